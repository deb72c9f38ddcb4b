"""The response cache: a rerun pays for nothing it already asked.

It is a table in the catalog's database (the SQLite file under the warehouse by default,
PostgreSQL in production), so every worker of a cluster shares it and it travels with
the warehouse. The key is the hash of everything that decides an answer: the model, the
template and its version, the messages (images by hash), how the images were shown
(and by which OCR), and the sampling parameters.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import sqlalchemy as sa

from trajforge.llm.calls import Completion, Sampling
from trajforge.llm.messages import Message, key_material

KEY_FORMAT = 1  # bump when the key's material changes shape, so old rows are never misread

_meta = sa.MetaData()

responses = sa.Table(
    "trajforge_llm_responses",
    _meta,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("model_id", sa.Text, nullable=False),
    sa.Column("template", sa.String(200), nullable=False),
    sa.Column("template_version", sa.String(40), nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("finish_reason", sa.String(40), nullable=False),
    sa.Column("tokens_in", sa.Integer),
    sa.Column("tokens_out", sa.Integer),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)


def cache_key(
    model_id: str, template: str, version: str, messages: list[Message], sampling: Sampling, observation: str,
    constraint: str | None = None,
) -> str:
    """The sha256 of the request's canonical JSON (`observation` says how images were shown; `constraint`
    names what held the answer while decoding: the grammar's hash, `json_schema:` before it where the server was
    sent the JSON schema; absent for free decoding so older keys still hold)."""
    material: dict[str, object] = {
        "format": KEY_FORMAT,
        "model_id": model_id,
        "template": template,
        "version": version,
        "messages": key_material(messages),
        "observation": observation,
        "sampling": sampling.model_dump(mode="json"),
    } | ({"constraint": constraint} if constraint is not None else {})
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ResponseCache:
    """Answers by key; an answer is stored once, whichever worker asked first."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)
        _meta.create_all(self.engine)

    def get(self, key: str) -> Completion | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(responses).where(responses.c.key == key)).first()
        if row is None:
            return None
        return Completion(row.text, row.finish_reason, row.tokens_in, row.tokens_out, attempts=0)

    def put(self, key: str, model_id: str, template: str, version: str, answer: Completion) -> None:
        row = dict(
            key=key,
            model_id=model_id,
            template=template,
            template_version=version,
            text=answer.text,
            finish_reason=answer.finish_reason,
            tokens_in=answer.tokens_in,
            tokens_out=answer.tokens_out,
            created_at=datetime.now(timezone.utc),
        )
        try:
            with self.engine.begin() as conn:
                conn.execute(responses.insert().values(**row))
        except sa.exc.IntegrityError:
            pass  # another worker stored the same request meanwhile; its answer stands

    def forget(self, before: datetime, *, dry_run: bool = False) -> int:
        """Remove the answers stored before `before` (UTC), so the table does not grow with every night; a rerun
        of a stage that asked them asks the model again. How many went, or would go in a dry run."""
        old = responses.c.created_at < before
        with self.engine.begin() as conn:
            if dry_run:
                return conn.execute(sa.select(sa.func.count()).select_from(responses).where(old)).scalar_one()
            return conn.execute(responses.delete().where(old)).rowcount

    def close(self) -> None:
        self.engine.dispose()

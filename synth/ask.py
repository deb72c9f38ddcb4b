"""The model calls of a synthesis shard: one versioned prompt per call, the raw answer kept beside the parsed one.

Every synthesis stage asks its model the same way: render a prompt from its room's
`prompts/` folder, optionally with a seed (a second sample of the same question is a
second cache entry), optionally held to a JSON schema while decoding. A call that gets no
answer is an `Answer` with its error, never an exception: the stage records the failure
in its row and goes on (the OpenCUA rule: parse strictly, record the failure, never guess).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from trajforge.llm import GatewayError, Sampling, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.schemas.stage import StageOutput

PROMPTS = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class Answer:
    """What one call gave: the raw text, the parsed value (None without a schema or when it did not parse), the
    parse or transport error, the model, and `name@version` of the prompt."""

    text: str
    parsed: Any
    error: str | None
    model_id: str
    prompt: str
    finish_reason: str | None = None
    """Why decoding stopped ("length": at the prompt's max_tokens, the text cut off)."""


class Asker:
    """A shard's model calls for the prompts `names` (loaded once), recording models and prompt versions in `out`."""

    def __init__(self, ws: Workspace, out: StageOutput, names: tuple[str, ...], *, model: str | None = None,
                 role: str = "synth", prompts: Path = PROMPTS) -> None:
        self.ws, self.out, self.model, self.role = ws, out, model, role
        self.prompts = {name: load_prompt(name, prompts) for name in names}

    def version(self, name: str) -> str:
        """`name@version`, recorded in the stage's lineage."""
        self.out.prompts[name] = self.prompts[name].version
        return f"{name}@{self.prompts[name].version}"

    def ask(self, name: str, *, seed: int | None = None, temperature: float | None = None,
            schema: type[BaseModel] | None = None, json_schema: dict[str, Any] | None = None, reask: bool = True,
            **variables: Any) -> Answer:
        """Ask prompt `name` rendered with `variables`; `seed`/`temperature` override the prompt's sampling;
        `reask=False` keeps an unparsable first answer as it is (llm.reask is not tried)."""
        rendered = self.prompts[name].render(**variables)
        base = rendered.sampling
        sampling = None
        if seed is not None or temperature is not None:
            sampling = Sampling(temperature=base.temperature if temperature is None else temperature,
                                top_p=base.top_p, max_tokens=base.max_tokens, seed=seed, stop=base.stop)
        version = self.version(name)
        try:
            result = self.ws.gateway.chat_sync(rendered, model=self.model, sampling=sampling, schema=schema,
                                               json_schema=json_schema, reask=reask)
        except GatewayError as exc:
            return Answer("", None, f"no answer: {exc.record.error}", exc.record.model_id, version)
        self.out.models[self.role] = result.record.model_id
        return Answer(result.text, result.parsed, result.parse_error, result.record.model_id, version,
                      result.record.finish_reason)

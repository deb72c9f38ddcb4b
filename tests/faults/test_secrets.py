"""Secrets: a night that signs in to Harbor ID (the bundled account app) with a sentinel password, its catalog on
PostgreSQL under a sentinel password and its instructions written by an endpoint under a sentinel API key. No
sentinel may be in any table version, snapshot property, catalog or cache row, log line, Prefect record, report or
export. The scan is shown to see content (the user name it finds) and the password to have been typed for real
(the app accepts only the right one; it keeps its SHA-256)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa
from conftest import require
from fault_bench import cli_env, cli_path
from test_apps import ACCOUNT_PASSWORD
from test_llm_models import SMOLLM2_ID, served

from trajforge.llm.local import missing_models
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.browser]

API_KEY = f"sk-S3NT1NEL-{uuid.uuid4().hex[:12]}"
PG_PASSWORD = f"S3NT1NEL-pg-{uuid.uuid4().hex[:12]}"

CONFIG = """\
warehouse:
  catalog_url: postgresql+psycopg://postgres:{pg_password}@127.0.0.1:5432/test
  namespace: {namespace}
query_gen:
  apps: [account]
  num_queries: 2
  deep_search_apps: []
  instructions: model
rollout:
  policy: replay
critics:
  step_critic: rules
  text_channel: false
synth:
  writer: template
llm:
  default: remote
  endpoints:
    remote: {{base_url: "{url}", model: {model}, api_key: "{api_key}"}}
"""


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded model served over HTTP: the remote server the API key is sent to."""
    require(missing_models() is None, str(missing_models()))
    with served("--model", "smollm2", log=tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def trajforge(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Without the suite's shared Prefect server: the night's own temporary server keeps its database (every
    # log line and state message) under the night's folder, which the test reads.
    env = {k: v for k, v in cli_env(cwd).items() if k != "PREFECT_API_URL"}
    env |= {"TRAJFORGE_SECRET_ACCOUNT_PASSWORD": ACCOUNT_PASSWORD}
    proc = subprocess.run([cli_path(), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, f"trajforge {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def found_in(texts: dict[str, str], needle: str) -> list[str]:
    return sorted(where for where, text in texts.items() if needle in text)


def test_a_night_that_types_a_password_leaks_no_secret(tmp_path: Path, postgres_url: str, endpoint: str) -> None:
    namespace = f"secrets_{uuid.uuid4().hex[:8]}"
    (tmp_path / "trajforge.yaml").write_text(CONFIG.format(pg_password=PG_PASSWORD, namespace=namespace,
                                                          url=endpoint, model=SMOLLM2_ID, api_key=API_KEY))
    texts: dict[str, str] = {}  # where -> what was read there
    night = trajforge(tmp_path, "run", "nightly")
    texts["run nightly: stdout and stderr"] = night.stdout + night.stderr
    report = trajforge(tmp_path, "report")
    texts["report"] = report.stdout + report.stderr
    exported = trajforge(tmp_path, "export", "train_e2e@latest", "--format", "ms-swift", "--out", "export")
    texts["export: output"] = exported.stdout + exported.stderr

    settings = Settings(warehouse={"path": tmp_path / "data" / "warehouse",
                                   "catalog_url": f"{postgres_url}", "namespace": namespace})
    ws = Workspace.open(settings)
    try:
        for table in ws.catalog.tables():
            for info in ws.catalog.history(table):
                rows = ws.catalog.load(table, info.snapshot_id)
                texts[f"table {table} v{info.snapshot_id}"] = "\n".join(map(repr, rows.iter_rows()))  # bytes too
                lineage = info.lineage.model_dump_json() if info.lineage else ""
                texts[f"table {table} v{info.snapshot_id}: snapshot properties"] = lineage
        page_graph = ws.catalog.load("queries").filter(pl.col("source") == "page_graph")["query_id"].to_list()
        episodes = ws.catalog.load("episodes").filter(pl.col("query_id").is_in(page_graph))  # each signs in first
        verdicts = ws.catalog.load("verdicts")
    finally:
        ws.catalog.close()
    engine = sa.create_engine(postgres_url)
    try:  # every row the run left in PostgreSQL: the catalog, the ledger, the response cache
        with engine.connect() as conn:
            names = conn.execute(sa.text("SELECT table_schema, table_name FROM information_schema.tables "
                                         "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')")).all()
            for schema, name in names:
                rows = conn.execute(sa.text(f'SELECT * FROM "{schema}"."{name}"')).all()
                texts[f"postgres {schema}.{name}"] = "\n".join(map(str, rows))
    finally:
        engine.dispose()
    for path in tmp_path.rglob("*"):  # logs, Prefect's database, blobs, the export, the config itself aside
        if path.is_file() and path.name != "trajforge.yaml":
            texts[f"file {path.relative_to(tmp_path)}"] = path.read_bytes().decode("latin-1")

    assert found_in(texts, "alice"), "the scan reads no content: the user name typed in every task is nowhere"
    assert len(episodes) and all('"signed_in": "alice"' in s for s in episodes["final_state_json"]), (
        "the replays did not sign in: the password was not typed as its value")
    assert len(verdicts) and any(verdicts["success"]), "no episode of the night was judged a success"
    for sentinel, what in ((ACCOUNT_PASSWORD, "the typed password"), (API_KEY, "the API key"),
                           (PG_PASSWORD, "the PostgreSQL password")):
        assert not found_in(texts, sentinel), f"{what} leaked into {found_in(texts, sentinel)}"

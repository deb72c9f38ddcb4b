"""Two runs started at once on one warehouse: the second stops at once with a message naming the first, writes
nothing, and the first finishes as if alone (no interleaved commits). A crashed run leaves nothing held."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from fault_bench import cli_env

from trajforge.data.catalog import Catalog
from trajforge.data.ledger import Ledger

CONFIG = """\
query_gen:
  apps: [notes]
  num_queries: 2
  atomic_per_app: 0
  deep_search_apps: []
{catalog}"""


def start(exe: str, cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([exe, *args], cwd=cwd, env=cli_env(cwd), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until_running(proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until the run has said it started: it holds the warehouse from before it opens its run."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(("starting run", "resuming run")):
            return
        assert line or proc.poll() is None, proc.communicate()
    raise AssertionError("the first run never started")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def warehouse(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Catalog, Ledger]:
    """A config and the catalog and ledger it names (SQLite in the warehouse, or a namespace of its own in
    the test PostgreSQL)."""
    line = ""
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
        line = f"warehouse:\n  catalog_url: {url}\n  namespace: t{uuid.uuid4().hex[:12]}\n"
    (tmp_path / "trajforge.yaml").write_text(CONFIG.format(catalog=line))
    from trajforge.schemas.config import load_settings

    settings = load_settings(tmp_path / "trajforge.yaml")
    settings.warehouse.path = tmp_path / settings.warehouse.path
    catalog = Catalog.from_settings(settings.warehouse)
    return tmp_path, catalog, Ledger(catalog.uri, scope=f"{catalog.iceberg.name}/{catalog.namespace}")


def test_a_second_run_stops_naming_the_first_and_writes_nothing(warehouse, trajforge_cli) -> None:
    cwd, catalog, _ = warehouse
    first = start(trajforge_cli, cwd, "run", "query_gen")
    try:
        wait_until_running(first)
        # Held still while the second starts: with the suite's Prefect server already up, the first (two
        # queries) could finish before the second had imported itself (CI saw the second run a whole night).
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None, "the first run ended before the second started"
        second = start(trajforge_cli, cwd, "run", "nightly")
        try:
            out, err = second.communicate(timeout=120)
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 1, out + err
        assert "starting run" not in out
        assert "another run is writing to this warehouse" in err and len(err.strip().splitlines()) == 1, err
        if catalog.uri.startswith("sqlite"):
            assert f"pid {first.pid}" in err  # the holder, by its process
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, out + err
    finally:
        first.kill()
    (info,) = catalog.history("queries")  # one version: the first run's, nothing of the second's
    assert info.stage == "query_gen"


def test_a_killed_run_leaves_the_warehouse_free(warehouse, trajforge_cli) -> None:
    cwd, _, ledger = warehouse
    first = start(trajforge_cli, cwd, "run", "query_gen")
    wait_until_running(first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    with ledger.writing("query_gen"):  # taken at once: the kill released it
        pass

"""The nightly on a real Dask cluster (`runner.engine: dask`): a scheduler and two workers, each a process of
its own started with the `dask` CLI as a user starts them, the catalog on PostgreSQL. The night must equal the
thread runner's (the session's shared replay night), and a worker SIGKILLed while a stage's shards run must
cost no row and duplicate none once the night is rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_bench import CONFIG, cli_env, compare  # the benchmark owns the comparison

from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings, WarehouseSettings

# The suite's 600 s counts fixture setup too: a Dask cluster, maybe the shared replay night, then a night of its own.
pytestmark = [pytest.mark.postgres, pytest.mark.browser, pytest.mark.timeout(1800)]

DASK = str(Path(sys.executable).with_name("dask"))


@dataclass
class Cluster:
    address: str
    workers: dict[str, subprocess.Popen[bytes]]
    """Worker name -> its `dask worker` process (the nanny and the worker process, in a session of their own)."""


def _start_worker(scheduler_file: Path, name: str, folder: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [DASK, "worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1", "--no-dashboard",
         "--name", name], cwd=folder, env=cli_env(folder), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=(folder / f"{name}.log").open("wb"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A Dask scheduler and two workers; the workers start in a folder of their own, not the night's."""
    from distributed import Client

    folder = tmp_path_factory.mktemp("dask")
    scheduler_file = folder / "scheduler.json"
    scheduler = subprocess.Popen(
        [DASK, "scheduler", "--scheduler-file", str(scheduler_file), "--port", "0", "--no-dashboard"],
        cwd=folder, env=cli_env(folder), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=(folder / "scheduler.log").open("wb"))
    workers: dict[str, subprocess.Popen[bytes]] = {}
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = {name: _start_worker(scheduler_file, name, folder) for name in ("w0", "w1")}
        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            address = client.scheduler.address
        yield Cluster(address, workers)
    finally:
        for proc in [*workers.values(), scheduler]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _night_folder(folder: Path, postgres_url: str, address: str) -> WarehouseSettings:
    """A replay night's folder whose shards go to the cluster and whose catalog is a fresh PostgreSQL
    namespace; returns where its warehouse is, for the comparison."""
    namespace = f"dask{uuid.uuid4().hex[:10]}"
    (folder / "trajforge.yaml").write_text(
        f"{CONFIG}\nwarehouse:\n  catalog_url: {postgres_url}\n  namespace: {namespace}\n"
        f"runner:\n  engine: dask\n  dask_address: {address}\n")
    return WarehouseSettings(path=folder / "data" / "warehouse", catalog_url=postgres_url, namespace=namespace)


def _night(exe: str, folder: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """`trajforge run nightly` in `folder`, its output to a file (a pipe nobody reads would stall it)."""
    log = folder / f"night-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([exe, "run", "nightly"], cwd=folder, env=cli_env(folder), start_new_session=True,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, log


def _finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    proc.wait(timeout=1200)
    return log.read_text(errors="replace")


def _assert_equal_nights(reference: Path, folder: Path, warehouse: WarehouseSettings) -> None:
    got = compare(reference, folder, warehouse)
    differing = {t: rows for t, rows in got.tables.items() if rows[0] != rows[1]}
    assert (got.lost, got.duplicated, got.false_failures) == (0, 0, 0), differing


def test_a_night_on_two_dask_workers_equals_the_thread_runners(postgres_url, cluster, replay_night,
                                                               trajforge_cli, tmp_path) -> None:
    from distributed import Client, get_task_stream

    reference, _ = replay_night
    warehouse = _night_folder(tmp_path, postgres_url, cluster.address)
    with Client(cluster.address, timeout=60) as client, get_task_stream(client) as stream:
        proc, log = _night(trajforge_cli, tmp_path)
        out = _finish(proc, log)
    assert proc.returncode == 0, out[-4000:]
    assert f"Connecting to an existing Dask cluster at {cluster.address}" in out
    # The scheduler's record of every task the night's client sent: the shards ran on both workers, not one.
    assert len({task["worker"] for task in stream.data}) == 2, stream.data
    _assert_equal_nights(reference, tmp_path, warehouse)


def test_a_worker_killed_mid_stage_then_rerun_loses_and_duplicates_nothing(postgres_url, cluster, replay_night,
                                                                            trajforge_cli, tmp_path) -> None:
    from distributed import Client

    reference, _ = replay_night
    warehouse = _night_folder(tmp_path, postgres_url, cluster.address)
    ws = Workspace.open(Settings(warehouse=warehouse))
    proc, log = _night(trajforge_cli, tmp_path)
    run_id = None
    while run_id is None and proc.poll() is None:
        started = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("starting run")]
        run_id = started[0].split()[-1] if started else None
        time.sleep(0.05)
    assert run_id is not None, log.read_text()[-3000:]
    killed = None
    with Client(cluster.address, timeout=60) as client:
        deadline = time.monotonic() + 900
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            done, total = ws.ledger.progress(run_id).get("rollout", (0, 0))
            busy = [info["name"] for addr, info in client.scheduler_info()["workers"].items()
                    if client.processing().get(addr)]
            if total and done < total and busy:
                os.killpg(cluster.workers[busy[0]].pid, signal.SIGKILL)  # the nanny and its worker
                killed = busy[0]
            time.sleep(0.05)
    out = _finish(proc, log)
    assert killed is not None, f"no rollout shard was seen running: {out[-3000:]}"
    runs = 1
    while proc.returncode != 0 and runs < 3:  # the night may fail the shard; a rerun resumes it
        proc, log = _night(trajforge_cli, tmp_path)
        out = _finish(proc, log)
        runs += 1
    assert proc.returncode == 0, out[-4000:]
    _assert_equal_nights(reference, tmp_path, warehouse)


def test_a_worker_opens_a_resumed_run_with_the_settings_its_shards_bring(tmp_path, monkeypatch) -> None:
    """A Dask worker outlives the command and kept the run's workspace by run id: a run stopped by an endpoint's
    timeout, resumed with the timeout raised (a resume: `RESUMED_ACROSS`), ran its shards with the first
    attempt's settings, so the fix never reached them on an existing cluster. Its first shard opens it in this
    process as a worker does."""
    from trajforge.flows.pipeline import run_identity
    from trajforge.tasks import prefect_tasks

    monkeypatch.setattr(prefect_tasks, "_WORKSPACES", {})  # this process's, as a fresh worker's
    endpoint = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout_s": 5}
    first = prefect_tasks.portable(Settings(warehouse={"path": tmp_path / "wh"}, llm={"endpoints": {"vllm": endpoint}}))
    fixed = prefect_tasks.portable(Settings(warehouse={"path": tmp_path / "wh"},
                                            llm={"endpoints": {"vllm": endpoint | {"timeout_s": 600}}}))
    assert run_identity("nightly", first) == run_identity("nightly", fixed)  # the rerun resumes the run
    ws = prefect_tasks._open("nightly-1", first)
    assert prefect_tasks._open("nightly-1", first) is ws  # its next shards keep what the worker opened
    assert prefect_tasks._open("nightly-1", fixed).settings.llm.endpoints["vllm"].timeout_s == 600

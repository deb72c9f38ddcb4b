"""`trajforge serve`: the nightly flow as a Prefect deployment on the configured schedule."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings

pytestmark = pytest.mark.browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture
def prefect_server(tmp_path):
    """A real Prefect server on loopback, with its own home."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    prefect = str(Path(sys.executable).parent / "prefect")
    proc = subprocess.Popen(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_for(lambda: healthy(url), 90, "the Prefect server")
        yield {**env, "PREFECT_API_URL": url}, prefect
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_registers_the_schedule_and_runs_the_nightly_flow(tmp_path, prefect_server, chromium, trajforge_cli):
    env, prefect = prefect_server
    (tmp_path / "trajforge.yaml").write_text(
        "query_gen:\n  apps: [shop]\n  num_queries: 2\n  atomic_per_app: 0\n  deep_search_apps: []\nrollout:\n  policy: replay\n"
        # Rule critics: this test is about the schedule and the served run; with the embedded model judging
        # every step (about 3.5 minutes on 2 cores) the run outlasted the watch on a busy machine.
        "critics:\n  step_critic: rules\n  text_channel: false\nsynth:\n  writer: template\n"
        "schedule:\n  cron: '30 3 * * *'\n  timezone: Europe/Paris\n"
    )
    serve = subprocess.Popen(  # in its own process group: the flow runs it starts must end with it
        [trajforge_cli, "serve"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        def registered() -> bool:
            out = subprocess.run([prefect, "deployment", "inspect", "nightly/nightly"], env=env,
                                 capture_output=True, text=True).stdout
            return "30 3 * * *" in out and "Europe/Paris" in out

        wait_for(registered, 90, "the nightly deployment with the configured cron")
        run = subprocess.run(
            [prefect, "deployment", "run", "nightly/nightly", "--watch", "--watch-timeout", "240"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "Completed" in run.stdout
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=30)
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "data" / "warehouse"}))
    assert ws.catalog.load("verdicts").height == 2
    assert [t for i in ws.catalog.history("episodes") for t in i.tags if t.startswith("nightly-")]

"""`trajforge serve`: the nightly flow as a Prefect deployment on the configured schedule."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PREFECT, running_prefect_server, wait_for

from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings

pytestmark = pytest.mark.browser


@pytest.fixture
def prefect_server(tmp_path):
    """A real Prefect server on loopback, with its own home."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    with running_prefect_server(env, 90) as url:
        yield {**env, "PREFECT_API_URL": url}, PREFECT


CONFIG = (
    "query_gen:\n  apps: [shop]\n  num_queries: 2\n  atomic_per_app: 0\n  deep_search_apps: []\nrollout:\n  policy: replay\n"
    # Rule critics: these tests are about the schedule and the served run; with the embedded model judging
    # every step (about 3.5 minutes on 2 cores) the run outlasted the watch on a busy machine.
    "critics:\n  step_critic: rules\n  text_channel: false\nsynth:\n  writer: template\n"
    "schedule:\n  cron: '30 3 * * *'\n  timezone: Europe/Paris\n"
)


def registered(prefect: str, env: dict[str, str]) -> str:
    """`prefect deployment inspect nightly/nightly` as the server shows it (empty before it exists)."""
    return subprocess.run([prefect, "deployment", "inspect", "nightly/nightly"], env=env, capture_output=True,
                          text=True, check=False).stdout


def run_deployment(prefect: str, env: dict[str, str]) -> None:
    run = subprocess.run(
        [prefect, "deployment", "run", "nightly/nightly", "--watch", "--watch-timeout", "240"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Completed" in run.stdout


def stop(proc: subprocess.Popen) -> None:
    """Ends a process started in its own group, with the flow runs it started."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def night_written(folder: Path) -> None:
    ws = Workspace.open(Settings(warehouse={"path": folder / "data" / "warehouse"}))
    assert ws.catalog.load("verdicts").height == 2
    assert [t for i in ws.catalog.history("episodes") for t in i.tags if t.startswith("nightly-")]


def test_serve_registers_the_schedule_and_runs_the_nightly_flow(tmp_path, prefect_server, chromium, trajforge_cli):
    env, prefect = prefect_server
    (tmp_path / "trajforge.yaml").write_text(CONFIG)
    serve = subprocess.Popen(  # in its own process group: the flow runs it starts must end with it
        [trajforge_cli, "serve"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: "30 3 * * *" in (shown := registered(prefect, env)) and "Europe/Paris" in shown, 90,
                 "the nightly deployment with the configured cron")
        run_deployment(prefect, env)
    finally:
        stop(serve)
    night_written(tmp_path)


def test_deploy_puts_the_nightly_on_a_process_pool_whose_worker_runs_it(tmp_path, prefect_server, chromium,
                                                                        trajforge_cli):
    env, prefect = prefect_server
    (tmp_path / "trajforge.yaml").write_text(CONFIG)
    deployed = subprocess.run([trajforge_cli, "deploy"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=False)
    assert deployed.returncode == 0, deployed.stderr
    assert "prefect worker start --pool trajforge" in deployed.stdout
    shown = registered(prefect, env)  # deploy returns once the server has it: no process of ours stays behind
    assert "30 3 * * *" in shown and "Europe/Paris" in shown and str(tmp_path) in shown
    assert "trajforge.flows.pipeline.nightly" in shown  # the installed package's flow: no code upload, no image
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", "trajforge"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        run_deployment(prefect, env)
    finally:
        stop(worker)
    night_written(tmp_path)


def test_deploy_gives_its_runs_the_config_it_read_and_this_shells_settings_but_no_secret(tmp_path, prefect_server,
                                                                                        trajforge_cli):
    """The worker runs in its own environment: the config deploy read through $TRAJFORGE_CONFIG is the flow's
    parameter (it was dropped: the nights ran on the defaults, into another warehouse), this shell's settings
    variables go with the deployment, and those that hold a secret are named, never stored on the server."""
    env, prefect = prefect_server
    (tmp_path / "prod.yaml").write_text(CONFIG)
    here = tmp_path / "here"  # no trajforge.yaml
    here.mkdir()
    sentinel = "S3NT1NEL-pw-5c2e"
    env = env | {"COLUMNS": "1000",  # `prefect deployment inspect` wraps a long path otherwise
                 "TRAJFORGE_CONFIG": str(tmp_path / "prod.yaml"), "TRAJFORGE_QUERY_GEN__NUM_QUERIES": "1",
                 "TRAJFORGE_SECRET_ACCOUNT_PASSWORD": sentinel,
                 "TRAJFORGE_SYNTH__OCR_CACHE_URL": f"sqlite:///{tmp_path}/{sentinel}.db"}
    deployed = subprocess.run([trajforge_cli, "deploy"], cwd=here, env=env, capture_output=True, text=True,
                              check=False)
    assert deployed.returncode == 0, deployed.stderr
    shown = registered(prefect, env)
    assert f"'config': '{tmp_path / 'prod.yaml'}'" in shown, shown  # the flow's parameter
    assert "'TRAJFORGE_QUERY_GEN__NUM_QUERIES': '1'" in shown and "30 3 * * *" in shown
    assert "TRAJFORGE_QUERY_GEN__NUM_QUERIES" in deployed.stdout
    assert ("TRAJFORGE_SECRET_ACCOUNT_PASSWORD, TRAJFORGE_SYNTH__OCR_CACHE_URL" in deployed.stderr
            and "set them where the worker runs" in deployed.stderr), deployed.stderr
    assert sentinel not in shown + deployed.stdout + deployed.stderr


@pytest.mark.parametrize("command", ["deploy", "serve"])
def test_without_a_prefect_server_deploy_and_serve_say_how_to_start_one(tmp_path, trajforge_cli, command):
    (tmp_path / "trajforge.yaml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([trajforge_cli, command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "prefect server start" in done.stderr and "PREFECT_API_URL" in done.stderr

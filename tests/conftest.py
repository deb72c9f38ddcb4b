"""Shared fixtures: real services, no mocks."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from trajforge.envs.apps import AppServer, BundledApp, load_app
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.llm import Gateway
from trajforge.llm.local import missing_models
from trajforge.llm.prompts import PACKAGE_ROOT, load_prompt
from trajforge.rollout.policy import PolicyOutput
from trajforge.schemas.config import LLMSettings
from trajforge.schemas.records import Query

# Prefect keeps its database under PREFECT_HOME; tests must not touch the user's, and each pytest-xdist worker
# has its own (a worker inherits the controller's environment, and two workers' temporary Prefect servers on one
# SQLite database would wait on each other's locks).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's pytest-xdist worker name (gw0, gw1, ...); None in a run without workers."""
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"trajforge-prefect-{WORKER or 'main'}-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)  # 6 MB a run, else left behind
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

CHROMIUM = Path("/usr/bin/chromium")


def prompt_version(name: str) -> str:
    """The version rows record for the shipped prompt `name` (its `version:`, `+`, a digest of its file): tests
    name it so, not as a literal "1", which an edit of the file changes."""
    (path,) = PACKAGE_ROOT.glob(f"*/prompts/{name}.yaml")
    return load_prompt(name, path.parent).version


def prompt_versions(*names: str) -> str:
    """`name@version` of each prompt, comma-separated, as a row's `prompt_version` names them."""
    return ",".join(f"{name}@{prompt_version(name)}" for name in names)


def require(condition: bool, reason: str) -> None:
    """Skip when a service is missing, or fail when CI says services must be there."""
    if condition:
        return
    if os.environ.get("TRAJFORGE_REQUIRE_SERVICES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium() -> Path:
    require(CHROMIUM.exists(), f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    return CHROMIUM


@pytest.fixture(scope="session")
def trajforge_cli() -> str:
    """The installed console script, as a user runs it."""
    exe = shutil.which("trajforge") or str(Path(os.sys.executable).parent / "trajforge")
    require(Path(exe).exists(), "the trajforge console script is not installed (pip install -e .)")
    return exe


SLOWEST_FIRST = ["test_pipeline.py", "test_dask.py", "test_model_rollout.py", "test_appdir.py", "test_query_corpus.py",
                 "test_llm_models.py", "test_train.py", "faults/test_kill_points.py", "test_query_synthesis.py",
                 "test_serve.py", "test_loop.py", "faults/test_disk_full.py", "test_synth.py", "faults/test_secrets.py",
                 "test_eval_critics.py"]
"""The files whose tests run whole nights or many browsers, longest first (measured 2026-11-27 on 2 cores with two
workers: test_pipeline 18 minutes, test_model_rollout 16, test_appdir 15, ... test_eval_critics 2.6). The README's
test command hands files to two pytest-xdist workers in collection order (`--dist loadfile`), so the long ones go
first: a long file handed out last would leave one worker alone at the end. The first two need no common night,
so neither worker starts by waiting for the other's replay night."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(here).as_posix(), len(rank)))


BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the fault tests share the fault bench's harness (fault_bench.py)

REPLAY_NIGHT_CONFIG = (BENCHMARKS / "replay_night.yaml").read_text()
"""The night the fault bench runs too, so its figures and the tests' describe one night."""


PREFECT = str(Path(sys.executable).with_name("prefect"))


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


@contextmanager
def running_prefect_server(env: dict[str, str], timeout: float) -> Iterator[str]:
    """`prefect server start` on a free loopback port with `env`, healthy; yields its API URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_for(lambda: healthy(url), timeout, "the Prefect server")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[None]:
    """One Prefect server per pytest-xdist worker, which every night its tests run reports to (PREFECT_API_URL,
    passed on to each `trajforge` process): without one, each `trajforge run` starts a temporary server of its own,
    about 20 s a run on a busy 2-core machine, and the suite makes some forty runs. A user's own
    PREFECT_API_URL is used as it is."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    with running_prefect_server(dict(os.environ), 180) as url:
        os.environ["PREFECT_API_URL"] = url
        try:
            yield
        finally:
            del os.environ["PREFECT_API_URL"]


@pytest.fixture(scope="session", autouse=True)
def shared_ocr_cache(tmp_path_factory) -> None:
    """Every night of the run, on either pytest-xdist worker, keeps its OCR readings in one database
    (`synth.ocr_cache_url`, which changes no row): most nights show the same screens of the bundled apps, and
    reading them was about half of a replay night on a busy machine (116 s of a 254 s Dask night)."""
    from filelock import FileLock

    from trajforge.llm.ocr import OcrReader

    folder = tmp_path_factory.getbasetemp() if WORKER is None else tmp_path_factory.getbasetemp().parent
    url = os.environ.setdefault("TRAJFORGE_SYNTH__OCR_CACHE_URL", f"sqlite:///{folder / 'ocr.db'}?timeout=60")
    with FileLock(folder / "ocr.lock"):
        OcrReader(db_url=url)  # its table, created once before any night's process races to create it


@pytest.fixture(scope="session")
def replay_night(tmp_path_factory, chromium, trajforge_cli) -> tuple[Path, str]:
    """One real night on the shop app with the replay policy (every trajectory accepted, so every
    training table of the night has rows), shared by the tests that read a night's output, one night
    for the whole run, pytest-xdist workers included: its folder (trajforge.yaml inside) and its tag."""
    from filelock import FileLock
    from test_pipeline import cli, workspace

    if WORKER is None:
        cwd = tmp_path_factory.mktemp("replay-night")
    else:  # the workers' session temporary folders share a parent: the first worker to get here runs the night
        cwd = tmp_path_factory.getbasetemp().parent / "replay-night"
    with FileLock(cwd.with_suffix(".lock")):
        done = cwd / "night.tag"  # written once the night finished; a worker whose night failed leaves none
        if not done.exists():
            cwd.mkdir(exist_ok=True)
            (cwd / "trajforge.yaml").write_text(REPLAY_NIGHT_CONFIG)
            cli(trajforge_cli, cwd, "run", "nightly")
            (tag,) = [t for t in workspace(cwd).catalog.history("train_e2e")[-1].tags if t.startswith("nightly-")]
            done.write_text(tag)
    return cwd, done.read_text()


POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test PostgreSQL as a SQLAlchemy URL; skips without it unless services are required.

    CI sets TRAJFORGE_REQUIRE_SERVICES=1 so that a missing database fails instead of
    silently skipping the tests that matter most for production.
    """
    import psycopg

    try:
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        require(False, f"PostgreSQL not reachable at 127.0.0.1:5432: {exc}")
    return POSTGRES_URL


@pytest.fixture(scope="module")
def shop() -> BundledApp:
    return load_app("shop")


@pytest.fixture(scope="module")
def server(shop: BundledApp) -> Iterator[AppServer]:
    """The shop served on loopback, as rollouts use it."""
    with AppServer(shop) as srv:
        yield srv



@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    """The embedded model behind a gateway with no cache and no re-ask: every answer is a real model call."""
    reason = missing_models()
    require(reason is None, str(reason))
    with Gateway(LLMSettings(reask=0)) as gw:
        yield gw

class ScriptedPolicy:
    """Plays a fixed list of actions, repeating the last: the smallest real policy, for
    tests of the episode recorder and the critics."""

    name = model_id = "scripted"
    prompt_version = "none"

    def __init__(self, script: list[dict[str, Any]]) -> None:
        self.script = script
        self.i = 0

    def reset(self, query: Query) -> None:
        self.i = 0

    def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput:
        action = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        return PolicyOutput(action, "scripted", json.dumps(action))

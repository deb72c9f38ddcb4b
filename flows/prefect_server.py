"""The temporary Prefect server of one `trajforge run`, started at the command's first line.

Without PREFECT_API_URL, Prefect starts a temporary server itself when the first flow runs: it imports its
server module into the calling process (about 2 s on 2 cores), starts the server's process and waits for
it (about 3-5 s, the server importing the same module), and only then runs the flow. A `trajforge run
grounding` with nothing to do took 13 s, 11 of them start-up. Started here, before the CLI imports
anything heavy, the server's start overlaps the CLI's own imports (about 4 s), and the CLI never imports
Prefect's server module.

The server is the one Prefect's `SubprocessASGIServer` (prefect 3.8, which pyproject pins) starts: uvicorn on
Prefect's app factory with the flags that make it a temporary server (no UI, none of the services a
standing server runs for schedules), in the same PREFECT_HOME, so its database is the one Prefect's own
temporary server would have used. It stops with the command; on Linux it is also told to stop if the
command is killed (SIGKILL leaves no orphan server holding its database).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

_SERVER_FLAGS = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
"""What `SubprocessASGIServer._run_uvicorn_command` sets for its server process (prefect 3.8)."""

_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception): ")
"""A traceback's last line: `ConnectionRefusedError: [Errno 111] ...`."""


class ServerError(RuntimeError):
    """The temporary server did not answer: its process exited or missed the start-up limit."""


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
"""Looked up here, not in the forked child, which should only call it."""


def _die_with_parent() -> None:
    """In the server's process before it runs: Linux sends it SIGTERM when the command's process dies."""
    assert _prctl is not None
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class TemporaryServer:
    """One Prefect API server process on a free loopback port, for as long as one command runs."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._log = tempfile.TemporaryFile()  # the server's own output, shown only when it fails to start
        self._ready = False
        self._process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **_SERVER_FLAGS}, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            preexec_fn=_die_with_parent if _prctl is not None else None,
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Until the server answers `/health`; raises ServerError (with why, from its output) when its process
        exits first or `timeout_s` passes. The first start in a new PREFECT_HOME migrates its database first."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            if self._process.poll() is not None:
                raise ServerError(f"the temporary Prefect server exited with status {self._process.returncode} "
                                  f"before it answered: {self._output()}")
            if time.monotonic() > deadline:
                raise ServerError(f"the temporary Prefect server did not answer within {timeout_s:.0f} s "
                                  f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS): {self._output()}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    self._ready = response.status == 200
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and wait for its process."""
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def _output(self) -> str:
        """Why the server failed, in one line: the last exception its output names (a failed start prints a
        traceback), else its last line."""
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
        return (errors or lines or ["(it printed nothing)"])[-1]


_STARTED: TemporaryServer | None = None
"""The server this process started for its command, if it did."""


def _profile_api_url() -> str | None:
    """The PREFECT_API_URL of Prefect's active profile, where `prefect config set PREFECT_API_URL=...` puts it,
    found as Prefect finds it (prefect 3.8, `prefect.settings.sources`): the profiles file $PREFECT_PROFILES_PATH,
    else $PREFECT_HOME/profiles.toml (default ~/.prefect/profiles.toml); the profile $PREFECT_PROFILE names, else
    the file's `active`. Read here, not through Prefect, whose import would cost the time the early start saves."""
    home = Path(os.environ["PREFECT_HOME"]) if os.environ.get("PREFECT_HOME") else Path.home() / ".prefect"
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):  # none yet, or one Prefect itself warns about
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active")
    return profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL") or None


def start_for(argv: list[str]) -> TemporaryServer | None:
    """Start a temporary server when the command is a `run` and no Prefect server is configured (PREFECT_API_URL,
    in the environment or the active Prefect profile), and point this process and every process it starts (Dask
    workers) at it: Prefect reads PREFECT_API_URL when it is imported, which the CLI does later."""
    global _STARTED
    if not argv or argv[0] != "run" or {"--help", "-h"} & set(argv) or os.environ.get("PREFECT_API_URL") \
            or _profile_api_url():
        return None
    _STARTED = TemporaryServer()
    os.environ["PREFECT_API_URL"] = _STARTED.api_url
    # Prefect would print a link to each flow run in its UI, which a temporary server does not serve.
    os.environ.setdefault("PREFECT_UI_URL", "")
    return _STARTED


def wait_ready() -> None:
    """Before a command's first flow: until the server this process started answers (nothing to wait for when
    it started none), as long as Prefect would wait for its own (set in trajforge.flows). Raises ServerError."""
    if _STARTED is not None:
        _STARTED.wait_ready(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))


def main() -> None:
    """The `trajforge` command: its Prefect server starts first (when it needs one), then the CLI."""
    # The very last thing at exit: the interpreter's final garbage collection walked every object the command
    # had made (Prefect's, pydantic's, the stages') and took about 1 s of a 7 s `trajforge run`; frozen, the
    # process ends in about 0.1 s. Nothing is lost: every table is committed and every file closed by then.
    atexit.register(gc.freeze)
    if (server := start_for(sys.argv[1:])) is not None:
        # At exit, after Prefect's own exit handlers (registered later, so run earlier) have sent the last logs
        # and events to it: stopped before them, they spent 3 s failing to connect.
        atexit.register(server.stop)
    from trajforge.flows.cli import app

    app()


"""scripts/install.sh and .ci/run, run in a copy of the repository with stand-ins for apt-get, the Pythons and the
suite: which .venv install.sh keeps, makes again or refuses, what it asks apt for, and how CI answers a failed build
of .venv-sam. The stand-in venv records pip's installs instead of making them (the real ones take minutes and
gigabytes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}")
    path.chmod(0o755)
    return path


def _python(path: Path, version: str = "3.11", ensurepip: bool = True) -> Path:
    """A stand-in interpreter. `-m venv DIR` makes DIR/bin/python, which logs `-m pip` calls to pip.log and hands
    the rest to the real interpreter. Version 3.11 hands its other calls to the real one too, but for `import
    ensurepip` where `ensurepip` is False (Debian's Python without its venv package); another version fails them."""
    _script(path.with_name("venv-python"), f'[ "$1" = -m ] && [ "$2" = pip ] && {{ echo "$*" >> pip.log; exit 0; }}\n'
            f'exec {sys.executable} "$@"\n')
    other = (f'exec {sys.executable} "$@"' if version == "3.11"
             else f'[ "$1" = --version ] && {{ echo "Python {version}.3"; exit 0; }}\nexit 1')
    return _script(path, f"""\
if [ "$1" = -m ] && [ "$2" = venv ]; then
  echo venv >> venv.log; mkdir -p "$3/bin"; cp {path.with_name("venv-python")} "$3/bin/python"; exit 0
fi
{'' if ensurepip else '[ "$2" = "import ensurepip" ] && exit 1'}
{other}
""")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the repository's install script, with apt-get, sudo, fc-list and python3 (a 3.12) stood in for."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _script(stubs / "apt-get", f'echo "$*" >> {tmp_path}/apt.log\n')
    _script(stubs / "sudo", 'exec "$@"\n')
    _script(stubs / "fc-list", "echo '/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf: DejaVu Sans:style=Book'\n")
    _python(stubs / "python3", version="3.12")
    return tmp_path


def _install(repo: Path, python: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{repo / 'stubs'}:{env['PATH']}"
    if python is not None:
        env["PYTHON"] = python
    return subprocess.run(["bash", "scripts/install.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_venv_without_pip_is_made_again_and_a_whole_one_kept(repo: Path) -> None:
    """`python3.11 -m venv` that failed at ensurepip leaves a .venv without pip: the next run makes it again rather
    than failing on it for ever; a whole .venv is kept, so a second run costs no new venv."""
    _python(repo / "stubs" / "python3.11")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", repo / ".venv"], check=True)
    first = _install(repo)
    assert first.returncode == 0, first.stderr
    assert _lines(repo / "venv.log") == ["venv"]
    assert len(_lines(repo / "pip.log")) == 5  # pip, torch, the project, the model, the labels
    second = _install(repo)
    assert second.returncode == 0, second.stderr
    assert _lines(repo / "venv.log") == ["venv"]
    assert not [line for line in _lines(repo / "apt.log") if "-venv" in line]  # this Python has ensurepip


@pytest.mark.parametrize(("python", "error"), [
    ("/nonexistent/python3.11", r"/nonexistent/python3.11 not found; install Python 3.11"),
    ("python3", r"python3 is Python 3.12.3, not Python 3.11 as pyproject.toml requires"),
])
def test_a_python_other_than_3_11_is_refused_with_what_to_install(repo: Path, python: str, error: str) -> None:
    """A missing python3.11 fell back to python3 (3.12 on newer systems), whose venv the project refuses."""
    out = _install(repo, python)
    assert out.returncode != 0
    assert error in out.stderr
    assert not (repo / ".venv").exists()


def test_debians_python_gets_its_venv_package(repo: Path) -> None:
    """Debian's python3.11 makes no venv without python3.11-venv (its ensurepip): apt is asked for it."""
    _python(repo / "stubs" / "python3.11", ensurepip=False)
    out = _install(repo)
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("install") and "python3.11-venv" in line.split() for line in _lines(repo / "apt.log"))


WAIT = f"""\
import os, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT / "tests")!r})
from test_regions import wait_for_environment
wait_for_environment(Path(os.environ["SAM_TEST_PYTHON"]), Path(os.environ["SAM_TEST_LOG"]))
"""
"""The suite as the SAM test sees it: its wait for .ci/run's build."""


@pytest.mark.timeout(180)
def test_a_failed_sam_build_fails_the_sam_test_at_once_with_the_builds_log(tmp_path: Path) -> None:
    """.ci/run builds .venv-sam while the suite runs. When the build fails (here python3.11 makes no venv, as Debian's
    without python3.11-venv), the SAM test fails with the build's log at once; it waited out 900 s."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci")
    (tmp_path / "scripts").mkdir()
    _script(tmp_path / "scripts" / "install.sh", "exit 0\n")
    (tmp_path / "stubs").mkdir()
    _script(tmp_path / "stubs" / "python3.11", "echo 'ensurepip is not available'; exit 1\n")
    (tmp_path / "wait.py").write_text(WAIT)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    _script(tmp_path / ".venv" / "bin" / "python", f"exec {sys.executable} {tmp_path / 'wait.py'}\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'stubs'}:{os.environ['PATH']}"}
    ci = subprocess.Popen(["bash", ".ci/run"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
    try:
        out = ci.communicate(timeout=120)[0]  # the wait's own limit is 900 s
    finally:
        with suppress(ProcessLookupError):
            os.killpg(ci.pid, signal.SIGKILL)  # the wait, where it outlived the limit
    assert ci.returncode != 0
    assert "its build failed; its build's log:" in out and "ensurepip is not available" in out, out[-3000:]

"""The CLI's habits, through the console script as a user runs it: stderr for errors, exit status 2 for usage
errors and 1 for failures at run time, --version, `config show`, a preflight that fails in seconds, and no
password on any output or log."""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

SENTINEL = "S3NT1NEL-pw-7f3a"


def run(exe: str, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in `cwd`, with its own Prefect home and none of the caller's TRAJFORGE_ variables."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAJFORGE_")}
    base |= {"COLUMNS": "200", "PREFECT_HOME": str(cwd / "prefect")}
    return subprocess.run([exe, *args], cwd=cwd, env=base | (env or {}), capture_output=True, text=True, timeout=300,
                          check=False)


def test_version(tmp_path: Path, trajforge_cli: str) -> None:
    proc = run(trajforge_cli, tmp_path, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"trajforge {version('trajforge')}"


def test_usage_error_exits_2_on_stderr_only(tmp_path: Path, trajforge_cli: str) -> None:
    proc = run(trajforge_cli, tmp_path, "run", "no-such-stage")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "unknown stage 'no-such-stage'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_show_gives_values_sources_and_masks_secrets(tmp_path: Path, trajforge_cli: str) -> None:
    (tmp_path / "trajforge.yaml").write_text(
        "query_gen:\n  num_queries: 3\n"
        f"warehouse:\n  catalog_url: postgresql+psycopg://user:{SENTINEL}@db.example:5432/x\n"
        "llm:\n  endpoints:\n    vllm:\n      base_url: http://127.0.0.1:9/v1\n      model: m\n"
        f"      api_key: key-{SENTINEL}\n"
    )
    proc = run(trajforge_cli, tmp_path, "config", "show", env={"TRAJFORGE_ROLLOUT__CONTEXTS": "5"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "num_queries: 3  # trajforge.yaml" in out
    assert "contexts: 5  # TRAJFORGE_ROLLOUT__CONTEXTS" in out
    assert "seed: 0  # default" in out
    assert 'catalog_url: "postgresql+psycopg://user:***@db.example:5432/x"  # trajforge.yaml' in out
    assert 'api_key: "**********"  # trajforge.yaml' in out
    assert SENTINEL not in out + proc.stderr


def test_preflight_names_the_unset_key_variable(tmp_path: Path, trajforge_cli: str) -> None:
    """A scheduled run whose endpoint key is missing fails before any work, naming the variable."""
    (tmp_path / "trajforge.yaml").write_text(
        "llm:\n  default: vllm\n  endpoints:\n    vllm:\n      base_url: http://127.0.0.1:9/v1\n      model: m\n"
        "      api_key_env: CLI_TEST_PROVIDER_KEY\n"
    )
    proc = run(trajforge_cli, tmp_path, "run", "nightly")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "environment variable CLI_TEST_PROVIDER_KEY is not set" in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(("demonstrations", "error"), [
    (None, "guidance.demonstrations: cannot read {path}: No such file or directory"),
    ('{"query_id": "q1", "instruction": "Open the cart", "steps": []}\n\n{"query_id": 3}\n',
     "guidance.demonstrations: {path}:3: field 'query_id': Input should be a valid string"),
    ('{"query_id": "q1", "instruction": "Open the cart", "steps": [{"action_type": "click"}]\n',
     "guidance.demonstrations: {path}:1: field '': Invalid JSON"),
])
def test_preflight_names_a_bad_demonstrations_file_and_line(tmp_path: Path, trajforge_cli: str,
                                                            demonstrations: str | None, error: str) -> None:
    """The guidance stage reads the demonstrations after query generation; the run refuses them before any work
    (a whole minute of a night, before this check)."""
    path = tmp_path / "demos.jsonl"
    if demonstrations is not None:
        path.write_text(demonstrations)
    (tmp_path / "trajforge.yaml").write_text(f"guidance:\n  demonstrations: {path}\n")
    proc = run(trajforge_cli, tmp_path, "run", "nightly")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: {error.format(path=path)}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "data").exists()


def test_view_of_an_unknown_run_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    proc = run(trajforge_cli, tmp_path, "view", "no-such-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.startswith("error:")


def test_export_of_an_unknown_format_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    pytest.importorskip("trajforge.synth.handoff")
    proc = run(trajforge_cli, tmp_path, "export", "train_e2e@latest", "--format", "nope", "--out", "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown format 'nope'" in proc.stderr


def test_unreachable_catalog_fails_in_one_line_without_the_password(tmp_path: Path, trajforge_cli: str) -> None:
    """Nothing listens on port 1, so no database is needed: the password must appear on no output and in no file
    the commands wrote (Prefect's home, the warehouse)."""
    config = tmp_path / "trajforge.yaml"
    config.write_text(f"warehouse:\n  catalog_url: postgresql+psycopg://trajforge:{SENTINEL}@127.0.0.1:1/db\n")
    outputs = []
    for args in (("datasets", "list"), ("run", "nightly")):
        proc = run(trajforge_cli, tmp_path, *args)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stdout == ""
        assert "catalog database is unreachable" in proc.stderr and "Connection refused" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        outputs.append(proc.stdout + proc.stderr)
    shown = run(trajforge_cli, tmp_path, "config", "show")
    assert shown.returncode == 0 and "trajforge:***@127.0.0.1:1/db" in shown.stdout
    outputs.append(shown.stdout + shown.stderr)
    for output in outputs:
        assert SENTINEL not in output
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != config]
    leaked = [p for p in written if SENTINEL.encode() in p.read_bytes()]
    assert not leaked, f"the password is in {leaked}"

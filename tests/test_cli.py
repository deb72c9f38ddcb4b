"""The CLI's habits, through the console script as a user runs it: stderr for errors, exit status 2 for usage
errors and 1 for failures at run time, --version, `config show`, a preflight that fails in seconds, and no
password on any output or log."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest
from fault_bench import cli_env
from test_catalog import lineage, query_row

from trajforge.data.catalog import Catalog
from trajforge.flows.stages import stages

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


def test_the_command_starts_without_loading_the_catalog_the_models_or_the_stages(tmp_path: Path,
                                                                                trajforge_cli: str) -> None:
    """--help, --version and `config show` need none of them (about 3.5 s of imports on 2 cores); `run --help`
    still lists every stage, loaded when it is shown."""
    heavy = ("trajforge.data.catalog", "trajforge.flows.stages", "trajforge.llm", "openai", "pyiceberg", "polars",
             "prefect")
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, trajforge.flows.cli; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True, timeout=120)
    loaded = set(probe.stdout.split())
    assert not {m for m in loaded if m.startswith(heavy)}, "imported by the CLI's module at start"
    proc = run(trajforge_cli, tmp_path, "run", "--help")
    assert proc.returncode == 0, proc.stderr
    assert all(re.search(rf"\b{name}\b", proc.stdout) for name in stages()), proc.stdout


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


def test_config_show_names_the_variables_that_give_a_mappings_keys(tmp_path: Path, trajforge_cli: str) -> None:
    """A variable one level below a mapping setting gives one of its keys, merged with the file's keys: both are
    named, not `default` (the variable was not looked for)."""
    (tmp_path / "trajforge.yaml").write_text("loop:\n  models:\n    0: base\n")
    proc = run(trajforge_cli, tmp_path, "config", "show", env={"TRAJFORGE_LOOP__MODELS__1": "foo"})
    assert proc.returncode == 0, proc.stderr
    assert 'models: {"0": "base", "1": "foo"}  # trajforge.yaml, TRAJFORGE_LOOP__MODELS__1' in proc.stdout
    (tmp_path / "trajforge.yaml").unlink()
    proc = run(trajforge_cli, tmp_path, "config", "show", env={"TRAJFORGE_LOOP__MODELS__1": "foo"})
    assert 'models: {"1": "foo"}  # TRAJFORGE_LOOP__MODELS__1' in proc.stdout


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


def test_preflight_names_a_model_no_endpoint_answers(tmp_path: Path, trajforge_cli: str) -> None:
    """A misspelled model name fails before any work (it used to pass, and fail at the rollout after the crawl)."""
    (tmp_path / "trajforge.yaml").write_text("rollout:\n  policy: gui_owl_e2e\n  model: gpt4o\n")
    proc = run(trajforge_cli, tmp_path, "run", "nightly")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout.model: no model named 'gpt4o' (configured: local;" in proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(("config", "field"), [
    ("rollout:\n  policy: gui_owl_e2e\nloop:\n  models: {{0: {path}}}\n", "loop.models.0"),
    ("rollout:\n  policy: gui_owl_e2e\n  model: {path}\n", "rollout.model"),
])
def test_preflight_names_a_checkpoint_folder_that_is_not_one(tmp_path: Path, trajforge_cli: str, config: str,
                                                             field: str) -> None:
    """A model named by a folder's path that holds no checkpoint fails before any work, naming its setting (it used
    to pass, and fail at the rollout after query generation, guidance and references, naming llm.local.model)."""
    path = tmp_path / "ckpt-typo"
    (tmp_path / "trajforge.yaml").write_text(config.format(path=path))
    proc = run(trajforge_cli, tmp_path, "run", "nightly")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: {field}: {path} is not a transformers checkpoint folder (no config.json)\n"
    assert not (tmp_path / "data").exists()


def test_preflight_takes_a_checkpoint_folder_and_a_path_an_endpoint_serves(tmp_path: Path) -> None:
    """A folder with a checkpoint's config.json passes where the model packages are installed (and is refused,
    naming them, where not); ENDPOINT:/path is a model the endpoint's server loads, not a folder here."""
    from trajforge.flows.preflight import check_models
    from trajforge.llm.local import missing_models
    from trajforge.schemas.config import ConfigError, Settings

    def settings(model: str) -> Settings:
        endpoints = {"vllm": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}
        return Settings(rollout={"policy": "gui_owl_e2e", "model": model},
                        llm={"default": "vllm", "endpoints": endpoints})

    check_models(settings("vllm:/srv/no-such-ckpt"))
    (tmp_path / "config.json").write_text("{}")
    refused = pytest.raises(ConfigError, match="rollout.model: the in-process model")
    with refused if missing_models(embedded=False) else contextlib.nullcontext():
        check_models(settings(str(tmp_path)))


@pytest.mark.parametrize(("demonstrations", "error"), [
    (None, "guidance.demonstrations: cannot read {path}: No such file or directory"),
    ('{"query_id": "q1", "instruction": "Open the cart", "steps": []}\n\n{"query_id": 3}\n',
     "guidance.demonstrations: {path}:3: field 'query_id': Input should be a valid string"),
    ('{"query_id": "q1", "instruction": "Open the cart", "steps": [{"action_type": "click"}]\n',
     "guidance.demonstrations: {path}:1: not a JSON object: Invalid JSON"),
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


def test_apps_check_of_no_tasks_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    """`--queries 0` checked nothing and said every sampled task resolves."""
    app = Path(__file__).parents[1] / "examples" / "apps" / "jotter"
    proc = run(trajforge_cli, tmp_path, "apps", "check", str(app), "--queries", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "Invalid value for '--queries': Input should be greater than or equal to 1" in proc.stderr, proc.stderr


def test_view_of_an_unknown_run_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "view", "no-such-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.startswith("error:")


def test_a_table_with_no_version_names_the_stages_that_write_it(tmp_path: Path, trajforge_cli: str) -> None:
    """Before any night wrote it, `datasets show` and a stage whose input is empty say what to run, not an empty
    frame."""
    queries_warehouse(tmp_path)
    for args in (("datasets", "show", "steps"), ("run", "grounding")):
        proc = run(trajforge_cli, tmp_path, *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == "" and proc.stderr == (
            "error: table 'steps' has no version yet; `trajforge run reference` or `trajforge run rollout` writes it\n")


def test_datasets_list_before_any_night_says_so_and_creates_no_warehouse(tmp_path: Path, trajforge_cli: str) -> None:
    proc = run(trajforge_cli, tmp_path, "datasets", "list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"no tables yet in {tmp_path / 'data' / 'warehouse'}"
    assert not (tmp_path / "data").exists()


READING_COMMANDS = [
    ("report",), ("view",), ("eval", "critics"), ("checkpoints",), ("datasets", "history", "queries"),
    ("datasets", "show", "queries"), ("datasets", "diff", "queries", "latest", "latest"),
    ("datasets", "tag", "queries@latest", "best"), ("datasets", "expire", "--older-than", "30"),
    ("export", "train_e2e@latest", "--format", "hf", "--out", "out"),
]


@pytest.mark.parametrize("args", READING_COMMANDS, ids=" ".join)
def test_a_command_that_reads_refuses_where_no_night_made_the_warehouse_and_creates_none(
        args: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each made an empty warehouse (catalog.db, blobs) in the current folder, which `open_catalog()` in a notebook
    below it then found before the project's: now a usage error naming the folder it looked in, and nothing
    written. In process (typer's runner): a console script per command would cost seconds each."""
    from typer.testing import CliRunner

    from trajforge.flows.cli import app

    for name in list(os.environ):
        if name.upper().startswith("TRAJFORGE_") and name.upper() != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: no warehouse at {tmp_path.resolve() / 'data' / 'warehouse'} "), \
        result.stderr
    assert list(tmp_path.iterdir()) == [], "a read creates no warehouse"


def queries_warehouse(cwd: Path) -> None:
    """A warehouse at the default path under `cwd` whose queries table has one version of two rows."""
    with Catalog(cwd / "data" / "warehouse") as catalog:
        catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lineage("q"))


def test_a_config_elsewhere_has_its_warehouse_beside_it_as_in_a_notebook(tmp_path: Path, trajforge_cli: str) -> None:
    """`warehouse.path: store` in other/trajforge.yaml was ./store to the CLI and other/store to `open_catalog`: a
    night wrote one and the notebook read the other. Both take it from the file's folder, with --config or
    $TRAJFORGE_CONFIG, and `config show` gives the path the commands use."""
    from trajforge.data.notebook import open_catalog

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "trajforge.yaml").write_text("warehouse:\n  path: store\n")
    with Catalog(tmp_path / "other" / "store") as catalog:
        catalog.commit_rows("queries", [query_row("q1")], lineage("q"))
    proc = run(trajforge_cli, tmp_path, "datasets", "show", "queries", "--limit", "0", "-c", "other/trajforge.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": 1 rows," in proc.stdout
    shown = run(trajforge_cli, tmp_path, "config", "show", env={"TRAJFORGE_CONFIG": "other/trajforge.yaml"})
    store = tmp_path.resolve() / "other" / "store"  # made absolute, so it hashes the same however the file is named
    assert f'path: "{store}"  # other/trajforge.yaml' in shown.stdout, shown.stdout + shown.stderr
    with open_catalog(tmp_path / "other" / "trajforge.yaml") as catalog:
        assert catalog.warehouse == tmp_path / "other" / "store"
    assert not (tmp_path / "store").exists()


def test_expire_of_cached_answers_needs_no_model_and_says_what_it_removed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets expire --responses` built the model gateway to reach its cache, after the files were removed: an
    endpoint whose key variable is unset here (the worker's environment has it) failed the command with status 1,
    and what it had removed was never said. In process (typer's runner), as the reading commands above."""
    from datetime import datetime, timezone

    from typer.testing import CliRunner

    from trajforge.flows.cli import app
    from trajforge.llm.cache import ResponseCache, responses
    from trajforge.llm.calls import Completion

    for name in list(os.environ):
        if name.upper().startswith("TRAJFORGE_") and name.upper() != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    monkeypatch.delenv("CLI_TEST_PROVIDER_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trajforge.yaml").write_text(
        "llm:\n  endpoints:\n    vllm:\n      base_url: http://127.0.0.1:9/v1\n      model: m\n"
        "      api_key_env: CLI_TEST_PROVIDER_KEY\n")
    queries_warehouse(tmp_path)
    with Catalog(tmp_path / "data" / "warehouse") as catalog:
        orphan = catalog.data_dir("queries") / "orphan.parquet"  # no version references it
        cache = ResponseCache(catalog.uri)
    orphan.write_bytes(b"PAR1")
    os.utime(orphan, (0, 0))
    cache.put("f" * 64, "m", "judge", "1", Completion("an old answer", "stop", 1, 1))
    with cache.engine.begin() as conn:
        conn.execute(responses.update().values(created_at=datetime(1999, 1, 1, tzinfo=timezone.utc)))
    cache.close()
    result = CliRunner().invoke(app, ["datasets", "expire", "--older-than", "1", "--responses"])
    assert result.exit_code == 0, result.output
    assert "removed 1 data files" in result.stdout and "forgot 1 cached model answers" in result.stdout
    assert not orphan.exists()


def test_app_dir_makes_a_night_of_those_apps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run nightly --app-dir DIR` is "a night on your own app only", yet the config's MiniWoB++ and Android tasks
    stayed asked for, and their queries joined the night."""
    from trajforge.flows.cli import _use_app_dirs
    from trajforge.schemas.config import load_settings

    for name in list(os.environ):
        if name.upper().startswith("TRAJFORGE_") and name.upper() != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    for name in ("APP_DIRS", "APPS", "DEEP_SEARCH_APPS", "MINIWOB_TASKS", "ANDROID_TASKS"):
        monkeypatch.setenv(f"TRAJFORGE_QUERY_GEN__{name}", "")  # recorded as unset, so the test's end unsets it
        monkeypatch.delenv(f"TRAJFORGE_QUERY_GEN__{name}")
    config = tmp_path / "trajforge.yaml"
    config.write_text("query_gen:\n  apps: [shop]\n  miniwob_tasks: [click-test]\n  android_tasks:\n"
                      "    - {instruction: wifi off, start: com.android.settings/.Settings, probe: wifi, value: v}\n")
    _use_app_dirs([tmp_path / "mine"], [])
    query_gen = load_settings(config).query_gen
    assert query_gen.app_dirs == [(tmp_path / "mine").resolve()]
    assert (query_gen.apps, query_gen.miniwob_tasks, query_gen.android_tasks) == ([], [], [])


def test_datasets_show_with_limit_0_gives_the_columns_and_the_row_count(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "datasets", "show", "queries", "--limit", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": 2 rows," in proc.stdout and "columns: run_id (String), query_id (String)" in proc.stdout
    assert "no rows" not in proc.stdout


def test_datasets_diff_of_a_versioned_table_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "datasets", "diff", "queries@latest", "latest", "latest")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.startswith(
        "error: give the table as TABLE, not TABLE@VERSION: 'queries@latest'"), proc.stderr


def test_datasets_diff_of_a_table_with_no_version_says_what_writes_it(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "datasets", "diff", "steps", "latest", "latest")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == (
        "error: table 'steps' has no version yet; `trajforge run reference` or `trajforge run rollout` writes it\n")


def test_export_of_an_unknown_format_is_a_usage_error(tmp_path: Path, trajforge_cli: str) -> None:
    proc = run(trajforge_cli, tmp_path, "export", "train_e2e@latest", "--format", "nope", "--out", "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown format 'nope'" in proc.stderr


def test_export_of_an_unknown_table_names_the_known_ones(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "export", "nosuch@latest", "--format", "hf", "--out", "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "unknown table 'nosuch'; known tables: " in proc.stderr, proc.stderr
    assert "train_e2e" in proc.stderr and not (tmp_path / "out").exists()


def test_history_of_a_table_with_no_version_says_what_writes_it(tmp_path: Path, trajforge_cli: str) -> None:
    queries_warehouse(tmp_path)
    proc = run(trajforge_cli, tmp_path, "datasets", "history", "checkpoints")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == (
        "error: table 'checkpoints' has no version yet; `trajforge run train` writes it\n")


NIGHTS = ("nightly-20261206T223011-111111", "nightly-20261207T223011-446966")


def test_report_takes_the_nights_tag_and_an_unknown_one_lists_the_runs_with_a_report(tmp_path: Path,
                                                                                     trajforge_cli: str) -> None:
    """The report's first line gives the night's tag beside its run id: either finds the report. The tag names
    the run whose versions hold it now (a second night of the day moves it)."""
    reports = tmp_path / "data" / "warehouse" / "reports"
    with Catalog(tmp_path / "data" / "warehouse") as catalog:
        for run_id in NIGHTS:
            snapshot = catalog.commit_rows("queries", [query_row("q1", run_id=run_id)], lineage(run_id, run_id=run_id))
            catalog.tag("queries", snapshot, "nightly-2026-12-07")
    reports.mkdir()
    for run_id in NIGHTS:
        (reports / f"{run_id}.md").write_text(f"# trajforge run {run_id} (nightly-2026-12-07)\n")
    proc = run(trajforge_cli, tmp_path, "report", "nightly-2026-12-07")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"# trajforge run {NIGHTS[1]} (nightly-2026-12-07)" in proc.stdout
    proc = run(trajforge_cli, tmp_path, "report", "nightly-2026-12-08")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == (
        f"error: no report for run or tag 'nightly-2026-12-08' in {reports}; the runs with one, newest first: "
        f"{NIGHTS[1]}, {NIGHTS[0]}\n")


def test_the_runs_summary_counts_the_rows_every_stage_of_the_run_added(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """replay_buffer on a first night got 26 rows from the reference stage and none from guidance or history: the
    summary said 0, the last version's own count. A row of an earlier run is not the run's."""
    from trajforge.flows.cli import _summary
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.config import Settings

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    ws.catalog.commit_rows("queries", [query_row("q0", run_id="run-0")], lineage("a", run_id="run-0"))
    ws.catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lineage("b", "reference"))
    last = ws.catalog.commit_rows("queries", [], lineage("c", "history"))
    _summary(ws, {"queries": last}, "nightly-x", "run-1")
    row = next(line for line in capsys.readouterr().out.splitlines() if "queries" in line)
    assert re.findall(r"[^│\s]+", row) == ["queries", "2", "3", str(last), "nightly-x"], row


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


MINIWOB_QUERY = "query_gen:\n  apps: []\n  miniwob_tasks: [click-test]\n"
"""A query-generation run that needs no browser: one MiniWoB++ task's query."""


def serverless_env(cwd: Path, **extra: str) -> dict[str, str]:
    """The environment of a command in `cwd` (fault_bench.cli_env) with no Prefect server configured (not the
    suite's shared one)."""
    return {k: v for k, v in cli_env(cwd).items() if k != "PREFECT_API_URL"} | extra


def prefect_servers(home: Path) -> list[psutil.Process]:
    """The Prefect server processes running with `home` as their Prefect home."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "prefect.server.api.server:create_app" not in " ".join(proc.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PREFECT_HOME") == str(home):
                found.append(proc)
    return found


def test_a_run_takes_the_server_the_active_prefect_profile_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The README offers `prefect config set PREFECT_API_URL=...` for a standing server, yet `trajforge run` looked at
    the variable alone: it started a temporary server and pointed the night at it, not at the profile's server. The
    profiles file is the one Prefect's own command writes; a profile without a URL still gets a temporary server."""
    from types import SimpleNamespace

    from conftest import PREFECT

    from trajforge.flows import prefect_server

    started: list[str] = []
    monkeypatch.setattr(prefect_server, "_STARTED", None)  # and back to None after the test
    monkeypatch.setattr(prefect_server, "TemporaryServer",
                        lambda: started.append("server") or SimpleNamespace(api_url="http://127.0.0.1:1/api"))
    for name in ("PREFECT_API_URL", "PREFECT_UI_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.setenv(name, "")  # recorded as it was, so the test's end puts back what start_for changes
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path)}
    for args in (("config", "set", "PREFECT_API_URL=http://127.0.0.1:4999/api"), ("profile", "create", "bare")):
        subprocess.run([PREFECT, *args], env=env, capture_output=True, check=True, timeout=120)
    assert prefect_server.start_for(["run", "nightly"]) is None
    assert "PREFECT_API_URL" not in os.environ and started == []
    monkeypatch.setenv("PREFECT_PROFILE", "bare")
    assert prefect_server.start_for(["run", "nightly"]) is not None
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:1/api" and started == ["server"]


def test_a_run_without_a_prefect_server_reports_to_its_own_and_stops_it(tmp_path: Path, trajforge_cli: str) -> None:
    """Without PREFECT_API_URL the command starts a temporary server as it starts (flows.prefect_server): the
    flow run is recorded in that server's database, in the Prefect home, and no server outlives the command."""
    (tmp_path / "trajforge.yaml").write_text(MINIWOB_QUERY)
    proc = subprocess.run([trajforge_cli, "run", "query_gen"], cwd=tmp_path, env=serverless_env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "View at" not in proc.stdout + proc.stderr  # the temporary server serves no UI to link to
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        assert db.execute("SELECT name FROM flow WHERE name = 'stage-query-gen'").fetchall()
        assert db.execute("SELECT state_type FROM flow_run").fetchall() == [("COMPLETED",)]
    assert prefect_servers(tmp_path / "prefect") == []


def test_a_killed_run_leaves_no_prefect_server_behind(tmp_path: Path, trajforge_cli: str) -> None:
    """SIGKILL gives the command no chance to stop its temporary server: the server is told to stop when the
    command's process dies (Linux), so no orphan keeps its port and its database."""
    (tmp_path / "trajforge.yaml").write_text(MINIWOB_QUERY)
    home = tmp_path / "prefect"
    cli = subprocess.Popen([trajforge_cli, "run", "query_gen"], cwd=tmp_path, env=serverless_env(tmp_path),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (servers := prefect_servers(home)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers, "no temporary Prefect server started"
    finally:
        cli.kill()
        cli.wait()
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"the temporary server outlived its command: {alive}"


def test_a_temporary_server_that_cannot_start_fails_the_run_in_one_line(tmp_path: Path, trajforge_cli: str) -> None:
    """The server's database is unreachable (nothing listens on port 1): the run fails with status 1 and one line
    saying the temporary Prefect server exited, with the end of its own output."""
    (tmp_path / "trajforge.yaml").write_text(MINIWOB_QUERY)
    env = serverless_env(tmp_path, PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://nobody@127.0.0.1:1/x")
    proc = subprocess.run([trajforge_cli, "run", "query_gen"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the temporary Prefect server exited" in proc.stderr and "Connect call failed" in proc.stderr


def test_serve_runs_one_night_at_a_time_as_deploy_does(tmp_path: Path, trajforge_cli: str) -> None:
    """`serve` registered the nightly with no concurrency limit (`deploy` gives it 1): a night scheduled while
    one ran started beside it and stopped at RunLocked instead of waiting for it."""
    import signal

    from conftest import PREFECT, running_prefect_server, wait_for

    (tmp_path / "trajforge.yaml").write_text(
        "query_gen:\n  apps: []\n  deep_search_apps: []\nrollout:\n  policy: replay\n"
        "critics:\n  step_critic: rules\n  text_channel: false\nsynth:\n  writer: template\n")
    env = cli_env(tmp_path)
    with running_prefect_server(env, 90) as url:
        env |= {"PREFECT_API_URL": url}
        serve = subprocess.Popen([trajforge_cli, "serve"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            def shown() -> str:  # empty until serve has registered it
                return subprocess.run([PREFECT, "deployment", "inspect", "nightly/nightly"], env=env,
                                      capture_output=True, text=True, check=False).stdout

            wait_for(lambda: "'global_concurrency_limit'" in shown(), 120, "the nightly deployment")
            assert re.search(r"'global_concurrency_limit': \{[^}]*'limit': 1,", shown()), shown()
        finally:
            os.killpg(serve.pid, signal.SIGTERM)
            serve.wait(timeout=60)

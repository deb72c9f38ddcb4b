"""The whole thin pipeline through the CLI, as a user runs it: real Prefect, browser, catalog."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa

from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import NOT_ROLLED_AGAIN
from trajforge.schemas.config import Settings

# The suite's 600 s counts fixture setup too: the first test here pays for the two nights.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(1500)]

DONE_BEFORE = "already done by an earlier run with this configuration"
"""The count `StageDef.once` stages give in their lineage's stats (tasks/runner.py)."""

CONFIG = """
query_gen:
  apps: [shop]
  num_queries: {n}
  atomic_per_app: 1
rollout:
  policy: replay
  contexts: 2
  episodes_per_shard: {per_shard}
critics: {{step_critic: rules, text_channel: false}}  # the model critics have their own tests (test_critics)
synth: {{writer: template}}  # the synthesis stages' model calls have their own tests (test_synth)
"""


def cli(exe: str, cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the CLI as a user does. `timeout` guards against a hung run, not a slow one: a night with the synthesis
    stages took over 300 s on a busy 2-core machine (CI's test_loop, 2026-11-24)."""
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"trajforge {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def workspace(cwd: Path) -> Workspace:
    return Workspace.open(Settings(warehouse={"path": cwd / "data" / "warehouse"}))


def by_policy(episodes: pl.DataFrame) -> pl.DataFrame:
    """The episodes the configured policy acted in (not the reference stage's replays)."""
    return episodes.filter(pl.col("source").is_null() | (pl.col("source") != "reference"))


def of_stage(ws: Workspace, table: str, stage: str) -> list:
    """A table's versions that one stage committed, oldest first."""
    return [info for info in ws.catalog.history(table) if info.lineage and info.lineage.stage == stage]


@pytest.fixture(scope="module")
def two_nights(tmp_path_factory, chromium, trajforge_cli):
    """Two nightly runs in a fresh folder, as the README's first command does."""
    cwd = tmp_path_factory.mktemp("nightly")
    (cwd / "trajforge.yaml").write_text(CONFIG.format(n=5, per_shard=2))
    first = cli(trajforge_cli, cwd, "run", "nightly")
    second = cli(trajforge_cli, cwd, "run", "nightly")
    return cwd, first.stdout, second.stdout + second.stderr  # the stages' summaries are Prefect log lines (stderr)


def test_nightly_prints_a_summary_and_leaves_iceberg_tables(two_nights):
    cwd, out, _ = two_nights
    for table in ("queries", "episodes", "steps", "step_critiques", "verdicts"):
        assert re.search(rf"{table}\s.*\d+\s.*\d+\s.*\d{{6,}}\s.*nightly-\d{{4}}-\d\d-\d\d", out), out
    assert (cwd / "data" / "warehouse" / "catalog.db").exists()
    assert list((cwd / "data" / "warehouse").glob("**/metadata/*.metadata.json"))


def test_second_run_makes_second_versions_listed_by_history(two_nights, trajforge_cli):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    history = ws.catalog.history("steps")
    assert [i.lineage.stage for i in history] == ["reference", "rollout"] * 2
    out = cli(trajforge_cli, cwd, "datasets", "history", "steps").stdout
    for info in history:
        assert str(info.snapshot_id) in out


def test_polars_reads_the_older_snapshot(two_nights):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    history = ws.catalog.history("steps")
    old, new = history[0], history[-1]
    older = ws.catalog.load("steps", old.snapshot_id)
    assert older.height == old.added_rows == old.total_rows
    assert set(older["run_id"]) == {old.run_id}
    assert ws.catalog.load("steps").height == new.total_rows == sum(i.added_rows for i in history)


def test_every_replayed_episode_is_judged_a_success(two_nights):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    nightly_verdicts = ws.catalog.history("verdicts")[1]  # after both nightly runs, before any rerun
    verdicts = ws.catalog.load("verdicts", nightly_verdicts.snapshot_id)
    episodes = by_policy(ws.catalog.load("episodes")).filter(pl.col("status") != "env_fault")  # faults: no verdict
    assert verdicts.height == episodes.height == 6  # night 1's 5 page-graph and 1 atomic query
    recorded = ws.catalog.load("episodes")
    references = recorded.filter((pl.col("source") == "reference") & (pl.col("status") != "env_fault"))
    # 6 queries x 2 viewports, once: night 2 reuses them (a replay that timed out on a loaded machine is retried)
    assert references.height == 12 and references["success"].all()
    assert references.select("query_id", "viewport").n_unique() == 12
    assert verdicts["success"].all(), verdicts.select("reason").to_series().to_list()
    channels = json.loads(verdicts["channels_json"][0])
    assert channels["checker"]["answer"] == "success"
    steps = ws.catalog.load("steps")
    assert steps["screenshot_before"].map_elements(lambda h: h in ws.blobs, return_dtype=pl.Boolean).all()


def test_the_second_night_rolls_no_query_again_and_says_why(two_nights):
    """The same replay policy on the same queries would repeat night 1's episodes step for step (and write each
    training row twice): night 2 rolls none, and its lineage, output and report say so."""
    cwd, _, second = two_nights
    ws = workspace(cwd)
    night1, night2 = of_stage(ws, "episodes", "rollout")
    keys = by_policy(ws.catalog.load("episodes", night1.snapshot_id))["attempt_key"]
    assert keys.null_count() == 0 and keys.n_unique() == 6  # one key per query
    assert night2.added_rows == 0 and night2.lineage.stats[NOT_ROLLED_AGAIN] == 6
    assert "rollout: 6 queries not rolled again" in second.replace("\n", " ")
    report = (cwd / "data" / "warehouse" / "reports" / f"{night2.run_id}.md").read_text()
    assert "Not rolled again: 6 queries" in report and "| train_e2e | all | 0 (no policy episode this run) |" in report


def test_train_e2e_accumulates_and_a_stage_rerun_by_hand_writes_no_row_twice(two_nights, trajforge_cli, tmp_path):
    """train_e2e accumulates as every training table does, so a night with nothing new empties nothing (a trainer
    reads @latest). `trajforge run export` or `run semantics` by hand on night 1's input writes none of its rows
    again with the same configuration (semantics wrote all 75 again before); export with another configuration
    writes them again as its own rows in place of night 1's (a fine-tuning job reading @latest sees each step
    once, with the newest weight), which the version before still holds."""
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    night1, night2 = of_stage(ws, "train_e2e", "export")[:2]
    assert night1.added_rows > 0 and night2.added_rows == 0 and night2.total_rows == night1.added_rows
    verdicts = of_stage(ws, "verdicts", "critics")[0].snapshot_id
    judged = ws.catalog.rows_added("verdicts", verdicts)[0].height
    semantics = of_stage(ws, "action_semantics", "semantics")[0]
    assert semantics.added_rows > 0

    cli(trajforge_cli, cwd, "run", "export", "--input", f"verdicts@{verdicts}")
    cli(trajforge_cli, cwd, "run", "semantics", "--input", f"steps@{semantics.lineage.inputs['steps']}")
    same = of_stage(ws, "train_e2e", "export")[-1]
    assert same.added_rows == 0 and same.total_rows == night1.added_rows
    assert same.lineage.stats[DONE_BEFORE] == judged
    again = of_stage(ws, "action_semantics", "semantics")[-1]
    assert again.added_rows == 0 and again.total_rows == semantics.total_rows and again.lineage.stats[DONE_BEFORE] > 0

    config = (cwd / "trajforge.yaml").read_text()
    assert "synth: {writer: template}" in config
    (cwd / "reweighted.yaml").write_text(config.replace("synth: {writer: template}",
                                                        "synth: {writer: template, reweight_smoothing: 0.2}"))
    cli(trajforge_cli, cwd, "run", "export", "--input", f"verdicts@{verdicts}", "--config", "reweighted.yaml")
    again = of_stage(ws, "train_e2e", "export")[-1]
    assert (again.added_rows, again.removed_rows, again.total_rows) == (night1.added_rows,) * 3
    assert ws.catalog.load("train_e2e", same.snapshot_id)["run_id"].unique().to_list() == [night1.run_id]
    for flags, rows in (([], again.total_rows), (["--added"], again.added_rows)):
        out = tmp_path / f"export{len(flags)}"
        said = cli(trajforge_cli, cwd, "export", f"train_e2e@{again.snapshot_id}", "--format", "ms-swift",
                   "--out", str(out), *flags).stdout
        assert len((out / "train.jsonl").read_text().splitlines()) == rows
        parts = sum(len(json.loads(line)["images"]) for line in (out / "train.jsonl").read_text().splitlines())
        files = len(list((out / "images").glob("*.png")))
        assert f"{rows} rows, {parts} image parts ({files} distinct files)" in said  # a night's rows share screens
    rows = ws.catalog.load("train_e2e", again.snapshot_id)
    assert rows["run_id"].unique().to_list() == [again.run_id] and rows["step_id"].is_unique().all()


def test_an_episode_accepted_when_judged_again_is_exported_then(two_nights, trajforge_cli):
    """A user judges night 1's episodes again and exports each verdicts version, with a configuration no earlier
    export used: first with a consensus that accepts none (the paper's: both channels must say success, and
    neither is asked here), then with the checker's, which accepts them all. The first export takes the rejected
    episodes' rows, exported by an earlier one, out of the table (they stayed before); the second writes the
    accepted episodes' rows though the first took the same episodes when they were rejected (keyed on the episode
    alone, it skipped them: 0 rows); a third writes none of them twice."""
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    episodes = of_stage(ws, "episodes", "rollout")[0].snapshot_id
    strict = (cwd / "trajforge.yaml").read_text().replace("synth: {writer: template}",
                                                          "synth: {writer: template, tau_c: 0.75}")
    (cwd / "strict.yaml").write_text(strict)
    (cwd / "none-accepted.yaml").write_text(strict.replace("text_channel: false}",
                                                           "text_channel: false, consensus: paper}"))

    def judge_and_export(config: str):  # -> the verdicts it added, and the export's train_e2e version
        cli(trajforge_cli, cwd, "run", "critics", "--input", f"episodes@{episodes}", "--config", config)
        verdicts = of_stage(ws, "verdicts", "critics")[-1].snapshot_id
        cli(trajforge_cli, cwd, "run", "export", "--input", f"verdicts@{verdicts}", "--config", config)
        return ws.catalog.rows_added("verdicts", verdicts)[0], of_stage(ws, "train_e2e", "export")[-1]

    exported = ws.catalog.load("train_e2e")
    rejected, export = judge_and_export("none-accepted.yaml")
    assert rejected.height > 0 and not rejected["success"].any() and export.added_rows == 0
    was = exported.filter(pl.col("episode_id").is_in(rejected["episode_id"].to_list())).height
    assert was > 0 and export.removed_rows == was and export.total_rows == exported.height - was
    assert not set(ws.catalog.load("train_e2e", export.snapshot_id)["episode_id"]) & set(rejected["episode_id"])
    accepted, export = judge_and_export("strict.yaml")
    assert accepted["success"].all() and set(accepted["episode_id"]) == set(rejected["episode_id"])
    critiques = ws.catalog.rows_added("step_critiques", export.lineage.inputs["step_critiques"])[0]
    labels = dict(critiques.select("step_id", "label").iter_rows())
    steps = ws.catalog.load("steps").filter(pl.col("episode_id").is_in(accepted["episode_id"].to_list())
                                            & pl.col("action_valid"))
    good = {s for s in steps["step_id"] if labels[s] == "GOOD"}  # tau_c 0.75: GOOD steps only
    assert good and export.added_rows == len(good) and DONE_BEFORE not in export.lineage.stats
    assert set(ws.catalog.rows_added("train_e2e", export.snapshot_id)[0]["step_id"]) == good
    assert export.removed_rows == 0

    verdicts = export.lineage.inputs["verdicts"]
    cli(trajforge_cli, cwd, "run", "export", "--input", f"verdicts@{verdicts}", "--config", "strict.yaml")
    again = of_stage(ws, "train_e2e", "export")[-1]
    assert again.added_rows == 0 and again.lineage.stats[DONE_BEFORE] == accepted.height


def test_critics_rerun_alone_names_its_input_snapshot(two_nights, trajforge_cli):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    first_episodes = of_stage(ws, "episodes", "rollout")[0]
    before = len(ws.catalog.history("verdicts"))
    cli(trajforge_cli, cwd, "run", "critics", "--input", f"episodes@{first_episodes.snapshot_id}")
    history = ws.catalog.history("verdicts")
    assert len(history) == before + 1
    lineage = history[-1].lineage
    assert lineage.inputs["episodes"] == first_episodes.snapshot_id
    assert lineage.stage == "critics"
    judged = by_policy(ws.catalog.rows_added("episodes", first_episodes.snapshot_id)[0])
    assert history[-1].added_rows == judged.filter(pl.col("status") != "env_fault").height


def test_tag_show_and_diff(two_nights, trajforge_cli):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    history = ws.catalog.history("queries")  # per night: query_gen's set, then history's with the counts
    old, new = history[0], history[-1]
    tag = [t for t in new.tags if t.startswith("nightly-")][0]
    assert ws.catalog.resolve(f"queries@{tag}") == ("queries", new.snapshot_id)
    cli(trajforge_cli, cwd, "datasets", "tag", f"queries@{old.snapshot_id}", "first-night")
    assert ws.catalog.resolve("queries@first-night") == ("queries", old.snapshot_id)
    shown = cli(trajforge_cli, cwd, "datasets", "show", "queries@first-night",
                "--columns", "query_id,instruction").stdout
    assert "6 rows" in shown  # 5 page-graph queries and 1 atomic
    assert re.search(r"│ query_id +┆ instruction +│", shown), shown  # two columns fit: a table
    first = ws.catalog.history("steps")[0].snapshot_id
    diff = cli(trajforge_cli, cwd, "datasets", "diff", "steps", str(first), "latest")
    assert re.search(r"\+\d+ -0", diff.stdout), diff.stdout


def test_show_prints_a_wide_version_one_line_per_column_cut_to_the_terminal(two_nights, trajforge_cli):
    """`steps` has 28 columns and accessibility trees thousands of characters long: a table of them squeezed into
    a terminal shows nothing, so each column gets its own line, the long values cut in the middle and an image
    by its size (a narrow selection stays a table: test_tag_show_and_diff); a column the table lacks is named with
    those it has."""
    cwd, _, _ = two_nights
    columns = workspace(cwd).catalog.latest("steps")[0].columns
    shown = cli(trajforge_cli, cwd, "datasets", "show", "steps", "--limit", "2").stdout.splitlines()
    lines = {line.split()[0]: line for line in shown if line and line.split()[0] in columns}
    assert set(lines) == set(columns), shown
    assert all(len(line) <= 200 for line in lines.values())  # the helper's COLUMNS
    assert lines["ax_tree_before"].count("...") == 2 and "RootWebArea" in lines["ax_tree_before"]
    assert re.fullmatch(r"step_index\s+Int64\s+0, 1", lines["step_index"])
    images = [line for line in cli(trajforge_cli, cwd, "datasets", "show", "train_grounding", "--limit", "1")
              .stdout.splitlines() if line.startswith("images ")]
    assert images and re.search(r"\[<[\d,]+ bytes>\]$", images[0]), images
    proc = subprocess.run([trajforge_cli, "datasets", "show", "steps", "--columns", "step_index,app"], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: steps has no column named 'app'; its columns: run_id, step_id"), proc.stderr


def test_invalid_config_fails_before_any_work(tmp_path, trajforge_cli):
    (tmp_path / "trajforge.yaml").write_text("rollout:\n  contxts: 2\n")
    proc = subprocess.run([trajforge_cli, "run", "nightly"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trajforge.yaml" in proc.stderr and "rollout.contxts" in proc.stderr
    assert not (tmp_path / "data").exists()


def test_killed_during_rollouts_then_rerun_commits_each_episode_once(tmp_path, chromium, trajforge_cli):
    (tmp_path / "trajforge.yaml").write_text(CONFIG.format(n=6, per_shard=1))
    ledger = sa.create_engine(f"sqlite:///{tmp_path / 'data' / 'warehouse' / 'catalog.db'}")
    proc = subprocess.Popen(
        [trajforge_cli, "run", "nightly"], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    done_before_kill = 0
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                with ledger.connect() as conn:
                    done_before_kill = conn.execute(sa.text(
                        "select count(*) from trajforge_shards where stage = 'rollout'"
                    )).scalar()
            except sa.exc.OperationalError:
                continue  # the ledger is not created yet
            if done_before_kill >= 2:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 2 <= done_before_kill < 7, f"the kill should land during rollouts (done={done_before_kill})"

    rerun = cli(trajforge_cli, tmp_path, "run", "nightly")
    assert "resuming run" in rerun.stdout
    ws = workspace(tmp_path)
    episodes = ws.catalog.load("episodes")
    assert episodes["episode_id"].is_unique().all(), "an episode was committed twice"
    episodes = by_policy(episodes)
    # Exactly one judged episode per query; a fault under load adds an env_fault record and its rerun.
    judged = episodes.filter(pl.col("status") != "env_fault")
    assert judged.height == 7 and judged["query_id"].n_unique() == 7  # 6 page-graph queries and 1 atomic
    faults = episodes.filter(pl.col("status") == "env_fault")
    assert (faults.height == 0) or set(judged.filter(pl.col("attempt") > 1)["query_id"]) == set(faults["query_id"])
    assert [i.lineage.stage for i in ws.catalog.history("episodes")] == ["reference", "rollout"]
    assert ws.catalog.load("verdicts").height == 7


def test_broken_app_spec_fails_before_any_work(tmp_path):
    """A user edits a bundled spec in their checkout so that a transition names a missing page."""
    repo = Path(__file__).resolve().parents[1]
    package = tmp_path / "checkout" / "trajforge"  # a copy of the package, first on the path
    package.mkdir(parents=True)
    shutil.copy(repo / "__init__.py", package / "__init__.py")
    for room in ("schemas", "data", "llm", "envs", "query_gen", "rollout", "critics", "guidance", "synth", "tasks",
                 "flows"):
        shutil.copytree(repo / room, package / room, ignore=shutil.ignore_patterns("__pycache__", "warehouse"))
    spec = package / "envs" / "apps" / "shop" / "spec.yaml"
    spec.write_text(spec.read_text().replace("to: cart", "to: basket", 1))
    proc = subprocess.run(
        [sys.executable, "-m", "trajforge.flows.cli", "run", "nightly"], cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "300", "PYTHONPATH": str(package.parent)},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(spec) in proc.stderr
    assert re.search(r"transitions\[\d+\]\.to: page 'basket' does not exist", proc.stderr), proc.stderr
    assert not (tmp_path / "data" / "warehouse").exists()


def test_miniwob_tasks_run_through_the_pipeline_with_their_rewards(tmp_path, chromium, trajforge_cli):
    from trajforge.envs.miniwob import DEFAULT_TASKS

    (tmp_path / "trajforge.yaml").write_text(
        "query_gen:\n  apps: []\n  miniwob_tasks: [" + ", ".join(DEFAULT_TASKS) + "]\n  miniwob_max_steps: 3\n"
        "rollout:\n  policy: random\n  contexts: 2\n  episodes_per_shard: 12\n"
        "critics:\n  step_critic: rules\n  text_channel: false\nsynth:\n  writer: template\n"
    )
    cli(trajforge_cli, tmp_path, "run", "nightly")
    ws = workspace(tmp_path)
    episodes = ws.catalog.load("episodes").filter(pl.col("status") != "env_fault")  # faults are rerun
    assert episodes.height == len(DEFAULT_TASKS) >= 30
    assert set(episodes["app"]) == {"miniwob"} and set(episodes["status"]) <= {"terminated", "max_steps"}
    states = [json.loads(s) for s in episodes["final_state_json"]]
    assert all({"reward", "raw_reward", "done"} <= set(s) for s in states)  # read from each page's own JS
    verdicts = ws.catalog.load("verdicts")
    assert verdicts.height == episodes.height
    reasons = [r.removeprefix("checker_first: ") for r in verdicts["reason"]]  # the checker decided each
    assert all(r.startswith("reward") or r == "the task did not end: no reward" for r in reasons), reasons
    done = [s for s in states if s["done"]]
    assert done, "a random clicker ends some MiniWoB++ episodes (click-test, click-button, ...)"
    assert [v for v in verdicts["success"]].count(True) == sum(s["raw_reward"] > 0 for s in states)


def test_a_synthesis_stage_reruns_alone_on_a_pinned_steps_version(two_nights, trajforge_cli):
    cwd, _, _ = two_nights
    ws = workspace(cwd)
    first_steps = of_stage(ws, "steps", "reference")[0]
    nightly = ws.catalog.lineage("grounding", of_stage(ws, "grounding", "grounding")[0].snapshot_id)
    assert nightly.kept["grounding"] > 0  # the night's grounding read the run's last steps version (the rollout's)
    assert nightly.inputs["steps"] == of_stage(ws, "steps", "rollout")[0].snapshot_id
    cli(trajforge_cli, cwd, "run", "grounding", "--input", f"steps@{first_steps.snapshot_id}")
    rerun = of_stage(ws, "grounding", "grounding")[-1].lineage
    assert rerun.inputs["steps"] == first_steps.snapshot_id
    # the night grounded these screens with the same configuration: nothing new, nothing read again
    assert rerun.kept["grounding"] == 0
    assert rerun.stats["screens already grounded with this configuration by an earlier run"] > 0
    for table in ("grounding", "train_grounding", "action_semantics", "train_semantics", "manuals",
                  "train_planning"):
        assert ws.catalog.load(table).height > 0, table


def test_a_run_names_the_unfinished_run_it_does_not_resume_and_fresh_sets_it_aside(tmp_path, trajforge_cli):
    """A run's identity holds its config and the input version it reads (`run STAGE` reads TABLE@latest): a stage
    run that crashed, rerun once a night had made a new version, started a new run and left the crashed one
    `running` for ever (expire keeps its files, versions and inputs for it), and `--fresh` set aside only the runs
    of the new identity, so no command reached it."""
    (tmp_path / "trajforge.yaml").write_text("query_gen:\n  apps: []\n  deep_search_apps: []\n")
    ws = workspace(tmp_path)
    crashed = ws.ledger.open_run("query_gen", "the crashed run's identity").run_id
    said = cli(trajforge_cli, tmp_path, "run", "query_gen").stderr
    assert crashed in said and "`trajforge run query_gen --fresh` sets them aside" in said, said
    assert crashed in ws.ledger.unfinished_runs()
    said = cli(trajforge_cli, tmp_path, "run", "query_gen", "--fresh").stderr
    assert crashed not in ws.ledger.unfinished_runs() and crashed not in said


def test_fresh_sets_aside_no_run_of_another_warehouse_in_the_database(postgres_url):
    """The namespaces of one PostgreSQL database share its run ledger, each holding only its own while it runs:
    `--fresh` in one must leave another's unfinished run (maybe running now) alone, and not name it."""
    from trajforge.data.ledger import Ledger

    here, there = (Ledger(postgres_url, scope=f"catalog/{name}{os.getpid()}-{time.monotonic_ns()}")
                   for name in ("here", "there"))
    try:
        # Identities of this test's own: a run recorded before the scope column is resumed by identity alone.
        before, after = (f"{setting} a setting changed {uuid.uuid4().hex}" for setting in ("before", "after"))
        crashed = here.open_run("nightly", before)
        theirs = there.open_run("nightly", before)  # another config, by chance the same
        assert not crashed.resumed and not theirs.resumed, "each warehouse resumes only its own runs"
        assert here.open_run("nightly", after).passed_over == (crashed.run_id,)
        fresh = here.open_run("nightly", after, fresh=True)
        assert crashed.run_id not in here.unfinished_runs() and theirs.run_id in here.unfinished_runs()
        there.finish_run(theirs.run_id, {})
        here.finish_run(fresh.run_id, {})
    finally:
        here.engine.dispose()
        there.engine.dispose()

"""The verl export as verl reads it: plain pyarrow on train.parquet, and reward.py loaded by path the way
verl's `custom_reward_function.path` loads it, after a real nightly run (replay policy); and a user's app's queries
rewarded by reward.py in a process that knows nothing but the export."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_pipeline import workspace

from trajforge.data.catalog import Catalog, Lineage
from trajforge.envs.android import APP as ANDROID
from trajforge.envs.kinds import kind_for, use_app_dirs
from trajforge.schemas.records import Query
from trajforge.synth import verl_reward
from trajforge.synth.handoff import ExportError, export
from trajforge.synth.verl import export_verl

pytestmark = pytest.mark.browser

COUNTER = Path(__file__).parent / "fixtures" / "counter_app"

REWARD_IN_A_FRESH_PROCESS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("custom_module", sys.argv[1])  # as verl loads it
reward = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reward)
truth, states = sys.argv[2], json.loads(sys.argv[3])
print(json.dumps([reward.compute_score("trajforge", "", truth, {"final_state": s}) for s in states]))
reward.compute_score("trajforge", "", json.dumps({**json.loads(truth), "app": "no-such-app"}), {"final_state": {}})
"""
"""Scores the states with the ground truth, then a query of an app that is nowhere, which must raise."""


@pytest.fixture(scope="module")
def night(replay_night, tmp_path_factory):
    """The night's queries exported, the Parquet read back, and reward.py loaded from the export."""
    cwd, tag = replay_night
    ws = workspace(cwd)
    result = export_verl(ws.catalog, f"queries@{tag}", tmp_path_factory.mktemp("verl") / "set",
                         viewport=ws.settings.rollout.viewport)
    spec = importlib.util.spec_from_file_location("custom_module", result.out / "reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    return ws, tag, result, pq.read_table(result.out / "train.parquet"), reward


def test_one_row_per_query_of_the_version(night):
    ws, tag, result, data, _ = night
    queries = ws.catalog.load("queries", tag)
    assert queries.height and result.rows == data.num_rows == queries.height
    assert sorted(r["query_id"] for r in data["extra_info"].to_pylist()) == sorted(queries["query_id"])
    assert result.table == "queries" and result.snapshot == ws.catalog.resolve(f"queries@{tag}")[1]
    assert sorted(p.name for p in result.out.iterdir()) == ["README.md", "reward.py", "train.parquet"]
    assert not list(result.out.parent.glob(".set.*")), "the temporary folder is renamed, not left behind"


def test_columns_and_types_are_those_verl_documents(night):
    _, _, _, data, _ = night
    schema = data.schema
    assert schema.field("data_source").type == pa.string() and schema.field("ability").type == pa.string()
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("reward_model").type == pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    assert schema.field("extra_info").type.field("index").type == pa.int64()
    assert schema.field("images").type == pa.list_(pa.struct([("bytes", pa.binary())]))
    rows = data.to_pylist()
    assert sorted(r["extra_info"]["index"] for r in rows) == list(range(len(rows)))
    for row in rows:
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert "<tools>" in row["prompt"][0]["content"]  # the action space, as the policy is asked
        assert row["reward_model"]["style"] == "rule"
        assert set(json.loads(row["reward_model"]["ground_truth"])) == {"app", "checker", "params"}


def test_each_image_placeholder_is_the_decodable_start_screen(night):
    ws, _, result, data, _ = night
    episodes = ws.catalog.load("episodes").filter(pl.col("source") == "reference")
    firsts = ws.catalog.load("steps").filter(pl.col("step_index") == 0).join(episodes, on="episode_id")
    rows = data.to_pylist()
    for row in rows:
        assert sum(m["content"].count("<image>") for m in row["prompt"]) == len(row["images"])
        starts = firsts.filter(pl.col("query_id") == row["extra_info"]["query_id"])
        for image in row["images"]:
            screen = Image.open(io.BytesIO(image["bytes"]))
            assert (screen.width, screen.height) in set(starts.select("width", "height").rows())
            assert image["bytes"] in {ws.blobs.get(h) for h in starts["screenshot_before"]}
    assert result.images == sum(len(r["images"]) for r in rows) > 0, "the shop's queries have reference replays"


def test_a_desktop_users_rows_start_from_the_desktop_screens(night, tmp_path):
    """The night records each reference in both viewports; with `rollout.viewport: desktop` the rows showed the
    mobile screen, in the mobile action space, where the user's rollouts start on the desktop one."""
    ws, tag, _, _, _ = night
    result = export_verl(ws.catalog, f"queries@{tag}", tmp_path / "desktop", viewport="desktop")
    rows = [r for r in pq.read_table(result.out / "train.parquet").to_pylist() if r["images"]]
    assert rows, "the shop's queries have reference replays"
    for row in rows:
        assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (1280, 800)
        assert "a desktop screen of 1280x800 pixels" in row["prompt"][0]["content"]


def test_reward_is_the_checker_on_the_final_state(night):
    ws, _, _, data, reward = night
    references = ws.catalog.load("episodes").filter((pl.col("source") == "reference") & pl.col("success"))
    finals = dict(references.select("query_id", "final_state_json").iter_rows())
    scored = 0
    for row in data.to_pylist():
        truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
        check = json.loads(truth)
        start = kind_for(check["app"]).app.initial_state()
        assert not kind_for(check["app"]).check(check["checker"], check["params"], start)[0]  # says no, not raises
        assert reward.compute_score(row["data_source"], "", truth, {**info, "final_state": start}) == 0.0
        if info["query_id"] in finals:
            final = finals[info["query_id"]]
            assert reward.compute_score(row["data_source"], "", truth, {**info, "final_state": final}) == 1.0
            parsed = json.loads(final)
            assert reward.compute_score(row["data_source"], "", truth, {**info, "final_state": parsed}) == 1.0
            scored += 1
    assert scored, "some query has a successful reference episode to score"


def test_unusable_input_scores_zero_and_never_raises(night):
    _, _, _, data, reward = night
    row = data.to_pylist()[0]
    truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
    other = json.dumps({**json.loads(truth), "checker": "no_such_checker"})
    for ground_truth, extra in [("not json", {**info, "final_state": {}}), ('{"app": "shop"}', {"final_state": {}}),
                                (None, {**info, "final_state": {}}), (truth, {**info, "final_state": None}),
                                (truth, {**info, "final_state": "{not a state"}),
                                (truth, {**info, "final_state": [1, 2]}), (truth, {**info, "final_state": {}}),
                                (other, {**info, "final_state": {}})]:
        assert reward.compute_score(row["data_source"], '{"cart": "everything"}', ground_truth, extra) == 0.0


def test_only_a_queries_version_into_a_new_folder(night, tmp_path):
    ws, tag, _, _, _ = night
    refused = {f"episodes@{tag}": "the verl export takes a version of queries",
               "queries": "name the version of queries to export: queries@TAG",
               "queries@no-such-tag": "table 'queries' has no tag 'no-such-tag'"}
    for ref, says in refused.items():
        with pytest.raises(ExportError, match=re.escape(says)):
            export_verl(ws.catalog, ref, tmp_path / "a", viewport="mobile")
    assert not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="not empty"):
        export_verl(ws.catalog, f"queries@{tag}", tmp_path / "b", viewport="mobile")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["mine.txt"]


def _queries_of(catalog: Catalog, *apps: str) -> None:
    """One "add one" query of each counter app directory as query generation writes it, committed as queries; an
    Android query as `android_queries` writes it, without a reference episode (the reference stage replays pages)."""
    queries = [Query(run_id="r", query_id=f"q-{app}", app=app, source="imported" if app == ANDROID else "page_graph",
                     instruction="Add one to the count, so it reads 1", path=["counter", "added"],
                     slots_json='{"n": "1"}', checker="probe" if app == ANDROID else "added_once",
                     checker_params_json='{"n": "1"}', max_steps=5, generator="tests",
                     created_at=datetime.now(timezone.utc)) for app in apps]
    catalog.commit_rows("queries", queries, Lineage(stage="query_gen", run_id="r",
                                                    commit_key=f"r/queries/{'+'.join(apps)}", config_hash="c",
                                                    code_version="v"))


def _counter(tmp_path: Path, name: str, checkers: str | None = None) -> str:
    """The counter app directory as app `name` (a name per test: an app is registered once per process), with
    `checkers` as its checkers.py when given; registered in this process."""
    shutil.copytree(COUNTER, tmp_path / name)
    (tmp_path / name / "spec.yaml").write_text((COUNTER / "spec.yaml").read_text().replace("app: counter",
                                                                                          f"app: {name}"))
    if checkers is not None:
        (tmp_path / name / "checkers.py").write_text(checkers)
    use_app_dirs([tmp_path / name])
    return name


def test_a_user_apps_queries_are_rewarded_by_its_checks_where_only_the_export_is(tmp_path):
    """An app directory is known only to a process that registered it, as the training workers have not: the
    export carries its checks (spec.yaml, and checkers.py for its `python` check) and reward.py registers them,
    in a fresh interpreter elsewhere, after the app's own folder is gone. An app it cannot find raises there."""
    shutil.copytree(COUNTER, tmp_path / "counter")
    (tmp_path / "counter" / "spec.yaml").write_text(
        (COUNTER / "spec.yaml").read_text().replace("app: counter", "app: counter-verl"))
    [counter] = use_app_dirs([tmp_path / "counter"])
    catalog = Catalog(tmp_path / "warehouse")
    _queries_of(catalog, counter.name)
    out = export_verl(catalog, "queries@latest", tmp_path / "verl", viewport="mobile").out
    shutil.rmtree(tmp_path / "counter")
    assert sorted(p.name for p in (out / "apps" / "counter-verl").iterdir()) == ["checkers.py", "spec.yaml"]
    [truth] = [r["ground_truth"] for r in pq.read_table(out / "train.parquet")["reward_model"].to_pylist()]
    accepted = {"url": "http://127.0.0.1:1/", "ax_tree": 'heading "Count: 1"',
                "http": {"state": {"json": {"count": 1}}}}
    rejected = {**accepted, "http": {"state": {"json": {"count": 2}}}}
    assert counter.check("added_once", {"n": "1"}, accepted)[0]
    assert not counter.check("added_once", {"n": "1"}, rejected)[0]
    done = subprocess.run([sys.executable, "-c", REWARD_IN_A_FRESH_PROCESS, str(out / "reward.py"), truth,
                           json.dumps([accepted, json.dumps(accepted), rejected])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[0] == "[1.0, 1.0, 0.0]", done.stderr
    assert done.returncode == 1 and "UnknownAppError: reward.py: unknown app 'no-such-app'" in done.stderr, done.stderr


def test_a_query_of_an_app_the_export_does_not_know_is_refused(tmp_path):
    """A night's --app-dir registered the app in that night's process only: an export that is not told the app's
    directory says so, rather than write a reward.py that cannot check it."""
    catalog = Catalog(tmp_path / "warehouse")
    _queries_of(catalog, "counter-elsewhere")
    with pytest.raises(ExportError, match="queries of app 'counter-elsewhere' cannot be rewarded.*--app-dir DIR"):
        export_verl(catalog, "queries@latest", tmp_path / "verl", viewport="mobile")
    assert not (tmp_path / "verl").exists()


def test_the_cli_export_takes_the_nights_app_dir(tmp_path, trajforge_cli):
    """After `run nightly --app-dir DIR`, the same option on export names the app, as on `eval critics`."""
    shutil.copytree(COUNTER, tmp_path / "counter")
    (tmp_path / "counter" / "spec.yaml").write_text(
        (COUNTER / "spec.yaml").read_text().replace("app: counter", "app: counter-cli"))
    _queries_of(workspace(tmp_path).catalog, "counter-cli")
    args = [trajforge_cli, "export", "queries@latest", "--format", "verl", "--out", "verl"]
    refused = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "app 'counter-cli' cannot be rewarded" in refused.stderr, refused.stderr
    done = subprocess.run([*args, "--app-dir", "counter"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "verl" / "apps" / "counter-cli" / "spec.yaml").is_file()
    # Beside the apps the config names, not instead of them: queries of both export with one --app-dir.
    shutil.copytree(tmp_path / "counter", tmp_path / "other")
    (tmp_path / "other" / "spec.yaml").write_text(
        (COUNTER / "spec.yaml").read_text().replace("app: counter", "app: counter-configured"))
    (tmp_path / "trajforge.yaml").write_text("query_gen:\n  app_dirs: [other]\n")
    _queries_of(workspace(tmp_path).catalog, "counter-configured")
    both = subprocess.run([*args[:-1], "verl-both", "--app-dir", "counter"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert both.returncode == 0, both.stderr
    assert sorted(p.name for p in (tmp_path / "verl-both" / "apps").iterdir()) == ["counter-cli", "counter-configured"]


def test_a_row_without_a_final_state_raises_naming_what_must_supply_it(tmp_path):
    """verl passes the Parquet row's extra_info as stored, which holds ids only: scored 0.0, every reward of a run
    set up as the card said was 0 and GRPO learnt nothing, silently. A state present but unusable still scores 0."""
    app = _counter(tmp_path, "counter-nostate")
    catalog = Catalog(tmp_path / "warehouse")
    _queries_of(catalog, app)
    out = export_verl(catalog, "queries@latest", tmp_path / "verl", viewport="mobile").out
    [row] = pq.read_table(out / "train.parquet").to_pylist()
    truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
    for extra in (info, None):
        with pytest.raises(verl_reward.FinalStateMissing, match="agent loop or reward manager that ran the episode"):
            verl_reward.compute_score(row["data_source"], "", truth, extra)
    assert verl_reward.compute_score(row["data_source"], "", truth, {**info, "final_state": None}) == 0.0
    card = (out / "README.md").read_text()
    assert "needs an agent loop or reward manager of yours" in card and "a row without `final_state` raises" in card


ODD_CHECKERS = """
def count_is(params, state):
    count = state["http"]["state"]["json"]["count"]
    assert count >= 0, f"a negative count after typing {state['typed']}"
    return 1 / count == 1 / int(params["n"]), f"the count is {count}"
"""
"""A user's `python` check that raises on odd states (AssertionError, ZeroDivisionError), quoting a typed secret."""


def test_a_users_checker_that_raises_on_an_odd_state_scores_zero_and_is_logged_masked(tmp_path, caplog,
                                                                                      monkeypatch):
    """A user's checkers.py may raise anything on a state it did not expect; one such rollout stopped training."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", "hunter2-typed")
    app = _counter(tmp_path, "counter-odd", ODD_CHECKERS)
    truth = json.dumps({"app": app, "checker": "added_once", "params": {"n": "1"}})
    state = {"url": "http://127.0.0.1:1/", "ax_tree": 'heading "Count: 1"', "typed": "hunter2-typed",
             "http": {"state": {"json": {"count": 1}}}}
    assert verl_reward.compute_score("trajforge", "", truth, {"final_state": state}) == 1.0
    with caplog.at_level(logging.WARNING, logger="trajforge.verl_reward"):
        for count, error in ((-1, "AssertionError"), (0, "ZeroDivisionError")):
            odd = {**state, "http": {"state": {"json": {"count": count}}}}
            assert verl_reward.compute_score("trajforge", "", truth, {"final_state": odd}) == 0.0
            assert f"checker {app}/added_once failed on the state: {error}" in caplog.text
    assert "a negative count after typing <secret>account_password</secret>" in caplog.text
    assert "hunter2-typed" not in caplog.text and "127.0.0.1" not in caplog.text


def test_prompts_are_in_the_users_viewport_and_a_devices_query_without_a_size_is_left_out(tmp_path):
    """The prompt's screen size and action space were the default viewport's, whatever `rollout.viewport` said, and
    an Android query got the mobile browser's 412x915 where its device checks actions in its own pixels."""
    app = _counter(tmp_path, "counter-desktop")
    catalog = Catalog(tmp_path / "warehouse")
    _queries_of(catalog, app, ANDROID)
    with pytest.raises(ExportError, match="needs the viewport rollouts run in"):
        export(catalog, "queries@latest", "verl", tmp_path / "none")
    result = export(catalog, "queries@latest", "verl", tmp_path / "verl", viewport="desktop")
    [row] = pq.read_table(result.out / "train.parquet").to_pylist()
    assert result.rows == 1 and row["extra_info"]["app"] == app
    assert "a desktop screen of 1280x800 pixels" in row["prompt"][0]["content"]
    assert '"name": "computer_use"' in row["prompt"][0]["content"]
    card = result.card.read_text()
    assert "- rows: 1\n" in card and "- source mix: page_graph 1\n" in card, card
    assert "Left out: 1 queries of android (a device" in card
    only_android = Catalog(tmp_path / "android")
    _queries_of(only_android, ANDROID)
    with pytest.raises(ExportError, match="no rows to export; left out: 1 queries of android"):
        export_verl(only_android, "queries@latest", tmp_path / "empty", viewport="desktop")

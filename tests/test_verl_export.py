"""The verl export as verl reads it: plain pyarrow on train.parquet, and reward.py loaded by path the way
verl's `custom_reward_function.path` loads it, after a real nightly run (replay policy)."""

from __future__ import annotations

import importlib.util
import io
import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_pipeline import workspace

from trajforge.envs.kinds import kind_for
from trajforge.synth.handoff import ExportError
from trajforge.synth.verl import export_verl

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def night(replay_night, tmp_path_factory):
    """The night's queries exported, the Parquet read back, and reward.py loaded from the export."""
    cwd, tag = replay_night
    ws = workspace(cwd)
    result = export_verl(ws.catalog, f"queries@{tag}", tmp_path_factory.mktemp("verl") / "set")
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
            assert reward.compute_score(row["data_source"], "", truth, {**info, "final_state": json.loads(final)}) == 1.0
            scored += 1
    assert scored, "some query has a successful reference episode to score"


def test_unusable_input_scores_zero_and_never_raises(night):
    _, _, _, data, reward = night
    row = data.to_pylist()[0]
    truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
    other = json.dumps({**json.loads(truth), "checker": "no_such_checker"})
    for ground_truth, extra in [("not json", {**info, "final_state": {}}), ('{"app": "shop"}', {}), (None, info),
                                (truth, None), (truth, info), (truth, {**info, "final_state": "{not a state"}),
                                (truth, {**info, "final_state": [1, 2]}), (truth, {**info, "final_state": {}}), (other, {**info, "final_state": {}})]:
        assert reward.compute_score(row["data_source"], '{"cart": "everything"}', ground_truth, extra) == 0.0


def test_only_a_queries_version_into_a_new_folder(night, tmp_path):
    ws, tag, _, _, _ = night
    for ref in (f"episodes@{tag}", "queries", "queries@no-such-tag"):
        with pytest.raises(ExportError, match="queries"):
            export_verl(ws.catalog, ref, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="not empty"):
        export_verl(ws.catalog, f"queries@{tag}", tmp_path / "b")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["mine.txt"]

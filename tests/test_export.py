"""The end-to-end training table as a fine-tuning job reads it: plain pyarrow on the Parquet
files of the tagged snapshot, after a real nightly run (replay policy: accepted trajectories)."""

from __future__ import annotations

import io
import json
import re

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_pipeline import workspace

pytestmark = pytest.mark.browser

@pytest.fixture(scope="module")
def night(replay_night):
    cwd, tag = replay_night
    ws = workspace(cwd)
    table = ws.catalog.table("train_e2e")
    snapshot = table.snapshot_by_name(tag)
    tasks = table.scan(snapshot_id=snapshot.snapshot_id).plan_files()
    files = [task.file.file_path.removeprefix("file://") for task in tasks]
    return ws, tag, pa.concat_tables([pq.read_table(f) for f in files])


def test_one_row_per_good_or_neutral_step_of_an_accepted_trajectory(night):
    ws, tag, data = night
    accepted = set(ws.catalog.load("verdicts").filter(pl.col("success"))["episode_id"])
    assert accepted, "replayed reference paths are accepted by the checker"
    critiques = ws.catalog.load("step_critiques")
    labels = dict(critiques.select("step_id", "label").iter_rows())
    no_change = {s for s, flags in critiques.select("step_id", "flags").iter_rows() if "no_change" in (flags or [])}
    steps = ws.catalog.load("steps").filter(pl.col("episode_id").is_in(list(accepted)) & pl.col("action_valid"))
    # a step that changed nothing is history only, unless it ends the episode or answers (they change nothing)
    expected = {s for s, kind in steps.select("step_id", "action_type").iter_rows() if labels[s] in ("GOOD", "NEUTRAL")
                and (s not in no_change or kind in ("terminate", "answer"))}
    assert expected and set(data["step_id"].to_pylist()) == expected and data.num_rows == len(expected)
    assert set(data["tag"].to_pylist()) == {tag} and set(data["label"].to_pylist()) <= {"GOOD", "NEUTRAL"}
    # Filter 1 at tau_c 0.5: the critic's score of each kept step; filter 3: a weight from its query's p_succ.
    assert set(data["score"].to_pylist()) <= {1.0, 0.5} and all(w > 0 for w in data["weight"].to_pylist())
    p_succ = ws.catalog.load("query_history").group_by("query_id").agg(pl.col("success").mean())
    assert set(data["p_succ"].to_pylist()) <= set(p_succ["success"].to_list())
    lineage = ws.catalog.lineage("train_e2e", tag)
    assert lineage.kept == {"train_e2e": len(expected)} and lineage.prompts == {"gui_owl_e2e": "1"}


def test_messages_are_qwen_chat_with_the_action_as_a_function_call_and_images_decode(night):
    ws, _, data = night
    steps = {s["step_id"]: s for s in ws.catalog.load("steps").to_dicts()}
    for row in data.to_pylist():
        messages = json.loads(row["messages_json"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert "mobile_use" in messages[0]["content"][0]["text"]
        images = [p for m in messages for p in m["content"] if p["type"] == "image"]
        assert len(images) == len(row["images"]) == 1
        for png in row["images"]:
            with Image.open(io.BytesIO(png)) as image:
                image.load()
                step = steps[row["step_id"]]
                assert image.size == (step["width"], step["height"])
        answer = messages[-1]["content"][0]["text"]
        call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>$", answer, re.DOTALL).group(1))
        action = json.loads(step["action_json"])
        assert call["name"] == "mobile_use" and call["arguments"]["action"] == step["action_type"]
        if "x" in action:
            assert call["arguments"]["coordinate"] == [action["x"], action["y"]]
        assert answer.startswith(f"<thinking>{step['thought']}</thinking>")

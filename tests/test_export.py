"""The end-to-end training table as a fine-tuning job reads it: plain pyarrow on the Parquet
files of the tagged snapshot, after a real nightly run (replay policy: accepted trajectories)."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import prompt_version
from PIL import Image
from test_pipeline import workspace

from trajforge.data.catalog import Lineage, commit_key
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Episode, Query, Step, StepCritique, Verdict
from trajforge.synth import export
from trajforge.tasks.runner import run_inline

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
    assert lineage.kept == {"train_e2e": len(expected)}
    assert lineage.prompts == {"gui_owl_e2e": prompt_version("gui_owl_e2e")}


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


def _made(stage: str, run_id: str, table: str, **inputs: int) -> Lineage:
    """The lineage of a commit the stage run `run_id` would have made: its key is the one readers look it up by."""
    return Lineage(stage=stage, run_id=run_id, commit_key=commit_key(run_id, stage, table), inputs=inputs,
                   config_hash="x", code_version="x")


def _rolled_out(ws: Workspace) -> int:
    """A rollout run's accepted-to-be episode of two clicks, the first with the Notetaker's answer: the episodes
    version."""
    buffer = io.BytesIO()
    Image.new("RGB", (390, 844), "white").save(buffer, format="PNG")
    png = ws.blobs.put(buffer.getvalue()).sha256
    when = datetime(2026, 12, 5, tzinfo=UTC)
    queries = ws.catalog.commit_rows("queries", [Query(
        run_id="made", query_id="q", app="notes", source="page_graph", instruction="task", path=["notes"],
        slots_json="{}", checker="state_has", checker_params_json="{}", max_steps=5, generator="test",
        created_at=when)], _made("query_gen", "made", "queries"))
    notes = {"notetaker": {"inputs": {"notes": []}, "output": {"notes": ["x"]}, "raw_output": '{"notes": ["x"]}'}}
    ws.catalog.commit_rows("steps", [Step(
        run_id="rolled", step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before=png, screenshot_after=png,
        width=390, height=844, url_before="u", url_after="u", title_before="t", title_after="t", ax_tree_before="",
        action_type="click", action_json=json.dumps({"x": 5, "y": 9}), action_valid=True, thought="", raw_output="",
        duration_ms=0, roles_json=json.dumps(notes) if i == 0 else None) for i in range(2)],
        _made("rollout", "rolled", "steps", queries=queries))
    return ws.catalog.commit_rows("episodes", [Episode(
        run_id="rolled", episode_id="e", query_id="q", app="notes", instruction="task", policy="replay",
        model_id="none", prompt_version="none", viewport="mobile", status="terminated", num_steps=2, final_url="u",
        final_state_json="{}", started_at=when, finished_at=when)], _made("rollout", "rolled", "episodes",
                                                                           queries=queries))


def test_an_accepted_episode_judged_again_with_a_step_now_harmful_loses_that_steps_row(tmp_path):
    """The critics judge an accepted episode again and a step once GOOD is now HARMFUL, the episode still accepted:
    the export of that verdicts version does it again (it is not "already done"), reading the critiques its critics
    run wrote, and its rows are replaced, that step's row gone; the lineage names the Notetaker's prompt its rows
    were rendered from, beside the policy's. Judged the same once more, nothing is redone."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    episodes = _rolled_out(ws)
    for n, labels in enumerate((["GOOD", "GOOD"], ["GOOD", "HARMFUL"], ["GOOD", "HARMFUL"])):
        critics = f"critics{n}"
        ws.catalog.commit_rows("step_critiques", [StepCritique(
            run_id=critics, critique_id=f"e:{i}:{n}", step_id=f"e:{i}", episode_id="e", critic="c", model_id="m",
            prompt_version="1", analysis="", summary="s", label=label, raw_output="", flags=[])
            for i, label in enumerate(labels)], _made("critics", critics, "step_critiques", episodes=episodes))
        verdicts = ws.catalog.commit_rows("verdicts", [Verdict(
            run_id=critics, verdict_id=f"e:v{n}", episode_id="e", query_id="q", success=True, consensus="c",
            channels_json="{}", reason="", config_hash="x")], _made("critics", critics, "verdicts", episodes=episodes))
        snapshots = run_inline(export.STAGE, ws, ws.ledger.open_run("test", f"judged {n}").run_id, verdicts)
        rows = ws.catalog.load("train_e2e")
        lineage = ws.catalog.lineage("train_e2e", snapshots["train_e2e"])
        if n == 0:
            assert sorted(rows["step_id"]) == ["e:0", "e:1"]
            assert lineage.prompts == {n: prompt_version(n) for n in ("gui_owl_e2e", "mobile_agent_notetaker")}
            assert ws.catalog.load("train_notetaker")["step_id"].to_list() == ["e:0"]
        elif n == 1:
            assert rows["step_id"].to_list() == ["e:0"] and rows["run_id"].to_list() == [lineage.run_id]
            assert "already done by an earlier run with this configuration" not in lineage.stats
        else:  # the same judgement again: nothing to redo
            assert lineage.stats == {"already done by an earlier run with this configuration": 1}
            assert rows["step_id"].to_list() == ["e:0"]

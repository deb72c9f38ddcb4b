"""PAL-UI's teacher passes and training table on one recorded run of the notes app.

One module-scoped warehouse: the notes app's queries and their reference demonstrations
(real browser, real app), as in test_synth; the teacher is an OpenAI-compatible endpoint
scripted at the edge, whose answers depend on the prompt, as a real model's do.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import prompt_version, prompt_versions
from llguidance import LLMatcher
from scripted import ScriptedServer, completion, message_parts, message_text, notes_workspace
from starlette.requests import Request
from starlette.responses import Response

from trajforge.data.catalog import Lineage, Withdrawal, commit_key, write_parquet_atomic
from trajforge.guidance.reference import STAGE as REFERENCE
from trajforge.llm.structured import Constraint
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.rollout.gui_owl import to_call
from trajforge.schemas.config import Settings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import PalUITeacher
from trajforge.schemas.tables import to_arrow
from trajforge.synth import pal_ui, pal_ui_sft
from trajforge.synth.trusted import load_trusted, spread
from trajforge.tasks.runner import run_inline

pytestmark = pytest.mark.browser

CAPTION = "The notes list, with a New note button."
VALIDATION = "The tap opened the next page, so it worked."


class TeacherServer(ScriptedServer):
    """An OpenAI-compatible teacher: captions, validations, a deliberation asking for `retrieve`, and the
    demonstrated action (or a wrong one)."""

    def __init__(self) -> None:
        super().__init__()
        self.truth: dict[tuple[str, int, int], dict[str, Any]] = {}  # (task, width, step) -> the demonstrated action
        self.retrieve: int | str | None = 0  # the step to look back at; "current": the step itself (out of range)
        self.wrong = False  # the action call gives up instead of giving the demonstrated action
        self.wrong_first = 0  # so many action calls give up before the rest act as `wrong` says
        self.blank = False  # captions come back empty
        self.asked: list[tuple[str, int]] = []  # (which prompt, images sent) per request

    def answer(self, system: str, user: str) -> tuple[str, str]:
        if "You caption a screenshot" in system:
            return "caption", "" if self.blank else CAPTION
        if "You check one action" in system:
            return "validate", VALIDATION
        step = int(re.search(r"^Current step: (\d+)", user, re.MULTILINE).group(1))
        if "You plan the next step" in system:
            return "teacher", json.dumps({
                "history_revision": "The memory shows the list was opened.", "candidates": ["tap the note", "go back"],
                "confidence": "Unsure which note the task means.",
                "retrieve": step if self.retrieve == "current" else self.retrieve})
        if "Read the memory and the deliberation" in system:
            task = re.search(r"^Task: (.*)$", user, re.MULTILINE).group(1)
            width = int(re.search(r"screen of (\d+)x", system).group(1))
            wrong, self.wrong_first = self.wrong or self.wrong_first > 0, max(self.wrong_first - 1, 0)
            action = {"type": "terminate", "status": "failure"} if wrong else self.truth[(task, width, step)]
            return "act", json.dumps(to_call(action, re.search(r'"name": "(\w+)"', system).group(1)))
        raise AssertionError(f"unexpected prompt: {system[:80]}")

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"body": body})
        name, reply = self.answer(message_text(body["messages"][0]), message_text(body["messages"][-1]))
        self.asked.append((name, sum(p["type"] == "image_url" for m in body["messages"] for p in message_parts(m))))
        return completion(reply)


@pytest.fixture(scope="module")
def model():
    with TeacherServer() as server:
        yield server


def workspace(root: Path, url: str, *, cache: bool = True, **pal: Any) -> Workspace:
    return notes_workspace(root, url, cache=cache, vision=True, pal_ui={"steps_per_shard": 3} | pal)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, chromium, model):
    """A run's reference demonstrations of the notes app, the run id, and the demonstrated actions."""
    root = tmp_path_factory.mktemp("pal_ui")
    ws = workspace(root, model.url)
    run = ws.ledger.open_run("test", "pal_ui").run_id
    queries = run_inline(QUERY_GEN, ws, run)["queries"]
    snapshots = run_inline(REFERENCE, ws, run, queries)
    steps = ws.catalog.rows_added("steps", snapshots["steps"])[0]
    episodes = {e["episode_id"]: e["instruction"] for e in ws.catalog.load("episodes").to_dicts()}
    model.truth = {(episodes[s["episode_id"]], s["width"], s["step_index"]):
                   {"type": s["action_type"], **json.loads(s["action_json"])} for s in steps.to_dicts()}
    return root, snapshots


@pytest.fixture(scope="module")
def looked_back(recorded, model):
    """The teacher stage, then the sft stage, with a teacher that looks back at step 0 and acts right."""
    root, snapshots = recorded
    ws = workspace(root, model.url, min_step=2)  # look back two steps or more: weights above 1
    run = ws.ledger.open_run("test", "looked-back").run_id
    model.retrieve, model.wrong, model.asked = 0, False, []
    teacher = run_inline(pal_ui.STAGE, ws, run, snapshots["steps"])
    asked = list(model.asked)
    sft = run_inline(pal_ui_sft.STAGE, ws, run, teacher["pal_ui_teacher"])
    return ws, teacher, sft, asked


def fresh(recorded, model, name: str, **pal: Any) -> tuple[Workspace, str, list[Any]]:
    """An uncached workspace (the cache would answer with an earlier test's answers), a new run, the trusted units."""
    root, snapshots = recorded
    ws = workspace(root, model.url, cache=False, **pal)
    return ws, ws.ledger.open_run("test", name).run_id, load_trusted(ws, snapshots["steps"]).units


def test_a_teacher_that_looks_back_and_gives_the_trusted_action_is_kept_with_its_distance(looked_back):
    ws, teacher, _, asked = looked_back
    rows = ws.catalog.rows_added("pal_ui_teacher", teacher["pal_ui_teacher"])[0].to_dicts()
    assert len(rows) == 3 and all(r["step_index"] >= 2 for r in rows)
    assert len({r["episode_id"] for r in rows}) >= 2  # spread over the episodes
    for r in rows:
        assert r["kept"] and r["matched"] and r["retrieved_step"] == 0 and r["distance"] == r["step_index"]
        assert r["trusted"] == "reference" and r["checker"] and r["model_id"] == "scripted"
        assert r["prompt_version"] == prompt_versions("pal_ui_teacher", "pal_ui_act")
        assert json.loads(r["predicted_action_json"]) == json.loads(r["trusted_action_json"])
        assert json.loads(r["deliberation_json"])["retrieve"] == 0
        memory = json.loads(r["memory_json"])
        assert [m["step_index"] for m in memory] == list(range(r["step_index"]))
        assert {(m["caption"], m["validation"], m["caption_model"], m["caption_prompt"], m["validation_prompt"])
                for m in memory} == {(CAPTION, VALIDATION, "scripted", prompt_versions("pal_ui_caption"),
                                      prompt_versions("pal_ui_validate"))}
        assert r["retrieved_screenshot"] == memory[0]["screenshot"]
    # one caption and one validation per earlier step; the action call saw o_i and o_j
    memos = sum(r["step_index"] for r in rows)
    shared = len({(r["episode_id"], j) for r in rows for j in range(r["step_index"])})
    assert sum(n == "caption" for n, _ in asked) == shared <= memos
    assert [images for n, images in asked if n == "act"] == [2, 2, 2]
    assert [images for n, images in asked if n == "validate"] == [2] * shared
    lineage = ws.catalog.lineage("pal_ui_teacher", teacher["pal_ui_teacher"])
    names = ("pal_ui_caption", "pal_ui_validate", "pal_ui_teacher", "pal_ui_act")
    assert lineage.prompts == {n: prompt_version(n) for n in names}
    assert lineage.stats["passes kept that looked back"] == 3 and not lineage.dropped
    assert pal_ui.pal_ui_summary(lineage.stats).startswith("3 trusted steps given a teacher pass; 3 matched")


def test_a_look_back_row_calls_retrieve_is_shown_that_screen_then_acts(looked_back):
    ws, teacher, sft, _ = looked_back
    passes = {r["sample_id"]: r for r in ws.catalog.rows_added("pal_ui_teacher", teacher["pal_ui_teacher"])[0].to_dicts()}
    chats = ws.catalog.rows_added("pal_ui_sft", sft["pal_ui_sft"])[0].to_dicts()
    assert len(chats) == 3
    for chat in chats:
        source = passes[chat["source_id"]]
        assert (chat["retrieved_step"], chat["distance"]) == (0, source["distance"])
        assert chat["weight"] == pytest.approx(1 + 0.5 * (source["distance"] - 1))
        messages = json.loads(chat["messages_json"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        system = messages[0]["content"][0]["text"]
        assert '"name": "retrieve"' in system and ('"name": "computer_use"' in system or '"name": "mobile_use"' in system)
        ask = messages[2]["content"][0]["text"]
        assert ask.startswith("<think>The memory shows the list was opened. Possible next actions: tap the note; go back.")
        assert ask.endswith('<tool_use>{"name": "retrieve", "arguments": {"step": 0}}</tool_use>')
        assert messages[3]["content"][0] == {"type": "image"}
        assert f"Step 0. Screen: {CAPTION} Action: {VALIDATION}" in messages[1]["content"][-1]["text"]
        call = json.loads(messages[4]["content"][0]["text"].split("<tool_use>")[1].removesuffix("</tool_use>"))
        trusted = json.loads(source["trusted_action_json"])
        assert call["arguments"]["action"] == trusted["type"]
        parts = [p for m in messages for p in m["content"] if p["type"] == "image"]
        assert len(parts) == len(chat["images"]) == 2
        assert chat["images"] == [ws.blobs.get(source["screenshot"]), ws.blobs.get(source["retrieved_screenshot"])]
    lineage = ws.catalog.lineage("pal_ui_sft", sft["pal_ui_sft"])
    assert lineage.prompts == {"pal_ui_policy": prompt_version("pal_ui_policy")}
    assert lineage.stats["could not balance: no direct samples, the rest kept whole"] == 1
    assert lineage.stats["teacher passes"] == lineage.stats["teacher passes kept"] == 3
    # step 1 looking back at step 0 sees both screens either way: only the hand-made longer memory below saves tokens
    assert lineage.stats["prompt tokens with all screenshots"] > 0 and lineage.stats["prompt tokens with memory"] > 0
    line = pal_ui_sft.STAGE.summary(lineage.stats)
    assert line.startswith("teacher matched 3/3 (100%); 3 rows, 3 with a look-back (100%)") and "with memory vs" in line


def test_a_teacher_whose_action_is_wrong_is_rejected_and_more_steps_are_tried_until_the_most(recorded, model):
    """No pass matches: the shard goes on past its 3 steps (`pal_ui.min_kept` 1 not reached) to the most, 5."""
    ws, run, units = fresh(recorded, model, "wrong", max_steps_per_shard=5)
    assert len(spread(units, 99, ws.settings.pal_ui.min_step)) >= 5  # enough steps for the most to bind
    model.retrieve, model.wrong = None, True
    try:
        teacher = run_inline(pal_ui.STAGE, ws, run, recorded[1]["steps"])
    finally:
        model.retrieve, model.wrong = 0, False
    rows = ws.catalog.rows_added("pal_ui_teacher", teacher["pal_ui_teacher"])[0].to_dicts()
    assert len(rows) == 5
    for r in rows:
        assert not r["kept"] and r["matched"] is False and r["retrieved_step"] is None and r["distance"] is None
        assert r["match_reason"].startswith("type 'terminate' is not")
        assert json.loads(r["predicted_action_json"]) == {"type": "terminate", "status": "failure"}
        assert r["act_raw_output"] and r["teacher_raw_output"]
    lineage = ws.catalog.lineage("pal_ui_teacher", teacher["pal_ui_teacher"])
    assert lineage.dropped == {"teacher pass rejected: action does not match (type)": 5}
    assert lineage.stats["steps tried past pal_ui.steps_per_shard, fewer than pal_ui.min_kept matched"] == 2
    sft = run_inline(pal_ui_sft.STAGE, ws, run, teacher["pal_ui_teacher"])
    assert ws.catalog.rows_added("pal_ui_sft", sft["pal_ui_sft"])[0].height == 0
    stats = ws.catalog.lineage("pal_ui_sft", sft["pal_ui_sft"]).stats
    assert stats["teacher pass not kept: action does not match (type)"] == 5 and stats["teacher passes"] == 5
    assert pal_ui_sft.pal_ui_sft_summary(stats).startswith("teacher matched 0/5 (0%); 0 rows")


def test_passes_past_the_budget_stop_at_the_first_match_and_the_most_cannot_be_below_the_budget(recorded, model):
    """The first pass gives up and the second matches: with a budget of 1 the shard tries 2 steps, not the most."""
    ws, run, units = fresh(recorded, model, "until-kept", steps_per_shard=1, max_steps_per_shard=6)
    model.wrong_first = 1
    try:
        out = pal_ui.teach(units, ws, run, "")
    finally:
        model.wrong_first = 0
    assert [row.kept for row in out.rows["pal_ui_teacher"]] == [False, True]
    assert out.stats["steps tried past pal_ui.steps_per_shard, fewer than pal_ui.min_kept matched"] == 1
    with pytest.raises(ValueError, match=r"pal_ui.max_steps_per_shard \(2\) is below pal_ui.steps_per_shard \(3\)"):
        Settings(pal_ui={"steps_per_shard": 3, "max_steps_per_shard": 2})


def test_a_retrieve_index_past_the_earlier_steps_is_rejected_not_guessed(recorded, model):
    ws, run, units = fresh(recorded, model, "out-of-range", steps_per_shard=1, min_kept=0)
    model.retrieve, model.asked = "current", []
    try:
        out = pal_ui.teach(units, ws, run, "")
    finally:
        model.retrieve = 0
    [row] = out.rows["pal_ui_teacher"]
    i = row.step_index
    assert not row.kept and row.matched is None and row.retrieved_step is None and row.act_raw_output is None
    assert row.match_reason == (f"retrieve index out of range: step {i} asked for at step {i}, which can look back "
                                f"at 0 to {i - 1}")
    assert json.loads(row.deliberation_json)["retrieve"] == i
    assert "act" not in [n for n, _ in model.asked]
    assert out.dropped == {"teacher pass rejected: retrieve index out of range": 1}


def test_the_decoding_schema_offers_only_the_earlier_steps_to_retrieve_and_none_at_step_0():
    """At step 0 (`pal_ui.min_step` 0) there is no earlier screen: a constrained teacher is offered only null, not a
    step 0 the range check would then reject."""
    assert pal_ui.deliberation_schema(3)["properties"]["retrieve"]["anyOf"] == [
        {"type": "integer", "minimum": 0, "maximum": 2}, {"type": "null"}]
    first = pal_ui.deliberation_schema(0)
    assert first["properties"]["retrieve"] == {"anyOf": [{"type": "null"}]}
    assert LLMatcher.validate_grammar(Constraint("json", first).grammar) == ""


def test_a_step_whose_memory_is_incomplete_asks_no_teacher_and_says_which_part(recorded, model):
    ws, run, units = fresh(recorded, model, "blank", steps_per_shard=1, min_kept=0)
    model.blank, model.asked = True, []
    try:
        out = pal_ui.teach(units, ws, run, "")
    finally:
        model.blank = False
    [row] = out.rows["pal_ui_teacher"]
    assert not row.kept and row.match_reason == "memory incomplete: the caption of step 0: empty answer"
    assert json.loads(row.memory_json)[0]["caption_error"] == "empty answer"
    assert {n for n, _ in model.asked} == {"caption", "validate"}
    assert out.dropped == {"teacher pass rejected: memory incomplete": 1}


def test_the_budget_tries_one_episode_of_every_query_before_a_second(recorded, model):
    """A query's replays on the two viewports ask the teacher nearly the same question: two steps of budget go to
    two queries, even where one query's episodes come first by id."""
    ws, run, units = fresh(recorded, model, "spread", steps_per_shard=2)
    longer = sorted({u.query_id for u in units if len(u.steps) >= 2})
    assert len(longer) >= 2 and all(sum(u.query_id == q for u in units) == 2 for q in longer)
    # the first query's episodes renamed to sort before every other: by episode alone both would be tried
    first = [dataclasses.replace(u, episode_id=f"0-{u.viewport}") if u.query_id == longer[0] else u for u in units]
    out = pal_ui.teach(first, ws, run, "")
    assert len({row.query_id for row in out.rows["pal_ui_teacher"]}) == 2


def hand_made(recorded, model, retrieved: list[int | None]) -> tuple[Workspace, list[PalUITeacher]]:
    """Kept passes at step 4 of a made-up episode, looking back at the given steps (None: no look-back), on real
    screenshots."""
    root, snapshots = recorded
    ws = workspace(root, model.url, cache=False)
    steps = ws.catalog.rows_added("steps", snapshots["steps"])[0].sort("step_id").to_dicts()[:4]
    memory = [{"step_index": j, "action": "click", "caption": CAPTION, "validation": VALIDATION, "caption_error": None,
               "caption_model": "scripted", "caption_prompt": "pal_ui_caption@1", "validation_error": None,
               "validation_model": "scripted", "validation_prompt": "pal_ui_validate@1",
               "screenshot": s["screenshot_before"], "width": s["width"], "height": s["height"]}
              for j, s in enumerate(steps)]
    plan = pal_ui.Deliberation(history_revision="Half done.", candidates=["tap Save"], confidence="Sure.", retrieve=None)
    rows = []
    for n, j in enumerate(retrieved):
        rows.append(PalUITeacher(
            run_id="r", sample_id=f"s{n}", step_id=f"step{n}", episode_id="e", query_id="q", step_index=4,
            trusted="reference", checker="c@1", instruction="Save the note", viewport="mobile",
            screenshot=steps[0]["screenshot_before"], width=steps[0]["width"], height=steps[0]["height"],
            memory_json=json.dumps(memory), teacher_raw_output="{}",
            deliberation_json=plan.model_copy(update={"retrieve": j}).model_dump_json(), act_raw_output="{}",
            retrieved_step=j, retrieved_screenshot=None if j is None else steps[j]["screenshot_before"],
            distance=None if j is None else 4 - j, predicted_action_json='{"type": "click", "x": 5, "y": 5}',
            trusted_action_json='{"type": "click", "x": 5, "y": 5}', matched=True, match_reason="type click",
            kept=True, model_id="scripted", prompt_version="pal_ui_teacher@1,pal_ui_act@1"))
    return ws, rows


def test_balancing_keeps_the_look_backs_whole_and_drops_the_surplus_direct_samples_by_hash(recorded, model):
    ws, rows = hand_made(recorded, model, [3, 1, None, None, None, None, None])  # distances 1 and 3, five direct
    run = ws.ledger.open_run("test", "balance").run_id
    out = pal_ui_sft.compile_sft(rows, ws, run, "")
    chats = out.rows["pal_ui_sft"]
    assert len(chats) == 4 and sum(c.retrieved_step is not None for c in chats) == 2
    direct = sorted((r for r in rows if r.retrieved_step is None), key=lambda r: digest(r.sample_id))
    assert {c.source_id for c in chats if c.retrieved_step is None} == {r.sample_id for r in direct[:2]}
    assert out.dropped == {"balance: direct sample beyond pal_ui.retrieval_share 0.5": 3}
    # weight = 1 + 0.5 * (distance - 1): distance 1 -> 1.0, distance 3 -> 2.0, no look-back -> 1.0
    assert sorted((c.distance or 0, c.weight) for c in chats) == [(0, 1.0), (0, 1.0), (1, 1.0), (3, 2.0)]
    assert out.stats["distance 1 before weighting"] == out.stats["distance 3 before weighting"] == 1
    assert out.stats["distance 1 after weighting (hundredths)"] == 100
    assert out.stats["distance 3 after weighting (hundredths)"] == 200
    assert pal_ui_sft.pal_ui_sft_summary(dict(out.stats) | {"teacher passes": 10, "teacher passes kept": 7}) \
        .startswith("teacher matched 7/10 (70%); 4 rows, 2 with a look-back (50%); i - j before weighting: 1: 1, "
                    "3: 1; after: 1: 1, 3: 2; mean prompt tokens")
    direct_row = next(c for c in chats if c.retrieved_step is None)
    messages = json.loads(direct_row.messages_json)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and len(direct_row.images) == 1
    assert messages[2]["content"][0]["text"].endswith(
        '<tool_use>{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [5, 5]}}</tool_use>')
    # the memory's four screenshots in place of the captions: more tokens than the memory (and o_j) cost
    assert out.stats["prompt tokens with all screenshots"] > out.stats["prompt tokens with memory"]


def test_balancing_other_shares_and_a_missing_class(recorded, model):
    _, rows = hand_made(recorded, model, [1, 2, 3, None, None, None])
    kept, dropped, _ = pal_ui_sft.balance(rows, 0.25)  # three look-backs against three direct: one look-back stays
    assert sum(r.retrieved_step is not None for r in kept) == 1 and len(kept) == 4
    assert dropped == {"balance: look-back sample beyond pal_ui.retrieval_share 0.25": 2}
    assert pal_ui_sft.balance(rows, 0.25)[0] == kept  # deterministic
    kept, dropped, stats = pal_ui_sft.balance(rows[3:], 0.5)
    assert kept == rows[3:] and not dropped
    assert stats == {"could not balance: no look-back samples, the rest kept whole": 1}
    assert pal_ui_sft.weight_of(5, 0.25) == 2.0 and pal_ui_sft.weight_of(None, 0.25) == 1.0
    assert pal_ui_sft.image_tokens(390, 844) == 14 * 31


def test_passes_and_their_balance_done_again_replace_the_earlier_rows(recorded, model):
    """The teacher rerun with another configuration, then the training table rebalanced at another share: each
    table's latest version holds each step once, from the newest run, and no row of a pass the teacher replaced."""
    root, snapshots = recorded
    model.retrieve, model.wrong, model.wrong_first, model.blank = 0, False, 0, False
    runs = []
    for weight, share in ((0.5, 0.5), (1.0, 0.5), (1.0, 0.4)):
        ws = workspace(root, model.url, cache=False, min_step=1, distance_weight=weight, retrieval_share=share)
        runs.append(ws.ledger.open_run("test", f"weight {weight} share {share}").run_id)
        if share == 0.5:  # the last run rebalances the second's passes
            teacher = run_inline(pal_ui.STAGE, ws, runs[-1], snapshots["steps"])["pal_ui_teacher"]
        run_inline(pal_ui_sft.STAGE, ws, runs[-1], teacher)
    passes = ws.catalog.load("pal_ui_teacher").to_dicts()
    assert passes and {p["run_id"] for p in passes} == {runs[1]}
    assert len({p["step_id"] for p in passes}) == len(passes)
    # Each step once; rows this test's runs did not replace are earlier tests' (their passes were of episodes the
    # budget of 3 did not reach here).
    chats = ws.catalog.load("pal_ui_sft").to_dicts()
    assert len({c["step_id"] for c in chats}) == len(chats) and not {runs[0], runs[1]} & {c["run_id"] for c in chats}
    assert sorted(c["source_id"] for c in chats if c["run_id"] == runs[2]) == sorted(
        p["sample_id"] for p in passes if p["kept"])


def _taught(recorded: tuple[Path, dict[str, int]], model: TeacherServer, label: str) -> tuple[Workspace, int,
                                                                                              set[str]]:
    """pal_ui, then pal_ui_sft, on the recorded steps: the workspace, the teacher version and the episodes that
    have chat samples."""
    root, snapshots = recorded
    model.retrieve, model.wrong, model.wrong_first, model.blank = 0, False, 0, False
    ws = workspace(root, model.url, cache=False, min_step=1, retrieval_share=0.3)
    run = ws.ledger.open_run("test", label).run_id
    teacher = run_inline(pal_ui.STAGE, ws, run, snapshots["steps"])["pal_ui_teacher"]
    run_inline(pal_ui_sft.STAGE, ws, run, teacher)
    return ws, teacher, set(ws.catalog.load("pal_ui_sft")["episode_id"])


def _pal_ui_commit(ws: Workspace, label: str, files: list[Path], withdrawn: str | None = None) -> tuple[str, int]:
    """A pal_ui run's commit of `files` to pal_ui_teacher, taking out `withdrawn`'s passes: its run id and version."""
    run_id = ws.ledger.open_run("test", label).run_id
    lineage = Lineage(stage="pal_ui", run_id=run_id, commit_key=commit_key(run_id, "pal_ui", "pal_ui_teacher"),
                      config_hash="x", code_version="x")
    withdraw = Withdrawal("episode_id", frozenset({withdrawn})) if withdrawn else None
    return run_id, ws.catalog.commit_files("pal_ui_teacher", files, lineage, "append", withdraw)


def test_an_episode_whose_passes_pal_ui_withdrew_loses_its_chat_samples(recorded, model):
    """pal_ui takes an episode's passes out and writes none again (the critics have since rejected it: `load_trusted`
    withdraws it): pal_ui_sft run on that version takes the episode's chat samples out too, counted."""
    ws, _, held = _taught(recorded, model, "before the withdrawal")
    gone = sorted(held)[0]
    later, version = _pal_ui_commit(ws, "withdrawing", [], gone)  # a run that only withdrew
    sft = run_inline(pal_ui_sft.STAGE, ws, later, version)["pal_ui_sft"]
    assert set(ws.catalog.load("pal_ui_sft")["episode_id"]) == held - {gone}
    assert ws.catalog.lineage("pal_ui_sft", sft).stats["withdrawn: no kept teacher pass left"] == 1


def test_an_episode_done_again_with_no_pass_kept_loses_its_chat_samples_after_any_number_of_pal_ui_runs(recorded,
                                                                                                         model):
    """pal_ui does an episode again (a step critique changed) and its teacher matches none of the new passes: the
    old passes are replaced by one not kept. pal_ui_sft, run only after a later pal_ui run that did nothing, still
    takes the episode's chat samples out: it goes by what the version holds, not by what changed last."""
    ws, teacher, held = _taught(recorded, model, "before the redo")
    redone = sorted(held)[-1]
    unkept = ws.catalog.load("pal_ui_teacher", teacher).filter(pl.col("episode_id") == redone).head(1).with_columns(
        kept=pl.lit(False))
    path = ws.catalog.data_dir("pal_ui_teacher") / "redone.parquet"
    write_parquet_atomic(to_arrow("pal_ui_teacher", unkept.to_dicts()), path)
    _pal_ui_commit(ws, "redone, nothing kept", [path], redone)
    quiet, version = _pal_ui_commit(ws, "a pal_ui run with nothing to do", [])
    sft = run_inline(pal_ui_sft.STAGE, ws, quiet, version)["pal_ui_sft"]
    assert set(ws.catalog.load("pal_ui_sft")["episode_id"]) == held - {redone}
    assert ws.catalog.lineage("pal_ui_sft", sft).stats["withdrawn: no kept teacher pass left"] == 1


def test_a_rerun_on_an_older_teacher_version_leaves_the_chat_samples_of_later_nights_alone(recorded, model):
    """`trajforge run pal_ui_sft --input pal_ui_teacher@OLDER`: that version holds no pass of the episodes a later
    night taught, so it has no say over their chat samples; the rerun withdraws none of them."""
    ws, older, _ = _taught(recorded, model, "the older night")
    later_episode = "an episode of a later night"
    later = ws.ledger.open_run("test", "a later night").run_id
    kept = ws.catalog.load("pal_ui_teacher", older).filter(pl.col("kept")).head(1).with_columns(
        run_id=pl.lit(later), episode_id=pl.lit(later_episode), sample_id=pl.lit("a later pass"),
        step_id=pl.lit("a later step"))
    path = ws.catalog.data_dir("pal_ui_teacher") / "later.parquet"
    write_parquet_atomic(to_arrow("pal_ui_teacher", kept.to_dicts()), path)
    lineage = Lineage(stage="pal_ui", run_id=later, commit_key=commit_key(later, "pal_ui", "pal_ui_teacher"),
                      config_hash="x", code_version="x")
    run_inline(pal_ui_sft.STAGE, ws, later, ws.catalog.commit_files("pal_ui_teacher", [path], lineage, "append"))
    before = set(ws.catalog.load("pal_ui_sft")["episode_id"])
    assert later_episode in before
    rerun = ws.ledger.open_run("test", "again on the older night").run_id
    sft = run_inline(pal_ui_sft.STAGE, ws, rerun, older)["pal_ui_sft"]
    assert set(ws.catalog.load("pal_ui_sft")["episode_id"]) == before
    assert "withdrawn: no kept teacher pass left" not in ws.catalog.lineage("pal_ui_sft", sft).stats

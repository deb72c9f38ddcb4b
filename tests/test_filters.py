"""The online rejection-sampling filters (GUI-Owl 2.2.3), each driven with rows that must pass and rows that
must not, through the export that applies them."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from PIL import Image

from trajforge.data.blobs import BlobStore
from trajforge.envs.axtree import AXNode, render
from trajforge.schemas.config import SynthSettings
from trajforge.schemas.records import Episode, Step
from trajforge.synth.export import ExportUnit, StepLabel, export
from trajforge.synth.filters import Reflection, balance_reflections, consistent, critic_score, weights

TREE = render([AXNode(0, "RootWebArea", "Shop"), AXNode(1, "link", "Cart", box=(10, 10, 80, 30)),
               AXNode(1, "link", "Orders", box=(100, 10, 80, 30)),
               AXNode(1, "textbox", "Search", box=(10, 60, 200, 30))])


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def _png(blobs: BlobStore, shade: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (390, 844), (shade, shade, shade)).save(buf, format="PNG")
    return blobs.put(buf.getvalue()).sha256


def _step(blobs: BlobStore, i: int, thought: str, *, action: str = "click", target: str | None = "Cart",
          roles: dict | None = None) -> Step:
    args = {"x": 50, "y": 25} if action == "click" else {"text": "milk"} if action == "type" else {}
    return Step(run_id="r", step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before=_png(blobs, i),
                screenshot_after=_png(blobs, i + 1), width=390, height=844, url_before="u", url_after="u",
                title_before="t", title_after="t", ax_tree_before=TREE, action_type=action,
                action_json=json.dumps(args),
                action_valid=True, target_role="link" if target else None, target_name=target, thought=thought,
                raw_output="", duration_ms=1, roles_json=json.dumps(roles) if roles else None)


def _episode(query: str = "q") -> Episode:
    now = datetime.now(UTC)
    return Episode(run_id="r", episode_id="e", query_id=query, app="shop", instruction="Open the cart", policy="p",
                   model_id="m", prompt_version="1", viewport="mobile", status="terminated", num_steps=3,
                   final_url="u", final_state_json="{}", started_at=now, finished_at=now)


def _export(units: list[ExportUnit], blobs: BlobStore, **settings):
    return export(units, run_id="r", tag="t", blobs=blobs, settings=SynthSettings(**settings))


def test_filter_1_keeps_a_step_whose_critic_score_reaches_tau_c(blobs):
    steps = [_step(blobs, i, "Tap the Cart link.") for i in range(3)]
    labels = {s.step_id: StepLabel(label, "s") for s, label in zip(steps, ("GOOD", "NEUTRAL", "HARMFUL"), strict=True)}
    unit = ExportUnit(_episode(), steps, True, labels)
    assert [critic_score(x) for x in ("GOOD", "NEUTRAL", "HARMFUL", None)] == [1.0, 0.5, 0.0, None]
    half = _export([unit], blobs, tau_c=0.5)
    assert [r.label for r in half.rows["train_e2e"]] == ["GOOD", "NEUTRAL"]
    assert half.dropped == {"filter 1: critic score 0.0 below tau_c 0.5 (HARMFUL)": 1}
    strict = _export([unit], blobs, tau_c=0.75)
    assert [(r.label, r.score) for r in strict.rows["train_e2e"]] == [("GOOD", 1.0)]
    assert strict.dropped["filter 1: critic score 0.5 below tau_c 0.75 (NEUTRAL)"] == 1


def test_a_click_that_changed_nothing_is_history_not_a_target(blobs):
    """The pre-filter settles a click that changed nothing as NEUTRAL, which passes tau_c 0.5: it is dropped as a
    target but stays in the later steps' history; the terminate, which changes nothing by nature, is kept."""
    steps = [_step(blobs, 0, "Tap the Cart link."), _step(blobs, 1, "Tap the Cart link."),
             _step(blobs, 2, "Done.", action="terminate", target=None)]
    labels = {"e:0": StepLabel("GOOD", "opened the cart"),
              "e:1": StepLabel("NEUTRAL", "click: no change", ("no_change",)),
              "e:2": StepLabel("NEUTRAL", "terminated the episode", ("no_change",))}
    out = _export([ExportUnit(_episode(), steps, True, labels)], blobs)
    assert [r.step_id for r in out.rows["train_e2e"]] == ["e:0", "e:2"]
    assert out.dropped == {"no change: the action changed neither screen, tree nor URL (pre-filter)": 1}
    assert "click: no change" in out.rows["train_e2e"][1].messages_json


def test_a_trajectory_the_critics_did_not_accept_is_counted_once_by_a_reason_that_says_episodes(blobs):
    """The report lists drops beside kept rows under one header: the other reasons count steps, this one counts
    the episode (of 3 steps here, each labelled GOOD), so its reason names the unit."""
    steps = [_step(blobs, i, "Tap the Cart link.") for i in range(3)]
    unit = ExportUnit(_episode(), steps, False, {s.step_id: StepLabel("GOOD", "s") for s in steps})
    out = _export([unit], blobs)
    assert out.rows["train_e2e"] == []
    assert out.dropped == {"trajectory not accepted by the critics (episodes)": 1}


def test_filter_2_drops_a_thought_that_names_another_element_or_action(blobs):
    assert consistent("Tap the Cart link at the top.", "click", "Cart", TREE).ok
    assert consistent("", "click", "Cart", TREE).reason == "no thought to check"
    assert consistent("Nothing here contradicts it.", "click", "Cart", TREE).ok
    other = consistent("I should open Orders to see the order.", "click", "Cart", TREE)
    assert not other.ok and other.rule == "element" and "'orders'" in other.reason
    kind = consistent("Scroll down to find the cart.", "click", "Cart", TREE)
    assert not kind.ok and kind.rule == "kind of action"
    assert consistent("Type milk into the Search box.", "type", "Search", TREE).ok
    steps = [_step(blobs, 0, "Click the Cart link."), _step(blobs, 1, "Open Orders now.")]
    unit = ExportUnit(_episode(), steps, True, {s.step_id: StepLabel("GOOD", "s") for s in steps})
    out = _export([unit], blobs)
    assert [r.step_id for r in out.rows["train_e2e"]] == ["e:0"]
    assert out.dropped == {"filter 2: the thought names another element": 1}
    assert len(_export([unit], blobs, consistency="off").rows["train_e2e"]) == 2
    # a reference replay's thought is written from its action ("transition 2/5 (search -> dish): press Enter.",
    # where a "Search" button is on the screen): it is not read
    replayed = ExportUnit(_episode().model_copy(update={"policy": "replay"}), steps, True, unit.labels)
    assert len(_export([replayed], blobs).rows["train_e2e"]) == 2


def test_filter_2_reads_whole_element_names_the_longest_first_and_verbs_beside_them():
    """A name inside a longer name the thought gives is not read on its own: a thought that names another element
    than the one the action hit is caught even when the names overlap. An element's name is no verb, and "enter"
    goes into a page as well as types."""
    tree = render([AXNode(0, "RootWebArea", "Shop"), AXNode(1, "link", "Cart", box=(10, 10, 80, 30)),
                   AXNode(1, "button", "Add to cart", box=(10, 50, 80, 30)),
                   AXNode(1, "link", "All settings", box=(10, 90, 80, 30)),
                   AXNode(1, "link", "Settings", box=(10, 130, 80, 30)),
                   AXNode(1, "button", "Save draft", box=(10, 170, 80, 30)),
                   AXNode(1, "button", "Save", box=(10, 210, 80, 30)),
                   AXNode(1, "button", "Done", box=(10, 250, 80, 30)),
                   AXNode(1, "textbox", "Type a message", box=(10, 290, 200, 30))])
    for thought, hit, said in (("Tap 'Add to cart'.", "Cart", "add to cart"), ("Tap Settings.", "All settings",
                               "settings"), ("Tap 'Save draft'.", "Save", "save draft")):
        near = consistent(thought, "click", hit, tree)
        assert not near.ok and near.rule == "element" and f"{said!r}" in near.reason, (thought, near)
    assert consistent("Tap 'Add to cart'.", "click", "Add to cart", tree).ok
    assert consistent("Tap Save, not Save draft.", "click", "Save", tree).ok  # the target among the names
    assert consistent("Enter the Settings page.", "click", "Settings", tree).ok
    assert consistent("The Done button saves the note.", "click", "Done", tree).ok
    assert consistent("Focus the Type a message box.", "click", "Type a message", tree).ok
    # Outside the names the verbs still count: a thought that scrolls to the element is no click on it.
    scroll = consistent("Scroll down to the Settings link.", "click", "Settings", tree)
    assert not scroll.ok and scroll.rule == "kind of action"


def test_filter_2_reads_a_terminate_word_after_be_as_a_state_not_as_the_action():
    """A terminate word after "is" or "are" says what a thing is ("the form is complete"); "Done." decides."""
    for thought in ("The form is complete, so I submit it.", "The fields are done; tap Cart to pay."):
        assert consistent(thought, "click", "Cart", TREE).ok, thought
    stop = consistent("Done: the cart holds the milk.", "click", "Cart", TREE)
    assert not stop.ok and stop.rule == "kind of action"


def test_filter_2_reads_a_fields_name_in_the_way_thoughts_say_it():
    """The shop's search page has a searchbox "Search dishes" and a button "Search": a thought about the box says
    "search", which is the button's whole name. "The search box" is the field's; and typing or a key goes to the
    focused field, so a button's name beside it names nothing typed into. A click on another element named by
    part of its name, without the field word, is still caught."""
    tree = render([AXNode(0, "RootWebArea", "Search"), AXNode(1, "searchbox", "Search dishes", box=(16, 160, 274, 44)),
                   AXNode(1, "button", "Search", box=(298, 160, 98, 44))])
    for thought, action in (("Type Pad Thai into the search box.", "type"), ("Tap the search box.", "click"),
                            ("Press Enter to search.", "key"), ("I search for Pad Thai.", "type")):
        assert consistent(thought, action, "Search dishes", tree).ok, thought
    assert not consistent("Tap Search to find the dish.", "click", "Search dishes", tree).ok  # the button's name

def test_filter_3_weights_hard_tasks_up_and_easy_ones_down(blobs):
    w = weights({"easy": 1.0, "mid": 0.5, "hard": 0.0}, smoothing=0.1, low=0.25, high=4.0)
    assert w["easy"] == 0.25 and w["hard"] > w["mid"] > w["easy"] and w["mid"] == pytest.approx(1.0)
    assert weights({}, smoothing=0.1, low=0.25, high=4.0) == {}
    step = _step(blobs, 0, "Click the Cart link.")
    unit = ExportUnit(_episode("hard"), [step], True, {step.step_id: StepLabel("GOOD", "s")}, 0.0, w["hard"])
    [row] = _export([unit], blobs).rows["train_e2e"]
    assert row.p_succ == 0.0 and row.weight == w["hard"]


def test_filter_4_keeps_reflections_that_the_next_step_confirms_then_balances_them():
    candidates = [
        Reflection("neg-confirmed-1", "FAILURE", "GOOD", False),
        Reflection("neg-confirmed-2", "FAILURE", "NEUTRAL", False),
        Reflection("neg-unconfirmed", "FAILURE", "HARMFUL", True),
        Reflection("pos-clean-1", "SUCCESS", "GOOD", True), Reflection("pos-clean-2", "SUCCESS", "GOOD", True),
        Reflection("pos-clean-3", "SUCCESS", "GOOD", True), Reflection("pos-dirty", "SUCCESS", "GOOD", False),
    ]
    kept, dropped = balance_reflections(candidates)
    ids = {k.sample_id for k in kept}
    assert {"neg-confirmed-1", "neg-confirmed-2"} <= ids and "neg-unconfirmed" not in ids and "pos-dirty" not in ids
    assert sum(k.outcome == "SUCCESS" for k in kept) == sum(k.outcome == "FAILURE" for k in kept) == 2
    assert dropped == {"reflector FAILURE not followed by a positive step": 1,
                       "reflector SUCCESS from a trajectory with a step not positive": 1,
                       "reflector SUCCESS beyond the 1:1 balance": 1}
    rerun, _ = balance_reflections(list(reversed(candidates)))
    assert {k.sample_id for k in rerun} == ids  # the cut is by a hash of the id: another order keeps the same rows


def test_each_role_of_an_accepted_team_trajectory_gets_its_table(blobs):
    manager = {"inputs": {"knowledge": "", "guidance": None, "completed": [], "pending": ["open cart"],
                          "last_action": "", "outcome": "", "feedback": "", "notes": []},
               "raw_output": '{"pending_subgoals": ["open cart"]}', "output": {"pending_subgoals": ["open cart"]},
               "parse_error": None}
    worker = {"inputs": {"platform": "mobile", "width": 390, "height": 844, "pending": ["open cart"],
                         "feedback": "", "notes": []},
              "raw_output": '{"thought": "tap Cart", "action": {"action": "click", "coordinate": [50, 25]}}',
              "output": {"thought": "tap Cart"}, "parse_error": None}
    reflector = {"inputs": {"action": "{}", "summary": "tapped"}, "raw_output": '{"outcome": "SUCCESS"}',
                 "output": {"outcome": "SUCCESS"}, "parse_error": None}
    notetaker = {"inputs": {"notes": []}, "raw_output": "garbage", "output": None, "parse_error": "did not parse"}
    steps = [_step(blobs, 0, "Tap the Cart link.", roles={"manager": manager, "worker": worker}),
             _step(blobs, 1, "Tap the Cart link.", roles={"reflector": reflector, "manager": manager,
                                                         "worker": worker, "notetaker": notetaker})]
    unit = ExportUnit(_episode(), steps, True, {s.step_id: StepLabel("GOOD", "s") for s in steps})
    out = _export([unit], blobs)
    assert len(out.rows["train_manager"]) == len(out.rows["train_worker"]) == 2
    assert out.rows["train_notetaker"] == [] and out.dropped["notetaker: its answer did not parse"] == 1
    # One SUCCESS and no FAILURE: the 1:1 balance keeps none.
    assert out.rows["train_reflector"] == [] and out.dropped["filter 4: reflector SUCCESS beyond the 1:1 balance"] == 1
    messages = json.loads(out.rows["train_worker"][0].messages_json)
    assert messages[-1]["content"][0]["text"] == worker["raw_output"] and len(out.rows["train_worker"][0].images) == 1
    assert "click" in messages[0]["content"][0]["text"]  # the worker's prompt lists the action space

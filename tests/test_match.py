"""The one action-matching rule: what counts as the trusted action, and what does not."""

from __future__ import annotations

from trajforge.schemas.records import Step
from trajforge.synth.match import match, text_f1
from trajforge.synth.trusted import prediction_schema

BOX = [100.0, 200.0, 80.0, 40.0]  # x, y, w, h


def test_a_point_matches_inside_the_target_box_or_within_the_tolerance_of_a_boxless_trusted_point():
    trusted = {"type": "click", "x": 140, "y": 220}
    inside = match({"type": "click", "x": 175, "y": 235}, trusted, target_box=BOX)
    assert inside.ok and "inside the target box" in inside.reason
    # No margin around a box: a prediction held to element centres that lands just beside the target is the next
    # element's centre (an icon at (190, 220) right of the box), not the target.
    beside = match({"type": "click", "x": 190, "y": 220}, trusted, target_box=BOX, tolerance=14)
    assert not beside.ok and "outside the target box" in beside.reason
    # Without a box, the distance to the trusted point decides.
    assert match({"type": "click", "x": 150, "y": 220}, trusted).ok
    assert not match({"type": "click", "x": 170, "y": 220}, trusted).ok


def test_the_type_must_agree_aliases_resolved():
    assert not match({"type": "long_press", "x": 140, "y": 220}, {"type": "click", "x": 140, "y": 220}).ok
    assert match({"type": "press", "key": "Enter"}, {"type": "key", "key": "Enter"}).ok
    assert not match({"type": "key", "key": "Tab"}, {"type": "key", "key": "Enter"}).ok


def test_text_needs_a_token_f1_above_one_half():
    trusted = {"type": "type", "text": "buy milk and eggs"}
    assert match({"type": "type", "text": "Buy milk and eggs"}, trusted).ok
    assert match({"type": "type", "text": "buy milk and bread"}, trusted).ok  # F1 0.75
    assert not match({"type": "type", "text": "buy bread"}, trusted).ok  # F1 0.33
    assert text_f1("", "") == 1.0 and text_f1("a", "") == 0.0


def test_a_scroll_or_swipe_matches_by_direction_not_by_distance():
    assert match({"type": "scroll", "x": 10, "y": 10, "dy": 900}, {"type": "scroll", "x": 300, "y": 400, "dy": 300}).ok
    down = {"type": "scroll", "x": 10, "y": 10, "dy": 300}
    assert not match({"type": "scroll", "x": 10, "y": 10, "dy": -300}, down).ok
    up = {"type": "swipe", "x": 200, "y": 700, "x2": 200, "y2": 200}
    assert match({"type": "swipe", "x": 100, "y": 600, "x2": 110, "y2": 100}, up).ok
    assert match({"type": "swipe", "x": 100, "y": 600, "x2": 600, "y2": 580}, up).reason == "direction right is not up"


def test_a_drag_must_pick_up_at_the_target_and_drop_near_the_trusted_drop_point():
    """A drag is not a scroll: its direction alone (both go down here) says nothing about what it moves where."""
    trusted = {"type": "drag", "x": 100, "y": 200, "x2": 100, "y2": 500}
    box = [80.0, 180.0, 40.0, 40.0]
    elsewhere = match({"type": "drag", "x": 900, "y": 10, "x2": 900, "y2": 700}, trusted, target_box=box)
    assert not elsewhere.ok and "outside the target box" in elsewhere.reason
    assert match({"type": "drag", "x": 110, "y": 210, "x2": 105, "y2": 510}, trusted, target_box=box).ok
    short = match({"type": "drag", "x": 110, "y": 210, "x2": 100, "y2": 300}, trusted, target_box=box)
    assert not short.ok and short.reason == "drop point 200 px from the trusted point"
    # without a box, the start is held to the trusted start as a click's point is
    assert not match({"type": "drag", "x": 140, "y": 200, "x2": 100, "y2": 500}, trusted).ok


def test_keys_match_by_the_browsers_names_in_either_spaces_form():
    """A desktop step recorded in the phone's form ({"key": "Enter"}) is what a desktop prediction, held by its
    call schema to `keys`, must be able to match; and 'enter' is the key 'Enter' (`actions.key_name`)."""
    recorded = {"type": "key", "key": "Enter"}
    assert match({"type": "key", "keys": ["Enter"]}, recorded).ok
    assert match({"type": "key", "keys": ["enter"]}, {"type": "key", "keys": ["Enter"]}).ok
    assert match({"type": "key", "key": "enter"}, recorded).ok
    assert match({"type": "key", "keys": ["ctrl", "a"]}, {"type": "key", "keys": ["Control", "a"]}).ok
    wrong = match({"type": "key", "keys": ["Control", "a"]}, {"type": "key", "keys": ["Control", "c"]})
    assert not wrong.ok and wrong.reason == "keys ['Control', 'a'] are not ['Control', 'c']"
    assert not match({"type": "key", "keys": ["Enter", "a"]}, recorded).ok


def test_terminate_matches_on_its_status():
    assert match({"type": "terminate", "status": "success"}, {"type": "terminate", "status": "success"}).ok
    assert not match({"type": "terminate", "status": "failure"}, {"type": "terminate", "status": "success"}).ok


def _step(tree: str) -> Step:
    return Step(run_id="r", step_id="s", episode_id="e", step_index=0, screenshot_before="a", screenshot_after="a",
                width=390, height=844, url_before="u", url_after="u", title_before="t", title_after="t",
                ax_tree_before=tree, action_type="click", action_json="{}", action_valid=True, thought="",
                raw_output="", duration_ms=1.0)


def _click_point(schema: dict) -> dict:
    click = next(b for b in schema["properties"]["arguments"]["anyOf"] if b["properties"]["action"] == {"const": "click"})
    return click["properties"]["coordinate"]


def test_a_prediction_may_point_only_at_an_element_centre_unless_points_are_free():
    tree = ('main\n  button "Save" (40,40,20,20)\n  link "Cart" [covered] (0,0,10,10)\n  text "Total" (140,140,21,20)'
            '\n  button "Off screen" (500,900,10,10)')
    step = _step(tree)
    # the centres of the boxed elements on the screen; the covered link cannot be clicked, so it is not offered
    assert _click_point(prediction_schema("mobile", step, "elements")) == {"enum": [[50, 50], [150, 150]]}
    free = _click_point(prediction_schema("mobile", step, "free"))
    assert free["prefixItems"][0]["maximum"] == 389 and free["prefixItems"][1]["maximum"] == 843
    # a tree that does not parse, or offers no box, leaves the point free rather than offering nothing
    assert "prefixItems" in _click_point(prediction_schema("mobile", _step('button "unterminated'), "elements"))
    assert "prefixItems" in _click_point(prediction_schema("mobile", _step("main"), "elements"))


def test_a_named_prediction_chooses_among_the_clickable_elements_by_name():
    tree = ('main\n  button "Save" (40,40,20,20)\n  link "Cart" [covered] (0,0,10,10)\n  text "Total" (140,140,21,20)'
            '\n  button "Off screen" (500,900,10,10)\n  link "Help" (100,200,40,20)')
    clicks = [b for b in prediction_schema("mobile", _step(tree), "names")["properties"]["arguments"]["anyOf"]
              if b["properties"]["action"] == {"const": "click"}]
    # one branch per named, interactive, uncovered element on the screen; its point is the element's centre
    assert [(c["properties"]["target"], c["properties"]["coordinate"]) for c in clicks] == [
        ({"const": "Save"}, {"const": [50, 50]}), ({"const": "Help"}, {"const": [120, 210]})]
    # nothing to name (static text only): the click falls back to the element centres
    assert _click_point(prediction_schema("mobile", _step('main\n  text "Total" (140,140,21,20)'), "names")) == {
        "enum": [[150, 150]]}

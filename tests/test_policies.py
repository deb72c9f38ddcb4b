"""The model-driven policies: the action space as a function, and answers turned into actions."""

from __future__ import annotations

import json

import pytest

from trajforge.envs import actions
from trajforge.envs.browser import Target
from trajforge.llm.structured import ParseError, parse
from trajforge.rollout.gui_owl import FUNCTIONS, MAX_TARGETS, ToolCall, call_schema, to_action, tool_spec


@pytest.mark.parametrize("space", ["mobile", "desktop"])
def test_tool_spec_lists_exactly_the_space_the_validator_accepts(space):
    function = json.loads(tool_spec(space))["function"]
    assert function["name"] == FUNCTIONS[space]
    assert function["parameters"]["properties"]["action"]["enum"] == list(actions.SPACES[space])
    for kind in actions.SPACES[space]:
        assert f"* {kind}(" in function["description"]


ANSWER = """<thinking>The cart link is at the top right.</thinking>
<conclusion>Open the cart.</conclusion>
<tool_call>
{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [380, 42]}}
</tool_call>"""


def test_a_gui_owl_answer_becomes_a_valid_action():
    call = parse(ANSWER, "tool_call", ToolCall)
    action = to_action(call, "mobile_use")
    assert action == {"type": "click", "x": 380, "y": 42}
    assert actions.validate(action, 412, 915, "mobile") is None


def test_a_named_click_is_held_to_each_named_elements_centre():
    targets = [Target("button", "Add to cart", 100, 200), Target("link", "Cart", 300, 40),
               Target("button", "Add to cart", 100, 600)]  # a second "Add to cart" lower down
    branches = call_schema("mobile", 412, 915, targets=targets)["properties"]["arguments"]["anyOf"]
    clicks = [b["properties"] for b in branches if b["properties"]["action"]["const"] == "click"]
    assert [(c["target"]["const"], c["coordinate"]["const"]) for c in clicks] == [
        ("Add to cart", [100, 200]), ("Cart", [300, 40]), ("Add to cart (2)", [100, 600])]  # each one reachable
    assert {b["properties"]["action"]["const"] for b in branches} == set(actions.SPACES["mobile"])
    many = [Target("button", f"Item {i}", 10, 10 + i) for i in range(MAX_TARGETS + 5)]
    branches = call_schema("mobile", 412, 915, targets=many)["properties"]["arguments"]["anyOf"]
    assert sum(b["properties"]["action"]["const"] == "click" for b in branches) == MAX_TARGETS
    call = ToolCall(name="mobile_use", arguments={"action": "click", "target": "Cart", "coordinate": [300, 40]})
    assert to_action(call, "mobile_use") == {"type": "click", "x": 300, "y": 40}  # the name is not an argument


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"action": "swipe", "coordinate": [200, 800], "coordinate2": [200, 300], "time": 0.5},
         {"type": "swipe", "x": 200, "y": 800, "x2": 200, "y2": 300, "duration": 0.5}),
        ({"action": "wait", "time": 2}, {"type": "wait", "seconds": 2}),
        ({"action": "system_button", "button": "Back"}, {"type": "system_button", "button": "Back"}),
        ({"action": "terminate", "status": "success"}, {"type": "terminate", "status": "success"}),
    ],
)
def test_arguments_map_to_the_flat_action(arguments, expected):
    assert to_action(ToolCall(name="mobile_use", arguments=arguments), "mobile_use") == expected
    assert actions.validate(expected, 412, 915, "mobile") is None


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (ToolCall(name="computer_use", arguments={"action": "click"}), "not 'mobile_use'"),
        (ToolCall(name="mobile_use", arguments={"coordinate": [1, 2]}), "no action"),
        (ToolCall(name="mobile_use", arguments={"action": "click", "coordinate": [1]}), r"\[x, y\]"),
        # a stray argument must not overwrite the point or the action the model named
        (ToolCall(name="mobile_use", arguments={"action": "click", "coordinate": [10, 20], "x": 300}),
         "'x' is not an argument"),
        (ToolCall(name="mobile_use", arguments={"action": "click", "coordinate": [10, 20], "type": "long_press"}),
         "'type' is not an argument"),
        (ToolCall(name="mobile_use", arguments={"action": "type", "text": "hi", "target": "Search"}),
         "'target' is not an argument"),
    ],
)
def test_malformed_calls_say_what_is_wrong(call, error):
    with pytest.raises(ValueError, match=error):
        to_action(call, "mobile_use")


def test_an_answer_without_a_call_is_a_parse_error_not_a_guess():
    with pytest.raises(ParseError, match="exactly one <tool_call>"):
        parse("<conclusion>Click the cart.</conclusion> click(380, 42)", "tool_call", ToolCall)

"""The model-driven policies: the action space as a function, and answers turned into actions."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image
from scripted import Reply, ScriptedServer

from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.envs.browser import Observation, Target
from trajforge.llm import Gateway
from trajforge.llm.structured import ParseError, parse
from trajforge.rollout.gui_owl import FUNCTIONS, MAX_TARGETS, ToolCall, call_schema, to_action, tool_spec
from trajforge.rollout.mobile_agent import MobileAgentPolicy
from trajforge.schemas.config import LLMSettings
from trajforge.schemas.records import Query


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


def _screen(url: str) -> Observation:
    buf = io.BytesIO()
    Image.new("RGB", (412, 915), "white").save(buf, format="PNG")
    return Observation(png=buf.getvalue(), width=412, height=915, url=url, title="t", nodes=())


def test_mobile_agent_roles_record_what_they_were_asked_and_refuse_what_they_do_not_define(tmp_path):
    """Two steps of the team against a scripted server: the Notetaker's recorded inputs are the notes it was shown,
    not the list its own answer was added to, and a Worker action or a Reflection with a key it does not define
    is a recorded parse error, not an action with the stray key copied in or ignored."""
    plan = '{"thought": "", "completed_subgoals": [], "pending_subgoals": ["open the cart"]}'
    replies = [Reply(plan), Reply('{"thought": "", "action": {"action": "click", "coordinate": [10, 20], "x": 300}}'),
               Reply('{"outcome": "SUCCESS", "feedback": ""}'), Reply('{"notes": ["code is 1234"]}'), Reply(plan),
               Reply('{"thought": "", "action": {"action": "click", "coordinate": [10, 20]}}'),
               Reply('{"outcome": "SUCCESS", "verdict": "FAILURE"}'), Reply(plan),
               Reply('{"thought": "", "action": {"action": "wait"}}')]
    llm = LLMSettings.model_validate({"endpoints": {"m": {"base_url": "", "model": "scripted", "max_retries": 0,
                                                          "timeout_s": 5}}, "default": "m", "reask": 0, "cache": False})
    with ScriptedServer(*replies) as server:
        llm.endpoints["m"].base_url = server.url
        with Gateway(llm, blobs=BlobStore(tmp_path / "blobs")) as gateway:
            policy = MobileAgentPolicy(gateway, viewport="mobile")
            policy.reset(Query.model_construct(query_id="q", instruction="Open the cart"))
            first = policy.act(_screen("/"), None)
            second = policy.act(_screen("/a"), None)
            third = policy.act(_screen("/b"), None)
    assert first.action == {} and "'x' is not an argument" in first.error
    assert second.roles["notetaker"]["inputs"]["notes"] == []  # what it was shown, before its own answer
    assert second.roles["manager"]["inputs"]["notes"] == ["code is 1234"]
    assert second.action == {"type": "click", "x": 10, "y": 20}
    assert third.roles["reflector"]["output"] is None and "verdict" in third.roles["reflector"]["parse_error"]
    assert third.action == {"type": "wait"}

"""GUI-Owl's end-to-end policy (paper section 2.1): one model call per step.

The system message holds the action space as one Qwen function (`mobile_use` or
`computer_use`, with GUI-Owl's argument names: action, coordinate, coordinate2, text,
time, ...); the user message holds the task, the optional guidance, the history, and
the newest screenshots. The answer reasons, concludes, and calls the function. Only the
conclusion enters the history, so long reasoning does not grow every later prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from trajforge.envs import actions
from trajforge.envs.browser import Observation, Target
from trajforge.llm import Gateway, ImagePart, load_prompt
from trajforge.rollout.policy import Draw, PolicyOutput
from trajforge.schemas.config import ClickTargets
from trajforge.schemas.records import Query

PROMPT = "gui_owl_e2e"
FUNCTIONS = {"mobile": "mobile_use", "desktop": "computer_use"}

_DESCRIPTIONS = {
    "key": "Press a key (key), e.g. Enter or Backspace.",
    "click": "Click (tap) at coordinate.",
    "long_press": "Press and hold at coordinate for time seconds.",
    "swipe": "Swipe from coordinate to coordinate2 (scrolls the page the other way).",
    "type": "Type text into the focused field.",
    "answer": "Answer the user with text.",
    "system_button": "Press a system button: Back, Home, Menu or Enter.",
    "open": "Open the app named text.",
    "wait": "Wait time seconds for the screen to change.",
    "terminate": "End the task; status is success or failure.",
    "mouse_move": "Move the pointer to coordinate.",
    "drag": "Press at coordinate, drag to coordinate2 and release.",
    "right_click": "Right-click at coordinate.",
    "middle_click": "Middle-click at coordinate.",
    "double_click": "Double-click at coordinate.",
    "scroll": "Turn the mouse wheel at coordinate by dy pixels (positive shows what is below).",
}
_DESKTOP_DESCRIPTIONS = {
    "key": "Press keys together, e.g. [\"ctrl\", \"a\"], released in reverse order.",
    "type": "Type text; clear the field first if clear is true; press Enter after if enter is true.",
}
# Our flat argument -> GUI-Owl's argument name and JSON schema.
_ARGS: dict[str, tuple[str, dict[str, Any]]] = {
    "x": ("coordinate", {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}),
    "x2": ("coordinate2", {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}),
    "text": ("text", {"type": "string"}),
    "key": ("key", {"type": "string"}),
    "keys": ("keys", {"type": "array", "items": {"type": "string"}}),
    "button": ("button", {"enum": list(actions.SYSTEM_BUTTONS)}),
    "status": ("status", {"enum": list(actions.TERMINATE_STATUSES)}),
    "seconds": ("time", {"type": "number"}),
    "duration": ("time", {"type": "number"}),
    "clear": ("clear", {"type": "boolean"}),
    "enter": ("enter", {"type": "boolean"}),
    "dy": ("dy", {"type": "number"}),
    "dx": ("dx", {"type": "number"}),
}


class ToolCall(BaseModel):
    """The JSON inside <tool_call>: which function, with which arguments."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict[str, Any]


def action_lines(space: actions.Space) -> list[str]:
    """`* click(coordinate): Click (tap) at coordinate.` for every action of the space."""
    lines = []
    for kind, (required, optional) in actions.SPACES[space].items():
        names = [_ARGS[a][0] for a in (*required, *optional) if a in _ARGS]
        text = (_DESKTOP_DESCRIPTIONS if space == "desktop" else {}).get(kind, _DESCRIPTIONS[kind])
        lines.append(f"* {kind}({', '.join(dict.fromkeys(names))}): {text}")
    return lines


def tool_spec(space: actions.Space) -> str:
    """The action space as one Qwen function definition, from the same table the validator uses."""
    signatures = actions.SPACES[space]
    properties: dict[str, Any] = {"action": {"enum": list(signatures)}}
    for required, optional in signatures.values():
        for arg in (*required, *optional):
            if arg in _ARGS:
                name, schema = _ARGS[arg]
                properties.setdefault(name, schema)
    function = {
        "name": FUNCTIONS[space],
        "description": "Act on the screen. Actions:\n" + "\n".join(action_lines(space)),
        "parameters": {"type": "object", "properties": properties, "required": ["action"]},
    }
    return json.dumps({"type": "function", "function": function})


MAX_TEXT = 80
"""Longest text argument a constrained answer may type (a typed field's value, an answer)."""
MAX_TARGETS = 40
"""Most named elements a click may choose from (the first on the screen, in document order): a longer choice
costs grammar states and prompt-reading the model cannot do anyway."""


def call_schema(space: actions.Space, width: int, height: int, points: list[list[int]] | None = None,
                targets: list[Target] | None = None) -> dict[str, Any]:
    """The function call as a JSON schema, one branch per action with exactly its arguments and points on
    the screen: an answer held to it while decoding is a call the action validator accepts. `points`, when
    given, are the only points an action may name (the end of a drag or swipe stays free).

    With `targets`, a click names one of those elements (`"target": NAME`) and its coordinate is that
    element's centre, one branch per name: a model that reads the screen as text chooses among what it
    can read instead of inventing pixels (the `target` argument is ours, not GUI-Owl's)."""
    point = {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": max(width - 1, 0)},
                                              {"type": "integer", "minimum": 0, "maximum": max(height - 1, 0)}],
             "items": False, "minItems": 2, "maxItems": 2}
    tighter: dict[str, dict[str, Any]] = {
        "x": {"enum": points} if points else point, "x2": point,
        "text": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT},
        "key": {"type": "string", "minLength": 1, "maxLength": 24},
        "keys": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 24}, "minItems": 1,
                 "maxItems": 4},
        "seconds": {"type": "number", "minimum": 0, "maximum": actions.MAX_SECONDS},
        "duration": {"type": "number", "minimum": 0, "maximum": actions.MAX_SECONDS},
    }
    named: dict[str, Target] = {}  # in document order; a name's second element is "NAME (2)", and so on
    for target in (targets or [])[:MAX_TARGETS]:
        name, n = target.name, 1
        while name in named:
            n += 1
            name = f"{target.name} ({n})"
        named[name] = target
    branches = []
    for kind, (required, optional) in actions.SPACES[space].items():
        if kind == "click" and named:
            branches += [{"type": "object", "properties": {"action": {"const": "click"}, "target": {"const": name},
                                                           "coordinate": {"const": [t.x, t.y]}},
                          "required": ["action", "target", "coordinate"], "additionalProperties": False}
                         for name, t in named.items()]
            continue
        properties: dict[str, Any] = {"action": {"const": kind}}
        names = ["action"]
        for arg in (*required, *optional):
            if arg in _ARGS:  # y and y2 travel inside coordinate and coordinate2
                name, schema = _ARGS[arg]
                properties[name] = tighter.get(arg, schema)
                if arg in required:
                    names.append(name)
        branches.append({"type": "object", "properties": properties, "required": names,
                         "additionalProperties": False})
    return {"type": "object", "properties": {"name": {"const": FUNCTIONS[space]}, "arguments": {"anyOf": branches}},
            "required": ["name", "arguments"], "additionalProperties": False}


_GUI_OWL_ARGS = frozenset(name for name, _ in _ARGS.values())


def to_action(call: ToolCall, function: str) -> dict[str, Any]:
    """GUI-Owl's function arguments as a flat action of our space; ValueError says what is wrong.

    An argument GUI-Owl's function does not have is refused rather than copied: a stray `x` or `type` beside
    `coordinate` would otherwise overwrite the point or the action the model named."""
    if call.name != function:
        raise ValueError(f"called {call.name!r}, not {function!r}")
    args = dict(call.arguments)
    kind = args.pop("action", None)
    if not isinstance(kind, str):
        raise ValueError("the call has no action")
    if kind == "click":
        args.pop("target", None)  # which element a named click chose: its coordinate says where
    if unknown := sorted(set(args) - _GUI_OWL_ARGS):
        raise ValueError(f"{kind}: {', '.join(map(repr, unknown))} is not an argument of {function}")
    action: dict[str, Any] = {"type": kind}
    for name, (x, y) in (("coordinate", ("x", "y")), ("coordinate2", ("x2", "y2"))):
        if name in args:
            point = args.pop(name)
            if not (isinstance(point, list) and len(point) == 2):
                raise ValueError(f"{name} must be [x, y], got {point!r}")
            action[x], action[y] = point
    if "time" in args:
        action["seconds" if kind == "wait" else "duration"] = args.pop("time")
    action.update(args)
    return action



def to_call(action: dict[str, Any], function: str) -> dict[str, Any]:
    """A flat action of our space as GUI-Owl's function call: the inverse of `to_action`, for training samples.

    The action is put in the function's space's form first (`actions.canonical`): a desktop step recorded before
    the recorder stored that form says {"key": "enter"}, and `computer_use` has only `keys` ("Enter")."""
    action = actions.canonical(action, "desktop" if function == FUNCTIONS["desktop"] else "mobile")
    args: dict[str, Any] = {"action": action["type"]}
    for key, value in action.items():
        if key in ("x", "x2"):
            args["coordinate" if key == "x" else "coordinate2"] = [value, action["y" if key == "x" else "y2"]]
        elif key in ("seconds", "duration"):
            args["time"] = value
        elif key not in ("type", "y", "y2"):
            args[key] = value
    return {"name": function, "arguments": args}


_THINKING = re.compile(r"<thinking>(.*?)</thinking>", re.DOTALL)
_CONCLUSION = re.compile(r"<conclusion>(.*?)</conclusion>", re.DOTALL)


def click_targets_for(gateway: Gateway, model: str | None, click_targets: ClickTargets) -> ClickTargets:
    """How a constrained click of `model` is held to the screen: `click_targets` ("auto": "points" for a model that
    sees the screen, "names" for one that reads it as text). Anything that asks the policy's prompt outside a
    rollout (agentic-Q's candidates) holds its clicks the same way."""
    if click_targets == "auto":
        return "points" if gateway.sees_images(model) else "names"
    return click_targets


class GuiOwlPolicy:
    """The end-to-end policy over the model gateway; any model the gateway knows can drive it."""

    name = "gui_owl_e2e"

    def __init__(self, gateway: Gateway, *, viewport: str, model: str | None = None, history_images: int = 1,
                 guidance: dict[str, str] | None = None, draw: Draw | None = None,
                 click_targets: ClickTargets = "auto") -> None:
        """`guidance` maps query ids to guidance texts (paper 6.4) given to those queries; `draw` samples
        (None: the prompt's greedy decoding); `click_targets` is how a constrained click is held to the
        screen ("names": to a named element's centre, "points": to any pixel, "auto": names for a model that
        reads the screen as text, points for one that sees it)."""
        self.gateway = gateway
        self.click_targets = click_targets_for(gateway, model, click_targets)
        self.draw = draw
        self.model = model
        self.space = actions.space_for(viewport)
        self.history_images = history_images
        self.guidance = guidance or {}
        self.prompt = load_prompt(PROMPT)
        self._tools = tool_spec(self.space)
        self._model_id = model or "local"
        self._task = ""
        self._query_guidance: str | None = None
        self._history: list[str] = []
        self._screens: list[ImagePart] = []

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def prompt_version(self) -> str:
        return f"{PROMPT}@{self.prompt.version}"

    def reset(self, query: Query) -> None:
        self._task = query.instruction
        self._query_guidance = self.guidance.get(query.query_id)
        self._history, self._screens = [], []

    def act(self, observation: Observation, env: Any) -> PolicyOutput:
        """One model call; an answer that is not a valid call is kept with why, as an invalid step."""
        self._screens = [*self._screens, ImagePart(png=observation.png, ax_tree=observation.ax_tree)]
        self._screens = self._screens[-self.history_images:]
        function = FUNCTIONS[self.space]
        rendered = self.prompt.render(
            platform=self.space, width=observation.width, height=observation.height, tools=self._tools,
            function=function, task=self._task, guidance=self._query_guidance, history=self._history,
            screenshots=self._screens,
        )
        result = self.gateway.chat_sync(rendered, model=self.model, schema=ToolCall,
                                        sampling=self.draw.of(rendered.sampling) if self.draw else None,
                                        json_schema=call_schema(
                                            self.space, observation.width, observation.height,
                                            targets=observation.targets() if self.click_targets == "names" else None))
        self._model_id = result.record.model_id
        text = result.text
        thinking = _THINKING.search(text)
        conclusion = _CONCLUSION.search(text)
        error = result.parse_error
        action: dict[str, Any] = {}
        if result.parsed is not None:
            try:
                action = to_action(result.parsed, function)
            except ValueError as exc:
                error = str(exc)
        thought = thinking.group(1).strip() if thinking else text.split("<tool_call>")[0].strip()
        summary = conclusion.group(1).strip() if conclusion else ""
        # A small model concludes with nothing, or a copy of the prompt ("The screen now is shown"): its history
        # then cannot tell one step from the next and it repeats its last click (measured on SmolLM2). So a named
        # click always enters the history as what it did, the conclusion after it; any other step without a
        # conclusion enters as its action.
        target = result.parsed.arguments.get("target") if result.parsed is not None else None
        if action and isinstance(target, str):
            summary = f"click {target!r}. {summary}".strip()
        elif not summary:
            summary = json.dumps(action) if action else "no valid action"
        self._history.append(summary)
        return PolicyOutput(action, thought, text, calls=result.calls, error=error)

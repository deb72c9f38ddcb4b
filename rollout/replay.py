"""The reference replay policy: walk a query's page path through the app spec's transitions,
then do the query's operations (`actions_json`: an atomic-operation query's one operation).

Each transition's UI actions name elements by accessible role and name; the policy finds
them on the live page at the moment it acts and emits ordinary pixel actions (a click
at the element's centre; typing is a click on the field, then a type action; check,
uncheck and set_checked read the box's state and click only when it must change). So its
episodes look exactly like a model's: screenshots and pixel coordinates, usable as
ground truth for guidance and as grounding data, and a broken spec or app shows up as
a failed episode instead of a silent pass.

Operations (query_gen.operations) become the action space's own actions: a click, a
double or right click, a drag from one element to another, a drag across a passage of
text (its first and last characters' boxes read from the page with a Range), a click
then typing, or scrolling until the element is in view. Text without a nameable element
around it is role "text", named by its text, as the accessibility tree shows it. An
operation the space cannot express (a double click on a phone) ends the episode with
terminate(failure) and says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trajforge.envs.browser import Box, BrowserEnv, Observation
from trajforge.envs.locate import MAX_SCROLLS, find_boxes, is_checked, passage_boxes
from trajforge.envs.operations import SPACE_OPS, Operation, parse_operations
from trajforge.envs.spec import CHECK_OPS, AppSpec
from trajforge.rollout.policy import PolicyOutput
from trajforge.schemas.records import Query


@dataclass(frozen=True)
class _Step:
    """One UI action of the path with its slots filled in."""

    label: str  # "transition 2/3 (search -> dish), action 1/3"
    op: str
    role: str | None
    name: str | None
    text: str | None
    checked: bool | None = None  # check, uncheck, set_checked: the state the element must end in


class SlotError(ValueError):
    """The query's path or slots do not fit the spec."""


def on_screen(box: Box, obs: Observation) -> tuple[int, int]:
    """Where to click a box whose centre is on screen: the centre of its part that shows, in
    whole pixels inside the screen. A menu that overflows a phone's right edge is clicked
    where it shows, and a centre of 411.5 on a 412-pixel screen does not round off it (the
    writer's Help menu on mobile did both, and its reference replay failed)."""
    x, y, w, h = box
    left, top, right, bottom = max(x, 0), max(y, 0), min(x + w, obs.width), min(y + h, obs.height)
    return min(round((left + right) / 2), obs.width - 1), min(round((top + bottom) / 2), obs.height - 1)


def _press(key: str | None, space: str) -> dict[str, Any]:
    """A spec's `op: press` as its space's key action: the phone's {"key": "Enter"}, the desktop's
    {"keys": ["Enter"]} (the desktop space has no single `key`)."""
    return {"type": "key", "keys": [key]} if space == "desktop" else {"type": "key", "key": key}


def plan(spec: AppSpec, path: list[str], slots: dict[str, str]) -> list[_Step]:
    """The UI actions along `path`, placeholders filled from `slots`."""
    graph = spec.graph()
    steps: list[_Step] = []
    hops = list(zip(path, path[1:], strict=False))
    for i, (source, target) in enumerate(hops, 1):
        if not graph.has_edge(source, target):
            raise SlotError(f"the spec has no transition {source} -> {target}")
        transition = graph.edges[source, target]["transition"]
        for j, ui in enumerate(transition.actions, 1):
            try:
                name = ui.name.format_map(slots) if ui.name else None
                text = ui.text.format_map(slots) if ui.text is not None else None
            except KeyError as exc:
                raise SlotError(f"transition {source} -> {target} needs slot {exc.args[0]!r}, "
                                f"the query has {sorted(slots)}") from None
            label = f"transition {i}/{len(hops)} ({source} -> {target}), action {j}/{len(transition.actions)}"
            checked = None
            if ui.op in CHECK_OPS:
                if ui.op == "set_checked" and text not in ("on", "off"):
                    raise SlotError(f"transition {source} -> {target} sets {ui.name!r} to on or off, "
                                    f"the query's slots make it {text!r}")
                checked = ui.op == "check" or text == "on"
            steps.append(_Step(label, ui.op, ui.role, name, text, checked))
    return steps


class ReplayPolicy:
    """Replays the reference path of a query; ends with terminate(success), or
    terminate(failure) when an element it needs is not on the page."""

    name = "replay"
    model_id = "replay"
    prompt_version = "none"

    def __init__(self, spec: AppSpec) -> None:
        self.spec = spec
        self._steps: list[_Step] = []
        self._operations: list[Operation] = []
        self._index = 0
        self._clicked_field = False
        self._scrolls = 0
        self._problem: str | None = None
        self._goal = ""
        self._skipped: list[str] = []  # check steps found already done, told in the next thought

    def reset(self, query: Query | dict[str, Any]) -> None:
        q = query if isinstance(query, Query) else Query.model_validate(query)
        self._index, self._clicked_field, self._scrolls, self._problem = 0, False, 0, None
        self._skipped = []
        self._goal = q.path[-1] if q.path else ""
        try:
            slots = {k: str(v) for k, v in json.loads(q.slots_json).items()}
            if q.path and q.path[0] != self.spec.start:
                raise SlotError(f"the path starts at {q.path[0]!r}, the app at {self.spec.start!r}")
            self._steps = plan(self.spec, q.path, slots)
            self._operations = parse_operations(q.actions_json)
        except (SlotError, ValueError) as exc:
            self._steps, self._operations, self._problem = [], [], str(exc)

    def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput:
        if self._problem:
            return self._out({"type": "terminate", "status": "failure"}, f"Cannot replay: {self._problem}.")
        if self._index >= len(self._steps) + len(self._operations):
            done = "and every operation " if self._operations else ""
            return self._out({"type": "terminate", "status": "success"},
                             f"Every action of the path {done}is done and the page is {observation.title!r} "
                             f"(goal page {self._goal!r}); the task is complete.")
        if self._index >= len(self._steps):
            return self._operate(self._index - len(self._steps), observation, env)
        step = self._steps[self._index]
        if step.op == "press" and not step.role:
            self._advance()
            return self._out(_press(step.text, env.space), f"{step.label}: press {step.text}.")
        assert step.role and step.name  # the spec model guarantees both for click, type and the check ops
        boxes = env.find_element(step.role, step.name)
        if len(boxes) != 1:
            return self._out({"type": "terminate", "status": "failure"},
                             f"{step.label}: expected one {step.role} {step.name!r} on {observation.url}, "
                             f"found {len(boxes)}; cannot go on.")
        if step.checked is not None and is_checked(env, step.role, step.name) == step.checked:
            self._skipped.append(f"{step.label}: the {step.role} {step.name!r} is already "
                                 f"{'on' if step.checked else 'off'}, no click needed.")
            self._advance()
            return self.act(observation, env)  # nothing was done: the same screen serves the next step
        x, y, w, h = boxes[0]
        cx, cy = x + w / 2, y + h / 2
        if not (0 <= cx < observation.width and 0 <= cy < observation.height):
            return self._scroll_towards(step.label, step.role, step.name, cx, cy, observation, env.space)
        self._scrolls = 0
        target = f'the {step.role} "{step.name}"'
        px, py = on_screen(boxes[0], observation)
        click = {"type": "click", "x": px, "y": py}
        if step.checked is not None:
            self._advance()
            return self._out(click, f"{step.label}: click {target} to turn it {'on' if step.checked else 'off'}.")
        if step.op == "click":
            self._advance()
            return self._out(click, f"{step.label}: click {target}.")
        if not self._clicked_field:
            self._clicked_field = True
            return self._out(click, f"{step.label}: click {target} to focus it before "
                                    f"{'typing' if step.op == 'type' else 'pressing a key'}.")
        self._advance()
        if step.op == "type":
            return self._out({"type": "type", "text": step.text}, f"{step.label}: type {step.text!r} into {target}.")
        return self._out(_press(step.text, env.space), f"{step.label}: press {step.text} in {target}.")

    def _operate(self, i: int, obs: Observation, env: BrowserEnv) -> PolicyOutput:
        """The next action of operation i: scroll its element into view, then do it."""
        op = self._operations[i]
        label = f"operation {i + 1}/{len(self._operations)} ({op.op})"
        fail = {"type": "terminate", "status": "failure"}
        if op.op not in SPACE_OPS[env.space]:
            return self._out(fail, f"{label}: the {env.space} action space has no way to do {op.op}; "
                                   f"it can do {', '.join(SPACE_OPS[env.space])}.")
        boxes = find_boxes(env, op.role, op.name)
        if len(boxes) != 1:
            return self._out(fail, f"{label}: expected one {op.role} {op.name!r} on {obs.url}, found {len(boxes)}; "
                                   "cannot go on.")
        x, y, w, h = boxes[0]
        passage = None
        if op.op in ("double_click", "select_text") and op.text:
            passage = passage_boxes(env, op.role, op.name, op.text)
            if passage is None:
                return self._out(fail, f"{label}: the {op.role} {op.name!r} does not hold the text {op.text!r}; "
                                       "cannot go on.")
            x, y, w, h = passage.whole
        cx, cy = x + w / 2, y + h / 2
        in_view = 0 <= y and y + h <= obs.height if op.op == "scroll_to" else 0 <= cy < obs.height
        if not (in_view and 0 <= cx < obs.width):
            return self._scroll_towards(label, op.role, op.name, cx, cy, obs, env.space)
        self._scrolls = 0
        target = f'the {op.role} "{op.name}"'
        cx, cy = on_screen((x, y, w, h), obs)
        if op.op == "scroll_to":
            self._advance()
            return self.act(obs, env)  # scrolling was the whole operation: nothing to do on this screen
        if op.op == "type_at":
            if not self._clicked_field:
                self._clicked_field = True
                return self._out({"type": "click", "x": cx, "y": cy},
                                 f"{label}: click {target} to type there.")
            self._advance()
            return self._out({"type": "type", "text": op.text}, f"{label}: type {op.text!r} into {target}.")
        self._advance()
        if op.op == "drag":
            assert op.to_role and op.to_name  # Operation guarantees both for drag
            drops = find_boxes(env, op.to_role, op.to_name)
            if len(drops) != 1:
                return self._out(fail, f"{label}: expected one {op.to_role} {op.to_name!r} to drop on, "
                                       f"found {len(drops)}; cannot go on.")
            dx, dy, dw, dh = drops[0]
            if not (0 <= dx + dw / 2 < obs.width and 0 <= dy + dh / 2 < obs.height):
                return self._out(fail, f"{label}: the {op.to_role} {op.to_name!r} is off screen while {target} "
                                       "is on it; one drag cannot reach it.")
            return self._out({"type": "drag", "x": cx, "y": cy, "x2": round(dx + dw / 2),
                              "y2": round(dy + dh / 2)},
                             f"{label}: drag {target} onto the {op.to_role} \"{op.to_name}\".")
        if op.op == "select_text":
            assert passage is not None
            (sx, sy), (ex, ey) = passage.start(), passage.end()
            return self._out({"type": "drag", "x": round(sx), "y": round(sy), "x2": round(ex), "y2": round(ey)},
                             f"{label}: drag across {op.text!r} in {target} to select it.")
        point = {"x": cx, "y": cy}
        if op.op == "double_click":
            what = f"the word {op.text!r} in {target}" if op.text else target
            return self._out({"type": "double_click", **point}, f"{label}: double-click {what}.")
        if op.op == "right_click":
            return self._out({"type": "right_click", **point}, f"{label}: right-click {target}.")
        return self._out({"type": "click", **point}, f"{label}: click {target}.")

    def _scroll_towards(self, label: str, role: str, name: str, cx: float, cy: float, obs: Observation,
                        space: str) -> PolicyOutput:
        """Swipe (mobile) or scroll (desktop) so that the element's centre comes into view,
        at most 60% of a screen at a time."""
        self._scrolls += 1
        if self._scrolls > MAX_SCROLLS:
            return self._out({"type": "terminate", "status": "failure"},
                             f"{label}: the {role} {name!r} stays off screen after "
                             f"{MAX_SCROLLS} swipes; cannot go on.")
        w, h = obs.width, obs.height
        dy = max(-0.6 * h, min(0.6 * h, cy - h / 2))
        dx = max(-0.6 * w, min(0.6 * w, cx - w / 2)) if not 0 <= cx < w else 0.0
        # The finger moves against the content: to see what is below, swipe up.
        y0 = 0.8 * h if dy > 0 else 0.2 * h
        x0 = 0.8 * w if dx > 0 else (0.2 * w if dx < 0 else w / 2)
        if space == "desktop":  # a mouse has no swipe: turn the wheel over the middle of the screen
            wheel = {"type": "scroll", "x": round(w / 2), "y": round(h / 2), "dy": round(dy), "dx": round(dx)}
            return self._out(wheel, f"{label}: the {role} {name!r} is off screen; "
                                    "scroll to bring it into view.")
        swipe = {"type": "swipe", "x": round(x0), "y": round(y0), "x2": round(x0 - dx), "y2": round(y0 - dy)}
        return self._out(swipe, f"{label}: the {role} {name!r} is off screen; "
                                "swipe to bring it into view.")

    def _advance(self) -> None:
        self._index += 1
        self._clicked_field = False

    def _out(self, action: dict[str, Any], thought: str) -> PolicyOutput:
        thought = " ".join([*self._skipped, thought])
        self._skipped = []
        return PolicyOutput(action=action, thought=thought, raw_output=json.dumps(action))

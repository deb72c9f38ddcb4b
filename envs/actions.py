"""The action spaces: GUI-Owl's mobile (paper Table 9) and desktop (Table 10) actions in pixels.

An action is a flat JSON object: {"type": "click", "x": 120, "y": 640}. Coordinates
are pixels of the screenshot the policy saw (width and height are stored beside every
step), so a row means the same thing whatever the trainer's convention is. The
viewport picks the space: a 'mobile' episode takes mobile actions, a 'desktop'
episode desktop ones, and an action of the other space is invalid.

Mobile (Table 9):

| type          | arguments                                   | meaning                              |
| ------------- | ------------------------------------------- | ------------------------------------ |
| click         | x, y                                        | tap                                  |
| long_press    | x, y, duration? (s, default 1)              | press and hold                       |
| swipe         | x, y, x2, y2, duration? (s, default 0.3)    | finger drag from (x, y) to (x2, y2)  |
| type          | text                                        | type into the focused field          |
| key           | key (a key name: Enter, Backspace, a)       | a key event ("press" is an alias)    |
| system_button | button: Back, Home, Menu or Enter           | the device's system buttons          |
| open          | text (app name)                             | open an app                          |
| wait          | seconds? (default 1)                        | let the screen change                |
| answer        | text                                        | answer the user (no screen change)   |
| terminate     | status: success or failure                  | end the episode                      |

Desktop (Table 10):

| type          | arguments                                   | meaning                              |
| ------------- | ------------------------------------------- | ------------------------------------ |
| key           | keys (list of key names: ["Control", "a"])  | press in order, release in reverse (a single `key` is taken as [key]) |
| type          | text, clear? (bool), enter? (bool)          | select-all + delete first; Enter after |
| mouse_move    | x, y                                        | move the pointer                     |
| click         | x, y                                        | left click                           |
| double_click  | x, y                                        | left double click                    |
| right_click   | x, y                                        | right click                          |
| middle_click  | x, y                                        | middle click                         |
| drag          | x, y, x2, y2                                | press at (x, y), move, release at (x2, y2) |
| scroll        | x, y, dy, dx? (wheel pixels)                | wheel at (x, y); dy > 0 shows what is below |
| wait          | seconds? (default 1)                        | let the screen change                |
| terminate     | status: success or failure                  | end the episode                      |

Key names are the browser's (Enter, ArrowDown, Control, a); the names models trained on
pyautogui write (ctrl, esc, pagedown) are accepted too (`key_name`).

`validate` never raises: a model's malformed action is data (recorded on its step
with the error), not a crash of the episode.
"""

from __future__ import annotations

import math
from typing import Any, Literal

Space = Literal["mobile", "desktop"]

NUMBER = (int, float)
STRING = (str,)
BOOL = (bool,)
KEYS = (list,)  # a non-empty list of non-empty strings

Signature = tuple[dict[str, tuple[type, ...]], dict[str, tuple[type, ...]]]
"""(required arguments, optional arguments); each maps argument -> accepted Python types."""

_POINT: dict[str, tuple[type, ...]] = {"x": NUMBER, "y": NUMBER}
_TERMINATE: Signature = ({"status": STRING}, {})
_WAIT: Signature = ({}, {"seconds": NUMBER})

SPACES: dict[str, dict[str, Signature]] = {
    "mobile": {
        "key": ({"key": STRING}, {}),
        "click": (_POINT, {}),
        "long_press": (_POINT, {"duration": NUMBER}),
        "swipe": ({**_POINT, "x2": NUMBER, "y2": NUMBER}, {"duration": NUMBER}),
        "type": ({"text": STRING}, {}),
        "answer": ({"text": STRING}, {}),
        "system_button": ({"button": STRING}, {}),
        "open": ({"text": STRING}, {}),
        "wait": _WAIT,
        "terminate": _TERMINATE,
    },
    "desktop": {
        "key": ({"keys": KEYS}, {}),
        "type": ({"text": STRING}, {"clear": BOOL, "enter": BOOL}),
        "mouse_move": (_POINT, {}),
        "click": (_POINT, {}),
        "drag": ({**_POINT, "x2": NUMBER, "y2": NUMBER}, {}),
        "right_click": (_POINT, {}),
        "middle_click": (_POINT, {}),
        "double_click": (_POINT, {}),
        "scroll": ({**_POINT, "dy": NUMBER}, {"dx": NUMBER}),
        "wait": _WAIT,
        "terminate": _TERMINATE,
    },
}

ALIASES = {"press": "key"}
"""Other names models use for an action type; `normalize` maps them to the canonical one."""

SYSTEM_BUTTONS = ("Back", "Home", "Menu", "Enter")
TERMINATE_STATUSES = ("success", "failure")
MAX_SECONDS = 10.0
"""Longest wait, long press or swipe: a policy must not stall an episode for minutes."""
MAX_TYPED = 1000
"""Most characters a `type` action types: the keyboard types a character at a time (2,000 took 7.3 s on a busy
2-core machine), so a model's runaway text ran into the action's deadline and was recorded as an env fault, the
episode rerun to the same answer, instead of an invalid action of the policy's."""
MAX_SCREENS = 100
"""Longest scroll, in screen heights (widths): Chromium refuses a gesture billions of pixels long ("Invalid
parameters"), which was an env fault rather than the policy's invalid action."""

_KEY_ALIASES = {
    "ctrl": "Control", "control": "Control", "alt": "Alt", "option": "Alt", "shift": "Shift",
    "cmd": "Meta", "command": "Meta", "win": "Meta", "super": "Meta", "meta": "Meta",
    "enter": "Enter", "return": "Enter", "esc": "Escape", "escape": "Escape", "tab": "Tab",
    "backspace": "Backspace", "delete": "Delete", "del": "Delete", "space": " ", "up": "ArrowUp",
    "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight", "pageup": "PageUp",
    "pagedown": "PageDown", "home": "Home", "end": "End", "insert": "Insert",
}


def key_name(key: str) -> str:
    """The browser's name for a key a model may have written pyautogui-style ('ctrl' -> 'Control')."""
    return _KEY_ALIASES.get(key.strip().lower(), key)


def canonical_key(name: str) -> str:
    """A key's name as a step stores it: the browser's (`key_name`), except the space bar's, which is " ": a blank
    key the validator refuses (and a trained model would write back), so "space" stays as written; the env maps it
    when it presses."""
    browser = key_name(name)
    return browser if browser.strip() else name


def canonical(action: dict[str, Any], space: Space) -> dict[str, Any]:
    """An action in its space's own form (`normalize`: an alias type resolved, a desktop key press as `keys`) with
    its keys' canonical names (`canonical_key`): what the env executes, and so what a step stores and a training
    answer says. A policy may write either space's key form and a model pyautogui's names; rows recorded before the
    recorder stored this form are read through it too (`rollout.gui_owl.to_call`)."""
    action = normalize(action, space)
    if isinstance(action.get("key"), str):
        action = {**action, "key": canonical_key(action["key"])}
    if isinstance(action.get("keys"), list):
        action = {**action, "keys": [canonical_key(k) if isinstance(k, str) else k for k in action["keys"]]}
    return action


def pressed(action: dict[str, Any]) -> list[str] | None:
    """The keys a key action presses, by the browser's names (`key_name`: 'space' and " " alike are " "), from a
    phone's single `key` and a desktop's `keys` alike (steps recorded before the recorder stored each space's own
    form hold a desktop key press as `key`, while a desktop prediction always says `keys`); None for an action that
    names no keys. Two actions press the same keys when these agree."""
    keys = action["keys"] if "keys" in action else [action["key"]] if "key" in action else None
    return [key_name(str(k)) for k in keys] if isinstance(keys, list) else None


def space_for(viewport: str) -> Space:
    """The action space of a viewport: 'desktop' for desktop, the mobile space otherwise."""
    return "desktop" if viewport == "desktop" else "mobile"


def normalize(action: Any, space: Space = "mobile") -> Any:
    """The action in canonical form: an alias type replaced by its type, and a desktop
    key action written with the mobile space's single `key` turned into `keys`; anything
    else unchanged."""
    if not isinstance(action, dict):
        return action
    if action.get("type") in ALIASES:
        action = {**action, "type": ALIASES[action["type"]]}
    if space == "desktop" and action.get("type") == "key" and "key" in action and "keys" not in action:
        action = {**{k: v for k, v in action.items() if k != "key"}, "keys": [action["key"]]}
    return action


def _type_error(kind: str, name: str, value: Any, types: tuple[type, ...]) -> str | None:
    if types is KEYS:
        if isinstance(value, list) and value and all(isinstance(k, str) and k.strip() for k in value):
            return None
        return f"{kind}: argument {name!r} must be a non-empty list of key names, got {value!r}"
    # bool is an int in Python: refuse it as a number, accept it only where a bool is asked for.
    if isinstance(value, types) and (types is BOOL or not isinstance(value, bool)):
        if isinstance(value, float) and not math.isfinite(value):  # a model's NaN or Infinity (JSON allows both)
            return f"{kind}: argument {name!r} must be a finite number, got {value!r}"
        return None
    names: dict[tuple[type, ...], str] = {NUMBER: "a number", BOOL: "true or false"}
    expected = names.get(types, "a string")
    return f"{kind}: argument {name!r} must be {expected}, got {value!r}"


def validate(action: Any, width: int, height: int, space: Space = "mobile") -> str | None:
    """Why `action` cannot be executed on a width x height screen in `space`, or None when it can."""
    if not isinstance(action, dict):
        return f"an action must be a JSON object, got {type(action).__name__}"
    actions = SPACES[space]
    action = normalize(action, space)
    kind = action.get("type")
    if kind not in actions:
        other = next((s for s in SPACES if s != space and kind in SPACES[s]), None)
        if other is not None:
            return f"{kind!r} is a {other} action, not in the {space} action space; known: {', '.join(actions)}"
        return f"unknown action type {kind!r}; known: {', '.join(actions)}"
    required, optional = actions[kind]
    for name, types in {**required, **optional}.items():
        if name not in action:
            if name in required:
                return f"{kind}: missing argument {name!r}"
            continue
        error = _type_error(kind, name, action[name], types)
        if error:
            return error
    unknown = sorted(set(action) - {"type"} - set(required) - set(optional))
    if unknown:
        return f"{kind}: unknown argument(s) {', '.join(unknown)}"
    for xk, yk in (("x", "y"), ("x2", "y2")):
        if xk in required:
            x, y = action[xk], action[yk]
            if not (0 <= x < width and 0 <= y < height):
                return f"{kind}: point ({xk}={x}, {yk}={y}) is off the {width}x{height} screen"
    for name in ("duration", "seconds"):
        if name in action and not 0 <= action[name] <= MAX_SECONDS:
            return f"{kind}: {name} must be between 0 and {MAX_SECONDS:g} seconds, got {action[name]}"
    for name, screen in (("dx", width), ("dy", height)):
        if kind == "scroll" and name in action and not abs(action[name]) <= MAX_SCREENS * screen:
            return f"scroll: {name} must be within {MAX_SCREENS} screens ({MAX_SCREENS * screen} px): {action[name]}"
    if kind == "type" and len(action["text"]) > MAX_TYPED:
        return f"type: text is {len(action['text'])} characters long, more than {MAX_TYPED}"
    if kind == "system_button" and action["button"] not in SYSTEM_BUTTONS:
        return f"system_button: button must be one of {', '.join(SYSTEM_BUTTONS)}, got {action['button']!r}"
    if kind == "terminate" and action["status"] not in TERMINATE_STATUSES:
        return f"terminate: status must be success or failure, got {action['status']!r}"
    named = {"key": "key", "open": "text"}.get(kind)  # what names a key or an app must not be blank
    if named in action and not action[named].strip():
        return f"{kind}: argument {named!r} is empty"
    return None


def direction(action: dict[str, Any]) -> str | None:
    """The way a move goes on the screen (y grows downwards), by its larger part: up/down/left/right of a scroll
    (wheel dy, dx: dy > 0 shows what is below) or of a swipe or drag (start to end); None without one or for no
    move."""
    if action["type"] == "scroll":
        dx, dy = float(action.get("dx", 0)), float(action.get("dy", 0))
    elif "x2" in action and "y2" in action:
        dx, dy = float(action["x2"]) - float(action["x"]), float(action["y2"]) - float(action["y"])
    else:
        return None
    if dx == dy == 0:
        return None
    if abs(dy) >= abs(dx):
        return "down" if dy > 0 else "up"
    return "right" if dx > 0 else "left"


def point(action: dict[str, Any]) -> tuple[float, float] | None:
    """Where a pointer action lands (its start point), or None for other actions."""
    if "x" in action and "y" in action:
        return float(action["x"]), float(action["y"])
    return None

"""The interaction recorder: what it reports, how a report is read, and the `interaction` checker.

The one script every page loads is the recorder (`_shared/static/interactions.js`, served as
`/__kit/interactions.js`): it reports to the server what low-level operation the user did
on which element (click, double-click, right-click, text selection, drag, typing,
scrolling into view), because an atomic-operation task ("double-click the word
'parmesan'") changes no app state that a checker could read otherwise. Its reports
(`POST /__ui`) are kept per session beside the app's state (see `envs.apps.sessions`).
Every app answers the `interaction` checker, which reads them.
"""

from __future__ import annotations

import json
from bisect import insort
from pathlib import Path
from typing import Any

UI_EVENTS = "ui_events"
"""The key of the recorder's reports in `/__state`: a list of {op, role, name, text?,
to_role?, to_name?, page, at} in the order the page saw them; `at` (ms since the epoch) is
when it did. Reports are posted one by one and may arrive out of that order."""

UI_OPS = ("click", "double_click", "right_click", "drag", "select_text", "type_at", "scroll_to")
"""What the recorder reports: the ops of query_gen.operations.Operation."""

MAX_UI_EVENTS = 200
"""Reports kept per session (the oldest go first): a long episode must not grow without bound."""

_UI_FIELDS = ("op", "role", "name", "text", "to_role", "to_name", "page", "at")
_MAX_UI_TEXT = 2000

RECORDER_SCRIPT = '<script src="/__kit/interactions.js" defer></script>'
"""The tag every page of every bundled app puts in its <head>."""

RECORDER_PATH = Path(__file__).parent / "_shared" / "static" / "interactions.js"
"""The recorder's source, served as `/__kit/interactions.js`."""

INTERACTION_CHECKER = "interaction"
"""The checker every bundled app answers (not one of its goal checkers): did the user do
this operation on this element, as the page's recorder reported it."""


def keep_ui_events(kept: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """Add the reports to `kept`, in place, in the order the page saw them (`at`; reports posted one by one may
    arrive out of it, and what reads them in order, such as a secret's pieces across a one-time-code widget's
    boxes, must see the page's). Of the typing reports of one field on one page only the latest (by `at`) is
    kept: it holds the field's whole value, and one report per keystroke would say the same thing letter by
    letter. At most MAX_UI_EVENTS are kept, the newest."""
    for event in events:
        if event["op"] == "type_at":
            same = [e for e in kept if e["op"] == "type_at"
                    and all(e.get(k) == event.get(k) for k in ("role", "name", "page"))]
            if any(e["at"] >= event["at"] for e in same):
                continue  # a keystroke's report that arrived after a later one's
            kept[:] = [e for e in kept if e not in same]
        insort(kept, event, key=lambda e: e["at"])  # after the reports the page saw at the same time
    del kept[:-MAX_UI_EVENTS]


def parse_ui_events(body: str) -> list[dict[str, Any]]:
    """The recorder's report (a JSON object or list of them) as events; raises ValueError
    naming the item and field that is wrong."""
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    items = raw if isinstance(raw, list) else [raw]
    events: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"[{i}]: must be an object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(_UI_FIELDS))
        if unknown:
            raise ValueError(f"[{i}]: unknown field {unknown[0]!r}; known: {', '.join(_UI_FIELDS)}")
        if item.get("op") not in UI_OPS:
            raise ValueError(f"[{i}].op: {item.get('op')!r} is not one of {', '.join(UI_OPS)}")
        for key in ("role", "name", "page"):
            if key not in item:
                raise ValueError(f"[{i}].{key}: missing")
        if not isinstance(item.get("at"), (int, float)) or isinstance(item.get("at"), bool):
            raise ValueError(f"[{i}].at: must be a number (ms since the epoch), got {item.get('at')!r}")
        for key, value in item.items():
            if key != "at" and not isinstance(value, str):
                raise ValueError(f"[{i}].{key}: must be a string, got {type(value).__name__}")
        events.append({k: v[:_MAX_UI_TEXT] if isinstance(v, str) else v for k, v in item.items()})
    return events


def _same(a: object, b: object) -> bool:
    """Names and texts compare as a person reads them: case and spacing do not matter."""
    return " ".join(str(a).split()).casefold() == " ".join(str(b).split()).casefold()


def _said(event: dict[str, Any]) -> str:
    text = f"{event.get('op')} {event.get('role')} {event.get('name', '')!r}"
    if event.get("text") is not None:
        text += f" text {event['text']!r}"
    if event.get("to_role") is not None:
        text += f" onto {event['to_role']} {event.get('to_name', '')!r}"
    if event.get("page") is not None:
        text += f" on {event['page']}"
    return text


def check_interaction(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The page recorded operation `op` on the element (`role`, `name`).

    Optional params narrow it: `text` (the word double-clicked, the passage selected, the
    value typed: for type_at the field's last value), `to_role` and `to_name` (where a
    drag was dropped), `page` (the path and query of the page it was done on: "follow the
    link 'Languages', and there click 'All settings'" is not done by the start page's own
    'All settings' link). The reason names the matching event, or what was recorded instead.
    """
    absent = [k for k in ("op", "role", "name") if not params.get(k)]
    if absent:
        return False, f"checker params lack {', '.join(absent)}"
    if params["op"] not in UI_OPS:
        return False, f"checker param op is {params['op']!r}; known: {', '.join(UI_OPS)}"
    events = state.get(UI_EVENTS, [])
    on_element = [e for e in events if e["op"] == params["op"] and _same(e["role"], params["role"])
                  and _same(e["name"], params["name"])]
    if params.get("page"):
        on_element = [e for e in on_element if e.get("page") == params["page"]]
    if params["op"] == "type_at":  # what the field holds now, not what it held on the way
        on_element = sorted(on_element, key=lambda e: e["at"])[-1:]
    wanted = {k: params[k] for k in ("text", "to_role", "to_name") if params.get(k)}
    for event in on_element:
        if all(_same(event.get(k, ""), v) for k, v in wanted.items()):
            return True, f"recorded {_said(event)}"
    target = _said({k: params.get(k) for k in ("op", "role", "name", "text", "to_role", "to_name", "page")})
    seen = "; ".join(_said(e) for e in events[-5:]) or "nothing"
    return False, f"no {target} was recorded; the last recorded: {seen}"

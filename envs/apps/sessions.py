"""Per-session state of one app server: the app's state and the recorder's reports, one
copy per session (`envs.apps.server` says how a request picks its session)."""

from __future__ import annotations

import threading
from typing import Any

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.interaction import MAX_UI_EVENTS, UI_EVENTS


class Sessions:
    """Per-session state, created from the app's initial state on first use, and the
    recorder's reports, kept apart so the app's handlers never see them."""

    def __init__(self, app: BundledApp) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.states: dict[str, dict[str, Any]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}

    def get(self, session_id: str) -> dict[str, Any]:
        if session_id not in self.states:
            self.states[session_id] = self.app.initial_state()
        return self.states[session_id]

    def view(self, session_id: str) -> dict[str, Any]:
        """What `/__state` shows: the app's state, plus `ui_events` once the page reported one."""
        state = self.get(session_id)
        events = self.events.get(session_id)
        return {**state, UI_EVENTS: events} if events else state

    def reset(self, session_id: str) -> dict[str, Any]:
        self.states[session_id] = self.app.initial_state()
        self.events.pop(session_id, None)
        return self.states[session_id]

    def record(self, session_id: str, events: list[dict[str, Any]]) -> None:
        """Keep the reports. Of the typing reports of one field on one page only the
        latest (by `at`) is kept: it holds the field's whole value, and one report per
        keystroke would say the same thing letter by letter."""
        kept = self.events.setdefault(session_id, [])
        for event in events:
            if event["op"] == "type_at":
                same = [e for e in kept if e["op"] == "type_at"
                        and all(e.get(k) == event.get(k) for k in ("role", "name", "page"))]
                if any(e["at"] >= event["at"] for e in same):
                    continue  # a keystroke's report that arrived after a later one's
                kept[:] = [e for e in kept if e not in same]
            kept.append(event)
        del kept[:-MAX_UI_EVENTS]

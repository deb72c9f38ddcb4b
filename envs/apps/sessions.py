"""Per-session state of one app server: the app's state and the recorder's reports, one
copy per session (`envs.apps.server` says how a request picks its session)."""

from __future__ import annotations

import threading
from typing import Any

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.interaction import UI_EVENTS, keep_ui_events


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
        """Keep the reports (`interaction.keep_ui_events`)."""
        keep_ui_events(self.events.setdefault(session_id, []), events)

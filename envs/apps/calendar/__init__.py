"""Daybook, the bundled week calendar (see `app.py` for pages and state)."""

from trajforge.envs.apps.calendar.app import CalendarApp, create_app

__all__ = ["CalendarApp", "create_app"]

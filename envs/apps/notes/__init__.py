"""Jotter, the bundled notes app (see `app.py` for pages and state)."""

from trajforge.envs.apps.notes.app import NotesApp, create_app

__all__ = ["NotesApp", "create_app"]

"""Writer, the bundled desktop-style document editor (see `app.py` for its surfaces and state)."""

from trajforge.envs.apps.writer.app import WriterApp, create_app

__all__ = ["WriterApp", "create_app"]

"""Settings, the bundled phone settings app (see `app.py` for pages and state)."""

from trajforge.envs.apps.settings.app import SettingsApp, create_app

__all__ = ["SettingsApp", "create_app"]

"""Harbor ID, the bundled account app with a sign-in form (see `app.py` for pages and state)."""

from trajforge.envs.apps.account.app import AccountApp, create_app

__all__ = ["AccountApp", "create_app"]

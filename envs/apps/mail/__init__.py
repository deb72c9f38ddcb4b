"""Postbox, the bundled mail client (see `app.py` for pages and state)."""

from trajforge.envs.apps.mail.app import MailApp, create_app

__all__ = ["MailApp", "create_app"]

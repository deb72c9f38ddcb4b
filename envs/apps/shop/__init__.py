"""FreshCart, the bundled food-delivery shop (see `app.py` for pages and state)."""

from trajforge.envs.apps.shop.app import ShopApp, create_app

__all__ = ["ShopApp", "create_app"]

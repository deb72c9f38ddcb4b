"""Which bundled apps there are, and loading one by name.

Each app is a subpackage of `envs.apps` with a `create_app()`; the modules beside them
(`base`, `server`, this one...) and `_shared` (static files only, no `__init__.py`) are
not apps. Apps are imported only when loaded: they import `envs.apps.base`, so importing
them here at module level would be a cycle.
"""

from __future__ import annotations

import importlib
import pkgutil

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.spec import SpecError

_PACKAGE = __name__.rpartition(".")[0]
"""The package whose subpackages are the apps (`trajforge.envs.apps`)."""


class UnknownAppError(LookupError):
    """No bundled app has that name; the message lists the ones there are."""


def known_apps() -> list[str]:
    """Names of the bundled apps: the subpackages of envs.apps."""
    return sorted(m.name for m in pkgutil.iter_modules(importlib.import_module(_PACKAGE).__path__) if m.ispkg)


def load_app(name: str) -> BundledApp:
    """The bundled app `name`, its spec validated and every goal's checker present."""
    apps = known_apps()
    if name not in apps:
        raise UnknownAppError(f"unknown app {name!r}; bundled apps: {', '.join(apps) or '(none)'}")
    module = importlib.import_module(f"{_PACKAGE}.{name}")
    app: BundledApp = module.create_app()
    for page_id, page in app.spec.pages.items():
        if page.goal is not None and page.goal.checker not in app.checkers:
            raise SpecError(
                f"{app.spec_path}: pages.{page_id}.goal.checker: app {name!r} has no checker "
                f"{page.goal.checker!r}; known: {', '.join(sorted(app.checkers))}"
            )
    return app

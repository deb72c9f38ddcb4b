"""Bundled web apps: small, real, server-rendered apps that episodes run against.

Each app is a subpackage of `envs.apps` with a `spec.yaml` (its page graph, see
`query_gen.graph`) and a `create_app()` that returns a `BundledApp`. The app renders
plain semantic HTML with real forms and links, so the accessibility tree has good roles
and names and every action that changes state is a real navigation. The one script every
page loads is the interaction recorder (see `interaction`). The notes app adds a script of
its own to reorder its cards by dragging.

The modules: `web` (Request, Response and the response helpers), `base` (`BundledApp`),
`kit` (markup and checker helpers the apps share), `interaction` (the recorder's reports
and the `interaction` checker), `sessions` (per-session state), `server` (`AppServer`) and
`registry` (`known_apps`, `load_app`). The apps import from those modules, not from here.
"""

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.interaction import INTERACTION_CHECKER, UI_EVENTS, check_interaction
from trajforge.envs.apps.registry import UnknownAppError, known_apps, load_app
from trajforge.envs.apps.server import SESSION_COOKIE, AppServer
from trajforge.envs.apps.web import not_found

__all__ = [
    "INTERACTION_CHECKER",
    "SESSION_COOKIE",
    "UI_EVENTS",
    "AppServer",
    "BundledApp",
    "UnknownAppError",
    "check_interaction",
    "known_apps",
    "load_app",
    "not_found",
]

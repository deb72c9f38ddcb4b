"""`BundledApp`, the base class of every bundled app, and the `Checker` signature."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from trajforge.envs.apps.interaction import INTERACTION_CHECKER, check_interaction
from trajforge.envs.apps.web import Request, Response
from trajforge.envs.spec import AppSpec, load_spec

Checker = Callable[[dict[str, str], dict[str, Any]], tuple[bool, str]]
"""(params, state) -> (success, reason). The reason says what was found in the state."""


class BundledApp:
    """An app: its spec, its initial state, its request handler and its checkers.

    Subclasses set `checkers` and implement `initial_state` and `handle`. `handle`
    gets the session's state and may change it in place; the server holds a lock
    around it, so handlers need no locking of their own.
    """

    checkers: dict[str, Checker] = {}

    def __init__(self, name: str, package_dir: Path) -> None:
        self.name = name
        self.package_dir = package_dir
        self.spec_path = package_dir / "spec.yaml"
        self.spec: AppSpec = load_spec(self.spec_path)
        self.static_dir = package_dir / "static"

    def initial_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        raise NotImplementedError

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        """Run a named checker on a state: one of the app's, or the shared `interaction`.
        An unknown checker name is a caller error and raises."""
        fn = self.checkers.get(checker) or (check_interaction if checker == INTERACTION_CHECKER else None)
        if fn is None:
            known = sorted([*self.checkers, INTERACTION_CHECKER])
            raise ValueError(f"app {self.name!r} has no checker {checker!r}; known: {', '.join(known)}")
        return fn(params, state)

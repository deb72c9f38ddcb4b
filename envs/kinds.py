"""The app kinds behind one interface: each knows its tasks, its environment and its checker.

A query names its app; `kind_for(name)` is the one place a name becomes a kind:
"miniwob" and "android" are task suites, a name an app directory registered
(`use_app_dirs`, from `query_gen.app_dirs`) is a user's own web app, any other name is
a bundled web app. The
stages ask the kind, never the name: query generation for the suite's own tasks,
rollouts for where an episode starts and which environment it sees, critics and
guidance for the checker. A new kind is one class here.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import tempfile
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from trajforge.envs import android, miniwob
from trajforge.envs.android import DevicePool, android_queries, check_probe
from trajforge.envs.appdir import AppDir, AppDirEnv, load_app_dir, running
from trajforge.envs.apps import AppServer, BundledApp, UnknownAppError, known_apps, load_app
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.miniwob import MiniWoBEnv, MiniWoBServer, check_reward, check_tasks, miniwob_queries
from trajforge.envs.spec import AppSpec, SpecError
from trajforge.schemas.config import ConfigError, RolloutSettings, Settings
from trajforge.schemas.records import Episode, Query

T = TypeVar("T")

MINIWOB = miniwob.APP
ANDROID = android.APP


@dataclass
class Site:
    """A browser kind's apps, served for the length of a rollout."""

    start_url: Callable[[Query], str]
    """Where a query's episode starts."""
    base_url: str = ""
    """The origin the app answers at (a web app's page paths are relative to it)."""
    wrap: Callable[[BrowserEnv], Any] = lambda env: env
    """The environment an episode sees on a pooled browser context (e.g. MiniWoB++'s seeded reset)."""
    launchers: dict[str, str] = field(default_factory=dict)
    """App name or title -> start URL, for the action that opens an app."""
    shared_state: str | None = None
    """Where the app keeps one state for every session, which its reset puts back (an app directory reset by a url
    or a command: its base URL or its folder); None: each session its own. One session at a time uses such a
    state (`one_session`), since a reset wipes what another session is doing."""


@contextmanager
def one_session(shared_state: str | None) -> Iterator[None]:
    """Hold the app's shared state (`Site.shared_state`) for one episode, against every other session of this
    machine: the rollouts of one process (the reference stage replays its viewports side by side, each rollout
    on contexts of its own) and of its other processes (Dask workers). A lock file of the temporary folder,
    taken with `flock`, which excludes every other opening of the file, threads' included, and is let go when
    the process ends however it ends. Workers on other machines are not seen: README "Your own app"."""
    if shared_state is None:
        yield
        return
    name = hashlib.sha256(shared_state.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"trajforge-app-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class AppKind(ABC):
    """One kind of app."""

    name: str
    spec: AppSpec | None = None
    """The page graph, for kinds that have one: query generation samples it, the replay policy walks it."""
    in_browser: bool = True
    """Episodes run on the browser pool (else `on_devices`)."""

    @abstractmethod
    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        """Whether a task succeeded, read from the state its app ended in, and why."""

    def tasks(self, settings: Settings, *, run_id: str) -> tuple[list[Query], Counter[str]]:
        """The kind's own tasks (a suite's), and those that could not be made, counted by reason; a web app's
        queries come from query generation instead."""
        return [], Counter()

    def task_source(self) -> dict[str, str]:
        """What made `tasks()`, for the stage's lineage (model name -> version)."""
        return {}

    def unavailable(self, settings: RolloutSettings) -> str | None:
        """Why this kind's queries cannot run with these settings (counted as dropped), or None."""
        return None

    def serve(self, stack: ExitStack) -> Site:
        """Start what a rollout on the browser pool needs (servers live as long as `stack`)."""
        raise NotImplementedError(f"{self.name} does not run in the browser")

    def on_devices(self, settings: RolloutSettings, fn: Callable[[Any, Query, str], T], queries: list[Query]) -> list[T]:
        """fn(env, query, start) for every query, on the kind's own devices."""
        raise NotImplementedError(f"{self.name} runs in the browser")


def _web_site(spec: AppSpec, base_url: str, wrap: Callable[[BrowserEnv], Any] | None = None, *,
              shared_state: str | None = None) -> Site:
    """A web app served at `base_url`: every episode starts on its start page, which opens it by title or name."""
    url = base_url + spec.pages[spec.start].url
    site = Site(start_url=lambda q: url, base_url=base_url, launchers={spec.title: url, spec.app: url},
                shared_state=shared_state)
    if wrap is not None:
        site.wrap = wrap
    return site


class BundledWebKind(AppKind):
    """A bundled web app: a page graph, a server with per-session state, and checkers of that state."""

    app: BundledApp

    def __init__(self, app: BundledApp) -> None:
        self.app = app
        self.name = app.name
        self.spec = app.spec

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        return self.app.check(checker, params, state)

    def serve(self, stack: ExitStack) -> Site:
        return _web_site(self.spec, stack.enter_context(AppServer(self.app)).base_url)


class AppDirKind(AppKind):
    """A user's own web app from its app directory (`envs.appdir`): served where it runs, reset as it says, and
    judged by its declarative checks on the final state read at the end of each episode."""

    def __init__(self, app: AppDir) -> None:
        self.app_dir = app
        self.name = app.name
        self.spec = app.spec

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        return self.app_dir.check(checker, params, state)

    def serve(self, stack: ExitStack) -> Site:
        app = self.app_dir
        shared = None if app.reset == "context" else app.serve.base_url or str(app.path.resolve())
        return _web_site(self.spec, stack.enter_context(running(app)),
                         wrap=lambda env: AppDirEnv(env, app), shared_state=shared)


class MiniWoBKind(AppKind):
    """The MiniWoB++ suite: seeded task pages whose own JavaScript reward is the checker."""

    name = MINIWOB

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        return check_reward(params, state)

    def tasks(self, settings: Settings, *, run_id: str) -> tuple[list[Query], Counter[str]]:
        cfg = settings.query_gen
        return miniwob_queries(cfg.miniwob_tasks, cfg.miniwob_seeds, run_id=run_id, max_steps=cfg.miniwob_max_steps,
                               chromium=settings.rollout.chromium)

    def task_source(self) -> dict[str, str]:
        return {"miniwob_utterances": f"miniwob@{version('miniwob')}"}

    def serve(self, stack: ExitStack) -> Site:
        server = stack.enter_context(MiniWoBServer())
        return Site(start_url=lambda q: server.task_url(q.path[0], int(json.loads(q.slots_json)["seed"])),
                    wrap=MiniWoBEnv)


class AndroidKind(AppKind):
    """Android devices over ADB: hand-written tasks checked by a device state probe."""

    name = ANDROID
    in_browser = False

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        return check_probe(params, state)

    def tasks(self, settings: Settings, *, run_id: str) -> tuple[list[Query], Counter[str]]:
        return android_queries(settings.query_gen.android_tasks, run_id=run_id), Counter()

    def unavailable(self, settings: RolloutSettings) -> str | None:
        return None if settings.android.devices else "no device configured (rollout.android.devices)"

    def on_devices(self, settings: RolloutSettings, fn: Callable[[Any, Query, str], T], queries: list[Query]) -> list[T]:
        return DevicePool(settings.android).map(lambda env, q: fn(env, q, q.path[0]), queries)


_APP_DIRS: dict[str, AppDir] = {}
"""The app directories this process was given, by app name."""


def use_app_dirs(paths: list[Path]) -> list[AppKind]:
    """Read the app directories and make their apps known to `kind_for`, in this process (each worker of a night
    does it when it opens the night's workspace); their kinds, in order. A directory whose app takes the name of a
    bundled app, a suite or another directory's app raises SpecError."""
    kinds = []
    for path in paths:
        app = load_app_dir(path)
        taken = (f"the bundled app {app.name!r}" if app.name in known_apps()
                 else f"the {app.name} suite" if app.name in (MINIWOB, ANDROID)
                 else f"the app of {_APP_DIRS[app.name].path}" if app.name in _APP_DIRS
                 and _APP_DIRS[app.name].path != app.path else None)
        if taken:
            raise SpecError(f"{app.path}/spec.yaml: app: {app.name!r} is the name of {taken}; give it another")
        if _APP_DIRS.get(app.name) != app:
            _APP_DIRS[app.name] = app
            kind_for.cache_clear()
        kinds.append(kind_for(app.name))
    return kinds


@functools.cache
def kind_for(name: str) -> AppKind:
    """The kind of the app a query names; an unknown app raises UnknownAppError."""
    if name == MINIWOB:
        return MiniWoBKind()
    if name == ANDROID:
        return AndroidKind()
    if name in _APP_DIRS:
        return AppDirKind(_APP_DIRS[name])
    return BundledWebKind(load_app(name))


def check_episode(query: Query, episode: Episode) -> tuple[bool, str]:
    """The query's checker on the episode's final app state: (success, the checker's reason)."""
    return kind_for(query.app).check(query.checker, json.loads(query.checker_params_json),
                                     json.loads(episode.final_state_json))


def configured_kinds(settings: Settings, named: Callable[[str], str] = str) -> list[AppKind]:
    """The kinds the config asks queries of: its bundled apps, its app directories, then the suites it names
    tasks of.

    Validates on the way (an unknown app or MiniWoB++ task, a deep-search app the config names that nothing
    serves raises), so a run can check its config before any work; `named` gives a field as the error names it
    (the preflight's says where it was set).
    """
    try:
        kinds = [kind_for(name) for name in settings.query_gen.apps]
    except UnknownAppError as exc:
        raise ConfigError(f"{named('query_gen.apps')}: {exc}") from None
    kinds += use_app_dirs(settings.query_gen.app_dirs)
    asked = "deep_search_apps" in settings.query_gen.model_fields_set  # the default, [writer], applies where served
    served = {k.name for k in kinds}
    if asked and (unserved := [a for a in settings.query_gen.deep_search_apps if a not in served]):
        raise ConfigError(f"{named('query_gen.deep_search_apps')}: {', '.join(unserved)} is neither in "
                          "query_gen.apps nor an app of query_gen.app_dirs, so nothing serves it")
    if settings.query_gen.miniwob_tasks:
        check_tasks(settings.query_gen.miniwob_tasks)
        kinds.append(kind_for(MINIWOB))
    if settings.query_gen.android_tasks:
        kinds.append(kind_for(ANDROID))
    return kinds

"""The environment pool: N isolated browser contexts on one Chromium, run in parallel.

One `BrowserHost` (an async Playwright driver and one browser on a loop thread) and
N `BrowserEnv`s on it, each a context of its own (cookies, storage, cache, history
apart). `map` runs a function per item on N worker threads, each holding one env
while it runs, so the function is ordinary blocking code (an episode with a sync
policy) and the envs' browser calls overlap on the host's loop. `map_envs` is that loop
over any envs: the Android device pool's and interface validation's too.

Crash recovery needs no supervisor: an env that hit a fault opens a new context at its
next reset, and the host relaunches the browser first when it died; the episodes that
were running when it died end as env_fault and the caller reruns them
(`rollout.stage`).

`warm_envs` lends envs that stay open between the stages of a run in one process: a
context's first document costs several times a reset of one already open, and a night
asks for a pool per shard and viewport (reference replays, rollouts, planning's trials).
A run keeps them open with `warm_scope`; the last scope of the process closes them.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar

from trajforge.envs.browser import CHROMIUM, BrowserEnv, BrowserHost, Observation

Env = TypeVar("Env")
Item = TypeVar("Item")
Result = TypeVar("Result")


class EnvPool:
    """`size` envs of one viewport on one browser; use as a context manager."""

    def __init__(
        self,
        size: int,
        *,
        viewport: Literal["mobile", "desktop"] = "mobile",
        chromium: Path = CHROMIUM,
        action_timeout_s: float = 10.0,
        apps: dict[str, str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"an env pool needs at least one context, got {size}")
        self.host = BrowserHost(chromium)
        self.envs = [BrowserEnv(viewport=viewport, action_timeout_s=action_timeout_s, apps=apps, host=self.host)
                     for _ in range(size)]

    def map(self, fn: Callable[[BrowserEnv, Item], Result], items: Iterable[Item]) -> list[Result]:
        """fn(env, item) for every item, in item order; at most one call per env at a time (`map_envs`)."""
        return map_envs(self.envs, fn, items)

    def close(self) -> None:
        """Close every context, then the browser and the driver."""
        try:
            for env in self.envs:
                env.close()
        finally:
            self.host.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_envs(envs: Sequence[Env], fn: Callable[[Env, Item], Result], items: Iterable[Item]) -> list[Result]:
    """fn(env, item) for every item, in item order, on one worker thread per env, each holding one env
    while it runs; so fn is ordinary blocking code and the envs' browser calls overlap on their host's loop.

    An exception of fn propagates once the calls already running have finished; the calls not begun are
    dropped (interface validation's queued page visits ran on, minutes for a crawl whose shard had failed).
    Env faults are fn's to handle, as `run_episode` does.
    """
    free: queue.SimpleQueue[Env] = queue.SimpleQueue()
    for env in envs:
        free.put(env)

    def call(item: Item) -> Result:
        env = free.get()
        try:
            return fn(env, item)
        finally:
            free.put(env)

    with ThreadPoolExecutor(len(envs), thread_name_prefix="env") as workers:
        futures = [workers.submit(call, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


_warm_lock = threading.Lock()
_warm_scopes = 0
"""How many `warm_scope` blocks of this process are open now."""
_warm_hosts: dict[Path, BrowserHost] = {}
"""One browser per Chromium binary for the warm envs of this process."""
_warm_free: dict[tuple[Path, str, float], list[BrowserEnv]] = {}
"""(Chromium, viewport, action timeout) -> the warm envs no caller holds now."""


@contextmanager
def warm_envs(size: int, *, viewport: Literal["mobile", "desktop"] = "mobile", chromium: Path = CHROMIUM,
              action_timeout_s: float = 10.0, apps: dict[str, str] | None = None,
              on_observe: Callable[[Observation], None] | None = None) -> Iterator[list[BrowserEnv]]:
    """`size` envs of one viewport for the block, taken from those an earlier block of this process gave back
    (opening more where too few are free), and given back after it for the next, until `close_warm`.

    Why: 4 new contexts' first resets took 1.7-2.4 s on 2 cores (2026-12-04), their next ones 0.3-0.45 s, and
    a night opened a pool for every reference shard and viewport and every planning trial. A lent env is
    as clean as a pooled one between two episodes, since every episode begins with a reset (cookies, storage,
    history; a dead browser or a faulted context replaced). `apps` and `on_observe` hold for this block only. An
    env that runs a recorder of its own (a user's app, `BrowserEnv.add_recorder`) is closed, not given back:
    the recorder stays on its context.
    """
    if size < 1:
        raise ValueError(f"an env pool needs at least one context, got {size}")
    key = (Path(chromium), viewport, action_timeout_s)
    with _warm_lock:
        host = _warm_hosts.get(key[0])
        if host is None:
            host = _warm_hosts[key[0]] = BrowserHost(key[0])
        free = _warm_free.setdefault(key, [])
        envs = [free.pop() for _ in range(min(size, len(free)))]
    envs += [BrowserEnv(viewport=viewport, action_timeout_s=action_timeout_s, host=host)
             for _ in range(size - len(envs))]
    for env in envs:
        env.apps, env.on_observe = dict(apps or {}), on_observe
    try:
        yield envs
    finally:
        kept = []
        for env in envs:
            env.apps, env.on_observe = {}, None
            if env.has_recorder:
                env.close()
            else:
                kept.append(env)
        with _warm_lock:
            if _warm_hosts.get(key[0]) is host:  # else close_warm ran meanwhile: these are closed with it
                _warm_free.setdefault(key, []).extend(kept)


@contextmanager
def warm_scope() -> Iterator[None]:
    """Warm envs stay open while any scope of this process does; the last scope to end closes them
    (`close_warm`). A run holds one (`tasks.prefect_tasks.run_workspace`), so two runs in one process, such as
    two stage flows a notebook runs at once, no longer close the browser under each other: the first run to end
    used to close every warm env, the other run's lent ones too, and that run's next browser call failed."""
    global _warm_scopes
    with _warm_lock:
        _warm_scopes += 1
    try:
        yield
    finally:
        with _warm_lock:
            _warm_scopes -= 1
            last = _warm_scopes == 0
        if last:
            close_warm()


@atexit.register
def close_warm() -> None:
    """Close the warm envs' browsers, and with them every context (a run's end, and this process's exit); safe to
    call twice. Envs lent out now are closed too; their holder's calls fail as after a crash."""
    with _warm_lock:
        hosts = list(_warm_hosts.values())
        _warm_hosts.clear()
        _warm_free.clear()
    for host in hosts:
        host.close()

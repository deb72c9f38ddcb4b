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
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypeVar

from trajforge.envs.browser import CHROMIUM, BrowserEnv, BrowserHost

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

    An exception of fn propagates (after the calls already running have finished): env faults are fn's to
    handle, as `run_episode` does.
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
        return list(workers.map(call, items))

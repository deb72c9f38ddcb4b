"""The rollout stage over one shard of queries: episodes and steps rows, no Prefect.

One AppServer per app the shard needs and one `EnvPool` (`settings.contexts` browser
contexts on one browser) running the shard's queries in parallel. An episode that ends
in an environment fault (browser crash, timeout, app server down) is kept as an
env_fault row, which critics skip, and its query is rerun as a new episode, up to
`settings.max_fault_retries` times, as Agentic-Q's detection-rerunning does: a fault
never turns into a failed task.

Episode ids are a hash of (run_id, query_id, attempt), so a rerun of a shard writes the
same ids and the catalog can tell a redone shard from new work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from trajforge.query_gen.android import ANDROID
from trajforge.envs.android import DevicePool
from trajforge.envs.apps import AppServer, BundledApp, UnknownAppError, load_app
from trajforge.envs.browser import BrowserEnv
from trajforge.rollout.episode import BlobSink, run_episode
from trajforge.envs.pool import EnvPool
from trajforge.llm import Gateway
from trajforge.rollout.gui_owl import GuiOwlPolicy
from trajforge.rollout.mobile_agent import MobileAgentPolicy
from trajforge.envs.miniwob import MiniWoBEnv, MiniWoBServer
from trajforge.rollout.policy import Policy
from trajforge.rollout.random_policy import RandomPolicy
from trajforge.rollout.replay import ReplayPolicy
from trajforge.schemas.config import RolloutSettings
from trajforge.schemas.records import Episode, Query, Step
from trajforge.schemas.stage import StageOutput


MINIWOB = "miniwob"  # queries from the MiniWoB++ suite (query_gen.miniwob_tasks), not a bundled app


def episode_id_for(run_id: str, query_id: str, attempt: int = 1) -> str:
    """Deterministic episode id: the same run, query and attempt always give the same id.

    The first attempt keeps the id episodes had before reruns existed.
    """
    key = f"{run_id}\x00{query_id}" + (f"\x00{attempt}" if attempt > 1 else "")
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def make_policy(settings: RolloutSettings, app: BundledApp | None, gateway: Gateway | None,
                guidance: dict[str, str] | None = None) -> Policy:
    """The configured policy for one app's queries (app None: MiniWoB++); model-driven ones need the gateway.

    `guidance` (query id -> text) goes into the end-to-end policy's prompt; the other policies do not read it.
    """
    if settings.policy == "replay":
        assert app is not None, "replay needs a bundled app's page graph"
        return ReplayPolicy(app.spec)
    if settings.policy == "random":
        return RandomPolicy(settings.random_seed)
    if gateway is None:
        raise ValueError(f"policy {settings.policy!r} asks a model: the rollout needs a gateway")
    if settings.policy == "mobile_agent_v3":
        return MobileAgentPolicy(gateway, viewport=settings.viewport, model=settings.model)
    return GuiOwlPolicy(gateway, viewport=settings.viewport, model=settings.model,
                        history_images=settings.history_images, guidance=guidance)


def rollout(queries: list[dict[str, Any]], *, run_id: str, settings: RolloutSettings,
            blobs: BlobSink, gateway: Gateway | None = None,
            guidance: dict[str, tuple[str, str]] | None = None) -> StageOutput:
    """Run every query of the shard with the configured policy and viewport.

    `guidance` maps query ids to (guidance id, text): those queries' episodes are guided
    rollouts of the self-evolving loop, and their rows name the guidance.

    Queries for an app that is not bundled are dropped with a reason (they belong to
    another environment). Every env_fault episode is counted in `dropped` under its
    fault kind, as rerun or as the query's last attempt.
    """
    output = StageOutput(rows={"episodes": [], "steps": []}, models={"policy": settings.policy}, prompts={})
    parsed = [q if isinstance(q, Query) else Query.model_validate(q) for q in queries]
    apps: dict[str, BundledApp] = {}
    runnable: list[Query] = []
    on_devices: list[Query] = []
    for q in parsed:
        if q.app in (MINIWOB, ANDROID) and settings.policy == "replay":
            output.dropped[f"{q.app} query: the replay policy has no reference path"] += 1
            continue
        if q.app == MINIWOB:
            runnable.append(q)
            continue
        if q.app == ANDROID:
            if settings.android.devices:
                on_devices.append(q)
            else:
                output.dropped["android query: no device configured (rollout.android.devices)"] += 1
            continue
        if q.app not in apps:
            try:
                apps[q.app] = load_app(q.app)
            except UnknownAppError:
                output.dropped[f"no bundled app {q.app!r}"] += 1
                continue
        runnable.append(q)

    guidance = guidance or {}
    texts = {query_id: text for query_id, (_, text) in guidance.items()}

    def attempts(env: Any, q: Query, start_url: str) -> list[tuple[Episode, list[Step]]]:
        """The query's episodes: the first, and a rerun after each env fault while retries last."""
        runs = []
        for attempt in range(1, settings.max_fault_retries + 2):
            runs.append(run_episode(
                env, make_policy(settings, apps.get(q.app), gateway, texts), q, run_id=run_id,
                episode_id=episode_id_for(run_id, q.query_id, attempt), attempt=attempt,
                blobs=blobs, max_steps=q.max_steps, start_url=start_url,
                max_invalid=settings.max_invalid_actions,
            ))
            if runs[-1][0].status != "env_fault":
                break
        return runs

    results: list[list[tuple[Episode, list[Step]]]] = []
    if on_devices:
        results += DevicePool(settings.android).map(lambda env, q: attempts(env, q, q.path[0]), on_devices)
    if runnable:
        results += _in_browser(runnable, apps, settings, attempts)
    for runs in results:
        for episode, steps in runs:
            last = episode is runs[-1][0]
            if episode.query_id in guidance:
                episode = episode.model_copy(update={"guidance_id": guidance[episode.query_id][0]})
                output.stats["guided episodes"] += 1
            output.rows["episodes"].append(episode)
            output.rows["steps"].extend(steps)
            if episode.status == "env_fault":
                outcome = "no reruns left" if last else "rerun"
                output.dropped[f"env_fault {episode.fault_kind}: {outcome}"] += 1
    for episode in output.rows["episodes"]:  # lineage: which model and prompt versions acted
        if episode.model_id not in ("replay", "random"):
            output.models["policy_model"] = episode.model_id
        for item in episode.prompt_version.split(","):
            name, _, version = item.partition("@")
            if version:
                output.prompts[name] = version
    return output


def _in_browser(queries: list[Query], apps: dict[str, BundledApp], settings: RolloutSettings,
                attempts: Callable[[Any, Query, str], list[tuple[Episode, list[Step]]]]
                ) -> list[list[tuple[Episode, list[Step]]]]:
    """Bundled-app and MiniWoB++ queries on the browser pool, their servers up meanwhile."""
    with ExitStack() as stack:
        servers = {name: stack.enter_context(AppServer(app)) for name, app in apps.items()}
        start_urls = {name: servers[name].base_url + app.spec.pages[app.spec.start].url
                      for name, app in apps.items()}
        miniwob = stack.enter_context(MiniWoBServer()) if any(q.app == MINIWOB for q in queries) else None
        pool = stack.enter_context(EnvPool(
            settings.contexts, viewport=settings.viewport, chromium=settings.chromium,
            action_timeout_s=settings.action_timeout_s,
            apps={apps[n].spec.title: u for n, u in start_urls.items()} | start_urls,
        ))

        def run(env: BrowserEnv, q: Query) -> list[tuple[Episode, list[Step]]]:
            if q.app == MINIWOB:
                assert miniwob is not None
                return attempts(MiniWoBEnv(env), q, miniwob.task_url(q.path[0], int(json.loads(q.slots_json)["seed"])))
            return attempts(env, q, start_urls[q.app])

        return pool.map(run, queries)

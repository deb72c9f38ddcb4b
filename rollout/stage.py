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

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import polars as pl

from trajforge.envs.apps import UnknownAppError
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.kinds import AppKind, kind_for
from trajforge.envs.pool import EnvPool
from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway
from trajforge.llm.workspace import Workspace
from trajforge.rollout.episode import BlobSink, run_episode
from trajforge.rollout.gui_owl import GuiOwlPolicy
from trajforge.rollout.mobile_agent import MobileAgentPolicy
from trajforge.rollout.policy import Draw, Policy
from trajforge.rollout.random_policy import RandomPolicy
from trajforge.rollout.replay import ReplayPolicy
from trajforge.schemas.config import RolloutSettings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Episode, Query, Step
from trajforge.schemas.stage import Inputs, StageDef, StageOutput


def episode_id_for(run_id: str, query_id: str, attempt: int = 1, sample: int = 0) -> str:
    """Deterministic episode id: the same run, query, sample and attempt always give the same id.

    The first sample's first attempt keeps the id episodes had before reruns and samples existed.
    """
    key = f"{run_id}\x00{query_id}" + (f"\x00{attempt}" if attempt > 1 else "") + (f"\x00s{sample}" if sample else "")
    return digest(key, 24)


def draw_for(settings: RolloutSettings, seed_base: str, query_id: str, sample: int) -> Draw | None:
    """How one attempt of a query decodes: None (greedy) at temperature 0; else sampled with a seed drawn
    from `seed_base` (the queries version the night read), so a rerun of that night asks for the same
    samples, which the response cache answers, and a new night's queries version samples anew."""
    if settings.temperature == 0:
        return None
    seed = int(digest(f"{seed_base}\x00{query_id}\x00{sample}", 8), 16)
    return Draw(settings.temperature, settings.top_p, seed)


def make_policy(settings: RolloutSettings, spec: AppSpec | None, gateway: Gateway | None,
                guidance: dict[str, str] | None = None, draw: Draw | None = None) -> Policy:
    """The configured policy for one app's queries (`spec`: its page graph, if it has one); model-driven ones
    need the gateway.

    `guidance` (query id -> text) goes into the end-to-end policy's prompt; the other policies do not read it.
    """
    if settings.policy == "replay":
        assert spec is not None, "replay needs the app's page graph"
        return ReplayPolicy(spec)
    if settings.policy == "random":
        return RandomPolicy(settings.random_seed)
    if gateway is None:
        raise ValueError(f"policy {settings.policy!r} asks a model: the rollout needs a gateway")
    if settings.policy == "mobile_agent_v3":
        return MobileAgentPolicy(gateway, viewport=settings.viewport, model=settings.model, draw=draw)
    return GuiOwlPolicy(gateway, viewport=settings.viewport, model=settings.model,
                        history_images=settings.history_images, guidance=guidance, draw=draw,
                        click_targets=settings.click_targets)


def rollout(queries: list[Query] | list[dict[str, Any]], *, run_id: str, settings: RolloutSettings,
            blobs: BlobSink, gateway: Gateway | None = None,
            guidance: dict[str, tuple[str, str]] | None = None, seed_base: str = "") -> StageOutput:
    """Run every query of the shard `rollout.samples_per_query` times with the configured policy and viewport.

    `guidance` maps query ids to (guidance id, text): those queries' episodes are guided
    rollouts of the self-evolving loop, and their rows name the guidance. `seed_base` makes
    the sampled attempts' seeds (`draw_for`).

    A query whose app is unknown, or whose kind cannot run here (an Android query with no
    device, a suite task under the replay policy), is dropped with the reason. Every env_fault
    episode is counted in `dropped` under its fault kind, as rerun or as the sample's last attempt.
    """
    output = StageOutput(rows={"episodes": [], "steps": []}, models={"policy": settings.policy}, prompts={})
    parsed = [q if isinstance(q, Query) else Query.model_validate(q) for q in queries]
    kinds: dict[str, AppKind] = {}
    runnable: list[Query] = []
    for q in parsed:
        if q.app not in kinds:
            try:
                kinds[q.app] = kind_for(q.app)
            except UnknownAppError:
                output.dropped[f"no bundled app {q.app!r}"] += 1
                continue
        kind = kinds[q.app]
        if kind.spec is None and settings.policy == "replay":
            output.dropped[f"{q.app} query: the replay policy has no reference path"] += 1
        elif (reason := kind.unavailable(settings)) is not None:
            output.dropped[f"{q.app} query: {reason}"] += 1
        else:
            runnable.append(q)

    guidance = guidance or {}
    texts = {query_id: text for query_id, (_, text) in guidance.items()}

    def attempts(env: Any, q: Query, start_url: str) -> list[tuple[Episode, list[Step]]]:
        """The query's episodes: each sample's first, and a rerun after each env fault while retries last."""
        runs = []
        for sample in range(settings.samples_per_query):
            draw = draw_for(settings, seed_base, q.query_id, sample)
            for attempt in range(1, settings.max_fault_retries + 2):
                episode, steps = run_episode(
                    env, make_policy(settings, kinds[q.app].spec, gateway, texts, draw), q, run_id=run_id,
                    episode_id=episode_id_for(run_id, q.query_id, attempt, sample), attempt=attempt,
                    blobs=blobs, max_steps=q.max_steps, start_url=start_url,
                    max_invalid=settings.max_invalid_actions, max_repeats=settings.max_repeated_actions,
                )
                runs.append((episode.model_copy(update={"sample": sample, "seed": draw.seed if draw else None}),
                             steps))
                if episode.status != "env_fault":
                    break
        return runs

    results: list[list[tuple[Episode, list[Step]]]] = []
    for kind in kinds.values():
        if not kind.in_browser and (mine := [q for q in runnable if q.app == kind.name]):
            results += kind.on_devices(settings, attempts, mine)
    if in_browser := [q for q in runnable if kinds[q.app].in_browser]:
        results += _in_browser(in_browser, kinds, settings, attempts)
    for runs in results:
        for i, (episode, steps) in enumerate(runs):
            last = i == len(runs) - 1 or runs[i + 1][0].sample != episode.sample  # this sample's last attempt
            if episode.query_id in guidance:
                episode = episode.model_copy(update={"guidance_id": guidance[episode.query_id][0]})
                output.stats["guided episodes"] += 1
            output.rows["episodes"].append(episode)
            output.rows["steps"].extend(steps)
            if episode.status == "env_fault":
                outcome = "no reruns left" if last else "rerun"
                output.dropped[f"env_fault {episode.fault_kind}: {outcome}"] += 1
    _count_policy_steps(output)
    for episode in output.rows["episodes"]:  # lineage: which model and prompt versions acted
        if episode.model_id not in ("replay", "random"):
            output.models["policy_model"] = episode.model_id
        for item in episode.prompt_version.split(","):
            name, _, version = item.partition("@")
            if version:
                output.prompts[name] = version
    return output


def _in_browser(queries: list[Query], kinds: dict[str, AppKind], settings: RolloutSettings,
                attempts: Callable[[Any, Query, str], list[tuple[Episode, list[Step]]]]
                ) -> list[list[tuple[Episode, list[Step]]]]:
    """The browser kinds' queries on the browser pool, their apps served meanwhile."""
    with ExitStack() as stack:
        sites = {name: kinds[name].serve(stack) for name in sorted({q.app for q in queries})}
        launchers = {name: url for site in sites.values() for name, url in site.launchers.items()}
        pool = stack.enter_context(EnvPool(
            settings.contexts, viewport=settings.viewport, chromium=settings.chromium,
            action_timeout_s=settings.action_timeout_s, apps=launchers,
        ))

        def run(env: BrowserEnv, q: Query) -> list[tuple[Episode, list[Step]]]:
            site = sites[q.app]
            return attempts(site.wrap(env), q, site.start_url(q))

        return pool.map(run, queries)


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class GuidanceRef:
    """The guidance a run wrote for a hard query, handed to its rollout's prompt."""

    guidance_id: str
    text: str


@dataclass(frozen=True)
class RolloutUnit:
    """One query to roll out, with the guidance this run wrote for it (None: unguided)."""

    query: Query
    guidance: GuidanceRef | None = None
    seed_base: str = ""
    """The queries version it came from: its sampled attempts' seeds are drawn from it."""


def load_queries(ws: Workspace, snapshot: int | None) -> Inputs[RolloutUnit]:
    """The queries of one version, each with the guidance written for that version.

    The guidance is the latest guidance stage run that read this very queries version: in a
    nightly, the run's own; run stage by stage (`trajforge run history`, then `guidance`, then
    `rollout`, each its own run), the guidance run that followed the history run. Pairing by
    the queries' run id instead missed the second case (the history run writes queries, a
    later run the guidance).
    """
    frame, snapshot = ws.catalog.rows_added("queries", snapshot)
    snapshots = {"queries": snapshot}
    guidance: dict[str, GuidanceRef] = {}
    written = [info for info in ws.catalog.history("guidance")
               if info.lineage is not None and info.lineage.stage == "guidance"
               and info.lineage.inputs.get("queries") == snapshot]
    if written:
        info = written[-1]
        assert info.lineage is not None
        rows = ws.catalog.load("guidance", info.snapshot_id).filter(pl.col("run_id") == info.lineage.run_id)
        guidance = {r["query_id"]: GuidanceRef(r["guidance_id"], r["text"])
                    for r in rows.select("query_id", "guidance_id", "text").to_dicts()}
        if guidance:
            snapshots["guidance"] = info.snapshot_id
    units = [RolloutUnit(Query.model_validate(q), guidance.get(q["query_id"]), f"queries@{snapshot}")
             for q in frame.to_dicts()]
    return Inputs(units=units, snapshots=snapshots)


def _count_policy_steps(output: StageOutput) -> None:
    """The model policy's steps in the lineage: valid actions, constrained answers, model calls and time."""
    for step in output.rows["steps"]:
        assert isinstance(step, Step)
        if step.model_calls_json is None:  # replay and random policies ask no model
            continue
        output.stats["policy steps"] += 1
        output.stats["policy steps with a valid action"] += step.action_valid
        for call in json.loads(step.model_calls_json):
            output.stats["policy model calls"] += 1
            output.stats["policy model ms"] += round(call["latency_ms"])
            output.stats["policy calls constrained while decoding"] += call.get("constrained") is not None


def policy_summary(stats: dict[str, int]) -> str | None:
    """The share of the model policy's steps with a valid action and the model time a step cost (None: the
    policy asked no model)."""
    steps = stats.get("policy steps", 0)
    if not steps:
        return None
    valid = stats.get("policy steps with a valid action", 0)
    return (f"{steps} policy steps, {valid} ({valid / steps:.0%}) with a valid action; "
            f"{stats.get('policy calls constrained while decoding', 0)} of {stats.get('policy model calls', 0)} "
            f"model answers held to their format while decoding; {stats.get('policy model ms', 0) / 1000 / steps:.1f} "
            "s of model time per step")


def run_rollouts(units: list[RolloutUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Rollouts by the configured model iteration's model, guided where the run wrote guidance."""
    settings = ws.settings.rollout
    iteration_model = ws.settings.loop.models.get(ws.settings.loop.iteration)
    if iteration_model is not None:
        settings = settings.model_copy(update={"model": iteration_model})
    guidance = {u.query.query_id: (u.guidance.guidance_id, u.guidance.text) for u in units if u.guidance}
    out = rollout([u.query for u in units], run_id=run_id, settings=settings, blobs=ws.blobs, gateway=ws.gateway,
                  guidance=guidance, seed_base=units[0].seed_base if units else "")
    if iteration_model is not None:
        out.stats[f"episodes by loop.models[{ws.settings.loop.iteration}]"] += len(out.rows["episodes"])
    return out


STAGE = StageDef[Workspace, RolloutUnit](
    name="rollout",
    key=lambda u: u.query.query_id,
    reads="queries",
    writes={"episodes": "append", "steps": "append"},
    sections=("rollout", "loop", "llm"),
    load=load_queries,
    run=run_rollouts,
    shard_size=lambda s: s.rollout.episodes_per_shard,
    # One shard at a time: each shard runs `rollout.contexts` browser contexts itself.
    summary=policy_summary,
)

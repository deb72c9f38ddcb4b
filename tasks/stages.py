"""The pipeline's stages: what each reads, writes and runs, for the runner and the flows."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

import polars as pl

from trajforge.critics.checkers import checker_for
from trajforge.critics.stage import judge
from trajforge.data.catalog import Lineage
from trajforge.guidance.distill import Describer
from trajforge.guidance.history import hardness
from trajforge.guidance.stage import guide, load_demonstrations, record
from trajforge.query_gen.android import ANDROID, android_queries
from trajforge.query_gen.miniwob import miniwob_queries
from trajforge.query_gen.stage import generate_queries
from trajforge.envs.apps import load_app
from trajforge.rollout.stage import MINIWOB, rollout
from trajforge.schemas.stage import StageOutput
from trajforge.synth.export import export
from trajforge.tasks.runner import Inputs, StageDef
from trajforge.tasks.workspace import Workspace


def rows_added(ws: Workspace, table: str, snapshot: int | None) -> tuple[pl.DataFrame, int]:
    """The rows that one version of a table added (its run's rows), and that version's id.

    Tables accumulate across runs; a stage works on what one run produced, which is
    what `--input TABLE@VERSION` names.
    """
    if snapshot is None:
        _, snapshot = ws.catalog.resolve(f"{table}@latest")
        if snapshot is None:
            raise LookupError(f"table {table!r} has no version yet; run the stage that writes it first")
    frame = ws.catalog.load(table, snapshot)
    lineage = ws.catalog.lineage(table, snapshot)
    if lineage is not None:
        frame = frame.filter(pl.col("run_id") == lineage.run_id)
    return frame, snapshot


def _snapshot_of_run(ws: Workspace, table: str, commit_key: str) -> int:
    for info in ws.catalog.history(table):
        if info.lineage is not None and info.lineage.commit_key == commit_key:
            return info.snapshot_id
    raise LookupError(f"table {table!r} has no version committed as {commit_key!r}")


def _load_apps(ws: Workspace, _: int | None) -> Inputs:
    apps = [load_app(name) for name in ws.settings.query_gen.apps]
    fingerprint = hashlib.sha256("".join(a.spec.model_dump_json() for a in apps).encode()).hexdigest()[:16]
    units = [{"app": a.name} for a in apps]
    if ws.settings.query_gen.miniwob_tasks:
        units.append({"app": MINIWOB})
    if ws.settings.query_gen.android_tasks:
        units.append({"app": ANDROID})
    return Inputs(units=units, fingerprint=fingerprint)


def _run_query_gen(units: list[dict[str, Any]], ws: Workspace, run_id: str, _: str) -> StageOutput:
    cfg = ws.settings.query_gen
    out = generate_queries(
        [load_app(u["app"]) for u in units if u["app"] not in (MINIWOB, ANDROID)], run_id=run_id, settings=cfg,
        gateway=ws.gateway if cfg.instructions == "model" else None, chromium=ws.settings.rollout.chromium,
        viewport=ws.settings.rollout.viewport,
    )
    if any(u["app"] == MINIWOB for u in units):
        out.rows["queries"].extend(miniwob_queries(
            cfg.miniwob_tasks, cfg.miniwob_seeds, run_id=run_id, max_steps=cfg.miniwob_max_steps,
            chromium=ws.settings.rollout.chromium,
        ))
        out.models["miniwob_utterances"] = f"miniwob@{version('miniwob')}"
    if any(u["app"] == ANDROID for u in units):
        out.rows["queries"].extend(android_queries(cfg.android_tasks, run_id=run_id))
    return out


def _load_queries(ws: Workspace, snapshot: int | None) -> Inputs:
    """The queries of one version, each with the guidance its run wrote for it (key `guidance`, or None)."""
    frame, snapshot = rows_added(ws, "queries", snapshot)
    snapshots = {"queries": snapshot}
    guidance: dict[str, dict[str, str]] = {}
    lineage = ws.catalog.lineage("queries", snapshot)
    _, guidance_snapshot = ws.catalog.resolve("guidance@latest")
    if lineage is not None and guidance_snapshot is not None:
        rows = ws.catalog.load("guidance", guidance_snapshot).filter(pl.col("run_id") == lineage.run_id)
        guidance = {r["query_id"]: r for r in rows.select("query_id", "guidance_id", "text").to_dicts()}
        if guidance:
            snapshots["guidance"] = guidance_snapshot
    units = [q | {"guidance": guidance.get(q["query_id"])} for q in frame.to_dicts()]
    return Inputs(units=units, snapshots=snapshots)


def _run_rollout(units: list[dict[str, Any]], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Rollouts by the configured model iteration's model, guided where the run wrote guidance."""
    settings = ws.settings.rollout
    iteration_model = ws.settings.loop.models.get(ws.settings.loop.iteration)
    if iteration_model is not None:
        settings = settings.model_copy(update={"model": iteration_model})
    guidance = {u["query_id"]: (u["guidance"]["guidance_id"], u["guidance"]["text"]) for u in units if u["guidance"]}
    queries = [{k: v for k, v in u.items() if k != "guidance"} for u in units]
    out = rollout(queries, run_id=run_id, settings=settings, blobs=ws.blobs, gateway=ws.gateway, guidance=guidance)
    out.stats[f"model iteration {ws.settings.loop.iteration}"] += len(out.rows["episodes"])
    return out


def _load_episodes(ws: Workspace, snapshot: int | None) -> Inputs:
    """Episodes of one version, with the steps and queries of the same rollout run."""
    episodes, snapshot = rows_added(ws, "episodes", snapshot)
    lineage = ws.catalog.lineage("episodes", snapshot)
    if lineage is None:
        raise LookupError(f"episodes@{snapshot} has no lineage, so its steps and queries cannot be found")
    steps_snapshot = _snapshot_of_run(ws, "steps", f"{lineage.run_id}:{lineage.stage}:steps")
    steps, _ = rows_added(ws, "steps", steps_snapshot)
    queries_snapshot = lineage.inputs["queries"]
    queries = {q["query_id"]: q for q in ws.catalog.load("queries", queries_snapshot).to_dicts()}
    by_episode: dict[str, list[dict[str, Any]]] = {}
    for step in steps.sort("step_index").to_dicts():
        by_episode.setdefault(step["episode_id"], []).append(step)
    units = [
        {**ep, "steps": by_episode.get(ep["episode_id"], []), "query": queries.get(ep["query_id"])}
        for ep in episodes.to_dicts()
    ]
    return Inputs(units=units, snapshots={"episodes": snapshot, "steps": steps_snapshot, "queries": queries_snapshot})


def _run_critics(units: list[dict[str, Any]], ws: Workspace, run_id: str, config_hash: str) -> StageOutput:
    cfg = ws.settings.critics
    asks_models = cfg.step_critic == "model" or cfg.text_channel or cfg.multimodal_model is not None
    return judge(
        units,
        run_id=run_id,
        settings=cfg,
        config_hash=config_hash,
        checker_for=checker_for,
        blobs=ws.blobs,
        gateway=ws.gateway if asks_models else None,
    )


STAGES: dict[str, StageDef] = {
    s.name: s
    for s in (
        StageDef(
            name="query_gen",
            key="app",
            reads=None,
            writes={"queries": "overwrite"},
            sections=("query_gen", "llm"),
            load=_load_apps,
            run=_run_query_gen,
            shard_size=lambda s: 1,
        ),
        StageDef(
            name="rollout",
            key="query_id",
            reads="queries",
            writes={"episodes": "append", "steps": "append"},
            sections=("rollout", "loop", "llm"),
            load=_load_queries,
            run=_run_rollout,
            shard_size=lambda s: s.rollout.episodes_per_shard,
            # One shard at a time: each shard runs `rollout.contexts` browser contexts itself.
        ),
        StageDef(
            name="critics",
            key="episode_id",
            reads="episodes",
            writes={"step_critiques": "append", "verdicts": "append"},
            sections=("critics", "llm"),
            load=_load_episodes,
            run=_run_critics,
            shard_size=lambda s: s.critics.episodes_per_shard,
        ),
    )
}


# ---------------------------------------------------------------- the self-evolving loop (paper 2.2.1, 6.4)


def _latest(ws: Workspace, table: str) -> tuple[pl.DataFrame, int | None]:
    """Every row of a table's latest version (an empty frame before its first), and that version's id."""
    _, snapshot = ws.catalog.resolve(f"{table}@latest")
    return ws.catalog.load(table, snapshot), snapshot


def _load_hard_queries(ws: Workspace, snapshot: int | None) -> Inputs:
    """The version's hard queries with their references, the worst `loop.max_guided` of them selected."""
    queries, snapshot = rows_added(ws, "queries", snapshot)
    history, history_snapshot = _latest(ws, "query_history")
    buffer, buffer_snapshot = _latest(ws, "replay_buffer")
    loop, cfg = ws.settings.loop, ws.settings.guidance
    demos = load_demonstrations(cfg.demonstrations) if cfg.demonstrations else []
    known = set(buffer["entry_id"])
    attempts: dict[str, list[tuple[Any, bool]]] = {}
    for row in history.select("query_id", "judged_at", "success").iter_rows():
        attempts.setdefault(row[0], []).append((row[1], row[2]))
    hard = []
    for q in queries.to_dicts():
        h = hardness(attempts.get(q["query_id"], []), window=loop.window, below=loop.hard_below)
        if h.hard:
            refs = buffer.filter(pl.col("query_id") == q["query_id"]).sort("run_id", descending=True).head(2).to_dicts()
            refs += [d | {"new": d["entry_id"] not in known} for d in demos if d["query_id"] == q["query_id"]]
            hard.append((h.recent_rate, -h.attempts, q | {"hard_reason": h.reason, "references": refs}))
    hard.sort(key=lambda t: (t[0], t[1], t[2]["query_id"]))
    units = [unit | {"selected": i < loop.max_guided} for i, (_, _, unit) in enumerate(hard)]
    snapshots = {"queries": snapshot} | {
        t: s for t, s in (("query_history", history_snapshot), ("replay_buffer", buffer_snapshot)) if s is not None}
    demo_hash = hashlib.sha256(cfg.demonstrations.read_bytes()).hexdigest()[:16] if cfg.demonstrations else ""
    return Inputs(units=units, snapshots=snapshots, fingerprint=demo_hash)


def _run_guidance(units: list[dict[str, Any]], ws: Workspace, run_id: str, _: str) -> StageOutput:
    cfg = ws.settings.guidance

    def replay(queries: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]], bool]]:
        """Each query's reference path replayed in its app now, with its checker's answer."""
        settings = ws.settings.rollout.model_copy(update={"policy": "replay"})
        out = rollout(queries, run_id=f"{run_id}-reference", settings=settings, blobs=ws.blobs)
        steps: dict[str, list[dict[str, Any]]] = {}
        for step in out.rows["steps"]:
            steps.setdefault(step.episode_id, []).append(step.model_dump())
        by_id = {q["query_id"]: q for q in queries}
        results = []
        for episode in out.rows["episodes"]:
            if episode.status == "env_fault":
                continue
            q = by_id[episode.query_id]
            ok, _ = checker_for(q["app"])(q["checker"], json.loads(q["checker_params_json"]),
                                          json.loads(episode.final_state_json))
            results.append((episode.model_dump(), steps.get(episode.episode_id, []), ok))
        return results

    describer = Describer(ws.gateway if cfg.describer == "model" else None, ws.blobs, cfg.model)
    return guide(units, run_id=run_id, describer=describer, replay=replay, max_steps=cfg.max_reference_steps)


def _load_judged(ws: Workspace, snapshot: int | None) -> tuple[list[dict[str, Any]], dict[str, int], Lineage]:
    """The judged episodes of one verdicts version, each with its steps, query and `success`."""
    verdicts, snapshot = rows_added(ws, "verdicts", snapshot)
    lineage = ws.catalog.lineage("verdicts", snapshot)
    if lineage is None:
        raise LookupError(f"verdicts@{snapshot} has no lineage, so its episodes cannot be found")
    episodes = _load_episodes(ws, lineage.inputs["episodes"])
    success = dict(verdicts.select("episode_id", "success").iter_rows())
    judged = [ep | {"success": success[ep["episode_id"]]} for ep in episodes.units if ep["episode_id"] in success]
    return judged, episodes.snapshots | {"verdicts": snapshot}, lineage


def _load_history_units(ws: Workspace, snapshot: int | None) -> Inputs:
    """Per query of the rolled-out set: its earlier record and this version's judged episodes.

    Episodes already in the history (a stage rerun on the same verdicts) are left out, so
    no attempt is counted twice.
    """
    judged, snapshots, _ = _load_judged(ws, snapshot)
    history, history_snapshot = _latest(ws, "query_history")
    recorded = set(history["episode_id"])
    prior: dict[str, list[int]] = {}
    for query_id, ok in history.select("query_id", "success").iter_rows():
        prior.setdefault(query_id, [0, 0])
        prior[query_id][0] += 1
        prior[query_id][1] += ok
    queries = ws.catalog.load("queries", snapshots["queries"]).to_dicts()
    units = []
    for q in queries:
        mine = [j for j in judged if j["query_id"] == q["query_id"]]
        units.append(q | {
            "prior": prior.get(q["query_id"], [0, 0]),
            "judged": [{"episode": j, "steps": j["steps"], "success": j["success"]}
                       for j in mine if j["episode_id"] not in recorded],
            "already_recorded": sum(j["episode_id"] in recorded for j in mine),
        })
    if history_snapshot is not None:
        snapshots["query_history"] = history_snapshot
    return Inputs(units=units, snapshots=snapshots)


def _run_history(units: list[dict[str, Any]], ws: Workspace, run_id: str, _: str) -> StageOutput:
    return record(units, run_id=run_id, iteration=ws.settings.loop.iteration, judged_at=datetime.now(UTC))


def _load_export_units(ws: Workspace, snapshot: int | None) -> Inputs:
    """Judged episodes of one verdicts version with their step critics' labels."""
    judged, snapshots, lineage = _load_judged(ws, snapshot)
    critiques_snapshot = _snapshot_of_run(ws, "step_critiques", f"{lineage.run_id}:{lineage.stage}:step_critiques")
    critiques, _ = rows_added(ws, "step_critiques", critiques_snapshot)
    labels = {r["step_id"]: r for r in critiques.select("step_id", "label", "summary").to_dicts()}
    units = [j | {"labels": {s["step_id"]: labels.get(s["step_id"]) for s in j["steps"]}} for j in judged]
    return Inputs(units=units, snapshots=snapshots | {"step_critiques": critiques_snapshot})


def run_tag(ws: Workspace, run_id: str) -> str:
    """The tag a run's versions get: nightly-YYYY-MM-DD for a nightly run, else the run id."""
    run = ws.ledger.get_run(run_id)
    return f"nightly-{run.started_at:%Y-%m-%d}" if run.flow == "nightly" else run_id


def _run_export(units: list[dict[str, Any]], ws: Workspace, run_id: str, _: str) -> StageOutput:
    return export(units, run_id=run_id, tag=run_tag(ws, run_id), blobs=ws.blobs)


STAGES.update({
    s.name: s
    for s in (
        StageDef(
            name="guidance",
            key="query_id",
            reads="queries",
            writes={"guidance": "append", "replay_buffer": "append"},
            sections=("guidance", "loop", "rollout", "llm"),
            load=_load_hard_queries,
            run=_run_guidance,
            shard_size=lambda s: 4,
        ),
        StageDef(
            name="history",
            key="query_id",
            reads="verdicts",
            writes={"query_history": "append", "replay_buffer": "append", "queries": "overwrite"},
            sections=("loop",),
            load=_load_history_units,
            run=_run_history,
            shard_size=lambda s: 500,
        ),
        StageDef(
            name="export",
            key="episode_id",
            reads="verdicts",
            writes={"train_e2e": "overwrite"},
            sections=("rollout",),
            load=_load_export_units,
            run=_run_export,
            shard_size=lambda s: 50,
        ),
    )
})

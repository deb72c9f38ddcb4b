"""Reference demonstrations: every validated query's reference path replayed once per query version.

A page-graph, atomic or deep-search query carries the path that defines it (its pages,
slots and `actions_json`). The replay policy walks that path in the live app, and the
query's checker reads the app's state at the end: a success is a demonstration correct by
construction, with screenshots, accessibility trees and pixel actions like any rollout's.
They give the synthesis stages valid actions to learn from even when the policy model
fails every step, and the guidance stage finds them in the replay buffer instead of
replaying on demand.

A recording is reused while it holds: the query's version is a hash of everything that
decides the path (the query's task fields and its app's page graph), and a query whose
version already has a reference episode in the warehouse is not replayed again.
Reference episodes are written to `episodes` and `steps` with `source: reference`,
`query_version` and the checker's `success`; the critics do not judge them (they read the
rollout stage's episodes), since the checker already has.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import polars as pl

from trajforge.envs.apps import UnknownAppError
from trajforge.envs.kinds import check_episode
from trajforge.guidance.history import buffer_entry
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import query_version, rollout, spec_hash
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Episode, Query, Step
from trajforge.schemas.stage import Inputs, StageDef, StageOutput


@dataclass(frozen=True)
class ReferenceUnit:
    """A query to replay in one viewport, with its version."""

    query: Query
    viewport: str
    version: str


def load_references(ws: Workspace, snapshot: int | None) -> Inputs[ReferenceUnit]:
    """The version's queries that have a reference path and no recording of their current version yet.

    Queries without a page graph (MiniWoB++ tasks, Android tasks) have no reference path; queries whose
    version was recorded by an earlier run are reused. Both are counted in the lineage's stats.
    """
    queries, snapshot = ws.catalog.rows_added("queries", snapshot)
    recorded: set[str] = set()
    _, episodes_snapshot = ws.catalog.resolve("episodes@latest")
    if episodes_snapshot is not None:
        episodes = ws.catalog.load("episodes", episodes_snapshot)
        if "query_version" in episodes.columns:
            # an env fault (a timeout on a loaded machine) recorded nothing: its version is replayed again
            # only runs whose stage committed every table (`Ledger.committed_runs`): this run's own episodes,
            # committed before a kill cut its steps' commit, are still to do
            done = episodes.filter((pl.col("source") == "reference") & (pl.col("status") != "env_fault")
                                   & pl.col("run_id").is_in(list(ws.ledger.committed_runs("reference"))))
            recorded = set(done["query_version"].drop_nulls())
    specs: dict[str, str] = {}
    units = []
    stats: Counter[str] = Counter()
    for row in queries.to_dicts():
        query = Query.model_validate(row)
        if query.app not in specs:
            try:
                specs[query.app] = spec_hash(query.app)
            except UnknownAppError:
                specs[query.app] = ""
        if not specs[query.app]:
            stats[f"{query.app} query: no page graph, so no reference path"] += 1
            continue
        for viewport in ws.settings.rollout.reference_viewports:
            version = query_version(query, specs[query.app], viewport)
            if version in recorded:
                stats["reference reused: this query version was recorded by an earlier run"] += 1
            else:
                units.append(ReferenceUnit(query, viewport, version))
    snapshots = {"queries": snapshot} | ({"episodes": episodes_snapshot} if episodes_snapshot is not None else {})
    return Inputs(units=units, snapshots=snapshots, fingerprint=digest("".join(sorted(specs.values()))), stats=stats)


def record_references(units: list[ReferenceUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Replay each unit's query in its viewport, check it, and keep the successes as replay-buffer entries too."""
    out = StageOutput(rows={"episodes": [], "steps": [], "replay_buffer": []}, models={"policy": "replay"}, prompts={})
    versions = {(u.query.query_id, u.viewport): u for u in units}

    def replay(viewport: str) -> StageOutput:
        settings = ws.settings.rollout.model_copy(
            update={"policy": "replay", "viewport": viewport, "samples_per_query": 1})  # one recording each
        # the policy's viewport keeps the ids references had before there were two
        tag = "reference" if viewport == ws.settings.rollout.viewport else f"reference-{viewport}"
        return rollout([u.query for u in units if u.viewport == viewport], run_id=f"{run_id}-{tag}",
                       settings=settings, blobs=ws.blobs)

    # The viewports at once, each on its own contexts: one after the other, a shard of 3 replays kept 1 core of 2
    # busy (a replay's steps wait on its page loads, and a shard held 1 or 2 of them at a time).
    viewports = sorted({u.viewport for u in units})
    with ThreadPoolExecutor(max(1, len(viewports)), thread_name_prefix="reference") as pool:
        replays = list(pool.map(replay, viewports))
    for done in replays:
        for table in ("episodes", "steps"):
            out.rows[table] += done.rows[table]
        out.dropped.update(done.dropped)
        out.stats.update(done.stats)
    steps: dict[str, list[Step]] = {}
    for step in out.rows["steps"]:
        steps.setdefault(step.episode_id, []).append(step)  # type: ignore[union-attr]
    episodes: list[Episode] = []
    for episode in out.rows["episodes"]:
        assert isinstance(episode, Episode)
        unit = versions[episode.query_id, episode.viewport]
        update = {"run_id": run_id, "source": "reference", "query_version": unit.version}
        if episode.status != "env_fault":
            ok, _ = check_episode(unit.query, episode)
            update["success"] = ok
            if ok:
                out.stats["reference demonstrations recorded"] += 1
            else:
                out.dropped[f"reference path replayed but the checker says it failed ({unit.query.app})"] += 1
        episode = episode.model_copy(update=update)
        episodes.append(episode)
        if episode.success:
            out.rows["replay_buffer"].append(buffer_entry(episode, steps.get(episode.episode_id, []), run_id=run_id,
                                                          origin="replay"))
    out.rows["episodes"] = episodes
    out.rows["steps"] = [s.model_copy(update={"run_id": run_id}) for s in out.rows["steps"]]  # type: ignore[union-attr]
    return out


STAGE = StageDef[Workspace, ReferenceUnit](
    name="reference",
    key=lambda u: f"{u.query.query_id}:{u.viewport}",
    reads="queries",
    writes={"episodes": "append", "steps": "append", "replay_buffer": "append"},
    sections=("rollout",),
    load=load_references,
    run=record_references,
    shard_size=lambda s: s.rollout.episodes_per_shard,
)

"""Per-query history and hard-query selection (paper 2.2.1): which queries the loop must help.

Every judged episode becomes one `query_history` row (the model, its iteration, whether it
was guided, the verdict). A query is hard when its success rate over its last k attempts
is below a threshold, or when it has never succeeded: those are the queries the model
keeps failing, and the ones guidance is written for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import polars as pl

from trajforge.critics.stage import EpisodeUnit, load_episodes
from trajforge.data.catalog import Lineage
from trajforge.llm.workspace import Workspace
from trajforge.schemas.records import Episode, Query, QueryAttempt, ReplayEntry, Step
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

STEP_FIELDS = (
    "step_index", "action_type", "action_json", "thought", "target_role", "target_name", "target_box", "action_valid",
    "url_before", "url_after", "title_before", "title_after", "ax_tree_before", "ax_tree_after",
    "screenshot_before", "screenshot_after",
)


@dataclass(frozen=True)
class Hardness:
    """A query's record so far and whether it counts as hard."""

    attempts: int
    successes: int
    recent_rate: float | None  # over the last k attempts; None before any attempt
    hard: bool
    reason: str


def hardness(attempts: list[tuple[datetime, bool]], *, window: int, below: float) -> Hardness:
    """Judge one query from its (judged_at, success) attempts, in any order.

    The recent rate is over the last `window` attempts taken in whole nights: a night's attempts share one
    judged_at (the history stage's) and have no order among them, so the newest nights are taken whole until
    they hold `window` attempts. A night of 8 samples with a window of 3 gives that night's rate over all 8, not
    over whichever 3 of its samples were recorded last."""
    if not attempts:
        return Hardness(0, 0, None, False, "never attempted")
    nights: dict[datetime, list[bool]] = {}
    for judged_at, ok in attempts:
        nights.setdefault(judged_at, []).append(ok)
    recent: list[bool] = []
    for judged_at in sorted(nights, reverse=True):
        if len(recent) >= window:
            break
        recent += nights[judged_at]
    tried, successes = len(attempts), sum(ok for _, ok in attempts)
    rate = sum(recent) / len(recent)
    if successes == 0:
        return Hardness(tried, 0, rate, True, f"never succeeded in {tried} attempt(s)")
    if rate < below:
        return Hardness(tried, successes, rate, True,
                        f"success rate {rate:.2f} over the last {len(recent)} attempt(s) is below {below}")
    return Hardness(tried, successes, rate, False, f"success rate {rate:.2f} over the last {len(recent)}")


def attempts_by_query(history: pl.DataFrame) -> dict[str, list[tuple[datetime, bool]]]:
    """query id -> its (judged_at, success) attempts in `query_history` rows: what `hardness` judges."""
    attempts: dict[str, list[tuple[datetime, bool]]] = {}
    for query_id, judged_at, success in history.select("query_id", "judged_at", "success").iter_rows():
        attempts.setdefault(query_id, []).append((judged_at, success))
    return attempts


def attempt_row(episode: Episode, query: Query, success: bool, *, run_id: str, iteration: int,
                judged_at: datetime) -> QueryAttempt:
    """The history row of one judged episode."""
    return QueryAttempt(
        run_id=run_id, episode_id=episode.episode_id, query_id=query.query_id, app=query.app,
        source=query.source, iteration=iteration, policy=episode.policy, model_id=episode.model_id,
        guidance_id=episode.guidance_id, success=success, judged_at=judged_at,
    )


def buffer_entry(episode: Episode, steps: list[Step], *, run_id: str, origin: str = "rollout") -> ReplayEntry:
    """A successful episode as a replay-buffer entry; its id is the episode's, so it is kept once."""
    return ReplayEntry(
        run_id=run_id, entry_id=f"{origin}:{episode.episode_id}", query_id=episode.query_id, origin=origin,
        episode_id=episode.episode_id, instruction=episode.instruction,
        steps_json=json.dumps([{f: d[f] for f in STEP_FIELDS}  # in STEP_FIELDS' order: the text is compared
                               for d in (s.model_dump(mode="json")
                                         for s in sorted(steps, key=lambda s: s.step_index))]),
    )


# ---------------------------------------------------------------- the stage: record the run's verdicts


@dataclass(frozen=True)
class JudgedEpisode:
    """An episode with its steps and the critics' verdict."""

    episode: Episode
    steps: list[Step]
    success: bool
    iteration: int = 0
    """The model iteration of the episode's policy model (`iterations`)."""


def iterations(history: list[tuple[str, int]], new: list[str]) -> dict[str, int]:
    """Model id -> its iteration of the self-evolving loop: the iteration its attempts were first recorded under,
    and for a model never recorded the next number (in sorted order, so every shard numbers them alike). A night
    with a new model starts a new iteration; no number is set by hand. `history`: (model id, iteration) rows."""
    known: dict[str, int] = {}
    for model_id, iteration in history:
        known[model_id] = min(iteration, known.get(model_id, iteration))
    following = max(known.values(), default=-1) + 1
    for model_id in sorted(set(new) - set(known)):
        known[model_id], following = following, following + 1
    return known


@dataclass(frozen=True)
class HistoryUnit:
    """A query of the rolled-out set: its record so far and this version's judged episodes not yet recorded."""

    query: Query
    prior_attempts: int
    prior_successes: int
    judged: list[JudgedEpisode]
    already_recorded: int
    """Judged episodes the history holds already: a rerun of the stage counts nothing twice."""
    rolled: bool
    """Whether the rollout run behind the verdicts has an episode of it, judged or not: a query it left out as
    identical to earlier attempts, or dropped (an unknown app, a kind that cannot run), has none."""


def load_judged(ws: Workspace, snapshot: int | None) -> tuple[list[tuple[EpisodeUnit, bool]], dict[str, int], Lineage]:
    """The judged episodes of one verdicts version with their success, the snapshots read, and the verdicts'
    lineage (the critics run that judged them)."""
    judged, _, snapshots, lineage = _load_verdicts(ws, snapshot)
    return judged, snapshots, lineage


def _load_verdicts(ws: Workspace, snapshot: int | None
                   ) -> tuple[list[tuple[EpisodeUnit, bool]], set[str], dict[str, int], Lineage]:
    """`load_judged`, and the queries the judged rollout run has any policy episode of, judged or not."""
    verdicts, snapshot = ws.catalog.rows_added("verdicts", snapshot)
    lineage = ws.catalog.lineage("verdicts", snapshot)
    if lineage is None:
        raise LookupError(f"verdicts@{snapshot} has no lineage, so its episodes cannot be found")
    episodes = load_episodes(ws, lineage.inputs["episodes"])
    success = dict(verdicts.select("episode_id", "success").iter_rows())
    judged = [(u, success[u.episode.episode_id]) for u in episodes.units if u.episode.episode_id in success]
    rolled = {u.episode.query_id for u in episodes.units}
    return judged, rolled, episodes.snapshots | {"verdicts": snapshot}, lineage


def load_history_units(ws: Workspace, snapshot: int | None) -> Inputs[HistoryUnit]:
    """Per query of the rolled-out set: its earlier record and this version's judged episodes."""
    judged, rolled, snapshots, _ = _load_verdicts(ws, snapshot)
    history, history_snapshot = ws.catalog.latest("query_history")
    recorded = set(history["episode_id"])
    prior: dict[str, list[int]] = {}
    for query_id, ok in history.select("query_id", "success").iter_rows():
        prior.setdefault(query_id, [0, 0])
        prior[query_id][0] += 1
        prior[query_id][1] += ok
    numbered = iterations(list(history.select("model_id", "iteration").iter_rows()) if history.height else [],
                          [u.episode.model_id for u, _ in judged])
    units = []
    for q in ws.catalog.load("queries", snapshots["queries"]).to_dicts():
        mine = [(u, ok) for u, ok in judged if u.episode.query_id == q["query_id"]]
        attempts, successes = prior.get(q["query_id"], [0, 0])
        units.append(HistoryUnit(
            query=Query.model_validate(q), prior_attempts=attempts, prior_successes=successes,
            judged=[JudgedEpisode(u.episode, u.steps, ok, numbered[u.episode.model_id]) for u, ok in mine
                    if u.episode.episode_id not in recorded],
            already_recorded=sum(u.episode.episode_id in recorded for u, _ in mine),
            rolled=q["query_id"] in rolled,
        ))
    if history_snapshot is not None:
        snapshots["query_history"] = history_snapshot
    return Inputs(units=units, snapshots=snapshots)


def record(units: list[HistoryUnit], *, run_id: str, judged_at: datetime) -> StageOutput:
    """History rows, replay-buffer entries and the query set with accumulated attempts and successes."""
    out = StageOutput(rows={"query_history": [], "replay_buffer": [], "queries": []})
    for unit in units:
        attempts, successes = unit.prior_attempts, unit.prior_successes
        for j in unit.judged:
            out.rows["query_history"].append(
                attempt_row(j.episode, unit.query, j.success, run_id=run_id, iteration=j.iteration,
                            judged_at=judged_at))
            attempts, successes = attempts + 1, successes + j.success
            if j.success:
                out.rows["replay_buffer"].append(buffer_entry(j.episode, j.steps, run_id=run_id))
        if unit.already_recorded:
            out.dropped["episode already in query_history (a rerun of the stage)"] += unit.already_recorded
        elif not unit.judged and unit.rolled:
            out.stats["queries with no judged episode (env faults only)"] += 1
        elif not unit.judged:
            out.stats["queries not rolled out by this run (not rolled again as identical, or dropped by the rollout: "
                      "its lineage counts say why)"] += 1
        out.rows["queries"].append(
            unit.query.model_copy(update={"run_id": run_id, "attempts": attempts, "successes": successes}))
    return out


def run_history(units: list[HistoryUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    return record(units, run_id=run_id, judged_at=datetime.now(UTC))


STAGE = StageDef[Workspace, HistoryUnit](
    name="history",
    key=lambda u: u.query.query_id,
    reads="verdicts",
    writes={"query_history": "append", "replay_buffer": "append", "queries": "overwrite"},
    sections=("loop",),
    load=load_history_units,
    run=run_history,
    shard_size=lambda s: 500,
)

"""Per-query history and hard-query selection (paper 2.2.1): which queries the loop must help.

Every judged episode becomes one `query_history` row (the model, its iteration, whether it
was guided, the verdict). A query is hard when its success rate over its last k attempts
is below a threshold, or when it has never succeeded: those are the queries the model
keeps failing, and the ones guidance is written for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trajforge.schemas.records import QueryAttempt, ReplayEntry

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
    """Judge one query from its (judged_at, success) attempts, in any order."""
    ordered = [ok for _, ok in sorted(attempts)]
    successes = sum(ordered)
    if not ordered:
        return Hardness(0, 0, None, False, "never attempted")
    recent = ordered[-window:]
    rate = sum(recent) / len(recent)
    if successes == 0:
        return Hardness(len(ordered), 0, rate, True, f"never succeeded in {len(ordered)} attempt(s)")
    if rate < below:
        return Hardness(len(ordered), successes, rate, True,
                        f"success rate {rate:.2f} over the last {len(recent)} attempt(s) is below {below}")
    return Hardness(len(ordered), successes, rate, False, f"success rate {rate:.2f} over the last {len(recent)}")


def attempt_row(episode: dict[str, Any], query: dict[str, Any], success: bool, *, run_id: str, iteration: int,
                judged_at: datetime) -> QueryAttempt:
    """The history row of one judged episode."""
    return QueryAttempt(
        run_id=run_id, episode_id=episode["episode_id"], query_id=query["query_id"], app=query["app"],
        source=query["source"], iteration=iteration, policy=episode["policy"], model_id=episode["model_id"],
        guidance_id=episode.get("guidance_id"), success=success, judged_at=judged_at,
    )


def buffer_entry(episode: dict[str, Any], steps: list[dict[str, Any]], *, run_id: str,
                 origin: str = "rollout") -> ReplayEntry:
    """A successful episode as a replay-buffer entry; its id is the episode's, so it is kept once."""
    return ReplayEntry(
        run_id=run_id, entry_id=f"{origin}:{episode['episode_id']}", query_id=episode["query_id"], origin=origin,
        episode_id=episode["episode_id"], instruction=episode["instruction"],
        steps_json=json.dumps([{f: s.get(f) for f in STEP_FIELDS}
                               for s in sorted(steps, key=lambda s: s["step_index"])]),
    )

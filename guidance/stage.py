"""The loop's two stages over rows, no Prefect: `guide` before rollouts, `record` after critics.

`guide` takes the hard queries (chosen from the per-query history), finds reference
trajectories for each (the replay buffer's successes, human demonstrations, or the
query's reference path replayed in its app now), and writes guidance rows. `record`
turns the run's verdicts into per-query history rows, keeps successful trajectories in
the replay buffer, and rewrites the query set with attempts and successes accumulated
across runs, so `queries@latest` shows each query's record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from trajforge.critics.steps import short_id
from trajforge.guidance.distill import Describer, guidance_row
from trajforge.guidance.history import STEP_FIELDS, attempt_row, buffer_entry
from trajforge.schemas.records import Query, ReplayEntry
from trajforge.schemas.stage import StageOutput

# (queries) -> [(episode, steps, success)]: each query's reference path run in its app, and its checker's answer.
Replayer = Callable[[list[dict[str, Any]]], list[tuple[dict[str, Any], list[dict[str, Any]], bool]]]


class DemoStep(BaseModel):
    """One step of a human demonstration, as the file holds it."""

    model_config = ConfigDict(extra="forbid")
    action_type: str
    action_json: str = "{}"
    thought: str
    title_before: str = ""
    title_after: str = ""
    url_before: str = ""
    url_after: str = ""
    ax_tree_before: str = ""
    ax_tree_after: str = ""
    target_role: str | None = None
    target_name: str | None = None


class Demonstration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query_id: str
    instruction: str
    steps: list[DemoStep]


def load_demonstrations(path: Path) -> list[dict[str, Any]]:
    """Human demonstrations from a JSONL file as replay-buffer entries (without a run id yet); errors name the
    file, line and field."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            demo = Demonstration.model_validate_json(line)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ValueError(f"{path}:{number}: field {'.'.join(str(p) for p in err['loc'])!r}: {err['msg']}") from None
        steps = [{f: None for f in STEP_FIELDS} | s.model_dump() | {"step_index": i, "action_valid": True}
                 for i, s in enumerate(demo.steps)]
        entries.append({
            "entry_id": f"human:{short_id(path.name, line)}", "query_id": demo.query_id, "origin": "human",
            "episode_id": None, "instruction": demo.instruction, "steps_json": json.dumps(steps),
        })
    return entries


def guide(units: list[dict[str, Any]], *, run_id: str, describer: Describer, replay: Replayer | None,
          max_steps: int) -> StageOutput:
    """Guidance for the hard queries of the shard.

    Each unit is a query's columns plus `hard_reason`, `selected` (False: hard, but over
    the per-run limit) and `references` (replay-buffer entries as dicts). A selected
    query without references gets its reference path replayed when `replay` is given.
    """
    out = StageOutput(rows={"guidance": [], "replay_buffer": []}, prompts={})
    todo = []
    for unit in units:
        if not unit["selected"]:
            out.dropped["hard, but over loop.max_guided this run"] += 1
        else:
            todo.append(unit)
    for unit in todo:  # demonstrations seen for the first time join the replay buffer
        for ref in unit["references"]:
            if ref.pop("new", False):
                out.rows["replay_buffer"].append(ReplayEntry(**ref | {"run_id": run_id}))
    missing = [u for u in todo if not u["references"]]
    if missing and replay is not None:
        for episode, steps, success in replay([_query(u) for u in missing]):
            if not success:
                out.dropped["reference path replayed but the checker says it failed"] += 1
                continue
            entry = buffer_entry(episode, steps, run_id=run_id, origin="replay")
            out.rows["replay_buffer"].append(entry)
            next(u for u in missing if u["query_id"] == episode["query_id"])["references"].append(entry.model_dump())
    for unit in todo:
        if not unit["references"]:
            out.dropped["no reference trajectory (none in the replay buffer, none replayed or demonstrated)"] += 1
            continue
        refs = [(r["entry_id"], json.loads(r["steps_json"])) for r in unit["references"]]
        row, distilled = guidance_row(_query(unit), refs, unit["hard_reason"], describer, run_id=run_id,
                                      max_steps=max_steps)
        out.stats.update(distilled.stats)
        out.stats["reference steps kept"] += sum(o["kept"] for o in distilled.outcomes)
        for d in distilled.dropped:
            out.stats[f"reference steps dropped: {d['reason'].split(':')[0]}"] += 1
        if row is None:
            out.dropped["quality control kept no step of any reference"] += 1
            continue
        out.rows["guidance"].append(row)
        if row.describer != "template":
            out.models["guidance_describer"] = row.describer
            for item in row.prompt_version.split(","):
                name, _, version = item.partition("@")
                out.prompts[name] = version
    return out


def _query(unit: dict[str, Any]) -> dict[str, Any]:
    return {k: unit[k] for k in Query.model_fields}


def record(units: list[dict[str, Any]], *, run_id: str, iteration: int, judged_at: datetime) -> StageOutput:
    """History rows, replay-buffer entries and the query set with accumulated attempts and successes.

    Each unit is a query's columns plus `prior` ([attempts, successes] so far), `judged`
    ([{episode, steps, success}] of the judged episodes not yet recorded) and
    `already_recorded` (judged episodes the history holds already: a rerun counts nothing twice).
    """
    out = StageOutput(rows={"query_history": [], "replay_buffer": [], "queries": []})
    for unit in units:
        query = _query(unit)
        attempts, successes = unit["prior"]
        for j in unit["judged"]:
            out.rows["query_history"].append(
                attempt_row(j["episode"], query, j["success"], run_id=run_id, iteration=iteration, judged_at=judged_at))
            attempts, successes = attempts + 1, successes + j["success"]
            if j["success"]:
                out.rows["replay_buffer"].append(buffer_entry(j["episode"], j["steps"], run_id=run_id))
        if unit["already_recorded"]:
            out.dropped["episode already in query_history (a rerun of the stage)"] += unit["already_recorded"]
        elif not unit["judged"]:
            out.stats["queries with no judged episode (env faults only)"] += 1
        out.rows["queries"].append(Query(**query | {"run_id": run_id, "attempts": attempts, "successes": successes}))
    return out

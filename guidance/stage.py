"""The guidance stage, before rollouts (paper 2.2.1): guidance for the queries the model keeps failing.

`guide` takes the hard queries (chosen from the per-query history), finds reference
trajectories for each (the replay buffer's successes, human demonstrations, or the
query's reference path replayed in its app now), and writes guidance rows. Its partner
after the critics, `record` (guidance/history.py), turns the run's verdicts into the
per-query history that decides which queries are hard.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from trajforge.critics.stage import checker_for
from trajforge.envs import secrets
from trajforge.envs.axtree import parse, render
from trajforge.guidance.distill import Describer, guidance_row
from trajforge.guidance.history import STEP_FIELDS, attempts_by_query, buffer_entry, hardness
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import rollout
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import Episode, Query, ReplayEntry, Step
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

# (queries) -> [(episode, steps, success)]: each query's reference path run in its app, and its checker's answer.
Replayer = Callable[[list[Query]], list[tuple[Episode, list[Step], bool]]]


@dataclass
class HardQuery:
    """A hard query of the input version, with its references (replay-buffer rows; a demonstration not yet in
    the buffer has `new: True`)."""

    query: Query
    hard_reason: str
    selected: bool
    """False: hard, but over `loop.max_guided` this run."""
    references: list[dict[str, Any]]


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

    @field_validator("action_json")
    @classmethod
    def _a_json_object(cls, action: str) -> str:
        """Quality control reads the action's fields (guidance.distill), and loading masks the secrets in them:
        text that is not a JSON object stops the run when the file is loaded, naming its line and field."""
        if not isinstance(json.loads(action), dict):  # a JSONDecodeError is a ValueError: pydantic reports it
            raise ValueError("not a JSON object")
        return action

    @field_validator("ax_tree_before", "ax_tree_after")
    @classmethod
    def _a_rendered_tree(cls, tree: str) -> str:
        """Quality control parses both trees (guidance.distill.changes), possibly nights after the file was read:
        a tree it cannot parse stops the run when the file is loaded, naming its line and field."""
        parse(tree)  # its ValueError says which line of the tree is not one
        return tree


class Demonstration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query_id: str
    instruction: str
    steps: list[DemoStep]


def load_demonstrations(path: Path) -> list[dict[str, Any]]:
    """Human demonstrations from a JSONL file as replay-buffer entries (without a run id yet); errors name the
    file, line and field."""
    entries = []
    for number, line in enumerate(path.read_text().split("\n"), 1):  # not `splitlines`: U+2028 may be in a text
        if not line.strip():
            continue
        try:
            demo = Demonstration.model_validate_json(line)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = f"field {'.'.join(str(p) for p in err['loc'])!r}" if err["loc"] else "not a JSON object"  # no field
            raise ValueError(f"{path}:{number}: {where}: {err['msg']}") from None
        steps = [{f: None for f in STEP_FIELDS} | s.model_dump() | {"step_index": i, "action_valid": True}
                 for i, s in enumerate(demo.steps)]
        entries.append({
            "entry_id": f"human:{short_id(path.name, line)}", "query_id": demo.query_id, "origin": "human",
            "episode_id": None, "instruction": secrets.mask(demo.instruction), "steps_json": json.dumps(_masked(steps)),
        })
    return entries


def _masked(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A demonstration's steps with every secret set in this process masked, as a rollout's steps are: a person
    types the password itself where a policy types its placeholder, and what the recorder kept of the page may
    show it. Whole in any field and in pieces across the same field of the steps (a code typed a digit a step:
    `secrets.mask_json`, which reads each action's fields), and in each tree node by node, whole and in pieces
    across its nodes' names and across their values, as `envs.browser.Observation` masks a live one. Never the
    rendered tree whole: a PIN's digits inside a node's box numbers were masked, and the tree no longer parsed."""
    trees = []
    for step in steps:
        step["action_json"] = json.loads(step["action_json"])
        trees.append({field: _masked_tree(step.pop(field)) for field in ("ax_tree_before", "ax_tree_after")})
    masked: list[dict[str, Any]] = secrets.mask_json(steps)
    for step, tree in zip(masked, trees, strict=True):
        step["action_json"] = json.dumps(step["action_json"])
        step.update(tree)
    return masked


def _masked_tree(text: str) -> str:
    nodes = parse(text)
    names, _ = secrets.mask_pieces([n.name for n in nodes])
    values, _ = secrets.mask_pieces([n.value for n in nodes])
    return render(replace(n, name=secrets.mask(names[i]), value=secrets.mask(values[i])) for i, n in enumerate(nodes))


def guide(units: list[HardQuery], *, run_id: str, describer: Describer, replay: Replayer | None,
          max_steps: int) -> StageOutput:
    """Guidance for the hard queries of the shard; a selected query without references gets its reference path
    replayed when `replay` is given."""
    out = StageOutput(rows={"guidance": [], "replay_buffer": []}, prompts={})
    todo = []
    for unit in units:
        if not unit.selected:
            out.dropped["hard, but over loop.max_guided this run"] += 1
        else:
            todo.append(unit)
    for unit in todo:  # demonstrations seen for the first time join the replay buffer
        for ref in unit.references:
            if ref.pop("new", False):
                out.rows["replay_buffer"].append(ReplayEntry(**ref | {"run_id": run_id}))
    missing = [u for u in todo if not u.references]
    failed: set[str] = set()  # queries whose replay failed: counted under that reason, once
    if missing and replay is not None:
        for episode, steps, success in replay([u.query for u in missing]):
            if not success:
                out.dropped["reference path replayed but the checker says it failed"] += 1
                failed.add(episode.query_id)
                continue
            entry = buffer_entry(episode, steps, run_id=run_id, origin="replay")
            out.rows["replay_buffer"].append(entry)
            next(u for u in missing if u.query.query_id == episode.query_id).references.append(entry.model_dump())
    for unit in todo:
        if not unit.references:
            if unit.query.query_id not in failed:
                out.dropped["no reference trajectory (none in the replay buffer, none replayed or demonstrated)"] += 1
            continue
        refs = [(r["entry_id"], json.loads(r["steps_json"])) for r in unit.references]
        row, distilled = guidance_row(unit.query.model_dump(), refs, unit.hard_reason, describer, run_id=run_id,
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


# ---------------------------------------------------------------- the stage


def load_hard_queries(ws: Workspace, snapshot: int | None) -> Inputs[HardQuery]:
    """The version's hard queries with their references, the worst `loop.max_guided` of them selected."""
    queries, snapshot = ws.catalog.rows_added("queries", snapshot)
    history, history_snapshot = ws.catalog.latest("query_history")
    buffer, buffer_snapshot = ws.catalog.latest("replay_buffer")
    loop, cfg = ws.settings.loop, ws.settings.guidance
    # The reference stage replays each query in every reference viewport, all under one query id: a route recorded
    # on another screen than the rollout's (a desktop route has none of the swipes a phone needs) guides a query only
    # while it has none recorded in the rollout's viewport. An entry whose episode is not in `episodes` (a
    # demonstration, a replay of this stage) counts as the rollout's.
    _, episodes_snapshot = ws.catalog.resolve("episodes@latest")
    viewports = ws.catalog.load("episodes", episodes_snapshot, columns=["episode_id", "viewport"])
    buffer = buffer.join(viewports.unique("episode_id"), on="episode_id", how="left").with_columns(
        elsewhere=pl.col("viewport").is_not_null() & (pl.col("viewport") != ws.settings.rollout.viewport))
    demos = load_demonstrations(cfg.demonstrations) if cfg.demonstrations else []
    known = set(buffer["entry_id"])
    attempts = attempts_by_query(history)
    hard = []
    stats: Counter[str] = Counter()  # why a query is not guided: a first night has no attempt of any
    for q in queries.to_dicts():
        h = hardness(attempts.get(q["query_id"], []), window=loop.window, below=loop.hard_below)
        if not h.hard:
            why = "never attempted" if h.attempts == 0 else f"recent success rate at or above {loop.hard_below}"
            stats[f"not hard: {why}"] += 1
        else:
            # The newest two, by when their run started (a run id is FLOW-YYYYmmddTHHMMSS-hex: sorted whole, every
            # `reference-...` run came before any `nightly-...` one whatever its date), ties by entry.
            started = pl.col("run_id").str.split("-").list.get(-2, null_on_oob=True)
            mine = buffer.filter(pl.col("query_id") == q["query_id"])
            here = mine.filter(~pl.col("elsewhere"))
            refs = ((here if here.height else mine).sort(started, "entry_id", descending=True).head(2)
                    .drop("viewport", "elsewhere").to_dicts())
            # A demonstration joins the buffer the first night it is used: from then on it may be among the newest
            # entries already, and is used once, not again from the file.
            listed = {r["entry_id"] for r in refs}
            refs += [d | {"new": d["entry_id"] not in known} for d in demos
                     if d["query_id"] == q["query_id"] and d["entry_id"] not in listed]
            hard.append((h.recent_rate, -h.attempts, q["query_id"], Query.model_validate(q), h.reason, refs))
    hard.sort(key=lambda t: t[:3])
    units = [HardQuery(query, reason, i < loop.max_guided, refs)
             for i, (_, _, _, query, reason, refs) in enumerate(hard)]
    snapshots = {"queries": snapshot} | {
        t: s for t, s in (("query_history", history_snapshot), ("replay_buffer", buffer_snapshot),
                          ("episodes", episodes_snapshot)) if s is not None}
    demo_hash = digest(cfg.demonstrations.read_bytes()) if cfg.demonstrations else ""
    return Inputs(units=units, snapshots=snapshots, fingerprint=demo_hash, stats=stats)


def run_guidance(units: list[HardQuery], ws: Workspace, run_id: str, _: str) -> StageOutput:
    cfg = ws.settings.guidance

    def replay(queries: list[Query]) -> list[tuple[Episode, list[Step], bool]]:
        """Each query's reference path replayed in its app now, with its checker's answer."""
        settings = ws.settings.rollout.model_copy(update={"policy": "replay", "samples_per_query": 1})
        out = rollout(queries, run_id=f"{run_id}-reference", settings=settings, blobs=ws.blobs)
        steps: dict[str, list[Step]] = {}
        for step in out.rows["steps"]:
            steps.setdefault(step.episode_id, []).append(step)
        by_id = {q.query_id: q for q in queries}
        results = []
        for episode in out.rows["episodes"]:
            if episode.status == "env_fault":
                continue
            q = by_id[episode.query_id]
            ok, _ = checker_for(q.app)(q.checker, json.loads(q.checker_params_json),
                                       json.loads(episode.final_state_json))
            results.append((episode, steps.get(episode.episode_id, []), ok))
        return results

    describer = Describer(ws.gateway if cfg.describer == "model" else None, ws.blobs, cfg.model)
    return guide(units, run_id=run_id, describer=describer, replay=replay, max_steps=cfg.max_reference_steps)


STAGE = StageDef[Workspace, HardQuery](
    name="guidance",
    key=lambda u: u.query.query_id,
    reads="queries",
    writes={"guidance": "append", "replay_buffer": "append"},
    sections=("guidance", "loop", "rollout", "llm"),
    load=load_hard_queries,
    run=run_guidance,
    shard_size=lambda s: 4,
)

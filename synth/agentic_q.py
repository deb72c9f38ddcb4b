"""Agentic-Q (agentic-q-step-wise-policy-optimization.md, sections 2 and 3.1-3.4): step values and SWPO groups.

Data stratification (3.1): each query's last n judged policy attempts (`agentic_q.attempts`,
the paper's n = 8; `rollout.samples_per_query` makes them) give its level l = successes
out of n. Levels 0 and n teach nothing (every attempt ends alike) and are dropped, counted.
Environment faults are not attempts: the rollout reruns them (detection-rerunning), and
an `env_fault` episode is never counted as a failure here.

Progress supervision (2, 3.3): with gamma = 1 and r_i = 0 before the last step, every step
of an attempt has the return G_i = r_T, the attempt's outcome. Each step is an
`agentic_q_values` row: the windowed state (the task, the last w actions in words, the
screen) and the action; the thought is kept beside it but is not part of what the value
is for (action-focus).

Candidate groups (3.4): for `agentic_q.groups` states of the night, the policy model (its
own prompt, `gui_owl_e2e`) samples K actions, its clicks held to the screen as the rollout holds
them (`rollout.click_targets`: a text-only model names one of the recorded screen's elements).
The paper scores them with its trained agentic-Q model; none is trained here, so the
Monte-Carlo estimate from the same attempts stands in: a candidate's score is the mean
return of the recorded steps at that state (same screen and window) whose action matches
it (`synth.match`), and the state's mean return V(s) when none does; an invalid candidate
scores 0. A group is dropped when its K actions are all the same, or when its scores' std
is below `agentic_q.min_std`; a kept group's weight is u(s) = mean(g)^-1 / sum over the
night's kept groups of mean(g)^-1. The stage runs as one shard so that sum is over the
whole night.

A query is taken up again whenever it has new attempts, and its rows in both tables replace
the ones earlier runs wrote for it (`StageDef.replaces` on `query_id`): the level is a
property of the query's last n attempts, so the latest version holds each informative
query's current n attempts once, every step with the level they give now, and none of a
query now at level 0 or n (3.1 drops it). Writing only the attempts a night added would
never write the attempts a query had while it waited for its nth, and would leave the
older ones with a level the query no longer has.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

import polars as pl

from trajforge.envs import actions, axtree
from trajforge.envs.browser import Target, screen_targets
from trajforge.llm import ImagePart
from trajforge.llm.prompts import PROMPTS_DIR
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, PROMPT, ToolCall, call_schema, click_targets_for, tool_spec
from trajforge.schemas.config import AgenticQSettings
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import QGroup, QValueSample, Step, steps_by_episode
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.synth.ask import Asker
from trajforge.synth.match import match
from trajforge.synth.trusted import checker_versions, group_advantages, history, predicted_action, trusted_action


@dataclass(frozen=True)
class Attempt:
    """One judged policy episode of a query, its steps in order."""

    episode_id: str
    success: bool
    model_id: str
    steps: list[Step]


@dataclass(frozen=True)
class QueryAttempts:
    """A query's last n judged attempts: the unit the level is counted over."""

    query_id: str
    instruction: str
    viewport: str
    checker: str
    attempts: list[Attempt]

    @property
    def level(self) -> int:
        return sum(a.success for a in self.attempts)


# ---------------------------------------------------------------- arithmetic


def group_weights(means: list[float]) -> list[float]:
    """u(s) = mean(g)^-1 / sum over s' of mean(g)^-1 for the kept groups' mean scores (all above 0: a group whose
    scores are all 0 has std 0 and is dropped before weighting)."""
    inverse = [1 / m for m in means]
    total = sum(inverse)
    return [i / total for i in inverse]


def group_filter(actions_seen: list[str], scores: list[float], min_std: float) -> str | None:
    """Why a group of K candidates is dropped (3.4), or None to keep it: all actions the same (no diversity), or
    scores concentrated (population std below `min_std`)."""
    if len(set(actions_seen)) == 1:
        return "identical actions"
    if statistics.pstdev(scores) < min_std:
        return f"concentrated scores (std < {min_std})"
    return None


def state_key(step: Step, window: list[str]) -> str:
    """One state across attempts: the same screen (URL and accessibility tree) after the same last w actions."""
    return digest("\n".join([step.url_before, step.ax_tree_before, *window]))


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class _Observed:
    """A recorded step at a state, and the return of its attempt."""

    action: dict[str, Any]
    target_box: list[float] | None
    value: float


def _values(unit: QueryAttempts, cfg: AgenticQSettings, run_id: str
            ) -> tuple[list[QValueSample], dict[str, list[_Observed]], dict[str, tuple[Step, list[str]]]]:
    """The Q-sample rows of a query's attempts, the recorded (action, return) pairs per state, and one step and
    window per state (what a candidate group is sampled on)."""
    rows, observed, states = [], {}, {}
    for attempt in unit.attempts:
        for i, step in enumerate(attempt.steps):
            if not step.action_valid:
                continue
            window = history(attempt.steps, i, cfg.window)
            key = state_key(step, window)
            value = 1.0 if attempt.success else 0.0
            observed.setdefault(key, []).append(_Observed(trusted_action(step), step.target_box, value))
            states.setdefault(key, (step, window))
            rows.append(QValueSample(
                run_id=run_id, value_id=short_id(run_id, step.step_id), query_id=unit.query_id,
                episode_id=attempt.episode_id, step_id=step.step_id, step_index=step.step_index,
                instruction=unit.instruction, history=window, screenshot=step.screenshot_before, width=step.width,
                height=step.height, url=step.url_before, state_key=key, action_type=step.action_type,
                action_json=step.action_json, target_box=step.target_box, thought=step.thought, value=value,
                level=unit.level, attempts=len(unit.attempts), checker=unit.checker, model_id=attempt.model_id))
    return rows, observed, states


def _score(candidate: dict[str, Any] | None, seen: list[_Observed], tolerance: float) -> tuple[float, int]:
    """The Monte-Carlo Q of a candidate at a state: the mean return of the recorded steps whose action it matches
    (how many), V(s) when it matches none; 0 for an invalid candidate."""
    if candidate is None:
        return 0.0, 0
    hits = [o.value for o in seen if match(candidate, o.action, target_box=o.target_box, tolerance=tolerance).ok]
    if hits:
        return statistics.fmean(hits), len(hits)
    return statistics.fmean(o.value for o in seen), 0


def _targets(step: Step) -> list[Target]:
    """The named elements of the step's recorded screen: what the live observation offered the policy
    (`Observation.targets`); none from a tree that does not parse (the click stays free)."""
    try:
        return screen_targets(axtree.parse(step.ax_tree_before or ""), step.width, step.height)
    except ValueError:
        return []


def _group(asker: Asker, ws: Workspace, unit: QueryAttempts, key: str, step: Step, window: list[str],
           seen: list[_Observed], run_id: str) -> QGroup:
    """K candidates from the policy's prompt at a recorded state, scored; the filters decide whether it is kept.
    A click is held to the screen as the rollout's policy holds it: with free pixels a text-only model invents
    points that miss every element, and its groups drop as concentrated scores."""
    cfg = ws.settings.agentic_q
    space = actions.space_for(unit.viewport)
    function = FUNCTIONS[space]
    held = click_targets_for(ws.gateway, ws.settings.rollout.model, ws.settings.rollout.click_targets)
    schema = call_schema(space, step.width, step.height, targets=_targets(step) if held == "names" else None)
    candidates, scores, seen_actions = [], [], []
    for k in range(cfg.candidates):
        answer = asker.ask(PROMPT, seed=k, temperature=cfg.temperature, schema=ToolCall, json_schema=schema,
                           platform=space, width=step.width, height=step.height, tools=tool_spec(space),
                           function=function, task=unit.instruction, guidance=None, history=window,
                           screenshots=[ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before)])
        action, error = predicted_action(answer, function)
        score, matched = _score(action, seen, ws.settings.synth.match_tolerance_px)
        candidates.append({"raw_output": answer.text, "action": action, "error": error, "score": score,
                           "matched": matched})
        scores.append(score)
        seen_actions.append(json.dumps(actions.normalize(action), sort_keys=True) if action else "invalid")
    reason = group_filter(seen_actions, scores, cfg.min_std)
    return QGroup(
        run_id=run_id, group_id=short_id(run_id, unit.query_id, key), query_id=unit.query_id, state_key=key,
        step_id=step.step_id, instruction=unit.instruction, history=window, screenshot=step.screenshot_before,
        width=step.width, height=step.height, level=unit.level, candidates_json=json.dumps(candidates),
        scores=scores, advantages=group_advantages(scores) if reason is None else [0.0] * len(scores),
        mean_score=statistics.fmean(scores), weight=None, kept=reason is None, drop_reason=reason,
        observed=len(seen), scorer="monte_carlo", model_id=answer.model_id, prompt_version=asker.version(PROMPT))


def estimate(units: list[QueryAttempts], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Levels, the Q-sample rows of the informative queries, and up to `agentic_q.groups` candidate groups."""
    cfg = ws.settings.agentic_q
    out = StageOutput(rows={"agentic_q_values": [], "agentic_q_groups": []})
    states: list[tuple[QueryAttempts, str, Step, list[str], list[_Observed]]] = []
    for unit in units:
        n, level = len(unit.attempts), unit.level
        out.stats[f"level {level} of {n}"] += 1
        for attempt in unit.attempts:
            if attempt.success:
                out.stats["successful trajectories"] += 1
                out.stats["steps of successful trajectories"] += len(attempt.steps)
        if level in (0, n):
            out.dropped[f"level {level} of {n}: every attempt {'failed' if level == 0 else 'succeeded'}"] += 1
            continue
        rows, observed, recorded = _values(unit, cfg, run_id)
        out.rows["agentic_q_values"].extend(rows)
        out.stats["q samples"] += len(rows)
        out.stats["q samples with G = 1"] += sum(r.value == 1 for r in rows)
        states += [(unit, key, *recorded[key], seen) for key, seen in observed.items()]
    # States seen in more attempts first (their scores rest on more returns), then by value spread.
    states.sort(key=lambda s: (-len(s[4]), -statistics.pstdev([o.value for o in s[4]]), s[1]))
    if states and ws.settings.synth.writer != "model":
        out.stats["synth.writer is template: no candidate groups sampled"] += 1
    elif cfg.groups and states:
        asker = Asker(ws, out, (PROMPT,), model=ws.settings.rollout.model, role="agentic_q", prompts=PROMPTS_DIR)
        groups = [_group(asker, ws, unit, key, step, window, seen, run_id)
                  for unit, key, step, window, seen in states[:cfg.groups]]
        kept = [g for g in groups if g.kept]
        weights = dict(zip((g.group_id for g in kept), group_weights([g.mean_score for g in kept])))
        for group in groups:
            out.stats["groups sampled"] += 1
            if group.drop_reason:
                out.dropped[f"group dropped: {group.drop_reason}"] += 1
                out.stats[f"groups dropped: {group.drop_reason}"] += 1
            out.rows["agentic_q_groups"].append(group.model_copy(update={"weight": weights.get(group.group_id)}))
    return out


def agentic_q_summary(stats: dict[str, int]) -> str | None:
    """The level histogram (queries per level), the positive-label rate, the mean steps of a successful attempt and
    the share of candidate groups each filter dropped."""
    levels = sorted((k for k in stats if k.startswith("level ")), key=lambda k: int(k.split()[1]))
    if not levels:
        return None
    line = f"levels (of {levels[0].split()[-1]}) " + ", ".join(f"{k.split()[1]}: {stats[k]}" for k in levels)
    samples = stats.get("q samples", 0)
    if samples:
        line += f"; {samples} step values, {stats.get('q samples with G = 1', 0) / samples:.0%} with G = 1"
    if stats.get("successful trajectories"):
        line += (f"; {stats['steps of successful trajectories'] / stats['successful trajectories']:.1f} steps per "
                 "successful trajectory")
    if groups := stats.get("groups sampled", 0):
        drops = [f"{k.removeprefix('groups dropped: ')} {n / groups:.0%}" for k, n in sorted(stats.items())
                 if k.startswith("groups dropped: ")]
        line += f"; {groups} candidate groups, dropped: {', '.join(drops) or 'none'}"
    return line


def load_attempts(ws: Workspace, snapshot: int | None) -> Inputs[QueryAttempts]:
    """The queries whose episodes the steps version holds, each with its last n judged policy attempts from every
    run up to that version. Environment faults, unjudged episodes, attempts whose steps came after that version and
    queries with fewer than n attempts are counted, not used."""
    cfg = ws.settings.agentic_q
    added, snapshot = ws.catalog.rows_added("steps", snapshot)
    inputs = Inputs[QueryAttempts](units=[], snapshots={"steps": snapshot})
    read = ws.catalog.latest_versions("episodes", "verdicts", "queries")  # each named in the lineage once read
    if "episodes" in read:
        inputs.snapshots["episodes"] = read["episodes"]
    episodes = ws.catalog.newest("episodes", "episode_id", read.get("episodes")).lazy()
    query_ids = (episodes.filter(pl.col("episode_id").is_in(added["episode_id"].unique().to_list()))
                 .select("query_id").unique().collect()["query_id"].to_list())
    if not query_ids:
        return inputs
    episodes = episodes.filter(pl.col("query_id").is_in(query_ids) & (pl.col("source") != "reference")).collect()
    verdicts: dict[str, bool] = {}
    if "verdicts" in read:
        inputs.snapshots["verdicts"] = read["verdicts"]
        verdicts = dict(ws.catalog.newest("verdicts", "episode_id", read["verdicts"])
                        .select("episode_id", "success").iter_rows())
    # Episodes and verdicts are read at their latest versions, steps at the input's: an attempt rolled after that
    # version (`--input steps@OLDER`) has no steps in it, and counted it would be an empty attempt at a level the
    # input's night never had, its rows replacing the query's complete ones. At that version it was not made yet.
    held = set(ws.catalog.scan("steps", snapshot).filter(pl.col("episode_id").is_in(episodes["episode_id"].to_list()))
               .select("episode_id").unique().collect()["episode_id"])
    judged: dict[str, list[dict[str, Any]]] = {}
    for e in episodes.sort("started_at").to_dicts():
        if e["status"] == "env_fault":
            inputs.stats["environment fault: rerun by the rollout, not counted as a failure"] += 1
        elif e["episode_id"] not in verdicts:
            inputs.stats["attempt not judged by the critics"] += 1
        elif e["num_steps"] and e["episode_id"] not in held:
            inputs.stats["attempt rolled after the input steps version: not counted"] += 1
        else:
            judged.setdefault(e["query_id"], []).append(e)
    ids = [e["episode_id"] for rows in judged.values() for e in rows[-cfg.attempts:]]
    steps = steps_by_episode(ws.catalog.newest("steps", "step_id", snapshot, where=pl.col("episode_id").is_in(ids))
                             .to_dicts())
    if "queries" in read:
        inputs.snapshots["queries"] = read["queries"]
    checkers = checker_versions(ws, list(judged), read.get("queries"))
    for query_id, rows in sorted(judged.items()):
        if len(rows) < cfg.attempts:
            inputs.stats[f"fewer than {cfg.attempts} judged attempts: left for a later night"] += 1
            continue
        last = rows[-cfg.attempts:]
        inputs.units.append(QueryAttempts(
            query_id, last[-1]["instruction"], last[-1]["viewport"], checkers.get(query_id, ""),
            [Attempt(e["episode_id"], verdicts[e["episode_id"]], e["model_id"], steps.get(e["episode_id"], []))
             for e in last]))
    return inputs


STAGE = StageDef[Workspace, QueryAttempts](
    name="agentic_q",
    key=lambda u: u.query_id,
    reads="steps",
    writes={"agentic_q_values": "append", "agentic_q_groups": "append"},
    sections=("agentic_q", "synth", "rollout", "llm"),
    # Not `once`: a query is the same key with new attempts. A redo (a night with a new attempt, a rerun by hand)
    # takes the query's earlier rows out, so no step is there twice.
    replaces=("query_id", lambda u: u.query_id),
    load=load_attempts,
    run=estimate,
    shard_size=lambda s: 1_000_000,  # one shard: u(s) is normalised over the whole night's groups
    summary=agentic_q_summary,
)

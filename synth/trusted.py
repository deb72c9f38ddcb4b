"""Step samples from trusted trajectories: the core the step-level datasets share.

GUI-Owl's reasoning synthesis and the three companion papers (PAL-UI, CES, Agentic-Q) all
cut a trajectory into independent step samples: the task, the state at step i, a
compressed history of the steps before it, and a target action to imitate or score. The
papers' ground truth is human demonstrations; ours are the trajectories whose actions we
trust: reference replays their query's checker passed, and policy episodes the critics'
latest verdict accepted. This module loads them once, in one shape, and holds the
arithmetic the group-based datasets share (group-normalised advantages).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

import polars as pl

from trajforge.critics.prefilter import NO_CHANGE
from trajforge.envs import actions, axtree
from trajforge.envs.browser import Target, screen_targets
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import MAX_TARGETS, call_schema, to_action
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Step, steps_by_episode
from trajforge.schemas.stage import Inputs
from trajforge.synth.ask import Answer
from trajforge.synth.semantics import NO_EFFECT, action_text


@dataclass(frozen=True)
class TrustedEpisode:
    """An episode whose actions are trusted, with its steps in order and what vouches for it."""

    episode_id: str
    query_id: str
    instruction: str
    viewport: str
    trusted: Literal["reference", "accepted"]
    steps: list[Step]
    checker: str = ""
    """The query's checker and a hash of its parameters (`name@hash`): the version of the test that passed."""
    harmful: frozenset[str] = frozenset()
    """The steps whose latest step critique is HARMFUL: an accepted episode can still take a wrong turn and come
    back; such a step stays in the episode (the history of the steps after it) but is no target to imitate."""
    no_change: frozenset[str] = frozenset()
    """The steps whose latest step critique carries the pre-filter's no_change flag (neither screen, tree nor URL
    changed) on an action that should change something (not a `NO_EFFECT` one): a single such click is NEUTRAL, so
    its episode can be accepted, but it teaches a click on nothing; history only, as in `synth.export`."""

    @property
    def unit_key(self) -> str:
        """The stages' unit (`StageDef.key`): the episode and, where its step critiques set steps apart, which ones.
        An accepted episode judged again with a step now HARMFUL (or no longer) is new work for a stage that did
        it, its rows replaced (`StageDef.replaces` on the episode); keyed on the episode alone, it kept the rows
        that taught the step now judged wrong. An episode with no step set apart keeps its plain id."""
        if not self.harmful and not self.no_change:
            return self.episode_id
        return f"{self.episode_id}:{digest(json.dumps([sorted(self.harmful), sorted(self.no_change)]))}"

    def imitable(self, index: int) -> bool:
        """Whether step `index` is a target a synthesis stage may teach: a valid action not labelled HARMFUL that
        changed something (or was not meant to)."""
        step = self.steps[index]
        return step.action_valid and step.step_id not in self.harmful and step.step_id not in self.no_change


def spread(units: list[TrustedEpisode], budget: int, min_step: int = 0) -> list[tuple[TrustedEpisode, int]]:
    """Up to `budget` steps worth a synthesis stage's model calls (reasoning's, PAL-UI's): imitable steps
    (`TrustedEpisode.imitable`) with at least `min_step` earlier steps, on a named target first, the earliest
    eligible step of every episode before the next of any (so a shard spreads over its episodes, and a memory of
    earlier steps is the shortest), and of one episode of every query before a second of any. A query's episodes
    (its reference replay on each viewport, an accepted attempt) ask nearly the same question: on 2026-12-03's
    default night PAL-UI's eight passes were five queries, each query's second viewport answered as its first, and
    none matched (no pal_ui_sft row); on the same steps, spread, they were eight queries and one matched."""
    episodes: dict[str, list[str]] = defaultdict(list)
    for unit in sorted(units, key=lambda u: u.episode_id):
        episodes[unit.query_id].append(unit.episode_id)
    candidates = [(u, i) for u in units for i in range(min_step, len(u.steps)) if u.imitable(i)]
    candidates.sort(key=lambda c: (not c[0].steps[c[1]].target_name, c[0].steps[c[1]].action_type == "terminate",
                                   c[1], episodes[c[0].query_id].index(c[0].episode_id), c[0].episode_id))
    return candidates[:budget]


def trusted_action(step: Step) -> dict[str, Any]:
    """The step's action as a flat action dict (`envs.actions`), the form `synth.match` compares."""
    return {"type": step.action_type, **json.loads(step.action_json)}


def history(steps: list[Step], index: int, window: int | None = None) -> list[str]:
    """The actions before step `index` in words, oldest first; only the last `window` of them when given."""
    start = 0 if window is None else max(0, index - window)
    return [action_text(s) for s in steps[start:index]]


MAX_POINTS = 64
"""Most element centres a prediction may choose among (the grammar grows with each)."""


def prediction_schema(space: actions.Space, step: Step, points: str) -> dict[str, Any]:
    """The call schema a synthesis stage's prediction of a step's action is held to. `synth.points: names`: a
    click names one of the step's on-screen interactive elements and its point is that element's centre, as
    the rollout's named clicks (a model that reads the tree as text chooses by what it reads); `elements`: a
    point can only be the centre of an element of the step's accessibility tree (chosen by its numbers; it
    cannot miss by arithmetic, which a 135M model cannot do); `free`: any pixel. A tree with no such element
    falls back to the next looser form."""
    centres: list[list[int]] = []
    try:
        nodes = axtree.parse(step.ax_tree_before or "") if points != "free" else []
    except ValueError:  # a tree that does not parse offers no element: the point stays free
        nodes = []
    if points == "names" and (targets := screen_targets(nodes, step.width, step.height)):
        return call_schema(space, step.width, step.height, targets=_choices(step, targets))
    if nodes:
        for node in nodes:
            if node.box is not None and "covered" not in node.states:
                x, y, w, h = node.box
                centre = [int(x + w / 2), int(y + h / 2)]
                if centre not in centres and 0 <= centre[0] < step.width and 0 <= centre[1] < step.height:
                    centres.append(centre)
    return call_schema(space, step.width, step.height, centres[:MAX_POINTS] or None)


def _choices(step: Step, targets: list[Target]) -> list[Target]:
    """The named targets a prediction of `step` chooses among: `call_schema` offers the first MAX_TARGETS, so on a
    longer screen a step whose own target comes later could never be matched. Its choices are then MAX_TARGETS
    consecutive targets around it, in document order as every choice list is, starting at a place drawn from the
    step's id: neither first nor last, so where it stands does not give it away."""
    if len(targets) <= MAX_TARGETS:
        return targets
    own = next((i for i, t in enumerate(targets) if _is_target(step, t)), None)
    if own is None or own < MAX_TARGETS:
        return targets[:MAX_TARGETS]
    start = own - int(digest(step.step_id), 16) % MAX_TARGETS
    start = min(max(start, 0), len(targets) - MAX_TARGETS)
    return targets[start:start + MAX_TARGETS]


def _is_target(step: Step, target: Target) -> bool:
    """Whether `target` is the element the step acted on: its recorded name, its centre in its recorded box (the
    box tells same-named elements apart)."""
    if target.name != step.target_name:
        return False
    if step.target_box is None:
        return True
    x, y, w, h = step.target_box
    return x <= target.x <= x + w and y <= target.y <= y + h


def predicted_action(answer: Answer, function: str) -> tuple[dict[str, Any] | None, str | None]:
    """The action a function-call answer names, or None and why not (no answer, no parse, or a call that is
    not the action space's)."""
    if answer.parsed is None:
        return None, answer.error
    try:
        return to_action(answer.parsed, function), None
    except ValueError as exc:
        return None, str(exc)


def group_advantages(scores: list[float]) -> list[float]:
    """GRPO's group-normalised advantage, (r - mean) / std (population std, CES eq. 5, Agentic-Q eq. 1); a group
    whose scores are all equal teaches nothing and gets zeros rather than a division by zero."""
    mean = statistics.fmean(scores)
    std = statistics.pstdev(scores)
    return [0.0 if std == 0 else (r - mean) / std for r in scores]


def checker_versions(ws: Workspace, query_ids: list[str], version: int | None = None) -> dict[str, str]:
    """query id -> `checker@hash of its parameters` for the queries' rows in that version (None: the latest)."""
    if "queries" not in ws.catalog.tables():
        return {}
    queries = (ws.catalog.scan("queries", version).filter(pl.col("query_id").is_in(query_ids))
               .unique("query_id", keep="last").select("query_id", "checker", "checker_params_json").collect())
    return {q: f"{c}@{digest(p, 8)}" for q, c, p in queries.iter_rows()}


def judged_steps(ws: Workspace, snapshot: int, step_ids: list[str]) -> tuple[set[str], set[str]]:
    """The steps of `step_ids` whose latest critique in that version of `step_critiques` (`Catalog.newest`) is
    HARMFUL, and those it flags no_change."""
    latest = ws.catalog.newest("step_critiques", "step_id", snapshot, where=pl.col("step_id").is_in(step_ids))
    harmful = set(latest.filter(pl.col("label") == "HARMFUL")["step_id"])
    if "flags" not in latest.columns:  # a version from before the pre-filter's flags were recorded
        return harmful, set()
    return harmful, set(latest.filter(pl.col("flags").list.contains(NO_CHANGE))["step_id"])


def load_trusted(ws: Workspace, snapshot: int | None) -> Inputs[TrustedEpisode]:
    """The episodes of the steps a run wrote whose actions are trusted: reference replays their checker
    passed, and episodes the critics' latest verdict accepted; the others are counted by reason, and withdrawn: a
    stage that did one when it was trusted takes its rows out. Each with the steps the step critic's latest label
    (`step_critiques@latest`) calls HARMFUL or flags no_change, counted: not imitated."""
    steps, snapshot = ws.catalog.rows_added("steps", snapshot)
    ids = steps["episode_id"].unique().to_list()
    # The other tables at the versions read now, named in the lineage: a rerun reads the same ones.
    snapshots = {"steps": snapshot} | ws.catalog.latest_versions("episodes", "queries", "verdicts", "step_critiques")
    episodes = ws.catalog.newest("episodes", "episode_id", snapshots.get("episodes"),
                                 where=pl.col("episode_id").is_in(ids))
    accepted: dict[str, bool] = {}
    if "verdicts" in snapshots:
        verdicts = ws.catalog.newest("verdicts", "episode_id", snapshots["verdicts"],
                                     where=pl.col("episode_id").is_in(ids))
        accepted = dict(verdicts.select("episode_id", "success").iter_rows())
    harmful: set[str] = set()
    unchanged: set[str] = set()
    if "step_critiques" in snapshots:
        harmful, unchanged = judged_steps(ws, snapshots["step_critiques"], steps["step_id"].to_list())
    by_episode = steps_by_episode(steps.to_dicts())
    checkers = checker_versions(ws, episodes["query_id"].unique().to_list(), snapshots.get("queries"))
    inputs = Inputs[TrustedEpisode](units=[], snapshots=snapshots)
    for e in episodes.to_dicts():
        if e.get("source") == "reference":
            trusted = "reference" if e.get("success") else None
            why = "reference replay its checker did not pass"
        else:
            trusted = "accepted" if accepted.get(e["episode_id"]) else None
            why = "policy episode not accepted by the critics" if e["episode_id"] in accepted else \
                "policy episode not judged"
        if trusted is None:
            inputs.stats[f"not trusted: {why}"] += 1
            # An earlier run may have trusted it (the critics judged it again since): its rows go (`Inputs.withdrawn`)
            inputs.withdrawn[e["episode_id"]] = why
            continue
        episode_steps = by_episode.get(e["episode_id"], [])
        bad = frozenset(s.step_id for s in episode_steps if s.step_id in harmful)
        if bad:
            inputs.stats["trusted steps labelled HARMFUL by the step critic: history only, not imitated"] += len(bad)
        idle = frozenset(s.step_id for s in episode_steps if s.step_id in unchanged and s.action_type not in NO_EFFECT)
        if idle:
            inputs.stats["trusted steps that changed nothing (pre-filter no_change): history only, not imitated"] += \
                len(idle)
        inputs.units.append(TrustedEpisode(e["episode_id"], e["query_id"], e["instruction"], e["viewport"], trusted,
                                           episode_steps, checkers.get(e["query_id"], ""), bad, idle))
    return inputs

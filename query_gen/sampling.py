"""Path sampling on a page graph and template instructions (paper 6.2, steps 1-3).

Paths run from the start page to a goal page. Sampling is seeded; it draws each path
in turn (the least drawn first, then the one through the least used transition), so a
small budget still covers the graph instead of repeating its shortest route, and drops a
path once every slot combination of it has been drawn.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass

import networkx as nx

from trajforge.envs.spec import AppSpec, UIAction, placeholders
from trajforge.schemas.ids import digest

TEMPLATE_GENERATOR = "template@1"


@dataclass(frozen=True)
class SampledTask:
    """A path with its slot values: everything a query, its replay and its checker need."""

    app: str
    path: tuple[str, ...]
    slots: tuple[tuple[str, str], ...]
    instruction: str
    checker: str
    checker_params: tuple[tuple[str, str], ...]
    reference_steps: int
    """Steps the reference replay takes along the path (replay_steps), the final terminate included."""

    @property
    def query_id(self) -> str:
        payload = json.dumps([self.app, self.path, self.slots, self.instruction])
        return digest(payload)


def replay_steps(action: UIAction) -> int:
    """Steps the reference replay (rollout.replay) spends on one UI action: typing, and pressing a key in a named
    element, first click the element to focus it; every other action is one step."""
    return 2 if action.op == "type" or (action.op == "press" and action.role) else 1


def _slots_used(spec: AppSpec, path: list[str]) -> set[str]:
    """Slots that the path's actions, urls or goal mention: only those get values."""
    g = spec.graph()
    used: set[str] = set()
    for u, v in zip(path, path[1:]):
        for action in g.edges[u, v]["transition"].actions:
            used |= placeholders(action.name or "") | placeholders(action.text or "")
    for page_id in path:
        page = spec.pages[page_id]
        used |= placeholders(page.url)
        if page.goal and page_id == path[-1]:
            used |= placeholders(page.goal.instruction)
            for value in page.goal.params.values():
                used |= placeholders(value)
    return used


def _asks_for_all(spec: AppSpec, path: list[str]) -> bool:
    """Whether the path's goal asks for every slot the path fills. The writer's path editor -> text_saved ->
    share_dialog types and saves a text on the way to sharing: a task "Share the document" whose reference replay
    does more than the instruction asks (and whose step budget counts it)."""
    goal = spec.pages[path[-1]].goal
    assert goal is not None
    asked = placeholders(goal.instruction).union(*(placeholders(v) for v in goal.params.values()))
    return _slots_used(spec, path) <= asked


def goal_paths(spec: AppSpec, max_len: int) -> list[list[str]]:
    """Every simple path from the start page to a goal page, at most max_len pages long."""
    g = spec.graph()
    paths: list[list[str]] = []
    for goal in spec.goal_pages():
        paths.extend(nx.all_simple_paths(g, spec.start, goal, cutoff=max_len - 1))
    return sorted(paths)


@dataclass(frozen=True)
class Sample:
    """The sampled tasks, and whether sampling drew every path's every slot combination (exhausted): only then is
    a shortfall below n the graph's own limit rather than the draw cap's."""

    tasks: list[SampledTask]
    exhausted: bool


def sample_tasks(spec: AppSpec, n: int, *, seed: int, max_len: int) -> Sample:
    """Up to n tasks with distinct instructions; fewer when the graph and its slots allow fewer, or when
    n * 20 draws gave no more."""
    rng = random.Random(seed)
    paths = goal_paths(spec, max_len)
    # A path that fills slots its goal does not ask for is sampled only for a goal that has no other path.
    fits = [_asks_for_all(spec, p) for p in paths]
    exact = {p[-1] for p, fit in zip(paths, fits) if fit}
    paths = [p for p, fit in zip(paths, fits) if fit or p[-1] not in exact]
    g = spec.graph()
    values = spec.slot_values()
    combinations = {tuple(p): math.prod(len(set(values[s])) for s in _slots_used(spec, p)) for p in paths}
    drawn: dict[tuple[str, ...], set[tuple[tuple[str, str], ...]]] = {tuple(p): set() for p in paths}
    draws: Counter[tuple[str, ...]] = Counter()
    edge_use: Counter[tuple[str, str]] = Counter()
    tasks: dict[str, SampledTask] = {}
    instructions: set[str] = set()
    attempts = 0
    while paths and len(tasks) < n and attempts < n * 20:
        attempts += 1
        # The least-drawn path first, so that a goal whose only route lies inside other goals' routes (the account
        # app's sign-in) gets its turn; among those, the one whose least-used transition has been used least.
        path = min(paths, key=lambda p: (draws[tuple(p)], min(edge_use[e] for e in zip(p, p[1:])),
                                         rng.random()))
        slots = {name: rng.choice(values[name]) for name in sorted(_slots_used(spec, path))}
        goal = spec.pages[path[-1]].goal
        assert goal is not None
        steps = sum(replay_steps(a) for u, v in zip(path, path[1:]) for a in g.edges[u, v]["transition"].actions)
        task = SampledTask(
            app=spec.app,
            path=tuple(path),
            slots=tuple(sorted(slots.items())),
            instruction=goal.instruction.format(**slots),
            checker=goal.checker,
            checker_params=tuple(sorted((k, v.format(**slots)) for k, v in goal.params.items())),
            reference_steps=steps + 1,  # the final terminate
        )
        # One instruction is one task for the agent, whichever route its reference path takes.
        if task.instruction.casefold() not in instructions:
            instructions.add(task.instruction.casefold())
            tasks[task.query_id] = task
        draws[task.path] += 1
        edge_use.update(zip(path, path[1:]))
        drawn[task.path].add(task.slots)
        if len(drawn[task.path]) == combinations[task.path]:
            paths.remove(path)  # every task it can give has been drawn
    return Sample(list(tasks.values()), exhausted=not paths)

"""Query quality: near-duplicate removal and coverage of the page graphs (issue 5, part 4).

Two instructions that differ only in case, punctuation or spacing, and whose goals are
checked with the same parameters, ask the same thing, and a dataset that repeats them
teaches less per episode. Coverage says how much of
each app's graph the kept queries exercise, so a run that only ever samples the
shortest route is visible in its lineage.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from trajforge.envs.operations import parse_operations
from trajforge.envs.spec import AppSpec
from trajforge.schemas.records import Query


def normalise(instruction: str) -> str:
    """Lowercase words only: what two near-duplicate instructions share."""
    return " ".join(re.findall(r"\w+", instruction.lower()))


def remove_near_duplicates(queries: list[Query]) -> tuple[list[Query], Counter[str]]:
    """The first query of each (app, normalised instruction, checker and its parameters); the others are counted
    as dropped. The check is part of the key because `normalise` drops signs and symbols: "to -5" and "to 5", or
    "C++" and "C#", read alike to it but are different tasks."""
    seen: set[tuple[str, str, str, str]] = set()
    kept: list[Query] = []
    dropped: Counter[str] = Counter()
    for query in queries:
        params = json.dumps(json.loads(query.checker_params_json), sort_keys=True)
        key = (query.app, normalise(query.instruction), query.checker, params)
        if key in seen:
            dropped[f"{query.app}: near-duplicate instruction"] += 1
        else:
            seen.add(key)
            kept.append(query)
    return kept, dropped


def coverage(spec: AppSpec, queries: list[Query]) -> dict[str, int]:
    """How many of the app's pages, transitions and slot values the queries use, and of how
    many; and how many queries do each kind of UI operation (operation kinds: the
    transitions' ops for page-graph queries, the operations of atomic and deep-search ones).

    Keys read `coverage: APP: pages used` / `coverage: APP: pages total`, so they sum
    per app across shards like the stage's other counts.
    """
    mine = [q for q in queries if q.app == spec.app]
    pages = {p for q in mine for p in q.path}
    transitions = {e for q in mine for e in zip(q.path, q.path[1:])}
    values = {(k, v) for q in mine for k, v in json.loads(q.slots_json).items()}
    all_values = {(k, v) for k, vs in spec.slot_values().items() for v in vs}
    prefix = f"coverage: {spec.app}"
    graph = spec.graph()
    kinds: Counter[str] = Counter()
    for q in mine:
        ops = {a.op for u, v in zip(q.path, q.path[1:]) if graph.has_edge(u, v)
               for a in graph.edges[u, v]["transition"].actions}
        kinds.update(ops | {op.op for op in parse_operations(q.actions_json)})
    return {
        **{f"{prefix}: operation {kind}": n for kind, n in sorted(kinds.items())},
        f"{prefix}: pages used": len(pages),
        f"{prefix}: pages total": len(spec.pages),
        f"{prefix}: transitions used": len(transitions),
        f"{prefix}: transitions total": len(spec.transitions),
        f"{prefix}: slot values used": len(values),
        f"{prefix}: slot values total": len(all_values),
    }

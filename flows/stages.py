"""The night, as one ordered list of stage modules: the flows read it, the CLI names its stages.

Each module declares `STAGE = StageDef(...)` next to the code it runs (see README,
"Adding a stage"). The nightly runs them in this order, each reading the version of its
`reads` table that this run made (or the table's latest, if the run made none).
"""

from __future__ import annotations

import importlib
from typing import Any

from trajforge.llm.workspace import Workspace
from trajforge.schemas.stage import StageDef

NIGHTLY: tuple[str, ...] = (
    "trajforge.query_gen.stage",
    "trajforge.guidance.reference",  # each new query version's reference path, replayed and checked
    "trajforge.guidance.stage",  # guidance for the queries earlier runs failed, before the rollouts that use it
    "trajforge.rollout.stage",
    "trajforge.critics.stage",
    "trajforge.guidance.history",  # rewrites queries: queries@latest then shows each query's record
    "trajforge.synth.export",
    "trajforge.synth.grounding",  # every distinct screen of the run: elements, words, characters, regions
    "trajforge.synth.semantics",  # every valid step: the action from before/after, and described
    "trajforge.synth.reasoning",  # trusted steps: sampled reasonings kept when their action matches; distilled roles
    "trajforge.synth.planning",  # manuals per app and task family (measured), plans checked against page graphs
    "trajforge.synth.pal_ui",  # trusted steps: a memory of the earlier ones, a teacher that may look back at one
    "trajforge.synth.pal_ui_sft",  # the night's matched teacher passes, balanced look-back/direct, as chat rows
    "trajforge.synth.ces",  # trusted steps: silver states, coordinator and state-tracker groups scored by an executor
    "trajforge.synth.agentic_q",  # each query's last n judged attempts: levels, step values, SWPO candidate groups
    "trajforge.train.stage",  # with loop.train: the next model, trained on the night's training tables
)


def load_stage(module: str) -> StageDef[Workspace, Any]:
    """The `STAGE` a module declares; the error names the module when it declares none."""
    stage = getattr(importlib.import_module(module), "STAGE", None)
    if not isinstance(stage, StageDef):
        raise TypeError(f"{module} declares no STAGE = StageDef(...)")
    return stage


def stages(modules: tuple[str, ...] = NIGHTLY) -> dict[str, StageDef[Workspace, Any]]:
    """Stage name -> declaration, in the night's order; two modules declaring one name is an error."""
    found: dict[str, StageDef[Workspace, Any]] = {}
    for module in modules:
        stage = load_stage(module)
        if stage.name in found:
            raise ValueError(f"stage name {stage.name!r} is declared twice ({module})")
        found[stage.name] = stage
    return found

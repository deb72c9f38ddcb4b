"""The stage contract: what a stage declares, what it is given and what it returns.

A stage is declared next to its code, in its own room, as `STAGE = StageDef(...)`; the
runner (`tasks/`) runs it shard by shard and the flows (`flows/`) order the stages. The
contract lives here, in the bottom room, so that a room declares its stage without
importing the runner above it. The workspace a stage is handed (catalog, blobs, ledger,
model gateway and the validated settings, opened once per run) is
`trajforge.llm.workspace.Workspace`; this room cannot name it, so `StageDef` takes its
type as a parameter, and each declaration names it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from trajforge.schemas.config import Settings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Record
from trajforge.schemas.tables import record_model

WriteMode = Literal["append", "overwrite"]
"""`append`: the table accumulates across runs; `overwrite`: each run replaces it (older versions stay readable)."""

U = TypeVar("U")  # a stage's unit of work: a typed record (a dataclass or pydantic model), never a dict
W = TypeVar("W")  # the run's workspace


@dataclass
class Inputs(Generic[U]):
    """A stage's units of work and the snapshots they came from."""

    units: list[U]
    snapshots: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""
    """What else the output depends on (e.g. app spec files, a demonstrations file), for the config hash."""
    stats: Counter[str] = field(default_factory=Counter)
    """What loading left out and why (work already done by an earlier run, inputs that do not apply): it goes
    into the lineage beside the shards' own counts."""
    withdrawn: dict[str, str] = field(default_factory=dict)
    """For a stage with `StageDef.replaces`: values of its column that the input names but gives no unit for
    now, each with why (an episode the critics have since rejected). Rows an earlier run wrote for them go in
    this run's commits, nothing in their place, counted as `withdrawn: why`."""


@dataclass
class StageOutput:
    """Rows per output table, plus what lineage needs: drops with reasons, other counts,
    models and prompts used."""

    rows: dict[str, list[Record | dict[str, Any]]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    """Counts that are not drops (coverage, fallbacks, what could not be checked); summed over shards."""
    models: dict[str, str] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)


def config_hash(settings: Settings, sections: tuple[str, ...], fingerprint: str = "") -> str:
    """What a stage's output depends on besides its input rows: its config sections and its inputs' fingerprint.
    The runner records it in the lineage; a loader can compare it with earlier versions' to skip work done."""
    return digest(f"{settings.section_hash(*sections)}:{fingerprint}")


@dataclass(frozen=True)
class StageDef(Generic[W, U]):
    """One stage: what it reads and writes, how its work is split, and the two functions that do it.

    `load(ws, snapshot)` turns the input version (None: the table's latest) into typed units;
    `run(units, ws, run_id, config_hash)` does one shard's units and returns its rows. Both are
    plain functions: the same ones serve the nightly flow, `trajforge run STAGE` and the tests.
    """

    name: str
    key: Callable[[U], str]
    """A unit's identity: shards are runs of units sorted by it, and a shard's id is a hash of its keys."""
    reads: str | None
    """The table whose version `--input` names; None for a source stage."""
    writes: dict[str, WriteMode]
    sections: tuple[str, ...]
    """Config sections the output depends on ("llm" where a model may act: a new model is new work)."""
    load: Callable[[W, int | None], Inputs[U]]
    run: Callable[[list[U], W, str, str], StageOutput]
    shard_size: Callable[[Settings], int]
    workers: Callable[[Settings], int] = lambda s: 1
    """Shards run at once on the thread engine (`runner.engine: threads`); on Dask, the cluster's workers."""
    once: bool = False
    """A unit that an earlier run of this stage did with the same config hash and code version is not done again
    (counted in the lineage's stats): a stage rerun by hand on an input it has done writes no row twice. For
    stages whose key names everything a unit's output depends on besides the configuration (an episode, and for
    export whether it was accepted); not for those that take a unit up again with new inputs (a query's attempts,
    a hard query's guidance)."""
    replaces: tuple[str, Callable[[U], str]] | None = None
    """For a `once` stage whose tables accumulate: the column of every table it writes that names a unit (the
    export's `episode_id`), and a unit's value in it. A unit done again (another configuration or code version,
    or for the export another verdict) takes the rows earlier runs wrote for it out of those tables in the
    commit that adds its new ones (none, for an episode the critics now reject), so each unit's newest output is
    there once; older versions keep the rest."""
    enabled: Callable[[Settings], bool] = lambda s: True
    """Whether the nightly runs it (the loop's `train` runs with `loop.train`); `trajforge run STAGE` always does."""
    summary: Callable[[dict[str, int]], str | None] | None = None
    """One line for the person watching the run, from the stage's summed counts (its lineage's stats); the
    flow prints it after the commit."""

    def __post_init__(self) -> None:
        """A declaration that cannot work fails where it is made, before any stage runs."""
        if self.replaces is not None:
            column = self.replaces[0]
            if missing := [t for t in self.writes if column not in record_model(t).model_fields]:
                raise ValueError(f"stage {self.name!r} replaces rows by {column!r}, which table(s) {missing} lack")

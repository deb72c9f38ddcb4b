"""The stage contract, run shard by shard with resume and one commit per table.

A stage reads one input snapshot, splits its work into shards, and writes each shard's
rows as Parquet files into the output tables' data folders. Only when every shard is
done does it commit: one commit per output table, carrying the lineage. Rerunning a run
that crashed skips the shards the ledger says are done and finishes the commits, so
every row lands exactly once.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any, TypeVar

from trajforge.data.catalog import Lineage, Withdrawal, commit_key, write_parquet_atomic
from trajforge.data.ledger import ShardRecord
from trajforge.llm.prompts import prompts_fingerprint
from trajforge.llm.workspace import Workspace, code_version
from trajforge.schemas.ids import digest
from trajforge.schemas.stage import StageDef, config_hash
from trajforge.schemas.tables import to_arrow

Unit = TypeVar("Unit")

Stage = StageDef[Workspace, Any]


@dataclass
class Shard:
    shard_id: str
    units: list[Any]


@dataclass
class StagePlan:
    stage: Stage
    run_id: str
    inputs: dict[str, int]
    config_hash: str
    pending: list[Shard]
    shard_ids: frozenset[str]
    input_stats: Counter[str]
    unit_keys: frozenset[str] = frozenset()
    """Every unit's key, for a stage that does a unit once per configuration (`StageDef.once`)."""
    once_hash: str = ""
    """What doing a unit again would have to differ in for `StageDef.once`: the config hash, the code version and
    the prompts (`prompts_fingerprint`: an edited prompt is new work, in a checkout already dirty or an install
    without git alike)."""
    withdraw: Withdrawal | None = None
    """The earlier rows this run's units replace (`StageDef.replaces`), taken out by its commits."""
    replaces: dict[str, str] | None = None
    """Unit key -> its `StageDef.replaces` value, for the ledger (`Ledger.mark_committed`)."""

    @property
    def total(self) -> int:
        return len(self.shard_ids)


def even_chunks(units: list[Unit], size: int) -> list[list[Unit]]:
    """`units` in order, in as few chunks as hold at most `size` each, their sizes a unit apart at most: shards
    that run at once end together (grounding's 39 screens at 25 a shard were 25 and 14, one core idle for the
    last part of the stage; now 20 and 19). The same units give the same chunks, so a rerun resumes them."""
    count = -(-len(units) // size)
    base, extra = divmod(len(units), count) if count else (0, 0)
    bounds = [i * base + min(i, extra) for i in range(count + 1)]
    return [units[bounds[i]:bounds[i + 1]] for i in range(count)]


def plan(stage: Stage, ws: Workspace, run_id: str, input_snapshot: int | None) -> StagePlan:
    """Load the stage's inputs and list the shards this run has not finished yet."""
    inputs = stage.load(ws, input_snapshot)
    for table in stage.writes:  # created, or evolved to the code's records, before any work: a change no
        ws.catalog.table(table)  # table can take is refused now, not at the commit after every shard has run
    config = config_hash(ws.settings, stage.sections, inputs.fingerprint)
    units = sorted(inputs.units, key=stage.key)
    stats = Counter(inputs.stats)
    once_hash = digest(f"{config}:{code_version()}:{prompts_fingerprint()}") if stage.once else ""
    if stage.once:
        units = _once_units(stage, ws, run_id, units, once_hash, stats)
    withdraw: Withdrawal | None = None
    replaces: dict[str, str] | None = None
    if stage.replaces is not None:
        column, value = stage.replaces
        # Only the values an earlier run did: a withdrawal of the others would take nothing out, after reading
        # every file of the tables that might hold them.
        gone = ws.ledger.values_done(stage.name, set(inputs.withdrawn), besides=run_id)
        stats.update(f"withdrawn: {inputs.withdrawn[v]}" for v in gone)
        withdraw = Withdrawal(column, frozenset(value(u) for u in units) | gone)
        replaces = {stage.key(u): value(u) for u in units}
    shards = [Shard(digest("\n".join(stage.key(u) for u in chunk)), chunk)
              for chunk in even_chunks(units, stage.shard_size(ws.settings))]
    ws.ledger.plan_stage(run_id, stage.name, len(shards), [stage.key(u) for u in units] if stage.once else None,
                         inputs.snapshots)
    done = {r.shard_id for r in ws.ledger.shards_done(run_id, stage.name)}
    return StagePlan(
        stage=stage,
        run_id=run_id,
        inputs=inputs.snapshots,
        config_hash=config,
        pending=[s for s in shards if s.shard_id not in done],
        shard_ids=frozenset(s.shard_id for s in shards),
        input_stats=stats,
        unit_keys=frozenset(stage.key(u) for u in units) if stage.once else frozenset(),
        once_hash=once_hash,
        withdraw=withdraw,
        replaces=replaces,
    )


def _once_units(stage: Stage, ws: Workspace, run_id: str, units: list[Unit], once_hash: str,
                stats: Counter[str]) -> list[Unit]:
    """The units a `StageDef.once` stage does in this run: those no other run did with this configuration; on a
    resume, the ones its first plan kept. A code or prompt fix between the crash and the resume changes
    `once_hash`, and planning again would make other shards than the ones recorded, which the commit refuses on
    every rerun. Where another run has since done some of them (`trajforge run STAGE` by hand), the stage is
    planned again, its recorded shards set aside: committing them would write those units' rows twice."""
    done = ws.ledger.units_done(stage.name, once_hash, besides=run_id)
    planned = ws.ledger.planned_units(run_id, stage.name)
    if planned is not None and planned & done and not _landed(stage, ws, run_id):
        ws.ledger.forget_stage(run_id, stage.name)
        planned = None
    if planned is None:
        planned = {key for u in units if (key := stage.key(u)) not in done}
    for u in units:
        if (key := stage.key(u)) not in planned:
            stats["already done by an earlier run with this configuration" if key in done
                  else "left out by this run's first plan of the stage"] += 1
    return [u for u in units if stage.key(u) in planned]


def _landed(stage: Stage, ws: Workspace, run_id: str) -> dict[str, int]:
    """Table -> this run's commit of the stage to it, for the tables that hold one (some only: a crash between
    two of its table commits)."""
    return {table: version for table in stage.writes
            if (version := ws.catalog.find_commit(table, commit_key(run_id, stage.name, table))) is not None}


def _write_parquet(ws: Workspace, table: str, name: str, rows: list[Any]) -> str:
    """Validate and write rows atomically (temp file, then rename); returns the path."""
    path = ws.catalog.data_dir(table) / f"{name}.parquet"
    write_parquet_atomic(to_arrow(table, rows), path)
    return str(path)


def run_shard(plan: StagePlan, shard: Shard, ws: Workspace) -> dict[str, int]:
    """Do one shard's work and record it; returns rows written per table."""
    stage = plan.stage
    out = stage.run(shard.units, ws, plan.run_id, plan.config_hash)
    unknown = set(out.rows) - set(stage.writes)
    if unknown:
        raise ValueError(f"stage {stage.name!r} returned rows for undeclared tables {sorted(unknown)}")
    files: dict[str, list[str]] = {}
    kept: dict[str, int] = {}
    # Each attempt's files are its own: a shard task of a run whose driver died can still be running on a remote
    # Dask worker, and writing over the name its rerun committed would change committed rows under Iceberg's
    # manifest. The attempt the ledger records last is the one committed; the others' files go with `expire`.
    attempt = secrets.token_hex(4)
    for table, rows in out.rows.items():
        kept[table] = len(rows)
        if rows:
            files[table] = [_write_parquet(ws, table, f"{plan.run_id}-{stage.name}-{shard.shard_id}-{attempt}", rows)]
    ws.ledger.record_shard(
        plan.run_id,
        stage.name,
        ShardRecord(shard.shard_id, files, kept, dict(out.dropped), dict(out.stats), out.models, out.prompts,
                    code_version(), plan.inputs),
    )
    return kept


def commit(plan: StagePlan, ws: Workspace) -> dict[str, int]:
    """Commit every output table once, with lineage; safe to call again after a crash."""
    stage, run_id = plan.stage, plan.run_id
    already = ws.ledger.committed(run_id, stage.name)
    if already is not None:
        return already
    records = ws.ledger.shards_done(run_id, stage.name)
    done = {r.shard_id for r in records}
    if stale := done - plan.shard_ids:
        landed = _landed(stage, ws, run_id)
        if len(landed) == len(stage.writes):
            # Every table landed and the process died before the ledger heard of it; the stage's loader reads its
            # own output (train's checkpoints), so it plans otherwise now. What landed is the whole stage.
            ws.ledger.mark_committed(run_id, stage.name, landed, once_hash=plan.once_hash, unit_keys=plan.unit_keys,
                                     replaces=plan.replaces,
                                     withdrawn=plan.withdraw.values if plan.withdraw else frozenset())
            return landed
        if landed:  # a loader that counted this run's own first table commit as earlier work planned fewer units
            raise RuntimeError(f"stage {stage.name!r}: the ledger holds {len(stale)} shard(s) this plan does not "
                               f"have, and {', '.join(sorted(landed))} already holds this run's commit: the stage's "
                               "inputs changed since they ran; `--fresh` starts a new run")
        # Nothing landed yet: the inputs moved between the crash and this resume (another stage run by hand, say),
        # so the units fell into other shards, all of which ran. Those earlier shards' rows are in no table; the
        # current plan's are the stage's whole output, and committing both would write some units twice.
        ws.ledger.forget_shards(run_id, stage.name, stale)
        records = [r for r in records if r.shard_id in plan.shard_ids]
        done -= stale
    if plan.shard_ids - done:
        raise RuntimeError(f"stage {stage.name!r}: {len(plan.shard_ids - done)} shard(s) not done; rerun to resume")
    kept: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    stats: Counter[str] = Counter(plan.input_stats)
    # Every model, prompt and code version a shard used, and every input version it read: a run resumed after a
    # fix, or after a side input moved, has rows of both.
    models: dict[str, set[str]] = {}
    prompts: dict[str, set[str]] = {}
    codes: set[str] = set()
    read: dict[str, Counter[int]] = {}
    files: dict[str, list[str]] = {t: [] for t in stage.writes}
    for r in records:
        kept.update(r.kept)
        dropped.update(r.dropped)
        stats.update(r.stats)
        for used, seen in ((r.models, models), (r.prompts, prompts)):
            for name, value in used.items():
                seen.setdefault(name, set()).add(value)
        codes.add(r.code_version or "unrecorded")  # a shard that older code recorded
        for table, version in (r.inputs or {}).items():
            read.setdefault(table, Counter())[version] += 1
        for table, paths in r.files.items():
            files[table].extend(paths)
    ws.ledger.check_writing()  # a run that lost the warehouse (its lock's connection dropped) commits nothing
    snapshots: dict[str, int] = {}
    for table, mode in stage.writes.items():
        lineage = Lineage(
            stage=stage.name,
            run_id=run_id,
            commit_key=commit_key(run_id, stage.name, table),
            inputs=_inputs_read(plan.inputs, read),
            inputs_read={table: sorted(versions) for table, versions in read.items() if len(versions) > 1},
            config_hash=plan.config_hash,
            code_version=",".join(sorted(codes or {code_version()})),  # a stage with no shards: this commit's
            models={name: ",".join(sorted(values)) for name, values in sorted(models.items())},
            prompts={name: ",".join(sorted(values)) for name, values in sorted(prompts.items())},
            kept={table: kept.get(table, 0)},
            dropped=dict(dropped),
            stats=dict(stats),
        )
        withdraw = plan.withdraw if mode == "append" else None
        snapshots[table] = ws.catalog.commit_files(table, files[table], lineage, mode, withdraw)
    ws.ledger.mark_committed(run_id, stage.name, snapshots, once_hash=plan.once_hash, unit_keys=plan.unit_keys,
                             replaces=plan.replaces, withdrawn=plan.withdraw.values if plan.withdraw else frozenset())
    return snapshots


def _inputs_read(planned: dict[str, int], read: dict[str, Counter[int]]) -> dict[str, int]:
    """Table -> the one version the lineage names as the stage's input (its `inputs` holds one a table): the one
    this plan reads, where a shard read it too or no shard recorded one; else the one most shards read (every
    shard ran before the input moved, and this resume only commits). `Lineage.inputs_read` names every version
    where they read several."""
    return {table: planned[table] if not read.get(table) or planned.get(table) in read[table]
            else read[table].most_common(1)[0][0]
            for table in sorted(planned.keys() | read.keys())}


def run_inline(stage: Stage, ws: Workspace, run_id: str, input_snapshot: int | None = None) -> dict[str, int]:
    """The whole stage in this process, without Prefect (tests, benchmarks, a notebook): plan, every pending
    shard in turn, commit. Returns the committed snapshot per table. `run_id` must be open in the ledger."""
    staged = plan(stage, ws, run_id, input_snapshot)
    for shard in staged.pending:
        run_shard(staged, shard, ws)
    return commit(staged, ws)

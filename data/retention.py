"""Retention: expire old versions, then remove the data files and screenshot blobs nothing references.

Nightly runs only add: every version keeps its Parquet files and every screenshot stays in
the blob store. `expire` takes a cutoff and, per table, expires the versions committed
before it except the protected ones (every tagged version, so `nightly-*` and hand-made tags
stay readable; each table's current version; and every version a kept version's lineage
names as its input, so each kept version can still be explained and its stage rerun; and the
last version of each run whose rows the table's current version still holds, since a table that
accumulates, such as verdicts, orders its rows by their runs' versions: `Catalog.newest`); then
removes the data files no remaining version references, the metadata files no remaining version
needs (expired versions' manifest lists, manifests only they listed), and the blobs whose hash no
remaining row mentions (a hash is found in any string column, JSON included, so a new table
needs no registration here; the rows of the catalog's other namespaces in this warehouse count too,
as they share its blob store).

The loop's files go too: the trainer's input folders (`<warehouse>/train/NAME`, exports of table versions
the night's tags keep, so `trajforge export` makes them again) and a failed trainer's leftovers
(`.NAME.tmp` beside the checkpoints), once older than the cutoff. Checkpoint folders themselves only when
asked (`collect_checkpoints`: weights cost a training run to make again), and never the newest of a chain
(the next night's policy) nor one the config names; their rows stay in the `checkpoints` table.

Half-written temp files (`.NAME.parquet.HEX.tmp`, a run killed mid-write) go with the data files, once older
than the cutoff.

What an unfinished run may still commit is never removed: files younger than the cutoff, and
the shard files the run ledger lists for runs not finished (a crashed run resumes from them; one that a
`--fresh` run set aside is finished: nothing resumes it), and
the versions its stages read (`trajforge run STAGE --input TABLE@VERSION`). Nor
what it has committed so far, with the versions those were made from: its rerun finds each commit
by its key and reads its later stages' inputs by version id, so an expired one would be committed
a second time (an overwrite table would roll back to it) or stop the rerun.
Run under the writer lock of every namespace of the warehouse (`sharing_scopes`), so no run writes
meanwhile. `dry_run` lists only.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.catalog import Catalog as IcebergCatalog
from pyiceberg.table import Table
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Snapshot

from trajforge.data.blobs import SHA256, BlobStore
from trajforge.data.catalog import (
    RUN_ID_KEY,
    Catalog,
    CorruptData,
    UnknownRef,
    corrupt_file,
    data_folder,
    metadata_files,
    referenced_files,
    snapshot_lineage,
)
from trajforge.data.ledger import Ledger, scope_of


@dataclass
class Expiry:
    """What `expire` removed (or, in a dry run, would remove)."""

    snapshots: dict[str, list[int]] = field(default_factory=dict)
    """Table -> the snapshot ids expired."""
    kept_snapshots: dict[str, int] = field(default_factory=dict)
    """Table -> versions that remain."""
    data_files: list[Path] = field(default_factory=list)
    metadata_files: list[Path] = field(default_factory=list)
    """Manifest lists and manifests that only expired versions used (Iceberg's own files, beside the data)."""
    blobs: list[Path] = field(default_factory=list)
    train_data: list[Path] = field(default_factory=list)
    """The trainer's input folders, and failed trainers' leftover checkpoint folders."""
    checkpoints: list[Path] = field(default_factory=list)
    """Checkpoint folders (only with `collect_checkpoints`)."""
    bytes: int = 0


def _protected(tbl: Table) -> set[int]:
    """Tagged versions and each branch's head (the table's current version)."""
    return {ref.snapshot_id for ref in tbl.metadata.refs.values()
            if ref.snapshot_ref_type in (SnapshotRefType.TAG, SnapshotRefType.BRANCH)}


def _hashes(files: Iterable[Path]) -> set[str]:
    """Every sha256-looking string in the string columns (and lists of strings) of these Parquet files.

    Arrow's regex picks the strings that hold one and only their distinct values reach Python: most of a
    step row's text (its thought, its tree) holds none. A year-old steps table's 365 files: 2.0-2.4 s against
    2.8-3.6 s with Python's regex on every string, the same hashes (a `/tmp` A/B, four rounds, a night beside)."""
    found: set[str] = set()
    for path in files:
        if not path.is_file():
            continue
        for column in pq.read_table(path).columns:
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                column = pc.list_flatten(column)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                continue
            holding = pc.filter(column, pc.match_substring_regex(column, SHA256.pattern))
            for text in pc.unique(holding).to_pylist():
                found.update(SHA256.findall(text))
    return found


def _mentioned(files: Iterable[Path], blame: Callable[[Path, Exception], CorruptData]) -> set[str]:
    """The hashes these files mention; a file that cannot be read stops expire with `blame`'s error, which names it
    (Arrow's own names no file)."""
    found: set[str] = set()
    for path in sorted(files):
        try:
            found |= _hashes([path])
        except (pa.ArrowException, OSError) as exc:
            raise blame(path, exc) from exc
    return found


def _in_version(name: str, tbl: Table, versions: Collection[int]) -> Callable[[Path, Exception], CorruptData]:
    """A data file's error, naming its table and a version that reads it, as `Catalog.load` names it."""
    def blame(path: Path, exc: Exception) -> CorruptData:
        version = next(v for v in sorted(versions) if path in referenced_files(tbl, [v]))
        return corrupt_file(name, version, path, exc)
    return blame


def _pending_shard(path: Path, exc: Exception) -> CorruptData:
    """A shard file of a run not finished: its rerun would commit it, so it is read for its screenshots."""
    why = str(exc).splitlines()[0]
    return CorruptData(f"shard file {path} of a run not finished cannot be read ({why}); its rerun would fail on it "
                       "too: run that run's command again with --fresh to set it aside (expire then removes its "
                       "files), or remove the file and rerun")


def sharing_scopes(catalog: Catalog) -> list[str]:
    """The ledger scopes of the catalog's other namespaces: their runs store blobs in this warehouse's blob store
    (a blob stored again keeps its old mtime, so the cutoff does not protect it) and write its train/ folder, so
    `expire` holds their writer locks beside its own (`Ledger.writing(also=...)`)."""
    return [scope_of(catalog.iceberg.name, ".".join(namespace)) for namespace in _other_namespaces(catalog)]


def _other_namespaces(catalog: Catalog, parent: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The catalog's namespaces besides the catalog's own, nested ones included."""
    for namespace in catalog.iceberg.list_namespaces(parent):
        if namespace != IcebergCatalog.identifier_to_tuple(catalog.namespace):
            yield namespace
        yield from _other_namespaces(catalog, namespace)


def _mentioned_elsewhere(catalog: Catalog) -> set[str]:
    """The hashes every version of the other namespaces' tables in this warehouse mention. Two configurations
    that share a warehouse folder with a namespace each share its blob store (`Workspace.open`), and expire
    leaves their versions alone."""
    found: set[str] = set()
    for namespace in _other_namespaces(catalog):
        for ident in catalog.iceberg.list_tables(namespace):
            tbl = catalog.iceberg.load_table(ident)
            if data_folder(tbl).is_relative_to(catalog.warehouse):
                versions = [s.snapshot_id for s in tbl.metadata.snapshots]
                found |= _mentioned(referenced_files(tbl, versions), _in_version(".".join(ident), tbl, versions))
    return found


def _old(path: Path, cutoff: datetime) -> bool:
    """Last changed before the cutoff; a folder by the newest of it and everything in it."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    return datetime.fromtimestamp(max(p.stat().st_mtime for p in paths), tz=timezone.utc) < cutoff


def _run_of(snapshot: Snapshot) -> str | None:
    """The run that committed the snapshot (None: not a stage's commit)."""
    return snapshot.summary[RUN_ID_KEY] if snapshot.summary is not None else None


def _last_of_runs_with_rows(catalog: Catalog, name: str, tbl: Table) -> set[int]:
    """The last version of each run whose rows the table's current version holds. A table that accumulates
    (verdicts, step critiques) holds rows of runs whose versions are long expired, and `Catalog.newest` orders
    rows by their run's place in the table's history: a run missing from it ranked before every kept one, so a
    verdict judged again by hand went back to the night's older one once its version was expired."""
    current = tbl.current_snapshot()
    if current is None or "run_id" not in tbl.schema().column_names:
        return set()
    runs = set(catalog.load(name, current.snapshot_id, columns=["run_id"])["run_id"])
    last: dict[str, int] = {}
    for snapshot in sorted(tbl.metadata.snapshots, key=lambda s: s.sequence_number or 0):
        if (run := _run_of(snapshot)) in runs:
            last[run] = snapshot.snapshot_id
    return set(last.values())


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _trained_on(catalog: Catalog) -> set[tuple[str, int]]:
    """The table versions the registered checkpoints (the current `checkpoints` rows) were trained on. A standalone
    `trajforge run train` is not tagged, nor the by-hand stage runs it may have trained on, so nothing else kept
    them once a later checkpoint landed: the checkpoint's lineage named data that was gone."""
    if "checkpoints" not in catalog.tables():
        return set()
    found: set[tuple[str, int]] = set()
    for ref in catalog.load("checkpoints", columns=["trained_on"])["trained_on"].explode().drop_nulls().unique():
        try:
            table, sid = catalog.resolve(ref)
        except UnknownRef:  # expired by an earlier expire, before this rule
            continue
        if sid is not None:
            found.add((table, sid))
    return found


def _old_checkpoints(catalog: Catalog, cutoff: datetime, named: Collection[str]) -> list[Path]:
    """Checkpoint folders made before the cutoff, except each chain's newest and those `named`."""
    rows = catalog.load("checkpoints").sort("created_at").to_dicts()
    newest = {r["root_model_id"]: r["folder"] for r in rows}  # the next night's policy, chain by chain
    kept = set(newest.values()) | {r["folder"] for r in rows
                                   if r["created_at"] >= cutoff or r["model_id"] in named or r["folder"] in named}
    return sorted({Path(r["folder"]) for r in rows if r["folder"] not in kept and Path(r["folder"]).is_dir()})


def expire(catalog: Catalog, blobs: BlobStore, ledger: Ledger, older_than: timedelta, *, dry_run: bool = False,
           now: datetime | None = None, checkpoints_dir: Path | None = None, collect_checkpoints: bool = False,
           named_models: Collection[str] = ()) -> Expiry:
    """Expire each table's unprotected versions committed before now - `older_than`, then remove what no
    remaining version references. Returns what went (or would go).

    `checkpoints_dir`: where the loop writes checkpoints (loop.checkpoints_dir; default <warehouse>/checkpoints).
    `named_models`: the model names and folders the config uses, whose checkpoints stay."""
    cutoff = (now or datetime.now(timezone.utc)) - older_than
    cutoff_ms = int(cutoff.timestamp() * 1000)
    pending = {Path(p) for p in ledger.unfinished_files()}
    unfinished = ledger.unfinished_runs()
    read = ledger.unfinished_inputs()  # what such a run's stages read, committed or not
    tables = {name: catalog.iceberg.load_table((catalog.namespace, name)) for name in catalog.tables()}
    keep = {name: _protected(tbl) | {s.snapshot_id for s in tbl.metadata.snapshots
                                     if s.timestamp_ms >= cutoff_ms or _run_of(s) in unfinished
                                     or s.snapshot_id in read.get(name, ())}
            for name, tbl in tables.items()}
    for table, sid in _trained_on(catalog):  # a checkpoint's data: `trajforge checkpoints --model` names it
        keep[table].add(sid)
    # A kept version's lineage names the versions it was made from: they stay, so it can be explained and rerun.
    # So do the versions its stage run committed beside it (a rollout's steps beside its episodes, a critics run's
    # step critiques beside its verdicts): a later stage finds them by their commit keys (`Catalog.written_with`).
    committed_with: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for name, tbl in tables.items():
        for snapshot in tbl.metadata.snapshots:
            if (lineage := snapshot_lineage(snapshot)) is not None:
                committed_with.setdefault((lineage.run_id, lineage.stage), []).append((name, snapshot.snapshot_id))
    grown = True
    while grown:
        grown = False
        for name, tbl in tables.items():
            for sid in list(keep[name]):
                snapshot = tbl.snapshot_by_id(sid)
                lineage = snapshot_lineage(snapshot) if snapshot is not None else None
                if lineage is None:
                    continue
                beside = [(t, v) for t, v in committed_with.get((lineage.run_id, lineage.stage), []) if t != name]
                read = [(t, v) for t, versions in lineage.inputs_read.items() for v in versions]
                for table, input_sid in [*lineage.inputs.items(), *read, *beside]:
                    if table in keep and input_sid not in keep[table] and tables[table].snapshot_by_id(input_sid):
                        keep[table].add(input_sid)
                        grown = True
    for name, tbl in tables.items():  # for the order of the rows' runs only: their inputs may go
        keep[name] |= _last_of_runs_with_rows(catalog, name, tbl)
    # Read before any version expires: a file that cannot be read stops expire with nothing changed.
    referenced = {name: referenced_files(tbl, keep[name]) for name, tbl in tables.items()}
    mentioned = _mentioned(pending, _pending_shard) | _mentioned_elsewhere(catalog)
    for name, tbl in tables.items():
        mentioned |= _mentioned(referenced[name], _in_version(name, tbl, keep[name]))
    out = Expiry()
    for name, tbl in tables.items():
        expired = [s.snapshot_id for s in tbl.metadata.snapshots if s.snapshot_id not in keep[name]]
        live = referenced[name]
        if expired:
            out.snapshots[name] = expired
            if not dry_run:
                catalog.expire_versions(name, expired)
        out.kept_snapshots[name] = len(keep[name])
        # Not data_dir: a read must not evolve a table. The temp files of writes a killed run left half done
        # (`write_parquet_atomic`) go too: no run writes meanwhile (the writer lock), and the cutoff keeps one that a
        # writer outside it may still be writing (a Dask worker of a run killed under it: its file changes).
        folder = data_folder(tbl)
        for path in sorted([*folder.glob("*.parquet"), *folder.glob(".*.parquet.*.tmp")]):
            if path not in live and path not in pending and _old(path, cutoff):
                out.data_files.append(path)
        # After the expiry's commit the table is read again: that commit wrote the metadata that now holds it.
        current = tbl if dry_run or not expired else catalog.iceberg.load_table((catalog.namespace, name))
        needed = metadata_files(current, keep[name])
        for path in sorted(data_folder(tbl).with_name("metadata").glob("*")):
            if path.is_file() and path not in needed and _old(path, cutoff):
                out.metadata_files.append(path)
    for path in sorted(blobs.root.glob("??/*")):
        if path.is_file() and blobs.sha256_of(path) not in mentioned and _old(path, cutoff):
            out.blobs.append(path)
    leftovers = (checkpoints_dir.expanduser() if checkpoints_dir else catalog.warehouse / "checkpoints").glob(".*.tmp")
    out.train_data = sorted(p for p in [*(catalog.warehouse / "train").glob("*"), *leftovers]
                            if p.is_dir() and _old(p, cutoff))
    if collect_checkpoints:
        out.checkpoints = _old_checkpoints(catalog, cutoff, named_models)
    for path in (*out.data_files, *out.metadata_files, *out.blobs, *out.train_data, *out.checkpoints):
        out.bytes += _size(path)
        if dry_run:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return out

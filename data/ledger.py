"""The run ledger: which runs, stages and shards are done, kept in the catalog's database.

A shard's output files are written first and its ledger row second, so a crash leaves
at worst files no ledger row names: the rerun writes its own (each attempt's file names
are new) and `trajforge datasets expire` removes them; a stage's tables are committed with
idempotent commit keys, so a crash between two tables' commits is finished by the rerun.
The ledger lives beside the Iceberg catalog (SQLite by default, PostgreSQL in
production) so that every worker sees the same state.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from trajforge.schemas.ids import digest

_meta = sa.MetaData()

runs = sa.Table(
    "trajforge_runs",
    _meta,
    sa.Column("run_id", sa.String(80), primary_key=True),
    sa.Column("flow", sa.String(40), nullable=False),
    sa.Column("identity", sa.String(64), nullable=False, doc="Hash of what the run does; a rerun resumes it."),
    sa.Column("status", sa.String(16), nullable=False,
              doc="running (a rerun resumes it), done, or abandoned (set aside by a --fresh run: never resumed)."),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_at", sa.DateTime(timezone=True)),
    sa.Column("summary", sa.Text, doc="JSON: table -> snapshot id, and the tag, when finished."),
    sa.Column("scope", sa.Text, doc="The warehouse (`Ledger.scope`) the run writes to; NULL: recorded before."),
)

stages = sa.Table(
    "trajforge_stages",
    _meta,
    sa.Column("run_id", sa.String(80), primary_key=True),
    sa.Column("stage", sa.String(40), primary_key=True),
    sa.Column("total_shards", sa.Integer, nullable=False),
    sa.Column("snapshots", sa.Text, doc="JSON: table -> snapshot id once committed."),
    sa.Column("planned", sa.Text, nullable=False,
              doc="JSON: the unit keys a StageDef.once stage's first plan kept ({}: not kept)."),
    sa.Column("inputs", sa.Text, nullable=False,
              doc="JSON: table -> the snapshot id the stage reads, from its first plan."),
)

shards = sa.Table(
    "trajforge_shards",
    _meta,
    sa.Column("run_id", sa.String(80), primary_key=True),
    sa.Column("stage", sa.String(40), primary_key=True),
    sa.Column("shard_id", sa.String(40), primary_key=True),
    sa.Column("files", sa.Text, nullable=False, doc="JSON: table -> [parquet path]"),
    sa.Column("kept", sa.Text, nullable=False, doc="JSON: table -> rows"),
    sa.Column("dropped", sa.Text, nullable=False, doc="JSON: reason -> count"),
    sa.Column("stats", sa.Text, nullable=False, doc="JSON: name -> count"),
    sa.Column("models", sa.Text, nullable=False),
    sa.Column("prompts", sa.Text, nullable=False),
    sa.Column("code_version", sa.Text, doc="The code that did the shard (NULL: recorded by older code)."),
    sa.Column("inputs", sa.Text, doc="JSON: table -> the snapshot id the shard read (NULL: recorded by older code)."),
    sa.Column("done_at", sa.DateTime(timezone=True), nullable=False),
)

units = sa.Table(
    "trajforge_stage_units",
    _meta,
    sa.Column("run_id", sa.String(80), primary_key=True),
    sa.Column("stage", sa.String(40), primary_key=True),
    sa.Column("unit_key", sa.String(512), primary_key=True),
    sa.Column("once_hash", sa.String(64), nullable=False, doc="The configuration and code it did them with."),
    sa.Column("scope", sa.String(200), nullable=False, doc="The warehouse (`Ledger.scope`): not another's units."),
    sa.Column("replaces", sa.Text, nullable=False, doc="The unit's `StageDef.replaces` value ('' without one)."),
    comment="The units a committed stage run did, for stages that do a unit once per configuration (StageDef.once).",
)


class RunLocked(RuntimeError):
    """Another run holds the warehouse for writing."""


class LockLost(RuntimeError):
    """This run's hold on the warehouse went while it ran: its connection to PostgreSQL closed (the server or
    a proxy dropped it, or an administrator ended it), so another run may be writing now."""


@dataclass(frozen=True)
class Run:
    run_id: str
    flow: str
    started_at: datetime
    resumed: bool
    passed_over: tuple[str, ...] = ()
    """The unfinished runs of the flow in this warehouse that a new run left as they were, having another identity
    (its input's latest version or a setting changed since): nothing resumes them, and only `--fresh` sets them
    aside."""


@dataclass(frozen=True)
class ShardRecord:
    shard_id: str
    files: dict[str, list[str]]
    kept: dict[str, int]
    dropped: dict[str, int]
    stats: dict[str, int]
    models: dict[str, str]
    prompts: dict[str, str]
    code_version: str | None = None
    """The code that did the shard: a resume after a fix has shards of the old code and the new."""
    inputs: dict[str, int] | None = None
    """Table -> the snapshot id the shard read: an input that moved between a crash and its resume (a side
    input read at its latest) gives the resume's shards another version than those done before the crash.
    None for either: a shard that older code recorded."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _utc(value: datetime) -> datetime:
    """A time the database gave back, in UTC. PostgreSQL gives a timestamptz in the session's TimeZone (relabelled
    as UTC, a server in America/New_York moved the nightly tag a day and the report's stage windows by hours);
    SQLite gives the naive UTC time it was given."""
    return value.astimezone(timezone.utc) if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def scope_of(catalog_name: str, namespace: str) -> str:
    """The ledger scope of a catalog's namespace: its runs' writer lock."""
    return f"{catalog_name}/{namespace}"


class Ledger:
    def __init__(self, url: str, scope: str = ""):
        """`scope` names the warehouse within the database (its catalog and namespace): runs on two warehouses
        that share one PostgreSQL database do not hold each other up."""
        self.scope = scope
        self.engine = sa.create_engine(url, future=True)
        self._held: tuple[sa.Connection, int] | None = None
        """The connection holding `writing`'s PostgreSQL lock, and its key, while the block runs."""
        _meta.create_all(self.engine)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Columns added to the ledger after a database was created get added to it: a ledger outlives code
        versions. The rows already there get NULL in a nullable column (not recorded) and an empty JSON object in
        a NOT NULL one."""
        inspector = sa.inspect(self.engine)
        for table in _meta.sorted_tables:
            present = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name not in present:
                    if not isinstance(column.type, sa.Text):
                        raise RuntimeError(f"ledger column {table.name}.{column.name} needs a migration of its own")
                    spec = "TEXT" if column.nullable else "TEXT NOT NULL DEFAULT '{}'"
                    with self.engine.begin() as conn:
                        conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {spec}"))

    def open_run(self, flow: str, identity: str, *, fresh: bool = False) -> Run:
        """The unfinished run with this identity (resumed), or a new one.

        `fresh` (`trajforge run --fresh`) sets the flow's unfinished runs in this warehouse aside as abandoned,
        whatever their identity: left running, the next plain run resumed the old one (its queries, its night's
        tag) once the fresh one had finished, and retention kept its files for ever as those of a run still to be
        resumed; one of another identity (`run STAGE` after a night made a new version of its input) no command
        could reach at all. The caller holds the warehouse (`writing`), so none of them is still running."""
        unfinished = (runs.c.flow == flow, runs.c.status == "running")
        # Another warehouse of the database keeps its runs, whatever their identity (two configs may share one);
        # a run recorded before the scope column is this warehouse's only where its identity says so.
        legacy = sa.and_(runs.c.scope.is_(None), runs.c.identity == identity)
        mine = sa.or_(runs.c.scope == self.scope, legacy)
        with self.engine.begin() as conn:
            if fresh:
                conn.execute(runs.update().where(*unfinished, mine).values(status="abandoned", finished_at=_now()))
            else:
                row = conn.execute(sa.select(runs).where(*unfinished, mine, runs.c.identity == identity)
                                   .order_by(runs.c.started_at.desc())).first()
                if row is not None:
                    return Run(row.run_id, flow, _utc(row.started_at), resumed=True)
            passed_over = conn.execute(sa.select(runs.c.run_id).where(*unfinished, mine)
                                       .order_by(runs.c.started_at)).scalars().all()
            started = _now()
            run_id = f"{flow}-{started:%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"
            conn.execute(runs.insert().values(run_id=run_id, flow=flow, identity=identity, status="running",
                                              started_at=started, scope=self.scope))
            return Run(run_id, flow, started, resumed=False, passed_over=tuple(passed_over))

    @property
    def writer_key(self) -> int:
        """The key of `writing`'s PostgreSQL advisory lock: in `pg_locks`, `(classid::bigint << 32) | objid`
        (objsubid 1), whose `pid` is the server process of the run that holds the warehouse."""
        return self._key(self.scope)

    def _key(self, scope: str) -> int:
        return int(digest(f"trajforge-writer:{self.engine.url.database}:{scope}", 15), 16)

    @contextmanager
    def writing(self, run: str, *, also: Iterable[str] = ()) -> Iterator[None]:
        """Hold the warehouse for a run of `run` (nightly, or a stage's name) while the block runs: a second
        run started meanwhile stops at once with RunLocked, naming the run that holds it, instead of
        interleaving its commits with this one's.

        PostgreSQL: a session advisory lock on a connection of its own (any machine that shares the catalog
        sees it); SQLite: an flock on a file beside the database. Either is released by the operating
        system or the server when the process dies, so a crashed run never leaves the warehouse locked.

        `also`: other scopes of this database to hold as well (`expire`, whose blob store and train/ folder the
        warehouse's other namespaces share). SQLite's flock is the database's, so it holds every scope already.
        """
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:  # no open transaction
                key = self.writer_key
                taken: list[int] = []
                try:
                    for scope in dict.fromkeys([self.scope, *also]):
                        self._lock(conn, scope)
                        taken.append(self._key(scope))
                    # The lock lives as long as this connection, which stays idle while the run works: a server's
                    # idle_session_timeout (PostgreSQL 14+) would end it, so it is off for this session, and the
                    # server's TCP keepalives keep a NAT or firewall from forgetting it. `check_writing` still asks
                    # before each commit, for whatever else ends it.
                    if conn.dialect.server_version_info >= (14,):
                        conn.execute(sa.text("SET idle_session_timeout = 0"))
                    conn.execute(sa.text("SET tcp_keepalives_idle = 60"))
                    self._held = conn, key
                    yield
                finally:
                    self._held = None
                    with suppress(sa.exc.SQLAlchemyError):  # a lost connection took the locks with it
                        for taken_key in taken:
                            conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": taken_key})
            return
        path = Path(f"{self.engine.url.database}.writer.lock")
        with path.open("a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                raise RunLocked(f"another run is writing to this warehouse ({lock.read().strip() or 'unknown run'}, "
                                f"lock {path}); wait for it to finish, or stop it (a stopped run resumes on its "
                                "rerun)") from None
            lock.truncate(0)
            lock.write(f"a {run} run, pid {os.getpid()} on {socket.gethostname()}, since {_now():%Y-%m-%d %H:%M:%S} UTC")
            lock.flush()
            try:
                yield
            finally:
                lock.truncate(0)
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _lock(self, conn: sa.Connection, scope: str) -> None:
        """Take `scope`'s advisory lock on `conn`, or raise RunLocked naming who may hold it."""
        # A killed holder's lock goes when its server process sees the connection close, a moment
        # after the kill (a CI run caught it still held): ask again for up to 2 s before refusing.
        for attempt in range(5):
            if attempt:
                time.sleep(0.5)
            if conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": self._key(scope)}).scalar():
                return
        raise RunLocked(f"another run is writing to this warehouse ({scope or 'catalog'} in database "
                        f"{self.engine.url.database!r} on {self.engine.url.host}); runs not finished: "
                        f"{self._unfinished()}; wait for it to finish, or stop it (a stopped run resumes on its rerun)")

    def check_writing(self) -> None:
        """Raise LockLost when the PostgreSQL lock this ledger's `writing` took is not held any more; nothing
        outside such a block, or on SQLite (an flock goes only with the process).

        The runner asks before it commits a stage, so a run whose connection was dropped while it worked stops
        with its shards recorded (its rerun commits them) rather than commit beside another writer."""
        if self._held is None:
            return
        conn, key = self._held
        try:
            held = conn.execute(sa.text(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
                "AND pid = pg_backend_pid() AND ((classid::bigint << 32) | objid::bigint) = :k)"), {"k": key}).scalar()
            reason = "the lock is not held on its connection"
        except sa.exc.SQLAlchemyError as exc:
            cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
            held, reason = False, f"its connection failed ({str(cause).strip().splitlines()[0]})"
        if not held:
            raise LockLost(f"this run lost its hold on the warehouse ({self.scope or 'catalog'} in database "
                           f"{self.engine.url.database!r} on {self.engine.url.host}): {reason}; nothing more was "
                           "committed, and a rerun resumes it (a connection pooler in transaction mode, such as "
                           "pgbouncer's, cannot hold the lock: give the catalog a direct or session-pooled URL)")

    def _unfinished(self) -> str:
        """The newest runs the ledger says are unfinished (the holder among them, or crashed ones)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(runs.c.run_id).where(runs.c.status == "running")
                                .order_by(runs.c.started_at.desc()).limit(3)).all()
        return ", ".join(r.run_id for r in rows) or "none recorded"

    def unfinished_runs(self) -> set[str]:
        """Every run the ledger has not seen finish: the one writing now, and crashed ones not yet resumed."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(runs.c.run_id).where(runs.c.status == "running")).scalars())

    def get_run(self, run_id: str) -> Run:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).first()
        if row is None:
            raise LookupError(f"no run {run_id!r} in the ledger")
        return Run(row.run_id, row.flow, _utc(row.started_at), resumed=False)

    def finish_run(self, run_id: str, summary: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(status="done", finished_at=_now(), summary=json.dumps(summary))
            )

    def plan_stage(self, run_id: str, stage: str, total_shards: int, planned: list[str] | None = None,
                   inputs: dict[str, int] | None = None) -> None:
        """The stage's first plan in this run: its shard count, the input versions it reads (retention keeps them
        while the run is unfinished: `unfinished_inputs`) and, for a `StageDef.once` stage, the unit keys it kept
        (`planned_units`); a resume's plan changes none of them."""
        with self.engine.begin() as conn:
            exists = conn.execute(
                sa.select(stages.c.stage).where(stages.c.run_id == run_id, stages.c.stage == stage)
            ).first()
            if exists is None:
                # '{}', not NULL, for a stage that keeps no plan: the column is NOT NULL (and so in a ledger
                # made before it was added: `_add_missing_columns`).
                conn.execute(stages.insert().values(run_id=run_id, stage=stage, total_shards=total_shards,
                                                    planned=json.dumps(planned if planned is not None else {}),
                                                    inputs=json.dumps(inputs or {})))

    def unfinished_inputs(self) -> dict[str, set[int]]:
        """Table -> the versions the stages of runs not finished read: a run given `--input TABLE@VERSION` that
        crashed before its commit resumes from that version."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(stages.c.inputs).join(runs, runs.c.run_id == stages.c.run_id)
                                .where(runs.c.status == "running")).scalars().all()
        out: dict[str, set[int]] = {}
        for value in rows:
            for table, snapshot in (json.loads(value) if value else {}).items():
                out.setdefault(table, set()).add(int(snapshot))
        return out

    def forget_stage(self, run_id: str, stage: str) -> None:
        """Set aside this run's plan and shards of a stage not committed, so it is planned and done anew (their
        files stay until `expire`: no version references them)."""
        with self.engine.begin() as conn:
            conn.execute(shards.delete().where(shards.c.run_id == run_id, shards.c.stage == stage))
            conn.execute(stages.delete().where(stages.c.run_id == run_id, stages.c.stage == stage,
                                               stages.c.snapshots.is_(None)))

    def forget_shards(self, run_id: str, stage: str, shard_ids: Iterable[str]) -> None:
        """Set aside these shards of this run's stage, done but not committed (their files stay until `expire`)."""
        with self.engine.begin() as conn:
            conn.execute(shards.delete().where(shards.c.run_id == run_id, shards.c.stage == stage,
                                               shards.c.shard_id.in_(list(shard_ids))))

    def planned_units(self, run_id: str, stage: str) -> set[str] | None:
        """The unit keys this run's first plan of a `StageDef.once` stage kept; None before it (or where a
        ledger of older code kept none)."""
        with self.engine.connect() as conn:
            value = conn.execute(
                sa.select(stages.c.planned).where(stages.c.run_id == run_id, stages.c.stage == stage)
            ).scalar()
        keys = json.loads(value) if value else None
        return set(keys) if isinstance(keys, list) else None

    def committed(self, run_id: str, stage: str) -> dict[str, int] | None:
        """The stage's snapshots if this run already committed it."""
        with self.engine.connect() as conn:
            value = conn.execute(
                sa.select(stages.c.snapshots).where(stages.c.run_id == run_id, stages.c.stage == stage)
            ).scalar()
        return json.loads(value) if value else None

    def committed_runs(self, stage: str) -> set[str]:
        """The runs whose `stage` committed every table. A loader that skips work done by earlier runs counts
        only these: a run killed between two of a stage's table commits has rows in the first table, and a
        rerun that counted them as done would plan fewer shards than it recorded, and lose their rows."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(stages.c.run_id).where(stages.c.stage == stage,
                                                                     stages.c.snapshots.is_not(None))).scalars())

    def mark_committed(self, run_id: str, stage: str, snapshots: dict[str, int], *, once_hash: str = "",
                       unit_keys: frozenset[str] = frozenset(), replaces: dict[str, str] | None = None,
                       withdrawn: frozenset[str] = frozenset()) -> None:
        """The stage's commits are all in; with `unit_keys`, which units it did as `once_hash` says, in the
        same transaction (`units_done`).

        `replaces` (unit key -> its `StageDef.replaces` value): this run's commits took out the rows earlier runs
        wrote for those values, so those runs' units of the same values count as done no more. Export's keys are
        an episode and its verdict: an episode rejected, then accepted (its rows replaced), then rejected again
        was skipped as done by the first run, and kept the acceptance's rows. `withdrawn`: further values whose
        rows the commits took out with no unit of this run (`Inputs.withdrawn`): done again when an input gives
        them again (an episode the critics accept once more)."""
        replaces = replaces or {}
        with self.engine.begin() as conn:
            values = sorted(set(replaces.values()) | withdrawn)
            for i in range(0, len(values), 500):  # SQLite's limit on a statement's variables
                conn.execute(units.delete().where(units.c.stage == stage, units.c.scope == self.scope,
                                                  units.c.run_id != run_id, units.c.replaces.in_(values[i:i + 500])))
            if unit_keys:
                conn.execute(units.insert(), [{"run_id": run_id, "stage": stage, "unit_key": key,
                                               "once_hash": once_hash, "scope": self.scope,
                                               "replaces": replaces.get(key, "")}
                                              for key in sorted(unit_keys)])
            conn.execute(
                stages.update()
                .where(stages.c.run_id == run_id, stages.c.stage == stage)
                .values(snapshots=json.dumps(snapshots))
            )

    def units_done(self, stage: str, once_hash: str, *, besides: str) -> set[str]:
        """The keys of the units that runs other than `besides` did in `stage` as `once_hash` says, and committed."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(units.c.unit_key).where(
                units.c.stage == stage, units.c.once_hash == once_hash, units.c.scope == self.scope,
                units.c.run_id != besides)).scalars())

    def values_done(self, stage: str, values: set[str], *, besides: str) -> set[str]:
        """Of `values` of the stage's `StageDef.replaces` column, those whose units runs other than `besides` did in
        `stage` and committed, under any configuration: those whose rows its tables may hold."""
        found: set[str] = set()
        ordered = sorted(values)
        with self.engine.connect() as conn:
            for i in range(0, len(ordered), 500):  # SQLite's limit on a statement's variables
                found |= set(conn.execute(sa.select(units.c.replaces).where(
                    units.c.stage == stage, units.c.scope == self.scope, units.c.run_id != besides,
                    units.c.replaces.in_(ordered[i:i + 500]))).scalars())
        return found

    def record_shard(self, run_id: str, stage: str, record: ShardRecord) -> None:
        values = dict(
            files=json.dumps(record.files),
            kept=json.dumps(record.kept),
            dropped=json.dumps(record.dropped),
            stats=json.dumps(record.stats),
            models=json.dumps(record.models),
            prompts=json.dumps(record.prompts),
            code_version=record.code_version,
            inputs=json.dumps(record.inputs) if record.inputs is not None else None,
            done_at=_now(),
        )
        with self.engine.begin() as conn:
            # A shard that raced with its own retry is recorded once.
            conn.execute(shards.delete().where(
                shards.c.run_id == run_id, shards.c.stage == stage, shards.c.shard_id == record.shard_id
            ))
            conn.execute(shards.insert().values(run_id=run_id, stage=stage, shard_id=record.shard_id, **values))

    def shards_done(self, run_id: str, stage: str) -> list[ShardRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(shards).where(shards.c.run_id == run_id, shards.c.stage == stage).order_by(shards.c.shard_id)
            ).all()
        return [
            ShardRecord(
                r.shard_id, json.loads(r.files), json.loads(r.kept), json.loads(r.dropped), json.loads(r.stats),
                json.loads(r.models), json.loads(r.prompts), r.code_version,
                json.loads(r.inputs) if r.inputs is not None else None,
            )
            for r in rows
        ]

    def unfinished_files(self) -> set[str]:
        """The shard files of every run not finished: what a rerun still commits (retention keeps them)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(shards.c.files).join(runs, runs.c.run_id == shards.c.run_id).where(runs.c.status == "running")
            ).all()
        return {path for (files,) in rows for paths in json.loads(files).values() for path in paths}

    def progress(self, run_id: str) -> dict[str, tuple[int, int]]:
        """stage -> (shards done, shards planned), for progress bars."""
        with self.engine.connect() as conn:
            planned = dict(conn.execute(
                sa.select(stages.c.stage, stages.c.total_shards).where(stages.c.run_id == run_id)
            ).all())
            done = dict(conn.execute(
                sa.select(shards.c.stage, sa.func.count()).where(shards.c.run_id == run_id).group_by(shards.c.stage)
            ).all())
        return {s: (done.get(s, 0), n) for s, n in planned.items()}

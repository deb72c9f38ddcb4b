"""The nightly killed with SIGKILL at many points, rerun, and compared with an unbroken night of the same config.

A kill point is a stage and a phase the run ledger shows: `shards` (the stage planned, its shards running)
or `commit` (every shard done, the stage's tables being committed), and `report` (every stage the night runs
committed; the night's tags and report being written). One *chain* walks a fresh night through the points in
order: the watcher kills the process group the moment the ledger shows the next point, reruns `trajforge run
nightly` (which resumes), and waits for the point after it; a point the run passed between two polls is
recorded as missed, not as survived. Then the night is finished by a last rerun and compared with the
unbroken night: rows per table (latest version), every key unique, and the policy's episodes judged as the
unbroken night judged them (the replay policy succeeds on every query, so a failure is a false one).

    python benchmarks/fault_bench.py [--chains 1] [--random N] [--browser N] [--dask N] [--seed S] [--keep DIR]

`--random N` also kills N fresh nights each at a random time within the unbroken night's length;
`--browser N` kills the Chromium of N fresh nights while their rollouts run, and lets each night go on (its
episodes that died are environment faults, rerun).
`--dask N` runs N fresh nights on a Dask LocalCluster of two worker processes (each in a PostgreSQL database
of its own) and SIGKILLs one worker while the rollouts run; Dask hands its shard to a worker, and a night
that failed anyway is rerun.

Prints one table: fault | trials | survived | rows lost | rows duplicated | false task failures. Never asserts;
tests/faults/test_kill_points.py runs one short chain and asserts the same figures are zero.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import sqlalchemy as sa
import yaml
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from trajforge.flows.stages import stages
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import UNHASHED, Settings, WarehouseSettings
from trajforge.schemas.tables import record_model

CONFIG = Path(__file__).with_name("replay_night.yaml").read_text()
"""The replay night, shared with the tests (tests/conftest.py): every stage writes rows and asks no model."""


class _FileOnly(Settings):
    """Settings from the values given alone, no environment variable read: `cli_env` passes the CLI none that
    changes what the night runs."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **others: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


_NIGHT = _FileOnly(**yaml.safe_load(CONFIG))
STAGES = [name for name, stage in stages().items() if stage.enabled(_NIGHT)]
"""The stages the replay night runs, in order: those `StageDef.enabled` keeps (the loop's `train` runs only with
`loop.train`, which the night leaves off). The report point shows once every one of them is committed."""

PER_SCREEN = frozenset({"grounding", "train_grounding"})
"""Tables with rows per distinct screen of the night (grounding's elements, words and characters)."""

Point = tuple[str, str]
"""(stage, phase): phase is "shards" or "commit"; ("nightly", "report") after the last stage."""


def all_points() -> list[Point]:
    """Every kill point of a night in order: each stage's shards and its commit, then the report."""
    return [(stage, phase) for stage in STAGES for phase in ("shards", "commit")] + [("nightly", "report")]


def cli_path() -> str:
    return str(Path(sys.executable).with_name("trajforge"))


def cli_env(folder: Path) -> dict[str, str]:
    """The environment the CLI runs in for a night in `folder`: its own Prefect home, none of the caller's
    TRAJFORGE_ variables (the config file alone says what the night is) but those of settings that change no
    row (`schemas.config.UNHASHED`: the test suite shares one OCR cache between its nights)."""
    kept = {f"TRAJFORGE_{section}__{name}".upper() for section, names in UNHASHED.items() for name in names
            if not isinstance(names, dict) or names[name] is True}  # a whole setting, not a part of a section
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAJFORGE_") or k.upper() in kept}
    return env | {"COLUMNS": "200", "PREFECT_HOME": str(folder / "prefect")}


def night(folder: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """`trajforge run nightly` in `folder` to its end (a fresh night, or the rerun that resumes one)."""
    return subprocess.run([cli_path(), "run", "nightly"], cwd=folder, env=cli_env(folder), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _phase(ledger: sa.Engine) -> list[Point]:
    """The points the ledger shows now: the stages with their phase, in the night's order."""
    try:
        with ledger.connect() as conn:
            stages = conn.execute(sa.text("SELECT stage, total_shards, snapshots FROM trajforge_stages")).all()
            done = dict(conn.execute(sa.text("SELECT stage, count(*) FROM trajforge_shards GROUP BY stage")).all())
            finished = conn.execute(sa.text(
                "SELECT count(*) FROM trajforge_runs WHERE flow = 'nightly' AND status != 'running'")).scalar()
    except (sa.exc.OperationalError, sa.exc.ProgrammingError):  # the ledger is not created yet (SQLite, PostgreSQL)
        return []
    shown: list[Point] = []
    committed = 0
    for stage, total, snapshots in stages:
        if snapshots:
            committed += 1
            shown.append((stage, "done"))
        elif done.get(stage, 0) >= total:
            shown.append((stage, "commit"))
        else:  # planned, its shards running
            shown.append((stage, "shards"))
    if committed == len(STAGES) and not finished:
        shown.append(("nightly", "report"))
    return shown


@dataclass
class Chain:
    """What one chain of kills did."""

    killed: list[Point] = field(default_factory=list)
    missed: list[Point] = field(default_factory=list)
    reruns: int = 0
    failed: str | None = None
    """Why a rerun did not finish the night, if one did not."""


def _passed(point: Point, shown: list[Point]) -> bool:
    """Whether the night is past `point` already: its stage is done, or a later point shows."""
    order = all_points()
    later = [order.index(p) for p in shown if p in order]
    return (point[0], "done") in shown or bool(later) and max(later) > order.index(point)


def chain(folder: Path, points: list[Point], poll_s: float = 0.02) -> Chain:
    """Walk a fresh night in `folder` through `points` (in the night's order), killing at each; then finish it."""
    (folder / "trajforge.yaml").write_text(CONFIG)
    ledger = sa.create_engine(f"sqlite:///{folder / 'data' / 'warehouse' / 'catalog.db'}")
    out = Chain()
    todo = sorted(points, key=all_points().index)
    while True:
        # stderr to a file, not a pipe: read only at the end, a pipe would stop the night when its 64 KB filled
        err_file = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([cli_path(), "run", "nightly"], cwd=folder, env=cli_env(folder), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err_file, text=True)
        out.reruns += 1
        killed = False
        try:
            while todo and proc.poll() is None:
                shown = _phase(ledger)
                if todo[0] in shown:
                    os.killpg(proc.pid, signal.SIGKILL)
                    out.killed.append(todo.pop(0))
                    killed = True
                    break
                if _passed(todo[0], shown):
                    out.missed.append(todo.pop(0))
                    continue
                time.sleep(poll_s)
            proc.wait(timeout=1800)  # killed: returns at once; else the night runs to its end
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            err_file.seek(0)
            err = err_file.read()
            err_file.close()
        if killed:
            continue
        if proc.returncode != 0:
            out.failed = (err.strip().splitlines() or ["no output"])[-1]
        out.missed += todo  # the night ended before them
        return out
def killed_at(folder: Path, after_s: float) -> tuple[Point | None, bool]:
    """A fresh night in `folder` killed `after_s` seconds in (a point the ledger did not choose), then rerun to
    its end: the point it was at (None: before the ledger existed) and whether the rerun finished."""
    (folder / "trajforge.yaml").write_text(CONFIG)
    ledger = sa.create_engine(f"sqlite:///{folder / 'data' / 'warehouse' / 'catalog.db'}")
    proc = subprocess.Popen([cli_path(), "run", "nightly"], cwd=folder, env=cli_env(folder), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=after_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shown = [p for p in _phase(ledger) if p[1] != "done"]
    return (shown[-1] if shown else None), night(folder).returncode == 0


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """Every process descended from `root`: pid -> (its name, its command line). By descent, not by process
    group: Playwright starts the browser detached, in a session of its own."""
    parent: dict[int, int] = {}
    names: dict[int, tuple[str, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue  # it ended meanwhile
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            parent[int(entry.name)], names[int(entry.name)] = int(rest[1]), (name, cmdline)
    below, todo = set(), [root]
    while todo:
        pid = todo.pop()
        children = [c for c, p in parent.items() if p == pid and c not in below]
        below.update(children)
        todo += children
    return {pid: names[pid] for pid in below}


def _kill(pids: list[int]) -> int:
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def _kill_chromium(root: int) -> int:
    """SIGKILL every Chromium process descended from `root` (the night's browser and its renderers); how many."""
    return _kill([pid for pid, (name, _) in _descendants(root).items() if "chrom" in name])


def _kill_dask_worker(root: int) -> int:
    """SIGKILL one worker process of the LocalCluster the night in process `root` started (its nanny, in the
    night's process, starts a new one); 1, or 0 when none is up yet."""
    workers = sorted(pid for pid, (_, cmdline) in _descendants(root).items() if "spawn_main" in cmdline)
    return _kill(workers[:1])


def browser_killed(folder: Path, at: Point = ("rollout", "shards"), poll_s: float = 0.02) -> tuple[int, bool]:
    """A fresh night in `folder` whose Chromium is SIGKILLed (every process of it) the moment the ledger shows
    `at`; the night goes on in the same process, which relaunches the browser and reruns the episodes that died
    with it. Returns how many processes were killed (0: the night passed `at` first) and whether the night
    finished without a rerun of ours."""
    (folder / "trajforge.yaml").write_text(CONFIG)
    killed, returncode = _killed_during(folder, f"sqlite:///{folder / 'data' / 'warehouse' / 'catalog.db'}", at,
                                        _kill_chromium, poll_s)
    return killed, returncode == 0


def _killed_during(folder: Path, ledger_url: str, at: Point, kill: Callable[[int], int],
                   poll_s: float) -> tuple[int, int]:
    """A fresh `trajforge run nightly` in `folder` (its config written), with `kill(pid of the night)` called
    the moment its ledger (at `ledger_url`) shows `at`; the night then goes on to its end. Returns what `kill`
    returned (0: the night passed `at` first, or there was nothing to kill yet) and the night's exit status."""
    ledger = sa.create_engine(ledger_url)
    proc = subprocess.Popen([cli_path(), "run", "nightly"], cwd=folder, env=cli_env(folder), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = 0
    try:
        while not killed and proc.poll() is None:
            shown = _phase(ledger)
            if at in shown:
                killed = kill(proc.pid)
            elif _passed(at, shown):
                break
            time.sleep(poll_s)
        return killed, proc.wait(timeout=1800)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        ledger.dispose()


POSTGRES = "postgresql://postgres@127.0.0.1:5432"


@contextlib.contextmanager
def postgres_database(prefix: str = "faults") -> Iterator[str]:
    """A PostgreSQL database of its own for one night (its ledger, catalog and OCR cache), dropped after; yields
    its SQLAlchemy URL. psycopg.OperationalError when the server cannot be reached."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{POSTGRES}/postgres", connect_timeout=2, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield f"{POSTGRES.replace('postgresql:', 'postgresql+psycopg:')}/{name}"
    finally:
        with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def dask_worker_killed(folder: Path, url: str, poll_s: float = 0.02) -> tuple[int, bool]:
    """A fresh night in `folder` on a Dask LocalCluster of 2 worker processes (catalog at `url`), one worker
    SIGKILLed the moment the ledger shows the rollouts' shards running; the night goes on (Dask gives the
    shard to a worker), and is rerun if it failed. Returns workers killed and whether the night finished."""
    (folder / "trajforge.yaml").write_text(
        f"{CONFIG}warehouse:\n  catalog_url: {url}\nrunner:\n  engine: dask\n  workers: 2\n")
    killed, returncode = _killed_during(folder, url, ("rollout", "shards"), _kill_dask_worker, poll_s)
    return killed, returncode == 0 or night(folder).returncode == 0


@dataclass
class Comparison:
    lost: int
    duplicated: int
    false_failures: int
    tables: dict[str, tuple[int, int]]
    """table -> (rows in the unbroken night, rows in the faulted one)."""
    rendered: int = 0
    """Screenshots in one night's steps and not the other's: the same screens painted differently. Then the
    per-screen tables (`PER_SCREEN`) may differ in rows, and only their duplicated keys count."""


def _latest(warehouse: WarehouseSettings) -> dict[str, pl.DataFrame]:
    ws = Workspace.open(Settings(warehouse=warehouse))
    return {name: ws.catalog.load(name) for name in ws.catalog.tables()}


def _judged(tables: dict[str, pl.DataFrame]) -> int:
    """Failed verdicts of the policy's episodes (the reference stage's replays are not judged)."""
    verdicts = tables.get("verdicts")
    return 0 if verdicts is None else int((~verdicts["success"]).sum())


def compare(reference: Path, faulted: Path, warehouse: WarehouseSettings | None = None) -> Comparison:
    """Rows per table, duplicated keys and false failures of the night in folder `faulted` (its warehouse as
    `warehouse` says when the config moved it or its catalog) against the unbroken night in folder
    `reference`. Episodes ended by an environment fault (and their reruns) are left out: a loaded machine
    makes them in either night, and each is rerun by design."""
    ref = _latest(WarehouseSettings(path=reference / "data" / "warehouse"))
    got = _latest(warehouse or WarehouseSettings(path=faulted / "data" / "warehouse"))
    # Chromium did not always paint a screen identically (a blinking caret, a tapped control still :active,
    # partial raster's anti-aliasing; envs.browser removes all three, and two replays of 67 steps then matched
    # 3 times out of 3): a screen that differs is one more distinct screen for grounding, whose rows are per
    # distinct screen, so those tables are still compared by their keys only where screens differ.
    rendered = len(_screens(ref) ^ _screens(got))
    lost = duplicated = 0
    tables: dict[str, tuple[int, int]] = {}
    for name in sorted(set(ref) | set(got)):
        a, b = ref.get(name, pl.DataFrame()), got.get(name, pl.DataFrame())
        if name == "episodes":
            a, b = (df.filter(pl.col("status") != "env_fault") if df.height else df for df in (a, b))
        tables[name] = (a.height, b.height)
        unique = b[record_model(name).key].n_unique() if b.height else 0
        duplicated += b.height - unique  # a key committed twice
        if not (rendered and name in PER_SCREEN):
            lost += max(0, a.height - unique)
            duplicated += max(0, unique - a.height)
    return Comparison(lost, duplicated, max(0, _judged(got) - _judged(ref)), tables, rendered)


def _screens(tables: dict[str, pl.DataFrame]) -> set[str]:
    steps = tables.get("steps")
    return set() if steps is None else set(steps["screenshot_before"]) | set(steps["screenshot_after"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=1, help="Chains of kills, each through every point.")
    parser.add_argument("--random", type=int, default=0,
                        help="Nights killed at a random time within the unbroken night's length, each rerun.")
    parser.add_argument("--browser", type=int, default=0,
                        help="Nights whose Chromium is killed while the rollouts run; each night goes on (no rerun).")
    parser.add_argument("--dask", type=int, default=0,
                        help="Nights on a Dask LocalCluster (PostgreSQL catalog) one of whose workers is killed "
                        "while the rollouts run; each night goes on, and is rerun if it failed.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="Keep the nights' folders here.")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="fault-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    reference = root / "unbroken"
    reference.mkdir(exist_ok=True)
    (reference / "trajforge.yaml").write_text(CONFIG)
    start = time.perf_counter()
    done = night(reference)
    if done.returncode != 0:
        raise SystemExit(f"the unbroken night failed: {done.stderr.strip()[-500:]}")
    length = time.perf_counter() - start
    print(f"unbroken night: {length:.0f} s")
    rows: list[tuple[str, int, int, int, int, int]] = []
    killed: Counter[Point] = Counter()
    missed: Counter[Point] = Counter()
    lost = dup = false = survived = trials = 0
    for n in range(args.chains):
        folder = root / f"chain-{n}"
        folder.mkdir(exist_ok=True)
        start = time.perf_counter()
        result = chain(folder, all_points())
        result_cmp = compare(reference, folder)
        killed.update(result.killed)
        missed.update(result.missed)
        trials += len(result.killed)
        ok = result.failed is None and not (result_cmp.lost or result_cmp.duplicated or result_cmp.false_failures)
        survived += len(result.killed) if ok else 0
        lost, dup, false = lost + result_cmp.lost, dup + result_cmp.duplicated, false + result_cmp.false_failures
        print(f"chain {n}: {len(result.killed)} kills, {len(result.missed)} points passed between polls, "
              f"{result.reruns} runs, {time.perf_counter() - start:.0f} s"
              + (f"; {result_cmp.rendered} screenshots painted differently" if result_cmp.rendered else "")
              + (f"; the last rerun failed: {result.failed}" if result.failed else ""))
        for table, (a, b) in result_cmp.tables.items():
            if a != b:
                print(f"  {table}: {a} rows unbroken, {b} after the kills")
    if args.chains:
        rows.append(("SIGKILL of the nightly (chain of points)", trials, survived, lost, dup, false))
    rng = random.Random(args.seed)
    totals = [0, 0, 0, 0, 0]
    for n in range(args.random):
        folder = root / f"random-{n}"
        folder.mkdir(exist_ok=True)
        point, finished = killed_at(folder, rng.uniform(0, length))
        got = compare(reference, folder)
        ok = finished and not (got.lost or got.duplicated or got.false_failures)
        for i, value in enumerate((1, ok, got.lost, got.duplicated, got.false_failures)):
            totals[i] += value
        print(f"random {n}: killed at {point[0] + ':' + point[1] if point else 'start-up'}"
              + ("" if finished else "; the rerun failed")
              + (f"; {got.rendered} screenshots painted differently" if got.rendered else ""))
    if args.random:
        rows.append(("SIGKILL of the nightly (random time)", *totals))
    totals = [0, 0, 0, 0, 0]
    for n in range(args.browser):
        folder = root / f"browser-{n}"
        folder.mkdir(exist_ok=True)
        processes, finished = browser_killed(folder)
        got = compare(reference, folder)
        faults = Workspace.open(Settings(warehouse={"path": folder / "data" / "warehouse"})).catalog.load(
            "episodes").filter(pl.col("status") == "env_fault").height
        ok = processes > 0 and finished and not (got.lost or got.duplicated or got.false_failures)
        for i, value in enumerate((int(processes > 0), ok, got.lost, got.duplicated, got.false_failures)):
            totals[i] += value
        print(f"browser {n}: " + (f"{processes} Chromium processes killed during the rollouts, {faults} episodes "
                                  "ended by it and rerun" if processes else "the rollouts ended before the kill")
              + ("" if finished else "; the night failed")
              + (f"; {got.rendered} screenshots painted differently" if got.rendered else ""))
    if args.browser:
        rows.append(("SIGKILL of Chromium during the rollouts (the night goes on)", *totals))
    totals = [0, 0, 0, 0, 0]
    for n in range(args.dask):
        folder = root / f"dask-{n}"
        folder.mkdir(exist_ok=True)
        with postgres_database() as url:
            workers, finished = dask_worker_killed(folder, url)
            got = compare(reference, folder, WarehouseSettings(path=folder / "data" / "warehouse", catalog_url=url))
        ok = workers > 0 and finished and not (got.lost or got.duplicated or got.false_failures)
        for i, value in enumerate((int(workers > 0), ok, got.lost, got.duplicated, got.false_failures)):
            totals[i] += value
        print(f"dask {n}: " + ("a worker killed during the rollouts" if workers else "the rollouts ended first")
              + ("" if finished else "; the night and its rerun failed")
              + (f"; {got.rendered} screenshots painted differently" if got.rendered else ""))
    if args.dask:
        rows.append(("SIGKILL of a Dask worker during the rollouts", *totals))
    if killed:
        print(f"\nkill points ({len(killed)} distinct): "
              + ", ".join(f"{stage}:{phase}" for stage, phase in all_points() if (stage, phase) in killed))
    if missed:
        print("passed between polls: " + ", ".join(f"{s}:{p}" for s, p in all_points() if (s, p) in missed))
    header = ("fault", "trials", "survived", "rows lost", "rows duplicated", "false task failures")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

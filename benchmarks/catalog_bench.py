"""Step-row commit and read throughput of the dataset catalog.

A rollout stage writes its steps as shard Parquet files and commits them once; this
measures that path against plain `pyarrow.parquet.write_table` of the same rows, and
how long reading the committed version into polars takes. Then one more shard's append
three ways, as the export commits it to a table that already holds the first version's
files: plain; withdrawing its own episodes where no file holds them but every file's
column bounds admit them (a night's new episodes: each file's column is read); and
withdrawing 50 episodes that one file holds (an episode exported again: that file is
rewritten without them). Last, a commit to a table with a long history (`--history`, a year of nights
by default: a commit's metadata work grows with the versions kept, and tagged nightly versions stay),
through the catalog against pyiceberg's own `add_files` in the same process; then retention's expiry of
100 of those versions through the catalog, and of the next 100 through pyiceberg's own `expire_snapshots` (on
the 100 fewer versions left, which favours it). Prints, never asserts.

    python benchmarks/catalog_bench.py [--rows 100000] [--shards 20] [--history 365] [--uri postgresql+psycopg://...]

Targets: commit path >= 20,000 rows/s; load of 100k rows < 1.5 s.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.data.catalog import Catalog, Lineage, Withdrawal
from trajforge.schemas.tables import to_arrow

ROLES = ["button", "link", "textbox", "checkbox", "combobox", "heading", "listitem", "img", "tab", "menuitem"]
WORDS = (
    "save cancel settings profile search notes inbox compose archive delete share edit title body "
    "calendar today tomorrow reminder alarm contacts add remove more options back forward home help"
).split()


def _ax_lines(rng: random.Random, n: int) -> list[str]:
    """Distinct 'role name' lines at various depths, the vocabulary trees are drawn from."""
    return [
        "  " * rng.randint(1, 4) + f"{rng.choice(ROLES)} {' '.join(rng.choices(WORDS, k=rng.randint(1, 4)))} {k}"
        for k in range(n)
    ]


def build_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Step rows shaped like a rollout's: ~2 KB each, screens repeating within an app."""
    rng = random.Random(seed)
    lines = _ax_lines(rng, 50_000)
    rows = []
    for i in range(n):
        episode, index = divmod(i, 20)
        x, y = rng.randint(0, 1023), rng.randint(0, 599)
        rows.append(
            {
                "run_id": "bench-run",
                "step_id": f"ep{episode:06d}-s{index:02d}",
                "episode_id": f"ep{episode:06d}",
                "step_index": index,
                "screenshot_before": f"{rng.getrandbits(256):064x}",
                "screenshot_after": f"{rng.getrandbits(256):064x}",
                "width": 1024,
                "height": 600,
                "url_before": f"http://127.0.0.1:8000/notes/{rng.randint(1, 500)}",
                "url_after": f"http://127.0.0.1:8000/notes/{rng.randint(1, 500)}",
                "title_before": "Notes",
                "title_after": "Notes - edit",
                # ~1.5 KB: every screen a different mix of lines, so it compresses like real trees.
                "ax_tree_before": "RootWebArea Notes\n" + "\n".join(rng.choices(lines, k=48)),
                "action_type": "click",
                "action_json": json.dumps({"x": x, "y": y}),
                "action_valid": True,
                "action_error": None,
                "target_role": rng.choice(ROLES),
                "target_name": " ".join(rng.choices(WORDS, k=2)),
                "thought": f"The {rng.choice(WORDS)} control is what the task needs; clicking it at ({x}, {y}).",
                "raw_output": f'{{"action": "click", "x": {x}, "y": {y}}}',
                "duration_ms": rng.uniform(40, 120),
            }
        )
    return rows


def _appends(catalog: Catalog, shards: list[pa.Table], lineage: Lineage) -> list[tuple[str, float]]:
    """One more shard appended three ways (module docstring), each timed from its file on disk to its version."""
    first = shards[0]
    column = first.schema.get_field_index("step_id")
    renamed = pa.array([f"x{s}" for s in first["step_id"].to_pylist()])  # new steps of the same episodes
    extra = first.set_column(column, first.schema.field(column), renamed)
    firsts = [shard["episode_id"][0].as_py() for shard in shards]
    in_bounds = frozenset(f"{e}z" for e in firsts)
    cases = [
        ("plain", None),
        # 'ep000000z' sorts inside the first file's bounds and is in no file: every file is read, none rewritten.
        (f"withdrawing ids in bounds of all {len(shards)}", Withdrawal("episode_id", in_bounds)),
        ("withdrawing 50 of one file's episodes",
         Withdrawal("episode_id", frozenset(shards[1]["episode_id"].unique().to_pylist()[:50]))),
    ]
    timed = []
    for n, (label, withdraw) in enumerate(cases):
        path = catalog.data_dir("steps") / f"bench-extra-{n}.parquet"
        pq.write_table(extra, path, compression="zstd")
        key = f"bench-run-{n}:steps"
        t = time.perf_counter()
        catalog.commit_files("steps", [path], lineage.model_copy(update={"commit_key": key}), withdraw=withdraw)
        timed.append((f"append {extra.num_rows:,} rows, {label}", time.perf_counter() - t))
    return timed


def _drop(catalog: Catalog) -> None:
    """Leave nothing of a bench catalog behind (a shared PostgreSQL keeps its tables otherwise)."""
    if "steps" in catalog.tables():
        catalog.iceberg.drop_table((catalog.namespace, "steps"))
    catalog.iceberg.drop_namespace(catalog.namespace)
    catalog.close()


def _deep_history(root: Path, uri: str | None, shard: pa.Table, versions: int,
                  lineage: Lineage) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """One more 100-row shard committed to a new table, then to the same table after `versions` such commits,
    through the catalog and through pyiceberg's own transaction (medians of 5, the two interleaved); then the
    oldest 100 versions expired through the catalog, and the next 100 through pyiceberg's own (fewer where fewer
    than that are older than the current version, none where none is)."""
    small = shard.slice(0, 100)
    catalog = Catalog(root / "history", uri=uri, name=f"bench-history-{time.time_ns()}")
    try:
        folder = catalog.data_dir("steps")

        def write(n: int) -> tuple[Path, Lineage]:
            path = folder / f"night-{n:04d}.parquet"
            pq.write_table(small, path, compression="zstd")
            return path, lineage.model_copy(update={"commit_key": f"night-{n}:steps"})

        def ours(n: int) -> float:
            path, night = write(n)
            t = time.perf_counter()
            catalog.commit_files("steps", [path], night)
            return time.perf_counter() - t

        def pyicebergs(n: int) -> float:
            path, night = write(n)
            t = time.perf_counter()
            tx = catalog.table("steps").refresh().transaction()
            tx.add_files([path.as_uri()], snapshot_properties=night.snapshot_properties())
            tx.commit_transaction()
            return time.perf_counter() - t

        first = ours(0)
        for n in range(1, versions):
            ours(n)
        timed: dict[str, list[float]] = {"catalog": [], "pyiceberg's own add_files": []}
        for n in range(versions, versions + 10, 2):
            timed["catalog"].append(ours(n))
            timed["pyiceberg's own add_files"].append(pyicebergs(n + 1))
        expiry = []
        for name in ("catalog", "pyiceberg's own expire_snapshots"):
            tbl = catalog.table("steps").refresh()
            held = len(tbl.metadata.snapshots)
            # The current version cannot go (pyiceberg refuses it): a short --history has fewer than 200 others.
            oldest = [s.snapshot_id for s in tbl.metadata.snapshots][:min(100, held - 1)]
            if not oldest:
                continue
            t = time.perf_counter()
            if name == "catalog":
                catalog.expire_versions("steps", oldest)
            else:
                tbl.maintenance.expire_snapshots().by_ids(oldest).commit()
            expiry.append((f"{len(oldest)} of {held} versions, {name}", time.perf_counter() - t))
    finally:
        _drop(catalog)
    commits = [("to a new table, catalog", first)] + [
        (f"after {versions} versions, {name}", sorted(times)[len(times) // 2]) for name, times in timed.items()]
    return commits, expiry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--history", type=int, default=365, help="Versions before the last commit (0: skip it).")
    parser.add_argument("--uri", default=None, help="SQLAlchemy URL of the catalog (default: SQLite in the warehouse)")
    args = parser.parse_args()

    t = time.perf_counter()
    rows = build_rows(args.rows)
    t_build = time.perf_counter() - t

    t = time.perf_counter()
    step = -(-args.rows // args.shards)
    shards = [to_arrow("steps", rows[i : i + step]) for i in range(0, args.rows, step)]
    t_validate = time.perf_counter() - t
    data = pa.concat_tables(shards)
    row_bytes = data.nbytes / data.num_rows

    with tempfile.TemporaryDirectory(prefix="catalog-bench-") as tmp:
        root = Path(tmp)

        t = time.perf_counter()
        pq.write_table(data, root / "baseline.parquet", compression="zstd")
        t_baseline = time.perf_counter() - t

        catalog = Catalog(root / "warehouse", uri=args.uri, name=f"bench-{time.time_ns()}")
        try:
            catalog.table("steps")  # creation is a one-off, not part of a stage's commit
            lineage = Lineage(
                stage="rollout",
                run_id="bench-run",
                commit_key="bench-run:steps",
                config_hash="bench",
                code_version="bench",
                kept={"steps": args.rows},
            )
            t = time.perf_counter()
            folder = catalog.data_dir("steps")
            paths = []
            for n, shard in enumerate(shards):
                path = folder / f"bench-shard-{n:03d}.parquet"
                pq.write_table(shard, path, compression="zstd")
                paths.append(path)
            t_shards = time.perf_counter() - t
            t = time.perf_counter()
            snapshot = catalog.commit_files("steps", paths, lineage)
            t_commit = time.perf_counter() - t

            catalog.load("steps", snapshot)  # warm-up: imports and first-use costs
            t = time.perf_counter()
            df = catalog.load("steps", snapshot)
            t_load = time.perf_counter() - t
            t = time.perf_counter()
            narrow = catalog.scan("steps", snapshot).select("step_id", "episode_id", "action_type", "width").collect()
            t_narrow = time.perf_counter() - t
            assert df.height == args.rows and narrow.height == args.rows
            on_disk = sum(p.stat().st_size for p in paths) / args.rows
            appends = _appends(catalog, shards, lineage)
        finally:
            _drop(catalog)
        history, expiry = _deep_history(root, args.uri, shards[0], args.history, lineage) if args.history else ([], [])

    t_catalog = t_shards + t_commit
    n = args.rows
    print(f"{n:,} steps rows, {row_bytes / 1024:.2f} KB each in Arrow, {on_disk / 1024:.2f} KB on disk; "
          f"{args.shards} shards; catalog {'SQLite' if args.uri is None else args.uri.split('@')[-1]}")
    print(f"(building the row dicts took {t_build:.2f} s; not counted)")
    print()
    print(f"{'step':<44} {'seconds':>8} {'rows/s':>10}")
    table = [
        ("validate rows (to_arrow, per shard)", t_validate),
        ("baseline: pq.write_table, one file", t_baseline),
        (f"write {args.shards} shard files into data_dir", t_shards),
        ("commit_files (one snapshot)", t_commit),
        ("catalog path: shard files + commit", t_catalog),
        ("catalog path + validation", t_catalog + t_validate),
        ("load() the version into polars", t_load),
        ("scan() 4 narrow columns", t_narrow),
    ]
    for label, seconds in table:
        print(f"{label:<44} {seconds:>8.3f} {n / seconds:>10,.0f}")
    print()
    print(f"{'commit of one more shard':<60} {'seconds':>8} {'x plain':>8}")
    for label, seconds in appends:
        print(f"{label:<60} {seconds:>8.3f} {seconds / appends[0][1]:>8.2f}")
    if history:
        print()
        print(f"{'commit of a 100-row shard':<60} {'seconds':>8} {'x new':>8}")
        for label, seconds in history:
            print(f"{label:<60} {seconds:>8.3f} {seconds / history[0][1]:>8.2f}")
        print()
        print(f"{'expiry of the oldest versions':<60} {'seconds':>8} {'x catalog':>9}")
        for label, seconds in expiry:
            print(f"{label:<60} {seconds:>8.3f} {seconds / expiry[0][1]:>9.2f}")
    print()
    print(f"catalog path / baseline time: {t_catalog / t_baseline:.2f}x   "
          f"(target: >= 20,000 rows/s -> {'met' if n / t_catalog >= 20_000 else 'NOT met'})")
    print(f"load of {n:,} rows: {t_load:.2f} s   (target: < 1.5 s -> {'met' if t_load < 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()

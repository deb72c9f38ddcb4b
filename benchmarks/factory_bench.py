"""The whole factory, model aside: a night with the reference-replay policy and rule critics, end to end.

Each night is `trajforge run nightly` as a user runs it (Prefect, catalog, ledger, blobs, OCR and every stage
included, in a Prefect home whose database was migrated before, as a user's is after their first night) over
the bundled apps' queries with `rollout.policy: replay`, rule critics and template writers, so no model is
asked and the figure is the factory's own. It is compared with the environment pool's steps/s measured in
the same process just before (benchmarks/env_bench.py's EnvPool loop on MiniWoB++ at 4 contexts): the
target is a night at 0.5 or more of it. Steps are the night's `steps` rows (the reference replays and the
policy's episodes); the episodes likewise.

A bundled app's step is not a MiniWoB++ step: most load a new page. So the night's queries are also replayed
once more on their own, with the same pool (`rollout` with the replay policy at 4 contexts, nothing else):
the night against that says what the factory adds to the apps' own cost.

Then the same night on Dask (`runner.engine: dask`, a LocalCluster of 1, 2 and 4 worker processes, the
catalog on PostgreSQL). On 2 cores the scaling is flat; it is printed for larger machines.

    python benchmarks/factory_bench.py [--apps shop,mail,calendar,notes,settings,writer] [--queries 2]
                                       [--dask 1,2,4] [--env-steps 100] [--keep DIR]

Prints a table of nights and each night's time per stage; never asserts.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import psycopg

from trajforge.data.blobs import BlobStore
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import RolloutSettings, Settings, WarehouseSettings

sys.path.insert(0, str(Path(__file__).parent))
from env_bench import env_pool, episodes, serve_miniwob  # the env bench's loop, not a copy
from fault_bench import cli_env, cli_path, postgres_database

CONFIG = """\
query_gen:
  apps: [{apps}]
  num_queries: {queries}
  deep_search_apps: []
rollout:
  policy: replay
  contexts: 4
critics:
  step_critic: rules
  text_channel: false
synth:
  writer: template
"""

_LOG = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| INFO +\| Flow run '([^']+)' - (?:Beginning subflow run '[^']+' for flow "
                  r"'stage-([a-z-]+)'|Finished in state)")
"""Prefect's flow-run log lines: a stage's subflow beginning (with the stage) and any flow run finishing."""


def stage_seconds(log: str) -> dict[str, float]:
    """Seconds each stage's subflow ran, from the night's Prefect log lines."""
    begun: dict[str, tuple[str, datetime]] = {}
    out: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = _LOG.match(line)
        if m is None:
            continue
        at, run, stage = datetime.strptime(m[1], "%H:%M:%S.%f"), m[2], m[3]
        if stage:
            begun[run] = (stage, at)
        elif run in begun:
            name, start = begun.pop(run)
            out[name] += (at - start).total_seconds() % 86400
    return dict(out)


def night(folder: Path, config: str, warehouse: WarehouseSettings) -> dict[str, object]:
    """One fresh night in `folder`: its wall time, episodes, steps and time per stage. What a run before left
    there (`--keep` given the same folder again) goes first: a night on its warehouse would resume or skip."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "trajforge.yaml").write_text(config)
    # The night's Prefect home is new; its database is migrated first (about 10 s on 2 cores), as a user's is
    # by their first night, so the figure is a night's and not Prefect's installation.
    subprocess.run([str(Path(cli_path()).with_name("prefect")), "server", "database", "upgrade", "-y"],
                   env=cli_env(folder), capture_output=True, check=True)
    start = time.perf_counter()
    proc = subprocess.run([cli_path(), "run", "nightly"], cwd=folder, env=cli_env(folder), capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"trajforge run nightly failed in {folder}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    catalog = Workspace.open(Settings(warehouse=warehouse)).catalog
    return {"wall_s": wall, "episodes": catalog.load("episodes").height, "steps": catalog.load("steps").height,
            "stages": stage_seconds(proc.stdout + proc.stderr)}


def app_replay(warehouse: WarehouseSettings, scratch: Path) -> float:
    """Steps/s of the night's queries replayed once by the env pool alone (4 contexts, no stage around it)."""
    queries = Workspace.open(Settings(warehouse=warehouse)).catalog.load("queries").to_dicts()
    start = time.perf_counter()
    out = rollout(queries, run_id="app-replay", settings=RolloutSettings(policy="replay", contexts=4),
                  blobs=BlobStore(scratch))
    return len(out.rows["steps"]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apps", default="shop,mail,calendar,notes,settings,writer")
    parser.add_argument("--queries", type=int, default=2, help="Page-graph queries per app (query_gen.num_queries).")
    parser.add_argument("--dask", default="1,2,4", help="Dask worker counts to run the night on ('' for none).")
    parser.add_argument("--env-steps", type=int, default=100, help="Steps per MiniWoB++ task of the env pool run.")
    parser.add_argument("--keep", type=Path, help="Keep the nights' folders here.")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="factory-bench-"))
    config = CONFIG.format(apps=", ".join(args.apps.split(",")), queries=args.queries)

    with serve_miniwob() as base:
        pool = env_pool(base, episodes(args.env_steps, 20), 4)["steps_per_s"]
    print(f"env pool, 4 contexts: {pool:.1f} steps/s")

    threads = WarehouseSettings(path=root / "threads/data/warehouse")
    rows = [("threads", 1, night(root / "threads", config, threads))]
    replay = app_replay(threads, root / "app-replay-blobs")
    print(f"the night's queries replayed by the env pool alone, 4 contexts: {replay:.1f} steps/s")
    for workers in [int(w) for w in args.dask.split(",") if w]:
        folder = root / f"dask-{workers}"
        try:  # a database per night: its OCR cache (per catalog database) starts as cold as the thread night's
            with postgres_database("factory") as url:
                dask = f"{config}warehouse:\n  catalog_url: {url}\nrunner:\n  engine: dask\n  workers: {workers}\n"
                rows.append(("dask", workers, night(folder, dask, WarehouseSettings(
                    path=folder / "data/warehouse", catalog_url=url))))
        except psycopg.OperationalError as exc:
            print(f"dask nights skipped: PostgreSQL not reachable ({exc})")
            break

    print("\n| engine | workers | night s | episodes | steps | episodes/s | steps/s | of the env pool (target 0.5) "
          "| of the apps' replay |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for engine, workers, r in rows:
        wall, eps, steps = float(r["wall_s"]), int(r["episodes"]), int(r["steps"])  # type: ignore[arg-type]
        print(f"| {engine} | {workers} | {wall:.1f} | {eps} | {steps} | {eps / wall:.3f} | {steps / wall:.2f} | "
              f"{steps / wall / pool:.3f} | {steps / wall / replay:.3f} |")
    print("\nseconds per stage:")
    stages = list(rows[0][2]["stages"])  # type: ignore[arg-type]
    print("| stage | " + " | ".join(f"{e} {w}" for e, w, _ in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{r['stages'].get(stage, 0):.1f}" for _, _, r in rows) + " |")  # type: ignore[union-attr]
    if args.keep:
        print(f"\nnights kept in {root}")
    else:  # a night that failed exits before this: its folder stays, named in the message
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

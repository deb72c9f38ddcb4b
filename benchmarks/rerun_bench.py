"""A nightly rerun with nothing new against a cold nightly run: wall time and model calls.

Runs `trajforge run nightly` twice in a fresh folder, as a user would, on the embedded
model (the end-to-end policy, the model step critic and the text channel). Nothing
changes between the two runs: same config, same apps, and no guidance (`loop.max_guided:
0`, since guidance for the first night's failures would be new work). The second run
generates the same queries; their reference paths are recorded already, and the rollout
leaves out every query whose attempts the warehouse holds with the same attempt key, so
the stages after it have nothing new to read. Any model request it still makes would be
the same as the first's, which the response cache answers.

Model calls are counted as new rows in the response cache (`llm.cache.responses`):
one row per distinct request answered by a model. Prints a table; never asserts.
Target (shared/FACTS.md, the project brief): the rerun under 10% of the cold run's
wall time, with no model call.

    python benchmarks/rerun_bench.py [--apps shop,notes] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from trajforge.llm.cache import responses

sys.path.insert(0, str(Path(__file__).parent))
from factory_bench import stage_seconds  # the same reading of Prefect's log lines

CONFIG = """\
query_gen:
  apps: [{apps}]
  num_queries: 1
  atomic_per_app: 1
  deep_search_apps: []
rollout:
  policy: gui_owl_e2e
loop:
  max_guided: 0
"""


def model_answers(cwd: Path) -> int:
    """Rows in the response cache: each is one request a model answered."""
    engine = sa.create_engine(f"sqlite:///{cwd / 'data' / 'warehouse' / 'catalog.db'}")
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(responses)).scalar_one()
    finally:
        engine.dispose()


def nightly(cwd: Path) -> tuple[float, int, dict[str, float]]:
    """One `trajforge run nightly`: its wall time, the model answers it added and its seconds per stage."""
    exe = str(Path(sys.executable).parent / "trajforge")
    before = model_answers(cwd) if (cwd / "data" / "warehouse" / "catalog.db").exists() else 0
    start = time.perf_counter()
    proc = subprocess.run([exe, "run", "nightly"], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"trajforge run nightly failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, model_answers(cwd) - before, stage_seconds(proc.stdout + proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apps", default="shop,notes", help="Bundled apps to run (comma-separated).")
    parser.add_argument("--keep", type=Path, help="Run in this folder and keep it (default: a temp folder).")
    args = parser.parse_args()

    cwd = args.keep or Path(tempfile.mkdtemp(prefix="trajforge-rerun-"))
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "trajforge.yaml").write_text(CONFIG.format(apps=", ".join(args.apps.split(","))))
    os.environ.setdefault("PREFECT_HOME", str(cwd / ".prefect"))
    try:
        cold = nightly(cwd)
        rerun = nightly(cwd)
    finally:
        if args.keep is None:
            shutil.rmtree(cwd, ignore_errors=True)

    print(f"apps {args.apps}: one page-graph and one atomic query each, embedded model, no guidance")
    print(f"{'run':<22} {'wall s':>8} {'model calls':>12}")
    for name, (wall, calls, _) in (("cold nightly", cold), ("rerun, nothing new", rerun)):
        print(f"{name:<22} {wall:>8.1f} {calls:>12}")
    print(f"\n{'stage':<16} {'cold s':>8} {'rerun s':>8}")
    for stage in cold[2]:
        print(f"{stage:<16} {cold[2][stage]:>8.1f} {rerun[2].get(stage, 0.0):>8.1f}")
    ratio = rerun[0] / cold[0]
    met = ratio < 0.10 and rerun[1] == 0
    print(f"rerun / cold wall time: {ratio:.2f}   (target: < 0.10 and no model call -> {'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()

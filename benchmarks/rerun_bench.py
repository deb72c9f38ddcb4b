"""A nightly rerun with nothing new against a cold nightly run: wall time, model calls and OCR readings.

Runs `trajforge run nightly` twice in a fresh folder, as a user would, on the embedded
model (the end-to-end policy, the model step critic and the text channel). Nothing
changes between the two runs: same config, same apps, and no guidance (`loop.max_guided:
0`, since guidance for the first night's failures would be new work). The second run
generates the same queries; their reference paths are recorded already, and the rollout
leaves out every query whose attempts the warehouse holds with the same attempt key, so
the stages after it have nothing new to read. Any model request it still makes would be
the same as the first's, which the response cache answers.

Model calls are counted as new rows in the response cache (`llm.cache.responses`):
one row per distinct request answered by a model; OCR as new readings in the OCR cache
(`llm.ocr.ocr_results`), one per screen read. Both live in the folder's catalog database:
the nights run in `fault_bench.cli_env`'s environment, less a shared OCR cache or a
response cache turned off. Prints a table; never asserts.
Target (shared/FACTS.md, the project brief): the rerun under 10% of the cold run's
wall time, with no model call and no new OCR.

    python benchmarks/rerun_bench.py [--apps shop,notes] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from trajforge.llm.cache import responses
from trajforge.llm.ocr import ocr_results

sys.path.insert(0, str(Path(__file__).parent))
from factory_bench import stage_seconds  # the same reading of Prefect's log lines
from fault_bench import cli_env

COUNTED = {"TRAJFORGE_SYNTH__OCR_CACHE_URL", "TRAJFORGE_LLM__CACHE"}
"""Settings `cli_env` passes on (they change no row) that would hide what is counted: a shared OCR cache keeps
the readings elsewhere and makes the cold night's warm, and the response cache turned off keeps no answer."""

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


def night_env(cwd: Path) -> dict[str, str]:
    """The environment of a night in `cwd`: none of the caller's TRAJFORGE_ variables (a catalog URL would put
    the bench's nights in the caller's catalog), nor those in `COUNTED`."""
    return {k: v for k, v in cli_env(cwd).items() if k.upper() not in COUNTED}


def cached(cwd: Path) -> tuple[int, int]:
    """Rows in the response cache and in the OCR cache of the catalog in `cwd`: each is one request a model
    answered, or one screen read. (0, 0) before the first night made them."""
    path = cwd / "data" / "warehouse" / "catalog.db"
    if not path.exists():
        return 0, 0
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            present = sa.inspect(conn)
            answers, readings = (conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                                 if present.has_table(table.name) else 0 for table in (responses, ocr_results))
            return answers, readings
    finally:
        engine.dispose()


def nightly(cwd: Path) -> tuple[float, int, int, dict[str, float]]:
    """One `trajforge run nightly`: its wall time, the model answers and OCR readings it added and its seconds
    per stage."""
    exe = str(Path(sys.executable).parent / "trajforge")
    answers, readings = cached(cwd)
    start = time.perf_counter()
    proc = subprocess.run([exe, "run", "nightly"], cwd=cwd, env=night_env(cwd), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"trajforge run nightly failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    after = cached(cwd)
    return wall, after[0] - answers, after[1] - readings, stage_seconds(proc.stdout + proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apps", default="shop,notes", help="Bundled apps to run (comma-separated).")
    parser.add_argument("--keep", type=Path, help="Run in this folder and keep it (default: a temp folder).")
    args = parser.parse_args()

    cwd = args.keep or Path(tempfile.mkdtemp(prefix="trajforge-rerun-"))
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "trajforge.yaml").write_text(CONFIG.format(apps=", ".join(args.apps.split(","))))
    # The folder's Prefect home is new; its database is migrated before the cold night is timed (about 10 s on
    # 2 cores), as factory_bench does: else the cold night carries Prefect's installation and flatters the ratio.
    subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                   env=night_env(cwd), capture_output=True, check=True)
    try:
        cold = nightly(cwd)
        rerun = nightly(cwd)
    finally:
        if args.keep is None:
            shutil.rmtree(cwd, ignore_errors=True)

    print(f"apps {args.apps}: one page-graph and one atomic query each, embedded model, no guidance")
    print(f"{'run':<22} {'wall s':>8} {'model calls':>12} {'OCR readings':>13}")
    for name, (wall, calls, readings, _) in (("cold nightly", cold), ("rerun, nothing new", rerun)):
        print(f"{name:<22} {wall:>8.1f} {calls:>12} {readings:>13}")
    print(f"\n{'stage':<16} {'cold s':>8} {'rerun s':>8}")
    for stage in cold[3]:
        print(f"{stage:<16} {cold[3][stage]:>8.1f} {rerun[3].get(stage, 0.0):>8.1f}")
    ratio = rerun[0] / cold[0]
    met = ratio < 0.10 and rerun[1] == 0 and rerun[2] == 0
    print(f"rerun / cold wall time: {ratio:.2f}   (target: < 0.10, no model call and no new OCR -> "
          f"{'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()

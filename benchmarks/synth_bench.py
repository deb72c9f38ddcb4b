"""The grounding stage's no-model path: screens per second, the share of time in OCR, and a rerun's cost.

Records real screens first: query generation (its `pages`) and the reference stage (the replay policy
in headless Chromium) for a few bundled apps, into a temporary warehouse. Then:

1. the no-model grounding path over every distinct screen, timed by part: OCR (rapidocr,
   cold: each screen read once), region proposals (OpenCV contours), and the accessibility
   tree + IoU cleaning + rows (`grounding.ground_screen`); prints screens/s and OCR's share;
2. the grounding stage through the runner, twice (`synth.writer: template`, so no model):
   the first finds every screen's OCR cached by part 1, as a night's grounding finds the
   critics'; the second has nothing new, and must read no new OCR and ask no model.

Prints a table; never asserts. Target (issue 11): a rerun with nothing new makes no model
call and no new OCR.

    python benchmarks/synth_bench.py [--apps notes,shop,mail] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from trajforge.guidance.reference import STAGE as REFERENCE
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.schemas.config import Settings
from trajforge.synth import grounding
from trajforge.synth.regions import propose
from trajforge.tasks.runner import run_inline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apps", default="notes,shop,mail", help="Bundled apps to record (comma-separated).")
    parser.add_argument("--keep", type=Path, help="Use this folder and keep it (default: a temp folder).")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="trajforge-synth-"))
    settings = Settings(
        warehouse={"path": root / "wh"},
        query_gen={"apps": args.apps.split(","), "num_queries": 2, "atomic_per_app": 1, "deep_search_apps": []},
        rollout={"policy": "replay", "contexts": 2},
        synth={"writer": "template"},
    )
    try:
        ws = Workspace.open(settings)
        run = ws.ledger.open_run("bench", f"record {time.time()}").run_id
        queries = run_inline(QUERY_GEN, ws, run)["queries"]
        steps = run_inline(REFERENCE, ws, run, queries)["steps"]
        screens = grounding.load_screens(ws, steps).units

        timings = {"ocr": 0.0, "regions": 0.0, "tree + cleaning": 0.0}
        rows = 0
        for screen in screens:
            png = ws.blobs.get(screen.screenshot)
            t0 = time.perf_counter()
            lines = ws.ocr.read(png)
            t1 = time.perf_counter()
            regions = propose(png)
            t2 = time.perf_counter()
            out = grounding.ground_screen(screen, png, lines, regions, run_id=run, iou_threshold=0.5)
            t3 = time.perf_counter()
            timings["ocr"] += t1 - t0
            timings["regions"] += t2 - t1
            timings["tree + cleaning"] += t3 - t2
            rows += len(out.rows)
        total = sum(timings.values())
        print(f"apps {args.apps}: {len(screens)} distinct screens (reference steps and the pages query generation saw)")
        print(f"{'part':<18} {'s':>7} {'share':>7}")
        for part, seconds in timings.items():
            print(f"{part:<18} {seconds:>7.2f} {seconds / total:>7.0%}")
        print(f"no-model grounding path: {len(screens) / total:.2f} screens/s, {rows / len(screens):.0f} rows/screen; "
              f"OCR share {timings['ocr'] / total:.0%}")

        reader = ws.ocr
        calls = ws.gateway.stats.calls
        runs_before = reader.engine_runs
        t0 = time.perf_counter()
        first = run_inline(grounding.STAGE, ws, ws.ledger.open_run("bench", f"ground {time.time()}").run_id, steps)
        cold = time.perf_counter() - t0
        runs_after_first, calls_after_first = reader.engine_runs, ws.gateway.stats.calls
        t0 = time.perf_counter()
        second = run_inline(grounding.STAGE, ws, ws.ledger.open_run("bench", f"again {time.time()}").run_id, steps)
        rerun = time.perf_counter() - t0
        kept = [ws.catalog.lineage("grounding", s["grounding"]).kept["grounding"] for s in (first, second)]
        print(f"{'grounding stage':<22} {'wall s':>7} {'rows':>7} {'new OCR':>8} {'model calls':>12}")
        first_ocr, first_calls = runs_after_first - runs_before, calls_after_first - calls
        print(f"{'first run (OCR cached)':<22} {cold:>7.2f} {kept[0]:>7} {first_ocr:>8} {first_calls:>12}")
        new_ocr = reader.engine_runs - runs_after_first
        new_calls = ws.gateway.stats.calls - calls_after_first
        print(f"{'rerun, nothing new':<22} {rerun:>7.2f} {kept[1]:>7} {new_ocr:>8} {new_calls:>12}")
        met = new_ocr == 0 and new_calls == 0
        verdict = "met" if met else "NOT met"
        print(f"rerun / first: {rerun / cold:.2f}   (target: no new OCR and no model call -> {verdict})")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Where a step's CPU goes: CPU time per step of each kind of process, a MiniWoB++ step against an app step.

The factory bench finds a bundled app's step several times dearer than the env pool's MiniWoB++ step
(README, "The factory's own speed"). This bench says by whom: it runs both loops in one process, each at the
same number of contexts, and meters the CPU time of this process and of every process under it (sampled
every 50 ms, so a renderer that exits keeps what it used up to its last sample; the sampler's own CPU is not
counted):

- the env pool on MiniWoB++ (benchmarks/env_bench.py's loop: a target lookup, an action, an observation);
- the replay policy on a bundled app's validated page-graph queries (`rollout`, nothing around it), whose
  steps mostly load a new page.

Chromium's processes are told apart by their `--type`; "python" is this process: Playwright's client, the
bundled apps' servers (threads here) and the stage's own work.

    python benchmarks/step_cpu.py [--apps shop] [--queries 8] [--contexts 4] [--env-steps 40]

Prints a table of milliseconds of CPU per step; never asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from trajforge.data.blobs import BlobStore
from trajforge.envs.apps import load_app
from trajforge.envs.browser import CHROMIUM
from trajforge.envs.kinds import BundledWebKind
from trajforge.envs.pool import close_warm
from trajforge.query_gen.stage import generate_queries
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import QueryGenSettings, RolloutSettings

sys.path.insert(0, str(Path(__file__).parent))
from env_bench import env_pool, episodes, serve_miniwob  # the env bench's loop, not a copy

KINDS = ["chromium renderer", "chromium browser", "chromium gpu-process", "chromium network service", "chromium other",
         "node (playwright driver)", "python (this process)"]


def kind_of(process: psutil.Process, me: int) -> str:
    if process.pid == me:
        return "python (this process)"
    cmdline = process.cmdline()
    program = Path(cmdline[0]).name if cmdline else process.name()  # a zygote's children run as /proc/self/exe
    if program.startswith("node") or "playwright" in " ".join(cmdline[:2]):  # "node-MainThread" when argv is unread
        return "node (playwright driver)"
    if "chrom" in program or any(a.startswith("--type=") for a in cmdline):
        kind = next((a.removeprefix("--type=") for a in cmdline if a.startswith("--type=")), "browser")
        if kind == "utility" and any("NetworkService" in a for a in cmdline):
            return "chromium network service"
        return f"chromium {kind}" if kind in ("renderer", "browser", "gpu-process") else "chromium other"
    return f"other ({program})"


def metered(run: Callable[[], int]) -> tuple[int, float, dict[str, float]]:
    """Steps, wall seconds and CPU seconds by process kind of `run()` (which returns its step count)."""
    me = psutil.Process()
    start: dict[int, float] = {}
    last: dict[int, tuple[str, float]] = {}
    started = False

    def sample() -> None:
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                used = times.user + times.system  # not children_*: every child is sampled itself
                if process.pid not in start:
                    start[process.pid] = 0.0 if started else used
                # asked each time: /usr/bin/chromium is a shell script until it execs the browser
                last[process.pid] = (kind_of(process, me.pid), used)
            except psutil.Error:  # exited between the listing and the read: its last sample stands
                pass

    sample()
    started = True
    stop = threading.Event()
    sampling = [0.0]  # the sampler's own CPU: it runs in this process, and is not the step's

    def loop() -> None:
        t = time.thread_time()
        while not stop.wait(0.05):
            sample()
        sampling[0] = time.thread_time() - t

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    steps = run()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    sample()
    cpu: dict[str, float] = defaultdict(float)
    for pid, (kind, used) in last.items():
        cpu[kind] += used - start[pid]
    cpu["python (this process)"] -= sampling[0]
    return steps, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apps", default="shop")
    parser.add_argument("--queries", type=int, default=8, help="Page-graph queries per app.")
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--env-steps", type=int, default=40, help="Steps per MiniWoB++ task (5 tasks).")
    args = parser.parse_args()

    made = generate_queries([BundledWebKind(load_app(a)) for a in args.apps.split(",")], run_id="step-cpu",
                            settings=QueryGenSettings(num_queries=args.queries, atomic_per_app=0,
                                                      deep_search_apps=[]), chromium=CHROMIUM)
    close_warm()  # query generation's browser, which the replay would borrow: each run starts its own, as printed
    queries: list[Any] = made.rows["queries"]
    work = episodes(args.env_steps, 20)

    def miniwob() -> int:
        with serve_miniwob() as base:  # the server's threads count as this process's, as the app servers do
            env_pool(base, work, args.contexts)
        return sum(len(actions) for _, actions in work)

    def apps() -> int:
        with tempfile.TemporaryDirectory() as blobs:
            out = rollout(queries, run_id="step-cpu", settings=RolloutSettings(policy="replay", contexts=args.contexts),
                          blobs=BlobStore(Path(blobs)))
        return len(out.rows["steps"])

    runs = {"MiniWoB++ (env pool)": metered(miniwob), f"{args.apps} (replay)": metered(apps)}
    print(f"\nCPU milliseconds per step, {args.contexts} contexts (browser start included)")
    print("| process | " + " | ".join(runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    kinds = KINDS + sorted({k for _, _, cpu in runs.values() for k in cpu} - set(KINDS))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{cpu.get(kind, 0.0) / steps * 1000:.0f}"
                                          for steps, _, cpu in runs.values()) + " |")
    totals = [f"{sum(cpu.values()) / steps * 1000:.0f}" for steps, _, cpu in runs.values()]
    print("| total | " + " | ".join(totals) + " |")
    print("| steps, steps/s, cores busy | " + " | ".join(
        f"{steps}, {steps / wall:.1f}, {sum(cpu.values()) / wall:.2f}" for steps, wall, cpu in runs.values()) + " |")


if __name__ == "__main__":
    main()

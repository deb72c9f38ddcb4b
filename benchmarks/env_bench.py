"""Environment step throughput on MiniWoB++: our env pool, a bare CDP loop, and BrowserGym.

The same fixed action sequences (5 MiniWoB++ tasks, 200 steps each, a reset every
`--episode-len` steps) run through:

- the bare-loop anchor: async Playwright, N contexts, each step an input event then
  CDP `Page.captureScreenshot` + `Accessibility.getFullAXTree`, sent at once as the pool
  sends its observation's calls: the floor of what an environment that screenshots and
  reads the tree can cost (shared/FACTS.md);
- `EnvPool` with 1, 2 and 4 contexts: what the rollout stage runs, each step the
  recorder's calls (target element, action with navigation wait, observation with the
  tree and element boxes);
- BrowserGym's MiniWoB++ environment (browsergym-miniwob, one env, with its artificial
  delays off: slow_mo=0, pre_observation_delay=0, as shared/FACTS.md measured it), in its
  own venv because it pins playwright 1.44; the benchmark creates the venv on first use
  (benchmarks/.venv-browsergym, git-ignored) and runs its loop in a subprocess.

Steps/s count resets in the wall time; a reset is starting the task (seeded, as a query
is) and the first observation. Both loops restart a default task (`envs.miniwob.DEFAULT_TASKS`)
in place when their context shows its page already, as the rollout's MiniWoBEnv does and the
miniwob package's own environment always does, and load the page otherwise (here click-tab-2
and book-flight, and each context's first episode of a task): the table gives the median of
all resets and of the loads alone. Prints a table; never asserts. Targets (the project
brief): >= 0.9 of the bare loop with 4 contexts (about 30 steps/s on 2 cores), resets
under 0.25 s.

    python benchmarks/env_bench.py [--steps 200] [--episode-len 20] [--browsergym-steps 40] [--no-browsergym]

Needs the `miniwob` package (pip install miniwob): its 140 task pages are served from
`miniwob/html/` on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from playwright.async_api import ViewportSize, async_playwright

from trajforge.envs.browser import CHROMIUM, CHROMIUM_ARGS, BrowserEnv
from trajforge.envs.miniwob import _KEEP_THE_END, DEFAULT_TASKS, MiniWoBEnv
from trajforge.envs.pool import EnvPool

TASKS = ["click-button", "click-checkboxes", "enter-text", "click-tab-2", "book-flight"]
VIEWPORT: ViewportSize = {"width": 1280, "height": 720}  # BrowserGym's default, so both screenshot the same size
BROWSERGYM_VENV = Path(__file__).resolve().parent / ".venv-browsergym"
BROWSERGYM_PACKAGES = ["browsergym-miniwob==0.14.3"]

Action = tuple[str, Any, Any]  # ("click", x, y) or ("type", text, None)


def action_sequence(task: str, steps: int) -> list[Action]:
    """A fixed sequence for a task: clicks over the task area (160x210 at the top left,
    where MiniWoB++ draws every task) and now and then typing, seeded by the task name."""
    rng = random.Random(task)
    return [("type", rng.choice(["hello", "Tokyo", "42"]), None) if rng.random() < 0.15
            else ("click", rng.randint(5, 155), rng.randint(55, 205)) for _ in range(steps)]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serve_miniwob() -> Iterator[str]:
    """The miniwob package's html folder on loopback; yields the tasks' base URL."""
    import miniwob

    html = Path(miniwob.__file__).parent / "html"
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/miniwob/"
    finally:
        server.shutdown()
        server.server_close()


def episodes(steps: int, episode_len: int) -> list[tuple[str, list[Action]]]:
    """(task, actions) per episode: every task's sequence cut into episodes."""
    out = []
    for task in TASKS:
        seq = action_sequence(task, steps)
        out += [(task, seq[i:i + episode_len]) for i in range(0, steps, episode_len)]
    return out


def summary(total_steps: int, wall_s: float, resets: list[tuple[float, bool]]) -> dict[str, float]:
    """Steps/s, and the median and 90th percentile of the resets' seconds (each with whether it loaded the page)."""
    seconds = [s for s, _ in resets]
    loads = [s for s, loaded in resets if loaded]
    return {"steps_per_s": total_steps / wall_s, "reset_s": statistics.median(seconds),
            "reset_p90_s": statistics.quantiles(seconds, n=10)[-1] if len(seconds) > 1 else seconds[0],
            "load_s": statistics.median(loads) if loads else float("nan")}


# --- the bare loop ------------------------------------------------------------------------


def start_script(seed: int) -> str:
    """The bare loop's episode start: the seeded problem, and the START cover an ended episode shows made inert
    as the pool's MiniWoBEnv makes it (`_KEEP_THE_END`); else a click after the end starts an unseeded problem,
    work the pool's steps do not do."""
    return f"Math.seedrandom({seed}); core.startEpisodeReal(); {_KEEP_THE_END}"


async def _bare(base: str, work: list[tuple[str, list[Action]]], contexts: int) -> dict[str, float]:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        queue: asyncio.Queue[tuple[int, tuple[str, list[Action]]]] = asyncio.Queue()
        for item in enumerate(work):
            queue.put_nowait(item)
        resets: list[tuple[float, bool]] = []

        async def worker() -> None:
            context = await browser.new_context(viewport=VIEWPORT)
            page = await context.new_page()
            cdp = await context.new_cdp_session(page)

            async def observe() -> None:
                await asyncio.gather(cdp.send("Page.captureScreenshot", {"format": "png"}),
                                     cdp.send("Accessibility.getFullAXTree"))

            shown = None
            while not queue.empty():
                seed, (task, actions) = queue.get_nowait()
                t0 = time.perf_counter()
                load = task != shown or task not in DEFAULT_TASKS
                if load:
                    await page.goto(base + task + ".html")
                    shown = task
                else:
                    await page.evaluate("core.endEpisode(0)")
                await page.evaluate(start_script(seed))
                await observe()
                resets.append((time.perf_counter() - t0, load))
                for kind, a, b in actions:
                    if kind == "click":
                        await page.mouse.click(a, b)
                    else:
                        await page.keyboard.type(a)
                    await observe()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(contexts)))
        wall = time.perf_counter() - t0
        await browser.close()
    return summary(sum(len(a) for _, a in work), wall, resets)


def bare_loop(base: str, work: list[tuple[str, list[Action]]], contexts: int) -> dict[str, float]:
    return asyncio.run(_bare(base, work, contexts))


# --- ours ------------------------------------------------------------------------------------


def env_pool(base: str, work: list[tuple[str, list[Action]]], contexts: int) -> dict[str, float]:
    """The steps as the episode recorder makes them: MiniWoBEnv's reset, then each step's target element,
    action and observation."""
    resets: list[tuple[float, bool]] = []

    def episode(env: BrowserEnv, item: tuple[int, tuple[str, list[Action]]]) -> None:
        seed, (task, actions) = item
        url = f"{base}{task}.html?seed={seed}"
        miniwob = MiniWoBEnv(env)
        load = not miniwob.restarts(url)
        t0 = time.perf_counter()
        miniwob.reset(f"bench-{seed}", url)
        env.observe()
        resets.append((time.perf_counter() - t0, load))
        for kind, a, b in actions:
            action = {"type": "click", "x": a, "y": b} if kind == "click" else {"type": "type", "text": a}
            if kind == "click":
                env.element_at(a, b)
            error = env.act(action)
            assert error is None, error
            env.observe()

    with EnvPool(contexts, viewport="desktop") as pool:
        for env in pool.envs:
            env.resize(VIEWPORT["width"], VIEWPORT["height"])
        t0 = time.perf_counter()
        pool.map(episode, list(enumerate(work)))
        wall = time.perf_counter() - t0
    return summary(sum(len(a) for _, a in work), wall, resets)


# --- BrowserGym ------------------------------------------------------------------------------

# Runs inside BrowserGym's venv: reads the work as JSON on stdin, prints a summary as JSON.
_BROWSERGYM_LOOP = textwrap.dedent("""
    import json, statistics, sys, time
    import gymnasium as gym
    import playwright.sync_api._generated as generated
    import browsergym.miniwob  # registers the environments
    from browsergym.core.action.highlevel import HighLevelActionSet

    spec = json.load(sys.stdin)
    launch = generated.BrowserType.launch

    def launch_debian_chromium(self, *args, **kwargs):
        # BrowserGym's pw_chromium_kwargs misses the second browser it starts and cannot take args.
        kwargs.update(executable_path=spec["chromium"], args=spec["args"])
        return launch(self, *args, **kwargs)

    generated.BrowserType.launch = launch_debian_chromium
    mapping = HighLevelActionSet(subsets=["coord"], strict=False, multiaction=False).to_python_code
    resets, steps, env, env_task = [], 0, None, None
    t0 = time.perf_counter()
    for task, actions in spec["work"]:
        if task != env_task:  # one env per task, as BrowserGym's environments are
            if env is not None:
                env.close()
            env, env_task = gym.make(f"browsergym/miniwob.{task}", slow_mo=0, pre_observation_delay=0,
                                     action_mapping=mapping, viewport=spec["viewport"]), task
        r0 = time.perf_counter()
        env.reset(seed=0)
        resets.append(time.perf_counter() - r0)
        for kind, a, b in actions:
            env.step(f"mouse_click({a}, {b})" if kind == "click" else f"keyboard_type({json.dumps(a)})")
            steps += 1
    wall = time.perf_counter() - t0
    env.close()
    print(json.dumps({"steps_per_s": steps / wall, "reset_s": statistics.median(resets),
                      "reset_p90_s": statistics.quantiles(resets, n=10)[-1] if len(resets) > 1 else resets[0]}))
""")


def browsergym_python() -> Path:
    """BrowserGym's venv interpreter, created with pip on first use."""
    python = BROWSERGYM_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {BROWSERGYM_VENV} (pip install {' '.join(BROWSERGYM_PACKAGES)}) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(BROWSERGYM_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *BROWSERGYM_PACKAGES], check=True)
    return python


def browsergym(base: str, work: list[tuple[str, list[Action]]]) -> dict[str, float]:
    spec = {"work": work, "chromium": str(CHROMIUM), "args": CHROMIUM_ARGS, "viewport": VIEWPORT}
    done = subprocess.run([str(browsergym_python()), "-c", _BROWSERGYM_LOOP], input=json.dumps(spec),
                          capture_output=True, text=True, env={**os.environ, "MINIWOB_URL": base}, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"BrowserGym's loop failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per task (5 tasks)")
    parser.add_argument("--episode-len", type=int, default=20, help="steps between resets")
    parser.add_argument("--browsergym-steps", type=int, default=40,
                        help="steps per task for BrowserGym (a prefix of the same sequences; it is slow)")
    parser.add_argument("--no-browsergym", action="store_true", help="skip BrowserGym (no venv needed)")
    args = parser.parse_args()
    work = episodes(args.steps, args.episode_len)
    rows: list[tuple[str, int, int, dict[str, float]]] = []
    with serve_miniwob() as base:
        for contexts in (1, 2, 4):
            rows.append(("bare loop (CDP screenshot + AX tree)", contexts, args.steps,
                         bare_loop(base, work, contexts)))
            rows.append(("trajforge EnvPool", contexts, args.steps, env_pool(base, work, contexts)))
        if not args.no_browsergym:
            rows.append(("BrowserGym MiniWoB++ (no delays)", 1, args.browsergym_steps,
                         browsergym(base, episodes(args.browsergym_steps, args.episode_len))))

    print(f"\n{len(TASKS)} MiniWoB++ tasks ({', '.join(TASKS)}), a reset every {args.episode_len} steps, "
          f"viewport {VIEWPORT['width']}x{VIEWPORT['height']}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(f"{'loop':40} {'contexts':>8} {'steps/task':>10} {'steps/s':>8} {'reset med':>9} {'reset p90':>9} "
          f"{'load med':>9}")
    for name, contexts, steps, r in rows:
        print(f"{name:40} {contexts:>8} {steps:>10} {r['steps_per_s']:>8.1f} "
              f"{r['reset_s']:>8.3f}s {r['reset_p90_s']:>8.3f}s {r.get('load_s', r['reset_s']):>8.3f}s")
    ours = {c: r for name, c, _, r in rows if name.startswith("trajforge")}
    bare = {c: r for name, c, _, r in rows if name.startswith("bare")}
    gym = next((r for name, _, _, r in rows if name.startswith("BrowserGym")), None)
    print(f"\n{'contexts':>8} {'ours / bare loop':>17}" + (f" {'ours / BrowserGym':>18}" if gym else ""))
    for c in ours:
        line = f"{c:>8} {ours[c]['steps_per_s'] / bare[c]['steps_per_s']:>17.2f}"
        if gym:
            line += f" {ours[c]['steps_per_s'] / gym['steps_per_s']:>18.1f}"
        print(line)
    ratio = ours[4]["steps_per_s"] / bare[4]["steps_per_s"]
    resets = ", ".join(f"{ours[c]['reset_s']:.3f} s with {c} (loads alone {ours[c]['load_s']:.3f} s)" for c in ours)
    print(f"\ntarget: ours / bare loop >= 0.9 with 4 contexts -> {ratio:.2f}; reset median < 0.25 s -> {resets}")
    if gym:
        print(f"\nreset: ours {ours[1]['reset_s']:.3f}s vs BrowserGym {gym['reset_s']:.3f}s "
              f"({gym['reset_s'] / ours[1]['reset_s']:.1f}x faster)")


if __name__ == "__main__":
    main()

"""MiniWoB++ from the `miniwob` package: its HTML tasks served on loopback, as environments.

Each task page generates a problem from a seed and scores the episode with its own
JavaScript reward (`core.endEpisode`). A query names the task and the seed; the reset
loads the task (or restarts it in place, as the miniwob package's own environment does),
seeds the generator and starts the episode, so the same query always shows the same
problem; the checker reads the page's reward, not the screen.
MiniWoB's default 10-second episode limit is lifted (`max_time_s`): a model-driven
policy thinks for longer than a human, and a time-out would label the task, not the
agent.
"""

from __future__ import annotations

import functools
import http.server
import json
import logging
import threading
from collections import Counter
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from playwright.async_api import Error as PlaywrightError
from pydantic import ValidationError

from trajforge.envs.browser import BrowserEnv, EnvFault
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import Query

logger = logging.getLogger(__name__)

APP = "miniwob"
"""The app name of every MiniWoB++ query: the suite is one kind, its tasks the queries' paths."""

# Tasks that a pixel-level agent can do on one screen without timing tricks; the
# default query set (30+ tasks of clicking, typing, choosing, forms and navigation).
DEFAULT_TASKS: tuple[str, ...] = (
    "click-button", "click-button-sequence", "click-checkboxes", "click-checkboxes-soft",
    "click-collapsible", "click-collapsible-2", "click-dialog", "click-dialog-2", "click-link",
    "click-menu-2", "click-option", "click-pie", "click-scroll-list", "click-shades", "click-shape",
    "click-tab", "click-tab-2-easy", "click-test", "click-test-2", "click-widget", "choose-list",
    "enter-date", "enter-password", "enter-text", "enter-text-2", "enter-time", "focus-text",
    "focus-text-2", "login-user", "navigate-tree", "search-engine", "social-media", "use-spinner",
    "email-inbox", "multi-layouts", "read-table",
)

_STATE_JS = """() => ({reward: WOB_REWARD_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL,
  done: WOB_DONE_GLOBAL, reason: WOB_REWARD_REASON, utterance: core.getUtterance()})"""


_END_AND_FORGET = """core.endEpisode(0); core.wob_latest = "-"; core.wob_scores = []; WOB_EPISODE_ID = 0;
  document.getElementById("reward-display").innerHTML = core.DISPLAY_HTML;"""
"""Ends the episode under way (nothing when it ended itself) and empties the reward display beside the task
(last reward, average, episodes done), which a loaded page shows empty: a restarted page showed the last
episodes' rewards in its screenshot and accessibility tree."""


_KEEP_THE_END = "core.cover_div.onclick = null;"
"""An ended task shows MiniWoB++'s START cover, whose click starts a new, unseeded problem and clears the reward.
The episode goes on until the policy terminates and the checker reads the state after its last step, so a click
after the end undid a solved task's reward, or earned one on a problem the query did not ask. The cover stays
(the screen says the task ended); its click does nothing, and the first ending stands (`core.endEpisode` rewards
once). A reset starts the next problem itself (`core.startEpisodeReal`)."""


_IMAGES_READY = """async () => {
  const url = /url\\("([^"]+)"\\)/g, shown = new Set(), named = new Set();
  for (const img of document.images) shown.add(img.currentSrc || img.src);
  for (const element of document.querySelectorAll("*")) {
    const style = getComputedStyle(element);
    for (const value of [style.backgroundImage, style.content, style.listStyleImage])
      for (const m of value.matchAll(url)) shown.add(m[1]);
  }
  for (const sheet of document.styleSheets) {
    let rules;
    try { rules = sheet.cssRules; } catch { continue; }  // another origin's sheet: not readable
    for (const rule of rules)
      for (const m of rule.cssText.matchAll(url)) named.add(new URL(m[1], sheet.href || location.href).href);
  }
  const load = src => {
    const img = new Image(), loaded = new Promise(done => { img.onload = img.onerror = done; });
    img.src = src;
    return loaded;
  };
  for (const src of named) if (!shown.has(src) && !src.startsWith("data:")) load(src);
  const waits = [...shown].filter(src => src && !src.startsWith("data:")).map(load);
  await Promise.race([Promise.all(waits), new Promise(done => setTimeout(done, 2000))]);
}"""
"""Waits until the images the task's page shows have arrived (`<img>` sources, backgrounds, `content: url(...)`;
at most 2 s, as a local server answers in milliseconds; one that fails is skipped), and starts loading the others
its stylesheets name (hover variants, icons of views a step opens). A task builds its problem after the load
event, and an element's image is fetched only when the element is first styled, so the first observation of a
loaded task was sometimes taken before it arrived (click-dialog's close icon, email-inbox's and social-media's
buttons: about 1 to 3 loads in 100 on 2 cores, and every time with the images served 0.4 s late). Once loaded
they are in the browser's memory cache, and later steps and restarts paint them at once."""


class MiniWoBError(ValueError):
    """A task that the installed miniwob package does not have, or a malformed task URL."""


def html_dir() -> Path:
    try:
        import miniwob
    except ImportError:
        raise MiniWoBError("MiniWoB++ needs the miniwob package: pip install miniwob") from None
    return Path(miniwob.__file__).parent / "html"


def known_tasks() -> list[str]:
    return sorted(p.stem for p in (html_dir() / "miniwob").glob("*.html"))


def check_tasks(tasks: list[str]) -> None:
    unknown = sorted(set(tasks) - set(known_tasks()))
    if unknown:
        raise MiniWoBError(f"unknown MiniWoB++ task(s) {unknown}; the miniwob package has {len(known_tasks())}")


class MiniWoBServer:
    """The package's html folder served read-only on 127.0.0.1 (a free port)."""

    def __init__(self, port: int = 0) -> None:
        handler = functools.partial(_QuietHandler, directory=str(html_dir()))
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def task_url(self, task: str, seed: int) -> str:
        return f"{self.base_url}/miniwob/{task}.html?seed={seed}"

    def __enter__(self) -> MiniWoBServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """Request lines would flood the rollout's log."""


def task_and_seed(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    seeds = parse_qs(parts.query).get("seed")
    if not parts.path.startswith("/miniwob/") or not parts.path.endswith(".html") or not seeds:
        raise MiniWoBError(f"not a MiniWoB++ task URL with a seed: {url!r}")
    return parts.path.removeprefix("/miniwob/").removesuffix(".html"), int(seeds[0])


class MiniWoBEnv:
    """A BrowserEnv on MiniWoB++ pages: seeded reset, and the page's reward as the app state."""

    def __init__(self, env: BrowserEnv, *, max_time_s: float = 600.0) -> None:
        self.env = env
        self.max_time_ms = int(max_time_s * 1000)

    def reset(self, session_id: str, start_url: str | None = None) -> str:
        """Seed the task's generator and start the episode; returns the utterance.

        A default task whose page is loaded already restarts in place, as MiniWoB++'s own library resets
        (the episode ended, the reward display emptied): 42 ms against a load's 252 ms at 4 contexts. The page
        then shows what a load shows (tests/test_miniwob.py checks every default task). Either way the reset
        returns once the images the problem shows have arrived (`_IMAGES_READY`; 8 ms more a load, at the
        median of one context, and nothing a restart). Other tasks are loaded each time: some
        keep state a restart does not put back (drag-cube's rotation, scroll-text's scroll, book-flight's
        widgets, 2026-12-01), as does any page after a fault.
        """
        url = start_url or self.env.start_url or ""
        _, seed = task_and_seed(url)
        start = f"""Math.seedrandom({seed}); core.EPISODE_MAX_TIME = {self.max_time_ms};
                    core.startEpisodeReal(); {_KEEP_THE_END} await ({_IMAGES_READY})(); return core.getUtterance();"""
        if self.restarts(url):
            utterance = self.env.restart(url, f"async () => {{ {_END_AND_FORGET} {start} }}")
        else:
            utterance = self.env.reset(session_id, url, app_protocol=False, script=f"async () => {{ {start} }}")
        # The natural-language variants (email-inbox-nl-turk, ...) wrap it with the answer's fields outside
        # their 'test' data mode: {"utterance": ..., "fields": ...}; the fields are the solution, not the task.
        return utterance["utterance"] if isinstance(utterance, dict) else utterance

    def restarts(self, url: str) -> bool:
        """Whether `reset` on `url` restarts the page in place rather than loading it: a default task whose
        page the env shows, with no fault since."""
        task, _ = task_and_seed(url)
        return task in DEFAULT_TASKS and self.env.shows_document(url)

    def app_state(self) -> dict[str, Any]:
        """The episode's reward as the page's JavaScript computed it. Through the env's own call, so a closed
        page or a hung renderer is an EnvFault within the action deadline, as every other env call is."""
        return self.env.evaluate(_STATE_JS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def check_reward(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """Success when the page ended the episode with a positive raw reward."""
    if not state.get("done"):
        return False, "the task did not end: no reward"
    raw = state.get("raw_reward", 0)
    reason = f" ({state['reason']})" if state.get("reason") else ""
    return raw > 0, f"reward {raw:g}{reason}"


def miniwob_queries(
    tasks: list[str], seeds: list[int], *, run_id: str, max_steps: int, chromium: Path
) -> tuple[list[Query], Counter[str]]:
    """One query per (task, seed); the instruction is the utterance that seed generates. A problem that cannot
    be made (its page fails to load or start, its utterance is no instruction) is dropped with the reason, and
    the other tasks go on."""
    check_tasks(tasks)
    generator = f"miniwob@{version('miniwob')}"
    now = datetime.now(timezone.utc)
    rows: list[Query] = []
    dropped: Counter[str] = Counter()
    with MiniWoBServer() as server:
        env = MiniWoBEnv(BrowserEnv(viewport="desktop", chromium=chromium))
        try:
            for task in tasks:
                for seed in seeds:
                    try:
                        utterance = env.reset(f"{task}-{seed}", server.task_url(task, seed))
                        rows.append(Query(
                            run_id=run_id,
                            query_id=short_id(APP, task, str(seed)),
                            app=APP,
                            source="miniwob",
                            instruction=utterance,
                            path=[task],
                            slots_json=json.dumps({"seed": seed}),
                            checker="reward",
                            checker_params_json=json.dumps({"task": task, "seed": str(seed)}),
                            max_steps=max_steps,
                            generator=generator,
                            created_at=now,
                        ))
                    except (EnvFault, PlaywrightError, ValidationError) as exc:
                        reason = str(exc).strip().splitlines()[0][:160]
                        logger.warning("MiniWoB++ task %s seed %s dropped: %s", task, seed, reason)
                        dropped[f"miniwob task {task}: {reason}"] += 1
        finally:
            env.close()
    return rows, dropped

"""A headless Chromium environment: screenshots and accessibility trees in, pixel actions out.

Playwright's sync API allows one driver per thread and blocks that thread on every
call, so N parallel environments would need N drivers and N browsers. Instead a
`BrowserHost` runs one async Playwright driver and one Chromium (Debian's, never a
downloaded one) on an asyncio loop in a thread of its own; every `BrowserEnv` is one
browser context on it, and its methods are plain blocking calls from any thread. Calls
of different envs overlap on the loop: while one waits for a frame to screenshot,
another clicks.

A reset reuses the env's page (about 0.15 s; a new context costs 0.2-0.5 s and a new
browser seconds, shared/FACTS.md) and clears what could leak between episodes:
cookies, storage of the origins visited, history. The observation's three CDP calls
(screenshot, accessibility tree, DOM snapshot for element boxes) run concurrently on a
persistent CDP session, so the tree and the boxes cost almost nothing beside the
screenshot's wait for a frame.

Failures are split in two. An action the agent got wrong (unknown type, a point off
the screen, a key that does not exist) is returned by `act` as an error string: it is
data for the step row. A failure of the browser or the app (crash, timeout, server
down) raises `EnvFault` with its kind: the episode is not the agent's to blame, and the
env recovers at the next reset (a new context, and a new browser if it died).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar
from urllib.parse import urlsplit

from playwright._impl._async_base import AsyncBase  # the base of every async API object
from playwright.async_api import (
    Browser,
    BrowserContext,
    CDPSession,
    Page,
    Response,
    async_playwright,
)
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

from trajforge.envs import actions, secrets
from trajforge.envs.apps import SESSION_COOKIE
from trajforge.envs.axtree import AXNode, Box, Element, Layout, PixelBox, cdp_value, from_cdp, render

T = TypeVar("T")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium tries to reach the internet and fails noisily (FACTS.md).
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # One renderer per context's site instead of one per site and frame: a replay of 8 shop queries at 4
    # contexts (a page load every step) took 15.0 s instead of 17.3 s, with 9 renderer processes at most
    # instead of 11 (2 cores, 2026-11-27). The pages are ours or the user's own app, in a headless browser
    # already run without its sandbox, so the isolation bought nothing here.
    "--disable-site-isolation-trials",
    # A changed tile is rastered whole, not only its damaged part over the old pixels: with partial raster (and
    # a tap's :active waited out, `BrowserEnv._until_released`), two replays of the same 67 shop and settings
    # steps differed in 3 screenshots, by one level at anti-aliased edges (a screen's pixels depended on what it
    # was painted over); without it, in none of 3 pairs, at the same wall time (55-56 s against 59 s). Each
    # differing screen was one more for OCR, grounding and the response cache's keys.
    "--disable-partial-raster",
]

VIEWPORTS: dict[str, dict[str, Any]] = {
    "mobile": {"viewport": {"width": 412, "height": 915}, "is_mobile": True, "has_touch": True,
               "device_scale_factor": 1},
    "desktop": {"viewport": {"width": 1280, "height": 800}, "is_mobile": False, "has_touch": False,
                "device_scale_factor": 1},
}
"""Device scale factor 1 everywhere, so screenshot pixels are CSS pixels and action
coordinates need no conversion."""

INTERACTIVE_ROLES = {
    "button", "link", "checkbox", "radio", "textbox", "searchbox", "combobox", "spinbutton", "slider",
    "switch", "tab", "menuitem", "menuitemcheckbox", "menuitemradio", "option", "listbox", "treeitem",
}
_HIDE_CARET = """(() => {
  const add = () => {
    const style = document.createElement("style");
    style.textContent = "* { caret-color: transparent !important; }";
    document.documentElement.appendChild(style);
  };
  if (document.documentElement) add(); else document.addEventListener("readystatechange", add, { once: true });
})();"""
"""Run in every page: a text caret is not painted. It blinks every half second, so two screenshots of one
focused field differed by when they were taken (8 captures 0.27 s apart gave 2 distinct PNGs), and with
them the OCR, the response cache's keys and a rerun's answers (CI: an embedded-model rerun asked the
model again from its second step on). Playwright's own screenshots hide it the same way; which element
has focus stays in the accessibility tree."""
_FIT_DEVICE_WIDTH = """(() => {
  const fit = () => {
    if (document.querySelector('meta[name="viewport" i]')) return;
    const meta = document.createElement("meta");
    meta.name = "viewport";
    meta.content = "width=device-width, initial-scale=1";
    (document.head || document.documentElement).appendChild(meta);
  };
  if (document.readyState !== "loading") fit(); else document.addEventListener("DOMContentLoaded", fit, { once: true });
})();"""
"""Run in every page of the mobile viewport: a page that declares no viewport is laid out at the device's width,
as if it declared `width=device-width`. Chromium's mobile emulation lays such a page out 980 px wide and shows it
zoomed out (a MiniWoB++ task: scale 0.42), so the screenshot was scaled while the tree's boxes, the targets, the
input events and the boxes a secret is covered with stayed in CSS pixels: a click where the screenshot showed the
button missed it, and a typed secret's cover missed the field. A page whose own viewport asks for a wider layout
keeps it, and is shown zoomed out: `rollout.viewport: desktop` suits such a page."""
_INVALID_BINDING = "__trajforgeInvalid"
_REPORT_INVALID = f"""(() => {{
  let checking = 0;
  for (const C of [HTMLFormElement, HTMLFieldSetElement, HTMLInputElement, HTMLSelectElement, HTMLTextAreaElement,
                   HTMLButtonElement, HTMLObjectElement, HTMLOutputElement, window.ElementInternals]) {{
    const check = C?.prototype.checkValidity;
    if (!check) continue;
    C.prototype.checkValidity = function () {{
      checking++;
      try {{ return check.call(this); }} finally {{ checking--; }}
    }};
  }}
  document.addEventListener("invalid", () => {{ if (!checking) window.{_INVALID_BINDING}?.(""); }}, true);
}})();"""
"""Run in every page: a form control that fails its constraints (a required field left empty when its form is
submitted, or a script's `reportValidity()`) tells the env, which then waits out the browser's validation bubble
(`VALIDATION_BUBBLE_S`). A script's `checkValidity()` fires the same `invalid` events and shows no bubble (a form
that enables its button as it is filled calls it on every key), so the events it fires are not told."""
VALIDATION_BUBBLE_S = 1.5
"""How long after a failed form submission the next observation is taken. Chromium fades its "Please fill out
this field." bubble in over about a second: the writer's Share dialog submitted empty, six times, was captured
as 6 different PNGs 0.8 s after the click, 2 at 1.0 s and 1 at 1.3 and 2.0 s; captured at once, it was a
faint ghost of the bubble that the accessibility tree already names (an alert), 5 times out of 6 the same."""
RECORDER_BINDING = "__trajforgeReport"
"""The function `add_recorder` gives every page: the interaction recorder (envs/apps/_shared/static/interactions.js)
calls it with its reports where it exists."""
# Storage an app may keep in the browser; the HTTP cache is not app state and stays warm.
_APP_STORAGE = "local_storage,indexeddb,websql,cache_storage,service_workers,file_systems"
_UNTIL_RELEASED = """new Promise(done => {
  let polls = 0;
  const poll = () => (!document.querySelector(":active") || ++polls >= 30) ? done() : setTimeout(poll, 30);
  poll();
})"""
"""Resolves once nothing is :active, or after 30 polls 0.03 s apart (the observation goes ahead anyway)."""
_SCREENSHOT_TRIES = 4
"""Captures asked for before "Unable to capture screenshot" is a fault (`BrowserEnv._screenshot`)."""
# How a dead server shows in Playwright's and Chromium's errors.
_SERVER_DOWN = ("ECONNREFUSED", "ECONNRESET", "ERR_CONNECTION_REFUSED", "ERR_CONNECTION_RESET",
                "ERR_EMPTY_RESPONSE", "ERR_CONNECTION_CLOSED", "socket hang up")

FaultKind = Literal["browser_crash", "timeout", "app_down", "other"]


async def _nothing() -> None:
    """An awaitable with no work, for a slot of `asyncio.gather` that has no call to make."""


async def _send_raw(cdp: CDPSession, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """`cdp.send` without Playwright's result mapping, for the observation's large answers.

    The public `CDPSession.send` copies every answer through Playwright's impl-to-API mapping, a recursive walk of
    the whole dict: for the accessibility tree, the DOM snapshot and the screenshot that was a quarter of this
    process's CPU in the env pool (py-spy --gil, env_bench at 4 contexts: 4.9 ms of Python per step without the
    mapping against 5.8 with it, 2026-11-28). A CDP answer is plain JSON with nothing to map, so it is taken from
    the object under the API (Playwright's own private layer: pyproject pins the minor version this was read
    against). Errors are the same class either way (`playwright.async_api.Error` is the impl's)."""
    answer: dict[str, Any] = await cdp._impl_obj.send(method, params, None)
    return answer


class EnvFault(RuntimeError):
    """The browser or the app failed, not the agent: browser_crash (the browser or the
    page's renderer died, or its context was closed), timeout (a navigation or a call did
    not finish in time), app_down (the app's server refused, dropped or failed a request)
    or other."""

    def __init__(self, message: str, kind: FaultKind = "other") -> None:
        # Masked (`secrets.mask`): a message names the page's live URL, where a form sent by GET carries what was
        # typed, and it reaches the episode's `fault`, a dropped row's reason and the log.
        super().__init__(secrets.mask(message))
        self.kind: FaultKind = kind


def _origin_of(url: str) -> str:
    """`url`'s origin as the env compares them: scheme and host with its port, as written."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def recorded_url(url: str, origin: str | None) -> str:
    """A page's URL as observations (and so every row) keep it: on `origin`, the origin the env was last reset on,
    its path, query and fragment ("/search?q=pizza"); elsewhere the whole URL. A bundled app answers on a new
    port every night, so the whole URL of the same page differed between nights: agentic-Q's states never
    matched across them, and the port reached the critics' and guidance's prompts."""
    if origin and (url == origin or url.startswith(origin + "/")):
        return url[len(origin):] or "/"
    return url


@dataclass(frozen=True)
class Observation:
    """What a policy sees: the screenshot (PNG) and the page's accessibility tree with boxes."""

    png: bytes
    width: int
    height: int
    url: str
    """`recorded_url`: the path on the app's origin, the whole URL elsewhere (env.url is the live page's)."""
    title: str
    nodes: tuple[AXNode, ...]
    """The accessibility tree, in document order: what live code reads."""
    focused: Element | None = None
    """The focused element, when it is not the page itself: a `type` or `key` action's target."""
    ax_tree: str = field(init=False, repr=False)
    """`nodes` as text (`axtree.render`), derived so the two cannot disagree: what prompts and step rows hold."""

    def __post_init__(self) -> None:
        # What the data keeps has secrets masked (`secrets.mask`): a form sent by GET puts what was typed in the
        # URL, and a secret typed into a field that is not a password field (a key, a one-time code) is in the
        # tree as that field's value and wherever the page echoes it, and so on the screenshot, where the
        # boxes of those nodes are covered. A secret shown in pieces (split by markup, typed a character a box)
        # is masked piece by piece (`secrets.mask_pieces`). `nodes` and `focused` are masked too: a policy
        # names what it sees (the random policy's thought, a model's click target, the step's target) and query
        # generation writes the names it crawls into queries.
        object.__setattr__(self, "url", secrets.mask(self.url))
        object.__setattr__(self, "title", secrets.mask(self.title))
        # Field by field, never the rendered text: a digit-only secret (a PIN) would also match inside a box's
        # numbers, or a heading's level, and leave a tree `axtree.parse` cannot read. A node's name and value are
        # the only page text a line holds (its role and states are Chromium's words, a link's URL is not shown).
        names, named = secrets.mask_pieces([n.name for n in self.nodes])
        values, valued = secrets.mask_pieces([n.value for n in self.nodes])
        held = secrets.holding(names + values)  # a node's name at its index, its value at index + len(nodes)
        showing = named | valued | {i % len(self.nodes) for i in held}
        if showing:  # rare: only then are the screenshot and the nodes touched
            object.__setattr__(self, "png", secrets.cover(self.png, self._secret_boxes(showing)))
            if self.focused is not None:  # its name as its node's, where a piece of a secret was masked there
                pieced = {n.name: names[i] for i, n in enumerate(self.nodes) if i in named}
                name = pieced.get(self.focused.name, self.focused.name)
                object.__setattr__(self, "focused", replace(self.focused, name=secrets.mask(name)))
            nodes = tuple(replace(n, name=secrets.mask(names[i]), value=secrets.mask(values[i])) if i in showing else n
                          for i, n in enumerate(self.nodes))
            object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "ax_tree", render(self.nodes))

    def _secret_boxes(self, showing: set[int]) -> list[PixelBox]:
        """The boxes of the nodes whose text shows a secret, or a piece of one (the indices in `showing`). A node
        without a box of its own that shows anything (text the tree holds apart from the layout, or a visually
        hidden field of zero size, as a one-time-code input can be) is covered by its closest ancestor that has
        one, and with none, the whole screenshot is: a secret is never left on it for want of a place."""
        boxes: list[PixelBox] = []
        path: list[AXNode] = []  # the node's ancestors, closest last
        for i, node in enumerate(self.nodes):
            del path[node.depth:]
            if i in showing:
                box = next((n.box for n in reversed([*path, node]) if n.box is not None and n.box[2] > 0
                            and n.box[3] > 0), (0, 0, self.width, self.height))
                boxes.append(box)
            path.append(node)
        return boxes

    def targets(self) -> list[Target]:
        """The named interactive elements whose centre is on the screen, in document order: what a click can
        hit and a policy can name."""
        return screen_targets(self.nodes, self.width, self.height)


class Target(NamedTuple):
    """An on-screen interactive element: its role, accessible name and centre in screenshot pixels."""

    role: str
    name: str
    x: int
    y: int


def screen_targets(nodes: Iterable[AXNode], width: int, height: int) -> list[Target]:
    """The named interactive elements of `nodes` whose centre is on a `width` x `height` screen and not covered
    by another element, in document order: a live observation's, or a recorded step's parsed tree."""
    found = []
    for node in nodes:
        if node.role in INTERACTIVE_ROLES and node.name and node.box is not None and "covered" not in node.states:
            x, y, w, h = node.box
            if w > 0 and h > 0 and 0 <= x + w / 2 < width and 0 <= y + h / 2 < height:
                found.append(Target(node.role, node.name, int(x + w // 2), int(y + h // 2)))
    return found


WHOLE_SCREEN: PixelBox = (0, 0, 1 << 16, 1 << 16)
"""A box over any screenshot: what is covered where a secret shows and nothing says where."""


def secrets_off_the_tree(snapshot: dict[str, Any]) -> list[PixelBox]:
    """The boxes to cover where a DOMSnapshot shows a secret that the accessibility tree does not hold, so the
    tree's own masking (`Observation`) never sees it: the text of a frame's document (`getFullAXTree` reads the
    main frame only: a code typed into a payment or sign-in frame) and text the tree ignores (`aria-hidden`).
    A frame's text is covered by its frame element's box in the page. Only what is laid out is covered (a
    script's or a hidden input's text is not painted); a password field shows bullets and is left alone.

    Only the strings table is looked at unless it holds a secret, so a page without one costs one pass over it."""
    strings: list[str] = snapshot["strings"]
    if not (held := secrets.holding(strings)):
        return []
    documents = snapshot["documents"]
    owner: dict[int, tuple[int, int]] = {}  # a frame's document -> (the document, node) of its frame element
    laid_out: list[dict[int, tuple[float, float, float, float]]] = []  # per document: node -> its first box
    for d, doc in enumerate(documents):
        frames = doc["nodes"].get("contentDocumentIndex", {"index": [], "value": []})
        owner.update((child, (d, node)) for node, child in zip(frames["index"], frames["value"], strict=True))
        boxes: dict[int, tuple[float, float, float, float]] = {}
        for node, bounds in zip(doc["layout"].get("nodeIndex", []), doc["layout"].get("bounds", []), strict=True):
            boxes.setdefault(node, tuple(bounds))
        laid_out.append(boxes)
    main = documents[0]
    sx, sy = main.get("scrollOffsetX", 0), main.get("scrollOffsetY", 0)
    covers: set[PixelBox] = set()
    for d, doc in enumerate(documents):
        nodes = doc["nodes"]
        showing = [i for i, text in enumerate(nodes.get("nodeValue", [])) if text in held]
        for rare in ("inputValue", "textValue"):
            values = nodes.get(rare, {"index": [], "value": []})
            showing += [i for i, text in zip(values["index"], values["value"], strict=True)
                        if text in held and not _password_field(nodes, i, strings)]
        if not any(i in laid_out[d] for i in showing):
            continue
        places = [i for i in showing if i in laid_out[d]] if d == 0 else []
        frame = d
        while frame != 0 and frame in owner:  # the outermost frame element, in the page
            frame, element = owner[frame]
            places = [element]
        if frame != 0:  # a document no frame element of the page holds: where it shows is unknown
            return [WHOLE_SCREEN]
        for i in places:
            if (box := laid_out[0].get(i)) is not None and box[2] > 0 and box[3] > 0:
                x, y, w, h = box
                covers.add((int(x - sx), int(y - sy), int(w + 1), int(h + 1)))  # whole pixels over a fraction
    return sorted(covers)


def _password_field(nodes: dict[str, Any], index: int, strings: list[str]) -> bool:
    """Whether the DOMSnapshot node `index` is an <input type=password> (its value shown as bullets)."""
    attributes = nodes.get("attributes", [])
    pairs = attributes[index] if index < len(attributes) else []
    return any(strings[name].lower() == "type" and strings[value].lower() == "password"
               for name, value in zip(pairs[::2], pairs[1::2], strict=True))


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (no decoding)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


class BrowserHost:
    """One Chromium and the asyncio loop that drives it, on a thread of its own.

    `run` executes a coroutine on the loop and blocks the calling thread until it is
    done, so any number of threads can drive their envs at once. `browser()` relaunches
    Chromium when the last one died (a crash, a kill): a crash costs the episodes that
    were running, not the host.
    """

    def __init__(self, chromium: Path = CHROMIUM) -> None:
        if not Path(chromium).exists():
            raise FileNotFoundError(f"Chromium not found at {chromium} (apt-get install chromium)")
        self.chromium = Path(chromium)
        self._browser: Browser | None = None
        self._lock = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="browser-host", daemon=True)
        self._thread.start()
        try:
            self._playwright = self.run(async_playwright().start())
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the host's loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BrowserHost.run called from its own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def browser(self) -> Browser:
        """The live browser, launched on first use or after the last one died."""
        async with self._lock:
            if self._browser is None or not self._browser.is_connected():
                self._browser = await self._playwright.chromium.launch(
                    executable_path=str(self.chromium), args=CHROMIUM_ARGS)
            return self._browser

    def close(self) -> None:
        """Close the browser, stop the driver and the loop; safe to call twice."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            if self._browser is not None:
                with contextlib.suppress(PlaywrightError):  # already gone
                    await self._browser.close()
            await self._playwright.stop()

        try:
            self.run(stop())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BrowserHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Blocking:
    """A blocking view of an async Playwright object (page, context, locator...), for
    code outside the host's loop: tests and notebooks write `env.page.evaluate("scrollY")`."""

    def __init__(self, target: Any, host: BrowserHost) -> None:
        self._target, self._host = target, host

    def _wrap(self, value: Any) -> Any:
        return Blocking(value, self._host) if isinstance(value, AsyncBase) else value

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if inspect.iscoroutinefunction(value):
            return lambda *args, **kwargs: self._wrap(self._host.run(value(*args, **kwargs)))
        if callable(value):
            return lambda *args, **kwargs: self._wrap(value(*args, **kwargs))
        return self._wrap(value)


class BrowserEnv:
    """One browser context with a fixed viewport, driven by pixel actions of the viewport's space.

    `start_url` is where `reset` goes unless it is given another; `apps` maps app names
    to their start URLs for the `open` action. Without a `host` the env starts (and
    closes) its own; an `EnvPool` shares one host between its envs. The methods block
    and may be called from any thread, one call at a time per env. The browser context
    opens at the first `reset`.
    """

    def __init__(
        self,
        start_url: str | None = None,
        *,
        viewport: Literal["mobile", "desktop"] = "mobile",
        chromium: Path = CHROMIUM,
        action_timeout_s: float = 10.0,
        apps: dict[str, str] | None = None,
        host: BrowserHost | None = None,
        on_observe: Callable[[Observation], None] | None = None,
    ) -> None:
        if viewport not in VIEWPORTS:
            raise ValueError(f"unknown viewport {viewport!r}; known: {', '.join(VIEWPORTS)}")
        self.start_url = start_url
        self.viewport = viewport
        self.space = actions.space_for(viewport)
        self.apps = dict(apps or {})
        self.timeout_s = action_timeout_s
        self.on_observe = on_observe
        """Handed every observation made (query generation keeps the pages it explores this way)."""
        self.width = VIEWPORTS[viewport]["viewport"]["width"]
        self.height = VIEWPORTS[viewport]["viewport"]["height"]
        self._touch = VIEWPORTS[viewport]["has_touch"]
        self._own_host = host is None
        self._host = host or BrowserHost(chromium)
        self._context: BrowserContext | None = None
        self._page: Page | None = None
        self._cdp: CDPSession | None = None
        self._main_frame = ""
        self._nav_done = asyncio.Event()
        self._document: tuple[int, str] | None = None
        """The main frame's last document response: (HTTP status, URL)."""
        self._unreachable: str | None = None
        """The URL the main frame's last document failed to load (Chromium's error page shows); None after a load."""
        self._broken = False  # a fault happened: the next reset opens a new context
        self._origins: set[str] = set()  # origins the context visited, cleared at reset
        self._seen: tuple[list[dict[str, Any]], Layout, dict[str, str]] = ([], Layout(), {})
        """The last observation's CDP tree and layout, and the names it masked (`element_at`)."""
        self._origin: str | None = None
        self._home = "about:blank"
        self._closed = False
        self._recorder: str | None = None  # the script add_recorder runs in every page
        self._held = False  # a tap may still hold :active: the next observation waits it out (`_until_released`)
        self.validation_failed_at: float | None = None
        """When (monotonic) a form last failed validation with a bubble; the next observation waits it out."""
        self._reports: list[str] = []

    # --- running on the host's loop ---------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Run one env operation on the host; browser and app failures become EnvFault.

        The deadline covers CDP calls, which have no timeout of their own, plus the
        longest wait an action may ask for.
        """
        try:
            return self._host.run(asyncio.wait_for(coro, self.timeout_s + actions.MAX_SECONDS))
        except (PlaywrightError, TimeoutError, EnvFault) as exc:
            fault = self.fault(exc, what)
            if fault is exc:
                raise
            raise fault from exc

    def fault(self, exc: BaseException, what: str = "") -> EnvFault:
        """A failure of this env's browser or app as an EnvFault with its kind.

        For the env's own calls and for code that drives the page itself (a policy that
        reads it); the env opens a new context at the next reset.
        """
        self._broken = True
        if isinstance(exc, EnvFault) and exc.kind != "other":
            return exc
        text = str(exc) or type(exc).__name__
        message = f"{what} failed: {text.splitlines()[0]}" if what else text.splitlines()[0]
        if self._browser_died():  # first: a dead browser also times out and drops connections
            return EnvFault(message, "browser_crash")
        if isinstance(exc, (PlaywrightTimeoutError, TimeoutError)):
            return EnvFault(message, "timeout")
        if any(s in text for s in _SERVER_DOWN):
            return EnvFault(message, "app_down")
        if "closed" in text or "crash" in text:  # the page or context closed, the renderer crashed
            return EnvFault(message, "browser_crash")
        return EnvFault(message, "other")

    def _browser_died(self, grace_s: float = 3.0) -> bool:
        """Whether the browser is gone. A dying browser fails calls ("Unable to capture
        screenshot", "page closed") a moment before its disconnect arrives, so wait for
        that moment: a fault blamed on the wrong cause, or a rerun started on the dying
        browser, would follow. On two loaded cores the disconnect has been seen to take
        more than half a second; faults are rare, so waiting longer costs little."""
        deadline = time.monotonic() + grace_s
        while self._browser_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _browser_alive(self) -> bool:
        browser = self._context.browser if self._context is not None else None
        return browser is not None and browser.is_connected()

    async def _open(self) -> None:
        """A fresh context, page and CDP session on the host's live browser."""
        browser = await self._host.browser()
        options = {**VIEWPORTS[self.viewport], "viewport": {"width": self.width, "height": self.height}}
        self._context = await browser.new_context(**options)
        self._context.set_default_timeout(self.timeout_s * 1000)
        await self._context.add_init_script(script=_HIDE_CARET)
        await self._context.add_init_script(script=_REPORT_INVALID)
        if VIEWPORTS[self.viewport]["is_mobile"]:
            await self._context.add_init_script(script=_FIT_DEVICE_WIDTH)
        await self._install_recorder()
        self._page = await self._context.new_page()
        self._context.on("page", self._on_page)
        self._cdp = await self._context.new_cdp_session(self._page)
        # On this session, so the call arrives before `_settle`'s round trip on it answers; V8 gives a page the
        # binding only with the Runtime domain on (it installs bindings as it reports each new context).
        self._cdp.on("Runtime.bindingCalled", self._on_binding)
        await self._cdp.send("Runtime.addBinding", {"name": _INVALID_BINDING})
        await self._cdp.send("Runtime.enable")
        self._main_frame = (await self._cdp.send("Page.getFrameTree"))["frameTree"]["frame"]["id"]
        self._nav_done.set()
        # A page that dies while loading never finishes its navigation: stop waiting for it.
        self._page.on("close", lambda _: self._nav_done.set())
        self._page.on("crash", lambda _: self._nav_done.set())
        self._page.on("response", self._on_response)
        self._cdp.on("Page.frameRequestedNavigation", self._on_nav_requested)
        self._cdp.on("Page.frameNavigated", self._on_navigated)
        self._cdp.on("Page.loadEventFired", self._on_nav_done)
        self._cdp.on("Page.navigatedWithinDocument", self._on_nav_done)
        # Also fires after the load event, and when a navigation ends without a new
        # document (a 204, a download, a cancelled request): never wait for those.
        self._cdp.on("Page.frameStoppedLoading", self._on_nav_done)
        await self._cdp.send("Page.enable")
        self._origins = set()
        self._broken = False

    # Navigation tracking: a click or key that submits a form requests a navigation
    # before Playwright's input call returns; waiting for the next load event then costs
    # nothing when no navigation was requested (most typing, swipes, radio clicks).
    def _on_nav_requested(self, params: dict[str, Any]) -> None:
        if params.get("frameId") == self._main_frame:
            self._nav_done.clear()

    def _on_binding(self, params: dict[str, Any]) -> None:
        if params.get("name") == _INVALID_BINDING:
            self.validation_failed_at = time.monotonic()

    def _on_navigated(self, params: dict[str, Any]) -> None:
        frame = params["frame"]
        self._visited(frame.get("url", ""))
        if frame.get("id") == self._main_frame:
            self._unreachable = frame.get("unreachableUrl")

    def _on_page(self, page: Page) -> None:
        """Record the origins every other page of the context shows (a link to a new tab, an OAuth window): one
        that closed itself before the reset, as a sign-in popup does, left its origins' storage behind for the
        next episode, since only the env's own page is watched on CDP. Playwright hands a popup over once it
        has its first URL, and tells its later documents, a frame's too."""
        self._visited(page.url)
        page.on("framenavigated", lambda frame: self._visited(frame.url))

    def _visited(self, url: str) -> None:
        """Record `url`'s origin as one the episode visited, whose storage the next reset clears."""
        if urlsplit(url).scheme in ("http", "https"):
            self._origins.add(_origin_of(url))

    def _on_app(self, url: str | None) -> bool:
        """Whether `url`, where a page failed to load, is the app's: on the origin the env was reset on or on one
        that the `open` action launches. Elsewhere (a dead link to another site) the failure is the agent's
        page to see, not an env fault. Without a URL to tell, it is taken for the app's."""
        return url is None or _origin_of(url) in {self._origin, *map(_origin_of, self.apps.values())}

    def _on_response(self, response: Response) -> None:
        """Remember the main frame's last document answer: a page that loads with a server error is the app's
        fault, not the agent's (`_observe` raises it as one)."""
        if response.request.is_navigation_request() and self._page is not None \
                and response.frame == self._page.main_frame:
            self._document = (response.status, response.url)

    def _on_nav_done(self, params: dict[str, Any]) -> None:
        if params.get("frameId", self._main_frame) == self._main_frame:
            self._nav_done.set()

    async def _settle(self) -> None:
        # A click's form submission is scheduled in the renderer after the input event
        # returns; one renderer round trip (about 2-10 ms) lets its navigation request
        # arrive (10 of 10 caught, against 6 of 10 without it, desktop clicks).
        assert self._cdp is not None
        with contextlib.suppress(PlaywrightError):  # the document went away: a navigation, flagged
            await self._cdp.send("Runtime.evaluate", {"expression": "0"})
        try:
            await asyncio.wait_for(self._nav_done.wait(), self.timeout_s)
        except TimeoutError:
            self._nav_done.set()
            raise EnvFault(f"navigation did not finish within {self.timeout_s:g} s ({self.url})", "timeout") from None
        if self._page is None or self._page.is_closed():
            raise EnvFault("the page closed while loading", "browser_crash")

    # --- episode lifecycle ---------------------------------------------------------

    def reset(self, session_id: str, start_url: str | None = None, *, app_protocol: bool = True,
              script: str | None = None) -> Any:
        """Start a fresh session on the start page.

        Cookies and the storage of every origin the last episode visited are cleared,
        and the page's history forgotten, so Back cannot reach the last episode. With
        `app_protocol` (bundled apps) the app's session `tf_session=session_id` is reset
        on its server (`POST /__reset`); pass False for pages that are not bundled apps
        (MiniWoB++, any site), whose known state is the cleared browser. After a fault
        the env first replaces its context (and the browser, if it died).

        `script` (a JavaScript function of no argument, as `restart` takes) runs on the loaded page
        together with the history reset, in one round trip to the browser rather than two; its
        result is returned (None without one).
        """
        url = start_url or self.start_url
        if not url:
            raise ValueError("reset needs a start_url (none was given to BrowserEnv either)")
        return self._call(self._reset(session_id, url, app_protocol, script), "reset")

    async def _reset(self, session_id: str, url: str, app_protocol: bool, script: str | None) -> Any:
        # A user's app's recorder (`add_recorder`) stays on its context, and its binding would take the reports a
        # bundled app's page sends its own server: such an episode after one on a user's app gets a fresh context.
        stale_recorder = app_protocol and self._recorder is not None
        # A page the last episode opened (a link to a new tab, `window.open`) would stay open for the run, unseen by
        # the env, its origin's storage never cleared: such a context is replaced too.
        opened = self._context is not None and len(self._context.pages) > 1
        if stale_recorder or opened or self._broken or self._page is None or self._page.is_closed() \
                or not self._browser_alive() or not await self._clear_storage():
            if stale_recorder:
                self._recorder = None
            if self._context is not None:
                with contextlib.suppress(PlaywrightError):  # the old one is dead already
                    await self._context.close()
            await self._open()
        assert self._context is not None and self._page is not None and self._cdp is not None
        self._home, self._origin = url, _origin_of(url)
        self._origins = {self._origin}
        if app_protocol:
            await self._context.add_cookies([{"name": SESSION_COOKIE, "value": session_id, "url": self._origin}])
            response = await self._context.request.post(self._origin + "/__reset", timeout=self.timeout_s * 1000)
            if not response.ok:
                raise EnvFault(f"POST {self._origin}/__reset answered {response.status}", "app_down")
        self._document = None
        self._forget_episode()
        await self._page.goto(url, wait_until="load")
        # At once: the history reset does not touch the document, and each round trip waits behind the
        # other contexts' work (a load's reset at 4 contexts on 2 cores pays about four of them).
        _, result = await asyncio.gather(self._cdp.send("Page.resetNavigationHistory"),
                                         self._page.evaluate(script) if script is not None else _nothing())
        self._nav_done.set()
        return result

    def _forget_episode(self) -> None:
        """Drop what the env kept of the last episode's page, for a reset and a restart alike."""
        self._reports = []
        self._held = False  # the new document holds nothing
        self.validation_failed_at = None  # nor shows a validation bubble
        self._seen = ([], Layout(), {})

    async def _clear_storage(self) -> bool:
        """Clear the context's cookies and the storage of every origin the last episode visited; False when
        one could not be cleared, so a new context (which has none) is needed.

        sessionStorage belongs to the tab, which is reused, and DOMStorage.clear reaches it only through a
        frame that shows its origin: after an episode that left its app (another app opened, a link
        followed) it answered "Frame not found", and the next reset faulted."""
        assert self._context is not None and self._cdp is not None
        clears: list[Awaitable[Any]] = [self._context.clear_cookies()]
        for origin in self._origins:
            clears.append(self._cdp.send("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": _APP_STORAGE}))
            clears.append(self._cdp.send("DOMStorage.clear",
                                         {"storageId": {"securityOrigin": origin, "isLocalStorage": False}}))
        failures = [r for r in await asyncio.gather(*clears, return_exceptions=True) if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, PlaywrightError):
                raise failure
        return not failures

    def shows_document(self, url: str) -> bool:
        """Whether the page, with no fault since its last reset, shows `url`'s document (the same origin and
        path; the query string may differ): what `restart` needs."""
        if self._broken or self._page is None or self._page.is_closed():
            return False
        here, there = urlsplit(self._page.url), urlsplit(url)
        return (here.scheme, here.netloc, here.path) == (there.scheme, there.netloc, there.path)

    def restart(self, url: str, script: str) -> Any:
        """Start a new episode on the document already loaded, for a page that restarts itself in place (as
        MiniWoB++'s own library resets its tasks): 42 ms against a load's 252 ms at 4 contexts on 2 cores
        (medians before the first observation, 2026-12-01).

        What a load would also give back is put back first: the pointer parked at (0, 0), no element
        focused, the address set to `url` (by `history.replaceState`), the history forgotten. Then `script`
        (a JavaScript function of no argument) restarts the page; its result is returned. Cookies and
        storage are not cleared: use it only for pages that keep their state in the document (check with
        `shows_document` first). Whether the first observation equals a load's is the caller's to show
        (tests/test_miniwob.py does for MiniWoB++'s default tasks).
        """
        if not self.shows_document(url):
            raise ValueError(f"restart needs the page to show {url!r}'s document; it shows {self.url!r}")
        return self._call(self._restart(url, script), "reset")

    async def _restart(self, url: str, script: str) -> Any:
        assert self._page is not None and self._cdp is not None
        self._home = url
        self._forget_episode()
        # At once, as their order does not matter: each round trip waits behind the other contexts' work
        # (at 4 contexts on 2 cores).
        _, result, _ = await asyncio.gather(
            # Left where the last episode's click was, the pointer hovers over the new problem's element
            # there, which a loaded page does not show: 17 of 72 first screenshots differed without this.
            self._page.mouse.move(0, 0),
            self._page.evaluate(f"""url => {{ document.activeElement?.blur(); history.replaceState(null, "", url);
                                              return ({script})(); }}""", url),
            self._cdp.send("Page.resetNavigationHistory"),
        )
        self._nav_done.set()
        return result

    def observe(self) -> Observation:
        """Screenshot and accessibility tree (with element boxes) of the current page.

        Raises EnvFault (app_down) when the page is the browser's error page (the app's server
        could not be reached) or the app answered its document with a server error (5xx): the
        app's, on its origin or an `open` launcher's. Another site's failure is observed as any page.
        """
        obs = self._call(self._observe(), "observe")
        if self.on_observe is not None:
            self.on_observe(obs)
        return obs

    async def _observe(self) -> Observation:
        assert self._cdp is not None and self._page is not None
        if self._held:
            self._held = False
            await self._until_released()
        if self.validation_failed_at is not None:
            await asyncio.sleep(self.validation_failed_at + VALIDATION_BUBBLE_S - time.monotonic())  # <= 0: at once
            self.validation_failed_at = None
        shot, tree, snapshot = await asyncio.gather(
            self._screenshot(),
            _send_raw(self._cdp, "Accessibility.getFullAXTree"),
            _send_raw(self._cdp, "DOMSnapshot.captureSnapshot", {"computedStyles": [], "includePaintOrder": True}),
        )
        doc, strings = snapshot["documents"][0], snapshot["strings"]
        document_url = strings[doc["documentURL"]] if doc["documentURL"] >= 0 else ""
        if document_url.startswith("chrome-error://") and self._on_app(self._unreachable):
            raise EnvFault(f"the page could not be loaded ({self._unreachable or self._page.url})", "app_down")
        if self._document is not None and self._document[0] >= 500 and self._on_app(self._document[1]):
            raise EnvFault(f"the app answered HTTP {self._document[0]} for {self._document[1]}", "app_down")
        png = base64.b64decode(shot["data"])
        if hidden := secrets_off_the_tree(snapshot):
            png = secrets.cover(png, hidden)
        width, height = png_size(png)
        layout = Layout(snapshot)
        candidates = [n["backendDOMNodeId"] for n in tree["nodes"]
                      if not n.get("ignored") and n.get("backendDOMNodeId") in layout.boxes]
        nodes, focused = from_cdp(tree["nodes"], layout.boxes, layout.covered(candidates, (width, height)))
        title = strings[doc["title"]] if doc["title"] >= 0 else ""
        shown = tuple(nodes)
        obs = Observation(png, width, height, recorded_url(self._page.url, self._origin), title, shown, focused)
        # Each name as the observation shows it, where that differs: only the observation sees a secret that
        # runs across its nodes (`secrets.mask_pieces`), which no name alone holds. It keeps the nodes it was
        # given unless a secret shows, so most steps skip the comparison.
        masked = {} if obs.nodes is shown else {
            n.name: m.name for n, m in zip(shown, obs.nodes, strict=True) if n.name != m.name}
        self._seen = (tree["nodes"], layout, masked)
        return obs

    async def _screenshot(self) -> dict[str, Any]:
        """`Page.captureScreenshot`, asked again when Chromium had no frame to give yet.

        On a loaded machine Chromium sometimes answers "Unable to capture screenshot" right after
        a navigation (its compositor has not produced the new page's first frame): seen in CI
        with three browser-heavy processes on 2 cores. The next frame comes within a few
        milliseconds, so it is asked for again, a few times, before it counts as a fault.
        """
        assert self._cdp is not None
        for attempt in range(_SCREENSHOT_TRIES):
            try:
                return await _send_raw(self._cdp, "Page.captureScreenshot", {"format": "png"})
            except PlaywrightError as exc:
                if "Unable to capture screenshot" not in str(exc) or attempt == _SCREENSHOT_TRIES - 1:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover - the last try raises

    def act(self, action: dict[str, Any]) -> str | None:
        """Execute one action; returns why it is invalid (nothing done), or None.

        Waits until a navigation the action started has loaded. Raises EnvFault when the
        browser or the app fails. A `type` action's `<secret>name</secret>` placeholders are
        typed as their values (see `envs.secrets`); an unset one makes the action invalid.
        """
        error = actions.validate(action, self.width, self.height, self.space)
        if error:
            return error
        if action["type"] == "type" and (unset := secrets.unset(action["text"])):
            return f"type: {unset}"
        return self._call(self._act(actions.normalize(action, self.space)), str(action["type"]))

    async def _act(self, action: dict[str, Any]) -> str | None:
        try:
            error = await self._execute(action)
        except PlaywrightError as exc:
            if "Unknown key" in str(exc):
                return f"key: {str(exc).splitlines()[0]}"
            raise
        if action["type"] not in ("answer", "terminate", "wait"):
            await self._settle()
        if action["type"] == "click" and self._touch:
            self._held = True
        return error

    async def _until_released(self) -> None:
        """Until the tapped element has left its :active state. Blink holds :active at least 0.15 s after a
        tap so a finger sees it (a mouse click clears it at once): a screenshot inside that time showed a
        tapped radio button darker, one after it not, so two replays of the same queries differed in 2 of
        67 steps by when the capture came. Polled in the page (`_UNTIL_RELEASED`), since a loaded renderer
        fires the timer late; one round trip. Waited for by the next observation, not by the tap: a caller
        that takes no screenshot after it (interface validation's taps) does not wait."""
        assert self._cdp is not None
        with contextlib.suppress(PlaywrightError):  # the document went away: nothing is held
            await self._cdp.send("Runtime.evaluate", {"expression": _UNTIL_RELEASED, "awaitPromise": True})

    async def _execute(self, a: dict[str, Any]) -> str | None:
        kind = a["type"]
        page, cdp = self._page, self._cdp
        assert page is not None and cdp is not None
        if kind == "click" and self._touch:
            await page.touchscreen.tap(a["x"], a["y"])
        elif kind in ("click", "double_click", "right_click", "middle_click"):
            button: Literal["left", "middle", "right"] = (
                "right" if kind == "right_click" else "middle" if kind == "middle_click" else "left")
            await page.mouse.click(a["x"], a["y"], button=button, click_count=2 if kind == "double_click" else 1)
        elif kind == "mouse_move":
            await page.mouse.move(a["x"], a["y"])
        elif kind == "drag":
            # Intermediate moves, so drag-and-drop code that follows mousemove sees the path.
            await page.mouse.move(a["x"], a["y"])
            await page.mouse.down()
            await page.mouse.move(a["x2"], a["y2"], steps=10)
            await page.mouse.up()
        elif kind == "long_press":
            hold_s = a.get("duration", 1.0)
            if self._touch:
                await cdp.send("Input.dispatchTouchEvent",
                               {"type": "touchStart", "touchPoints": [{"x": a["x"], "y": a["y"]}]})
                await asyncio.sleep(hold_s)
                await cdp.send("Input.dispatchTouchEvent", {"type": "touchEnd", "touchPoints": []})
            else:
                await page.mouse.move(a["x"], a["y"])
                await page.mouse.down()
                await asyncio.sleep(hold_s)
                await page.mouse.up()
        elif kind in ("swipe", "scroll"):
            # A synthesized scroll gesture moves the content by exactly the distance and
            # returns when it is done (no fling), so the screen is still for the next
            # screenshot; it arrives as wheel scrolling (synthesized touch gestures did not
            # scroll these pages in headless Chromium, raw touch events fling an
            # unpredictable distance). A swipe's distance is the finger's; a wheel's delta
            # is the opposite of the content's movement.
            if kind == "swipe":
                dx, dy, seconds = a["x2"] - a["x"], a["y2"] - a["y"], a.get("duration", 0.3)
            else:
                dx, dy, seconds = -a.get("dx", 0), -a["dy"], 0.3
            distance = max(abs(dx), abs(dy), 1)
            await cdp.send("Input.synthesizeScrollGesture", {
                "x": a["x"], "y": a["y"], "xDistance": dx, "yDistance": dy,
                "speed": int(max(distance / max(seconds, 0.05), 200)),
                "gestureSourceType": "mouse",
            })
        elif kind == "type":
            if a.get("clear"):
                await page.keyboard.press("ControlOrMeta+a")
                await page.keyboard.press("Backspace")
            await page.keyboard.type(secrets.reveal(a["text"]))  # the only place a secret's value is used
            if a.get("enter"):
                await page.keyboard.press("Enter")
        elif kind == "key":
            await self._press_keys([actions.key_name(k) for k in a.get("keys") or [a["key"]]])
        elif kind == "system_button":
            if a["button"] == "Back":
                await page.go_back(wait_until="load")
            elif a["button"] == "Home":
                await page.goto(self._home, wait_until="load")  # the episode's start page
            elif a["button"] == "Enter":
                await page.keyboard.press("Enter")
            else:
                return f"system_button: {a['button']} has no equivalent in a browser"
        elif kind == "open":
            urls = {name.casefold(): url for name, url in self.apps.items()}
            url = urls.get(a["text"].strip().casefold())
            if url is None:
                return f"open: unknown app {a['text']!r}; known: {', '.join(self.apps) or '(none)'}"
            await page.goto(url, wait_until="load")
        elif kind == "wait":
            await asyncio.sleep(a.get("seconds", 1.0))
        # answer and terminate change nothing on the screen.
        return None

    async def _press_keys(self, keys: list[str]) -> None:
        """Press the keys in order, release them in reverse (a chord: Control, Shift, t)."""
        assert self._page is not None
        pressed: list[str] = []
        try:
            for key in keys:
                await self._page.keyboard.down(key)
                pressed.append(key)
        finally:  # an unknown key must not leave the ones before it held down
            for key in reversed(pressed):
                await self._page.keyboard.up(key)

    # --- what checkers, recorders and reference policies read --------------------------

    def app_state(self) -> dict[str, Any]:
        """The app's state for this session (`GET /__state` with the session cookie)."""
        if self._origin is None:
            raise RuntimeError("app_state before reset")
        return self._call(self._app_state(self._origin), "reading app state")

    async def _app_state(self, origin: str) -> dict[str, Any]:
        assert self._context is not None
        status, body = await self._request("GET", origin + "/__state")
        if not 200 <= status < 300:
            raise EnvFault(f"GET {origin}/__state answered {status}", "app_down")
        # Masked as an app directory's state is (`envs.appdir`): a recorder's report of a plain field holds what
        # was typed into it.
        state: dict[str, Any] = secrets.mask_json(json.loads(body))
        return state

    def add_recorder(self, script: str) -> None:
        """Run `script` in every page of this env (this context's and every later one's), with a function
        `window.__trajforgeReport(body)` that hands its reports to the browser, which keeps them for
        `take_reports`: for a site whose server does not take the reports itself (a user's own app). The same
        recorder again is a no-op: a rollout wraps its pooled env anew for every episode, and each install would
        run on every page. A second, different one is refused: the page has one function to report to.

        A binding, not a route for the bundled apps' `POST /__ui`: with any route Playwright turns the context's
        HTTP cache off and stops every request in the browser until its driver lets it go.
        """
        if self._recorder == script:
            return
        if self._recorder is not None:
            raise ValueError("this env runs another recorder already")
        self._recorder = script
        if self._context is not None:
            self._call(self._install_recorder(), "installing the recorder")

    @property
    def has_recorder(self) -> bool:
        """Whether `add_recorder` gave this env's pages a recorder (it stays on the context until it closes)."""
        return self._recorder is not None

    async def _install_recorder(self) -> None:
        if self._recorder is None or self._context is None:
            return
        await self._context.expose_binding(RECORDER_BINDING, lambda _source, body: self._reports.append(str(body)))
        await self._context.add_init_script(script=self._recorder)

    def take_reports(self) -> list[str]:
        """The bodies the recorder sent since the last reset (or the last take), oldest first."""
        reports, self._reports = self._reports, []
        return reports

    def request(self, method: str, url: str) -> tuple[int, str]:
        """An HTTP request with the context's cookies (the episode's login and session): (status, body text).
        A URL that is a path goes to the origin of the episode's start page."""
        if url.startswith("/"):
            if self._origin is None:
                raise RuntimeError("a request to a path before reset")
            url = self._origin + url
        return self._call(self._request(method, url), f"{method} {url}")

    async def _request(self, method: str, url: str) -> tuple[int, str]:
        assert self._context is not None
        response = await self._context.request.fetch(url, method=method, timeout=self.timeout_s * 1000)
        return response.status, await response.text()

    def evaluate(self, expression: str, arg: Any = None) -> Any:
        """A JavaScript function's result on the current page, called with `arg`."""
        assert self._page is not None
        return self._call(self._page.evaluate(expression, arg), "evaluating a script")

    def element_at(self, x: float, y: float) -> Element | None:
        """The control under a point, as the last observation saw it: the element painted on top
        there, or its nearest interactive ancestor in that accessibility tree, with its box; None
        where nothing resolves.

        Read from the last observation's tree and layout, not the live page: no round trip a
        step, and the target is the element as the agent saw it (see `Layout`), its name masked as
        the observation's is. A name is looked up by its text: where the page shows a piece of a
        secret, the same text elsewhere on that page is masked too."""
        nodes, layout, masked = self._seen
        by_backend = {n["backendDOMNodeId"]: n for n in nodes if "backendDOMNodeId" in n}
        # The hit node or, where it has no accessibility node of its own, its closest DOM ancestor that has one.
        node = next((by_backend[b] for b in layout.top_at(x, y) if b in by_backend), None)
        by_ax_id = {n["nodeId"]: n for n in nodes}
        fallback: Element | None = None
        while node is not None:
            role = cdp_value(node.get("role")) or ""
            name = str(cdp_value(node.get("name")) or "").strip()
            box = layout.boxes.get(node.get("backendDOMNodeId", -1))
            if not node.get("ignored"):  # the name masked, as the observation's are: it is the step's target
                if role in INTERACTIVE_ROLES:
                    return Element(role, secrets.mask(masked.get(name, name)), box)
                if fallback is None and name and role not in ("RootWebArea", "InlineTextBox"):
                    fallback = Element("text" if role == "StaticText" else role, secrets.mask(masked.get(name, name)),
                                       box)
            node = by_ax_id.get(node.get("parentId", ""))
        return fallback

    def find_element(self, role: str, name: str) -> list[Box]:
        """Boxes (x, y, width, height, in screenshot pixels) of the visible elements with
        exactly this role and accessible name: how a reference policy grounds a step."""
        return self._call(self._find_element(role, name), f"finding {role} {name!r}")

    async def _find_element(self, role: str, name: str) -> list[Box]:
        assert self._page is not None
        # One round trip for all matches (locator.all() + bounding_box() costs ~30 ms).
        boxes = await self._page.get_by_role(role, name=name, exact=True).evaluate_all(  # type: ignore[arg-type]
            "els => els.map(e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })"
        )
        return [tuple(b) for b in boxes if b[2] > 0 and b[3] > 0]

    def resize(self, width: int, height: int) -> None:
        """Change the screen size (e.g. a short phone); actions are validated against it,
        and it outlives resets."""
        if self._page is not None:
            self._call(self._page.set_viewport_size({"width": width, "height": height}), "resizing")
        self.width, self.height = width, height

    @property
    def url(self) -> str:
        return self._page.url if self._page is not None else ""

    @property
    def page(self) -> Any:
        """The env's page, as a blocking view (for tests and notebooks)."""
        return Blocking(self._page, self._host)

    @property
    def context(self) -> Any:
        """The env's browser context, as a blocking view (for tests and notebooks)."""
        return Blocking(self._context, self._host)

    def close(self) -> None:
        """Close the context (and the host, when the env started its own); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._context is not None:
                with contextlib.suppress(PlaywrightError):  # already gone (the browser crashed)
                    self._host.run(self._context.close())
        finally:
            if self._own_host:
                self._host.close()

    def __enter__(self) -> BrowserEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

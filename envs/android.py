"""Android devices and emulators over ADB, with the same interface as the browser env.

Observations come from `screencap -p` (the screenshot) and `uiautomator dump` (the
view hierarchy, rendered like the browser's accessibility tree: role, name, state and
box); actions of the mobile space (paper Table 9) become `input` commands. Every call
goes through the `adb` client with an explicit server port and device serial, so one
machine can drive many devices: give each device its own ADB server port
(`adb -P 5038 start-server`) to keep a wedged device from stalling the others.

Nothing here needs a device at import or construction time; the first command does.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from trajforge.envs import actions, secrets
from trajforge.envs.axtree import AXNode, Element, PixelBox
from trajforge.envs.browser import EnvFault, Observation, png_size
from trajforge.envs.pool import map_envs
from trajforge.schemas.config import AndroidSettings, AndroidTask
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import Query

APP = "android"
"""The app name of every Android query: the device suite, one kind for all devices."""

T = TypeVar("T")
R = TypeVar("R")

# Android key codes for the mobile space's system buttons and common keys.
KEYCODES: dict[str, int] = {  # by the browser's key names (`actions.key_name`): the space bar is " "
    "Home": 3, "Back": 4, "Menu": 82, "Enter": 66, "Backspace": 67, "Delete": 112, "Tab": 61,
    "Escape": 111, " ": 62, "ArrowUp": 19, "ArrowDown": 20, "ArrowLeft": 21, "ArrowRight": 22,
    "PageUp": 92, "PageDown": 93, "AppSwitch": 187, "Power": 26, "VolumeUp": 24, "VolumeDown": 25,
}
_BOUNDS = re.compile(r"\[(-?\d+),(-?\d+)\]\[(-?\d+),(-?\d+)\]")
_FOCUS = re.compile(r"mCurrentFocus=Window\{\S+ \S+ ([^}\s]+)\}")
_SIZE = re.compile(r"(?:Override|Physical) size: (\d+)x(\d+)")
# uiautomator class names -> the roles the browser's tree uses, so policies see one vocabulary.
_ROLES = {
    "Button": "button", "ImageButton": "button", "EditText": "textbox", "CheckBox": "checkbox",
    "Switch": "switch", "RadioButton": "radio", "ToggleButton": "switch", "TextView": "text",
    "ImageView": "image", "SeekBar": "slider", "Spinner": "combobox", "TabWidget": "tablist",
}
_DUMP = "/sdcard/trajforge_window_dump.xml"
_COMPONENT = re.compile(r"[A-Za-z][\w.]*/[\w.$]+")  # package/activity, as `am start -n` takes it
_PACKAGE = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*")  # an application id, as Android takes it


@dataclass(frozen=True)
class UINode:
    role: str
    name: str
    box: PixelBox
    states: tuple[str, ...]
    resource_id: str


def parse_hierarchy(xml: str) -> list[UINode]:
    """The meaningful nodes of a uiautomator dump: those with text, a description or a use."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise EnvFault(f"uiautomator dump is not valid XML: {exc}", "other") from None
    nodes = []
    for el in root.iter("node"):
        a = el.attrib
        name = (a.get("text") or a.get("content-desc") or "").strip()
        clickable = a.get("clickable") == "true" or a.get("checkable") == "true"
        if not name and clickable:
            # A clickable row is usually labelled by its children's text, as TalkBack reads it.
            texts = [d.get("text") or d.get("content-desc") or "" for d in el.iter("node") if d is not el]
            name = " ".join(t.strip() for t in texts if t.strip())
        if not name and not clickable:
            continue
        m = _BOUNDS.fullmatch(a.get("bounds", ""))
        if m is None:
            continue
        x1, y1, x2, y2 = map(int, m.groups())
        cls = a.get("class", "").rsplit(".", 1)[-1]
        role = _ROLES.get(cls, "button" if clickable else "text")
        states = tuple(s for s in ("checked", "selected", "focused") if a.get(s) == "true")
        if a.get("enabled") == "false":
            states += ("disabled",)
        nodes.append(UINode(role, name, (x1, y1, x2 - x1, y2 - y1), states, a.get("resource-id", "")))
    return nodes


def ax_nodes(nodes: list[UINode]) -> tuple[AXNode, ...]:
    """The nodes as the browser's tree nodes, so one renderer writes both trees' text
    (`role "name" [state] (x,y,w,h)` lines); all at depth 0, as `parse_hierarchy` keeps
    the meaningful nodes without their nesting."""
    return tuple(AXNode(0, n.role, n.name, n.states, "", n.box) for n in nodes)


def _escape_text(text: str) -> str:
    """`input text` takes one shell word; spaces must be %s and shell metacharacters quoted. Its only escape is
    %s for a space (AOSP InputShellCommand.sendText): a `%` before anything else is typed as it is, and a
    backslash before it would be typed too."""
    return shlex.quote(text.replace(" ", "%s"))


class AndroidEnv:
    """One device: reset to an app's launch activity, observe, act."""

    viewport = "mobile"
    space = "mobile"

    def __init__(self, serial: str, *, adb: str = "adb", server_port: int = 5037, timeout_s: float = 20.0,
                 packages: dict[str, str] | None = None, probes: dict[str, str] | None = None) -> None:
        """`packages` maps app names (for the `open` action) to package names; `probes`
        maps state names to shell commands whose output a checker reads (for example
        {"wifi_on": "settings get global wifi_on"})."""
        self.serial = serial
        self.adb = adb
        self.server_port = server_port
        self.timeout_s = timeout_s
        self.packages = packages or {}
        self.probes = probes or {}
        self._nodes: list[UINode] = []
        self._masked: dict[str, str] = {}
        """The last observation's node names that it masked, as it shows them (`element_at`)."""
        self._size: tuple[int, int] | None = None

    def _run(self, *args: str, binary: bool = False) -> Any:
        cmd = [self.adb, "-P", str(self.server_port), "-s", self.serial, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise EnvFault(f"adb {' '.join(args[:3])} timed out after {self.timeout_s}s", "timeout") from None
        except OSError as exc:
            raise EnvFault(f"cannot run {self.adb!r}: {exc}", "other") from None
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            kind = "browser_crash" if "not found" in err or "offline" in err else "other"
            raise EnvFault(f"adb {' '.join(args[:3])} failed on {self.serial}: {err}", kind)
        return proc.stdout if binary else proc.stdout.decode(errors="replace")

    def screen_size(self) -> tuple[int, int]:
        """The last screenshot's size; before one, `wm size`."""
        if self._size is None:
            m = _SIZE.findall(self._run("shell", "wm", "size"))
            if not m:
                raise EnvFault("`wm size` printed no screen size", "other")
            self._size = tuple(map(int, m[-1]))  # an override, when set, is listed last
        return self._size

    def reset(self, session_id: str, start_url: str | None = None) -> None:
        """Stop and clear the app's data, then launch it: a known state per episode.

        `start_url` is `package/activity`; the session id is unused (a device runs one
        episode at a time) but kept for the browser env's interface.
        """
        if not start_url or not _COMPONENT.fullmatch(start_url):
            raise ValueError(f"an Android start_url is 'package/activity', got {start_url!r}")
        package = start_url.split("/", 1)[0]
        self._run("shell", "am", "force-stop", package)
        self._run("shell", "pm", "clear", package)
        self._run("shell", "am", "start", "-W", "-n", shlex.quote(start_url))  # an inner class's `$` too

    def observe(self) -> Observation:
        png = self._run("exec-out", "screencap", "-p", binary=True)
        if not png.startswith(b"\x89PNG"):
            raise EnvFault("screencap returned no PNG (is the screen on and the device unlocked?)", "other")
        width, height = png_size(png)
        # The screen as it is now: `wm size` gives the natural (portrait) size whatever the rotation, and `input`
        # takes points of the rotated screen, as the screenshot shows it.
        self._size = (width, height)
        self._run("shell", "uiautomator", "dump", _DUMP)
        self._nodes = parse_hierarchy(self._run("shell", "cat", _DUMP))
        activity = self.current_activity()
        focused = next((Element(n.role, n.name, n.box) for n in self._nodes if "focused" in n.states), None)
        shown = ax_nodes(self._nodes)
        obs = Observation(png, width, height, activity, activity.split("/")[0], shown, focused)
        # Each name as the observation shows it, where that differs (a secret split across nodes is masked piece
        # by piece there, which no name alone shows): `element_at` names a target as the observation does.
        self._masked = {} if obs.nodes is shown else {
            n.name: m.name for n, m in zip(shown, obs.nodes, strict=True) if n.name != m.name}
        return obs

    @property
    def url(self) -> str:
        """Where the device is: the foreground activity (the browser env's URL)."""
        return self.current_activity()

    def current_activity(self) -> str:
        m = _FOCUS.findall(self._run("shell", "dumpsys", "window", "windows"))
        return m[-1] if m else ""

    def act(self, action: dict[str, Any]) -> str | None:
        """Run a mobile-space action; an invalid one returns its error and touches nothing."""
        width, height = self.screen_size()
        error = actions.validate(action, width, height, "mobile")
        if error is not None:
            return error
        a = actions.normalize(action)
        kind = a["type"]
        if kind == "click":
            self._run("shell", "input", "tap", *_ints(a["x"], a["y"]))
        elif kind == "long_press":
            ms = int(float(a.get("duration", 1)) * 1000)
            self._run("shell", "input", "swipe", *_ints(a["x"], a["y"], a["x"], a["y"]), str(ms))
        elif kind == "swipe":
            ms = int(float(a.get("duration", 0.3)) * 1000)
            self._run("shell", "input", "swipe", *_ints(a["x"], a["y"], a["x2"], a["y2"]), str(ms))
        elif kind == "type":
            if secrets.PLACEHOLDER.search(a["text"]):
                # `input text` puts its argument on adb's command line, which the device's process list shows.
                return "type: secrets are typed in browser envs only; adb would show the value on its command line"
            if "%s" in a["text"]:
                return "type: `input text` types %s as a space and has no escape for it, so it cannot type '%s'"
            self._run("shell", "input", "text", _escape_text(a["text"]))
        elif kind in ("key", "system_button"):
            name = actions.key_name(a.get("key") or a.get("button"))
            code = KEYCODES.get(name)
            if code is None and len(name) == 1 and name.isalnum():
                code = 29 + ord(name.lower()) - ord("a") if name.isalpha() else 7 + int(name)
            if code is None:
                return f"no Android key code for {name!r}"
            self._run("shell", "input", "keyevent", str(code))
        elif kind == "open":
            package = self.packages.get(a["text"], a["text"])
            if not _PACKAGE.fullmatch(package):  # adb hands the command line to the device's shell, which parses it
                return (f"open: {package!r} is no Android package name; name a package (com.android.settings) "
                        f"or an app of rollout.android.packages ({', '.join(self.packages) or 'none configured'})")
            self._run("shell", "monkey", "-p", package, "-c", "android.intent.category.LAUNCHER", "1")
        elif kind == "wait":
            time.sleep(float(a.get("seconds", 1)))
        return None  # answer and terminate change nothing on the screen

    def element_at(self, x: float, y: float) -> Element | None:
        """The smallest node of the last observation whose box holds the point."""
        hits = [n for n in self._nodes if n.box[0] <= x < n.box[0] + n.box[2] and n.box[1] <= y < n.box[1] + n.box[3]]
        if not hits:
            return None
        n = min(hits, key=lambda n: n.box[2] * n.box[3])
        return Element(n.role, secrets.mask(self._masked.get(n.name, n.name)), n.box)  # as the observation names it

    def app_state(self) -> dict[str, Any]:
        """The foreground activity and every probe's output: what a task checker reads."""
        state: dict[str, Any] = {"activity": self.current_activity()}
        for name, command in self.probes.items():
            # One argument: adb joins its arguments with spaces for the device's shell, which parses them again, so
            # a probe's own quoting ("name='screen_brightness'") reaches that shell only as written.
            state[name] = self._run("shell", command).strip()
        return state

    def fault(self, exc: BaseException, what: str = "") -> EnvFault:
        """Any failure while driving the device as an EnvFault (the episode recorder's contract)."""
        if isinstance(exc, EnvFault):
            return exc
        return EnvFault(f"{what} failed: {exc}" if what else str(exc), "other")

    def close(self) -> None:
        """Nothing to release: the device outlives the env."""


def _ints(*values: Any) -> list[str]:
    return [str(round(float(v))) for v in values]


class DevicePool:
    """The configured devices, each running one episode at a time, all in parallel."""

    def __init__(self, settings: AndroidSettings) -> None:
        self.envs = [
            AndroidEnv(d.serial, adb=settings.adb, server_port=d.adb_server_port, packages=settings.packages,
                       probes=settings.probes)
            for d in settings.devices
        ]

    def map(self, fn: Callable[[AndroidEnv, T], R], items: list[T]) -> list[R]:
        """fn(device, item) for every item, in order, on whichever device is free."""
        return map_envs(self.envs, fn, items)


def check_probe(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """An Android task's checker: a state probe's output equals the expected value."""
    probe, expected = params.get("probe", ""), params.get("value", "")
    if probe not in state:
        return False, f"no probe {probe!r} in the device state (rollout.android.probes)"
    return state[probe] == expected, f"{probe} = {state[probe]!r} (expected {expected!r})"


def android_queries(tasks: list[AndroidTask], *, run_id: str) -> list[Query]:
    """Queries from hand-written task templates (`query_gen.android_tasks`): a device has no page graph to
    sample from; its tasks are written by hand, as AndroidWorld's are, each naming the activity it starts from
    and the device state (a probe) that says it is done."""
    now = datetime.now(timezone.utc)
    return [
        Query(
            run_id=run_id,
            query_id=short_id(APP, t.start, t.instruction),
            app=APP,
            source="imported",
            instruction=t.instruction,
            path=[t.start],
            slots_json="{}",
            checker="probe",
            checker_params_json=json.dumps({"probe": t.probe, "value": t.value}),
            max_steps=t.max_steps,
            generator="android_tasks@1",
            created_at=now,
        )
        for t in tasks
    ]

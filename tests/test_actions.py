"""Both action spaces on a real page in Chromium: each action does what it says, and
every kind of invalid action is recorded on its step, never raised.

The page (tests/pages/actions.html) logs its input events into `window.events`, so a
test reads what the browser really received. It is served on loopback by a stdlib
server that also answers the bundled apps' session protocol (`POST /__reset`,
`GET /__state`), so `run_episode` drives it like any app.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any, Literal

import pytest

from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.envs.apps import AppServer, load_app
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.rollout.episode import run_episode
from trajforge.rollout.policy import PolicyOutput
from trajforge.schemas.records import Query

PAGES = Path(__file__).parent / "pages"


class _PageHandler(SimpleHTTPRequestHandler):
    """Static files, plus the app protocol with an empty state."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self) -> None:
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.path == "/__reset":
            self._json()
        else:
            self.send_error(404)

    def do_GET(self) -> None:
        if self.path == "/__state":
            self._json()
        else:
            super().do_GET()


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_PageHandler, directory=str(PAGES)))
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _env(viewport: Literal["mobile", "desktop"], chromium: Path, site: str) -> Iterator[BrowserEnv]:
    with BrowserEnv(site + "/actions.html", viewport=viewport, chromium=chromium,
                    apps={"Second": site + "/second.html"}) as e:
        e.reset("actions")
        yield e


@pytest.fixture(scope="module")
def mobile_env(chromium: Path, site: str) -> Iterator[BrowserEnv]:
    yield from _env("mobile", chromium, site)


@pytest.fixture(scope="module")
def desktop_env(chromium: Path, site: str) -> Iterator[BrowserEnv]:
    yield from _env("desktop", chromium, site)


@pytest.fixture(params=["mobile", "desktop"])
def env(request: pytest.FixtureRequest) -> BrowserEnv:
    """Each viewport's env, on a fresh copy of the actions page."""
    e: BrowserEnv = request.getfixturevalue(f"{request.param}_env")
    e.reset(f"actions-{time.monotonic_ns()}")
    return e


@pytest.fixture
def mobile(mobile_env: BrowserEnv) -> BrowserEnv:
    mobile_env.reset(f"actions-{time.monotonic_ns()}")
    return mobile_env


@pytest.fixture
def desktop(desktop_env: BrowserEnv) -> BrowserEnv:
    desktop_env.reset(f"actions-{time.monotonic_ns()}")
    return desktop_env


def events(env: BrowserEnv) -> list[str]:
    return list(env.page.evaluate("events"))


def center(env: BrowserEnv, element_id: str) -> tuple[int, int]:
    box = env.page.locator(f"#{element_id}").bounding_box()
    return round(box["x"] + box["width"] / 2), round(box["y"] + box["height"] / 2)


def ok(env: BrowserEnv, action: dict[str, Any]) -> None:
    assert env.act(action) is None, action


# --- actions both spaces share --------------------------------------------------------


@pytest.mark.browser
def test_click_reaches_the_element(env: BrowserEnv) -> None:
    x, y = center(env, "target")
    ok(env, {"type": "click", "x": x, "y": y})
    assert f"click target {x} {y} 0" in events(env)


@pytest.mark.browser
def test_wait_waits_and_terminate_changes_nothing(env: BrowserEnv) -> None:
    t0 = time.monotonic()
    ok(env, {"type": "wait", "seconds": 0.3})
    assert time.monotonic() - t0 >= 0.3
    ok(env, {"type": "terminate", "status": "success"})
    assert events(env) == [] and env.url.endswith("/actions.html")


@pytest.mark.browser
def test_typing_into_the_focused_field(env: BrowserEnv) -> None:
    x, y = center(env, "field")
    ok(env, {"type": "click", "x": x, "y": y})
    ok(env, {"type": "type", "text": " and new"})
    assert env.page.input_value("#field") == "old and new"


@pytest.mark.browser
def test_a_focused_field_looks_the_same_whenever_it_is_captured(env: BrowserEnv) -> None:
    """The caret is not painted: a blinking one made screenshots of one screen differ by their timing, and
    with them OCR, cached model answers and reruns. Four captures over more than a blink still differ if
    it is (the caret is on for 0.5 s, off for 0.5 s)."""
    x, y = center(env, "field")
    ok(env, {"type": "click", "x": x, "y": y})
    assert env.observe().focused is not None  # which field has focus is still observed
    shots = set()
    for _ in range(4):
        shots.add(env.observe().png)
        time.sleep(0.3)
    assert len(shots) == 1


# --- mobile (Table 9) -----------------------------------------------------------------


@pytest.mark.browser
def test_mobile_key_and_enter_button(mobile: BrowserEnv) -> None:
    x, y = center(mobile, "field")
    ok(mobile, {"type": "click", "x": x, "y": y})
    ok(mobile, {"type": "key", "key": "Backspace"})
    ok(mobile, {"type": "press", "key": "Enter"})  # the alias
    assert mobile.page.input_value("#field") == "ol"
    ok(mobile, {"type": "system_button", "button": "Enter"})
    assert [e for e in events(mobile) if e.startswith("submit")] == ["submit ol", "submit ol"]


@pytest.mark.browser
def test_a_tapped_button_is_observed_as_it_stays(mobile: BrowserEnv) -> None:
    """A tap holds the button :active for at least 0.15 s; the observation comes after, so the capture
    right after the tap is the capture a moment later (before, a replay's screens differed by timing)."""
    x, y = center(mobile, "target")
    ok(mobile, {"type": "click", "x": x, "y": y})
    first = mobile.observe().png
    time.sleep(0.4)
    assert mobile.observe().png == first


@pytest.mark.browser
def test_a_form_that_fails_validation_is_observed_with_its_whole_bubble(chromium: Path) -> None:
    """Chromium fades its "Please fill out this field." bubble in over about a second; the observation after a
    failed submission waits it out, so each capture shows the whole bubble the tree names (not a faint ghost
    that depends on when it was taken)."""
    def click(env: BrowserEnv, name: str) -> None:
        (node,) = [n for n in env.observe().nodes if n.role == "button" and n.name == name]
        x, y, w, h = node.box
        ok(env, {"type": "click", "x": x + w / 2, "y": y + h / 2})

    captures = []
    with AppServer(load_app("writer")) as srv, BrowserEnv(viewport="desktop", chromium=chromium) as env:
        for session in ("first", "second"):
            env.reset(session, srv.base_url + "/")
            click(env, "Share")
            click(env, "Send invite")  # the dialog's email field is required and empty
            obs = env.observe()
            assert "Please fill out this field." in [n.name for n in obs.nodes if n.role == "alert"]
            captures.append(obs.png)
        time.sleep(0.5)
        assert env.observe().png == captures[-1]  # nothing was still fading in
    assert captures[0] == captures[1]


@pytest.mark.browser
def test_a_script_checking_validity_is_not_taken_for_a_bubble_and_report_validity_is(chromium: Path, site: str) -> None:
    """A form that enables its button as it is filled calls checkValidity() on every key: the `invalid` events
    it fires show no bubble, so no observation waits for one; reportValidity() shows one, and it is waited out."""
    with BrowserEnv(site + "/validity.html", viewport="desktop", chromium=chromium) as env:
        env.reset("validity")
        (field,) = [n for n in env.observe().nodes if n.role == "textbox"]
        x, y, w, h = field.box
        ok(env, {"type": "click", "x": x + w / 2, "y": y + h / 2})
        ok(env, {"type": "type", "text": "not-an-email"})
        assert env.page.evaluate("window.invalidEvents") >= 1  # the script's checks failed, firing `invalid`
        assert env.validation_failed_at is None
        (report,) = [n for n in env.observe().nodes if n.role == "button" and n.name == "Check now"]
        x, y, w, h = report.box
        ok(env, {"type": "click", "x": x + w / 2, "y": y + h / 2})
        assert env.validation_failed_at is not None
        assert any(n.role == "alert" for n in env.observe().nodes)  # the bubble the observation waited for
        assert env.validation_failed_at is None


@pytest.mark.browser
def test_mobile_long_press_holds(mobile: BrowserEnv) -> None:
    x, y = center(mobile, "pad")
    ok(mobile, {"type": "long_press", "x": x, "y": y, "duration": 0.6})
    held = [int(e.split()[1]) for e in events(mobile) if e.startswith("held")]
    assert len(held) == 1 and held[0] >= 550


@pytest.mark.browser
def test_mobile_swipe_moves_content_with_the_finger(mobile: BrowserEnv) -> None:
    ok(mobile, {"type": "swipe", "x": 200, "y": 700, "x2": 200, "y2": 300})
    assert mobile.page.evaluate("scrollY") == pytest.approx(400, abs=2)
    ok(mobile, {"type": "swipe", "x": 200, "y": 300, "x2": 200, "y2": 500, "duration": 0.1})
    assert mobile.page.evaluate("scrollY") == pytest.approx(200, abs=2)


@pytest.mark.browser
def test_mobile_system_buttons_and_open(mobile: BrowserEnv) -> None:
    ok(mobile, {"type": "open", "text": "second"})  # app names match case-insensitively
    assert mobile.observe().title == "Second"
    ok(mobile, {"type": "system_button", "button": "Back"})
    assert mobile.observe().title == "Actions"
    x, y = center(mobile, "next")
    ok(mobile, {"type": "click", "x": x, "y": y})
    assert mobile.url.endswith("/second.html")
    ok(mobile, {"type": "system_button", "button": "Home"})
    assert mobile.url.endswith("/actions.html")
    assert "no equivalent" in str(mobile.act({"type": "system_button", "button": "Menu"}))
    assert "unknown app 'Mail'" in str(mobile.act({"type": "open", "text": "Mail"}))


@pytest.mark.browser
def test_mobile_answer_changes_nothing(mobile: BrowserEnv) -> None:
    before = mobile.observe()
    ok(mobile, {"type": "answer", "text": "42"})
    after = mobile.observe()
    assert (after.url, after.ax_tree, events(mobile)) == (before.url, before.ax_tree, [])


# --- desktop (Table 10) -----------------------------------------------------------------


@pytest.mark.browser
def test_desktop_key_chord_presses_in_order_and_releases_in_reverse(desktop: BrowserEnv) -> None:
    x, y = center(desktop, "field")
    ok(desktop, {"type": "click", "x": x, "y": y})
    ok(desktop, {"type": "key", "keys": ["ctrl", "a"]})  # pyautogui's name is accepted
    keys = [e for e in events(desktop) if e.startswith("key")]
    assert keys == ["keydown field Control", "keydown field a", "keyup field a", "keyup field Control"]
    ok(desktop, {"type": "key", "keys": ["Delete"]})
    assert desktop.page.input_value("#field") == ""


@pytest.mark.browser
def test_desktop_chord_with_an_unknown_key_releases_the_keys_it_pressed(desktop: BrowserEnv) -> None:
    x, y = center(desktop, "field")
    ok(desktop, {"type": "click", "x": x, "y": y})
    assert "Unknown key" in str(desktop.act({"type": "key", "keys": ["Shift", "NoSuchKey"]}))
    ok(desktop, {"type": "type", "text": "a"})
    assert desktop.page.input_value("#field") == "olda", "Shift must not stay held down"


@pytest.mark.browser
def test_desktop_type_clears_and_presses_enter(desktop: BrowserEnv) -> None:
    x, y = center(desktop, "field")
    ok(desktop, {"type": "click", "x": x, "y": y})
    ok(desktop, {"type": "type", "text": "new", "clear": True, "enter": True})
    assert desktop.page.input_value("#field") == "new"
    assert "submit new" in events(desktop)
    ok(desktop, {"type": "type", "text": "!", "clear": False, "enter": False})
    assert desktop.page.input_value("#field") == "new!"


@pytest.mark.browser
def test_desktop_mouse_buttons(desktop: BrowserEnv) -> None:
    x, y = center(desktop, "target")
    ok(desktop, {"type": "double_click", "x": x, "y": y})
    ok(desktop, {"type": "right_click", "x": x, "y": y})
    ok(desktop, {"type": "middle_click", "x": x, "y": y})
    log = events(desktop)
    assert log.count(f"click target {x} {y} 0") == 2 and f"dblclick target {x} {y} 0" in log
    assert f"contextmenu target {x} {y} 2" in log
    assert f"auxclick target {x} {y} 1" in log


@pytest.mark.browser
def test_desktop_mouse_move_and_drag(desktop: BrowserEnv) -> None:
    ok(desktop, {"type": "mouse_move", "x": 50, "y": 200})
    assert events(desktop) == ["mousemove pad 50 200 0"]
    ok(desktop, {"type": "drag", "x": 60, "y": 180, "x2": 250, "y2": 300})
    log = events(desktop)[1:]
    down, up = log.index("mousedown pad 60 180 0"), log.index("mouseup pad 250 300 0")
    assert [e for e in log if e.startswith(("mousedown", "mouseup"))] == [log[down], log[up]]
    assert up - down >= 5, "a drag moves through the way between"


@pytest.mark.browser
def test_desktop_scroll_is_the_wheel(desktop: BrowserEnv) -> None:
    ok(desktop, {"type": "scroll", "x": 600, "y": 400, "dy": 300})
    assert desktop.page.evaluate("scrollY") == pytest.approx(300, abs=2)
    ok(desktop, {"type": "scroll", "x": 600, "y": 400, "dy": -100, "dx": 0})
    assert desktop.page.evaluate("scrollY") == pytest.approx(200, abs=2)


# --- invalid actions --------------------------------------------------------------------


class ScriptedPolicy:
    """Plays a fixed list of actions."""

    name = model_id = "scripted"
    prompt_version = "none"

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.i = 0

    def reset(self, query: Query) -> None:
        self.i = 0

    def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput:
        action = self.script[self.i]
        self.i += 1
        return PolicyOutput(action, "scripted", json.dumps(action))


INVALID: dict[str, list[tuple[Any, str]]] = {
    "both": [
        ({"type": "fly"}, "unknown action type 'fly'"),
        ("click 3 4", "must be a JSON object"),
        ({"type": "click", "x": 5000, "y": 10}, "off the"),
        ({"type": "click", "x": 10, "y": -1}, "off the"),
        ({"type": "click", "x": 10}, "missing argument 'y'"),
        ({"type": "click", "x": "10", "y": 10}, "'x' must be a number"),
        ({"type": "click", "x": True, "y": 10}, "'x' must be a number"),
        ({"type": "click", "x": 1, "y": 1, "button": "left"}, "unknown argument(s) button"),
        ({"type": "wait", "seconds": 60}, "between 0 and 10"),
        ({"type": "terminate", "status": "maybe"}, "success or failure"),
        ({"type": "type", "text": 5}, "'text' must be a string"),
        ({"type": "type", "text": "a" * 5000}, "5000 characters long, more than 1000"),
    ],
    "mobile": [
        ({"type": "scroll", "x": 1, "y": 1, "dy": 10}, "'scroll' is a desktop action"),
        ({"type": "double_click", "x": 1, "y": 1}, "'double_click' is a desktop action"),
        ({"type": "type", "text": "a", "clear": True}, "unknown argument(s) clear"),
        ({"type": "swipe", "x": 1, "y": 1, "x2": 1, "y2": 99999}, "(x2=1, y2=99999) is off the"),
        ({"type": "key", "key": "NoSuchKey"}, "Unknown key"),
        ({"type": "key", "key": " "}, "'key' is empty"),
        ({"type": "system_button", "button": "Power"}, "must be one of Back, Home, Menu, Enter"),
        ({"type": "long_press", "x": 1, "y": 1, "duration": -1}, "between 0 and 10"),
        ({"type": "open", "text": "Mail"}, "unknown app 'Mail'"),
    ],
    "desktop": [
        ({"type": "swipe", "x": 1, "y": 1, "x2": 2, "y2": 2}, "'swipe' is a mobile action"),
        ({"type": "system_button", "button": "Back"}, "'system_button' is a mobile action"),
        ({"type": "answer", "text": "42"}, "'answer' is a mobile action"),
        ({"type": "key", "keys": "ctrl+a"}, "non-empty list of key names"),
        ({"type": "key", "keys": []}, "non-empty list of key names"),
        ({"type": "key", "keys": ["NoSuchKey"]}, "Unknown key"),
        ({"type": "type", "text": "a", "clear": "yes"}, "'clear' must be true or false"),
        ({"type": "scroll", "x": 1, "y": 1}, "missing argument 'dy'"),
        ({"type": "scroll", "x": 1, "y": 1, "dy": 1e10}, "dy must be within 100 screens"),  # Chromium refuses it
        ({"type": "drag", "x": 1, "y": 1, "x2": 2}, "missing argument 'y2'"),
    ],
}


@pytest.mark.browser
def test_every_kind_of_invalid_action_is_recorded_not_raised(env: BrowserEnv, tmp_path: Path) -> None:
    cases = INVALID["both"] + INVALID[env.space]
    script = [action for action, _ in cases] + [{"type": "terminate", "status": "failure"}]
    query = Query(run_id="t", query_id="q-invalid", app="actions", source="imported", instruction="Fail.",
                  path=[], slots_json="{}", checker="none", checker_params_json="{}", max_steps=len(script),
                  generator="tests", created_at=datetime.now(timezone.utc))
    episode, steps = run_episode(env, ScriptedPolicy(script), query, run_id="t", episode_id=f"ep-{env.space}",
                                 blobs=BlobStore(tmp_path / "blobs"))
    assert episode.status == "terminated" and len(steps) == len(script)
    for step, (action, expected) in zip(steps, cases, strict=False):
        assert not step.action_valid and expected in (step.action_error or ""), (action, step.action_error)
    assert steps[-1].action_valid
    assert events(env) == [], "an invalid action must do nothing"
    assert {s.url_after for s in steps} == {"/actions.html"}  # the path on the page's origin (`recorded_url`)


def test_spaces_follow_table_9_and_10() -> None:
    assert set(actions.SPACES["mobile"]) == {"key", "click", "long_press", "swipe", "type", "answer",
                                             "system_button", "open", "wait", "terminate"}
    assert set(actions.SPACES["desktop"]) == {"key", "type", "mouse_move", "click", "drag", "right_click",
                                              "middle_click", "double_click", "scroll", "wait", "terminate"}
    assert actions.space_for("mobile") == "mobile" and actions.space_for("desktop") == "desktop"
    # A desktop key written the mobile way is read as a one-key chord.
    assert actions.normalize({"type": "key", "key": "Enter"}, "desktop") == {"type": "key", "keys": ["Enter"]}
    assert actions.validate({"type": "key", "key": "Enter"}, 10, 10, "desktop") is None


def test_an_action_is_stored_in_its_spaces_form_with_the_browsers_key_names() -> None:
    """What a step stores and a training answer says (`actions.canonical`), and what two key presses compare by
    (`actions.pressed`): one table of key names serves the recorder, the replay and the matcher."""
    assert actions.canonical({"type": "press", "key": "enter"}, "desktop") == {"type": "key", "keys": ["Enter"]}
    assert actions.canonical({"type": "key", "keys": ["ctrl", "a"]}, "desktop") == {"type": "key",
                                                                                     "keys": ["Control", "a"]}
    assert actions.canonical({"type": "key", "key": "esc"}, "mobile") == {"type": "key", "key": "Escape"}
    # the space bar keeps its name: its browser name, " ", is a blank key the validator refuses
    stored = actions.canonical({"type": "key", "keys": ["space"]}, "desktop")
    assert stored == {"type": "key", "keys": ["space"]} and actions.validate(stored, 10, 10, "desktop") is None
    assert actions.pressed(stored) == actions.pressed({"type": "key", "key": " "}) == [" "]
    assert actions.pressed({"type": "key", "key": "Enter"}) == actions.pressed({"type": "key", "keys": ["enter"]})
    assert actions.pressed({"type": "click", "x": 1, "y": 2}) is None

"""The environment pool against real Chromium and the real shop: isolation between
contexts, the known state after a reset, element boxes, and environment faults (a
killed browser, a server that is down, one that never answers) classified and rerun.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

import networkx as nx
import pytest
from PIL import Image

from trajforge.data.blobs import BlobRef, BlobStore
from trajforge.envs.apps import AppServer, BundledApp, load_app
from trajforge.envs.axtree import parse
from trajforge.envs.browser import BrowserEnv, EnvFault, recorded_url
from trajforge.envs.pool import EnvPool, close_warm, map_envs, warm_envs, warm_scope
from trajforge.envs.spec import AppSpec
from trajforge.rollout.episode import run_episode
from trajforge.rollout.replay import ReplayPolicy
from trajforge.rollout.stage import episode_id_for, rollout
from trajforge.schemas.config import RolloutSettings
from trajforge.schemas.records import Episode, Query, Step


def goal_query(spec: AppSpec, goal: str, query_id: str) -> Query:
    """A query for the shortest path to `goal`, each slot taking its first value."""
    path = nx.shortest_path(spec.graph(), spec.start, goal)
    slots: dict[str, str] = {}
    for page_id in path:
        for slot, values in spec.pages[page_id].slots.items():
            slots.setdefault(slot, values[0])
    page_goal = spec.pages[goal].goal
    assert page_goal is not None
    return Query(
        run_id="test", query_id=query_id, app=spec.app, source="page_graph",
        instruction=page_goal.instruction.format_map(slots), path=path, slots_json=json.dumps(slots),
        checker=page_goal.checker,
        checker_params_json=json.dumps({k: v.format_map(slots) for k, v in page_goal.params.items()}),
        max_steps=20, generator="tests", created_at=datetime.now(timezone.utc),
    )


def add_to_cart(env: BrowserEnv, dish: str) -> None:
    """Change the app's state from the page, as a script of the app would."""
    env.page.evaluate("dish => fetch('/cart/add', {method: 'POST', body: new URLSearchParams("
                      "{dish, size: 'Small', quantity: '1'})})", dish)


@pytest.fixture(scope="module")
def pool(chromium: Path, server: AppServer) -> Iterator[EnvPool]:
    with EnvPool(2, viewport="desktop", chromium=chromium) as p:
        yield p


@pytest.mark.browser
def test_contexts_are_isolated_from_each_other(pool: EnvPool, server: AppServer) -> None:
    """Two envs on one origin, run in parallel: neither sees the other's app state, storage or cookies."""
    barrier = threading.Barrier(2)

    def episode(env: BrowserEnv, name: str) -> dict[str, object]:
        env.reset(f"iso-{name}", server.base_url + "/")
        env.page.evaluate("name => { localStorage.setItem('who', name); document.cookie = 'mine=' + name; }", name)
        if name == "a":
            add_to_cart(env, "Pad Thai")
        barrier.wait(timeout=30)  # both have written before either reads
        return {"state": env.app_state(), "who": env.page.evaluate("localStorage.getItem('who')"),
                "cookie": env.page.evaluate("document.cookie")}

    a, b = pool.map(episode, ["a", "b"])
    assert [line["dish"] for line in a["state"]["cart"]] == ["Pad Thai"]  # type: ignore[index]
    assert b["state"]["cart"] == []  # type: ignore[index]
    assert (a["who"], b["who"]) == ("a", "b")
    assert "mine=a" in str(a["cookie"]) and "mine=a" not in str(b["cookie"])


@pytest.mark.browser
def test_reset_gives_the_known_state(pool: EnvPool, server: AppServer, shop: BundledApp) -> None:
    env = pool.envs[0]
    env.reset("known", server.base_url + "/")
    add_to_cart(env, "Caesar Salad")
    env.page.evaluate("localStorage.setItem('x', '1'); sessionStorage.setItem('y', '2'); document.cookie = 'z=3'")
    env.page.goto(server.base_url + "/cart")
    assert env.app_state()["cart"]

    env.reset("known", server.base_url + "/")  # the same session id: the app must forget it too
    assert env.app_state() == shop.initial_state()
    assert env.page.evaluate("[localStorage.length, sessionStorage.length, history.length]") == [0, 0, 1]
    assert env.page.evaluate("document.cookie") == "tf_session=known"
    assert env.page.go_back() is None, "Back must not reach the last episode's pages"


@pytest.mark.browser
def test_a_reset_after_an_episode_that_left_its_app_gives_the_known_state(pool: EnvPool, server: AppServer) -> None:
    """The episode stored on the app's origin, then left it for another (a link followed): the next reset
    neither faults nor keeps the tab's sessionStorage of the app (a cleared reused tab kept it, or faulted)."""
    from trajforge.envs.miniwob import MiniWoBServer

    env = pool.envs[0]
    with MiniWoBServer() as elsewhere:
        env.reset("left", server.base_url + "/")
        env.page.evaluate("sessionStorage.setItem('y', '2'); localStorage.setItem('x', '1')")
        env.page.goto(elsewhere.task_url("click-button", 1))
        env.observe()
        env.reset("left", server.base_url + "/")
    assert env.page.evaluate("[localStorage.length, sessionStorage.length, history.length]") == [0, 0, 1]
    assert env.observe().url == "/"


@pytest.mark.browser
def test_warm_envs_are_lent_again_and_a_reset_leaves_nothing_of_the_last_holder(chromium: Path,
                                                                                  shop: BundledApp) -> None:
    """A rollout gives its envs back for the next one of the run (a new context's first page costs several
    resets): the next holder gets the same env with its own apps, and after its reset nothing is left of the
    last holder's episode, on an app served on another port since. An env that ran a recorder is not lent again."""
    close_warm()
    with AppServer(shop) as first:
        with warm_envs(1, viewport="desktop", chromium=chromium, apps={"Shop": first.base_url}) as [env]:
            assert env.apps == {"Shop": first.base_url}
            env.reset("warm", first.base_url + "/")
            add_to_cart(env, "Pad Thai")
            env.page.evaluate("localStorage.setItem('x', '1'); sessionStorage.setItem('y', '2');"
                              "document.cookie = 'z=3'")
    with AppServer(shop) as second, warm_envs(1, viewport="desktop", chromium=chromium) as [again]:
        assert again is env and again.apps == {}
        again.reset("warm", second.base_url + "/")
        assert again.app_state() == shop.initial_state()
        assert again.page.evaluate("[localStorage.length, sessionStorage.length, history.length]") == [0, 0, 1]
        assert again.page.evaluate("document.cookie") == "tf_session=warm"  # the cookie of the same host is gone
        again.add_recorder("window.__recorded = true")  # as a user's app's env does (envs.appdir)
    with warm_envs(1, viewport="desktop", chromium=chromium) as [third], \
            warm_envs(1, viewport="mobile", chromium=chromium) as [mobile]:
        assert third is not again and not third.has_recorder
        assert mobile.viewport == "mobile"
    close_warm()
    with warm_envs(1, viewport="desktop", chromium=chromium) as [after]:
        assert after is not third, "close_warm closes the envs it held"
    close_warm()


@pytest.mark.browser
def test_a_run_that_ends_leaves_the_warm_envs_of_another_run_open(chromium: Path, shop: BundledApp) -> None:
    """Two runs in one process (two stage flows a notebook runs at once) each hold a warm scope: the first to
    end leaves the browser the other is using, and the last to end closes it."""
    close_warm()
    other = ExitStack()
    with AppServer(shop) as site:
        with warm_scope():
            other.enter_context(warm_scope())
            with warm_envs(1, viewport="desktop", chromium=chromium) as [env]:
                env.reset("held", site.base_url + "/")
                other.close()  # the other run ends while this one holds `env`
                env.reset("held", site.base_url + "/")  # failed when any run's end closed every warm env
                assert env.observe().url == "/"
            with warm_envs(1, viewport="desktop", chromium=chromium) as [again]:
                assert again is env, "still warm while a scope is open"
        with warm_envs(1, viewport="desktop", chromium=chromium) as [after]:
            assert after is not env, "the last scope's end closes the warm envs"
    close_warm()


@pytest.mark.browser
def test_ax_tree_boxes_match_the_elements(pool: EnvPool, server: AppServer) -> None:
    env = pool.envs[1]
    env.reset("boxes", server.base_url + "/")
    full = (env.width, env.height)
    env.resize(env.width, 300)  # short, so scrolling moves the boxes
    try:
        for scroll in (0, 60):
            if scroll:
                assert env.act({"type": "scroll", "x": 600, "y": 150, "dy": scroll}) is None
            obs = env.observe()
            line = next(li for li in obs.ax_tree.splitlines() if li.strip().startswith('link "Search"'))
            box = [int(v) for v in re.search(r"\((-?\d+),(-?\d+),(\d+),(\d+)\)$", line).groups()]  # type: ignore[union-attr]
            expected = env.page.get_by_role("link", name="Search", exact=True).bounding_box()
            assert box == pytest.approx([expected["x"], expected["y"], expected["width"], expected["height"]], abs=1)
            target = env.element_at(expected["x"] + 5, expected["y"] + 5)
            assert target is not None and (target.role, target.name) == ("link", "Search")
            assert target.box == pytest.approx(tuple(expected.values()), abs=1)
    finally:
        env.resize(*full)


def _own_browser_pids() -> list[int]:
    """Chromium browser processes (not its renderers) started by this test process, newest last."""
    procs: dict[int, tuple[int, int, list[bytes]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            procs[int(entry)] = (int(fields[1]), int(fields[19]), cmdline)  # ppid, start time

    def mine(pid: int) -> bool:
        while pid in procs and pid != os.getpid():
            pid = procs[pid][0]
        return pid == os.getpid()

    browsers = [pid for pid, (_, _, cmd) in procs.items()
                if cmd[0].endswith(b"/chromium") and not any(a.startswith(b"--type=") for a in cmd) and mine(pid)]
    return sorted(browsers, key=lambda pid: procs[pid][1])


class KillingBlobStore(BlobStore):
    """A real blob store that kills this process's newest browser while storing its Nth screenshot,
    so the crash lands in the middle of an episode."""

    def __init__(self, root: Path, kill_at: int) -> None:
        super().__init__(root)
        self.kill_at, self.puts, self.killed = kill_at, 0, 0
        self._lock = threading.Lock()

    def put(self, data: bytes) -> BlobRef:
        with self._lock:
            self.puts += 1
            if self.puts == self.kill_at:
                self.killed = _own_browser_pids()[-1]
                os.kill(self.killed, signal.SIGKILL)
        return super().put(data)


@pytest.mark.browser
def test_killed_browser_gives_env_fault_episodes_and_reruns_that_succeed(chromium: Path, shop: BundledApp,
                                                                         tmp_path: Path) -> None:
    close_warm()  # the rollout's browser is then this process's newest, the one KillingBlobStore kills
    queries = [goal_query(shop.spec, "cart", "q-cart"), goal_query(shop.spec, "settings_saved", "q-settings")]
    blobs = KillingBlobStore(tmp_path / "blobs", kill_at=3)
    settings = RolloutSettings(policy="replay", viewport="desktop", contexts=2, max_fault_retries=1, chromium=chromium)
    out = rollout([q.model_dump() for q in queries], run_id="run-kill", settings=settings, blobs=blobs)

    assert blobs.killed
    episodes = cast(list[Episode], out.rows["episodes"])
    faults = [e for e in episodes if e.status == "env_fault"]
    assert faults, "the kill must cost at least the episode it interrupted"
    assert all(e.fault_kind == "browser_crash" and e.attempt == 1 for e in faults), [(e.fault_kind, e.attempt, e.fault) for e in faults]
    for q in queries:
        mine = [e for e in episodes if e.query_id == q.query_id]
        assert [e.attempt for e in mine] == list(range(1, len(mine) + 1))
        assert [e.episode_id for e in mine] == [episode_id_for("run-kill", q.query_id, a)
                                                for a in range(1, len(mine) + 1)]
        assert mine[-1].status == "terminated", mine[-1].fault
        ok, reason = shop.check(q.checker, json.loads(q.checker_params_json), json.loads(mine[-1].final_state_json))
        assert ok, reason
    assert len({e.episode_id for e in episodes}) == len(episodes)
    assert out.dropped == {"env_fault browser_crash: rerun": len(faults)}
    steps = cast(list[Step], out.rows["steps"])
    assert {s.episode_id for s in steps} <= {e.episode_id for e in episodes}
    assert len(steps) == sum(e.num_steps for e in episodes)


@pytest.mark.browser
def test_faults_without_reruns_left_are_counted(chromium: Path, shop: BundledApp, tmp_path: Path) -> None:
    close_warm()  # as above
    blobs = KillingBlobStore(tmp_path / "blobs", kill_at=2)
    settings = RolloutSettings(policy="replay", viewport="mobile", contexts=1, max_fault_retries=0, chromium=chromium)
    out = rollout([goal_query(shop.spec, "cart", "q-once").model_dump()], run_id="run-once",
                  settings=settings, blobs=blobs)
    [episode] = cast(list[Episode], out.rows["episodes"])
    assert (episode.status, episode.fault_kind, episode.attempt) == ("env_fault", "browser_crash", 1)
    assert out.dropped == {"env_fault browser_crash: no reruns left": 1}


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.browser
def test_app_server_down_is_classified(chromium: Path, shop: BundledApp, server: AppServer,
                                       tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{_unused_port()}"
    with BrowserEnv(chromium=chromium, apps={"Gone": down + "/"}) as env:
        with pytest.raises(EnvFault) as fault:
            env.reset("down", down + "/")
        assert fault.value.kind == "app_down"

        query = goal_query(shop.spec, "cart", "q-down")
        episode, steps = run_episode(env, ReplayPolicy(shop.spec), query, run_id="t", episode_id="ep-down",
                                     blobs=BlobStore(tmp_path / "blobs"), start_url=down + "/")
        assert (episode.status, episode.fault_kind, steps) == ("env_fault", "app_down", [])

        # Mid-episode: opening the app, or following a link to it, while its server is down.
        env.reset("up", server.base_url + "/")
        with pytest.raises(EnvFault) as fault:
            env.act({"type": "open", "text": "Gone"})
        assert fault.value.kind == "app_down"
        env.reset("up", server.base_url + "/")
        env.page.evaluate("url => document.body.insertAdjacentHTML('afterbegin', "
                          "`<a href='${url}' style='position:fixed;left:0;top:0;padding:20px'>Gone</a>`)", down)
        assert env.act({"type": "click", "x": 10, "y": 10}) is None
        with pytest.raises(EnvFault) as fault:
            env.observe()
        assert fault.value.kind == "app_down"


class _Failing(http.server.BaseHTTPRequestHandler):
    """An app whose pages fail: each is an error page with a body, as a crashed handler serves it."""

    def do_GET(self) -> None:
        body = b"<html><body><h1>Internal Server Error</h1><button>Retry</button></body></html>"
        self.send_response(500)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # its reset endpoint still works: only its pages fail
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.browser
def test_a_page_that_loads_with_a_server_error_is_an_env_fault_not_a_failed_task(
        chromium: Path, shop: BundledApp, server: AppServer, tmp_path: Path) -> None:
    """The page renders (a heading, a button a policy could click), yet it is the app failing: the episode is
    an environment fault, rerun by the rollout, never a failure to be learned from."""
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{failing.server_address[1]}/"
    try:  # the failing server is one of the env's apps: a 5xx of another site is a page the agent sees
        with BrowserEnv(chromium=chromium, apps={"Failing": url}) as env:
            env.reset("s500", url)
            with pytest.raises(EnvFault, match=f"HTTP 500 for {url}") as fault:
                env.observe()
            assert fault.value.kind == "app_down"
            episode, steps = run_episode(env, ReplayPolicy(shop.spec), goal_query(shop.spec, "cart", "q-500"),
                                         run_id="t", episode_id="ep-500", blobs=BlobStore(tmp_path / "blobs"),
                                         start_url=url)
            assert (episode.status, episode.fault_kind, steps) == ("env_fault", "app_down", [])
            # Mid-episode: a link on a working page leads to the failing one; the next reset clears it.
            env.reset("up", server.base_url + "/")
            env.observe()
            env.page.evaluate("url => document.body.insertAdjacentHTML('afterbegin', "
                              "`<a href='${url}' style='position:fixed;left:0;top:0;padding:20px'>Gone</a>`)", url)
            assert env.act({"type": "click", "x": 10, "y": 10}) is None
            with pytest.raises(EnvFault, match="HTTP 500"):
                env.observe()
            env.reset("up-again", server.base_url + "/")
            assert env.observe().title
    finally:
        failing.shutdown()


@pytest.mark.browser
def test_a_server_that_never_answers_is_a_timeout(chromium: Path, server: AppServer) -> None:
    with socket.socket() as silent, BrowserEnv(chromium=chromium, action_timeout_s=1) as env:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections are accepted by the kernel, never answered
        with pytest.raises(EnvFault) as fault:
            env.reset("silent", f"http://127.0.0.1:{silent.getsockname()[1]}/", app_protocol=False)
        assert fault.value.kind == "timeout"
        env.reset("after", server.base_url + "/")  # the env recovers at its next reset
        assert env.observe().title.startswith("Home")


@pytest.mark.browser
def test_a_secret_is_typed_as_its_value_and_recorded_as_its_placeholder(
        pool: EnvPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The env types `<secret>account_password</secret>` as $TRAJFORGE_SECRET_ACCOUNT_PASSWORD, so Harbor ID signs
    alice in; the password field shows bullets; an unset secret is an invalid action that types nothing."""
    from test_apps import ACCOUNT_PASSWORD

    env = pool.envs[0]
    placeholder = "<secret>account_password</secret>"
    monkeypatch.delenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", raising=False)
    with AppServer(load_app("account")) as account:
        env.reset("secret", account.base_url + "/")
        for name, text in (("Username", "alice"), ("Password", placeholder)):
            [(x, y, w, h)] = env.find_element("textbox", name)
            assert env.act({"type": "click", "x": x + w / 2, "y": y + h / 2}) is None
            if name == "Password":
                assert env.act({"type": "type", "text": text}) == (
                    "type: secret 'account_password' is not set (TRAJFORGE_SECRET_ACCOUNT_PASSWORD)")
                assert env.page.get_by_label("Password").input_value() == ""
                monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", ACCOUNT_PASSWORD)
            assert env.act({"type": "type", "text": text}) is None
        tree = env.observe().ax_tree
        assert f'textbox "Password" [focused]: {"•" * len(ACCOUNT_PASSWORD)}' in tree and ACCOUNT_PASSWORD not in tree
        [(x, y, w, h)] = env.find_element("button", "Sign in")
        assert env.act({"type": "click", "x": x + w / 2, "y": y + h / 2}) is None
        state = env.app_state()
    assert state["signed_in"] == "alice" and state["failed_sign_ins"] == 0
    assert ACCOUNT_PASSWORD not in json.dumps(state), "the interaction recorder keeps a password field as bullets"


PIECES = ('<p>Your recovery code: 481-<b>S3CR3T</b></p><div id="otp">'
          + "".join(f'<input aria-label="Digit {i}" maxlength="1" size="1">' for i in range(1, 5)) + "</div>")
"""A code the page breaks with markup (two runs of text), and a one-time-code widget: a box a digit."""
MOVE_ON = """() => { const boxes = [...document.querySelectorAll('#otp input')];
  boxes.forEach((box, i) => box.addEventListener('input', () => boxes[i + 1]?.focus())); }"""
"""The widget's script: each digit typed moves the focus to the next box, as one-time-code forms do."""


@pytest.mark.browser
def test_a_secret_shown_in_pieces_is_masked_and_covered_piece_by_piece(
        pool: EnvPool, server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-time code typed into a widget of one box a digit, and a code the page breaks with markup, are whole
    in no node of the tree: each piece is masked in the tree's text and covered on the screenshot. The app's
    recorder reports each box's digit on its own: its reports in the app's state are masked too."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ONE_TIME_CODE", "4815")
    monkeypatch.setenv("TRAJFORGE_SECRET_RECOVERY_CODE", "481-S3CR3T")
    env = pool.envs[0]
    env.reset("pieces", server.base_url + "/")
    env.page.evaluate(f"document.body.insertAdjacentHTML('afterbegin', {json.dumps(PIECES)})")
    env.page.evaluate(MOVE_ON)
    [(x, y, w, h)] = env.find_element("textbox", "Digit 1")
    assert env.act({"type": "click", "x": x + w / 2, "y": y + h / 2}) is None
    assert env.act({"type": "type", "text": "<secret>one_time_code</secret>"}) is None
    assert [env.page.get_by_label(f"Digit {i}").input_value() for i in range(1, 5)] == list("4815")
    seen = env.observe()

    shown = {n.name: n for n in parse(seen.ax_tree)}
    assert [shown[f"Digit {i}"].value for i in range(1, 5)] == ["<secret>one_time_code</secret>"] * 4
    assert "S3CR3T" not in seen.ax_tree and "481-" not in seen.ax_tree, seen.ax_tree
    assert seen.ax_tree.count("<secret>recovery_code</secret>") == 2  # each run of text holds its piece's place
    assert not any("S3CR3T" in n.name or "481-" in n.name or n.value.isdigit() for n in seen.nodes)  # nodes too
    pieces = [n.box for n in seen.nodes if "<secret>recovery_code</secret>" in n.name or n.name.startswith("Digit")]
    image = Image.open(io.BytesIO(seen.png)).convert("RGB")
    assert len(pieces) == 6 and all(
        box is not None and image.crop((box[0], box[1], box[0] + box[2], box[1] + box[3])).getcolors()
        == [(box[2] * box[3], (0, 0, 0))] for box in pieces)
    x, y, w, h = next(n.box for n in seen.nodes if n.role == "heading" and n.box is not None)
    assert len(image.crop((x, y, x + w, y + h)).getcolors(4096)) > 1  # the rest of the page is left as it is
    for _ in range(50):  # the recorder's beacons may still be on their way
        typed = {e["name"]: e["text"] for e in env.app_state()["ui_events"] if e["op"] == "type_at"}
        if len(typed) == 4:
            break
        time.sleep(0.1)
    assert typed == {f"Digit {i}": "<secret>one_time_code</secret>" for i in range(1, 5)}


@pytest.mark.browser
def test_a_page_an_episode_opened_does_not_outlive_it(pool: EnvPool, server: AppServer) -> None:
    """A link to a new tab opens a page the env does not observe, whose origin's storage no reset clears: the
    next reset leaves none open (they piled up for the run, a renderer each)."""
    env = pool.envs[0]
    env.reset("opener", server.base_url + "/")
    env.page.evaluate("() => { window.open(location.href); window.open(location.href); }")
    for _ in range(50):
        if len(env.page.context.pages) == 3:
            break
        time.sleep(0.1)
    assert len(env.page.context.pages) == 3
    env.reset("next", server.base_url + "/")
    assert len(env.page.context.pages) == 1 and env.observe().title.startswith("Home")


OFF_THE_TREE = ('<p id="hidden" aria-hidden="true">Card code zq9secretXY</p>'
                '<input id="pw" type="password" value="zq9secretXY" aria-label="Password">'
                '<iframe id="pay" style="width:300px;height:120px" srcdoc="'
                '<p>Code zq9secretXY</p><input aria-label=Code value=zq9secretXY>"></iframe>')
"""A secret where the accessibility tree does not read it: text the page hides from it, and a payment frame."""


@pytest.mark.browser
def test_a_secret_the_tree_does_not_hold_is_covered_on_the_screenshot(
        pool: EnvPool, server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree is the main frame's, less what `aria-hidden` hides: a code shown in a sign-in or payment frame,
    or in hidden-from-the-tree text, was on the recorded screenshot (and so in OCR's rows) in clear. Such text
    is covered (a frame's by the frame's box); a password field's bullets are left as they are."""
    monkeypatch.setenv("TRAJFORGE_SECRET_CARD_CODE", "zq9secretXY")
    env = pool.envs[0]
    env.reset("off-the-tree", server.base_url + "/")
    env.page.evaluate(f"document.body.insertAdjacentHTML('afterbegin', {json.dumps(OFF_THE_TREE)})")
    env.page.frame_locator("#pay").get_by_label("Code").wait_for()
    seen = env.observe()
    assert "zq9secretXY" not in seen.ax_tree
    image = Image.open(io.BytesIO(seen.png)).convert("RGB")

    def black(selector: str) -> bool:
        x, y, w, h = env.page.evaluate(f"""() => {{ const r = document.querySelector('{selector}')
          .getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; }}""")
        inside = image.crop((int(x) + 1, int(y) + 1, int(x + w) - 1, int(y + h) - 1))
        return inside.getcolors() == [(inside.width * inside.height, (0, 0, 0))]

    assert black("#pay")
    text = env.page.evaluate("""() => { const range = document.createRange();  // the text's own box
      range.selectNodeContents(document.querySelector('#hidden')); const r = range.getBoundingClientRect();
      return [r.x, r.y, r.width, r.height]; }""")
    inside = image.crop((int(text[0]) + 1, int(text[1]) + 1, int(text[0] + text[2]) - 1, int(text[1] + text[3]) - 1))
    assert inside.getcolors() == [(inside.width * inside.height, (0, 0, 0))]
    assert not black("#pw")


@pytest.mark.browser
def test_a_page_is_recorded_by_its_path_on_any_port_and_a_secret_sent_by_get_masked(
        pool: EnvPool, server: AppServer, shop: BundledApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundled app answers on a new port every night: the same steps on two servers of the shop record the same
    URLs, its paths. A secret typed into a form sent by GET is in the live URL, URL-encoded, and in no
    observation's URL, tree, nodes or app state, nor in a click's target or a fault's message; a page on another
    origin keeps its whole URL."""
    # A space, a *, a ~ and an @: the browser's query string carries "harbor+*Tide%7E%408312", which Python's
    # quote_plus would write "harbor+%2ATide~%408312".
    secret = "harbor *Tide~@8312"
    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", secret)
    env = pool.envs[0]
    seen: list[list[str]] = []
    with AppServer(shop) as other:
        assert other.base_url != server.base_url
        for base in (server.base_url, other.base_url):
            env.reset("urls", base + "/search")
            [(x, y, w, h)] = env.find_element("searchbox", "Search dishes")
            assert env.act({"type": "click", "x": x + w / 2, "y": y + h / 2}) is None
            assert env.act({"type": "type", "text": "<secret>account_password</secret>"}) is None
            assert env.act({"type": "key", "keys": ["Enter"]}) is None
            assert "harbor+*Tide%7E%408312" in env.url  # the live page's URL, what the app answered
            assert "harbor" not in str(EnvFault(f"the page did not load ({env.url})"))  # a fault's message names it
            searched = env.observe()
            # A plain field: the value is in the tree (the search box, the results' heading), masked.
            assert "harbor" not in searched.ax_tree and searched.ax_tree.count(
                "<secret>account_password</secret>") >= 2, searched.ax_tree
            assert not any("harbor" in n.name or "harbor" in n.value for n in searched.nodes)
            assert "harbor" not in json.dumps(env.app_state())  # the recorder's report of the field
            # A click on the results' heading: the step's target, as the recorder reads it, is masked.
            heading = next(n for n in searched.nodes if n.role == "heading" and "<secret>" in n.name)
            assert heading.box is not None
            target = env.element_at(heading.box[0] + heading.box[2] / 2, heading.box[1] + heading.box[3] / 2)
            assert target is not None and "<secret>account_password</secret>" in target.name, target
            # ... and on the screenshot, where those nodes are, covered
            shown = [n.box for n in searched.nodes if "<secret>account_password</secret>" in n.name + n.value
                     and n.box is not None]
            image = Image.open(io.BytesIO(searched.png)).convert("RGB")
            assert len(shown) >= 2 and all(image.crop((x, y, x + w, y + h)).getcolors() == [(w * h, (0, 0, 0))]
                                           for x, y, w, h in shown)
            env.reset("urls", base + "/")
            seen.append([searched.url, env.observe().url])
    assert seen[0] == seen[1] == ["/search?q=<secret>account_password</secret>", "/"]
    assert recorded_url("http://127.0.0.1:8001/cart", "http://127.0.0.1:800") == "http://127.0.0.1:8001/cart"
    assert recorded_url("https://example.org/a?b=1", "http://127.0.0.1:8001") == "https://example.org/a?b=1"


@pytest.mark.browser
def test_a_click_on_a_piece_of_a_secret_names_its_target_masked(
        pool: EnvPool, server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A code the page breaks with markup (`481-<b>S3CR3T</b>`): a click on either run of text names its target
    as the observation shows that text, masked, not the run's own piece, which holds no secret whole. The target's
    name goes into the step row, and from there into manuals, guidance and the critics' prompts."""
    monkeypatch.setenv("TRAJFORGE_SECRET_RECOVERY_CODE", "481-S3CR3T")
    env = pool.envs[0]
    env.reset("pieces", server.base_url + "/")
    env.page.evaluate(f"document.body.insertAdjacentHTML('afterbegin', {json.dumps(PIECES)})")
    seen = env.observe()
    centre = "sel => { const r = document.querySelector(sel).getBoundingClientRect(); return [r.x + 4, r.y + 4]; }"
    bold, start = env.element_at(*env.page.evaluate(centre, "b")), env.element_at(*env.page.evaluate(centre, "p"))
    assert bold is not None and start is not None
    assert "S3CR3T" not in bold.name and "481-" not in start.name, (bold, start)
    assert {bold.name, start.name} <= {n.name for n in seen.nodes}  # as the observation names them
    assert bold.name == "<secret>recovery_code</secret>"


def test_a_call_that_raises_drops_the_calls_not_begun() -> None:
    """map_envs raises the first error once the running calls end, without running the queued ones: interface
    validation's page visits went on for minutes after its shard had failed."""
    began: list[int] = []

    def visit(env: str, item: int) -> int:
        began.append(item)
        if item == 0:
            raise EnvFault("the start page did not load", "timeout")
        time.sleep(0.2)  # the queued calls are dropped while this one runs
        return item

    with pytest.raises(EnvFault, match="start page"):
        map_envs(["env"], visit, range(20))
    assert began[0] == 0 and len(began) <= 2

"""Secrets and faults at the edges of a real page in real Chromium: a digit-only secret beside the tree's numbers,
a secret typed into a field of no size, a dead link to another site, and a popup that closed itself."""

from __future__ import annotations

import http.server
import io
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image
from test_env_pool import _Failing  # a site whose pages fail with a server error

from trajforge.envs import secrets
from trajforge.envs.apps import AppServer
from trajforge.envs.axtree import parse
from trajforge.envs.browser import BrowserEnv, EnvFault, PixelBox


@pytest.fixture(scope="module")
def env(chromium: Path) -> Iterator[BrowserEnv]:
    with BrowserEnv(viewport="desktop", chromium=chromium) as e:
        yield e


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _black(png: bytes, box: PixelBox) -> bool:
    x, y, w, h = box
    inside = Image.open(io.BytesIO(png)).convert("RGB").crop((x, y, x + w, y + h))
    return inside.getcolors() == [(w * h, (0, 0, 0))]


def test_a_box_of_no_size_covers_nothing() -> None:
    """Pillow refuses the inverted rectangle a zero-size box would draw: the screenshot comes back unchanged."""
    out = io.BytesIO()
    Image.new("RGB", (20, 20), "white").save(out, format="PNG")
    covered = Image.open(io.BytesIO(secrets.cover(out.getvalue(), [(5, 5, 0, 10), (5, 5, 10, 0)])))
    assert covered.convert("RGB").getcolors() == [(400, (255, 255, 255))]


PIN_PAGE = ('<button style="position:absolute;left:20px;top:2580px;width:120px;height:40px">Add to cart</button>'
            '<input aria-label="PIN" style="position:fixed;left:20px;top:20px;width:200px;height:30px">')
"""A button whose box's y is the PIN's digits, and a field to type the PIN into."""


@pytest.mark.browser
def test_a_digit_only_secret_is_masked_in_names_and_values_never_in_the_tree_s_numbers(
        env: BrowserEnv, server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the README's PIN 2580 set, a node at y=2580 rendered as `(20,<secret>pin</secret>,120,40)`: the tree
    text could not be parsed, and what reads it (grounding, an app directory's element check) lost the screen.
    The PIN typed into a field is masked in its value and covered; the boxes keep their numbers."""
    monkeypatch.setenv("TRAJFORGE_SECRET_PIN", "2580")
    env.reset("pin", server.base_url + "/")
    env.page.evaluate(f"document.body.insertAdjacentHTML('beforeend', {json.dumps(PIN_PAGE)})")
    [(x, y, w, h)] = env.find_element("textbox", "PIN")
    assert env.act({"type": "click", "x": x + w / 2, "y": y + h / 2}) is None
    assert env.act({"type": "type", "text": "<secret>pin</secret>"}) is None
    seen = env.observe()

    assert parse(seen.ax_tree) == list(seen.nodes)
    button = next(n for n in seen.nodes if n.role == "button" and n.name == "Add to cart" and n.box is not None
                  and n.box[1] == 2580)
    assert f'button "Add to cart" ({",".join(map(str, button.box))})' in seen.ax_tree
    field = next(n for n in seen.nodes if n.name == "PIN")
    assert field.value == "<secret>pin</secret>" and "2580" not in field.value
    assert field.box is not None and _black(seen.png, field.box)


HIDDEN_CODE = ('<div role="group" aria-label="One-time code" style="position:fixed;left:300px;top:100px;'
               'width:200px;height:40px;background:white"><input id="code" aria-label="Code" '
               'style="width:0;height:0;border:0;padding:0"></div>')
"""A visually hidden field (no width, no height) that takes a one-time code, inside a group the page shows."""


@pytest.mark.browser
def test_a_secret_typed_into_a_field_of_no_size_covers_its_closest_ancestor_with_a_box(
        env: BrowserEnv, server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The field's box is 0 x 0: covering it drew an inverted rectangle, Pillow raised ValueError, and the shard
    failed on every resume. Its group's box is covered instead."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ONE_TIME_CODE", "735194")
    env.reset("hidden-code", server.base_url + "/")
    env.page.evaluate(f"document.body.insertAdjacentHTML('beforeend', {json.dumps(HIDDEN_CODE)})")
    env.page.evaluate("document.querySelector('#code').focus()")
    assert env.act({"type": "type", "text": "<secret>one_time_code</secret>"}) is None
    assert env.page.evaluate("document.querySelector('#code').value") == "735194"
    seen = env.observe()

    field = next(n for n in seen.nodes if n.name == "Code")
    assert field.value == "<secret>one_time_code</secret>" and field.box is not None and field.box[2:] == (0, 0)
    group = next(n for n in seen.nodes if n.role == "group" and n.name == "One-time code")
    assert group.box == (300, 100, 200, 40) and _black(seen.png, group.box)


def _follow(env: BrowserEnv, url: str) -> None:
    """Click a link to `url` that the page shows at its top left."""
    env.page.evaluate("url => document.body.insertAdjacentHTML('afterbegin', "
                      "`<a href='${url}' style='position:fixed;left:0;top:0;padding:20px;z-index:9'>Away</a>`)", url)
    assert env.act({"type": "click", "x": 10, "y": 10}) is None


@pytest.mark.browser
def test_a_dead_link_to_another_site_is_the_agent_s_page_and_a_dead_app_a_fault(
        chromium: Path, server: AppServer) -> None:
    """A link the agent follows off its app (a "Powered by" footer on a machine without network) led to the
    browser's error page, and every such page was an app_down fault: an env_fault episode, rerun the same way
    until its retries ran out, never judged. Another site's failure (unreachable, or a 5xx) is now an
    observation like any page; the app's own origin and the apps `open` launches still fault."""
    dead_app = f"http://127.0.0.1:{_unused_port()}"
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    try:
        with BrowserEnv(viewport="desktop", chromium=chromium, apps={"Gone": dead_app + "/"}) as env:
            env.reset("unreachable", server.base_url + "/")
            _follow(env, f"http://127.0.0.1:{_unused_port()}/")
            assert env.observe().url.startswith("chrome-error://")  # the browser's error page, no fault
            env.reset("server-error", server.base_url + "/")
            _follow(env, f"http://127.0.0.1:{failing.server_address[1]}/")
            assert any(n.name == "Internal Server Error" for n in env.observe().nodes)
            env.reset("launcher", server.base_url + "/")
            _follow(env, dead_app + "/")
            with pytest.raises(EnvFault, match=re.escape(f"could not be loaded ({dead_app}/)")) as fault:
                env.observe()
            assert fault.value.kind == "app_down"
    finally:
        failing.shutdown()


class _SignIn(http.server.BaseHTTPRequestHandler):
    """A sign-in site on an origin of its own: /popup keeps a token in localStorage and closes its window, as an
    OAuth window does; /read shows the page."""

    def do_GET(self) -> None:
        script = ("localStorage.setItem('token', 'leaked'); opener.postMessage(localStorage.getItem('token'), '*');"
                  " window.close();") if self.path == "/popup" else ""
        body = f"<html><body><h1>Sign-in</h1><script>{script}</script></body></html>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.browser
def test_the_storage_of_a_popup_that_closed_itself_does_not_outlive_its_episode(
        env: BrowserEnv, server: AppServer) -> None:
    """The popup was gone by the reset, so the context was kept, and its origin, never seen by the env's own
    page, was not cleared: the next episode started signed in there."""
    sign_in = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SignIn)
    threading.Thread(target=sign_in.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{sign_in.server_address[1]}"
    try:
        env.reset("popup", server.base_url + "/")
        kept = env.evaluate("""url => new Promise(done => {
          let token = null;
          addEventListener("message", event => { token = event.data; }, { once: true });
          const popup = window.open(url);
          const poll = setInterval(() => {
            if (popup.closed && token !== null) { clearInterval(poll); done(token); }
          }, 20);
        })""", origin + "/popup")
        assert kept == "leaked" and len(env.page.context.pages) == 1
        env.reset("next", server.base_url + "/")
        env.page.goto(origin + "/read")
        assert env.page.evaluate("localStorage.getItem('token')") is None
    finally:
        sign_in.shutdown()

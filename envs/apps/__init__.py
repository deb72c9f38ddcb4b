"""Bundled web apps: small, real, server-rendered apps that episodes run against.

Each app is a subpackage of `rollout.apps` with a `spec.yaml` (its page graph, see
`query_gen.graph`) and a `create_app()` that returns a `BundledApp`. The app renders
plain semantic HTML with real forms and links, so the accessibility tree has good roles
and names and every action that changes state is a real navigation. The one script every
page loads is the interaction recorder (`_shared/static/interactions.js`, served as
`/__kit/interactions.js`): it reports to the server what low-level operation the user did
on which element (click, double-click, right-click, text selection, drag, typing,
scrolling into view), because an atomic-operation task ("double-click the word
'parmesan'") changes no app state that a checker could read otherwise. The notes app adds
a script of its own to reorder its cards by dragging.

State lives on the server, one copy per session: the cookie `tf_session=<id>` picks
it, and an unknown session starts from the app's initial state. Episodes get their
own session, so many episodes can share one server without seeing each other.
Checkers read that state (`GET /__state`), never the screen: success is what the app
recorded, not what the page happened to show. The recorder's reports (`POST /__ui`) are
kept per session beside the app's state and shown in `/__state` under `ui_events`, once
there is one, so a session nobody touched reads exactly as the app's initial state;
`POST /__reset` clears them with the rest. Every app answers the `interaction` checker,
which reads them.
"""

from __future__ import annotations

import contextlib
import copy
import html
import importlib
import json
import mimetypes
import pkgutil
import secrets
import sys
import threading
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from trajforge.envs.spec import AppSpec, SpecError, load_spec

SESSION_COOKIE = "tf_session"

UI_EVENTS = "ui_events"
"""The key of the recorder's reports in `/__state`: a list of {op, role, name, text?,
to_role?, to_name?, page, at} in the order they arrived; `at` (ms since the epoch) is
when the page saw it."""

UI_OPS = ("click", "double_click", "right_click", "drag", "select_text", "type_at", "scroll_to")
"""What the recorder reports: the ops of query_gen.operations.Operation."""

MAX_UI_EVENTS = 200
"""Reports kept per session (the oldest go first): a long episode must not grow without bound."""

_UI_FIELDS = ("op", "role", "name", "text", "to_role", "to_name", "page", "at")
_MAX_UI_TEXT = 2000

RECORDER_SCRIPT = '<script src="/__kit/interactions.js" defer></script>'
"""The tag every page of every bundled app puts in its <head>."""

_RECORDER_PATH = Path(__file__).parent / "_shared" / "static" / "interactions.js"

Checker = Callable[[dict[str, str], dict[str, Any]], tuple[bool, str]]
"""(params, state) -> (success, reason). The reason says what was found in the state."""


@dataclass(frozen=True)
class Request:
    """What an app's handler sees of an HTTP request (form bodies already decoded)."""

    method: str
    path: str
    query: dict[str, str]
    form: dict[str, str]


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def html_response(body: str, status: int = 200) -> Response:
    return Response(status=status, body=body.encode())


def redirect(location: str) -> Response:
    """303 See Other: the browser follows a POST with a GET, so reloads never resubmit."""
    return Response(status=303, headers={"Location": location})


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(value).encode(), content_type="application/json")


def not_found(what: str) -> Response:
    return html_response(f"<!doctype html><title>Not found</title><h1>Not found</h1><p>{html.escape(what)}</p>", 404)


class BundledApp:
    """An app: its spec, its initial state, its request handler and its checkers.

    Subclasses set `checkers` and implement `initial_state` and `handle`. `handle`
    gets the session's state and may change it in place; the server holds a lock
    around it, so handlers need no locking of their own.
    """

    checkers: dict[str, Checker] = {}

    def __init__(self, name: str, package_dir: Path) -> None:
        self.name = name
        self.package_dir = package_dir
        self.spec_path = package_dir / "spec.yaml"
        self.spec: AppSpec = load_spec(self.spec_path)
        self.static_dir = package_dir / "static"

    def initial_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        raise NotImplementedError

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        """Run a named checker on a state: one of the app's, or the shared `interaction`.
        An unknown checker name is a caller error and raises."""
        fn = self.checkers.get(checker) or (check_interaction if checker == INTERACTION_CHECKER else None)
        if fn is None:
            known = sorted([*self.checkers, INTERACTION_CHECKER])
            raise ValueError(f"app {self.name!r} has no checker {checker!r}; known: {', '.join(known)}")
        return fn(params, state)


INTERACTION_CHECKER = "interaction"
"""The checker every bundled app answers (not one of its goal checkers): did the user do
this operation on this element, as the page's recorder reported it."""


def _same(a: object, b: object) -> bool:
    """Names and texts compare as a person reads them: case and spacing do not matter."""
    return " ".join(str(a).split()).casefold() == " ".join(str(b).split()).casefold()


def _said(event: dict[str, Any]) -> str:
    text = f"{event.get('op')} {event.get('role')} {event.get('name', '')!r}"
    if event.get("text") is not None:
        text += f" text {event['text']!r}"
    if event.get("to_role") is not None:
        text += f" onto {event['to_role']} {event.get('to_name', '')!r}"
    return text


def check_interaction(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The page recorded operation `op` on the element (`role`, `name`).

    Optional params narrow it: `text` (the word double-clicked, the passage selected, the
    value typed: for type_at the field's last value), `to_role` and `to_name` (where a
    drag was dropped). The reason names the matching event, or what was recorded instead.
    """
    absent = [k for k in ("op", "role", "name") if not params.get(k)]
    if absent:
        return False, f"checker params lack {', '.join(absent)}"
    if params["op"] not in UI_OPS:
        return False, f"checker param op is {params['op']!r}; known: {', '.join(UI_OPS)}"
    events = state.get(UI_EVENTS, [])
    on_element = [e for e in events if e["op"] == params["op"] and _same(e["role"], params["role"])
                  and _same(e["name"], params["name"])]
    if params["op"] == "type_at":  # what the field holds now, not what it held on the way
        on_element = sorted(on_element, key=lambda e: e["at"])[-1:]
    wanted = {k: params[k] for k in ("text", "to_role", "to_name") if params.get(k)}
    for event in on_element:
        if all(_same(event.get(k, ""), v) for k, v in wanted.items()):
            return True, f"recorded {_said(event)}"
    target = _said({k: params.get(k) for k in ("op", "role", "name", "text", "to_role", "to_name")})
    seen = "; ".join(_said(e) for e in events[-5:]) or "nothing"
    return False, f"no {target} was recorded; the last recorded: {seen}"


class UnknownAppError(LookupError):
    """No bundled app has that name; the message lists the ones there are."""


def known_apps() -> list[str]:
    """Names of the bundled apps: the subpackages of rollout.apps."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def load_app(name: str) -> BundledApp:
    """The bundled app `name`, its spec validated and every goal's checker present."""
    apps = known_apps()
    if name not in apps:
        raise UnknownAppError(f"unknown app {name!r}; bundled apps: {', '.join(apps) or '(none)'}")
    module = importlib.import_module(f"{__name__}.{name}")
    app: BundledApp = module.create_app()
    for page_id, page in app.spec.pages.items():
        if page.goal is not None and page.goal.checker not in app.checkers:
            raise SpecError(
                f"{app.spec_path}: pages.{page_id}.goal.checker: app {name!r} has no checker "
                f"{page.goal.checker!r}; known: {', '.join(sorted(app.checkers))}"
            )
    return app


class _Sessions:
    """Per-session state, created from the app's initial state on first use, and the
    recorder's reports, kept apart so the app's handlers never see them."""

    def __init__(self, app: BundledApp) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.states: dict[str, dict[str, Any]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}

    def get(self, session_id: str) -> dict[str, Any]:
        if session_id not in self.states:
            self.states[session_id] = self.app.initial_state()
        return self.states[session_id]

    def view(self, session_id: str) -> dict[str, Any]:
        """What `/__state` shows: the app's state, plus `ui_events` once the page reported one."""
        state = self.get(session_id)
        events = self.events.get(session_id)
        return {**state, UI_EVENTS: events} if events else state

    def reset(self, session_id: str) -> dict[str, Any]:
        self.states[session_id] = self.app.initial_state()
        self.events.pop(session_id, None)
        return self.states[session_id]

    def record(self, session_id: str, events: list[dict[str, Any]]) -> None:
        """Keep the reports. Of the typing reports of one field on one page only the
        latest (by `at`) is kept: it holds the field's whole value, and one report per
        keystroke would say the same thing letter by letter."""
        kept = self.events.setdefault(session_id, [])
        for event in events:
            if event["op"] == "type_at":
                same = [e for e in kept if e["op"] == "type_at"
                        and all(e.get(k) == event.get(k) for k in ("role", "name", "page"))]
                if any(e["at"] >= event["at"] for e in same):
                    continue  # a keystroke's report that arrived after a later one's
                kept[:] = [e for e in kept if e not in same]
            kept.append(event)
        del kept[:-MAX_UI_EVENTS]


def _parse_ui_events(body: str) -> list[dict[str, Any]]:
    """The recorder's report (a JSON object or list of them) as events; raises ValueError
    naming the item and field that is wrong."""
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    items = raw if isinstance(raw, list) else [raw]
    events: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"[{i}]: must be an object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(_UI_FIELDS))
        if unknown:
            raise ValueError(f"[{i}]: unknown field {unknown[0]!r}; known: {', '.join(_UI_FIELDS)}")
        if item.get("op") not in UI_OPS:
            raise ValueError(f"[{i}].op: {item.get('op')!r} is not one of {', '.join(UI_OPS)}")
        for key in ("role", "name", "page"):
            if key not in item:
                raise ValueError(f"[{i}].{key}: missing")
        if not isinstance(item.get("at"), (int, float)) or isinstance(item.get("at"), bool):
            raise ValueError(f"[{i}].at: must be a number (ms since the epoch), got {item.get('at')!r}")
        for key, value in item.items():
            if key != "at" and not isinstance(value, str):
                raise ValueError(f"[{i}].{key}: must be a string, got {type(value).__name__}")
        events.append({k: v[:_MAX_UI_TEXT] if isinstance(v, str) else v for k, v in item.items()})
    return events


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves a whole episode

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # an access log per request would drown the rollout's own logs

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _session_id(self) -> tuple[str, bool]:
        cookie: SimpleCookie = SimpleCookie()
        with contextlib.suppress(CookieError):  # a malformed header means no session, not a crash
            cookie.load(self.headers.get("Cookie", ""))
        if SESSION_COOKIE in cookie and cookie[SESSION_COOKIE].value:
            return cookie[SESSION_COOKIE].value, False
        return secrets.token_hex(8), True  # a person's browser without the cookie gets one

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        form = {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        request = Request(self.command, url.path, query, form)
        session_id, new = self._session_id()
        sessions = self.server.sessions
        app = sessions.app
        try:
            if request.path == "/__state" and request.method == "GET":
                with sessions.lock:
                    response = json_response(sessions.view(session_id))
            elif request.path == "/__ui" and request.method == "POST":
                response = self._record(session_id, body)
            elif request.path == "/__kit/interactions.js" and request.method == "GET":
                response = Response(body=_RECORDER_PATH.read_bytes(), content_type="text/javascript",
                                    headers={"Cache-Control": "max-age=3600"})
            elif request.path == "/__reset" and request.method == "POST":
                with sessions.lock:
                    response = json_response(sessions.reset(session_id))
            elif request.path.startswith("/static/") and request.method == "GET":
                response = _static(app, request.path.removeprefix("/static/"))
            else:
                with sessions.lock:
                    response = app.handle(request, sessions.get(session_id))
        except Exception as exc:  # a handler bug must show as a 500 page, not a dropped connection
            response = html_response(f"<!doctype html><title>Error</title><h1>Server error</h1><pre>"
                                     f"{html.escape(repr(exc))}</pre>", 500)
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.send_header("Cache-Control", "no-store")
        if new:
            self.send_header("Set-Cookie", f"{SESSION_COOKIE}={session_id}; Path=/; SameSite=Lax")
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def _record(self, session_id: str, body: str) -> Response:
        """POST /__ui: keep the recorder's report; 400 naming the field when it is malformed."""
        try:
            events = _parse_ui_events(body)
        except ValueError as exc:
            return Response(status=400, body=f"bad interaction report: {exc}".encode(),
                            content_type="text/plain; charset=utf-8")
        sessions = self.server.sessions
        with sessions.lock:
            sessions.record(session_id, events)
        return Response(status=204)


def _static(app: BundledApp, name: str) -> Response:
    path = (app.static_dir / name).resolve()
    if app.static_dir.resolve() not in path.parents or not path.is_file():
        return not_found(f"/static/{name}")
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return Response(body=path.read_bytes(), content_type=content_type,
                     headers={"Cache-Control": "max-age=3600"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the browser dropped the connection (a cancelled navigation): normal
        super().handle_error(request, client_address)

    def __init__(self, address: tuple[str, int], sessions: _Sessions) -> None:
        self.sessions = sessions
        super().__init__(address, _Handler)


class AppServer:
    """Serves one app on 127.0.0.1 (a free port) from a daemon thread.

    Use as a context manager; `base_url` is valid inside it. `state(session_id)` reads a
    session's state directly (for tests and debugging); agents and checkers use
    `GET /__state` with the session cookie like any client.
    """

    def __init__(self, app: BundledApp, port: int = 0) -> None:
        self.app = app
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("AppServer is not started; use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> AppServer:
        self._server = _Server(("127.0.0.1", self._port), _Sessions(self.app))
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"app-{self.app.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def state(self, session_id: str) -> dict[str, Any]:
        if self._server is None:
            raise RuntimeError("AppServer is not started")
        sessions = self._server.sessions
        with sessions.lock:
            return copy.deepcopy(sessions.view(session_id))

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

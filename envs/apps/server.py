"""The HTTP server: `AppServer` serves one bundled app, one state per session.

State lives on the server, one copy per session: the cookie `tf_session=<id>` picks
it, and an unknown session starts from the app's initial state. Episodes get their
own session, so many episodes can share one server without seeing each other.
Checkers read that state (`GET /__state`), never the screen: success is what the app
recorded, not what the page happened to show. The recorder's reports (`POST /__ui`) are
kept per session beside the app's state and shown in `/__state` under `ui_events`, once
there is one, so a session nobody touched reads exactly as the app's initial state;
`POST /__reset` clears them with the rest.
"""

from __future__ import annotations

import contextlib
import copy
import html
import mimetypes
import secrets
import sys
import threading
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.interaction import RECORDER_PATH, parse_ui_events
from trajforge.envs.apps.sessions import Sessions
from trajforge.envs.apps.web import Request, Response, html_response, json_response, not_found

SESSION_COOKIE = "tf_session"


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
                response = Response(body=RECORDER_PATH.read_bytes(), content_type="text/javascript",
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
        if "Cache-Control" not in response.headers:  # static files say how long they keep; pages never do
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
            events = parse_ui_events(body)
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

    def __init__(self, address: tuple[str, int], sessions: Sessions) -> None:
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
        self._server = _Server(("127.0.0.1", self._port), Sessions(self.app))
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


def main(argv: list[str] | None = None) -> None:
    """Serve one bundled app in the foreground (`python -m trajforge.envs.apps.server notes --port 8000`): for a
    person to look at, and as the command of an app directory that expresses a bundled app."""
    import argparse

    from trajforge.envs.apps.registry import load_app

    parser = argparse.ArgumentParser(prog="python -m trajforge.envs.apps.server", description=main.__doc__)
    parser.add_argument("app", help="a bundled app's name")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = AppServer(load_app(args.app), args.port).start()
    print(f"{args.app} at {server.base_url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])

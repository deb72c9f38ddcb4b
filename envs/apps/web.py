"""What a bundled app's handler gets and gives back: `Request`, `Response` and the helpers that
build the usual responses (a page, a redirect, JSON, a 404)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any


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

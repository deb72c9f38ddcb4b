"""A scripted OpenAI-compatible chat server on loopback, and the workspace of the stage tests that use one.

The server is the one stand-in in the tests, for the model edge we do not own: a real model server cannot be
made to answer 429, time out or break its JSON on demand (test_llm_failures.py), nor to give the answers a
stage's filters must keep and drop (test_synth.py, test_ces.py, test_pal_ui.py, test_agentic_q.py). Those
tests subclass `ScriptedServer` and answer each request from what it asked, through `completion`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings

GOOD = '{"label": "GOOD", "reason": "fine"}'


@dataclass(frozen=True)
class Reply:
    text: str = GOOD
    status: int = 200
    delay: float = 0.0
    raw: str | None = None
    finish_reason: str = "stop"
    headers: dict[str, str] | None = None


def completion(text: str, finish_reason: str = "stop") -> JSONResponse:
    """A chat completion answering `text`, with 11 prompt and 7 completion tokens."""
    return JSONResponse({
        "id": "scripted", "object": "chat.completion", "created": 0, "model": "scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    })


def message_parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A request message's content as parts, a plain string being one text part."""
    content = message["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def message_text(message: dict[str, Any]) -> str:
    """A request message's text parts, joined by spaces (its images left out)."""
    return " ".join(p["text"] for p in message_parts(message) if p["type"] == "text")


class ScriptedServer:
    """Answers each request with the next scripted reply (the last one repeats) and remembers what it got."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = Starlette(routes=[Route("/v1/chat/completions", self._completions, methods=["POST"])])
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=1)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _completions(self, request: Request) -> Response:
        self.requests.append({"headers": dict(request.headers), "body": await request.json(), "at": time.monotonic()})
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(reply.delay)
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            # A refused key is quoted back, as some servers do ("Incorrect API key provided: sk-...").
            key = request.headers.get("authorization", "").removeprefix("Bearer ") if reply.status == 401 else ""
            return JSONResponse(
                {"error": {"message": f"scripted {reply.status}" + (f": key {key} refused" if key else ""),
                           "type": "scripted"}}, status_code=reply.status, headers=reply.headers,
            )
        if reply.raw is not None:
            return Response(reply.raw, media_type="application/json")
        return completion(reply.text, reply.finish_reason)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "scripted server did not start"
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def notes_workspace(root: Path, url: str, *, cache: bool = True, vision: bool = False,
                    **sections: dict[str, Any]) -> Workspace:
    """A workspace in `root` whose nights generate queries for the notes app (two page-graph and one atomic),
    replay them on 2 contexts and ask the scripted server at `url`; `sections` are more settings (`synth`,
    `ces`, `pal_ui`, ...)."""
    endpoint = {"base_url": url, "model": "scripted", "max_retries": 0, "timeout_s": 10, "vision": vision}
    return Workspace.open(Settings(
        warehouse={"path": root / "wh"},
        query_gen={"apps": ["notes"], "num_queries": 2, "atomic_per_app": 1, "deep_search_apps": []},
        rollout={"policy": "replay", "contexts": 2},
        llm={"endpoints": {"m": endpoint}, "default": "m", "reask": 0, "cache": cache},
        **sections,
    ))

"""Serve the in-process model as an OpenAI-compatible `/v1/chat/completions` endpoint.

    python -m trajforge.llm.serve [--model smollm2|CHECKPOINT] [--host 127.0.0.1] [--port 8000]

Why: one machine can hold the model for several workers, and the gateway's HTTP path
(the one production uses against vLLM) is tested against a real model over real HTTP
on any machine. Non-streaming chat only; images as data URLs; the model's name must be
the one `/v1/models` lists, as vLLM requires.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from trajforge.llm.calls import Sampling
from trajforge.llm.local import LocalModel, load
from trajforge.llm.messages import ImagePart, Message, TextPart, unreadable
from trajforge.llm.structured import Constraint
from trajforge.schemas.config import load_settings


class ChatRequest(BaseModel):
    """The fields of OpenAI's request that the local model honours; others are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    response_format: dict[str, Any] | None = Field(
        default=None, description="{'type': 'json_schema', 'json_schema': {'schema': ...}}: the answer is one JSON "
        "object of that schema, held to it while decoding.")
    structured_outputs: dict[str, Any] | None = Field(
        default=None, description="vLLM's extension: {'grammar': an llguidance Lark grammar}.")

    def grammar(self) -> str | None:
        """The grammar the answer is held to, from either structured-output option; None: free decoding."""
        if self.structured_outputs and "grammar" in self.structured_outputs:
            return str(self.structured_outputs["grammar"])
        if self.response_format and self.response_format.get("type") == "json_schema":
            schema = self.response_format.get("json_schema", {}).get("schema")
            if not isinstance(schema, dict):
                raise HTTPException(400, "response_format.json_schema.schema: expected a JSON schema object")
            return Constraint("json", schema).grammar
        return None


def _part(part: dict[str, Any], where: str) -> TextPart | ImagePart:
    if part.get("type") == "text":
        return TextPart(text=str(part.get("text", "")))
    if part.get("type") == "image_url":
        url = str((part.get("image_url") or {}).get("url", ""))
        head, _, data = url.partition(";base64,")
        if not head.startswith("data:image/") or not data:
            raise HTTPException(
                400, f"{where}.image_url.url: only base64 data:image/... URLs are supported (no fetching)"
            )
        try:
            image = ImagePart(png=base64.b64decode(data, validate=True))
        except binascii.Error:
            raise HTTPException(400, f"{where}.image_url.url: not valid base64") from None
        if why := unreadable(image):  # a 500 for it was retried by every client, and failed alike each time
            raise HTTPException(400, f"{where}.image_url.url: {why}")
        return image
    raise HTTPException(400, f"{where}.type: {part.get('type')!r} is not supported (text, image_url)")


def _message(raw: dict[str, Any], i: int) -> Message:
    role, content = raw.get("role"), raw.get("content")
    if role not in ("system", "user", "assistant"):
        raise HTTPException(400, f"messages[{i}].role: {role!r} is not supported (system, user, assistant)")
    if isinstance(content, str):
        return Message(role=role, content=[TextPart(text=content)])
    if not isinstance(content, list):
        raise HTTPException(400, f"messages[{i}].content: expected a string or a list of parts")
    return Message(role=role, content=[_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)])


def create_app(model: LocalModel) -> FastAPI:
    app = FastAPI(title=f"trajforge model server: {model.model_id}")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.model_id, "object": "model", "owned_by": "trajforge"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest) -> dict[str, Any]:
        # A plain `def`: FastAPI runs it in a worker thread, so generation never blocks the server's loop.
        if request.model != model.model_id:
            raise HTTPException(
                404, f"model {request.model!r} is not served here; this server serves {model.model_id!r}"
            )
        if request.stream:
            raise HTTPException(400, "stream: streaming is not supported")
        messages = [_message(m, i) for i, m in enumerate(request.messages)]
        if not model.vision and any(m.images for m in messages):
            raise HTTPException(400, f"{model.model_id} is a text model and takes no images")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        sampling = Sampling(
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=tuple(stop),
            max_tokens=request.max_completion_tokens or request.max_tokens or Sampling().max_tokens,
        )
        try:
            answer = model.generate(messages, sampling, request.grammar())
        except ValueError as exc:  # a grammar that does not compile is the request's fault
            raise HTTPException(400, str(exc)) from None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model.model_id,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer.text},
                    "finish_reason": answer.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": answer.tokens_in,
                "completion_tokens": answer.tokens_out,
                "total_tokens": (answer.tokens_in or 0) + (answer.tokens_out or 0),
            },
        }

    return app


def main(argv: list[str] | None = None) -> None:
    local = load_settings().llm.local
    parser = argparse.ArgumentParser(prog="python -m trajforge.llm.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=local.model, help=f"'smollm2' or a checkpoint folder (default: {local.model})"
    )
    parser.add_argument("--cache-dir", type=Path, default=local.cache_dir, help="where the embedded model is converted")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    model = load(local.model_copy(update={"model": args.model, "cache_dir": args.cache_dir}))
    print(f"serving {model.model_id} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(model), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()

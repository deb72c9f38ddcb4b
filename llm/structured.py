"""Strict parsing of a model's answer into a pydantic model.

Strict, because a lenient parser (first brace to last brace, repaired quotes) turns a
confused answer into a confident row: the training data would learn from what the
parser guessed. An answer is either exactly one JSON object (optionally in one ```json
fence) or, for function calling, free reasoning followed by exactly one Qwen-style
`<tool_call>{...}</tool_call>` and nothing after it.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from trajforge.llm.prompts import OutputFormat

T = TypeVar("T", bound=BaseModel)

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ParseError(ValueError):
    """Why an answer is not the structured output asked for; said back to the model on a re-ask."""


def _json_object(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(f"not one JSON object: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(value, dict):
        raise ParseError(f"expected a JSON object, got a JSON {type(value).__name__}")
    return value


def extract(text: str, fmt: OutputFormat) -> object:
    """The JSON value of an answer in format `fmt` ('json' or 'tool_call')."""
    body = text.strip()
    if fmt == "json":
        fence = _FENCE.fullmatch(body)
        return _json_object(fence.group(1) if fence else body)
    if fmt == "tool_call":
        calls = _TOOL_CALL.findall(body)
        if len(calls) != 1:
            raise ParseError(f"expected exactly one <tool_call>...</tool_call>, found {len(calls)}")
        if body[body.rindex("</tool_call>") + len("</tool_call>") :].strip():
            raise ParseError("text after </tool_call>")
        return _json_object(calls[0].strip())
    raise ValueError(f"format {fmt!r} has no structure to parse")


def parse(text: str, fmt: OutputFormat, schema: type[T]) -> T:
    """The answer validated against `schema`; ParseError names the first fields that do not fit."""
    value = extract(text, fmt)
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(object)'}: {e['msg']}" for e in exc.errors()[:5])
        raise ParseError(f"does not match {schema.__name__}: {problems}") from None

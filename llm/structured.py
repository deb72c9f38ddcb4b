"""Strict parsing of a model's answer into a pydantic model.

Strict, because a lenient parser (first brace to last brace, repaired quotes) turns a
confused answer into a confident row: the training data would learn from what the
parser guessed. An answer is either exactly one JSON object (optionally in one ```json
fence) or, for function calling, free reasoning followed by exactly one Qwen-style
`<tool_call>{...}</tool_call>` and nothing after it, or (`think_answer`, the R1-style
layout CES and GUI-R1 reward) `<think>...</think>` then `<answer>...</answer>` and nothing
else, parsed as `ThinkAnswer`.

Where a backend can, the answer is also held to its format while it is decoded
(`Constraint`): a small model then cannot write an unparsable answer, only a wrong one.
The strict parse still runs on every answer, constrained or not.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from trajforge.llm.prompts import OutputFormat

T = TypeVar("T", bound=BaseModel)

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK_ANSWER = re.compile(r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_THINK_ANSWER_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
THINK_TOKENS, ANSWER_TOKENS = 48, 64
"""Most tokens of a think_answer's reasoning and answer while decoding (a prompt's max_tokens must hold both
and the four tags: 128 does)."""


class ThinkAnswer(BaseModel):
    """A `think_answer` answer: the reasoning, and the answer (an instruction, a state), never empty."""

    think: str
    answer: str = Field(min_length=1)


class ParseError(ValueError):
    """Why an answer is not the structured output asked for; said back to the model on a re-ask."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a key given twice: json.loads keeps the last one, a guess between two
    answers (`{"label": "GOOD", "label": "HARMFUL"}`)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        twice = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
        raise ParseError(f"key {', '.join(map(repr, twice))} given more than once")
    return value


def _no_constant(name: str) -> None:
    """JSON has no NaN or Infinity; Python's json reads them, and a row would keep a NaN no table can compare."""
    raise ParseError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """A number with a fraction or an exponent: Python's json reads one beyond a float's range (1e999) as an
    infinity, which the NaN check never sees and a row keeps."""
    value = float(text)
    if math.isinf(value):
        raise ParseError(f"the number {text[:32]} is beyond a float's range")
    return value


def _integer(text: str) -> int:
    """An integer: Python refuses one of over 4300 digits with a bare ValueError, which crashed the caller."""
    try:
        return int(text)
    except ValueError:
        raise ParseError(f"an integer of {len(text)} digits is too long") from None


def _json_object(text: str) -> object:
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite,
                           parse_int=_integer)
        # An escaped character cut in half ("\ud83d" of an emoji, at max_tokens) reads as a lone surrogate: no
        # text, and no Parquet file can hold it, so the row it reached failed its whole shard on every rerun.
        json.dumps(value, ensure_ascii=False).encode()
    except json.JSONDecodeError as exc:
        raise ParseError(f"not one JSON object: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeEncodeError as exc:
        raise ParseError(f"a string holds half a character ({exc.object[exc.start:exc.end]!r})") from None
    if not isinstance(value, dict):
        raise ParseError(f"expected a JSON object, got a JSON {type(value).__name__}")
    return value


def extract(text: str, fmt: OutputFormat) -> object:
    """The JSON value of an answer in format `fmt` ('json' or 'tool_call'); for 'think_answer', {think, answer}:
    the whole answer is the two tagged parts, whitespace around them only, and no tag inside either."""
    body = text.strip()
    if fmt == "think_answer":
        found = _THINK_ANSWER.fullmatch(body)
        if found is None:
            raise ParseError("expected <think>...</think> then <answer>...</answer> and nothing else")
        parts = {"think": found["think"].strip(), "answer": found["answer"].strip()}
        if any(tag in value for value in parts.values() for tag in _THINK_ANSWER_TAGS):
            raise ParseError("a tag inside <think> or <answer>")
        return parts
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


# ---------------------------------------------------------------- constrained decoding

REASONING_TOKENS = 64
"""Most tokens of a tool_call answer's <thinking> (its <conclusion> gets a third): bounded, so the call
itself always fits in the prompt's max_tokens (and a step of the embedded model costs about 150 tokens,
not the 200 it used to ramble to)."""

MAX_FREE_STRING = 200
"""Longest value of a string field whose schema sets no bound: without one a small model fills a
reason or an analysis until max_tokens cuts the object short, and the answer does not parse."""

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: one space after ',' and ':' and no other whitespace (a small model given
free whitespace can spend its whole budget on newlines)."""


@dataclass(frozen=True)
class Constraint:
    """What an answer must be while it is decoded: its format's layout around one JSON object of `schema`.

    The grammar is in llguidance's Lark dialect, which the in-process decoder and llguidance-backed
    servers (vLLM, SGLang) accept; servers that only take a JSON schema get `schema` itself.
    """

    format: OutputFormat
    schema: dict[str, Any]

    @functools.cached_property
    def json_schema(self) -> dict[str, Any]:
        """`schema` as the decoder holds it (see `_tight`): what a server that takes a JSON schema is sent."""
        return _tight(self.schema)

    @functools.cached_property
    def grammar(self) -> str:
        call = "%json " + json.dumps({**self.json_schema, "x-guidance": _COMPACT})
        if self.format == "json":
            return f"start: {call}\n"
        if self.format == "tool_call":  # GUI-Owl's answer: reasoning, a one-sentence conclusion, one call
            return (
                'start: "<thinking>" thinking "</thinking>\\n<conclusion>" conclusion '
                '"</conclusion>\\n<tool_call>\\n" call "\\n</tool_call>"\n'
                f"thinking[max_tokens={REASONING_TOKENS}]: /[^<]*/\n"
                f"conclusion[max_tokens={REASONING_TOKENS // 3}]: /[^<]*/\n"
                f"call: {call}\n"
            )
        if self.format == "think_answer":  # the JSON schema plays no part: the two parts are free text
            return (
                'start: "<think>" think "</think>\\n<answer>" answer "</answer>"\n'
                f"think[max_tokens={THINK_TOKENS}]: /[^<]*/\n"
                f"answer[max_tokens={ANSWER_TOKENS}]: /[^<]+/\n"
            )
        raise ValueError(f"format {self.format!r} has no structure to constrain")

    @functools.cached_property
    def key(self) -> str:
        """A short hash of the grammar, for the response cache's key."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()[:16]


def _tight(schema: Any) -> Any:
    """`schema` as a decoder should hold it: MAX_FREE_STRING on every free string (no length, pattern,
    enum or const of its own), and no properties beyond those declared where it does not say otherwise
    (JSON schema allows them by default, and a small model spends its budget on invented ones)."""
    if isinstance(schema, list):
        return [_tight(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _tight(v) for k, v in schema.items()}
    if out.get("type") == "string" and not {"maxLength", "pattern", "enum", "const", "format"} & out.keys():
        out["maxLength"] = MAX_FREE_STRING
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out

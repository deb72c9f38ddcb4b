"""What a model call takes (sampling) and gives back (text, parsed answer, the call's record).

The record is what rows and lineage keep of a call: which template and version, which
model, how it saw the screen, the sampling, tokens, latency, whether the cache answered,
and why it failed. It never holds a credential.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T", bound=BaseModel)

Enforcement = Literal["grammar", "json_schema"]
"""How a backend holds an answer to its format while decoding: the whole grammar (in process, or a
server that takes llguidance grammars), or only the JSON object's schema (`response_format`)."""

ObservationMode = Literal["text", "image", "ocr", "ocr+ax"]
"""How a call showed the screenshots: none, as images, as OCR text, as OCR text and accessibility tree."""


class Sampling(BaseModel):
    """Decoding parameters; part of the cache key, so give a `seed` to draw a second, different sample."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, gt=0)
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Completion:
    """One answer from a backend, before the gateway records it."""

    text: str
    finish_reason: str
    tokens_in: int | None
    tokens_out: int | None
    attempts: int = 1
    withheld: bool = False
    """No text came back (`content` null beside tool calls, or beside a reasoning parser's field): `text` is "" and
    the cache does not keep it, so a rerun asks again (cached, it was never asked again)."""


class CallRecord(BaseModel):
    """One request to a model (or to the cache in its place)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    template: str
    template_version: str
    model: str = Field(description="The configured name: 'local' or an endpoint.")
    model_id: str = Field(description="The model itself: the endpoint's model name or the local checkpoint.")
    backend: Literal["transformers", "openai"]
    observation_mode: ObservationMode = Field(
        description="How the model saw the screenshots: as images, or as OCR text (and accessibility tree)."
    )
    sampling: Sampling
    cache_key: str
    cached: bool = Field(description="Answered from the response cache; no model was asked.")
    reask: bool = Field(default=False, description="This call re-asked after an answer that did not parse.")
    attempts: int = Field(description="HTTP attempts including retries (0 when cached).")
    tokens_in: int | None = None
    tokens_out: int | None = None
    latency_ms: float
    finish_reason: str | None = None
    text: str = Field(default="", description="The raw answer.")
    parse_error: str | None = None
    constrained: Enforcement | None = Field(
        default=None, description="How the answer was held to its format while decoding; None: decoded freely, "
        "then parsed strictly.")
    error: str | None = Field(default=None, description="Why no answer came back.")


@dataclass(frozen=True)
class ChatResult(Generic[T]):
    """The answer to one `Gateway.chat`: the last call's text and parsed value, and every call made."""

    text: str
    parsed: T | None
    parse_error: str | None
    calls: tuple[CallRecord, ...]

    @property
    def record(self) -> CallRecord:
        """The call whose answer this is: the re-ask, if there was one and it got an answer."""
        return next(call for call in reversed(self.calls) if call.error is None)


class BackendError(Exception):
    """A request that got no usable answer from a backend; `attempts` counts the tries made."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class GatewayError(Exception):
    """A call that got no answer (after its retries); `record` says which call and why."""

    def __init__(self, record: CallRecord) -> None:
        super().__init__(
            f"{record.model} ({record.model_id}), template {record.template}@{record.template_version}: {record.error}"
        )
        self.record = record

"""The one way every stage calls a model: `Gateway.chat(prompt.render(...))`.

The same call serves a laptop (the embedded SmolLM2 in-process) and a cluster (named
OpenAI-compatible endpoints); the configuration decides which model answers. Around
each request the gateway adds what a data factory needs:

- the response cache, so a rerun of a stage makes no model call it already made;
- screenshots as OCR text plus accessibility tree for a model that cannot see them,
  and a record that says which observation the model got;
- strict structured output with at most one re-ask, failures kept with the raw answer;
- a `CallRecord` per request (template and version, model, sampling, tokens, latency)
  and running totals (`stats`) whose `models` and `prompts` go into snapshot lineage.

It is async; synchronous callers (the Playwright rollout loop) use `chat_sync`, which
runs the call on the gateway's own event loop thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, SecretStr

from trajforge.data.blobs import BlobCorrupted, BlobMissing, BlobStore
from trajforge.data.catalog import Catalog
from trajforge.llm import ocr
from trajforge.llm.cache import ResponseCache, cache_key
from trajforge.llm.calls import BackendError, CallRecord, ChatResult, Completion, Enforcement, GatewayError, Sampling
from trajforge.llm.local import LocalBackend
from trajforge.llm.messages import IMAGE_ERRORS, ImagePart, Message, TextPart, unreadable
from trajforge.llm.prompts import RenderedPrompt, load_prompt
from trajforge.llm.remote import OpenAIBackend
from trajforge.llm.structured import Constraint, ParseError, parse
from trajforge.schemas.config import EndpointSettings, LLMSettings, Settings, header_key

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
Backend = LocalBackend | OpenAIBackend


@dataclass
class GatewayStats:
    """Running totals of one gateway, for a stage's counts and its snapshot lineage."""

    calls: int = 0
    cache_hits: int = 0
    errors: int = 0
    reasks: int = 0
    parse_failures: int = 0
    tokens_in: int = 0  # spent: answers the cache gave are not counted again
    tokens_out: int = 0
    models: dict[str, str] = field(default_factory=dict)  # name -> model id, for Lineage.models
    prompts: dict[str, str] = field(default_factory=dict)  # template -> version, for Lineage.prompts


UNFINISHED = frozenset({"abort", "error", "content_filter"})
"""Finish reasons of an answer the server cut short (vLLM's and SGLang's abort and error, OpenAI's filter)."""


def _finished(answer: Completion) -> bool:
    """Whether the cache may keep this answer: not one the server aborted, failed or filtered, which may differ
    next time. Any other reason is kept (stop, length, and a server's own names or none at all: a rerun with
    nothing new must ask no model), as is an empty answer (greedy decoding gives it again), but not one whose text
    the server withheld (`Completion.withheld`)."""
    return answer.finish_reason not in UNFINISHED and not answer.withheld


def _api_key(name: str, endpoint: EndpointSettings) -> SecretStr | None:
    """The endpoint's key: given in the config (checked as it loaded), or read from the environment variable it
    names, checked alike (`header_key`)."""
    if endpoint.api_key is not None or endpoint.api_key_env is None:
        return endpoint.api_key
    where = f"llm.endpoints.{name}.api_key_env: environment variable {endpoint.api_key_env}"
    try:
        value = header_key(os.environ.get(endpoint.api_key_env) or "")
    except ValueError as exc:
        raise ValueError(f"{where} {exc}") from None
    if not value:
        raise ValueError(f"{where} is not set")
    return SecretStr(value)


def _held_to(constraint: Constraint | None, how: Enforcement | None) -> str | None:
    """What held the answer while it was decoded, for its cache key: a server sent the JSON schema decodes
    under other rules than one sent the grammar, so after `structured_output` changes the call is asked again.
    A grammar's key is its hash alone, as before `how` was keyed, so answers cached then are still found."""
    if constraint is None:
        return None
    return constraint.key if how == "grammar" else f"{how}:{constraint.key}"


class Gateway:
    """Models by name, with cache, records and re-asks: 'local', the configured endpoints, and the checkpoints
    the loop trains (`backend`).

    `db_url` is the catalog's database, where the response cache lives (None: no cache);
    `blobs` resolves images given by hash.
    """

    def __init__(self, settings: LLMSettings, *, db_url: str | None = None, blobs: BlobStore | None = None,
                 ocr_reader: ocr.OcrReader | None = None) -> None:
        self.settings = settings
        self.ocr = ocr_reader or ocr.reader_for(None, db_url)
        """Renders screenshots as text for text-only models; shared with the critics and synthesis."""
        self.blobs = blobs
        self.backends: dict[str, Backend] = {"local": LocalBackend(settings.local)}
        for name, endpoint in settings.endpoints.items():
            self.backends[name] = OpenAIBackend(name, endpoint, _api_key(name, endpoint))
        self._backends_lock = threading.Lock()
        self.cache = ResponseCache(db_url) if settings.cache and db_url else None
        self.stats = GatewayStats()
        self._reask = load_prompt("reask")
        self._thread: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
        self._thread_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> Gateway:
        """The gateway of a configuration, its cache in the catalog database and its blobs in the warehouse."""
        with Catalog.from_settings(settings.warehouse) as catalog:
            return cls(settings.llm, db_url=catalog.uri, blobs=BlobStore(catalog.warehouse / "blobs"),
                       ocr_reader=ocr.reader_for(settings.synth, catalog.uri))

    def sees_images(self, model: str | None = None) -> bool:
        """Whether `model` (default: the configured default) takes screenshots as images; a text-only model
        reads them as OCR text and the accessibility tree instead."""
        return self.backend(model or self.settings.default).sees_images

    def backend(self, name: str) -> Backend:
        """The backend answering a model name, made on first use: 'local', an endpoint's name, the absolute path
        of a checkpoint folder (the loop's new model, served in process beside 'local'), or ENDPOINT:MODEL (that
        endpoint asked for another model its server loads, as a checkpoint the user's server serves). Any other
        name is a ValueError that lists the configured ones."""
        with self._backends_lock:
            if name not in self.backends:
                self.backends[name] = self._new_backend(name)
            return self.backends[name]

    def _new_backend(self, name: str) -> Backend:
        endpoint, _, served = name.partition(":")
        if served and endpoint in self.settings.endpoints:
            settings = self.settings.endpoints[endpoint].model_copy(update={"model": served})
            return OpenAIBackend(name, settings, _api_key(endpoint, settings))
        if os.path.isabs(name):
            try:
                return LocalBackend(self.settings.local.model_copy(update={"model": name}))
            except FileNotFoundError as exc:
                raise ValueError(f"model {name!r}: {exc}") from None
        known = ", ".join(n for n in self.backends if not os.path.isabs(n) and ":" not in n)
        raise ValueError(f"no model named {name!r} (configured: {known}; or a checkpoint folder's absolute path, "
                         "or ENDPOINT:MODEL)")

    # ------------------------------------------------------------------ calls

    async def chat(
        self,
        prompt: RenderedPrompt,
        *,
        model: str | None = None,
        sampling: Sampling | None = None,
        schema: type[T] | None = None,
        json_schema: dict[str, Any] | None = None,
        reask: bool = True,
    ) -> ChatResult[T]:
        """Ask `model` (default: the configured default) and, given a `schema`, parse the answer.

        A structured answer is held to its format while decoding where the backend can (`llm.constrain`):
        to `json_schema` when given (tighter than the pydantic model, e.g. one action's arguments per
        action type), else to `schema`'s own JSON schema. Raises GatewayError when no answer came back
        after the endpoint's retries; an answer that does not parse is not an error: the result keeps
        the raw text and `parse_error`, also when its re-ask gets no answer (whose record then ends `calls`,
        its `error` saying why). `reask=False` keeps the first answer even when it does not parse
        (a sample whose format is itself scored, as CES rewards it, must not be repaired).
        """
        name = model or self.settings.default
        self.backend(name)  # an unknown name fails here, before any work
        if schema is not None and prompt.format == "text":
            raise ValueError(
                f"{prompt.template}@{prompt.version} declares format 'text'; a schema needs 'json', 'tool_call' or 'think_answer'"
            )
        sampling = sampling or prompt.sampling
        constraint = None
        if schema is not None and self.settings.constrain:
            constraint = Constraint(prompt.format, json_schema or schema.model_json_schema())
        record = await self._call(name, prompt, list(prompt.messages), sampling, constraint, reask=False)
        if schema is None:
            return ChatResult(record.text, None, None, (record,))
        parsed, error = self._parse(record, prompt, schema, sampling)
        calls = [record.model_copy(update={"parse_error": error})]
        if error and self.settings.reask and reask:
            self.stats.reasks += 1
            self.stats.prompts[self._reask.name] = self._reask.version
            follow = self._reask.render(
                error=error, format=prompt.format, schema=json.dumps(schema.model_json_schema())
            )
            messages = [
                *prompt.messages,
                Message(role="assistant", content=[TextPart(text=record.text)]),
                *follow.messages,
            ]
            try:
                record = await self._call(name, prompt, messages, sampling, constraint, reask=True)
            except GatewayError as exc:  # the first answer stands, unparsed, as if not re-asked
                calls.append(exc.record)
            else:
                parsed, error = self._parse(record, prompt, schema, sampling)
                calls.append(record.model_copy(update={"parse_error": error}))
        if error:
            self.stats.parse_failures += 1
            logger.info("%s@%s on %s: answer kept unparsed: %s", prompt.template, prompt.version, name, error)
        return ChatResult(record.text, parsed, error, tuple(calls))

    def chat_sync(self, prompt: RenderedPrompt, **options: Any) -> ChatResult[Any]:
        """`chat` for synchronous code; blocks until the answer is there."""
        return self._run(self.chat(prompt, **options))

    @staticmethod
    def _parse(
        record: CallRecord, prompt: RenderedPrompt, schema: type[T], sampling: Sampling
    ) -> tuple[T | None, str | None]:
        try:
            return parse(record.text, prompt.format, schema), None
        except ParseError as exc:
            cut = (
                f" (the answer was cut off at max_tokens={sampling.max_tokens})"
                if record.finish_reason == "length"
                else ""
            )
            return None, f"{exc}{cut}"

    async def _call(
        self, name: str, prompt: RenderedPrompt, messages: list[Message], sampling: Sampling,
        constraint: Constraint | None, *, reask: bool
    ) -> CallRecord:
        backend = self.backend(name)
        start = time.perf_counter()
        mode = ocr.observation_mode(messages, backend.sees_images)
        observation = f"{mode}:{self.ocr.engine_id}" if mode.startswith("ocr") else mode
        how = backend.enforces(constraint) if constraint is not None else None
        if how is None:
            constraint = None
        # Read once: a local checkpoint's id is a fingerprint of its files (`llm.local.checkpoint`), so the key,
        # the record and the cache entry name one model even if the folder is written meanwhile.
        model_id = backend.model_id
        key = cache_key(model_id, prompt.template, prompt.version, messages, sampling, observation,
                        _held_to(constraint, how))
        about: dict[str, Any] = dict(
            template=prompt.template,
            template_version=prompt.version,
            model=name,
            model_id=model_id,
            backend=backend.kind,
            observation_mode=mode,
            sampling=sampling,
            cache_key=key,
            reask=reask,
            constrained=how,
        )
        self.stats.models[name] = model_id
        self.stats.prompts[prompt.template] = prompt.version
        answer = await asyncio.to_thread(self.cache.get, key) if self.cache else None
        cached = answer is not None
        if answer is None:
            answer = await self._ask(backend, messages, sampling, constraint, mode, about, start)
            if self.cache and _finished(answer):
                await asyncio.to_thread(self.cache.put, key, model_id, prompt.template, prompt.version, answer)
            self.stats.tokens_in += answer.tokens_in or 0
            self.stats.tokens_out += answer.tokens_out or 0
        record = CallRecord(
            **about,
            cached=cached,
            attempts=answer.attempts,
            tokens_in=answer.tokens_in,
            tokens_out=answer.tokens_out,
            latency_ms=(time.perf_counter() - start) * 1000,
            finish_reason=answer.finish_reason,
            text=answer.text,
        )
        self.stats.calls += 1
        self.stats.cache_hits += cached
        logger.debug(
            "%s@%s on %s: %s tokens in, %s out, %.0f ms%s",
            prompt.template,
            prompt.version,
            name,
            record.tokens_in,
            record.tokens_out,
            record.latency_ms,
            " (cached)" if cached else "",
        )
        return record

    async def _ask(
        self,
        backend: Backend,
        messages: list[Message],
        sampling: Sampling,
        constraint: Constraint | None,
        mode: str,
        about: dict[str, Any],
        start: float,
    ) -> Completion:
        """The backend's answer; a failure becomes a GatewayError whose record says why."""
        try:
            if mode != "text":  # images are read (and OCR'd) only now, on a cache miss, off the event loop
                messages = await asyncio.to_thread(self._show, messages, mode)
            return await backend.complete(messages, sampling, constraint)
        except (BackendError, BlobMissing, BlobCorrupted) as exc:
            record = CallRecord(
                **about,
                cached=False,
                attempts=getattr(exc, "attempts", 0),
                latency_ms=(time.perf_counter() - start) * 1000,
                error=str(exc),
            )
            self.stats.errors += 1
            logger.warning(
                "%s@%s on %s failed: %s", record.template, record.template_version, record.model, record.error
            )
            raise GatewayError(record) from exc

    def _show(self, messages: list[Message], mode: str) -> list[Message]:
        """The messages as the model will see them: image bytes read, or images rendered as text. An image the OCR
        cannot decode is this request's failure (BackendError), as a server's 400 for it would be."""
        with_bytes = [
            m.model_copy(
                update={"content": [p.with_bytes(self.blobs) if isinstance(p, ImagePart) else p for p in m.content]}
            )
            for m in messages
        ]
        if not mode.startswith("ocr"):
            return with_bytes
        try:
            return self.ocr.as_text(with_bytes)
        except IMAGE_ERRORS:
            # Pillow's errors are OSErrors, as the OCR engine's own may be: an image that does not decode is named,
            # any other error is raised as it came.
            for image in (p for m in with_bytes for p in m.images):
                if why := unreadable(image):
                    raise BackendError(why, 0) from None
            raise

    # ------------------------------------------------------------------ lifetime

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        with self._thread_lock:
            if self._thread is None:
                loop = asyncio.new_event_loop()
                self._thread = (loop, threading.Thread(target=loop.run_forever, name="llm-gateway", daemon=True))
                self._thread[1].start()
        return asyncio.run_coroutine_threadsafe(coro, self._thread[0]).result()

    async def aclose(self) -> None:
        """Close the connections this event loop opened."""
        for backend in self.backends.values():
            await backend.aclose()

    def close(self) -> None:
        """Close connections, the background loop `chat_sync` used, and the cache's database pool."""
        if self._thread is not None:
            self._run(self.aclose())
            loop, thread = self._thread
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._thread = None
        if self.cache:
            self.cache.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

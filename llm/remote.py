"""Any OpenAI-compatible endpoint (vLLM, SGLang, Ollama, hosted APIs) through the `openai` package.

Concurrency is bounded per endpoint, so a nightly run with thousands of requests keeps
a server busy without drowning it; a 408, a 409, a 429, a 5xx, a timeout or a lost connection is
retried with jittered exponential backoff, or after the wait a server's Retry-After asks
(tenacity; the openai client's own retries are off, so there is one retry policy, the
configured one). A slot is held only while a
request is in flight, never during a backoff wait.

The client and its slots belong to one event loop: a gateway used from several loops
(a sync caller's background loop, each `asyncio.run` of a test) gets one of each per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

import openai
from openai.types.chat import ChatCompletion
from pydantic import SecretStr
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)
from tenacity.wait import wait_base

from trajforge.llm.calls import BackendError, Completion, Enforcement, Sampling
from trajforge.llm.messages import IMAGE_ERRORS, ImagePart, Message, image_error
from trajforge.llm.structured import Constraint
from trajforge.schemas.config import EndpointSettings, redact

logger = logging.getLogger(__name__)


def _retried(exc: BaseException) -> bool:
    """Whether a failed attempt is worth another, as the openai client's own policy (off here) judges it: a lost
    connection or a timeout (APITimeoutError is an APIConnectionError), 408 Request Timeout, 409 (a lock timeout),
    429, a 5xx."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return isinstance(exc, openai.APIConnectionError)


MAX_RETRY_AFTER_S = 120.0
"""Longest wait a server's Retry-After is honoured for; a longer one is cut to it (and logged with the wait)."""


def retry_after(exc: BaseException | None) -> float | None:
    """The seconds a 429 or 503 asked the client to wait (Retry-After: seconds or an HTTP date; the
    `retry-after-ms` some servers send); None when it asked nothing."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    if (ms := headers.get("retry-after-ms")) is not None:
        with contextlib.suppress(ValueError):
            return max(float(ms) / 1000, 0.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        with contextlib.suppress(TypeError, ValueError):
            return max((parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds(), 0.0)
    return None


class _WaitRetryAfter(wait_base):
    """The server's Retry-After when it gave one (capped), else the jittered exponential backoff."""

    def __init__(self, backoff: wait_base) -> None:
        self.backoff = backoff

    def __call__(self, retry_state: RetryCallState) -> float:
        asked = retry_after(retry_state.outcome.exception() if retry_state.outcome else None)
        return min(asked, MAX_RETRY_AFTER_S) if asked is not None else self.backoff(retry_state)


def _wire(message: Message) -> dict[str, object]:
    """A message as the OpenAI API takes it: plain text content unless there are images."""
    if not message.images:
        return {"role": message.role, "content": message.text}
    parts = [
        {"type": "image_url", "image_url": {"url": _data_url(p)}}
        if isinstance(p, ImagePart)
        else {"type": "text", "text": p.text}
        for p in message.content
    ]
    return {"role": message.role, "content": parts}


def _data_url(image: ImagePart) -> str:
    """The image as a data URL; a BackendError (no request made) where Pillow cannot tell its format."""
    try:
        return image.data_url()
    except IMAGE_ERRORS as exc:
        raise BackendError(image_error(image, exc), 0) from None


class OpenAIBackend:
    kind = "openai"

    def __init__(self, name: str, settings: EndpointSettings, api_key: SecretStr | None) -> None:
        self.name = name
        self.settings = settings
        self.model_id = settings.model
        self.sees_images = settings.vision
        self._api_key = api_key
        self._sessions: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[openai.AsyncOpenAI, asyncio.Semaphore]
        ] = weakref.WeakKeyDictionary()

    def _session(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if loop not in self._sessions:
            client = openai.AsyncOpenAI(
                base_url=self.settings.base_url,
                # Servers without auth (a local vLLM) still need a non-empty key for the client.
                api_key=self._api_key.get_secret_value() if self._api_key else "none",
                timeout=self.settings.timeout_s,
                max_retries=0,
            )
            self._sessions[loop] = (client, asyncio.Semaphore(self.settings.max_concurrency))
        return self._sessions[loop]

    def enforces(self, constraint: Constraint) -> Enforcement | None:
        """How this server can hold the answer to `constraint`: as its settings say it accepts, where the
        format allows (a JSON schema alone cannot say a tool_call answer's layout)."""
        how = self.settings.structured_output
        if how == "grammar" or (how == "json_schema" and constraint.format == "json"):
            return how
        return None

    async def complete(self, messages: list[Message], sampling: Sampling,
                       constraint: Constraint | None = None) -> Completion:
        client, slots = self._session()
        params: dict[str, object] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        how = self.enforces(constraint) if constraint is not None else None
        if how == "json_schema":
            params["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": constraint.json_schema, "strict": True}}  # type: ignore[union-attr]
        elif how == "grammar":
            params["extra_body"] = {"structured_outputs": {"grammar": constraint.grammar}}  # type: ignore[union-attr]
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        wire = [_wire(m) for m in messages]

        async def send() -> object:
            async with slots:
                return await client.chat.completions.create(model=self.model_id, messages=wire, **params)  # type: ignore[arg-type, call-overload]

        attempts = [1]  # made so far; _retry counts its own
        try:
            try:
                # The first attempt runs outside tenacity: its bookkeeping per call (inspect on every hook) cost
                # about 220 µs of CPU, half the gateway's own cost per call (benchmarks/gateway_bench.py).
                response = await send()
            except (openai.APIStatusError, openai.APIConnectionError) as first:
                if not _retried(first):
                    raise
                response = await self._retry(send, first, attempts)
        # The client lets the JSONDecodeError of a malformed body through: it is the server's fault, recorded alike.
        except (openai.OpenAIError, json.JSONDecodeError) as exc:
            # `from None`: the client's exception keeps the server's body as it came, and a server may quote the key
            # it refused; chained, it reached Prefect's log of the failed task in the traceback.
            raise BackendError(self._shown(f"endpoint {self.name} ({self.settings.base_url}): "
                                           f"{type(exc).__name__}: {exc}"), attempts[0]) from None
        if not isinstance(response, ChatCompletion) or not response.choices:
            raise BackendError(self._shown(f"endpoint {self.name} ({self.settings.base_url}) answered no chat "
                                           f"completion: {str(response)[:200]}"), attempts[0])
        choice = response.choices[0]
        if choice.message is None:
            raise BackendError(self._shown(f"endpoint {self.name} ({self.settings.base_url}) answered a choice with "
                                           f"no message: {str(choice)[:200]}"), attempts[0])
        text = _text_of(choice.message.content)
        usage = response.usage
        return Completion(
            text=text or "",
            withheld=text is None,
            finish_reason=choice.finish_reason or "unknown",
            tokens_in=usage.prompt_tokens if usage else None,
            tokens_out=usage.completion_tokens if usage else None,
            attempts=attempts[0],
        )

    async def _retry(self, send: Callable[[], Awaitable[object]], first: BaseException, attempts: list[int]) -> object:
        """The attempts after a first one that failed with `first`, counted in `attempts[0]`: tenacity's policy
        from its first attempt on, which re-raises `first` (so its wait, Retry-After and log line are those of
        a failed attempt 1)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(_retried),
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=_WaitRetryAfter(wait_random_exponential(multiplier=self.settings.backoff_s, max=60)),
            before_sleep=self._log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                attempts[0] = attempt.retry_state.attempt_number
                if attempts[0] == 1:
                    raise first
                response = await send()
        return response

    def _shown(self, text: str) -> str:
        """An error's text without the endpoint's key or a password in a URL: it reaches the log, the call's record
        (a row's dropped reason, lineage). A server may quote the key it refused; a base_url may carry one."""
        key = self._api_key.get_secret_value() if self._api_key else ""
        return redact(text.replace(key, "***") if key else text)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        logger.warning(
            "endpoint %s: attempt %d failed (%s); retrying in %.2f s",
            self.name,
            state.attempt_number,
            self._shown(f"{type(exc).__name__}: {exc}"),
            wait,
        )

    async def aclose(self) -> None:
        """Close this loop's connections."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session[0].close()


def _text_of(content: object) -> str | None:
    """The answer's text: `content` as a string, or its text parts joined (some servers send a list of parts, which
    crashed the response cache); None where it holds none (null beside tool calls, or beside a reasoning parser's
    field, neither of which a prompt here asks for)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [part.get("text") if isinstance(part, dict) else getattr(part, "text", None) for part in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None

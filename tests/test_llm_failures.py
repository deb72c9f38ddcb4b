"""Failures of an OpenAI-compatible endpoint, injected by a scripted server on loopback (tests/scripted.py).

The scripted server is the one stand-in in these tests, and only for what a real model
server cannot be made to do on demand: 429, 500, a timeout, a malformed body, a
truncated or malformed answer. Each failure must be retried or recorded as configured.
Calls that succeed against a real model over HTTP are in test_llm_models.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import logging
import os
import random
import time
import traceback
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path
from typing import Any, Literal

import pytest
import sqlalchemy as sa
from conftest import require
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import BaseModel
from scripted import GOOD, Reply, ScriptedServer

from trajforge.data.catalog import Lineage
from trajforge.llm import ChatResult, Gateway, GatewayError, RenderedPrompt, Sampling, load_prompt
from trajforge.llm.cache import responses
from trajforge.llm.local import load, missing_models
from trajforge.llm.serve import create_app
from trajforge.schemas.config import LLMSettings, LocalModelSettings, Settings, load_settings

PROMPT = """
version: 2
format: json
sampling: {max_tokens: 30}
messages:
  - role: user
    content: "Judge: {{ step }}"
"""


class Judgement(BaseModel):
    label: Literal["GOOD", "HARMFUL"]
    reason: str


def endpoint(url: str, **overrides: Any) -> dict[str, Any]:
    return {"base_url": url, "model": "scripted", "max_retries": 2, "backoff_s": 0.01, "timeout_s": 5} | overrides


def gateway(url: str, *, reask: int = 1, db_url: str | None = None, **overrides: Any) -> Gateway:
    settings = LLMSettings.model_validate(
        {"endpoints": {"s": endpoint(url, **overrides)}, "default": "s", "reask": reask, "cache": db_url is not None}
    )
    return Gateway(settings, db_url=db_url)


def judge_prompt(folder: Path) -> RenderedPrompt:
    """The judge prompt, rendered for one step (written to `folder` first)."""
    (folder / "judge.yaml").write_text(PROMPT)
    return load_prompt("judge", folder).render(step="clicked Save")


@pytest.fixture
def judge(tmp_path):
    return judge_prompt(tmp_path)


def test_429_is_retried(judge):
    with ScriptedServer(Reply(status=429), Reply(status=429), Reply()) as server, gateway(server.url) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
    assert result.parsed == Judgement(label="GOOD", reason="fine")
    assert result.record.attempts == 3 and len(server.requests) == 3
    assert (result.record.tokens_in, result.record.tokens_out) == (11, 7)


@pytest.mark.parametrize(("status", "headers"), [
    (429, {"retry-after": "1"}),
    (503, {"retry-after-ms": "1000"}),
    (429, {"retry-after": "HTTP date in 2 s"}),
])
def test_a_retry_waits_as_long_as_the_server_asked(judge, caplog, status, headers):
    """The configured backoff here is 10 ms; a server that says when to come back is not asked sooner: a second
    after the refusal, or not before the HTTP date it gave (whole seconds, from when the test wrote it: on a busy
    machine most of its 2 s had gone by the first request, so the wait after it was under 1 s, and right)."""
    date = None
    if headers.get("retry-after") == "HTTP date in 2 s":
        date = (datetime.now(timezone.utc) + timedelta(seconds=2)).replace(microsecond=0)
        headers = {"retry-after": format_datetime(date, usegmt=True)}
    with ScriptedServer(Reply(status=status, headers=headers), Reply()) as server, gateway(server.url) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
    assert result.parsed is not None and result.record.attempts == 2
    first, second = (r["at"] for r in server.requests)
    if date is None:
        assert second - first >= 0.95
    else:  # the second request's wall-clock time, from the server's monotonic clock
        asked_again = datetime.now(timezone.utc) - timedelta(seconds=time.monotonic() - second)
        assert asked_again >= date - timedelta(milliseconds=50), (asked_again, date)
    assert "retrying in" in caplog.text


def test_500_after_the_last_retry_is_an_error_with_its_record(judge, caplog):
    with ScriptedServer(Reply(status=500)) as server, gateway(server.url) as gw:
        with pytest.raises(GatewayError) as err:
            gw.chat_sync(judge)
        assert gw.stats.errors == 1 and gw.stats.calls == 0
    record = err.value.record
    assert len(server.requests) == 3 and record.attempts == 3
    assert "InternalServerError" in record.error and "scripted 500" in record.error
    assert (record.template, record.template_version) == ("judge", judge.version)
    assert (record.model, record.model_id) == ("s", "scripted")
    assert any("endpoint s: attempt 2 failed (InternalServerError" in r.getMessage() for r in caplog.records), (
        "retries are logged"
    )


def test_no_retry_when_configured(judge):
    with ScriptedServer(Reply(status=503), Reply()) as server, gateway(server.url, max_retries=0) as gw:
        with pytest.raises(GatewayError):
            gw.chat_sync(judge)
    assert len(server.requests) == 1


def test_client_error_is_not_retried(judge):
    with ScriptedServer(Reply(status=400), Reply()) as server, gateway(server.url) as gw:
        with pytest.raises(GatewayError, match="BadRequestError"):
            gw.chat_sync(judge)
    assert len(server.requests) == 1


def test_timeout_is_retried(judge):
    with ScriptedServer(Reply(delay=3), Reply()) as server, gateway(server.url, timeout_s=0.5) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
    assert result.parsed is not None and result.record.attempts == 2


def test_timeout_on_every_attempt_is_recorded(judge):
    with ScriptedServer(Reply(delay=3)) as server, gateway(server.url, timeout_s=0.3, max_retries=1) as gw:
        with pytest.raises(GatewayError, match="APITimeoutError") as err:
            gw.chat_sync(judge)
    assert err.value.record.attempts == 2


def test_malformed_body_is_recorded_not_retried(judge):
    with ScriptedServer(Reply(raw='{"choices": [ {"index": 0, "mess'), Reply()) as server, gateway(server.url) as gw:
        with pytest.raises(GatewayError) as err:
            gw.chat_sync(judge)
    assert len(server.requests) == 1 and err.value.record.attempts == 1
    assert err.value.record.error


def test_truncated_answer_is_reasked_once(judge):
    cut = '{"label": "GOOD", "rea'
    with ScriptedServer(Reply(text=cut, finish_reason="length"), Reply()) as server, gateway(server.url) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
        assert (gw.stats.reasks, gw.stats.parse_failures) == (1, 0)
        assert gw.stats.prompts == {"judge": judge.version, "reask": load_prompt("reask").version}
    first, second = result.calls
    assert first.text == cut and "cut off at max_tokens=30" in first.parse_error and first.finish_reason == "length"
    assert second.reask and second.parse_error is None and result.parsed == Judgement(label="GOOD", reason="fine")
    asked_again = server.requests[1]["body"]["messages"]
    assert asked_again[-2] == {"role": "assistant", "content": cut}
    assert "could not be used" in asked_again[-1]["content"] and '"label"' in asked_again[-1]["content"], (
        "the schema is said"
    )


def test_malformed_answer_is_kept_raw_and_counted(judge):
    with ScriptedServer(Reply(text="GOOD, because it saved")) as server, gateway(server.url) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
        assert (gw.stats.reasks, gw.stats.parse_failures) == (1, 1)
    assert result.parsed is None and result.text == "GOOD, because it saved"
    assert result.parse_error.startswith("not one JSON object") and len(result.calls) == 2 == len(server.requests)


def test_no_reask_when_configured(judge):
    with ScriptedServer(Reply(text="nope")) as server, gateway(server.url, reask=0) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
        assert (gw.stats.reasks, gw.stats.parse_failures) == (0, 1)
    assert result.parsed is None and len(result.calls) == 1 == len(server.requests)


def test_concurrency_is_bounded_per_endpoint(tmp_path):
    (tmp_path / "p.yaml").write_text("version: 1\nmessages:\n  - role: user\n    content: 'n={{ n }}'\n")
    prompt = load_prompt("p", tmp_path)

    async def burst(gw: Gateway) -> list[str]:
        try:
            results: list[ChatResult[Any]] = await asyncio.gather(*(gw.chat(prompt.render(n=i)) for i in range(20)))
            return [result.text for result in results]
        finally:
            await gw.aclose()

    with ScriptedServer(Reply(text="ok", delay=0.1)) as server, gateway(server.url, max_concurrency=4) as gw:
        assert asyncio.run(burst(gw)) == ["ok"] * 20
    assert server.max_in_flight == 4 and len(server.requests) == 20


def test_failed_calls_are_not_cached(judge, tmp_path):
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(Reply(status=500), Reply()) as server, gateway(server.url, max_retries=0, db_url=db) as gw:
        with pytest.raises(GatewayError):
            gw.chat_sync(judge)
        assert gw.chat_sync(judge).text == GOOD
        assert gw.chat_sync(judge).record.cached
    assert len(server.requests) == 2


def answered(message: dict[str, Any] | None, finish_reason: str = "stop") -> Reply:
    """A 200 reply whose one choice holds `message` as the server sent it."""
    return Reply(raw=json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "scripted",
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}))


@pytest.mark.parametrize(("message", "finish_reason"), [
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "click", "arguments": "{}"}}]}, "tool_calls"),
    ({"role": "assistant", "content": None, "reasoning_content": "<think>the label is"}, "length"),
], ids=["tool calls", "reasoning only"])
def test_an_answer_whose_text_the_server_withheld_is_not_cached(judge, tmp_path, message, finish_reason):
    """A null content beside tool calls or a reasoning parser's field was stored as "", cached, and never asked
    again: it is an empty answer of this call (its row fails to parse, recorded), and the rerun asks again."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(answered(message, finish_reason), Reply()) as server, \
            gateway(server.url, max_retries=0, db_url=db, reask=0) as gw:
        first = gw.chat_sync(judge, schema=Judgement)
        assert first.text == "" and first.record.finish_reason == finish_reason and first.parsed is None
        again = gw.chat_sync(judge, schema=Judgement)
        assert not again.record.cached and again.parsed == Judgement(label="GOOD", reason="fine")
    assert len(server.requests) == 2


def test_a_choice_without_a_message_is_a_failed_call(judge):
    """It crashed the stage with an AttributeError; it is the call's error, recorded."""
    with ScriptedServer(answered(None)) as server, gateway(server.url, max_retries=0) as gw:
        with pytest.raises(GatewayError, match="answered a choice with no message") as err:
            gw.chat_sync(judge)
    assert err.value.record.error and len(server.requests) == 1


def test_content_sent_as_text_parts_is_the_answer_and_cached(judge, tmp_path):
    """Some servers send `content` as a list of parts: it crashed the response cache after the model answered."""
    parts = [{"type": "text", "text": '{"label": "GOOD", '}, {"type": "text", "text": '"reason": "fine"}'}]
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(answered({"role": "assistant", "content": parts})) as server, \
            gateway(server.url, db_url=db) as gw:
        assert gw.chat_sync(judge, schema=Judgement).parsed == Judgement(label="GOOD", reason="fine")
        assert gw.chat_sync(judge).record.cached
    assert len(server.requests) == 1


SECRET = "sk-trajforge-LEAKCHECK-7f3a9c2e"
OTHER_SECRET = "sk-trajforge-ENVJSON-51d0b8"


def test_api_key_appears_in_no_row_log_or_property(judge, tmp_path, monkeypatch, caplog):
    """Keys from a named variable and from TRAJFORGE_LLM__ENDPOINTS reach the server and nothing else."""
    caplog.set_level(logging.DEBUG)
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(Reply(), Reply(status=500), Reply(status=401)) as server:
        config = tmp_path / "trajforge.yaml"
        config.write_text(
            json.dumps(
                {
                    "warehouse": {"path": str(tmp_path / "wh")},
                    "llm": {
                        "default": "a",
                        "endpoints": {
                            "a": endpoint(server.url, api_key_env="MY_PROVIDER_KEY", max_retries=1),
                            "b": endpoint(server.url),
                        },
                    },
                }
            )
        )
        monkeypatch.setenv("MY_PROVIDER_KEY", SECRET)
        monkeypatch.setenv("TRAJFORGE_LLM__ENDPOINTS", json.dumps({"b": {"api_key": OTHER_SECRET}}))
        settings = load_settings(config)
        outputs: list[str] = []
        with Gateway(settings.llm, db_url=db) as gw:
            outputs.append(gw.chat_sync(judge, schema=Judgement).record.model_dump_json())  # succeeds
            for seed, model in enumerate(("a", "b")):  # a: 500, then 401 on its retry; b: 401
                with pytest.raises(GatewayError) as err:
                    gw.chat_sync(judge, model=model, sampling=Sampling(seed=seed))
                outputs += [str(err.value), repr(err.value), err.value.record.model_dump_json(),
                            "".join(traceback.format_exception(err.value))]  # as Prefect logs a failed task
            outputs.append(repr(gw.stats))
            lineage = Lineage(
                stage="s",
                run_id="r",
                commit_key="k",
                config_hash=settings.section_hash("llm"),
                code_version="v",
                models=gw.stats.models,
                prompts=gw.stats.prompts,
            )
        outputs += list(lineage.snapshot_properties().values())
        outputs += [settings.model_dump_json(), repr(settings), str(settings.model_dump())]
        with sa.create_engine(db).connect() as conn:
            outputs += [repr(row) for row in conn.execute(sa.select(responses))]
    logged = [caplog.text] + [r.getMessage() for r in caplog.records] + [repr(r.args) for r in caplog.records]
    assert any(r.levelno >= logging.WARNING and "failed" in r.getMessage() for r in caplog.records), (
        "failures are logged"
    )
    assert len(outputs) > 10 and len(caplog.records) > 5
    for text in outputs + logged:
        assert SECRET not in text and OTHER_SECRET not in text, text
    auth = [r["headers"]["authorization"] for r in server.requests]
    assert f"Bearer {SECRET}" in auth and f"Bearer {OTHER_SECRET}" in auth, "the keys did reach the server"


def test_unset_key_variable_names_endpoint_and_variable(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    settings = LLMSettings(endpoints={"vllm": endpoint("http://127.0.0.1:9/v1", api_key_env="NO_SUCH_KEY_VAR")})
    with pytest.raises(
        ValueError, match="llm.endpoints.vllm.api_key_env: environment variable NO_SUCH_KEY_VAR is not set"
    ):
        Gateway(settings)


def test_a_key_variable_read_from_a_file_loses_its_newline_and_a_control_character_is_refused(judge, monkeypatch):
    """A key from a file (a Kubernetes secret) ends in a newline: every call failed as a connection error, retried,
    and httpx's debug log quoted the key. It is stripped; a control character inside is named, the value not."""
    with ScriptedServer(Reply()) as server:
        settings = LLMSettings(endpoints={"s": endpoint(server.url, api_key_env="FILE_KEY")}, default="s")
        monkeypatch.setenv("FILE_KEY", f"{SECRET}\n")
        with Gateway(settings) as gw:
            assert gw.chat_sync(judge).text == GOOD
        assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
        monkeypatch.setenv("FILE_KEY", f"{SECRET[:8]}\x07{SECRET[8:]}")
        with pytest.raises(ValueError, match="FILE_KEY holds a control character") as err:
            Gateway(settings)
        assert SECRET[8:] not in str(err.value)


def test_llm_config_defaults_and_errors(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("TRAJFORGE_") and name != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    llm = Settings().llm
    assert (llm.default, llm.local.model, llm.endpoints, llm.reask, llm.cache) == ("local", "smollm2", {}, 1, True)
    config = tmp_path / "trajforge.yaml"
    config.write_text("llm:\n  default: vllm\n")
    with pytest.raises(
        ValueError, match=r"trajforge.yaml: field 'llm.default': .*'vllm' is neither 'local' nor an endpoint"
    ):
        load_settings(config)
    config.write_text("llm:\n  endpoints:\n    local: {base_url: 'http://x/v1', model: m}\n")
    with pytest.raises(ValueError, match=r"field 'llm.endpoints': .*'local' names the in-process model"):
        load_settings(config)
    config.write_text("llm:\n  endpoints:\n    vllm: {base_url: 'http://x/v1', model: m, max_concurency: 4}\n")
    with pytest.raises(ValueError, match=r"field 'llm.endpoints.vllm.max_concurency': Extra inputs"):
        load_settings(config)
    monkeypatch.chdir(tmp_path / "..")
    monkeypatch.setenv("TRAJFORGE_LLM__REASK", "2")
    with pytest.raises(ValueError, match="environment variable TRAJFORGE_LLM__REASK: field 'llm.reask'"):
        load_settings()


@pytest.mark.parametrize("status", [408, 409])
def test_a_request_timeout_or_a_conflict_is_retried(judge, status):
    """408 and 409 (a lock timeout) were recorded as failed calls at once: the openai client's own policy, off
    here, retries both, and the server may answer the same request next time."""
    with ScriptedServer(Reply(status=status), Reply()) as server, gateway(server.url) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
    assert result.parsed == Judgement(label="GOOD", reason="fine")
    assert result.record.attempts == 2 and len(server.requests) == 2


def test_a_config_key_from_a_yaml_block_reaches_the_server_without_its_newline(judge, tmp_path, monkeypatch, caplog):
    """`api_key: |` keeps a newline: every call failed as a connection error, retried, and httpx's DEBUG log held
    the key. It is stripped as the config loads, as a key a variable names is."""
    for name in list(os.environ):
        if name.startswith("TRAJFORGE_") and name != "TRAJFORGE_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    caplog.set_level(logging.DEBUG)
    with ScriptedServer(Reply()) as server:
        config = tmp_path / "trajforge.yaml"
        config.write_text(f"llm:\n  default: s\n  endpoints:\n    s:\n      base_url: {server.url}\n      model: m\n"
                          f"      max_retries: 0\n      api_key: |\n        {SECRET}\n")
        with Gateway(load_settings(config).llm) as gw:
            assert gw.chat_sync(judge).text == GOOD
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in caplog.text


def test_a_key_variable_with_a_non_ascii_character_is_refused_naming_endpoint_and_variable(monkeypatch):
    """It raised a bare UnicodeEncodeError out of chat, naming neither, whose text held the whole header."""
    monkeypatch.setenv("TYPED_KEY", f"{SECRET[:8]}’{SECRET[8:]}")
    settings = LLMSettings(endpoints={"s": endpoint("http://127.0.0.1:9/v1", api_key_env="TYPED_KEY")})
    with pytest.raises(ValueError, match="llm.endpoints.s.api_key_env: environment variable TYPED_KEY holds a "
                                         "non-ASCII character") as err:
        Gateway(settings)
    assert SECRET[8:] not in str(err.value)


LOOK = """
version: 1
messages:
  - role: user
    images: screens
    content: "What does the screen say?"
"""


def _png(size: int) -> bytes:
    """A PNG of noise (so its data stream is long enough to cut)."""
    rng = random.Random(0)
    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3))).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(("vision", "image"), [
    (True, b"<html>502 Bad Gateway</html>"),  # sent as a data URL: its format cannot be told
    (False, b"<html>502 Bad Gateway</html>"),  # read by OCR for a text model
    (False, _png(64)[:300]),  # truncated: OCR decodes it whole
], ids=["not an image, sent", "not an image, OCR", "truncated, OCR"])
def test_an_unreadable_image_is_a_failed_call_naming_it(tmp_path, vision, image):
    """An image Pillow cannot read raised a bare UnidentifiedImageError (or OSError) out of chat, which crashed
    its shard again on every resume: it is this call's failure, recorded with the image's hash, and never sent."""
    (tmp_path / "look.yaml").write_text(LOOK)
    prompt = load_prompt("look", tmp_path)
    with ScriptedServer(Reply()) as server, gateway(server.url, vision=vision) as gw:
        with pytest.raises(GatewayError) as err:
            gw.chat_sync(prompt.render(screens=[image]))
        assert gw.stats.errors == 1
        assert gw.chat_sync(prompt.render(screens=[_png(16)])).text == GOOD, "the next call goes on"
    sha = hashlib.sha256(image).hexdigest()
    assert err.value.record.error.startswith(f"image {sha} cannot be read: ")
    assert err.value.record.attempts == 0 and len(server.requests) == 1


def test_llm_serve_answers_400_naming_an_unreadable_image(tmp_path):
    """`python -m trajforge.llm.serve` answered an image its vision model cannot read with an unhandled 500, which
    every client retried and which failed alike each time: a 400 that names the part and the image."""
    from test_llm_models import build_tiny_qwen25_vl  # transformers' vision classes: only this test needs them

    reason = missing_models(embedded=False)
    require(reason is None, str(reason))
    build_tiny_qwen25_vl(tmp_path / "vl")
    model = load(LocalModelSettings(model=str(tmp_path / "vl")))
    broken = b"<html>502 Bad Gateway</html>"
    asked = {"model": model.model_id, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What does the screen say?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(broken).decode()}"}}]}]}
    answer = TestClient(create_app(model), raise_server_exceptions=False).post("/v1/chat/completions", json=asked)
    sha = hashlib.sha256(broken).hexdigest()
    assert (answer.status_code, answer.json()["detail"]) == (
        400, f"messages[0].content[1].image_url.url: image {sha} cannot be read: not an image Pillow can read")

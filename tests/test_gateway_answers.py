"""What the gateway keeps of an endpoint's answers: an unparsed answer whose re-ask failed, which answers the
response cache keeps, and the tokens a night spent. The endpoint is the scripted server (tests/scripted.py),
for answers a real model server cannot be made to give on demand."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel
from scripted import GOOD, Reply, ScriptedServer
from test_llm_failures import Judgement, gateway, judge_prompt


@pytest.fixture
def judge(tmp_path):
    return judge_prompt(tmp_path)


def test_an_answer_whose_reask_failed_is_kept_unparsed_with_both_calls(judge):
    """The first answer came back (and was paid for): a re-ask that gets none leaves it unparsed, as one not
    re-asked, and says why in its own record; the caller gets no GatewayError for a row it could keep."""
    unparsed = "GOOD, because it saved"
    with ScriptedServer(Reply(text=unparsed), Reply(status=400)) as server, gateway(server.url, max_retries=0) as gw:
        result = gw.chat_sync(judge, schema=Judgement)
        assert (gw.stats.reasks, gw.stats.errors, gw.stats.parse_failures) == (1, 1, 1)
    assert result.parsed is None and result.text == unparsed
    assert result.parse_error.startswith("not one JSON object")
    first, reask = result.calls
    assert result.record == first and first.text == unparsed and first.parse_error == result.parse_error
    assert reask.reask and "BadRequestError" in reask.error and reask.text == ""
    assert len(server.requests) == 2


@pytest.mark.parametrize(("finish_reason", "text", "kept"), [
    ("stop", GOOD, True),
    ("length", '{"label": "GOOD", "rea', True),  # the same cut again under the same max_tokens
    ("abort", '{"label": "GO', False),
    ("error", "", False),
    ("content_filter", None, False),
    ("eos_token", GOOD, True),  # a server's own name for a stop: a rerun asks it nothing
])
def test_only_answers_the_model_finished_are_cached(judge, tmp_path, finish_reason, text, kept):
    """An answer the server aborted, failed or withheld is not the model's answer to keep for every rerun."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(Reply(text=text, finish_reason=finish_reason), Reply()) as server, \
            gateway(server.url, db_url=db, max_retries=0) as gw:
        first = gw.chat_sync(judge)
        again = gw.chat_sync(judge)
    assert first.record.finish_reason == finish_reason and first.text == (text or "")
    assert again.record.cached == kept
    assert again.text == (first.text if kept else GOOD)
    assert len(server.requests) == (1 if kept else 2)


def test_token_totals_count_only_what_the_endpoint_was_asked(judge, tmp_path):
    """A rerun answered from the cache spends no tokens; each call's record still says what its answer took."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(Reply()) as server, gateway(server.url, db_url=db, max_retries=0) as gw:
        asked = gw.chat_sync(judge)
        cached = gw.chat_sync(judge)
        assert (gw.stats.calls, gw.stats.cache_hits) == (2, 1)
        assert (gw.stats.tokens_in, gw.stats.tokens_out) == (11, 7)
    assert cached.record.cached and not asked.record.cached
    assert (cached.record.tokens_in, cached.record.tokens_out) == (asked.record.tokens_in, asked.record.tokens_out)


def test_an_answer_held_to_a_json_schema_is_not_reused_for_a_grammar(judge, tmp_path):
    """A server sent the JSON schema decodes under other rules than one sent the grammar: after
    `structured_output` changes, the call is asked again, and its record says what held the answer it got."""
    db = f"sqlite:///{tmp_path / 'catalog.db'}"
    with ScriptedServer(Reply(), Reply()) as server:
        for how in ("json_schema", "grammar", "json_schema"):
            with gateway(server.url, db_url=db, max_retries=0, structured_output=how) as gw:
                result = gw.chat_sync(judge, schema=Judgement)
            assert result.record.constrained == how
    assert len(server.requests) == 2, "the third call is the first's, answered from the cache"
    assert "response_format" in server.requests[0]["body"] and "response_format" not in server.requests[1]["body"]


class Scored(BaseModel):
    label: Literal["GOOD", "HARMFUL"]
    score: float


@pytest.mark.parametrize(("answer", "error"), [
    ('{"label": "GOOD", "score": 1e999}', "the number 1e999 is beyond a float's range"),
    ('{"label": "GOOD", "score": -1e999}', "the number -1e999 is beyond a float's range"),
    ('{"label": "GOOD", "score": ' + "9" * 5000 + "}", "an integer of 5000 digits is too long"),
], ids=["inf", "-inf", "5000 digits"])
def test_a_number_no_float_or_int_holds_is_an_answer_that_does_not_parse(judge, answer, error):
    """1e999 was parsed as an infinity that a row kept (NaN and Infinity were refused); an integer of over 4300
    digits raised a bare ValueError out of chat. Either is an unparsed answer, kept raw with why."""
    with ScriptedServer(Reply(text=answer)) as server, gateway(server.url, reask=0, max_retries=0) as gw:
        result = gw.chat_sync(judge, schema=Scored)
        assert gw.stats.parse_failures == 1
    assert result.parsed is None and result.text == answer and result.parse_error == error
    assert len(server.requests) == 1

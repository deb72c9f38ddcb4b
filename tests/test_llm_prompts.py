"""Versioned prompt templates, strict structured-output parsing, and the cache key's material."""

from __future__ import annotations

import io
from typing import Literal

import pytest
from PIL import Image
from pydantic import BaseModel

from trajforge.llm import ImagePart, PromptError, Sampling, load_prompt
from trajforge.llm.cache import cache_key
from trajforge.llm.prompts import PACKAGE_ROOT, PROMPTS_DIR
from trajforge.llm.structured import ParseError, parse
from trajforge.schemas.ids import digest

JUDGE = """
version: 3
description: test judge
format: json
sampling: {max_tokens: 40}
messages:
  - role: system
    content: You judge steps.
  - role: user
    images: screenshots
    content: |
      Task: {{ task }}
"""


class Judgement(BaseModel):
    label: Literal["GOOD", "HARMFUL"]
    reason: str


def png(color: str = "white") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def judge(tmp_path):
    (tmp_path / "judge.yaml").write_text(JUDGE)
    return load_prompt("judge", tmp_path)


def test_render_names_template_version_and_places_images(judge):
    image = png()
    rendered = judge.render(task="open settings", screenshots=[image])
    assert (rendered.template, rendered.version, rendered.format) == ("judge", f"3+{digest(JUDGE, 8)}", "json")
    assert rendered.sampling == Sampling(max_tokens=40)
    system, user = rendered.messages
    assert system.text == "You judge steps."
    assert user.images[0].png == image and len(user.images[0].sha256) == 64
    assert user.text == "Task: open settings"
    assert user.content[0].type == "image", "images go before the text"


def test_missing_variable_names_file_message_and_variable(judge):
    with pytest.raises(PromptError, match=r"judge.yaml: messages\[1\]\.content: 'task' is undefined"):
        judge.render(screenshots=[])
    with pytest.raises(PromptError, match=r"messages\[1\]\.images: variable 'screenshots' not given"):
        judge.render(task="x")


def test_bad_template_file_names_file_and_field(tmp_path):
    (tmp_path / "noversion.yaml").write_text("messages:\n  - role: user\n    content: hi\n")
    with pytest.raises(PromptError, match=r"noversion.yaml: field 'version': Field required"):
        load_prompt("noversion", tmp_path)
    (tmp_path / "badrole.yaml").write_text("version: 1\nmessages:\n  - role: robot\n    content: hi\n")
    with pytest.raises(PromptError, match=r"badrole.yaml: field 'messages.0.role'"):
        load_prompt("badrole", tmp_path)
    (tmp_path / "badjinja.yaml").write_text("version: 1\nmessages:\n  - role: user\n    content: '{{ oops'\n")
    with pytest.raises(PromptError, match=r"badjinja.yaml: messages\[0\]\.content line 1"):
        load_prompt("badjinja", tmp_path)
    with pytest.raises(PromptError, match="absent.yaml: cannot read prompt 'absent'"):
        load_prompt("absent", tmp_path)


def test_image_given_by_bad_hash_is_refused(judge):
    with pytest.raises(PromptError, match=r"images \(screenshots\)"):
        judge.render(task="x", screenshots=["not-a-hash"])


def test_an_edit_without_a_version_bump_is_a_new_recorded_version(tmp_path):
    """reasoning_act's instruction was rewritten at `version: "1"`: rows from before and after must differ."""
    shipped = (PACKAGE_ROOT / "synth/prompts/reasoning_act.yaml").read_text()
    (tmp_path / "reasoning_act.yaml").write_text(shipped)
    first = load_prompt("reasoning_act", tmp_path)
    assert load_prompt("reasoning_act", tmp_path).version == first.version, "the same file, the same version"
    edited = shipped.replace("Read the reasoning", "Study the reasoning", 1)
    assert edited != shipped
    (tmp_path / "reasoning_act.yaml").write_text(edited)
    second = load_prompt("reasoning_act", tmp_path)
    assert second.version != first.version
    assert first.version.split("+")[0] == second.version.split("+")[0], "the declared `version:` still leads"


def test_shipped_templates_load():
    names = sorted(p.stem for p in PROMPTS_DIR.glob("*.yaml"))
    assert "reask" in names
    for name in names:
        assert load_prompt(name).version


@pytest.mark.parametrize(
    "text",
    [
        '{"label": "GOOD", "reason": "it opened settings"}',
        '  ```json\n{"label": "GOOD", "reason": "it opened settings"}\n```  ',
    ],
)
def test_parse_one_json_object(text):
    assert parse(text, "json", Judgement) == Judgement(label="GOOD", reason="it opened settings")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('Sure! {"label": "GOOD", "reason": "r"}', "not one JSON object"),
        ('{"label": "GOOD", "reason": "r"} {"label": "GOOD"}', "not one JSON object"),
        ('["GOOD"]', "expected a JSON object, got a JSON list"),
        ('{"label": "GOOD", "reason": "r', "not one JSON object"),
        ('{"label": "MAYBE", "reason": "r"}', "does not match Judgement: label"),
        ('{"label": "GOOD"}', "reason: Field required"),
        ('{"label": "GOOD", "reason": "r", "label": "HARMFUL"}', "key 'label' given more than once"),
        # Half an escaped emoji, cut at max_tokens: no text a table can hold. NaN: no JSON value.
        ('{"label": "GOOD", "reason": "it shows \\ud83d"}', "a string holds half a character"),
        ('{"label": "GOOD", "reason": "r", "score": NaN}', "NaN is not a JSON value"),
    ],
)
def test_parse_json_is_strict(text, error):
    with pytest.raises(ParseError, match=error):
        parse(text, "json", Judgement)


class Click(BaseModel):
    name: Literal["click"]
    arguments: dict[str, int]


def test_parse_tool_call_after_reasoning():
    text = 'The button is at the top.\n<tool_call>\n{"name": "click", "arguments": {"x": 3, "y": 4}}\n</tool_call>\n'
    assert parse(text, "tool_call", Click) == Click(name="click", arguments={"x": 3, "y": 4})


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"name": "click", "arguments": {}}', "found 0"),
        ("<tool_call>{}</tool_call><tool_call>{}</tool_call>", "found 2"),
        ('<tool_call>{"name": "click", "arguments": {}}</tool_call> and then', "text after </tool_call>"),
        ('<tool_call>{"name": "type", "arguments": {}}</tool_call>', "does not match Click: name"),
    ],
)
def test_parse_tool_call_is_strict(text, error):
    with pytest.raises(ParseError, match=error):
        parse(text, "tool_call", Click)


def test_cache_key_changes_with_everything_that_decides_an_answer(judge):
    a, b = png("white"), png("black")
    rendered = judge.render(task="t", screenshots=[a])
    base = dict(
        model_id="m",
        template="judge",
        version="3",
        messages=list(rendered.messages),
        sampling=Sampling(),
        observation="image",
    )
    key = cache_key(**base)
    assert key == cache_key(**base), "deterministic"
    by_hash = judge.render(task="t", screenshots=[ImagePart(sha256=ImagePart(png=a).sha256)])
    assert cache_key(**{**base, "messages": list(by_hash.messages)}) == key, (
        "an image by hash or by bytes is the same image"
    )
    changed = [
        {"model_id": "m2"},
        {"version": "4"},
        {"template": "other"},
        {"messages": list(judge.render(task="t2", screenshots=[a]).messages)},
        {"messages": list(judge.render(task="t", screenshots=[b]).messages)},
        {"messages": list(judge.render(task="t", screenshots=[ImagePart(png=a, ax_tree="button OK")]).messages)},
        {"sampling": Sampling(temperature=0.7)},
        {"sampling": Sampling(seed=1)},
        {"observation": "ocr:rapidocr-3.10.0"},
    ]
    for change in changed:
        assert cache_key(**{**base, **change}) != key, change


def test_a_template_with_a_key_twice_or_not_in_utf8_names_file_and_line(tmp_path):
    """As the config and an app's spec: PyYAML would keep the second `messages` silently."""
    (tmp_path / "twice.yaml").write_text("version: 1\nmessages:\n  - {role: user, content: a}\n"
                                         "messages:\n  - {role: user, content: b}\n")
    with pytest.raises(PromptError, match=r"twice.yaml:4:1: .*duplicate key 'messages' \(first at line 2\)"):
        load_prompt("twice", tmp_path)
    (tmp_path / "latin.yaml").write_bytes(b"version: 1\nmessages:\n  - {role: user, content: caf\xe9}\n")
    with pytest.raises(PromptError, match=r"latin.yaml:3:.*not UTF-8"):
        load_prompt("latin", tmp_path)

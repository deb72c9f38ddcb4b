"""Real models behind the gateway: in-process, and over real HTTP through `python -m llm.serve`.

The embedded SmolLM2 generates real text (a few tokens: about 17 tokens/s on 2 cores).
The Qwen2.5-VL path runs on a tiny randomly initialised model built here: the real
loading, image processing and generation code, with random weights, because no
vision-language weights can be had on this machine.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from conftest import require
from llguidance import LLMatcher
from PIL import Image, ImageDraw, ImageFont
from pydantic import BaseModel

from trajforge.critics.steps import StepJudgement
from trajforge.critics.trajectory import TrajectoryJudgement
from trajforge.data.blobs import BlobStore
from trajforge.envs.actions import validate
from trajforge.envs.axtree import AXNode
from trajforge.envs.browser import Observation, Target
from trajforge.envs.kinds import kind_for
from trajforge.guidance.distill import Outcome
from trajforge.llm import Gateway, GatewayError, ImagePart, Message, Sampling, load_prompt
from trajforge.llm.local import SMOLLM2_ID, LocalModel, checkpoint, load, missing_models, smollm2_folder
from trajforge.llm.messages import TextPart
from trajforge.llm.ocr import OcrReader
from trajforge.llm.structured import Constraint, ThinkAnswer
from trajforge.query_gen.deep_search import CommandAnswer, SelectionAnswer
from trajforge.query_gen.synthesis import InstructionAnswer
from trajforge.rollout.gui_owl import FUNCTIONS, GuiOwlPolicy, ToolCall, call_schema, to_action, tool_spec
from trajforge.rollout.mobile_agent import Notes, Plan, Reflection, WorkerAnswer
from trajforge.rollout.policy import Draw
from trajforge.rollout.stage import model_identity
from trajforge.schemas.config import LLMSettings, LocalModelSettings, load_settings
from trajforge.schemas.records import Query
from trajforge.synth.grounding import Described
from trajforge.synth.pal_ui import deliberation_schema
from trajforge.synth.planning import (
    PLAN,
    PROMPTS,
    ManualAnswer,
    PlanAnswer,
    check_plan,
    copies_example,
    plan_request,
    plan_schema,
    task_problem,
)
from trajforge.synth.semantics import Check

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")

SAY = """
version: 1
sampling: {max_tokens: 6}
messages:
  - role: user
    images: screenshots
    content: "{{ question }}"
"""


@pytest.fixture(scope="module")
def embedded() -> None:
    """The embedded model converted and loaded (once per process; the first conversion takes ~24 s)."""
    reason = missing_models()
    require(reason is None, str(reason))
    load(LocalModelSettings())


@pytest.fixture
def say(tmp_path):
    (tmp_path / "say.yaml").write_text(SAY)
    return load_prompt("say", tmp_path)


def screenshot(*lines: str) -> bytes:
    require(FONT.exists(), f"font {FONT} missing (apt-get install fonts-dejavu-core)")
    image = Image.new("RGB", (480, 80 + 60 * len(lines)), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((30, 40 + 60 * i), line, fill="black", font=ImageFont.truetype(str(FONT), 30))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@contextmanager
def served(*args: str, log: Path) -> Iterator[str]:
    """`python -m llm.serve` on a free loopback port, as a user starts it; yields its /v1 URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trajforge.llm.serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).parents[1],
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"llm.serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"llm.serve did not answer:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def requests_seen(log: Path) -> int:
    return log.read_text().count("POST /v1/chat/completions")


# --------------------------------------------------------------------------- embedded SmolLM2


def test_embedded_model_generates_and_records(embedded, say, tmp_path):
    with Gateway(LLMSettings(), db_url=f"sqlite:///{tmp_path / 'catalog.db'}") as gw:
        result = gw.chat_sync(say.render(question="What is the capital of France?", screenshots=[]))
        again = gw.chat_sync(say.render(question="What is the capital of France?", screenshots=[]))
        stats = gw.stats
    record = result.record
    assert result.text.strip(), "real text"
    assert (record.model, record.model_id, record.backend) == ("local", SMOLLM2_ID, "transformers")
    assert (record.template, record.template_version, record.observation_mode) == ("say", say.version, "text")
    assert record.sampling == Sampling(max_tokens=6) and record.tokens_in > 10 and 0 < record.tokens_out <= 6
    assert record.finish_reason in ("stop", "length") and record.latency_ms > 0 and not record.cached
    assert again.record.cached and again.text == result.text and again.record.attempts == 0
    assert (stats.calls, stats.cache_hits, stats.models) == (2, 1, {"local": SMOLLM2_ID})
    assert stats.prompts == {"say": say.version}


def test_embedded_model_stops_at_a_stop_string(embedded, say):
    prompt = say.render(question="Name three colours.", screenshots=[])
    with Gateway(LLMSettings()) as gw:
        full = gw.chat_sync(prompt, sampling=Sampling(max_tokens=12))
        word = full.text.split()[2]  # greedy decoding: the same answer again, up to this word
        stopped = gw.chat_sync(prompt, sampling=Sampling(max_tokens=12, stop=(word,)))
    assert stopped.text == full.text[: full.text.index(word)] and stopped.record.finish_reason == "stop"
    assert stopped.record.tokens_out < full.record.tokens_out


def test_screenshot_becomes_ocr_text_and_accessibility_tree():
    reason = missing_models(embedded=False)
    require(reason is None, str(reason))
    png = screenshot("Add to cart", "Checkout")
    [message] = OcrReader().as_text([Message(role="user", content=[ImagePart(png=png, ax_tree="button Checkout")])])
    lines = message.text.splitlines()
    assert lines[0].startswith("[Screenshot 1, shown as OCR text")
    assert lines[1].startswith('"Add to cart" @ (') and lines[2].startswith('"Checkout" @ (')
    assert lines[-2:] == ["[Accessibility tree of screenshot 1]", "button Checkout"]
    x, y = (int(v) for v in lines[2].split("@ (")[1].rstrip(")").split(", "))
    assert 30 < x < 250 and 100 < y < 150, "the box centre is in the screenshot's pixels"


def test_text_model_is_given_ocr_and_says_so(embedded, say, tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    ref = blobs.put(screenshot("Settings"))
    with Gateway(LLMSettings(), blobs=blobs) as gw:
        with_tree = gw.chat_sync(
            say.render(
                question="Where is Settings?", screenshots=[ImagePart(sha256=ref.sha256, ax_tree="link Settings")]
            )
        )
        ocr_only = gw.chat_sync(say.render(question="Where is Settings?", screenshots=[ref.sha256]))
        with pytest.raises(GatewayError, match="no blob 0{64}") as missing:
            gw.chat_sync(say.render(question="?", screenshots=["0" * 64]))
    assert with_tree.record.observation_mode == "ocr+ax" and ocr_only.record.observation_mode == "ocr"
    assert with_tree.record.tokens_in > ocr_only.record.tokens_in > 30, "the OCR text (and the tree) reached the model"
    assert missing.value.record.observation_mode == "ocr"


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def smollm2_server(embedded, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with served("--model", "smollm2", log=log) as url:
        yield url, log


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_url(request, tmp_path):
    if request.param == "sqlite":
        return None  # the default: SQLite under the warehouse
    return request.getfixturevalue("postgres_url")


def test_configured_endpoint_is_called_over_http_and_cached(smollm2_server, catalog_url, tmp_path, say):
    url, log = smollm2_server
    config = tmp_path / "trajforge.yaml"
    warehouse = {"path": str(tmp_path / "warehouse")} | ({"catalog_url": catalog_url} if catalog_url else {})
    endpoint = {"base_url": url, "model": SMOLLM2_ID, "max_concurrency": 2}
    config.write_text(json.dumps({"warehouse": warehouse, "llm": {"default": "box", "endpoints": {"box": endpoint}}}))
    question = f"Say hello to {uuid.uuid4().hex[:6]}."  # new to the (shared, persistent) PostgreSQL cache
    before = requests_seen(log)
    with Gateway.from_settings(load_settings(config)) as gw:
        first = gw.chat_sync(say.render(question=question, screenshots=[]))
        second = gw.chat_sync(say.render(question=question, screenshots=[]))
    assert requests_seen(log) - before == 1, "the second identical call is answered by the cache"
    assert first.text.strip() and second.text == first.text
    assert (first.record.backend, first.record.model, first.record.model_id) == ("openai", "box", SMOLLM2_ID)
    assert first.record.tokens_in > 10 and 0 < first.record.tokens_out <= 6 and first.record.attempts == 1
    assert second.record.cached and not first.record.cached
    with Gateway.from_settings(load_settings(config)) as rerun:  # a rerun, in a new process's place
        assert rerun.chat_sync(say.render(question=question, screenshots=[])).record.cached
    assert requests_seen(log) - before == 1


def test_text_endpoint_gets_ocr_text_not_images(smollm2_server, say):
    url, log = smollm2_server
    settings = LLMSettings(endpoints={"box": {"base_url": url, "model": SMOLLM2_ID}}, default="box", cache=False)
    with Gateway(settings) as gw:  # the server answers 400 to images for a text model: this passes only as text
        result = gw.chat_sync(say.render(question="What does it say?", screenshots=[screenshot("Checkout")]))
    assert result.record.observation_mode == "ocr" and result.record.tokens_in > 30 and result.text.strip()


def test_a_checkpoint_is_asked_by_its_folder_in_process_or_from_the_endpoint_that_serves_it(embedded, say, tmp_path):
    """The names a trained checkpoint goes by (loop.serve): its folder's absolute path, loaded beside 'local',
    and ENDPOINT:FOLDER, the endpoint's server asked for that model (as vLLM serves a folder by its path)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(smollm2_folder(LocalModelSettings().cache_dir), folder)
    with served("--model", str(folder), log=tmp_path / "serve.log") as url:
        settings = LLMSettings(endpoints={"box": {"base_url": url, "model": SMOLLM2_ID}}, cache=False)
        with Gateway(settings) as gw:
            here = gw.chat_sync(say.render(question="Say hi.", screenshots=[]), model=str(folder))
            there = gw.chat_sync(say.render(question="Say hi.", screenshots=[]), model=f"box:{folder}")
            with pytest.raises(GatewayError, match="404"):  # the endpoint's own model is not served there
                gw.chat_sync(say.render(question="Say hi.", screenshots=[]), model="box")
            with pytest.raises(ValueError, match="no config.json"):
                gw.chat_sync(say.render(question="Say hi.", screenshots=[]), model=str(tmp_path / "gone"))
    assert (here.record.backend, here.record.model_id) == ("transformers", checkpoint(str(folder))[0])
    assert (there.record.backend, there.record.model, there.record.model_id) == ("openai", f"box:{folder}", str(folder))
    assert here.text.strip() and there.text == here.text  # the same weights, greedy


def test_server_refuses_what_it_cannot_do(smollm2_server):
    url, _ = smollm2_server
    body = {"model": SMOLLM2_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/chat/completions", json={**body, "model": "gpt-x"}).status_code == 404
    assert httpx.post(f"{url}/chat/completions", json={**body, "stream": True}).status_code == 400
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]}
    answer = httpx.post(f"{url}/chat/completions", json={**body, "messages": [image]})
    assert answer.status_code == 400 and "messages[0].content[0].image_url.url" in answer.text


# --------------------------------------------------------------------------- a Qwen2.5-VL checkpoint


def build_tiny_qwen25_vl(folder: Path) -> None:
    """A Qwen2.5-VL checkpoint with random weights, a tiny BPE tokenizer and Qwen's image tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["click the Checkout button", "type hello into the search box", "scroll down"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = (  # Qwen2.5-VL's layout: an image is <|vision_start|><|image_pad|><|vision_end|>
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ids: dict[str, int] = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in specials}  # type: ignore[arg-type]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
            window_size=56,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    reason = missing_models(embedded=False)
    require(reason is None, str(reason))
    folder = tmp_path_factory.mktemp("qwen25vl") / "tiny-qwen2.5-vl"
    build_tiny_qwen25_vl(folder)
    return folder


def test_an_image_the_local_model_cannot_read_fails_that_request_as_a_gateway_error(tiny_vl, say):
    """A request the in-process model cannot answer fails that request alone, as an endpoint's error does: a
    GatewayError whose record says why, so a stage drops the one row and counts it (a raw UnidentifiedImageError
    crashed the stage)."""
    broken_image = ImagePart(png=b"not a png")
    broken = say.render(question="click Checkout", screenshots=[broken_image])
    with Gateway(LLMSettings(local={"model": str(tiny_vl)}, cache=False)) as gw:
        with pytest.raises(GatewayError) as err:
            gw.chat_sync(broken)
        assert gw.stats.errors == 1 and gw.stats.calls == 0
    record = err.value.record
    model_id = checkpoint(str(tiny_vl))[0]
    assert (record.model_id, record.backend, record.observation_mode) == (model_id, "transformers", "image")
    assert record.error == f"local model {model_id}: image {broken_image.sha256} cannot be read: not an image " \
        "Pillow can read"


def test_local_vision_checkpoint_sees_the_image_in_process_and_over_http(tiny_vl, say, tmp_path):
    image = screenshot("Checkout")
    prompt = say.render(
        question="click the Checkout button", screenshots=[ImagePart(png=image, ax_tree="button Checkout")]
    )
    sampling = Sampling(max_tokens=4)
    local = LLMSettings(local={"model": str(tiny_vl)}, cache=False)
    with Gateway(local) as gw:
        in_process = gw.chat_sync(prompt, sampling=sampling)
        text_only = gw.chat_sync(say.render(question="click the Checkout button", screenshots=[]), sampling=sampling)
    record = in_process.record
    model_id = checkpoint(str(tiny_vl))[0]
    assert (record.model_id, record.backend, record.observation_mode) == (model_id, "transformers", "image")
    assert record.tokens_in > text_only.record.tokens_in + 10, "the image's tokens are in the input"
    assert 0 < record.tokens_out <= 4

    log = tmp_path / "serve.log"
    with served("--model", str(tiny_vl), log=log) as url:
        remote = LLMSettings(
            endpoints={"vl": {"base_url": url, "model": str(tiny_vl), "vision": True}}, default="vl", cache=False
        )
        with Gateway(remote) as gw:
            over_http = gw.chat_sync(prompt, sampling=sampling)
    assert over_http.record.observation_mode == "image" and over_http.record.backend == "openai"
    # The same weights given the same image as a data URL: the same input tokens and the same greedy answer.
    assert (over_http.record.tokens_in, over_http.text) == (record.tokens_in, in_process.text)


def test_a_checkpoint_written_again_into_its_folder_is_a_new_model(tiny_vl, say, tmp_path):
    """A trainer that writes new weights into the same folder (the loop training a night again, a trainer's
    --output_dir overwritten) makes a new model: a new id, so its answers come from its new weights, not from the
    old model's cached ones, and its queries roll again. A file written beside the weights changes nothing."""
    import torch
    from transformers import AutoModelForImageTextToText

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_vl, folder)
    config = tmp_path / "trajforge.yaml"
    config.write_text(json.dumps({"warehouse": {"path": str(tmp_path / "warehouse")},
                                  "llm": {"default": "local", "local": {"model": str(folder)}}}))
    settings = load_settings(config)
    prompt = say.render(question="click Checkout", screenshots=[])
    sampling = Sampling(max_tokens=4)
    with Gateway.from_settings(settings) as gw:
        old = gw.chat_sync(prompt, sampling=sampling)
        rolled = model_identity(settings, settings.rollout)
        (folder / "README.md").write_text("A model card the trainer wrote.\n")
        assert gw.chat_sync(prompt, sampling=sampling).record.model_id == old.record.model_id
        assert model_identity(settings, settings.rollout) == rolled

        retrained = AutoModelForImageTextToText.from_pretrained(folder)
        with torch.no_grad():
            for weights in retrained.parameters():
                weights.add_(torch.randn_like(weights))
        retrained.save_pretrained(folder)
        new = gw.chat_sync(prompt, sampling=sampling)
    loaded = load(settings.llm.local).model.state_dict()
    assert all(torch.equal(loaded[name], weights) for name, weights in retrained.state_dict().items())
    assert not new.record.cached and new.record.model_id != old.record.model_id
    assert model_identity(settings, settings.rollout) != rolled  # a new attempt key: its queries roll again
    assert old.record.model_id.startswith(f"{folder}@") and new.record.model_id.startswith(f"{folder}@")


def test_missing_checkpoint_names_the_setting(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=f"llm.local.model: {tmp_path / 'nope'} is not a transformers checkpoint"
    ):
        Gateway(LLMSettings(local={"model": str(tmp_path / "nope")}))


# --------------------------------------------------------------------------- constrained decoding

YES_NO = """
version: 1
format: json
sampling: {max_tokens: 24}
messages:
  - role: user
    content: "Is the sky blue? Answer with JSON."
"""


class YesNo(BaseModel):
    answer: Literal["yes", "no"]


def policy_prompt(task: str = "Open the inbox and read the newest mail") -> Any:
    """GUI-Owl's step prompt for a mobile screen, without a screenshot (a text model needs none here)."""
    return load_prompt("gui_owl_e2e").render(
        platform="mobile", width=412, height=732, tools=tool_spec("mobile"), function="mobile_use",
        task=task, guidance=None, history=[], screenshots=[])


def assert_valid_call(result: Any) -> None:
    assert result.parse_error is None and result.parsed is not None, result.text
    action = to_action(result.parsed, "mobile_use")
    assert validate(action, 412, 732, "mobile") is None, action  # points included: on the screen


def test_a_grammar_lets_the_model_write_only_what_it_allows(embedded):
    model = load(LocalModelSettings())
    ask = [Message(role="user", content=[TextPart(text="Write a long poem about the sea.")])]
    answers = {model.generate(ask, Sampling(temperature=1.0, max_tokens=8, seed=seed), 'start: "yes" | "no"').text
               for seed in range(4)}
    assert answers <= {"yes", "no"} and answers
    free = model.generate(ask, Sampling(max_tokens=8)).text
    assert free not in ("yes", "no")  # the grammar, not the prompt, made those answers


def test_forced_tokens_fed_in_one_pass_give_generates_greedy_answer_and_a_seeded_draw_repeats(embedded):
    model = load(LocalModelSettings())
    rendered = policy_prompt()
    grammar = Constraint("tool_call", call_schema("mobile", 412, 732)).grammar
    greedy = Sampling(temperature=0.0, max_tokens=120)
    ours = model.generate(list(rendered.messages), greedy, grammar)
    theirs = model._generate(model._text_inputs(list(rendered.messages)), greedy, grammar)  # one pass per token
    assert ours.text == model.tokenizer.decode(theirs, skip_special_tokens=True)
    assert ours.tokens_out == len(theirs)
    drawn = Sampling(temperature=1.0, max_tokens=60, seed=7)
    assert model.generate(list(rendered.messages), drawn, grammar).text == \
        model.generate(list(rendered.messages), drawn, grammar).text


def test_generate_samples_as_asked_whatever_the_checkpoints_generation_config_says(embedded):
    """`_generate` (a vision model's path) took what it was not told from the checkpoint's generation_config:
    Qwen2.5-VL's `top_k: 1` made n seeded samples one answer n times, and a repetition penalty changed greedy
    answers. Given such a config, its greedy answer is the kept-cache loop's and its draws differ by seed."""
    import torch

    model = LocalModel(smollm2_folder(LocalModelSettings().cache_dir), SMOLLM2_ID)  # its own: the config is edited
    model.model.generation_config.top_k, model.model.generation_config.repetition_penalty = 1, 1.3
    messages = list(policy_prompt().messages)
    inputs = model._text_inputs(messages)
    greedy = Sampling(temperature=0.0, max_tokens=30)
    assert model.tokenizer.decode(model._generate(inputs, greedy, None), skip_special_tokens=True) == model.generate(
        messages, greedy).text
    draws = set()
    for seed in (1, 2, 3):
        torch.manual_seed(0)  # the seed asked for, not the global generator's state, decides the draw
        draws.add(tuple(model._generate(inputs, Sampling(temperature=1.0, max_tokens=30, seed=seed), None)))
    assert len(draws) == 3


def test_a_seeded_draw_is_the_same_whatever_another_model_draws_meanwhile(embedded):
    """Two models generating at once in one process (a policy beside a critic): a draw of the other's between two
    of this answer's tokens, from torch's global generator, changed this seeded answer."""
    import torch

    model = load(LocalModelSettings())
    ask = [Message(role="user", content=[TextPart(text="Write a long poem about the sea.")])]
    sampling = Sampling(temperature=1.0, max_tokens=24, seed=7)
    alone = model.generate(ask, sampling).text

    def other_models_draw(module: Any, args: Any) -> None:
        torch.rand(1)

    hook = model.model.model.register_forward_pre_hook(other_models_draw)
    try:
        beside = model.generate(ask, sampling).text
    finally:
        hook.remove()
    assert beside == alone


def test_a_failure_of_torch_fails_the_call_instead_of_dropping_its_row(embedded, say):
    """On the CPU an allocation failure is a plain RuntimeError; caught as the request's failure it dropped the row
    (and on resume it stayed dropped), and a torch or transformers version mismatch dropped every row in turn."""
    model = load(LocalModelSettings())

    def no_memory(module: Any, args: Any) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 268435456 bytes")

    hook = model.model.model.register_forward_pre_hook(no_memory)
    try:
        with Gateway(LLMSettings(cache=False)) as gw:
            with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
                gw.chat_sync(say.render(question="Say hi.", screenshots=[]))
            assert gw.stats.errors == 0
    finally:
        hook.remove()


def test_a_prompt_that_opens_like_the_last_is_read_from_where_they_part(embedded):
    grammar = Constraint("tool_call", call_schema("mobile", 412, 732)).grammar
    greedy = Sampling(temperature=0.0, max_tokens=40)
    first = list(policy_prompt("Open the inbox and read the newest mail").messages)
    second = list(policy_prompt("Delete the draft named Budget").messages)
    fresh = LocalModel(smollm2_folder(LocalModelSettings().cache_dir), SMOLLM2_ID)
    expected = fresh.generate(second, greedy, grammar)

    warm = load(LocalModelSettings())
    warm.generate(first, greedy, grammar)
    fed: list[int] = []
    hook = warm.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        answer = warm.generate(second, greedy, grammar)
    finally:
        hook.remove()
    assert answer.text == expected.text and answer.tokens_in == expected.tokens_in
    a, b = (warm._text_inputs(m)["input_ids"][0].tolist() for m in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > 500  # the system message and the tools
    assert fed[0] == len(b) - shared  # the prompt's first pass read only where it parts from the last


def test_a_free_answer_reads_as_generates_and_from_the_kept_cache(embedded):
    """Free answers (captions, validations, reasoning) take the constrained answers' loop for its kept cache."""
    greedy = Sampling(temperature=0.0, max_tokens=30)
    first = list(policy_prompt("Open the inbox and read the newest mail").messages)
    second = list(policy_prompt("Delete the draft named Budget").messages)
    model = load(LocalModelSettings())
    model.generate(first, greedy)
    fed: list[int] = []
    hook = model.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        answer = model.generate(second, greedy)
    finally:
        hook.remove()
    theirs = model._generate(model._text_inputs(second), greedy, None)  # transformers' generate, a fresh cache
    assert answer.text == model.tokenizer.decode(theirs, skip_special_tokens=True) and answer.text
    assert answer.tokens_out == len(theirs)
    a, b = (model._text_inputs(m)["input_ids"][0].tolist() for m in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert fed[0] == len(b) - shared  # the first pass read only where the prompt parts from the last
    assert len(fed) == answer.tokens_out  # then one pass a token: nothing is forced without a grammar


def test_the_kept_cache_holds_what_transformers_own_holds_as_it_grows_and_after_a_kept_prefix():
    reason = missing_models(embedded=False)
    require(reason is None, str(reason))
    import torch
    from transformers.cache_utils import DynamicLayer

    from trajforge.llm.kv_cache import GrowingLayer

    ours, theirs = GrowingLayer(), DynamicLayer()
    pieces = [torch.randn(1, 3, n, 4) for n in (300, 1, 1, 400, 2)]  # a prompt, two tokens, a longer prompt's tail
    for piece in pieces:
        held, expected = ours.update(piece, -piece), theirs.update(piece, -piece)
        assert all(torch.equal(a, b) for a, b in zip(held, expected, strict=True))
    ours.keep(250)  # the next prompt shares 250 positions; what follows them is written over
    tail = torch.randn(1, 3, 5, 4)
    keys, values = ours.update(tail, -tail)
    expected = torch.cat([pieces[0][..., :250, :], tail], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected) and ours.get_seq_length() == 255


def test_a_draw_stays_within_the_top_p_nucleus():
    import torch

    from trajforge.llm.local import _draw

    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    generator = torch.Generator().manual_seed(0)
    assert {_draw(logits, Sampling(temperature=1.0, top_p=0.5), generator) for _ in range(50)} == {0}
    assert {_draw(logits, Sampling(temperature=1.0, top_p=0.8), generator) for _ in range(200)} == {0, 1}
    assert {_draw(logits, Sampling(temperature=1.0), generator) for _ in range(400)} == {0, 1, 2}
    assert _draw(logits, Sampling(temperature=0.0), generator) == 0


def test_every_structured_answer_has_a_grammar_that_compiles():
    schemas = [StepJudgement, TrajectoryJudgement, InstructionAnswer, SelectionAnswer, CommandAnswer, Outcome,
               Plan, WorkerAnswer, Reflection, Notes, Described, ManualAnswer, PlanAnswer, Check, YesNo]
    for schema in schemas:
        assert LLMatcher.validate_grammar(Constraint("json", schema.model_json_schema()).grammar) == "", schema
    for space, function in FUNCTIONS.items():
        grammar = Constraint("tool_call", call_schema(space, 1280, 800)).grammar  # type: ignore[arg-type]
        assert LLMatcher.validate_grammar(grammar) == "", function
        on_elements = call_schema(space, 1280, 800, [[50, 50], [150, 150]])  # type: ignore[arg-type]
        assert LLMatcher.validate_grammar(Constraint("json", on_elements).grammar) == "", function
        named = call_schema(space, 1280, 800, targets=TARGETS)  # type: ignore[arg-type]
        assert LLMatcher.validate_grammar(Constraint("tool_call", named).grammar) == "", function
    for app in ("shop", "mail", "calendar", "notes", "settings", "writer"):  # plans over each app's page graph
        assert LLMatcher.validate_grammar(Constraint("json", plan_schema(kind_for(app).spec)).grammar) == "", app
    # PAL-UI's deliberation (its retrieve index bounded) and the think_answer layout CES rewards
    assert LLMatcher.validate_grammar(Constraint("json", deliberation_schema(3)).grammar) == ""
    assert LLMatcher.validate_grammar(Constraint("think_answer", ThinkAnswer.model_json_schema()).grammar) == ""


def test_the_embedded_policy_writes_a_valid_action_when_constrained(embedded, tmp_path):
    with Gateway(LLMSettings(), db_url=f"sqlite:///{tmp_path / 'catalog.db'}") as gw:
        result = gw.chat_sync(policy_prompt(), schema=ToolCall, json_schema=call_schema("mobile", 412, 732))
    assert result.record.constrained == "grammar" and len(result.calls) == 1  # no re-ask was needed
    assert_valid_call(result)
    with Gateway(LLMSettings(constrain=False), db_url=f"sqlite:///{tmp_path / 'catalog.db'}") as gw:
        free = gw.chat_sync(policy_prompt(), schema=ToolCall, sampling=Sampling(max_tokens=8))
    assert free.record.constrained is None and not free.record.cached  # a constrained answer is not reused


@pytest.mark.parametrize("app", ["mail", "writer"])
def test_the_embedded_model_plans_over_the_apps_pages_and_their_elements(embedded, tmp_path, app):
    """Held only to a plan's shape, SmolLM2 ran past max_tokens (the shop) or named a page the graph does not have
    ('home' in the mail app); held to the graph's walks while decoding, its plan can be followed from the start.
    Asked for the task before the walk, it copied the prompt's example task; walk first, its task is its own."""
    spec = kind_for(app).spec
    assert spec is not None
    prompt = load_prompt(PLAN, PROMPTS).render(**plan_request(spec))
    with Gateway(LLMSettings(), db_url=f"sqlite:///{tmp_path / 'catalog.db'}") as gw:
        result = gw.chat_sync(prompt, schema=PlanAnswer, json_schema=plan_schema(spec))
    assert result.record.constrained == "grammar" and result.parsed is not None, result.text
    assert check_plan(result.parsed, spec) is None, result.text
    assert 2 <= len(result.parsed.steps) <= 5
    assert task_problem(result.parsed) is None, result.text
    assert not copies_example(result.parsed, prompt.messages[0].text), result.text


TARGETS = [Target("link", "Inbox", 60, 120), Target("button", "Compose", 300, 120),
           Target("link", "Settings \"beta\"", 60, 200)]


def test_the_embedded_policy_clicks_named_elements_and_its_history_says_which(embedded, tmp_path):
    """A text-only model chooses a click among the screen's named elements (click_targets auto -> names), and
    its history says which element each click chose, whatever the model concluded."""
    nodes = (AXNode(0, "RootWebArea", "Mail"),
             *(AXNode(1, t.role, t.name, box=(t.x - 40, t.y - 15, 80, 30)) for t in TARGETS),
             AXNode(1, "button", "Below the screen", box=(10, 900, 80, 30)))
    observation = Observation(png=screenshot("Inbox  Compose", "Settings"), width=412, height=732, url="http://mail/",
                              title="Mail", nodes=nodes)
    centres = {(t.x, t.y): t.name for t in TARGETS}
    with Gateway(LLMSettings(), db_url=f"sqlite:///{tmp_path / 'catalog.db'}") as gw:
        policy = GuiOwlPolicy(gw, viewport="mobile", draw=Draw(temperature=1.0, top_p=1.0, seed=0))
        assert policy.click_targets == "names"
        policy.reset(Query(query_id="q1", app="mail", source="page_graph", instruction="Open the inbox",
                           path=["home", "inbox"], slots_json="{}", checker="page_is", checker_params_json="{}",
                           max_steps=5, generator="test", created_at=datetime.now(UTC), run_id="test"))
        clicks = []
        for _ in range(4):
            out = policy.act(observation, None)
            assert out.error is None and validate(out.action, 412, 732, "mobile") is None, out.raw_output
            if out.action["type"] == "click":
                clicks.append(centres[out.action["x"], out.action["y"]])  # KeyError: a point off the elements
    assert clicks, "four sampled steps on a screen of links and buttons made no click"
    assert [h.split(".")[0] for h in policy._history if h.startswith("click ")] == [f"click {n!r}" for n in clicks]
    assert all(policy._history), policy._history


@pytest.mark.parametrize("how", ["json_schema", "grammar"])
def test_an_endpoint_holds_answers_to_their_format_as_configured(smollm2_server, tmp_path, how):
    url, _ = smollm2_server
    endpoint = {"base_url": url, "model": SMOLLM2_ID, "structured_output": how}
    (tmp_path / "yes_no.yaml").write_text(YES_NO)
    with Gateway(LLMSettings(endpoints={"box": endpoint}, default="box", cache=False)) as gw:
        answer = gw.chat_sync(load_prompt("yes_no", tmp_path).render(), schema=YesNo)
        # Unconstrained under json_schema, the small model rambles to max_tokens and is asked again (48 s on
        # 2 cores): a few tokens, asked once, show the same thing.
        short = {} if how == "grammar" else {"sampling": Sampling(max_tokens=16), "reask": False}
        policy = gw.chat_sync(policy_prompt(), schema=ToolCall, json_schema=call_schema("mobile", 412, 732), **short)
    assert answer.record.constrained == how and answer.parsed is not None, answer.text
    assert answer.text == json.dumps(answer.parsed.model_dump())  # compact: no whitespace to spend tokens on
    if how == "grammar":  # any format
        assert policy.record.constrained == "grammar"
        assert_valid_call(policy)
    else:  # a JSON schema cannot say a tool_call answer's layout: parsed strictly instead
        assert policy.record.constrained is None

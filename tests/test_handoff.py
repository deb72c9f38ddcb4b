"""Trainer-ready exports of a real night's train_e2e version, read back as each trainer reads them: ms-swift's
and LLaMA-Factory's JSONL with `<image>` tags and image files, a `datasets` folder that TRL's vision-language
collator batches (with a small processor built here: no model is downloaded), and the dataset card."""

from __future__ import annotations

import hashlib
import io
import json

import datasets
import pytest
import yaml
from PIL import Image
from test_pipeline import workspace
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from trajforge.data.catalog import Catalog, Lineage
from trajforge.schemas.records import ReasoningChat
from trajforge.synth.handoff import ExportError, export, staged

pytestmark = pytest.mark.browser

TABLE = "train_e2e"

LLAMAFACTORY_KEYS = {"hf_hub_url", "ms_hub_url", "script_url", "file_name", "formatting", "ranking", "subset",
                     "split", "folder", "num_samples", "columns", "tags"}
"""The keys of a dataset_info.json entry (LLaMA-Factory's data/README.md)."""

LLAMAFACTORY_COLUMNS = {"prompt", "query", "response", "history", "messages", "system", "tools", "images", "videos",
                        "audios", "chosen", "rejected", "kto_tag"}
LLAMAFACTORY_TAGS = {"role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag",
                     "system_tag"}


@pytest.fixture(scope="module")
def night(replay_night, tmp_path_factory):
    """The night's catalog, the train_e2e version by its tag, and its export in each SFT format."""
    cwd, tag = replay_night
    catalog = workspace(cwd).catalog
    base = tmp_path_factory.mktemp("handoff")
    exports = {fmt: export(catalog, f"{TABLE}@{tag}", fmt, base / fmt) for fmt in ("ms-swift", "llamafactory", "hf")}
    return catalog, tag, catalog.load(TABLE, tag), exports


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["ms-swift", "llamafactory"])
def test_jsonl_rows_are_the_version_with_one_image_tag_per_image_file(night, fmt):
    catalog, tag, version, exports = night
    result = exports[fmt]
    assert (result.table, result.snapshot) == catalog.resolve(f"{TABLE}@{tag}")
    rows = read_jsonl(result.out / "train.jsonl")
    assert version.height > 0 and result.rows == len(rows) == version.height
    assert result.images == sum(len(r["images"]) for r in rows)
    source = {r["sample_id"]: r for r in version.iter_rows(named=True)}
    assert sorted(r["sample_id"] for r in rows) == sorted(source)
    for row in rows:
        original = source[row["sample_id"]]
        assert row["weight"] == original["weight"] and row["step_id"] == original["step_id"]
        expected = json.loads(original["messages_json"])
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in expected]
        assert all(isinstance(m["content"], str) for m in row["messages"])
        assert sum(m["content"].count("<image>") for m in row["messages"]) == len(row["images"])
        # The tag stands where the image part stood; the text around it is the part's text.
        assert row["messages"][1]["content"] == "".join(
            "<image>" if p["type"] == "image" else p["text"] for p in expected[1]["content"])
        assert row["images"] == [f"images/{hashlib.sha256(png).hexdigest()}.png" for png in original["images"]]
    referenced = {p for r in rows for p in r["images"]}
    files = sorted(result.out.joinpath("images").iterdir())
    assert {f"images/{f.name}" for f in files} == referenced  # each distinct image once, no strays
    for f in files:
        assert hashlib.sha256(f.read_bytes()).hexdigest() == f.stem
        with Image.open(f) as image:
            image.load()


def test_llamafactory_dataset_info_registers_the_table_as_documented(night):
    *_, exports = night
    out = exports["llamafactory"].out
    info = json.loads((out / "dataset_info.json").read_text())
    assert list(info) == [TABLE]
    entry = info[TABLE]
    assert set(entry) <= LLAMAFACTORY_KEYS and entry["formatting"] == "sharegpt"
    assert set(entry["columns"]) <= LLAMAFACTORY_COLUMNS and set(entry["tags"]) <= LLAMAFACTORY_TAGS
    assert entry["columns"] == {"messages": "messages", "images": "images"}
    tags = entry["tags"]
    for row in read_jsonl(out / entry["file_name"]):
        messages = row[entry["columns"]["messages"]]
        roles = [m[tags["role_tag"]] for m in messages]
        assert isinstance(messages[0][tags["content_tag"]], str)
        # sharegpt: an optional system turn, then user at odd and assistant at even positions.
        turns = roles[1:] if roles[0] == tags["system_tag"] else roles
        assert turns == [tags["user_tag"], tags["assistant_tag"]] * (len(turns) // 2) and turns
        assert all((out / p).is_file() for p in row[entry["columns"]["images"]])


def test_hf_export_opens_with_image_features_and_trl_collates_a_batch(night):
    _, _, version, exports = night
    ds = datasets.load_from_disk(str(exports["hf"].out))
    assert len(ds) == version.height == exports["hf"].rows
    assert isinstance(ds.features["images"], datasets.List)
    assert isinstance(ds.features["images"].feature, datasets.Image)
    source = {r["sample_id"]: r for r in version.iter_rows(named=True)}
    for row in ds:
        pngs = source[row["sample_id"]]["images"]
        placeholders = [p for m in row["messages"] for p in m["content"] if p["type"] == "image"]
        assert len(placeholders) == len(row["images"]) == len(pngs)
        for image, png in zip(row["images"], pngs):
            assert isinstance(image, Image.Image)
            assert image.size == Image.open(io.BytesIO(png)).size
    batch = DataCollatorForVisionLanguageModeling(tiny_processor())([ds[0], ds[1]])
    image_tokens = (batch["input_ids"] == IMAGE_ID).sum().item()
    assert batch["pixel_values"].shape[0] == 2 and image_tokens == 2 * TOKENS_PER_IMAGE
    assert batch["labels"].shape == batch["input_ids"].shape


IMAGE_ID = 2
TOKENS_PER_IMAGE = 3  # (28 / 14)^2 patches, less the CLS feature the "default" strategy drops


def tiny_processor() -> LlavaProcessor:
    """A vision-language processor made here from nothing downloaded: a word-level tokenizer knowing only its
    special tokens, a 28-pixel CLIP image processor and a ChatML template, enough for TRL's collator to render
    the messages, fill in the images and expand each into image tokens."""
    special = ["<|im_start|>", "<|im_end|>", "<image>", "<pad>", "[UNK]"]
    words = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special)}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="<pad>",
                                        additional_special_tokens=special[:3])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                "<|im_end|>\n{% endfor %}")
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, chat_template=template,
                          vision_feature_select_strategy="default")


def test_card_names_the_version_counts_lineage_and_licences(night):
    catalog, tag, version, exports = night
    for result in exports.values():
        text = result.card.read_text()
        front = yaml.safe_load(text.split("---")[1])
        assert front["license"] == "other" and front["task_categories"]
        lineage = catalog.lineage(TABLE, tag)
        for fact in (str(result.snapshot), tag, f"rows: {version.height}", f"stage: {lineage.stage}",
                     lineage.config_hash, f"{TABLE}: {lineage.kept[TABLE]}", "gui_owl_e2e: 1", "label mix: ",
                     "source mix of the", "## Licence notes", "- shop: bundled trajforge app"):
            assert fact in text, fact
        for table, snapshot in lineage.inputs.items():
            assert f"{table}: {snapshot}" in text


def test_a_version_by_snapshot_id_is_the_version_by_tag(night, tmp_path):
    catalog, *_, exports = night
    result = export(catalog, f"{TABLE}@{exports['hf'].snapshot}", "ms-swift", tmp_path / "by-id")
    assert (result.out / "train.jsonl").read_bytes() == (exports["ms-swift"].out / "train.jsonl").read_bytes()


@pytest.mark.parametrize(("ref", "fmt", "added", "named"), [
    ("ces_coordinator_rl@latest", "ms-swift", False, ["ces_coordinator_rl", "ms-swift", "an RL table"]),
    ("agentic_q_values", "hf", False, ["agentic_q_values", "hf", "an RL table"]),
    ("steps", "llamafactory", False, ["steps", "not a training table"]),
    (f"{TABLE}@latest", "parquet", False, ["parquet", "ms-swift, llamafactory, hf, verl"]),
    (f"{TABLE}@no-such-tag", "hf", False, ["no-such-tag"]),
    ("queries@latest", "verl", True, ["queries@latest", "verl exports a queries version whole"]),
    # The replay night writes no row to a Mobile-Agent role table: an empty file would fail the trainer instead.
    ("train_manager@latest", "hf", False, ["train_manager@latest: no rows to export"]),
    ("train_manager@latest", "ms-swift", True, ["train_manager@latest: no rows to export", "added none"]),
])
def test_what_cannot_be_exported_fails_naming_it_and_writes_nothing(night, tmp_path, ref, fmt, added, named):
    catalog, *_ = night
    with pytest.raises(ExportError) as error:
        export(catalog, ref, fmt, tmp_path / "out", added_only=added)
    assert all(n in str(error.value) for n in named), str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_folder_is_refused_and_left_untouched(night, tmp_path):
    catalog, tag, *_ = night
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export(catalog, f"{TABLE}@{tag}", "ms-swift", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # A file where the folder, or a folder above it, would be: named as given, not as the temporary written first.
    with pytest.raises(ExportError, match=r"output folder .*notes.txt is a file"):
        export(catalog, f"{TABLE}@{tag}", "ms-swift", out / "notes.txt")
    with pytest.raises(ExportError, match=r"cannot make output folder .*notes.txt/sub: "):
        export(catalog, f"{TABLE}@{tag}", "ms-swift", out / "notes.txt" / "sub")
    out.joinpath("notes.txt").unlink()  # an empty folder is taken
    assert export(catalog, f"{TABLE}@{tag}", "ms-swift", out).rows > 0


def commit_reasoning(catalog: Catalog, run_id: str, styles: list[str]) -> None:
    """One train_reasoning row per hint style (its sample_id), committed by run `run_id` as the stage does."""
    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), "white").save(buffer, format="PNG")
    messages = json.dumps([
        {"role": "user", "content": [{"type": "text", "text": "Open the cart."}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<thinking>Tap Cart.</thinking>"}]}])
    rows = [ReasoningChat(run_id=run_id, sample_id=style, source_id=f"reasoning:{style}", messages_json=messages,
                          images=[buffer.getvalue()], tag="t", hint_style=style, hinted_with_answer=style == "hinted")
            for style in styles]
    catalog.commit_rows("train_reasoning", rows, Lineage(stage="reasoning", run_id=run_id,
                                                         commit_key=f"{run_id}/reasoning", config_hash="c",
                                                         code_version="v"))


def test_a_reasoning_written_with_the_answer_shown_is_told_apart_in_every_format(tmp_path):
    """train_reasoning mixes reasoning a model found (rejection-sampled) with reasoning written to a trusted action
    it was shown: each trainer format carries `hint_style` and `hinted_with_answer`, so a job can leave the
    rationalisations out or weigh them apart."""
    catalog = Catalog(tmp_path / "warehouse")
    commit_reasoning(catalog, "r", ["cot", "hinted"])
    want = {"cot": ("cot", False), "hinted": ("hinted", True)}
    for fmt in ("ms-swift", "llamafactory"):
        out = export(catalog, "train_reasoning@latest", fmt, tmp_path / fmt).out
        assert {r["sample_id"]: (r["hint_style"], r["hinted_with_answer"])
                for r in read_jsonl(out / "train.jsonl")} == want, fmt
    ds = datasets.load_from_disk(str(export(catalog, "train_reasoning@latest", "hf", tmp_path / "hf").out))
    assert ds.features["hinted_with_answer"].dtype == "bool"
    assert {r["sample_id"]: (r["hint_style"], r["hinted_with_answer"]) for r in ds} == want


def test_the_card_of_the_rows_a_run_added_counts_those_rows_only(tmp_path):
    """`--added` (every loop export) writes the night's rows of a version that holds every night's: the card's
    mixes counted the whole version beside "rows:" of the exported ones, so a night of hinted reasoning read as
    mostly found."""
    catalog = Catalog(tmp_path / "warehouse")
    commit_reasoning(catalog, "night-1", ["cot", "found", "more"])
    commit_reasoning(catalog, "night-2", ["hinted"])
    card = export(catalog, "train_reasoning@latest", "ms-swift", tmp_path / "out", added_only=True).card.read_text()
    assert "- rows: 1\n" in card and "- hint_style mix: hinted 1\n" in card, card


def test_the_hf_card_says_how_to_learn_the_answers_only(tmp_path):
    """TRL's SFTTrainer learns a `messages` dataset's prompt tokens too unless told otherwise: the card said it took
    the export as is."""
    catalog = Catalog(tmp_path / "warehouse")
    commit_reasoning(catalog, "r", ["cot"])
    card = export(catalog, "train_reasoning@latest", "hf", tmp_path / "hf").card.read_text()
    assert "learns the prompt's tokens too" in card and "SFTConfig(assistant_only_loss=True)" in card
    assert "{% generation %}" in card


def test_a_crash_while_writing_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged(out) as tmp:
        (tmp / "train.jsonl").write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []

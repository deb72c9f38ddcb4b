"""Trainer-ready exports of one version of an SFT training table (`trajforge export TABLE@VERSION`).

The training tables keep a sample as Qwen2.5-VL chat messages (`messages_json`) with the PNG
bytes of each image part in `images`; each trainer wants that in its own shape:

- `ms-swift`: `train.jsonl` of {"messages": [{role, content: str}], "images": [path]} with one
  `<image>` tag per image part at its place in the content (ms-swift's standard format; extra
  keys are allowed and dropped by its SFT).
- `llamafactory`: the same file, registered in `dataset_info.json` as a sharegpt dataset with
  OpenAI-style role/content tags (LLaMA-Factory's data/README.md).
- `hf`: a `datasets` folder (`save_to_disk`) in TRL's vision-language conversational format:
  `messages` with structured content and `images` as a list of Image features.
- `verl`: not a training table but `queries@VERSION`, as RL tasks rewarded by their checkers
  (`synth.verl`). The step-level RL tables (CES groups, Agentic-Q values and groups) have no
  trainer format yet; a trainer reads their Parquet version from the catalog.

Image files are named by the sha256 of their bytes, so a screenshot shared by many rows is
written once. Every export gets a dataset card (`README.md`): the version, counts, lineage
and licence notes, so a trained model can be traced back to what it learnt from.

An export is written into a temporary sibling folder and renamed into place at the end: a
crash leaves no half-written folder under the name a training job would read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import yaml

from trajforge.data.catalog import Catalog, Lineage, UnknownRef
from trajforge.envs import apps as bundled_apps
from trajforge.envs.android import APP as ANDROID
from trajforge.envs.apps.registry import known_apps
from trajforge.envs.miniwob import APP as MINIWOB
from trajforge.llm.messages import ImagePart, Message, TextPart
from trajforge.llm.ocr import OcrReader
from trajforge.schemas.records import RECORDS, CESGroup, ChatSample, QGroup, QValueSample, TrainingStep


class ExportError(ValueError):
    """An export that cannot be done as asked; the message names the table, version, format or row at fault."""


SFT_FORMATS = ("ms-swift", "llamafactory", "hf")
"""Formats of the SFT tables."""
FORMATS = (*SFT_FORMATS, "verl")

SFT_TABLES = frozenset(t for t, m in RECORDS.items() if issubclass(m, (ChatSample, TrainingStep)))
"""Tables whose rows are chat samples with an answer to learn."""

RL_TABLES = frozenset(t for t, m in RECORDS.items() if issubclass(m, (CESGroup, QValueSample, QGroup)))
"""Tables of prompts with rewards or values: for an RL trainer, not for SFT."""

META = {"sample_id": "string", "source_id": "string", "step_id": "string", "episode_id": "string",
        "query_id": "string", "weight": "float64", "hint_style": "string", "hinted_with_answer": "bool"}
"""Columns kept beside the messages, so a trained-on row can be traced back and re-weighted, and a reasoning
written with the answer shown (`hinted_with_answer`, `hint_style` hinted) told from one that found it."""

MIX_COLUMNS = ("label", "kind", "source", "tier", "trusted", "outcome", "hint_style", "silver")
"""Columns whose value counts the card shows, in the table or in the input rows its rows were made from."""

PNG = b"\x89PNG\r\n\x1a\n"
IMAGE_TAG = "<image>"


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the folder, the version it holds, its rows, the image parts over all rows (a
    screenshot shared by rows counts once per row) and the dataset card."""

    out: Path
    table: str
    snapshot: int
    rows: int
    images: int
    card: Path


@dataclass(frozen=True)
class Sample:
    """One row, checked: its messages, its PNGs in part order and the kept columns."""

    messages: list[dict[str, Any]]
    images: list[bytes]
    meta: dict[str, Any]


def export(catalog: Catalog, ref: str, fmt: str, out: Path, *, added_only: bool = False,
           paths_from: Path | None = None, viewport: str | None = None) -> ExportResult:
    """Write exactly the version `ref` (TABLE@VERSION: snapshot id, tag or latest) of an SFT table to `out` in
    the trainer format `fmt`; with `added_only`, only the rows the run behind that version wrote (the night's
    data, `Catalog.rows_added`), as the loop trains on.

    A JSONL format's image paths are relative to `paths_from` (default `out`): the loop gives the folder its
    trainer runs in, above each table's, since ms-swift opens a relative path from where it runs.

    verl needs `viewport`, the user's `rollout.viewport`: its prompts give the screen size and action space a
    rollout of theirs starts in."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    if fmt == "verl":
        if added_only:
            raise ExportError(f"{ref}: verl exports a queries version whole; only an SFT table's export takes the "
                              "rows its run added")
        if viewport is None:
            raise ExportError(f"{ref}: the verl export needs the viewport rollouts run in (rollout.viewport)")
        from trajforge.synth.verl import export_verl

        return export_verl(catalog, ref, out, viewport=viewport)
    name = ref.partition("@")[0]
    if name not in SFT_TABLES:
        applies = ("none yet (an RL table: read its version from the catalog; verl takes queries@VERSION)"
                   if name in RL_TABLES else "none (it is not a training table)")
        raise ExportError(f"{ref}: {fmt} exports SFT tables only ({', '.join(sorted(SFT_TABLES))}); "
                          f"formats for {name!r}: {applies}")
    table, snapshot, frame, samples = _samples(catalog, ref, added_only)
    out = Path(out)
    with staged(out) as tmp:
        prefix = "" if paths_from is None else f"{Path(os.path.relpath(out, paths_from)).as_posix()}/"
        notes = _write_hf(tmp, samples) if fmt == "hf" else _write_jsonl(tmp, samples, table, fmt, prefix)
        if added_only:
            notes.append(f"Only the {len(samples)} rows the run behind snapshot {snapshot} added to the table.")
        write_card(tmp, catalog, table, snapshot, rows=frame, fmt=fmt, extra=notes)
    return ExportResult(out=out, table=table, snapshot=snapshot, rows=len(samples),
                        images=sum(len(s.images) for s in samples), card=out / "README.md")


def text_samples(catalog: Catalog, ref: str, reader: OcrReader, *, added_only: bool = False) -> list[dict[str, Any]]:
    """The version's rows as a text-only model reads them, in TRL's conversational prompt/completion format with
    one sample per assistant answer (the turns before it are its prompt), plus `table` and `sample_id`.

    Each image becomes its OCR text, and a one-screenshot row of a step (the policy's own prompt: train_e2e,
    train_reasoning) gets that step's accessibility tree beside it: what the gateway showed the embedded model
    at rollout (`OcrReader.as_text`). The night's screens are in the OCR cache already, so this reads no new
    image."""
    table, _, _, samples = _samples(catalog, ref, added_only)
    trees = _ax_trees(catalog, {s.meta["step_id"] for s in samples if "step_id" in s.meta and len(s.images) == 1})
    out: list[dict[str, Any]] = []
    for s in samples:
        tree = trees.get(s.meta.get("step_id", "")) if len(s.images) == 1 else None
        pngs = iter(s.images)
        messages = [Message(role=m["role"], content=[ImagePart(png=next(pngs), ax_tree=tree) if p["type"] == "image"
                                                     else TextPart(text=p["text"]) for p in m["content"]])
                    for m in s.messages]
        shown = [{"role": m.role, "content": m.text} for m in reader.as_text(messages)]
        out += [{"prompt": shown[:i], "completion": [m], "table": table, "sample_id": s.meta.get("sample_id")}
                for i, m in enumerate(shown) if m["role"] == "assistant"]
    return out


def _samples(catalog: Catalog, ref: str, added_only: bool) -> tuple[str, int, pl.DataFrame, list[Sample]]:
    """The table, snapshot, rows and checked samples of `ref`: all of its rows, or with `added_only` those its run
    added."""
    table, snapshot = resolve_version(catalog, ref)
    if added_only and catalog.lineage(table, snapshot) is None:  # rows_added would give every row
        raise ExportError(f"{ref}: snapshot {snapshot} was not written by a stage, so which rows its run added is "
                          "unknown; export it whole (without --added)")
    frame = catalog.rows_added(table, snapshot)[0] if added_only else catalog.load(table, snapshot)
    if frame.is_empty():  # a trainer fails on an empty file (datasets' JSON loader, verl's empty dataloader)
        raise ExportError(f"{ref}: no rows to export" + (f" (the run behind snapshot {snapshot} added none)"
                                                         if added_only else ""))
    return table, snapshot, frame, [_sample(row, f"{table}@{snapshot}") for row in frame.iter_rows(named=True)]


def _ax_trees(catalog: Catalog, step_ids: set[str]) -> dict[str, str]:
    """step_id -> the accessibility tree before the step, for the steps named."""
    if not step_ids:
        return {}
    steps = catalog.scan("steps").filter(pl.col("step_id").is_in(sorted(step_ids)))
    return dict(steps.select("step_id", "ax_tree_before").collect().iter_rows())


def resolve_version(catalog: Catalog, ref: str) -> tuple[str, int]:
    """The table and snapshot id of a ref, or an ExportError saying why there is none."""
    try:
        table, snapshot = catalog.resolve(ref)
    except UnknownRef as exc:
        raise ExportError(str(exc)) from exc
    if snapshot is None:
        raise ExportError(f"{ref}: table {table!r} has no versions yet; nothing to export")
    return table, snapshot


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh temporary sibling of `out` to write into, renamed to `out` when the block ends without error and
    removed otherwise. `out` must not exist or be an empty folder: an export never mixes with other files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"output folder {out} is a file; give a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output folder {out} exists and is not empty; give a new or empty folder")
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:  # a file where a folder should be, no permission: named as given, not as the temporary
        raise ExportError(f"cannot make output folder {out}: {exc.strerror or exc}") from None
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sample(row: dict[str, Any], version: str) -> Sample:
    """A row's messages and images, checked against what every trainer needs: known roles, an optional system
    turn then user and assistant turns in turn ending with an answer, one PNG per image part."""
    where = f"{version} row {row.get('sample_id')!r}"
    messages = json.loads(row["messages_json"])
    roles = [m["role"] for m in messages]
    turns = roles[1:] if roles[:1] == ["system"] else roles
    if not turns or len(turns) % 2 or turns != ["user", "assistant"] * (len(turns) // 2):
        raise ExportError(f"{where}: roles {roles} are not [system], then user and assistant in turn")
    images = list(row["images"] or [])
    parts = [p for m in messages for p in m["content"]]
    if any(p["type"] not in ("text", "image") for p in parts):
        raise ExportError(f"{where}: a content part is neither text nor image: {sorted({p['type'] for p in parts})}")
    if sum(p["type"] == "image" for p in parts) != len(images):
        raise ExportError(f"{where}: {sum(p['type'] == 'image' for p in parts)} image parts but {len(images)} images")
    if any(IMAGE_TAG in (p.get("text") or "") for p in parts):
        raise ExportError(f"{where}: a text part holds {IMAGE_TAG!r}, which trainers would read as an image")
    for i, png in enumerate(images):
        if not png.startswith(PNG):
            raise ExportError(f"{where}: image {i} is not PNG bytes (a blob reference?)")
    meta = {k: row[k] for k in META if row.get(k) is not None}
    return Sample(messages, images, meta)


def _write_jsonl(out: Path, samples: list[Sample], table: str, fmt: str, prefix: str = "") -> list[str]:
    """`train.jsonl` with `<image>` tags and image paths relative to `out` (each after `prefix`, the path from the
    folder they are relative to instead), and for LLaMA-Factory its `dataset_info.json`; returns the card's notes
    on using it."""
    (out / "images").mkdir()
    with (out / "train.jsonl").open("w", encoding="utf-8") as f:
        for s in samples:
            paths = [prefix + _write_image(out, png) for png in s.images]
            messages = [{"role": m["role"], "content": "".join(IMAGE_TAG if p["type"] == "image" else p["text"]
                                                               for p in m["content"])} for m in s.messages]
            f.write(json.dumps({"messages": messages, "images": paths, **s.meta}, ensure_ascii=False) + "\n")
    home = f"the folder that holds this one as `{prefix.rstrip('/')}` (where the loop's trainer runs)" if prefix \
        else "this folder"
    notes = [f"Image paths are relative to {home}; the trainer ignores the columns beside `messages` "
             "(ids, `weight`, a reasoning's `hint_style` and `hinted_with_answer`).",
             *_weight_note(samples)]
    if fmt == "ms-swift":
        where = "that folder" if prefix else "this folder"
        return [*notes, f"Train from {where}: `swift sft --dataset {prefix}train.jsonl ...` (ms-swift's standard "
                "format)."]
    entry = {"file_name": f"{prefix}train.jsonl", "formatting": "sharegpt",
             "columns": {"messages": "messages", "images": "images"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                      "assistant_tag": "assistant", "system_tag": "system"}}
    (out / "dataset_info.json").write_text(json.dumps({table: entry}, indent=2) + "\n")
    if prefix:
        return [*notes, (f"LLaMA-Factory: `dataset_dir: <that folder>`, `dataset: {table}` (its dataset_info.json "
                         "registers every table of the loop's data).")]
    return [*notes, (f"LLaMA-Factory: `dataset_dir: <this folder>`, `dataset: {table}` (registered in "
                     "dataset_info.json; images are found under `media_dir`, which defaults to `dataset_dir`).")]


def _write_image(out: Path, png: bytes) -> str:
    """The image's path relative to `out`, written once per distinct image."""
    path = f"images/{hashlib.sha256(png).hexdigest()}.png"
    if not (out / path).exists():
        (out / path).write_bytes(png)
    return path


def _write_hf(out: Path, samples: list[Sample]) -> list[str]:
    """A `datasets` folder in TRL's vision-language format; returns the card's notes on using it."""
    from datasets import Dataset, Features, Image, List, Value

    meta = [k for k in META if any(k in s.meta for s in samples)]
    features = Features({
        "messages": List({"role": Value("string"),
                          "content": List({"type": Value("string"), "text": Value("string")})}),
        "images": List(Image()),
        **{k: Value(META[k]) for k in meta},
    })
    data = {
        "messages": [[{"role": m["role"], "content": [{"type": p["type"], "text": p.get("text")}
                                                      for p in m["content"]]} for m in s.messages] for s in samples],
        "images": [[{"bytes": png, "path": None} for png in s.images] for s in samples],
        **{k: [s.meta.get(k) for s in samples] for k in meta},
    }
    Dataset.from_dict(data, features=features).save_to_disk(str(out))
    return [("Open with `datasets.load_from_disk(<this folder>)`; TRL's SFTTrainer reads it as it is (`messages` "
             "with `{type: image}` placeholders, filled from `images` in order), and by default learns the prompt's "
             "tokens too: to learn the answers only, set `SFTConfig(assistant_only_loss=True)`, which needs a chat "
             "template with `{% generation %}` markers (TRL 1.16 patches in its own for the templates it knows; "
             "else give one with `chat_template_path`) and, for images, transformers >= 5.18."),
            *_weight_note(samples)]


def _weight_note(samples: list[Sample]) -> list[str]:
    """Why `weight` is there: no trainer format applies a per-row weight by itself."""
    if not any("weight" in s.meta for s in samples):
        return []
    return [("`weight` is the row's weight in its table (filter 3's success-rate weight; for pal_ui_sft the "
             "look-back distance weight); no trainer format applies it by itself: sample or repeat rows by it.")]


# ---------------------------------------------------------------- the dataset card


def write_card(out: Path, catalog: Catalog, table: str, snapshot: int, *, rows: pl.DataFrame, fmt: str,
               extra: Sequence[str] = ()) -> Path:
    """`out/README.md`: a Hugging Face dataset card saying which version this is, what is in it, where it came
    from and under which licences, so a model trained on it can be traced back and published honestly. Counts and
    mixes are of `rows`, the rows exported: with `--added` (every loop export) part of the version's."""
    info = catalog.info(table, snapshot)
    lineage = catalog.lineage(table, snapshot)
    columns = rows.columns
    links = [c for c in ("source_id", *sorted({r.key for r in RECORDS.values()})) if c in columns]
    data = rows.select(*[c for c in MIX_COLUMNS if c in columns], *links)
    front = {"license": "other", "license_name": "mixed-see-licence-notes", "pretty_name": f"trajforge {table}",
             "task_categories": ["image-text-to-text"], "tags": ["gui-agent", "trajforge", table, fmt]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {table}", "",
             f"- version: snapshot {snapshot}; tags: {', '.join(info.tags) or 'none'}; "
             f"committed {info.committed_at.isoformat()}",
             f"- format: {fmt}", f"- rows: {rows.height}"]
    lines += [_mix(data, c, "") for c in MIX_COLUMNS if c in columns]
    lines += _upstream_mix(catalog, table, data, links, lineage)
    lines += ["", "## Lineage", "", *_lineage_lines(lineage), "", "## Licence notes", "",
              *_licence_lines(catalog, table, snapshot, lineage), ""]
    if extra:
        lines += ["## Using it", "", *(f"- {line}" for line in extra), ""]
    card = out / "README.md"
    card.write_text("\n".join(lines))
    return card


def _mix(frame: pl.DataFrame, column: str, of: str) -> str:
    tally = Counter(str(v) for v in frame[column].to_list())
    return f"- {column} mix{of}: " + ", ".join(f"{k} {n}" for k, n in tally.most_common())


def _upstream_mix(catalog: Catalog, table: str, data: pl.DataFrame, links: list[str],
                  lineage: Lineage | None) -> list[str]:
    """The mix columns of the rows each row was made from (a grounding row's kind, an e2e step's query source),
    joined on their table's key or on `source_id`: a training table rarely has them itself. They are in the
    input versions, or in the versions the same stage run wrote beside this one."""
    if lineage is None:
        return []
    sources = dict(lineage.inputs)
    for name, model in RECORDS.items():
        if name not in sources and any(c in model.model_fields for c in MIX_COLUMNS):
            try:
                sources[name] = catalog.written_with(name, lineage)
            except LookupError:
                pass
    lines = []
    for name, snap in sources.items():
        model = RECORDS.get(name)
        mix = [c for c in MIX_COLUMNS if model and c in model.model_fields]
        link = next((c for c in links if model and c in (model.key, "source_id")), None)
        if name == table or model is None or not mix or link is None:
            continue
        ids = data.select(pl.col(link).str.split(",")).explode(link) if link == "source_id" else data.select(link)
        upstream = catalog.scan(name, snap).select(model.key, *mix).filter(
            pl.col(model.key).is_in(ids[link].implode())).collect()
        joined = ids.join(upstream, left_on=link, right_on=model.key)
        lines += [_mix(joined, c, f" of the {joined.height} {name} rows they were made from") for c in mix
                  if joined.height]
    return lines


def _pairs(d: dict[str, Any]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in d.items()) or "none"


def _lineage_lines(lineage: Lineage | None) -> list[str]:
    if lineage is None:
        return ["No lineage recorded: this version was not written by a stage."]
    lines = [f"- stage: {lineage.stage} (run {lineage.run_id}, code {lineage.code_version})",
             f"- input snapshots: {_pairs(lineage.inputs)}", f"- config hash: {lineage.config_hash}",
             f"- models: {_pairs(lineage.models)}", f"- prompt versions: {_pairs(lineage.prompts)}",
             f"- kept: {_pairs(lineage.kept)}", "- dropped:" + ("" if lineage.dropped else " none")]
    lines += [f"  - {n}: {reason}" for reason, n in sorted(lineage.dropped.items(), key=lambda kv: -kv[1])]
    lines += ["- stats:" + ("" if lineage.stats else " none")] + [f"  - {k}: {n}" for k, n in lineage.stats.items()]
    return lines


def _licence_lines(catalog: Catalog, table: str, snapshot: int, lineage: Lineage | None) -> list[str]:
    """What is known of the licences of the apps and task sets behind the rows, found through the lineage."""
    apps = _apps(catalog, table, snapshot)
    lines = [f"- {app}: {_app_licence(app)}" for app in sorted(apps)] or [
        "- apps: not found in the lineage; the licences of the sources are unknown."]
    if lineage is not None and lineage.models:
        lines.append("- models behind the rows: " + ", ".join(sorted(set(lineage.models.values())))
                     + "; check each model's terms for the use of what it wrote.")
    return lines


def _apps(catalog: Catalog, table: str, snapshot: int) -> set[str]:
    """The apps of the `episodes` and `queries` versions this version was built from, found by walking up the
    lineage: an over-estimate when a stage read more episodes than it kept."""
    seen: set[tuple[str, int]] = set()
    todo = [(table, snapshot)]
    apps: set[str] = set()
    while todo:
        name, snap = todo.pop()
        if (name, snap) in seen:
            continue
        seen.add((name, snap))
        if name in ("episodes", "queries"):
            apps |= set(catalog.scan(name, snap).select("app").unique().collect()["app"].to_list())
        try:
            lineage = catalog.lineage(name, snap)
        except UnknownRef:  # an input version since expired: its own inputs are out of reach
            continue
        todo += list(lineage.inputs.items()) if lineage else []
    return apps


def _app_licence(app: str) -> str:
    if app == MINIWOB:
        return "MiniWoB++ task suite (Farama Foundation), MIT licence."
    if app == ANDROID:
        return "Android apps on a device: their licences are not recorded; check them before publishing."
    if app not in known_apps():
        return "not a bundled app (a user's own app): its licence is not known to trajforge."
    spec = yaml.safe_load((Path(bundled_apps.__file__).parent / app / "spec.yaml").read_text()) or {}
    declared = spec.get("license") or spec.get("licence")
    return f"bundled trajforge app, licence {declared}." if declared else (
        "bundled trajforge app written for this project; its spec.yaml declares no licence, so it is that of "
        "the trajforge repository.")

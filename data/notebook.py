"""Notebook helpers: the catalog of the current project, and the few views a person looks at in it.

    from trajforge.data.notebook import open_catalog, show_trajectory, success_per_app
    catalog = open_catalog()
    steps = catalog.load("steps@nightly-2026-11-22")
    show_trajectory(catalog, steps["episode_id"][0])

The morning report draws its per-night plots from the same functions, so a notebook and
the report never disagree on what a night's yield or success rate is.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import polars as pl
from PIL import Image, ImageDraw

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import CATALOG_FILE, NIGHTLY_TAG, Catalog
from trajforge.schemas.config import load_settings
from trajforge.schemas.records import RECORDS, ChatSample, TrainingStep

TRAINING_TABLES = tuple(sorted(name for name, model in RECORDS.items() if issubclass(model, (ChatSample, TrainingStep))))
"""The tables a fine-tuning job reads: the end-to-end steps and every chat-sample table."""


DEFAULT_WAREHOUSE = Path("data/warehouse")


def find_project(start: Path | None = None) -> tuple[Path, Path | None]:
    """The project folder and its config: $TRAJFORGE_CONFIG's; else, from `start` (the working folder) up, as git
    finds .git, the first folder with a trajforge.yaml or with a warehouse at the default path (a night run on
    the embedded defaults has no config file). Jupyter starts a kernel in the notebook's own folder
    (`notebooks/`), below the project's. Neither found: `start` itself, with no config."""
    if env := os.environ.get("TRAJFORGE_CONFIG"):
        return Path(env).resolve().parent, Path(env)
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "trajforge.yaml").is_file():
            return folder, folder / "trajforge.yaml"
        if (folder / DEFAULT_WAREHOUSE / CATALOG_FILE).is_file():
            return folder, None
    return here, None


def open_catalog(config: Path | str | None = None) -> Catalog:
    """The catalog of the project (`find_project`; trajforge.yaml and TRAJFORGE_* apply). Its warehouse path, as
    the CLI takes it: one the config file gives is relative to the file's folder (`load_settings`); the default,
    or one a variable gives, relative to the project's folder, where the CLI runs (not the kernel's `notebooks/`).
    Opening only reads: where the warehouse does not exist it is an error naming the path, not a new empty
    warehouse (whose "0 tables" would fail cells further down)."""
    root, path = (Path(config).resolve().parent, Path(config)) if config else find_project()
    wh = load_settings(path.resolve() if path is not None else None).warehouse  # the file's paths made absolute
    wh = wh.model_copy(update={"path": root / wh.path.expanduser()})  # an absolute path stays as it is
    if wh.catalog_url is None and not (wh.path / CATALOG_FILE).is_file():
        where = f"warehouse.path of {path}" if path is not None else (
            f"the default warehouse.path: no trajforge.yaml nor warehouse in {Path.cwd()} or a folder above it")
        raise FileNotFoundError(
            f"no warehouse at {wh.path} ({where}); run `trajforge run nightly` in the project, or point the "
            "notebook at its config: open_catalog('path/to/trajforge.yaml') or TRAJFORGE_CONFIG")
    return Catalog.from_settings(wh)


def blob_store(catalog: Catalog) -> BlobStore:
    """The screenshot store of the catalog's warehouse (where the stages put it)."""
    return BlobStore(catalog.warehouse / "blobs")


def versions(catalog: Catalog) -> pl.DataFrame:
    """Every version of every table, oldest first per table: what a notebook lists before choosing one. `tags` is
    a list: a version may carry a user's tag beside its night's (`nightly-...`), and either is a ref by itself."""
    rows = [
        {"table": table, "snapshot_id": i.snapshot_id, "committed_at": i.committed_at, "stage": i.stage,
         "run_id": i.run_id, "added_rows": i.added_rows, "removed_rows": i.removed_rows, "total_rows": i.total_rows,
         "tags": i.tags}
        for table in catalog.tables() for i in catalog.history(table)
    ]
    return pl.DataFrame(rows, schema={
        "table": pl.String, "snapshot_id": pl.Int64, "committed_at": pl.Datetime("us", "UTC"), "stage": pl.String,
        "run_id": pl.String, "added_rows": pl.Int64, "removed_rows": pl.Int64, "total_rows": pl.Int64,
        "tags": pl.List(pl.String)})


def night_labels(catalog: Catalog, table: str) -> dict[str, str]:
    """run id -> the run's nightly tag on `table`, or the run id when it has none (a second night of one day
    moves the day's tag to itself, and a single-stage run is never tagged). Ordered by first commit."""
    labels: dict[str, str] = {}
    for info in catalog.history(table):
        if info.run_id is None:
            continue
        labels.setdefault(info.run_id, info.run_id)
        labels[info.run_id] = next((t for t in info.tags if NIGHTLY_TAG.fullmatch(t)), labels[info.run_id])
    return labels


def success_per_app(catalog: Catalog) -> pl.DataFrame:
    """Judged attempts and successes per night and app (from query_history), nights in the order they ran."""
    schema = {"night": pl.String, "app": pl.String, "attempts": pl.UInt32, "successes": pl.UInt32, "rate": pl.Float64}
    if "query_history" not in catalog.tables():
        return pl.DataFrame(schema=schema)
    labels = night_labels(catalog, "query_history")
    order = {run_id: i for i, run_id in enumerate(labels)}
    history = catalog.load("query_history")
    grouped = history.group_by("run_id", "app").agg(
        pl.len().alias("attempts"), pl.col("success").sum().cast(pl.UInt32).alias("successes"))
    return (grouped.with_columns(
        pl.col("run_id").replace_strict(labels, default=pl.col("run_id")).alias("night"),
        pl.col("run_id").replace_strict(order, default=len(order), return_dtype=pl.Int64).alias("_order"),
        (pl.col("successes") / pl.col("attempts")).alias("rate"))
        .sort("_order", "app").select(list(schema)).cast(schema))


def yield_per_night(catalog: Catalog, tables: Iterable[str] = TRAINING_TABLES) -> pl.DataFrame:
    """Rows each training table got per night, from the lineage of its commits (nights in the order they ran)."""
    rows = []
    for table in sorted(set(tables) & set(catalog.tables())):
        labels = night_labels(catalog, table)
        for info in catalog.history(table):
            if info.lineage is not None:
                rows.append({"night": labels[info.lineage.run_id], "table": table, "committed_at": info.committed_at,
                             "rows": info.lineage.kept.get(table, 0)})
    frame = pl.DataFrame(rows, schema={"night": pl.String, "table": pl.String,
                                       "committed_at": pl.Datetime("us", "UTC"), "rows": pl.Int64})
    return (frame.group_by("night", "table").agg(pl.col("committed_at").min(), pl.col("rows").sum())
            .sort("committed_at", "table").drop("committed_at"))


def trajectory(catalog: Catalog, episode_id: str, version: int | str | None = None) -> pl.DataFrame:
    """One episode's steps in order, with each step's critic labels ('critic: LABEL', comma separated).

    `version` is a steps snapshot id or tag (None: latest); the labels are each critic's latest (a step judged
    again by the same critic shows its last label, not both).
    """
    steps = catalog.scan("steps", version).filter(pl.col("episode_id") == episode_id).sort("step_index").collect()
    critiques = catalog.newest("step_critiques", ["step_id", "critic"], where=pl.col("episode_id") == episode_id)
    labels = critiques.group_by("step_id").agg(
        pl.format("{}: {}", "critic", pl.col("label").fill_null("unparsed")).sort().str.join(", ").alias("labels"))
    return steps.join(labels, on="step_id", how="left")


def screenshot(catalog: Catalog, step: str | Mapping[str, Any], which: Literal["before", "after"] = "before"
               ) -> Image.Image:
    """The screenshot before (or after) a step, from the blob store; `step` is a step id or a steps row."""
    if isinstance(step, str):
        rows = catalog.scan("steps").filter(pl.col("step_id") == step).collect()
        if rows.height == 0:
            raise LookupError(f"no step {step!r} in steps@latest")
        step = rows.row(0, named=True)
    return Image.open(io.BytesIO(blob_store(catalog).get(step[f"screenshot_{which}"])))


def show_trajectory(catalog: Catalog, episode_id: str, version: int | str | None = None, width: int = 480) -> None:
    """Display an episode inline: its instruction, then per step the screenshot before the action (a click's
    point circled in red), the action, the thought and the critic labels (screens shrunk to `width` pixels so
    that a notebook stays small)."""
    from IPython.display import Markdown, display  # only notebooks need IPython

    episode = catalog.scan("episodes").filter(pl.col("episode_id") == episode_id).collect()
    if episode.height:
        e = episode.row(0, named=True)
        display(Markdown(f"**{e['app']}**: {e['instruction']} ({e['policy']}, {e['status']}, {e['num_steps']} steps)"))
    for step in trajectory(catalog, episode_id, version).iter_rows(named=True):
        display(Markdown(f"**step {step['step_index']}**: `{step['action_type']} {step['action_json']}` "
                         f"({step['labels'] or 'not judged'})\n\n> {step['thought']}"))
        image = screenshot(catalog, step).convert("RGB")
        action = json.loads(step["action_json"])
        if isinstance(action.get("x"), int | float) and isinstance(action.get("y"), int | float):
            x, y, r = action["x"], action["y"], max(10, image.width // 30)  # where the agent acted
            ImageDraw.Draw(image).ellipse((x - r, y - r, x + r, y + r), outline="red", width=3)
        image.thumbnail((width, width * 4))
        display(image)

"""The `verl` export: one version of `queries` as verl's RL prompt set, rewarded by the queries' own checkers.

verl (volcengine/verl) trains a policy by RL from a Parquet of prompts whose columns it names: `data_source`,
`prompt` (chat messages with string content; `<image>` in the text stands where the next image of `images`
goes), `ability`, `reward_model` (`{style: rule, ground_truth}`, handed to the reward function) and
`extra_info` (handed to it too), plus `images` (`[{bytes}]`) for a vision model. Our tasks are the rows of
`queries`, and a task's reward is its programmatic checker on the app's final state, so the ground truth is what
the checker needs (app, checker name, params) and `reward.py` (a copy of `synth/verl_reward.py`) runs it. A user's
app (an app directory) is known only to a process it was registered in, and the training workers are not a night's:
its checks (spec.yaml, and checkers.py where there is one) are copied to `apps/APP/` beside `reward.py`, which
registers them. They are predicates on the final state, so the app itself need not be there.

The prompt is the policy's own first step (the gui_owl_e2e template: the action space as a function in the
system message, the task and the start screen in the user message), so RL starts from what rollouts ask. The
start screen is the first screenshot of the query's reference episode (stage `reference`), in the user's
`rollout.viewport` when it was recorded there; a browser app's query without one (MiniWoB++) gets no image and
that viewport's size and action space. A device's query without one (Android) is left out, counted on the card:
the device has a screen size of its own, which a browser viewport's would misstate, and it checks actions in its
own pixels.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Catalog
from trajforge.envs import actions
from trajforge.envs.appdir import CHECKERS_FILE, SPEC_FILE
from trajforge.envs.apps import UnknownAppError
from trajforge.envs.browser import VIEWPORTS
from trajforge.envs.kinds import AppDirKind, kind_for
from trajforge.llm import ImagePart, TextPart, load_prompt
from trajforge.rollout.gui_owl import FUNCTIONS, PROMPT, tool_spec
from trajforge.synth.handoff import (
    IMAGE_TAG,
    SFT_FORMATS,
    SFT_TABLES,
    ExportError,
    ExportResult,
    resolve_version,
    staged,
    write_card,
)

DATA_SOURCE = "trajforge"
ABILITY = "gui_agent"
REWARD_MODULE = Path(__file__).with_name("verl_reward.py")
APPS_FOLDER = "apps"
"""The folder beside reward.py holding the app directories' checks (`verl_reward.APPS` reads it)."""

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("query_id", pa.string()), ("app", pa.string()), ("split", pa.string()),
                              ("index", pa.int64())])),
    ("images", pa.list_(pa.struct([("bytes", pa.binary())]))),
])

def command_note(rows: int) -> str:
    """The card's verl settings for a version of `rows` queries. verl drops a last incomplete batch and stops on
    an empty train or validation loader: its default batch of 1024 is more than a night's queries, and without
    `data.val_files` it looks for its own example's file. Stock verl only generates text and passes the row's
    extra_info as stored, so the settings alone do not train: the note says what the user must add."""
    batch = min(rows, 16)
    return ("verl needs an agent loop or reward manager of yours that runs each episode in the app and puts the "
            "app's final state in `extra_info['final_state']` (stock verl does neither, and `compute_score` raises "
            "without it); with it: `data.train_files=train.parquet data.val_files=train.parquet "
            f"data.train_batch_size={batch} "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch} data.image_key=images "
            "reward.custom_reward_function.path=reward.py reward.custom_reward_function.name=compute_score` "
            "(verl 0.9); raise `data.max_prompt_length` above its 512 tokens: the policy's prompt with a screenshot "
            "is longer.")


CARD_NOTES = (
    ("The reward is the query's own checker (ground_truth: JSON {app, checker, params}) on the app's final state, "
     "which the rollout driving the app must put in `extra_info['final_state']` (a dict or JSON string); the "
     "model's text is never read as a state. A state that is unusable, or that the checker fails on, scores 0.0, "
     "logged; a row without `final_state` raises."),
    "reward.py imports `trajforge` (the checkers are its code): install it on the training workers. It registers "
    "the checks of your own apps from `apps/` beside it (keep the two together); a query whose app it cannot find "
    "raises, rather than scoring every rollout 0.",
)


def export_verl(catalog: Catalog, ref: str, out: Path, *, viewport: str) -> ExportResult:
    """Write `train.parquet`, `reward.py` and the card into `out` (new or empty), all or nothing; the prompts are
    in `viewport` (`rollout.viewport`), the one the user's rollouts run in."""
    table, _, version = ref.partition("@")
    if table != "queries":
        applies = ", ".join(SFT_FORMATS) if table in SFT_TABLES else "none"
        raise ExportError(f"{ref}: the verl export takes a version of queries, whose rows are tasks with a checker "
                          f"to reward; formats for {table!r}: {applies}")
    if not version:
        raise ExportError(f"{ref}: name the version of queries to export: queries@TAG or queries@SNAPSHOT")
    _, snapshot = resolve_version(catalog, ref)
    out = Path(out)
    with staged(out) as tmp:  # refuses a non-empty `out` before any work
        queries = catalog.load(table, snapshot).sort("query_id")
        if queries.is_empty():  # verl stops on an empty dataloader
            raise ExportError(f"{ref}: no rows to export")
        app_dirs = _app_dirs(ref, queries)  # first: an app no reward could check fails the export, not training
        starts, read = _start_screens(catalog, queries["query_id"].to_list(), viewport)
        sized = [q in starts or kind_for(a).in_browser for q, a in zip(queries["query_id"], queries["app"])]
        left_out = [f"{n} queries of {app} (a device: its screen size is known only from a reference episode, and "
                    "they have none)" for app, n in Counter(queries.filter(~pl.Series(sized))["app"]).items()]
        queries = queries.filter(pl.Series(sized))
        if queries.is_empty():
            raise ExportError(f"{ref}: no rows to export; left out: {'; '.join(left_out)}")
        blobs = BlobStore(catalog.warehouse / "blobs")
        rows = [_row(q, i, starts.get(q["query_id"]), viewport, blobs) for i, q in enumerate(queries.to_dicts())]
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp / "train.parquet")
        shutil.copyfile(REWARD_MODULE, tmp / "reward.py")
        for app, folder in app_dirs.items():
            checks = tmp / APPS_FOLDER / app
            checks.mkdir(parents=True)
            for name in (SPEC_FILE, CHECKERS_FILE):
                if (folder / name).is_file():
                    shutil.copyfile(folder / name, checks / name)
        screens = f"Start screens: {sum(1 for r in rows if r['images'])} of {len(rows)} rows, the first screenshot " \
                  f"of the query's reference episode ({', '.join(f'{t}@{n}' for t, n in read.items()) or 'none'})."
        card = write_card(tmp, catalog, table, snapshot, rows=queries, fmt="verl",
                          extra=(command_note(len(rows)), *CARD_NOTES, screens, *(f"Left out: {n}." for n in left_out)))
    return ExportResult(out=out, table=table, snapshot=snapshot, rows=len(rows),
                        images=sum(len(r["images"]) for r in rows), card=out / card.name)


def _app_dirs(ref: str, queries: pl.DataFrame) -> dict[str, Path]:
    """App name -> app directory, for the queries' apps that are a user's (the others' checkers are trajforge's
    own). An app directory is known only where it was registered: the export's config (`query_gen.app_dirs`) must
    name it, or the export's own `--app-dir`: a night's set it for that night's process alone."""
    dirs: dict[str, Path] = {}
    for app in sorted(set(queries["app"])):
        try:
            kind = kind_for(app)
        except UnknownAppError as exc:
            raise ExportError(f"{ref}: its queries of app {app!r} cannot be rewarded: {exc}. For your own app, give "
                              "its directory with --app-dir DIR, as the night's own, or in query_gen.app_dirs") \
                from None
        if isinstance(kind, AppDirKind):
            dirs[app] = kind.app_dir.path
    return dirs


def _start_screens(catalog: Catalog, query_ids: list[str], viewport: str
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """query_id -> the first step (screenshot_before, width, height) and viewport of its newest reference
    episode, preferring `viewport` (queries never replayed are absent); and the versions
    read, for the card. Reference episodes accumulate, so the latest versions hold every recording."""
    _, episodes_snapshot = catalog.resolve("episodes@latest")
    _, steps_snapshot = catalog.resolve("steps@latest")
    if episodes_snapshot is None or steps_snapshot is None:
        return {}, {}
    read = {"episodes": episodes_snapshot, "steps": steps_snapshot}
    episodes = catalog.scan("episodes", episodes_snapshot)
    if "source" not in episodes.collect_schema().names():
        return {}, read
    firsts = (
        episodes.filter((pl.col("source") == "reference") & pl.col("query_id").is_in(query_ids))
        .select("episode_id", "query_id", "viewport", "finished_at")
        .join(catalog.scan("steps", steps_snapshot).filter(pl.col("step_index") == 0)
              .select("episode_id", "screenshot_before", "width", "height"), on="episode_id")
        .sort([pl.col("viewport") == viewport, "finished_at"])
        .collect()
    )
    return {row["query_id"]: row for row in firsts.to_dicts()}, read  # each query's last (preferred) row wins


def _row(query: dict[str, Any], index: int, start: dict[str, Any] | None, viewport: str,
         blobs: BlobStore) -> dict[str, Any]:
    """One verl row: the policy's first-step prompt (in the start screen's viewport and size, else `viewport`'s)
    and the checker's inputs as ground truth."""
    viewport = start["viewport"] if start else viewport
    size = {"width": start["width"], "height": start["height"]} if start else VIEWPORTS[viewport]["viewport"]
    space = actions.space_for(viewport)
    rendered = load_prompt(PROMPT).render(
        platform=space, width=size["width"], height=size["height"], tools=tool_spec(space), function=FUNCTIONS[space],
        task=query["instruction"], guidance=None, history=[],
        screenshots=[ImagePart(sha256=start["screenshot_before"])] if start else [])
    prompt = [{"role": m.role, "content": "".join(IMAGE_TAG if isinstance(p, ImagePart) else p.text
                                                  for p in m.content if isinstance(p, ImagePart | TextPart))}
              for m in rendered.messages]
    if sum(m["content"].count(IMAGE_TAG) for m in prompt) != (1 if start else 0):
        raise ExportError(f"query {query['query_id']!r}: its text holds {IMAGE_TAG!r}, which verl reads as an image")
    truth = {"app": query["app"], "checker": query["checker"], "params": json.loads(query["checker_params_json"])}
    return {
        "data_source": DATA_SOURCE, "prompt": prompt, "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": json.dumps(truth, sort_keys=True)},
        "extra_info": {"query_id": query["query_id"], "app": query["app"], "split": "train", "index": index},
        "images": [{"bytes": blobs.get(start["screenshot_before"])}] if start else [],
    }

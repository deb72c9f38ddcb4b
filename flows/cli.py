"""The `trajforge` command line: run the pipeline or one stage, inspect dataset versions, serve.

Every command validates the configuration (and app specs) before it starts work. Problems
go to stderr as one clear line, never a traceback (whose locals and messages could show a
database password): exit status 2 for a usage error (bad arguments, an unknown stage,
table or format, a bad config), 1 for a failure at run time (a stage that crashes, an
unreachable catalog).

Each command imports what it needs when it runs: the catalog, the stages and the models' clients
take about 3.5 s to import on 2 cores, which `--help`, `--version` and `config show` need none of.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import reprlib
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args, get_origin

import click
import typer
from pydantic import BaseModel, SecretStr
from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperCommand

import trajforge.flows  # noqa: F401  (sets Prefect's environment defaults before Prefect is imported)
from trajforge.flows import prefect_server
from trajforge.schemas.config import (
    ENV_PREFIX,
    SECRET_PREFIX,
    ConfigError,
    Settings,
    config_path,
    has_path,
    load_settings,
    read_yaml,
    redact,
)

if TYPE_CHECKING:
    import polars as pl

    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.stage import StageDef

EXPORT_FORMATS = ("ms-swift", "llamafactory", "hf", "verl")  # for --help; synth.handoff.FORMATS decides

class _App(typer.Typer):
    """The root command: an exception no command handled is a failure at run time, printed as one line."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the one place failures reach the user
            lines = str(exc).strip().splitlines()
            _error(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)
            sys.exit(1)


app = _App(help="trajforge: a self-evolving trajectory data factory for GUI agents.", no_args_is_help=True,
           pretty_exceptions_show_locals=False)
datasets = typer.Typer(help="Inspect and tag dataset versions.", no_args_is_help=True)
app.add_typer(datasets, name="datasets")
evaluate = typer.Typer(help="Measure the pipeline's judges against ground truth.", no_args_is_help=True)
app.add_typer(evaluate, name="eval")
config_app = typer.Typer(help="Inspect the configuration.", no_args_is_help=True)
apps_app = typer.Typer(help="Your own web app: draft an app directory from the live app, and check one against it.",
                       no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(apps_app, name="apps")
# Snapshot ids are copied from this output into --input: never truncate them, even when
# the output is not a terminal (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="Config file (default: $TRAJFORGE_CONFIG or ./trajforge.yaml).")
]


def _use_app_dirs(app_dirs: list[Path], deep_searched: list[str]) -> None:
    """Make the apps of `app_dirs` the configured ones (query_gen.apps, app_dirs, deep_search_apps), before the
    command reads its settings, and no other: the config's MiniWoB++ and Android tasks too made queries of a night
    on "your own app only". As variables in the environment: a run's flows and every worker process read the
    config again, and see them."""
    os.environ[f"{ENV_PREFIX}QUERY_GEN__APP_DIRS"] = json.dumps([str(p.resolve()) for p in app_dirs])
    for others in ("APPS", "MINIWOB_TASKS", "ANDROID_TASKS"):
        os.environ[f"{ENV_PREFIX}QUERY_GEN__{others}"] = "[]"
    os.environ[f"{ENV_PREFIX}QUERY_GEN__DEEP_SEARCH_APPS"] = json.dumps(deep_searched)


def _add_app_dirs(config: Path | None, app_dirs: list[Path]) -> None:
    """Add `app_dirs` to the configured ones (query_gen.app_dirs) for a command that reads what a night wrote
    (`eval critics`, `export`): its episodes may be of every app the config names and of a night's --app-dir."""
    try:
        configured = load_settings(config).query_gen.app_dirs
    except ConfigError:
        configured = []  # the command's own reading of the config reports it
    both = dict.fromkeys(str(Path(p).resolve()) for p in [*configured, *app_dirs])  # once each, in order
    os.environ[f"{ENV_PREFIX}QUERY_GEN__APP_DIRS"] = json.dumps(list(both))


def _error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(redact(message))}", highlight=False, soft_wrap=True)


def _fail(message: str) -> typer.Exit:
    """A usage error: the command cannot do what it was asked (exit status 2)."""
    _error(message)
    return typer.Exit(code=2)


def _crash(message: str) -> typer.Exit:
    """A failure at run time: what was asked is fine, but it could not be done (exit status 1)."""
    _error(message)
    return typer.Exit(code=1)


def _shown_url(url: str) -> str:
    """A database URL with its password masked."""
    import sqlalchemy as sa

    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return redact(url)


def _open(config: Path | None, models: bool = False) -> tuple[Settings, Workspace]:
    """The settings and workspace of a command that runs nights (`run`, `deploy`, `serve`); `models` also checks
    the models a run asks (preflight). Opening creates the warehouse where there is none (a run's first commit
    needs it)."""
    settings = _settings(config, models)
    return settings, _workspace(settings)


def _open_existing(config: Path | None) -> tuple[Settings, Workspace]:
    """The settings and workspace of a command that reads (or tags, expires) what nights wrote. Where no night
    made the warehouse it is a usage error naming the folder, and nothing is created: an empty warehouse in the
    current folder would be the one `open_catalog()` in a notebook below it finds, before the project's."""
    settings = _settings(config)
    if (missing := _no_warehouse(settings)) is not None:
        raise _fail(f"no warehouse at {missing} (warehouse.path): no night has run with this config; run "
                    "`trajforge run nightly`, or give the project's config with --config or TRAJFORGE_CONFIG")
    return settings, _workspace(settings)


def _settings(config: Path | None, models: bool = False) -> Settings:
    """The checked settings of a command (preflight), exiting with a usage error where they are wrong."""
    from trajforge.envs.apps import UnknownAppError
    from trajforge.envs.miniwob import MiniWoBError
    from trajforge.envs.spec import SpecError
    from trajforge.flows.preflight import preflight

    try:
        return preflight(str(config) if config else None, models=models)
    except (ConfigError, SpecError, MiniWoBError, UnknownAppError) as exc:
        raise _fail(str(exc)) from None


def _no_warehouse(settings: Settings) -> Path | None:
    """The local warehouse's folder where it has no catalog yet (no night ran); None where it has one, or the
    catalog is a database elsewhere. A command that only reads says so rather than create an empty one."""
    from trajforge.data.catalog import CATALOG_FILE

    wh = settings.warehouse
    path = wh.path.resolve()
    return path if wh.catalog_url is None and not (path / CATALOG_FILE).is_file() else None


def _workspace(settings: Settings) -> Workspace:
    """The workspace of checked settings; an unreachable catalog database is a failure at run time."""
    import sqlalchemy as sa

    from trajforge.llm.workspace import Workspace

    try:
        return Workspace.open(settings)
    except sa.exc.ArgumentError as exc:
        raise _fail(f"warehouse.catalog_url: {exc}") from None
    except sa.exc.OperationalError as exc:
        url = settings.warehouse.catalog_url
        where = _shown_url(url.get_secret_value()) if url else str(settings.warehouse.path)
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise _crash(f"the catalog database is unreachable ({where}): {reason}") from None


@contextmanager
def _usage_errors(*more: type[Exception]) -> Iterator[None]:
    """A catalog error raised inside (an unknown table, version or tag), or one of `more`, is a usage error."""
    from trajforge.data.catalog import CatalogError

    try:
        yield
    except (CatalogError, *more) as exc:
        raise _fail(str(exc)) from None


@functools.cache
def _stages() -> dict[str, StageDef[Workspace, Any]]:
    """The night's stages by name. Loading them imports every stage's module, so only the commands that name
    a stage ask for them, not every command's start."""
    from trajforge.flows.stages import stages

    return stages()


def _no_version(table: str) -> str:
    """The error for a table with no version yet, naming the commands that would write its first."""
    writers = [f"`trajforge run {name}`" for name, stage in _stages().items() if table in stage.writes]
    return f"table {table!r} has no version yet; {' or '.join(writers) or '`trajforge run nightly`'} writes it"


class _RunCommand(TyperCommand):
    """`run`, whose help lists the stages: loaded when the help is shown."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for param in self.params:
            if param.name == "stage":
                param.help = f"nightly, or one stage: {', '.join(_stages())}"  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"trajforge {version('trajforge')}")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version, help="Print the version and exit.")] = False,
) -> None:
    """The options every command shares (--version)."""


def _watch(ws: Workspace, run_id: str, stop: threading.Event) -> None:
    """Show shard progress per stage, read from the ledger (so it works for any worker)."""
    with Progress(
        TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        bars: dict[str, int] = {}
        finished = False
        while not finished:
            finished = stop.wait(0.3)  # after the stop, one last refresh shows the final counts
            for stage, (done, total) in ws.ledger.progress(run_id).items():
                if stage not in bars:
                    bars[stage] = progress.add_task(stage, total=total)
                progress.update(bars[stage], completed=done, total=total)


def _summary(ws: Workspace, snapshots: dict[str, int], tag: str | None, run_id: str) -> None:
    """The version of each table the run made, with the rows all its versions of the table added (the report's
    last section)."""
    from trajforge.synth.report import rows_added

    table = Table(title="trajforge run", show_lines=False)
    for col in ("table", "rows added", "rows total", "snapshot", "tag"):
        table.add_column(col, justify="right" if col.startswith("rows") else "left", no_wrap=True)
    for name, snapshot in snapshots.items():
        info = ws.catalog.info(name, snapshot)
        mine = [i for i in ws.catalog.history(name) if i.run_id == run_id]
        table.add_row(name, str(rows_added(mine)), str(info.total_rows), str(snapshot), tag or "")
    console.print(table)
    console.print(f"warehouse: {ws.settings.warehouse.path.resolve()}")


@app.command(cls=_RunCommand)
def run(
    stage: Annotated[str, typer.Argument(help="nightly, or one stage (listed by `trajforge run --help`)")],
    input: Annotated[
        str | None, typer.Option("--input", "-i", help="TABLE@VERSION the stage reads (default: TABLE@latest).")
    ] = None,
    config: ConfigOpt = None,
    fresh: Annotated[bool, typer.Option(help="Start a new run and set aside every unfinished run of this command "
                                             "for good, the one it would resume included.")] = False,
    app_dir: Annotated[list[Path] | None, typer.Option(
        "--app-dir", help="Your own app's directory (repeatable): the run makes queries for these apps only, "
        "instead of the configured ones.")] = None,
    deep_search: Annotated[bool, typer.Option(
        "--deep-search", help="With --app-dir: also search those apps' menus, tabs and dialogs on the live app for "
        "deep-search queries (query_gen.deep_search_apps).")] = False,
) -> None:
    """Run the nightly pipeline, or rerun a single stage on a chosen input version."""
    from trajforge.envs.appdir import load_app_dir
    from trajforge.envs.spec import SpecError
    from trajforge.flows.pipeline import STAGE_FLOWS, nightly, passed_over, run_identity
    from trajforge.tasks.prefect_tasks import run_workspace

    if stage != "nightly" and stage not in _stages():
        raise _fail(f"unknown stage {stage!r}; choose nightly or one of: {', '.join(_stages())}")
    if stage == "nightly" and input:
        raise _fail("--input applies to a single stage, not to nightly")
    if deep_search and not app_dir:
        raise _fail("--deep-search applies to the apps of --app-dir; for configured apps, "
                    "use query_gen.deep_search_apps")
    if app_dir:
        try:
            searched = [load_app_dir(p).name for p in app_dir] if deep_search else []
        except SpecError as exc:
            raise _fail(str(exc)) from None
        _use_app_dirs(app_dir, searched)
    settings, ws = _open(config, models=True)
    try:  # the server started as the command did (flows.prefect_server), once the checks above passed
        prefect_server.wait_ready()
    except prefect_server.ServerError as exc:
        raise _crash(str(exc)) from None
    cfg = str(config) if config else None
    input_snapshot: int | None = None
    with ws.ledger.writing(stage):  # one run writes to a warehouse at a time: a second stops here, naming it
        if stage == "nightly":
            run_ = ws.ledger.open_run("nightly", run_identity("nightly", settings), fresh=fresh)
            call = nightly(config=cfg, run_id=run_.run_id)
        else:
            reads = _stages()[stage].reads
            if input and reads is None:
                raise _fail(f"stage {stage!r} reads no table; it takes no --input")
            if reads is not None:
                with _usage_errors():
                    table, input_snapshot = ws.catalog.resolve(input or f"{reads}@latest")
                if table != reads:
                    raise _fail(f"stage {stage!r} reads {reads!r}, not {table!r}")
                if input_snapshot is None:
                    raise _fail(_no_version(reads))
            identity = run_identity(stage, settings, str(input_snapshot))
            run_ = ws.ledger.open_run(stage, identity, fresh=fresh)
            call = STAGE_FLOWS[stage](input_snapshot=input_snapshot, run_id=run_.run_id, config=cfg)
        console.print(f"{'resuming' if run_.resumed else 'starting'} run [bold]{run_.run_id}[/]")
        if note := passed_over(run_):
            err_console.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False, soft_wrap=True)
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(ws, run_.run_id, stop), daemon=True)
        watcher.start()
        try:
            with run_workspace(run_.run_id, ws):  # the flows use this workspace: the config is loaded once
                result = asyncio.run(call)
        finally:
            stop.set()
            watcher.join()
        if stage == "nightly":
            _summary(ws, result["snapshots"], result["tag"], run_.run_id)
        else:
            ws.ledger.finish_run(run_.run_id, {"snapshots": result})
            _summary(ws, result, None, run_.run_id)


@datasets.command("list")
def datasets_list(config: ConfigOpt = None) -> None:
    """Every table with its latest version."""
    settings = _settings(config)
    if (missing := _no_warehouse(settings)) is not None:
        console.print(f"no tables yet in {missing}", highlight=False, soft_wrap=True)
        return
    ws = _workspace(settings)
    names = ws.catalog.tables()
    if not names:
        url = settings.warehouse.catalog_url
        where = _shown_url(url.get_secret_value()) if url else ws.catalog.warehouse
        console.print(f"no tables yet in {where}", highlight=False, soft_wrap=True)
        return
    table = Table()
    for col in ("table", "versions", "latest snapshot", "rows", "committed at", "stage", "tags"):
        table.add_column(col)
    for name in names:
        history = ws.catalog.history(name)
        if not history:
            table.add_row(name, "0", "-", "0", "-", "-", "")
            continue
        last = history[-1]
        tags = sorted({t for i in history for t in i.tags})
        table.add_row(
            name, str(len(history)), str(last.snapshot_id), str(last.total_rows),
            f"{last.committed_at:%Y-%m-%d %H:%M:%S}", last.stage or "-", ", ".join(tags[-3:]),
        )
    console.print(table)


@datasets.command("history")
def datasets_history(table: str, config: ConfigOpt = None) -> None:
    """Every version of a table, oldest first, with its stage, run and counts."""
    _, ws = _open_existing(config)
    with _usage_errors():
        history = ws.catalog.history(table)
    if not history:
        raise _fail(_no_version(table))
    out = Table(title=f"{table}: {len(history)} version(s)")
    for col in ("snapshot", "committed at", "operation", "stage", "run", "added", "removed", "total", "inputs",
                "tags"):
        out.add_column(col)
    for i in history:
        inputs = ", ".join(f"{t}@{s}" for t, s in (i.lineage.inputs.items() if i.lineage else []))
        out.add_row(
            str(i.snapshot_id), f"{i.committed_at:%Y-%m-%d %H:%M:%S}", i.operation, i.stage or "-",
            i.run_id or "-", str(i.added_rows), str(i.removed_rows), str(i.total_rows), inputs, ", ".join(i.tags),
        )
    console.print(out)


@datasets.command("show")
def datasets_show(
    ref: Annotated[str, typer.Argument(help="TABLE, TABLE@latest, TABLE@SNAPSHOT_ID or TABLE@TAG")],
    limit: Annotated[int, typer.Option(help="Rows to print.", min=0)] = 10,
    columns: Annotated[str | None, typer.Option(help="Comma-separated columns to print.")] = None,
    config: ConfigOpt = None,
) -> None:
    """A version's lineage and its first rows: as a table where they fit the terminal, else one line per column
    (polars' glimpse), since most tables have more columns than a terminal is wide."""
    import polars as pl

    _, ws = _open_existing(config)
    with _usage_errors():
        table, snapshot = ws.catalog.resolve(ref)
        if snapshot is None:
            raise _fail(_no_version(table))
        names = [n for c in (columns or "").split(",") if (n := c.strip())] or None  # none named: every column
        # Only what is shown is read: a version of a million steps with their trees would not fit in memory.
        head = ws.catalog.load(table, snapshot, columns=names, limit=limit)
        version = ws.catalog.info(table, snapshot)
    console.print(f"[bold]{table}@{snapshot}[/]: {version.total_rows} rows, {head.width} columns")
    if version.lineage is not None:  # None: not written by a stage
        console.print_json(version.lineage.model_dump_json())
    if head.is_empty():  # an empty version, or --limit 0: the columns alone
        console.print(("columns: " if version.total_rows else "no rows; columns: ")
                      + ", ".join(f"{n} ({t})" for n, t in head.schema.items()), markup=False, highlight=False)
        return
    with pl.Config(tbl_rows=limit, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=10_000):
        shown = str(head)
    if max(map(len, shown.splitlines())) > console.width:
        shown = _by_column(head, console.width)
    console.print(shown, markup=False, highlight=False, soft_wrap=True)  # values hold brackets: no markup


class _Short(reprlib.Repr):
    """A value cut to fit a line: a long string shortened in its middle, an image's bytes shown by their size,
    a time as ISO 8601."""

    def __init__(self) -> None:
        super().__init__()  # keyword arguments only from Python 3.12
        self.maxstring, self.maxother, self.maxlist = 60, 60, 4

    def repr_bytes(self, value: bytes, level: int) -> str:
        return f"<{len(value):,} bytes>"

    def repr_datetime(self, value: datetime, level: int) -> str:
        return value.isoformat(" ", "seconds")


def _by_column(frame: pl.DataFrame, width: int) -> str:
    """A frame too wide for the terminal, one line per column: its name, type and values, each value and each
    line cut to fit (an accessibility tree or a list of screenshots is long)."""
    short = _Short()
    name_width = max(map(len, frame.columns))
    type_width = max(len(str(t)) for t in frame.schema.values())
    lines = []
    for name, dtype in frame.schema.items():
        line = f"{name:<{name_width}}  {dtype!s:<{type_width}}  " + ", ".join(map(short.repr, frame[name].to_list()))
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    return "\n".join(lines)


@datasets.command("diff")
def datasets_diff(table: str, a: str, b: str, config: ConfigOpt = None) -> None:
    """Rows added, removed and changed between versions A and B (ids, tags or 'latest')."""
    if "@" in table:
        raise _fail(f"give the table as TABLE, not TABLE@VERSION: {table!r}; the versions to compare are A and B")
    _, ws = _open_existing(config)
    with _usage_errors():
        diff = ws.catalog.diff(table, a, b)
    if diff.a is None and diff.b is None:  # both 'latest' of a table no stage has written yet
        raise _fail(_no_version(table))
    console.print(str(diff))
    key = diff.key
    for label, frame in (("added", diff.added), ("removed", diff.removed)):
        if frame.height:
            console.print(f"{label}: " + ", ".join(map(str, frame[key].head(10).to_list())) + (" ..." if frame.height > 10 else ""))
    if diff.changed:
        console.print("changed: " + ", ".join(map(str, diff.changed[:10])))


@datasets.command("tag")
def datasets_tag(
    ref: Annotated[str, typer.Argument(help="TABLE@VERSION to tag")],
    name: Annotated[str, typer.Argument(help="Tag name; an existing tag of that name is moved")],
    config: ConfigOpt = None,
) -> None:
    """Name a version so notebooks and training jobs can ask for it by name."""
    _, ws = _open_existing(config)
    with _usage_errors():
        table, snapshot = ws.catalog.resolve(ref)
        if snapshot is None:
            raise _fail(f"{ref}: the table has no version to tag")
        ws.catalog.tag(table, snapshot, name)
    console.print(f"tagged {table}@{snapshot} as {name}")


@datasets.command("expire")
def datasets_expire(
    older_than: Annotated[float, typer.Option("--older-than", min=0, help="Expire versions older than DAYS.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; change nothing.")] = False,
    checkpoints: Annotated[bool, typer.Option(
        "--checkpoints", help="Also remove the loop's checkpoint folders older than DAYS, except each chain's "
        "newest (the next night's policy) and those the config names; their rows stay in the checkpoints table.")
    ] = False,
    responses: Annotated[bool, typer.Option(
        "--responses", help="Also forget the model answers cached more than DAYS ago: a rerun of a stage that "
        "asked them asks the model again.")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Expire old versions (tagged and current ones kept), then remove the data files, Iceberg metadata files and
    screenshot blobs that no remaining version references, and the trainer's old input folders."""
    from trajforge.data.retention import expire, sharing_scopes
    from trajforge.llm.cache import ResponseCache

    settings, ws = _open_existing(config)
    with ws.ledger.writing("expire", also=sharing_scopes(ws.catalog)):  # no run commits meanwhile, in any namespace
        gone = expire(ws.catalog, ws.blobs, ws.ledger, timedelta(days=older_than), dry_run=dry_run,
                      checkpoints_dir=settings.loop.checkpoints_dir, collect_checkpoints=checkpoints,
                      named_models=settings.model_names())
        # The removed screenshots' OCR readings (about 9 KB each, near the PNG's size); a cache that
        # synth.ocr_cache_url shares with other warehouses is left alone.
        shared = settings.synth.ocr_cache_url is not None
        readings = 0 if shared else ws.ocr.forget({ws.blobs.sha256_of(p) for p in gone.blobs}, dry_run=dry_run)
        # The cache alone, not the gateway: building one checks every endpoint's key variable and checkpoint folder,
        # and a missing one failed the command after the files above were gone, before it said what went.
        cache = ResponseCache(ws.catalog.uri) if responses else None
        answers = cache.forget(datetime.now(timezone.utc) - timedelta(days=older_than), dry_run=dry_run) if cache else 0
    table = Table(title="would expire" if dry_run else "expired")
    for col in ("table", "versions expired", "versions kept"):
        table.add_column(col)
    for name, kept in gone.kept_snapshots.items():
        table.add_row(name, str(len(gone.snapshots.get(name, []))), str(kept))
    console.print(table)
    verb = "would remove" if dry_run else "removed"
    console.print(f"{verb} {len(gone.data_files)} data files, {len(gone.metadata_files)} Iceberg metadata files, "
                  f"{len(gone.blobs)} screenshot blobs "
                  f"({readings} OCR readings{', shared cache left alone' if shared else ''}), "
                  f"{len(gone.train_data)} training data folders and {len(gone.checkpoints)} checkpoints "
                  f"({gone.bytes / 1e6:.1f} MB)")
    if responses:
        console.print(f"{'would forget' if dry_run else 'forgot'} {answers} cached model answers")
    if dry_run:
        for path in (*gone.data_files, *gone.metadata_files, *gone.blobs, *gone.train_data, *gone.checkpoints):
            console.print(f"  {path}", highlight=False)


@evaluate.command("critics")
def eval_critics(
    input: Annotated[str, typer.Option("--input", "-i", help="verdicts@VERSION to evaluate.")] = "verdicts@latest",
    output: Annotated[
        Path | None, typer.Option(help="Report file (JSON); default WAREHOUSE/reports/critics-SNAPSHOT.json.")
    ] = None,
    config: ConfigOpt = None,
    app_dir: Annotated[list[Path] | None, typer.Option(
        "--app-dir", help="The directory of your own app whose episodes the verdicts judged (repeatable), as the "
        "night's `run --app-dir` gave it: its checks are their ground truth.")] = None,
) -> None:
    """Each critic channel's verdicts against the programmatic ground truth: metrics, confusion, errors."""
    from trajforge.critics.evaluate import load_judged, score
    from trajforge.critics.stage import checker_for
    from trajforge.envs.apps import UnknownAppError

    if app_dir:  # the ground truth is the app's own checks: a night's --app-dir is needed again here
        _add_app_dirs(config, app_dir)
    _, ws = _open_existing(config)
    with _usage_errors():
        try:
            snapshot, judged = load_judged(ws.catalog, input, checker_for)
        except UnknownAppError as exc:
            raise _fail(f"{exc}; for your own app's episodes, pass its directory with --app-dir DIR (or set "
                        "query_gen.app_dirs)") from None
    reports = score(judged)
    successes = sum(j.truth for j in judged)
    console.print(
        f"[bold]verdicts@{snapshot}[/]: {len(judged)} episodes, {successes} successful by their checkers "
        "(positive class: success)", highlight=False,
    )
    table = Table(title="critics against ground truth")
    for col in ("predictor", "model", "n", "precision", "recall", "NPV", "F1", "kappa", "TP", "FP", "TN", "FN",
                "no answer"):
        table.add_column(col, justify="left" if col in ("predictor", "model") else "right")
    for r in reports:
        c = r.confusion
        metrics = (c.precision, c.recall, c.npv, c.f1, c.kappa)  # None: nothing to divide by, shown as "-"
        table.add_row(r.name, r.model_id, str(c.n), *("-" if v is None else f"{v:.3f}" for v in metrics),
                      *(str(v) for v in (c.tp, c.fp, c.tn, c.fn, r.unanswered)))
    console.print(table)
    for r in reports:
        for kind, examples in (("judged success, failed", r.false_positives), ("judged failure, succeeded", r.false_negatives)):
            for ex in examples:
                console.print(f"{r.name}: {kind}: {ex['episode_id']} ({ex['instruction']!r}): {ex['critic_reason']}",
                              highlight=False)
    path = output or ws.catalog.warehouse / "reports" / f"critics-{snapshot}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(
        {"verdicts": snapshot, "episodes": len(judged), "successes": successes, "predictors": [r.as_json() for r in reports]},
        indent=2,
    ))
    console.print(f"report: {path}", highlight=False)


@app.command()
def checkpoints(
    model: Annotated[str | None, typer.Option(
        "--model", help="A checkpoint's model id, folder or hash prefix: list the table versions it was trained on."
    )] = None,
    trained_on: Annotated[str | None, typer.Option(
        "--trained-on", help="TABLE@VERSION: list the checkpoints trained on that version.")] = None,
    config: ConfigOpt = None,
) -> None:
    """The checkpoints the loop trained (loop.train), and the lineage of one either way."""
    from trajforge.train import lineage

    _, ws = _open_existing(config)
    with _usage_errors():
        if model is not None:
            for ref in lineage.trained_on(ws.catalog, model):
                console.print(ref, highlight=False)
            return
        rows = lineage.trained_from(ws.catalog, trained_on) if trained_on else lineage.checkpoints(ws.catalog)
    table = Table(title=f"{rows.height} checkpoint(s)" + (f" trained on {trained_on}" if trained_on else ""))
    for col in ("created at", "model id", "hash", "trained from", "tables", "samples", "steps", "seconds", "folder"):
        table.add_column(col)
    for r in rows.iter_rows(named=True):  # the versions themselves: --model HASH
        table.add_row(f"{r['created_at']:%Y-%m-%d %H:%M:%S}", r["model_id"], r["checkpoint_hash"][:12],
                      r["base_model_id"], ", ".join(ref.partition("@")[0] for ref in r["trained_on"]),
                      str(r["samples"]), str(r["steps"]), f"{r['seconds']:.1f}",
                      "here" if Path(r["folder"]).is_dir() else "removed")
    console.print(table)


@app.command()
def report(
    run_id: Annotated[str | None, typer.Argument(help="A nightly run id (default: the latest nightly run).")] = None,
    config: ConfigOpt = None,
) -> None:
    """Print a nightly run's report: yield, success by app and query source, hard queries before and after guidance."""
    _, ws = _open_existing(config)
    folder = ws.catalog.warehouse / "reports"
    if run_id is None:
        found = sorted(folder.glob("nightly-*.md"))  # run ids start with their start time, so names sort by time
        if not found:
            raise _fail(f"no nightly report in {folder}; run `trajforge run nightly` first")
        path = found[-1]
    else:
        path = folder / f"{run_id}.md"
        if not path.exists() and (tagged := _run_of_tag(ws, run_id)) is not None:
            path = folder / f"{tagged}.md"
        if not path.exists():
            newest = [p.stem for p in sorted(folder.glob("nightly-*.md"), reverse=True)[:5]]
            raise _fail(f"no report for run or tag {run_id!r} in {folder}; the runs with one, newest first: "
                        f"{', '.join(newest) or 'none'}")
    console.print(f"report: {path}", highlight=False)
    typer.echo(path.read_text())  # as written: rich would wrap the report's long table rows


def _run_of_tag(ws: Workspace, tag: str) -> str | None:
    """The run whose versions a tag (nightly-YYYY-MM-DD, on the report's first line) names now: a second night of
    the same day moves the tag to its own versions. None where no table has the tag."""
    from trajforge.data.catalog import CatalogError, can_be_tag

    if not can_be_tag(tag):
        return None
    for table in ws.catalog.tables():
        try:
            _, snapshot = ws.catalog.resolve(f"{table}@{tag}")
        except CatalogError:  # not a tag of this table
            continue
        if snapshot is not None:
            return ws.catalog.info(table, snapshot).run_id
    return None


@app.command("export")
def export_cmd(
    ref: Annotated[str, typer.Argument(help="TABLE@VERSION of a training table (a snapshot id, a tag or latest).")],
    fmt: Annotated[str, typer.Option("--format", "-f", help=f"The trainer's format: {', '.join(EXPORT_FORMATS)}.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the dataset and its card into.")],
    added: Annotated[bool, typer.Option(
        "--added", help="Only the rows the run behind the version added (a night's data), not all it holds.")] = False,
    config: ConfigOpt = None,
    app_dir: Annotated[list[Path] | None, typer.Option(
        "--app-dir", help="verl: the directory of your own app whose queries these are (repeatable), as the "
        "night's `run --app-dir` gave it: its checks go beside reward.py.")] = None,
) -> None:
    """Hand a training table's version to a trainer: its rows and images in the trainer's format, with a card."""
    from trajforge.synth.handoff import FORMATS, ExportError, export

    if fmt not in FORMATS:
        raise _fail(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if app_dir:
        _add_app_dirs(config, app_dir)
    _, ws = _open_existing(config)
    with _usage_errors(ExportError):
        ws.catalog.resolve(ref)  # an unknown table is named, with the known ones, as `datasets show` does
        result = export(ws.catalog, ref, fmt, out, added_only=added, viewport=ws.settings.rollout.viewport)
    # Image parts, not files: rows about one screen share its PNG (2,519 parts of a night's grounding rows, 179 files).
    files = len(list((result.out / "images").glob("*.png")))
    on_disk = f" ({files} distinct files)" if files else ""
    console.print(f"exported {result.table}@{result.snapshot} as {fmt}: {result.rows} rows, {result.images} image "
                  f"parts{on_disk} to {result.out} (card: {result.card})", highlight=False)


@app.command()
def view(
    target: Annotated[str | None, typer.Argument(
        help="A run id (its episodes) or an episode id (default: the run of the newest episode).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder (default: WAREHOUSE/views/TARGET).")] = None,
    config: ConfigOpt = None,
) -> None:
    """Write a static site to look at episodes step by step (screens, actions, critiques, verdicts)."""
    from trajforge.flows.viewer import ViewError, build_viewer

    _, ws = _open_existing(config)
    try:
        index = build_viewer(ws, target, out)
    except ViewError as exc:
        raise _fail(str(exc)) from None
    console.print(str(index), highlight=False)


@config_app.command("show")
def config_show(config: ConfigOpt = None) -> None:
    """Every setting's effective value (YAML) and where it came from: default, the config file or a
    TRAJFORGE_ variable; secrets masked."""
    path = config_path(config)
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    data = (read_yaml(path) or {}) if path is not None else {}  # read as load_settings read it
    env = {name.upper(): value for name, value in os.environ.items() if name.upper().startswith(ENV_PREFIX)}
    typer.echo(f"# config file: {path if path is not None else 'none'}")
    for line in _setting_lines(settings, (), lambda parts: _source(parts, data, path, env)):
        typer.echo(line)


def _setting_lines(
    model: BaseModel, parts: tuple[str, ...], source: Callable[[tuple[str, ...]], str]
) -> Iterator[str]:
    """YAML lines of a settings section, each value followed by `# SOURCE`."""
    pad = "  " * len(parts)
    for name in type(model).model_fields:
        value, here = getattr(model, name), (*parts, name)
        if isinstance(value, BaseModel):
            yield f"{pad}{name}:"
            yield from _setting_lines(value, here, source)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            yield f"{pad}{name}:"  # a mapping of sections, such as llm.endpoints
            for key, item in value.items():
                yield f"{pad}  {key}:"
                yield from _setting_lines(item, (*here, str(key)), source)
        else:
            yield f"{pad}{name}: {_shown(value)}  # {source(here)}"


def _shown(value: Any) -> str:
    """A setting's value as YAML (JSON is YAML), secrets masked: a URL keeps all but its password."""
    if isinstance(value, SecretStr):
        secret = value.get_secret_value()
        value = _shown_url(secret) if "://" in secret else "**********"
    return redact(json.dumps(to_jsonable_python(value)))


def _source(parts: tuple[str, ...], data: dict[str, Any], path: Path | None, env: dict[str, str]) -> str:
    """Where a setting's value came from. The environment overrides the file key by key, and a variable may give
    a whole section as JSON (TRAJFORGE_LLM='{...}'), so the longest variable that holds the key wins. A mapping
    (loop.models) also takes keys from variables below its own (TRAJFORGE_LOOP__MODELS__1), merged with the
    file's keys: each of those is named too."""
    keys = sorted(n for n in env if n.startswith(ENV_PREFIX + "__".join(parts).upper() + "__"))
    for i in range(len(parts), 0, -1):
        name = ENV_PREFIX + "__".join(parts[:i]).upper()
        if name not in env:
            continue
        if i == len(parts):
            return ", ".join([name, *keys])
        try:
            given = json.loads(env[name])
        except json.JSONDecodeError:
            continue
        if has_path(given, parts[i:]):
            return ", ".join([name, *keys])
    file = [str(path)] if path is not None and has_path(data, parts) else []
    return ", ".join(file + keys) or "default"


def _nightly_deployment(config: Path | None, settings: Settings) -> dict[str, Any]:
    """What `deploy` and `serve` both give Prefect: the cron, and as the flow's parameter the absolute path of the
    config file the command read (--config, $TRAJFORGE_CONFIG or ./trajforge.yaml), since a worker has its own
    environment and would otherwise run the nights on another config, into another warehouse."""
    from prefect.schedules import Cron

    path = config_path(config)
    return {"parameters": {"config": str(path.resolve())} if path is not None else {},
            "schedules": [Cron(settings.schedule.cron, timezone=settings.schedule.timezone)]}


def _secret_settings(annotation: Any, parts: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The settings that hold a secret (a SecretStr), as their variables' names split at `__` ('*' for a
    mapping's key, such as an endpoint's name)."""
    if annotation is SecretStr:
        yield parts
    elif get_origin(annotation) is dict:
        yield from _secret_settings(get_args(annotation)[1], (*parts, "*"))
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from _secret_settings(field.annotation, (*parts, name.upper()))
    else:  # a union, such as SecretStr | None
        for arg in get_args(annotation):
            yield from _secret_settings(arg, parts)


def _shell_variables() -> tuple[dict[str, str], list[str]]:
    """This shell's TRAJFORGE_ variables for a deployment's runs: (those it carries, the names of those it
    cannot). `deploy` checked the config with them, so a user expects the nights to run with them too, but the
    worker runs in its own environment: the deployment carries them, except $TRAJFORGE_CONFIG (the flow's
    parameter) and those that hold or may hold a secret (an endpoint's api_key, a database URL, a section given
    as JSON, an app's TRAJFORGE_SECRET_), which would be stored on the Prefect server and shown by `prefect
    deployment inspect`: the worker's own environment must set those."""
    secrets = list(_secret_settings(Settings))
    carried: dict[str, str] = {}
    left: list[str] = []
    for name, value in os.environ.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper == f"{ENV_PREFIX}CONFIG":
            continue
        parts = upper.removeprefix(ENV_PREFIX).split("__")
        if upper.startswith(SECRET_PREFIX) or any(all(a in (b, "*") for a, b in zip(secret, parts))
                                                  for secret in secrets):
            left.append(name)
        else:
            carried[name] = value
    return carried, sorted(left)


def _prefect_server() -> str:
    """The Prefect server's API URL, checked to answer.

    Without PREFECT_API_URL each Prefect process starts a temporary server of its own, which
    keeps no schedule after that process ends and starts none while it runs: a served or
    deployed nightly would then never run. So `serve` and `deploy` refuse, naming the two
    commands that give them a server.
    """
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise _fail("no Prefect server to schedule on (PREFECT_API_URL is not set): start one with "
                    "`prefect server start`, then `export PREFECT_API_URL=http://127.0.0.1:4200/api`")
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise _crash(f"the Prefect server at {_shown_url(url)} does not answer: {exc}") from None
    return url


@app.command()
def deploy(
    config: ConfigOpt = None,
    pool: Annotated[str, typer.Option(help="The process work pool whose worker runs the nights (created if missing).")]
    = "trajforge",
) -> None:
    """Deploy the nightly flow to the Prefect server on schedule.cron; a worker of the pool runs it in this folder."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectNotFound

    from trajforge.flows.pipeline import nightly

    settings, _ = _open(config, models=True)
    url = _prefect_server()
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    carried, left = _shell_variables()
    nightly.deploy(
        name="nightly", work_pool_name=pool, **_nightly_deployment(config, settings),
        # The worker imports the installed package (no code upload, no image) and runs in this folder, where
        # trajforge.yaml and the default warehouse are; one night at a time (the warehouse's lock says so too).
        entrypoint_type=EntrypointType.MODULE_PATH, job_variables={"working_dir": str(Path.cwd()), "env": carried},
        concurrency_limit=1, build=False, push=False, print_next_steps=False, ignore_warnings=True,
    )
    console.print(f"deployed nightly/nightly to work pool {pool!r} at {_shown_url(url)}, on cron "
                  f"{settings.schedule.cron!r} ({settings.schedule.timezone}); runs need a worker: "
                  f"prefect worker start --pool {pool}")
    if carried:
        console.print(f"the deployment gives its runs this shell's {', '.join(sorted(carried))}", highlight=False)
    if left:
        err_console.print(f"[bold yellow]warning:[/] the deployment's runs do not get this shell's {', '.join(left)} "
                          "(secrets are not stored on the Prefect server): set them where the worker runs",
                          highlight=False, soft_wrap=True)


@apps_app.command("init")
def apps_init(
    url: Annotated[str, typer.Argument(help="The running app's start page.")],
    out: Annotated[Path, typer.Option("--out", help="The app directory to write spec.yaml into.")],
    name: Annotated[str | None, typer.Option(help="The app's name in queries and datasets (default: --out's "
                                                  "folder name).")] = None,
    max_pages: Annotated[int, typer.Option(help="Pages to explore, breadth-first from the start page.")] = 12,
    config: ConfigOpt = None,
) -> None:
    """Explore a running web app by its links (no form is submitted, no button pressed) and write a draft app
    directory to edit: its pages, link transitions, and a goal per page that `apps check` passes as written."""
    from trajforge.envs.appdir import answers
    from trajforge.envs.browser import BrowserEnv
    from trajforge.envs.explore import explore, write_draft

    try:
        settings = load_settings(config)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    app_name = name or re.sub(r"[^a-z0-9]+", "-", out.resolve().name.lower()).strip("-") or "my-app"
    if (out / "spec.yaml").exists():
        raise _fail(f"{out / 'spec.yaml'} exists; give another --out, or remove it")
    if (why := answers(url)) is not None:
        raise _crash(f"{url} does not answer ({why}); start the app first")
    with BrowserEnv(chromium=settings.rollout.chromium, viewport=settings.rollout.viewport) as env:
        draft = explore(env, url, name=app_name, max_pages=max_pages)
    path = write_draft(draft, out, url)
    goals = sum(1 for p in draft["pages"].values() if "goal" in p)
    console.print(f"wrote {path}: app {app_name!r}, {len(draft['pages'])} pages, {len(draft['transitions'])} "
                  f"transitions, {goals} goals; edit it, then: trajforge apps check {out}")


@apps_app.command("check")
def apps_check(
    directory: Annotated[Path, typer.Argument(help="The app directory (its spec.yaml).")],
    queries: Annotated[int, typer.Option(help="Page-graph tasks to sample, validate and replay.", min=1)] = 20,
    config: ConfigOpt = None,
) -> None:
    """Check an app directory against the live app: its spec, that the app answers, that each sampled task's
    pages and elements are there, and that its goal's check holds after its reference path is replayed; all in
    `rollout.viewport`, as a night's query generation and rollouts see the app."""
    from trajforge.data.blobs import BlobStore
    from trajforge.envs.appdir import AppDirError
    from trajforge.envs.browser import EnvFault
    from trajforge.envs.kinds import use_app_dirs
    from trajforge.envs.spec import SpecError
    from trajforge.query_gen.stage import generate_queries
    from trajforge.rollout.stage import rollout

    try:
        settings = load_settings(config)
        [kind] = use_app_dirs([directory])
    except (ConfigError, SpecError) as exc:
        raise _fail(str(exc)) from None
    chromium = settings.rollout.chromium
    try:
        # Template wording: the check is of pages, elements and goals, and needs no model gateway.
        made = generate_queries([kind], run_id="apps-check", settings=settings.query_gen.model_copy(update={
            "num_queries": queries, "atomic_per_app": 0, "validate_interface": True, "instructions": "template"}),
            chromium=chromium, viewport=settings.rollout.viewport)
        found = made.rows["queries"]
        with tempfile.TemporaryDirectory() as blobs:
            replay = settings.rollout.model_copy(update={"policy": "replay", "samples_per_query": 1})
            episodes = rollout(found, run_id="apps-check", settings=replay, blobs=BlobStore(Path(blobs)))
    except (AppDirError, EnvFault) as exc:  # EnvFault: a page the browser could not open twice (validation)
        raise _crash(str(exc)) from None
    # A graph with fewer distinct tasks than asked is no mistake in the spec: the validator and replay check them all.
    problems = Counter({reason: n for reason, n in made.dropped.items() if "fewer distinct tasks" not in reason})
    by_id = {q.query_id: q for q in found}  # type: ignore[union-attr]
    last = {s.episode_id: s for s in episodes.rows["steps"]}  # type: ignore[union-attr]
    held = 0
    for episode in episodes.rows["episodes"]:
        q = by_id[episode.query_id]  # type: ignore[union-attr]
        ok, reason = kind.check(q.checker, json.loads(q.checker_params_json), json.loads(episode.final_state_json))
        step = last.get(episode.episode_id)
        gave_up = (step is not None and step.action_type == "terminate"
                   and json.loads(step.action_json).get("status") == "failure")
        if episode.status != "terminated" or gave_up:
            why = step.thought if gave_up and step is not None else episode.fault or episode.status
            problems[f"{' -> '.join(q.path)}: the reference path could not be replayed: {why}"] += 1
        elif not ok:
            problems[f"{' -> '.join(q.path)}: check {q.checker!r} does not hold after the reference path: "
                     f"{reason}"] += 1
        else:
            held += 1
    problems.update(episodes.dropped)
    console.print(f"{kind.name}: {len(found)} tasks validated of those sampled, {held} replayed to a check that "
                  f"holds")
    for reason, n in problems.most_common():
        console.print(f"  [red]✗[/] {escape(reason)}" + (f" (x{n})" if n > 1 else ""), highlight=False)
    if problems:
        raise typer.Exit(code=1)
    console.print("[green]ok[/]: every sampled task resolves and its check holds")


@app.command()
def serve(config: ConfigOpt = None) -> None:
    """Serve the nightly flow as a Prefect deployment on the configured cron schedule, while this process runs."""
    from trajforge.flows.pipeline import nightly

    settings, _ = _open(config, models=True)
    _prefect_server()
    console.print(f"serving deployment nightly/nightly on cron {settings.schedule.cron!r} ({settings.schedule.timezone})")
    # One night at a time, as `deploy`'s: a night scheduled while one runs waits for it (it stopped at RunLocked).
    nightly.serve(name="nightly", global_limit=1, **_nightly_deployment(config, settings))


if __name__ == "__main__":
    app()

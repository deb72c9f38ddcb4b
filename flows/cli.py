"""The `trajforge` command line: run the pipeline or one stage, inspect dataset versions, serve.

Every command validates the configuration (and app specs) before it starts work, and
prints problems as one clear message instead of a traceback.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import polars as pl
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import trajforge.flows  # noqa: F401  (sets Prefect's environment defaults before Prefect is imported)
from trajforge.data.catalog import CatalogError
from trajforge.envs.apps import UnknownAppError
from trajforge.envs.miniwob import MiniWoBError
from trajforge.envs.spec import SpecError
from trajforge.flows.stages import stages
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import ConfigError, Settings

STAGES = stages()

app = typer.Typer(help="trajforge: a self-evolving trajectory data factory for GUI agents.", no_args_is_help=True)
datasets = typer.Typer(help="Inspect and tag dataset versions.", no_args_is_help=True)
app.add_typer(datasets, name="datasets")
evaluate = typer.Typer(help="Measure the pipeline's judges against ground truth.", no_args_is_help=True)
app.add_typer(evaluate, name="eval")
# Snapshot ids are copied from this output into --input: never truncate them, even when
# the output is not a terminal (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 200)

ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="Config file (default: $TRAJFORGE_CONFIG or ./trajforge.yaml).")
]


def _fail(message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def _open(config: Path | None) -> tuple[Settings, Workspace]:
    from trajforge.flows.pipeline import preflight

    try:
        settings = preflight(str(config) if config else None)
    except (ConfigError, SpecError, MiniWoBError, UnknownAppError) as exc:
        raise _fail(str(exc)) from None
    return settings, Workspace.open(settings)


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


def _summary(ws: Workspace, snapshots: dict[str, int], tag: str | None) -> None:
    table = Table(title="trajforge run", show_lines=False)
    for col in ("table", "rows added", "rows total", "snapshot", "tag"):
        table.add_column(col, justify="right" if col.startswith("rows") else "left", no_wrap=True)
    for name, snapshot in snapshots.items():
        info = next(i for i in ws.catalog.history(name) if i.snapshot_id == snapshot)
        table.add_row(name, str(info.added_rows), str(info.total_rows), str(snapshot), tag or "")
    console.print(table)
    console.print(f"warehouse: {ws.settings.warehouse.path.resolve()}")


@app.command()
def run(
    stage: Annotated[str, typer.Argument(help=f"nightly, or one stage: {', '.join(STAGES)}")],
    input: Annotated[
        Optional[str], typer.Option("--input", "-i", help="TABLE@VERSION the stage reads (default: TABLE@latest).")
    ] = None,
    config: ConfigOpt = None,
    fresh: Annotated[bool, typer.Option(help="Start a new run even if an unfinished one can be resumed.")] = False,
) -> None:
    """Run the nightly pipeline, or rerun a single stage on a chosen input version."""
    from trajforge.flows.pipeline import STAGE_FLOWS, nightly, run_identity, run_workspace

    if stage != "nightly" and stage not in STAGES:
        raise _fail(f"unknown stage {stage!r}; choose nightly or one of: {', '.join(STAGES)}")
    settings, ws = _open(config)
    cfg = str(config) if config else None
    input_snapshot: int | None = None
    if stage == "nightly":
        if input:
            raise _fail("--input applies to a single stage, not to nightly")
        run_ = ws.ledger.open_run("nightly", run_identity("nightly", settings), fresh=fresh)
        call = nightly(config=cfg, run_id=run_.run_id)
    else:
        reads = STAGES[stage].reads
        if input and reads is None:
            raise _fail(f"stage {stage!r} reads no table; it takes no --input")
        if reads is not None:
            try:
                table, input_snapshot = ws.catalog.resolve(input or f"{reads}@latest")
            except CatalogError as exc:
                raise _fail(str(exc)) from None
            if table != reads:
                raise _fail(f"stage {stage!r} reads {reads!r}, not {table!r}")
            if input_snapshot is None:
                raise _fail(f"table {reads!r} has no version yet; run the stage that writes it first")
        identity = run_identity(stage, settings, str(input_snapshot))
        run_ = ws.ledger.open_run(stage, identity, fresh=fresh)
        call = STAGE_FLOWS[stage](input_snapshot=input_snapshot, run_id=run_.run_id, config=cfg)
    console.print(f"{'resuming' if run_.resumed else 'starting'} run [bold]{run_.run_id}[/]")
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
        _summary(ws, result["snapshots"], result["tag"])
    else:
        ws.ledger.finish_run(run_.run_id, {"snapshots": result})
        _summary(ws, result, None)


@datasets.command("list")
def datasets_list(config: ConfigOpt = None) -> None:
    """Every table with its latest version."""
    _, ws = _open(config)
    table = Table()
    for col in ("table", "versions", "latest snapshot", "rows", "committed at", "stage", "tags"):
        table.add_column(col)
    for name in ws.catalog.tables():
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
    _, ws = _open(config)
    try:
        history = ws.catalog.history(table)
    except CatalogError as exc:
        raise _fail(str(exc)) from None
    out = Table(title=f"{table}: {len(history)} version(s)")
    for col in ("snapshot", "committed at", "operation", "stage", "run", "added", "total", "inputs", "tags"):
        out.add_column(col)
    for i in history:
        inputs = ", ".join(f"{t}@{s}" for t, s in (i.lineage.inputs.items() if i.lineage else []))
        out.add_row(
            str(i.snapshot_id), f"{i.committed_at:%Y-%m-%d %H:%M:%S}", i.operation, i.stage or "-",
            i.run_id or "-", str(i.added_rows), str(i.total_rows), inputs, ", ".join(i.tags),
        )
    console.print(out)


@datasets.command("show")
def datasets_show(
    ref: Annotated[str, typer.Argument(help="TABLE, TABLE@latest, TABLE@SNAPSHOT_ID or TABLE@TAG")],
    limit: Annotated[int, typer.Option(help="Rows to print.")] = 10,
    columns: Annotated[Optional[str], typer.Option(help="Comma-separated columns to print.")] = None,
    config: ConfigOpt = None,
) -> None:
    """A version's lineage and its first rows."""
    _, ws = _open(config)
    try:
        table, snapshot = ws.catalog.resolve(ref)
        frame = ws.catalog.load(table, snapshot)
    except CatalogError as exc:
        raise _fail(str(exc)) from None
    lineage = ws.catalog.lineage(table, snapshot) if snapshot is not None else None
    console.print(f"[bold]{table}@{snapshot}[/]: {frame.height} rows, {frame.width} columns")
    if lineage is not None:
        console.print_json(lineage.model_dump_json())
    if columns:
        frame = frame.select([c.strip() for c in columns.split(",")])
    with pl.Config(tbl_rows=limit, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
        console.print(str(frame.head(limit)), highlight=False)


@datasets.command("diff")
def datasets_diff(table: str, a: str, b: str, config: ConfigOpt = None) -> None:
    """Rows added, removed and changed between versions A and B (ids, tags or 'latest')."""
    _, ws = _open(config)
    try:
        diff = ws.catalog.diff(table, a, b)
    except CatalogError as exc:
        raise _fail(str(exc)) from None
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
    _, ws = _open(config)
    try:
        table, snapshot = ws.catalog.resolve(ref)
        if snapshot is None:
            raise _fail(f"{ref}: the table has no version to tag")
        ws.catalog.tag(table, snapshot, name)
    except CatalogError as exc:
        raise _fail(str(exc)) from None
    console.print(f"tagged {table}@{snapshot} as {name}")


@evaluate.command("critics")
def eval_critics(
    input: Annotated[str, typer.Option("--input", "-i", help="verdicts@VERSION to evaluate.")] = "verdicts@latest",
    output: Annotated[
        Optional[Path], typer.Option(help="Report file (JSON); default WAREHOUSE/reports/critics-SNAPSHOT.json.")
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Each critic channel's verdicts against the programmatic ground truth: metrics, confusion, errors."""
    import json

    from trajforge.critics.evaluate import load_judged, score
    from trajforge.critics.stage import checker_for

    _, ws = _open(config)
    try:
        snapshot, judged = load_judged(ws.catalog, input, checker_for)
    except CatalogError as exc:
        raise _fail(str(exc)) from None
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
        table.add_row(r.name, r.model_id, str(c.n), *(f"{v:.3f}" for v in (c.precision, c.recall, c.npv, c.f1, c.kappa)),
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
def report(
    run_id: Annotated[Optional[str], typer.Argument(help="A nightly run id (default: the latest nightly run).")] = None,
    config: ConfigOpt = None,
) -> None:
    """Print a nightly run's report: yield, success by app and query source, hard queries before and after guidance."""
    _, ws = _open(config)
    folder = ws.catalog.warehouse / "reports"
    if run_id is None:
        found = sorted(folder.glob("nightly-*.md"))  # run ids start with their start time, so names sort by time
        if not found:
            raise _fail(f"no nightly report in {folder}; run `trajforge run nightly` first")
        path = found[-1]
    else:
        path = folder / f"{run_id}.md"
        if not path.exists():
            raise _fail(f"no report for run {run_id!r} in {folder}")
    console.print(f"report: {path}", highlight=False)
    typer.echo(path.read_text())  # as written: rich would wrap the report's long table rows


@app.command()
def serve(config: ConfigOpt = None) -> None:
    """Serve the nightly flow as a Prefect deployment on the configured cron schedule."""
    from prefect.schedules import Cron

    from trajforge.flows.pipeline import nightly

    settings, _ = _open(config)
    params = {"config": str(config.resolve())} if config else {}
    console.print(f"serving deployment nightly/nightly on cron {settings.schedule.cron!r} ({settings.schedule.timezone})")
    nightly.serve(
        name="nightly",
        schedules=[Cron(settings.schedule.cron, timezone=settings.schedule.timezone)],
        parameters=params,
    )


if __name__ == "__main__":
    app()

"""The per-run report: how much usable data the run made and whether guidance helped.

Read by a person the morning after: yield (accepted trajectories per rollout), success
rate by app and by query source, and each guided query's success before the run and in
it. Everything comes from the run's catalog rows, so the report can be rebuilt later.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import sqlalchemy as sa
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trajforge.critics.evaluate import load_judged, score
from trajforge.critics.stage import checker_for
from trajforge.data.catalog import CatalogError, Lineage, SnapshotInfo
from trajforge.data.notebook import TRAINING_TABLES, success_per_app, yield_per_night
from trajforge.guidance.history import attempts_by_query, hardness
from trajforge.llm.cache import responses
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import NOT_ROLLED_AGAIN, policy_summary
from trajforge.synth import agentic_q, ces, pal_ui, pal_ui_sft
from trajforge.synth.export import ROLE_TABLES

ROLE_OF = {t.table: role for role, t in ROLE_TABLES.items()}
"""Training table -> the Mobile-Agent-v3 role whose answers fill it."""


def _rate(successes: int, attempts: int) -> str:
    return f"{successes}/{attempts} ({successes / attempts:.0%})" if attempts else "0/0 (-)"


def _by(history: pl.DataFrame, column: str) -> list[str]:
    lines = [f"| {column} | success |", "| --- | --- |"]
    grouped = history.group_by(column).agg(pl.len().alias("n"), pl.col("success").sum().alias("ok")).sort(column)
    for row in grouped.iter_rows(named=True):
        lines.append(f"| {row[column]} | {_rate(row['ok'], row['n'])} |")
    return lines


def render_report(*, run_id: str, tag: str, history: pl.DataFrame, guidance: pl.DataFrame,
                  hard_before: list[str], not_rolled_again: int = 0) -> str:
    """Markdown for one run. `history` is every query_history row so far; `guidance` this run's guidance rows;
    `hard_before` the queries that were hard when the run began; `not_rolled_again` the queries the rollout left
    out as identical to attempts the warehouse holds."""
    now = history.filter(pl.col("run_id") == run_id)
    before = history.filter(pl.col("run_id") != run_id)
    accepted = int(now["success"].sum()) if now.height else 0
    models = ", ".join(sorted(set(now["model_id"]))) or "-"
    iteration = ", ".join(str(i) for i in sorted(set(now["iteration"]))) or "-"
    lines = [
        f"# trajforge run {run_id} ({tag})", "",
        f"Model iteration {iteration}; policy model(s): {models}.", "",
        "## Yield", "",
        (f"Accepted trajectories per rollout: {_rate(accepted, now.height)} "
         "(rollouts: judged episodes; environment faults are rerun, not counted)."), "",
        *([f"Not rolled again: {not_rolled_again} queries whose attempts the warehouse holds with the same attempt "
           "key (query version, policy settings, model, guidance, seeds, code); rollout.reroll_identical rolls "
           "them.", ""] if not_rolled_again else []),
        "## Success rate by app", "", *_by(now, "app"), "",
        "## Success rate by query source", "", *_by(now, "source"), "",
        "## Hard queries before and after guidance", "",
        f"Hard when the run began: {len(hard_before)}; given guidance: {guidance.height}.", "",
        "| query | guidance | before this run | this run | moved |", "| --- | --- | --- | --- | --- |",
    ]
    for g in guidance.sort("query_id").iter_rows(named=True):
        old = before.filter(pl.col("query_id") == g["query_id"])
        new = now.filter(pl.col("query_id") == g["query_id"])
        old_rate = old["success"].mean() if old.height else None
        new_rate = new["success"].mean() if new.height else None
        moved = "-" if old_rate is None or new_rate is None else f"{new_rate - old_rate:+.0%}"
        lines.append(f"| {g['query_id']} {g['instruction']!r} | {g['guidance_id']} | "
                     f"{_rate(int(old['success'].sum()), old.height)} | {_rate(int(new['success'].sum()), new.height)} "
                     f"| {moved} |")
    unguided = sorted(set(hard_before) - set(guidance["query_id"]))
    if unguided:
        lines += ["", f"Hard but not guided this run: {', '.join(unguided)} (the guidance lineage says why)."]
    lines += ["", "## Every query of the run", "",
              "| query | source | before this run | this run |", "| --- | --- | --- | --- |"]
    for (query_id, source), rows in sorted(now.group_by("query_id", "source"), key=lambda g: g[0]):
        old = before.filter(pl.col("query_id") == query_id)
        lines.append(f"| {query_id} | {source} | {_rate(int(old['success'].sum()), old.height)} | "
                     f"{_rate(int(rows['success'].sum()), rows.height)} |")
    return "\n".join(lines) + "\n"


def _this_run(ws: Workspace, table: str, run_id: str, *columns: str) -> pl.DataFrame | None:
    """The run's rows of a table with run_id and those of `columns` the table has (a version written before a
    column was added lacks it), or None when the table does not exist yet (its stage never ran). Scanned, not
    loaded: a training table holds every night's screenshots (three nights of 500 train_e2e rows, 138 MB on disk:
    loading it whole raised peak memory by 300-320 MB, a night's run_id and weight by 28 MB)."""
    if table not in ws.catalog.tables():
        return None
    scan = ws.catalog.scan(table)
    have = scan.collect_schema().names()
    return scan.filter(pl.col("run_id") == run_id).select("run_id", *(c for c in columns if c in have)).collect()


def render_yield(ws: Workspace, run_id: str) -> list[str]:
    """Rows each training and synthesis table got this run, by kind; a kind with zero rows is a bug to explain."""
    lines = ["## Training data written this run", "", "| table | kind | rows |", "| --- | --- | --- |"]
    episodes = _this_run(ws, "episodes", run_id, "policy", "source")
    team = episodes is not None and episodes.filter(pl.col("policy") == "mobile_agent_v3").height > 0
    rolled = episodes is not None and episodes.filter(pl.col("source").fill_null("policy") == "policy").height > 0
    for table, column in (("episodes", "source"), ("train_e2e", None), ("train_manager", None), ("train_worker", None),
                          ("train_reflector", "outcome"), ("train_notetaker", None), ("grounding", "kind"),
                          ("train_grounding", None), ("action_semantics", "tier"), ("train_semantics", None),
                          ("reasoning_samples", "hint_style"), ("train_reasoning", "hint_style"),
                          ("manuals", "app"), ("plans", "app"), ("train_planning", None),
                          ("pal_ui_teacher", "kept"), ("pal_ui_sft", None),
                          ("ces_coordinator_rl", "zero_variance"), ("ces_coordinator_sft", "silver"),
                          ("ces_state_tracker_rl", "zero_variance"), ("ces_state_tracker_sft", None),
                          ("agentic_q_values", "level"), ("agentic_q_groups", "kept")):
        rows = _this_run(ws, table, run_id, *([column] if column else []))
        if rows is None:
            lines.append(f"| {table} | - | table not written yet |")
        elif column is None or rows.height == 0:
            why = ""
            if table in ROLE_OF and not team:
                why = " (no mobile_agent_v3 episode this run)"
            elif table == "train_e2e" and rows.height == 0:
                why = (" (no policy trajectory passed the critics and filters: see below)" if rolled
                       else " (no policy episode this run)")
            elif rows.height == 0:
                why = _why_empty(_lineage_of_run(ws, table, run_id), ROLE_OF.get(table))
            lines.append(f"| {table} | all | {rows.height}{why} |")
        else:
            for value, n in rows.group_by(column).len().sort(column).iter_rows():
                kind = "policy" if value is None else value if isinstance(value, str) else f"{column} {value}"
                lines.append(f"| {table} | {kind} | {n} |")
    manuals = _this_run(ws, "manuals", run_id, "app", "family", "success_before", "success_with", "trial_queries")
    if manuals is not None and manuals.height:
        lines += ["", "### Manuals and their measured value", "",
                  "| app | family | success before | success with the manual | trial queries |",
                  "| --- | --- | --- | --- | --- |"]
        for m in manuals.sort("app", "family").iter_rows(named=True):
            before = "-" if m["success_before"] is None else f"{m['success_before']:.0%}"
            with_ = "-" if m["success_with"] is None else f"{m['success_with']:.0%}"
            lines.append(f"| {m['app']} | {m['family']} | {before} | {with_} | {len(m['trial_queries'])} |")
    return lines + [""]


def _why_empty(lineage: Lineage | None, role: str | None = None) -> str:
    """Why the stage wrote no row, for the yield table: its drops and the counts it phrased as a cause ("synth.writer
    is template: no plan asked", agentic-Q waiting for enough attempts), the two most frequent; without either,
    its two largest counts. A count of work done ("manual trial episodes") beside a cause would read as one.

    A role's table (`role`) gets the drops that name the role ("worker: filter 2, ...", "filter 4: reflector ...")
    only: the export stage's lineage holds every table's, and train_e2e's filters drop no role's answer. Each role
    answer of an accepted trajectory is written or dropped by such a reason, so none means there was no answer."""
    if lineage is None:
        return ""
    if role is not None:
        counts = Counter({what: n for what, n in lineage.dropped.items() if re.search(rf"\b{role}\b", what)})
        if not counts:
            return f" (no {role} answer in an accepted trajectory)"
    else:
        stats = Counter(lineage.stats)
        counts = Counter(lineage.dropped) + Counter({what: n for what, n in stats.items() if ": " in what}) or stats
    return " (" + "; ".join(f"{what}: {n}" for what, n in counts.most_common(2)) + ")" if counts else ""


def render_policy(ws: Workspace, run_id: str) -> list[str]:
    """The model policy's steps this run, as the rollout stage counted them in its lineage."""
    lineage = _lineage_of_run(ws, "steps", run_id, stage="rollout")
    line = policy_summary(lineage.stats) if lineage is not None else None
    return ["## The policy's steps", "", f"{line}.", ""] if line else []


def _lineage_of_run(ws: Workspace, table: str, run_id: str, stage: str | None = None) -> Lineage | None:
    """The lineage of the run's last commit to the table (by `stage`, where given)."""
    if table not in ws.catalog.tables():
        return None
    mine = [i.lineage for i in ws.catalog.history(table) if i.run_id == run_id and i.lineage is not None
            and stage in (None, i.lineage.stage)]
    return mine[-1] if mine else None


def render_filters(ws: Workspace, run_id: str) -> list[str]:
    """The online rejection-sampling filters of train_e2e this run: what each kept and dropped, with its setting."""
    lineage = _lineage_of_run(ws, "train_e2e", run_id)
    if lineage is None:
        return []
    cfg = ws.settings.synth
    lines = ["## Rejection-sampling filters (train_e2e and the role tables)", "",
             (f"Settings: tau_c {cfg.tau_c}; consistency {cfg.consistency}; weights in [{cfg.reweight_min}, "
             f"{cfg.reweight_max}], smoothing {cfg.reweight_smoothing}."), "",
             "| table or reason | rows |", "| --- | --- |"]
    lines += [f"| kept in {table} | {n} |" for table, n in sorted(lineage.kept.items())]
    lines += [f"| dropped: {reason} | {n} |" for reason, n in sorted(lineage.dropped.items())]
    lines += [f"| {name} | {n} |" for name, n in sorted(lineage.stats.items()) if name.startswith("filter")]
    rows = _this_run(ws, "train_e2e", run_id, "weight")
    if rows is not None and rows.height and "weight" in rows.columns:
        lines += ["", (f"Row weights (filter 3): min {rows['weight'].min():.2f}, mean {rows['weight'].mean():.2f}, "
                  f"max {rows['weight'].max():.2f}.")]
    return lines + [""]


def render_calibration(ws: Workspace, run_id: str) -> list[str]:
    """What a verdict is worth: each critic channel, the step labels and the consensus against the checkers, on
    this run's judged episodes (precision on success: how clean kept data is; NPV: how safe dropping is)."""
    verdicts = _lineage_of_run(ws, "verdicts", run_id)
    if verdicts is None:
        return []
    version = ws.catalog.written_with("verdicts", verdicts)
    try:
        _, judged = load_judged(ws.catalog, f"verdicts@{version}", checker_for)
    except CatalogError as exc:
        return ["## What a verdict is worth", "", f"Not measured: {exc}.", ""]
    lines = ["## What a verdict is worth (critics against the checkers)", "",
             (f"{len(judged)} judged episodes, {sum(j.truth for j in judged)} successful by their checkers. Training "
             f"steps are kept at a step-critic score of at least tau_c = {ws.settings.synth.tau_c}."), "",
             "| predictor | answered | precision on success | NPV | kappa | unanswered |",
             "| --- | --- | --- | --- | --- | --- |"]
    for report in score(judged):
        c = report.confusion
        precision = f"{c.precision:.2f}" if c.precision is not None else "- (none judged a success)"
        npv = f"{c.npv:.2f}" if c.npv is not None else "- (none judged a failure)"
        kappa = f"{c.kappa:.2f}" if c.kappa is not None else "-"
        lines.append(f"| {report.name} | {c.n} | {precision} | {npv} | {kappa} | {report.unanswered} |")
    return lines + [""]


def render_reasoning(ws: Workspace, run_id: str) -> list[str]:
    """Reasoning synthesis this run: per hint style, the share of tried steps that got an accepted reasoning."""
    samples = _this_run(ws, "reasoning_samples", run_id, "step_id", "kept", "hint_style")
    if samples is None or samples.height == 0:
        return []
    tried = samples["step_id"].n_unique()
    lines = ["## Reasoning synthesis", "", f"{tried} trusted steps tried.", "",
             "| hint style | steps with an accepted reasoning | samples | kept |", "| --- | --- | --- | --- |"]
    by_style = samples.group_by("hint_style").agg(
        pl.col("step_id").filter(pl.col("kept")).n_unique().alias("steps"), pl.len().alias("n"),
        pl.col("kept").sum().alias("kept")).sort("hint_style")
    for row in by_style.iter_rows(named=True):
        lines.append(f"| {row['hint_style']} | {_rate(row['steps'], tried)} | {row['n']} | {row['kept']} |")
    return lines + [""]


STEP_DATASETS = (pal_ui.STAGE, pal_ui_sft.STAGE, ces.STAGE, agentic_q.STAGE)
"""The companion papers' stages whose summary line (the figures each paper's data is judged by) the report shows."""


def render_step_datasets(ws: Workspace, run_id: str) -> list[str]:
    """Each companion paper's stage this run: its summary line, from the lineage of the first table it wrote."""
    lines = []
    for stage in STEP_DATASETS:
        lineage = _lineage_of_run(ws, next(iter(stage.writes)), run_id)
        line = stage.summary(lineage.stats) if lineage is not None and stage.summary else None
        if line:
            lines.append(f"- {stage.name}: {line}.")
    return ["## Step-level datasets (companion papers)", "", *lines, ""] if lines else []


HASH_CHARS = 12
"""A checkpoint hash is shown by its first characters, enough to tell two sets of weights apart by eye."""

COMPARED_QUERIES = 30
"""Rows of the per-query comparison of two iterations: the queries that moved most (a night has hundreds)."""


def render_iterations(history: pl.DataFrame, checkpoints: pl.DataFrame, run_id: str) -> list[str]:
    """The self-evolving loop (paper 2.2.3): each iteration's policy model and what trained it, which model made
    this night's rollouts and which one the night trained for the next, and the newest iteration against the one
    before it on the same queries. `history`: every query_history row; `checkpoints`: every checkpoints row."""
    trained = checkpoints.filter(pl.col("run_id") == run_id)
    if history.height == 0 and trained.height == 0:
        return []
    by_model = _checkpoint_of(checkpoints)
    return ["## Model iterations", "", *_iteration_table(history, by_model), "### This night", "",
            *_this_night(history.filter(pl.col("run_id") == run_id), trained, by_model),
            *_compare_iterations(history, run_id)]


def _checkpoint_of(checkpoints: pl.DataFrame) -> dict[str, dict]:
    """Model id -> its checkpoints row; a model id trained again names its latest weights."""
    return {row["model_id"]: row for row in checkpoints.sort("created_at").iter_rows(named=True)}


def _made_by(by_model: dict[str, dict], model_id: str) -> dict | None:
    """The checkpoints row of a recorded model id: by the id itself, or, for a checkpoint served in process, which
    records FOLDER@FINGERPRINT (`llm.local.checkpoint`), by its folder, the id the row registers."""
    return by_model.get(model_id) or by_model.get(model_id.rpartition("@")[0])


def _trained_from(checkpoint: dict) -> str:
    """The short hash and the base model: which weights, and which night's policy the data came from."""
    return f"{checkpoint['checkpoint_hash'][:HASH_CHARS]} from {checkpoint['base_model_id']}"


def _iteration_table(history: pl.DataFrame, by_model: dict[str, dict]) -> list[str]:
    """Each iteration's policy model over every night; a trained one with its hash, base model and table versions,
    so a change in success can be traced to the data that made it."""
    lines = ["| iteration | policy model | checkpoint | trained on | nights | attempts | success |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    grouped = history.group_by("iteration", "model_id").agg(
        pl.col("run_id").n_unique().alias("nights"), pl.len().alias("n"), pl.col("success").sum().alias("ok"))
    for row in grouped.sort("iteration", "model_id").iter_rows(named=True):
        checkpoint = _made_by(by_model, row["model_id"])
        made = f"{_trained_from(checkpoint)} | {', '.join(checkpoint['trained_on'])}" if checkpoint else "- | -"
        lines.append(f"| {row['iteration']} | {row['model_id']} | {made} | {row['nights']} | "
                     f"{row['n']} | {_rate(row['ok'], row['n'])} |")
    return lines + [""]


def _this_night(now: pl.DataFrame, trained: pl.DataFrame, by_model: dict[str, dict]) -> list[str]:
    """The model(s) that made the night's rollouts and the checkpoint the night trained: the next iteration's."""
    lines = []
    for iteration, model_id in now.select("iteration", "model_id").unique().sort("iteration", "model_id").iter_rows():
        checkpoint = _made_by(by_model, model_id)
        made = f"checkpoint {_trained_from(checkpoint)}" if checkpoint else "not a trained checkpoint"
        lines.append(f"- Rollouts: iteration {iteration}, {model_id} ({made}).")
    if now.height == 0:
        lines.append("- Rollouts: none judged this night.")
    for c in trained.sort("created_at").iter_rows(named=True):
        lines.append(f"- Trained for the next iteration: {c['model_id']} (checkpoint {_trained_from(c)}) on "
                     f"{', '.join(c['trained_on'])}: {c['samples']} samples, {c['steps']} steps, {c['seconds']:.0f} s.")
    if trained.height == 0:
        lines.append("- No checkpoint trained this night (loop.train).")
    return lines + [""]


def _compare_iterations(history: pl.DataFrame, run_id: str, limit: int = COMPARED_QUERIES) -> list[str]:
    """The night's newest iteration against the iteration before it, over every night, on the queries both
    attempted: a query only one of them tried would credit a model with an easier (or harder) query set."""
    now = history.filter(pl.col("run_id") == run_id)
    older = history.filter(pl.col("iteration") < now["iteration"].max()) if now.height else now  # none: no night
    if older.height == 0:
        return []
    old, newest = older["iteration"].max(), now["iteration"].max()
    pair = history.filter(pl.col("iteration").is_in([old, newest]))
    per_query = pair.group_by("query_id", "app").agg(*_attempts_under(old, "old"), *_attempts_under(newest, "new"))
    shared = per_query.filter((pl.col("n_old") > 0) & (pl.col("n_new") > 0))
    only_old = per_query.filter(pl.col("n_new") == 0).height
    only_new = per_query.filter(pl.col("n_old") == 0).height
    models = {it: ", ".join(sorted(set(pair.filter(pl.col("iteration") == it)["model_id"]))) for it in (old, newest)}
    lines = [f"### Iteration {newest} against iteration {old} on the same queries", "",
             (f"Iteration {newest} ({models[newest]}) against iteration {old} ({models[old]}), every night's attempts, "
              f"on the {shared.height} queries both attempted. Not compared: {only_old} queries attempted under "
              f"iteration {old} only, {only_new} under iteration {newest} only."), ""]
    if shared.height == 0:
        return lines
    counts = pl.col("n_old", "ok_old", "n_new", "ok_new").sum()
    per_app = pl.concat([shared.group_by("app").agg(counts).sort("app"),
                         shared.select(pl.lit("all").alias("app"), counts)])
    lines += [f"| app | iteration {old} | iteration {newest} | change |", "| --- | --- | --- | --- |"]
    lines += [_compared(row, row["app"]) for row in per_app.iter_rows(named=True)]
    moved = shared.sort((pl.col("ok_new") / pl.col("n_new") - pl.col("ok_old") / pl.col("n_old")).abs(), "app",
                        "query_id", descending=[True, False, False])
    lines += ["", f"| query | app | iteration {old} | iteration {newest} | change |", "| --- | --- | --- | --- | --- |"]
    lines += [_compared(row, f"{row['query_id']} | {row['app']}") for row in moved.head(limit).iter_rows(named=True)]
    if moved.height > limit:
        lines += ["", f"{moved.height - limit} more queries of both iterations moved less and are not listed."]
    return lines + [""]


def _attempts_under(iteration: int, side: str) -> list[pl.Expr]:
    """A query's attempts (n_SIDE) and successes (ok_SIDE) under one iteration."""
    under = pl.col("iteration") == iteration
    return [under.sum().alias(f"n_{side}"), (under & pl.col("success")).sum().alias(f"ok_{side}")]


def _compared(row: dict, label: str) -> str:
    """A table row of the two iterations' success and its change (rates over attempts, in points)."""
    change = row["ok_new"] / row["n_new"] - row["ok_old"] / row["n_old"]
    return (f"| {label} | {_rate(row['ok_old'], row['n_old'])} | {_rate(row['ok_new'], row['n_new'])} | "
            f"{change:+.0%} |")


def write_report(ws: Workspace, run_id: str, tag: str) -> Path:
    """Write the run's report to `<warehouse>/reports/<run_id>.md`, its plots beside it as `<run_id>-*.png`
    (rebuilt the same on a resumed run)."""
    history = ws.catalog.load("query_history")
    guidance = ws.catalog.load("guidance").filter(pl.col("run_id") == run_id)
    checkpoints = ws.catalog.load("checkpoints")  # an empty frame until the train stage first commits
    hard_before = hard_when_begun(ws, run_id, history.filter(pl.col("run_id") != run_id))
    path = ws.catalog.warehouse / "reports" / f"{run_id}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    rollout = _lineage_of_run(ws, "episodes", run_id, stage="rollout")
    report = render_report(run_id=run_id, tag=tag, history=history, guidance=guidance, hard_before=hard_before,
                           not_rolled_again=rollout.stats.get(NOT_ROLLED_AGAIN, 0) if rollout is not None else 0)
    snapshots = _run_snapshots(ws, run_id)
    plots = write_plots(path.parent, run_id, yields=yield_per_night(ws.catalog), success=success_per_app(ws.catalog),
                        labels=label_mix(ws, run_id), rejections=rejections(snapshots),
                        cost=stage_cost(ws, run_id, snapshots), samples=training_rows(snapshots))
    path.write_text(report + "\n" + "\n".join(
        render_policy(ws, run_id) + render_yield(ws, run_id) + render_filters(ws, run_id)
        + render_calibration(ws, run_id) + render_reasoning(ws, run_id) + render_step_datasets(ws, run_id)
        + render_iterations(history, checkpoints, run_id) + plots + render_versions(snapshots, tag)))
    return path


def render_versions(snapshots: list[tuple[str, SnapshotInfo]], tag: str) -> list[str]:
    """The version of each table the run made (its last commit to it: the one a nightly tags), in the order the run
    first wrote each, as the run command prints them: `TABLE@SNAPSHOT` or `TABLE@TAG` reads the night's data."""
    versions: dict[str, list[SnapshotInfo]] = {}
    for table, info in snapshots:
        versions.setdefault(table, []).append(info)  # a table written again keeps its place
    lines = ["## Versions this run made", "", "| table | rows added | rows in the version | snapshot | tag |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {table} | {rows_added(mine)} | {mine[-1].total_rows} | {mine[-1].snapshot_id} | "
              f"{tag if tag in mine[-1].tags else '-'} |" for table, mine in versions.items()]
    return lines + [""]


def rows_added(versions: list[SnapshotInfo]) -> int:
    """The rows a run added to a table over its versions of it, oldest first: replay_buffer gets the reference
    stage's rows and then guidance's and history's (often none), so the last version's count alone understates
    the night. A version that holds only its own rows (an overwrite, as of queries) replaced what came before."""
    added = 0
    for info in versions:
        added = info.added_rows if info.added_rows == info.total_rows else added + info.added_rows
    return added


def hard_when_begun(ws: Workspace, run_id: str, before: pl.DataFrame) -> list[str]:
    """The queries hard when the run began, as its guidance stage judged them: each query of the queries version
    that stage read (the night's whole query set), on the attempts before this run (`before`). The queries judged
    this run would leave out a hard query that loop.max_guided cut and the rollout did not roll again."""
    lineage = _lineage_of_run(ws, "guidance", run_id, stage="guidance")
    if lineage is None or "queries" not in lineage.inputs:
        return []
    queries, _ = ws.catalog.rows_added("queries", lineage.inputs["queries"])
    attempts = attempts_by_query(before)
    loop = ws.settings.loop
    return sorted(q for q in set(queries["query_id"])
                  if hardness(attempts.get(q, []), window=loop.window, below=loop.hard_below).hard)


# ------------------------------------------------------------------- plots
# Rendering is pure (frames in, a matplotlib Figure out, no pyplot state), so it is tested on hand-made
# frames; gathering reads the catalog. Figures are drawn on the Agg canvas whatever backend is configured.

PLOT_DPI = 100
LABEL_COLORS = {"GOOD": "tab:green", "NEUTRAL": "tab:gray", "HARMFUL": "tab:red", "unparsed": "black"}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _short(text: str, size: int = 70) -> str:
    """`text` cut to `size` characters in its middle: a stage's reasons share their start ("element: not unique
    ...") more often than their end."""
    if len(text) <= size:
        return text
    head = (size - 1) // 2
    return text[:head] + "…" + text[len(text) - (size - 1 - head):]


def _night_figure(nights: list[str]) -> Figure:
    """A figure wide enough for a label per night, up to a month of them."""
    return _figure(min(16.0, max(8.0, 0.5 * len(nights))), 4.5)


def _night_axis(ax: Axes, nights: list[str]) -> None:
    ax.set_xticks(range(len(nights)), nights, rotation=30, ha="right", fontsize="small")
    ax.set_xlim(-0.5, len(nights) - 0.5)


def plot_yield(frame: pl.DataFrame) -> Figure:
    """Training rows per table across nights (one line per table): a table falling to zero is a stage to look at."""
    nights = list(dict.fromkeys(frame["night"]))
    fig = _night_figure(nights)
    ax = fig.add_subplot()
    colors = colormaps["tab20"]  # a dozen tables: the default cycle of ten would repeat colours
    for i, table in enumerate(sorted(set(frame["table"]))):
        rows = dict(frame.filter(pl.col("table") == table).select("night", "rows").iter_rows())
        ax.plot(range(len(nights)), [rows.get(night, 0) for night in nights], marker="o", label=table,
                color=colors(i % colors.N))
    _night_axis(ax, nights)
    ax.set_ylabel("training rows")
    ax.set_title("Yield per night")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def plot_success(frame: pl.DataFrame) -> Figure:
    """Success rate per app across nights (one line per app; the attempts are in the point labels)."""
    nights = list(dict.fromkeys(frame["night"]))
    fig = _night_figure(nights)
    ax = fig.add_subplot()
    for (app,), rows in frame.group_by("app", maintain_order=True):
        x = [nights.index(n) for n in rows["night"]]
        ax.plot(x, rows["rate"].to_list(), marker="o", label=app)
        for xi, row in zip(x, rows.iter_rows(named=True)):
            ax.annotate(f"{row['successes']}/{row['attempts']}", (xi, row["rate"]), fontsize="x-small",
                        textcoords="offset points", xytext=(3, 3))
    _night_axis(ax, nights)
    ax.set_ylim(-0.05, 1.1)
    ax.set_ylabel("success rate")
    ax.set_title("Success per app")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def plot_labels(frame: pl.DataFrame) -> Figure:
    """Step labels per critic, stacked: a critic that says GOOD to everything shows at a glance."""
    critics = sorted(set(frame["critic"]))
    fig = _figure(6.0, 1.0 + 0.5 * len(critics))
    ax = fig.add_subplot()
    left = [0] * len(critics)
    for label in sorted(set(frame["label"])):
        counts = dict(frame.filter(pl.col("label") == label).select("critic", "rows").iter_rows())
        widths = [counts.get(c, 0) for c in critics]
        ax.barh(critics, widths, left=left, label=label, color=LABEL_COLORS.get(label))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("steps")
    ax.set_title("Step label mix")
    ax.legend(fontsize="small")
    return fig


def plot_rejections(frame: pl.DataFrame) -> Figure:
    """Rows dropped per stage and reason, largest first: where the night's data went. Two reasons that shorten to
    one label are one bar of their summed rows: matplotlib puts equal labels on one row, one bar hiding the other."""
    rows: Counter[str] = Counter()
    for stage, reason, n in frame.select("stage", "reason", "rows").iter_rows():
        rows[_short(f"{stage}: {reason}")] += n
    labels = sorted(rows, key=lambda label: (rows[label], label))
    fig = _figure(9.0, 1.0 + 0.3 * len(labels))
    ax = fig.add_subplot()
    ax.barh(labels, [rows[label] for label in labels])
    ax.tick_params(axis="y", labelsize="small")
    ax.set_xlabel("rows dropped")
    ax.set_title("Rejections per filter")
    return fig


def plot_cost(frame: pl.DataFrame, samples: int) -> Figure:
    """Model calls, tokens and wall seconds per stage, with the totals per accepted training sample in the title."""
    fig = _figure(12.0, 1.5 + 0.3 * frame.height)
    stages = frame["stage"].to_list()
    for i, (column, xlabel) in enumerate((("calls", "model calls"), ("tokens", "tokens (in + out)"),
                                          ("seconds", "wall seconds"))):
        ax = fig.add_subplot(1, 3, i + 1)
        ax.barh(stages, frame[column].to_list())
        ax.set_xlim(0, max(1, frame[column].max()) * 1.05)  # a night without model calls keeps a sane axis
        ax.invert_yaxis()  # the night's order, top down
        ax.set_xlabel(xlabel)
        if i:
            ax.set_yticks(range(len(stages)), [""] * len(stages))
    fig.suptitle(f"Cost per stage; per accepted training sample: {cost_per_sample(frame, samples)}")
    return fig


def cost_per_sample(frame: pl.DataFrame, samples: int) -> str:
    """The night's model calls, tokens and seconds divided by its training rows."""
    if not samples:
        return "- (no training rows)"
    return (f"{frame['calls'].sum() / samples:.2f} calls, {frame['tokens'].sum() / samples:.0f} tokens, "
            f"{frame['seconds'].sum() / samples:.2f} s ({samples} rows)")


def write_plots(folder: Path, stem: str, *, yields: pl.DataFrame, success: pl.DataFrame, labels: pl.DataFrame,
                rejections: pl.DataFrame, cost: pl.DataFrame, samples: int) -> list[str]:
    """Draw each plot as `<folder>/<stem>-<name>.png` and return the Markdown that links them (an empty frame
    gets a sentence instead of an empty plot)."""
    cost_note = (f"Per accepted training sample: {cost_per_sample(cost, samples)}. Calls and tokens are the model "
                 "answers stored during each stage (the response cache; cached answers cost nothing); seconds run "
                 "from the previous stage's commit to the stage's own.")
    plots = (("yield", "Yield per night", yields, plot_yield, "No training rows yet.", None),
             ("success", "Success per app", success, plot_success, "No judged attempt yet.", None),
             ("labels", "Step label mix", labels, plot_labels, "No step critique this run.", None),
             ("rejections", "Rejections per filter", rejections, plot_rejections, "Nothing dropped this run.", None),
             ("cost", "Cost per stage", cost, lambda f: plot_cost(f, samples), "No stage committed this run.",
              cost_note))
    lines = ["## Plots", ""]
    for name, title, frame, plot, empty, note in plots:
        lines += [f"### {title}", ""]
        if frame.height == 0:
            lines += [empty, ""]
            continue
        file = f"{stem}-{name}.png"
        plot(frame).savefig(folder / file, dpi=PLOT_DPI)
        lines += [note, ""] if note else []
        lines += [f"![{title}]({file})", ""]
    return lines


def _run_snapshots(ws: Workspace, run_id: str) -> list[tuple[str, SnapshotInfo]]:
    """(table, version) of every commit the run made, in commit order."""
    found = [(t, i) for t in ws.catalog.tables() for i in ws.catalog.history(t) if i.run_id == run_id]
    return sorted(found, key=lambda ti: ti[1].committed_at)


def label_mix(ws: Workspace, run_id: str) -> pl.DataFrame:
    """Step critiques of the run per critic and label ('unparsed': the critic's answer did not parse)."""
    rows = _this_run(ws, "step_critiques", run_id, "critic", "label")
    if rows is None:
        return pl.DataFrame(schema={"critic": pl.String, "label": pl.String, "rows": pl.UInt32})
    return (rows.with_columns(pl.col("label").fill_null("unparsed"))
            .group_by("critic", "label").agg(pl.len().alias("rows")).sort("critic", "label"))


def rejections(snapshots: list[tuple[str, SnapshotInfo]]) -> pl.DataFrame:
    """Rows dropped per stage and reason (a stage's lineage repeats its drops on each table it writes: once)."""
    by_stage = {i.lineage.stage: i.lineage.dropped for _, i in snapshots if i.lineage is not None}
    return pl.DataFrame([{"stage": s, "reason": r, "rows": n} for s, d in by_stage.items() for r, n in d.items()],
                        schema={"stage": pl.String, "reason": pl.String, "rows": pl.Int64})


def training_rows(snapshots: list[tuple[str, SnapshotInfo]]) -> int:
    """The run's accepted training samples: rows its commits wrote to the training tables."""
    return sum(i.lineage.kept.get(t, 0) for t, i in snapshots if t in TRAINING_TABLES and i.lineage is not None)


def stage_cost(ws: Workspace, run_id: str, snapshots: list[tuple[str, SnapshotInfo]]) -> pl.DataFrame:
    """Per stage in the night's order: the model answers stored while it ran, their tokens, and its seconds.

    A stage's window runs from the previous stage's commit (the run's start for the first) to its own last
    commit; the answers are the response cache's rows created in the window, the only per-call record that
    outlives the stage. Another run writing to the same catalog at the same time would be counted too.
    """
    ends: dict[str, datetime] = {}
    for _, info in snapshots:
        if info.stage is not None:
            ends[info.stage] = max(ends.get(info.stage, info.committed_at), info.committed_at)
    start = ws.ledger.get_run(run_id).started_at
    calls: list[tuple[datetime, int]] = []
    if ends and sa.inspect(ws.ledger.engine).has_table(responses.name):
        query = sa.select(responses.c.created_at, responses.c.tokens_in, responses.c.tokens_out).where(
            responses.c.created_at >= start, responses.c.created_at <= max(ends.values()))
        with ws.ledger.engine.connect() as conn:
            calls = [(at if at.tzinfo else at.replace(tzinfo=UTC), (tin or 0) + (tout or 0))
                     for at, tin, tout in conn.execute(query)]
    rows = []
    for stage, end in sorted(ends.items(), key=lambda se: se[1]):
        mine = [tokens for at, tokens in calls if start < at <= end]
        rows.append({"stage": stage, "calls": len(mine), "tokens": sum(mine), "seconds": (end - start).total_seconds()})
        start = end
    return pl.DataFrame(rows, schema={"stage": pl.String, "calls": pl.Int64, "tokens": pl.Int64,
                                      "seconds": pl.Float64})

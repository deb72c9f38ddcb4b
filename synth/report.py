"""The per-run report: how much usable data the run made and whether guidance helped.

Read by a person the morning after: yield (accepted trajectories per rollout), success
rate by app and by query source, and each guided query's success before the run and in
it. Everything comes from the run's catalog rows, so the report can be rebuilt later.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from trajforge.critics.evaluate import load_judged, score
from trajforge.critics.stage import checker_for
from trajforge.data.catalog import CatalogError, Lineage
from trajforge.guidance.history import hardness
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import policy_summary
from trajforge.synth import agentic_q, ces, pal_ui, pal_ui_sft
from trajforge.synth.export import ROLE_TABLES

ROLE_TABLE_NAMES = {t.table for t in ROLE_TABLES.values()}


def _rate(successes: int, attempts: int) -> str:
    return f"{successes}/{attempts} ({successes / attempts:.0%})" if attempts else "0/0 (-)"


def _by(history: pl.DataFrame, column: str) -> list[str]:
    lines = [f"| {column} | success |", "| --- | --- |"]
    grouped = history.group_by(column).agg(pl.len().alias("n"), pl.col("success").sum().alias("ok")).sort(column)
    for row in grouped.iter_rows(named=True):
        lines.append(f"| {row[column]} | {_rate(row['ok'], row['n'])} |")
    return lines


def render_report(*, run_id: str, tag: str, history: pl.DataFrame, guidance: pl.DataFrame,
                  hard_before: list[str]) -> str:
    """Markdown for one run. `history` is every query_history row so far; `guidance` this run's guidance rows;
    `hard_before` the queries that were hard when the run began."""
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


def _this_run(ws: Workspace, table: str, run_id: str) -> pl.DataFrame | None:
    """The run's rows of a table, or None when the table does not exist yet (its stage never ran)."""
    if table not in ws.catalog.tables():
        return None
    return ws.catalog.load(table).filter(pl.col("run_id") == run_id)


def render_yield(ws: Workspace, run_id: str) -> list[str]:
    """Rows each training and synthesis table got this run, by kind; a kind with zero rows is a bug to explain."""
    lines = ["## Training data written this run", "", "| table | kind | rows |", "| --- | --- | --- |"]
    episodes = _this_run(ws, "episodes", run_id)
    team = episodes is not None and episodes.filter(pl.col("policy") == "mobile_agent_v3").height > 0
    for table, column in (("episodes", "source"), ("train_e2e", None), ("train_manager", None), ("train_worker", None),
                          ("train_reflector", "outcome"), ("train_notetaker", None), ("grounding", "kind"),
                          ("train_grounding", None), ("action_semantics", "tier"), ("train_semantics", None),
                          ("reasoning_samples", "hint_style"), ("train_reasoning", "hint_style"),
                          ("manuals", "app"), ("plans", "app"), ("train_planning", None),
                          ("pal_ui_teacher", "kept"), ("pal_ui_sft", None),
                          ("ces_coordinator_rl", "zero_variance"), ("ces_coordinator_sft", "silver"),
                          ("ces_state_tracker_rl", "zero_variance"), ("ces_state_tracker_sft", None),
                          ("agentic_q_values", "level"), ("agentic_q_groups", "kept")):
        rows = _this_run(ws, table, run_id)
        if rows is None:
            lines.append(f"| {table} | - | table not written yet |")
        elif column is None or rows.height == 0:
            why = " (no mobile_agent_v3 episode this run)" if table in ROLE_TABLE_NAMES and not team else \
                " (no policy trajectory passed the critics and filters: see below)" if table == "train_e2e" and \
                rows.height == 0 else ""
            lines.append(f"| {table} | all | {rows.height}{why} |")
        else:
            for value, n in rows.group_by(column).len().sort(column).iter_rows():
                kind = "policy" if value is None else value if isinstance(value, str) else f"{column} {value}"
                lines.append(f"| {table} | {kind} | {n} |")
    manuals = _this_run(ws, "manuals", run_id)
    if manuals is not None and manuals.height:
        lines += ["", "### Manuals and their measured value", "",
                  "| app | family | success before | success with the manual | trial queries |",
                  "| --- | --- | --- | --- | --- |"]
        for m in manuals.sort("app", "family").iter_rows(named=True):
            before = "-" if m["success_before"] is None else f"{m['success_before']:.0%}"
            with_ = "-" if m["success_with"] is None else f"{m['success_with']:.0%}"
            lines.append(f"| {m['app']} | {m['family']} | {before} | {with_} | {len(m['trial_queries'])} |")
    return lines + [""]


def render_policy(ws: Workspace, run_id: str) -> list[str]:
    """The model policy's steps this run, as the rollout stage counted them in its lineage."""
    lineage = next((i.lineage for i in ws.catalog.history("steps") if i.run_id == run_id and i.lineage is not None
                    and i.lineage.stage == "rollout"), None) if "steps" in ws.catalog.tables() else None
    line = policy_summary(lineage.stats) if lineage is not None else None
    return ["## The policy's steps", "", f"{line}.", ""] if line else []


def _lineage_of_run(ws: Workspace, table: str, run_id: str) -> Lineage | None:
    if table not in ws.catalog.tables():
        return None
    mine = [i.lineage for i in ws.catalog.history(table) if i.run_id == run_id and i.lineage is not None]
    return mine[-1] if mine else None


def render_filters(ws: Workspace, run_id: str) -> list[str]:
    """The online rejection-sampling filters of train_e2e this run: what each kept and dropped, with its setting."""
    lineage = _lineage_of_run(ws, "train_e2e", run_id)
    if lineage is None:
        return []
    cfg = ws.settings.synth
    lines = ["## Rejection-sampling filters (train_e2e and the role tables)", "",
             f"Settings: tau_c {cfg.tau_c}; consistency {cfg.consistency}; weights in [{cfg.reweight_min}, "
             f"{cfg.reweight_max}], smoothing {cfg.reweight_smoothing}.", "",
             "| table or reason | rows |", "| --- | --- |"]
    lines += [f"| kept in {table} | {n} |" for table, n in sorted(lineage.kept.items())]
    lines += [f"| dropped: {reason} | {n} |" for reason, n in sorted(lineage.dropped.items())]
    lines += [f"| {name} | {n} |" for name, n in sorted(lineage.stats.items()) if name.startswith("filter")]
    rows = _this_run(ws, "train_e2e", run_id)
    if rows is not None and rows.height and "weight" in rows.columns:
        lines += ["", f"Row weights (filter 3): min {rows['weight'].min():.2f}, mean {rows['weight'].mean():.2f}, "
                  f"max {rows['weight'].max():.2f}."]
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
             f"{len(judged)} judged episodes, {sum(j.truth for j in judged)} successful by their checkers. Training "
             f"steps are kept at a step-critic score of at least tau_c = {ws.settings.synth.tau_c}.", "",
             "| predictor | answered | precision on success | NPV | kappa | unanswered |",
             "| --- | --- | --- | --- | --- | --- |"]
    for report in score(judged):
        c = report.confusion
        precision = f"{c.precision:.2f}" if c.tp + c.fp else "- (none judged a success)"
        npv = f"{c.npv:.2f}" if c.tn + c.fn else "- (none judged a failure)"
        kappa = f"{c.kappa:.2f}" if c.n else "-"
        lines.append(f"| {report.name} | {c.n} | {precision} | {npv} | {kappa} | {report.unanswered} |")
    return lines + [""]


def render_reasoning(ws: Workspace, run_id: str) -> list[str]:
    """Reasoning synthesis this run: per hint style, the share of tried steps that got an accepted reasoning."""
    samples = _this_run(ws, "reasoning_samples", run_id)
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


def render_iterations(history: pl.DataFrame) -> list[str]:
    """The loop's iterations side by side: each policy model's attempts and success rate over every night."""
    if history.height == 0:
        return []
    lines = ["## Model iterations", "", "| iteration | policy model | nights | attempts | success |",
             "| --- | --- | --- | --- | --- |"]
    grouped = history.group_by("iteration", "model_id").agg(
        pl.col("run_id").n_unique().alias("nights"), pl.len().alias("n"), pl.col("success").sum().alias("ok"))
    for row in grouped.sort("iteration", "model_id").iter_rows(named=True):
        lines.append(f"| {row['iteration']} | {row['model_id']} | {row['nights']} | {row['n']} | "
                     f"{_rate(row['ok'], row['n'])} |")
    return lines + [""]


def write_report(ws: Workspace, run_id: str, tag: str) -> Path:
    """Write the run's report to `<warehouse>/reports/<run_id>.md` (rebuilt the same on a resumed run)."""
    history = ws.catalog.load("query_history")
    guidance = ws.catalog.load("guidance").filter(pl.col("run_id") == run_id)
    before = history.filter(pl.col("run_id") != run_id)
    now = history.filter(pl.col("run_id") == run_id)
    loop = ws.settings.loop
    hard_before = [
        q for q in now["query_id"].unique().sort()
        if hardness(list(before.filter(pl.col("query_id") == q).select("judged_at", "success").iter_rows()),
                    window=loop.window, below=loop.hard_below).hard
    ]
    path = ws.catalog.warehouse / "reports" / f"{run_id}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = render_report(run_id=run_id, tag=tag, history=history, guidance=guidance,
                           hard_before=hard_before)
    path.write_text(report + "\n" + "\n".join(
        render_policy(ws, run_id) + render_yield(ws, run_id) + render_filters(ws, run_id)
        + render_calibration(ws, run_id) + render_reasoning(ws, run_id) + render_step_datasets(ws, run_id)
        + render_iterations(history)))
    return path

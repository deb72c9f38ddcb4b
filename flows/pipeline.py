"""The stage flows and the nightly flow that chains them.

Each stage flow plans the stage's shards, runs the pending ones as Prefect tasks and
commits the stage's tables once. Flows are `async def` because a sync (sub)flow costs
about a second of heartbeat wait each (shared/FACTS.md).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.futures import wait

from trajforge.data.ledger import Run
from trajforge.flows.preflight import preflight
from trajforge.flows.stages import stages
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import UNHASHED, Settings
from trajforge.schemas.ids import digest
from trajforge.synth.report import write_report
from trajforge.tasks.prefect_tasks import portable, run_workspace, shard_task, task_runner, workspace
from trajforge.tasks.runner import Stage, commit, plan

STAGES = stages()


def _workspace(run_id: str | None, config: str | None) -> Workspace:
    """The workspace the caller of run `run_id` opened (`run_workspace`: Prefect parameters must be plain
    values, so the flows find it by run id); a flow started alone (a deployment) opens its own."""
    ws = workspace(run_id) if run_id is not None else None
    return ws if ws is not None else Workspace.open(preflight(config))


RESUMED_ACROSS: dict[str, Any] = UNHASHED | {"runner": True, "loop": {"trainer"}}
"""Settings a run's identity leaves out: those that change no row (`UNHASHED`: a timeout, a key, the cache), how
shards are run (`runner`), and the trainer's command. Changing them is how a user fixes what stopped a run (an
endpoint's timeout, a worker count, a trainer not installed), so the rerun resumes it: a new run would start the
night again and leave the stopped one unfinished, its training rows never handed to a trainer."""


def run_identity(flow_name: str, settings: Settings, extra: str = "") -> str:
    """What a run does; an unfinished run with the same identity is resumed, not restarted."""
    return digest(f"{flow_name}:{settings.model_dump_json(exclude=RESUMED_ACROSS)}{extra}", 32)


def passed_over(run: Run) -> str | None:
    """What a new run says of the unfinished runs of its flow it leaves as they were (`Run.passed_over`): their
    ids and the way to set them aside, since nothing else ever will (`expire` keeps their files and versions)."""
    if not run.passed_over:
        return None
    return (f"unfinished runs of {run.flow} not resumed (another configuration or input): "
            f"{', '.join(run.passed_over)}; `trajforge run {run.flow} --fresh` sets them aside, else their files and "
            "versions are kept for ever")


async def _run_stage(stage: Stage, ws: Workspace, run_id: str, input_snapshot: int | None) -> dict[str, int]:
    already = ws.ledger.committed(run_id, stage.name)
    if already is not None:
        return already
    p = plan(stage, ws, run_id, input_snapshot)
    settings = portable(ws.settings)
    with task_runner(run_id, stage.workers(ws.settings)) as runner:
        futures = [runner.submit(shard_task, {"plan": p, "shard": shard, "settings": settings})
                   for shard in p.pending]
        wait(futures)
        for f in futures:
            f.result()  # re-raise the first shard failure; done shards stay recorded
    snapshots = commit(p, ws)
    if stage.summary is not None and snapshots:
        table = next(iter(snapshots))
        lineage = ws.catalog.lineage(table, snapshots[table])
        line = stage.summary(lineage.stats if lineage is not None else {})
        if line:
            print(f"{stage.name}: {line}")  # the stage flow logs prints
    return snapshots


def _stage_flow(stage: Stage):
    @flow(name=f"stage-{stage.name.replace('_', '-')}", log_prints=True)
    async def stage_flow(
        input_snapshot: int | None = None, run_id: str | None = None, config: str | None = None
    ) -> dict[str, int]:
        """Run one stage; without a run id it is a run of its own, resumed if it crashed."""
        ws = _workspace(run_id, config)
        if run_id is not None:  # a stage of a run its caller holds (the nightly, the CLI)
            return await _run_stage(stage, ws, run_id, input_snapshot)
        with ws.ledger.writing(stage.name):
            run = ws.ledger.open_run(stage.name, run_identity(stage.name, ws.settings, str(input_snapshot)))
            run_id = run.run_id
            if note := passed_over(run):
                print(note)
            with run_workspace(run_id, ws):
                snapshots = await _run_stage(stage, ws, run_id, input_snapshot)
            ws.ledger.finish_run(run_id, {"snapshots": snapshots})
        return snapshots

    return stage_flow


STAGE_FLOWS = {name: _stage_flow(stage) for name, stage in STAGES.items()}


@flow(name="nightly", log_prints=True)
async def nightly(config: str | None = None, run_id: str | None = None) -> dict[str, Any]:
    """The stages of `flows.stages.NIGHTLY` in order, each on the version of its input this run made; then
    every new version tagged nightly-YYYY-MM-DD and the run's report written."""
    ws = _workspace(run_id, config)
    if run_id is None:  # a run of its own (a deployment's): it holds the warehouse; the CLI holds it for its runs
        with ws.ledger.writing("nightly"):
            run = ws.ledger.open_run("nightly", run_identity("nightly", ws.settings))
            if note := passed_over(run):
                print(note)
            with run_workspace(run.run_id, ws):
                return await _nightly(ws, run.run_id, config)
    return await _nightly(ws, run_id, config)


async def _nightly(ws: Workspace, run_id: str, config: str | None) -> dict[str, Any]:
    snapshots: dict[str, int] = {}
    for name, stage in STAGES.items():
        if not stage.enabled(ws.settings):
            continue
        input_snapshot = snapshots.get(stage.reads) if stage.reads is not None else None
        snapshots |= await STAGE_FLOWS[name](input_snapshot=input_snapshot, run_id=run_id, config=config)
    tag = ws.run_tag(run_id)
    for table, snapshot in snapshots.items():
        ws.catalog.tag(table, snapshot, tag)
    report = write_report(ws, run_id, tag)
    print(f"report: {report}")
    summary = {"run_id": run_id, "tag": tag, "snapshots": snapshots, "report": str(report)}
    ws.ledger.finish_run(run_id, summary)
    return summary

"""The stage flows and the nightly flow that chains them.

Each stage flow plans the stage's shards, runs the pending ones as Prefect tasks and
commits the stage's tables once. Flows are `async def` because a sync (sub)flow costs
about a second of heartbeat wait each (shared/FACTS.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from trajforge.envs.apps import load_app
from trajforge.envs.miniwob import check_tasks
from trajforge.schemas.config import Settings, load_settings
from trajforge.tasks.prefect_tasks import shard_task
from trajforge.tasks.runner import StageDef, commit, plan
from trajforge.synth.report import write_report
from trajforge.tasks.stages import STAGES, run_tag
from trajforge.tasks.workspace import Workspace


def preflight(config: str | None) -> Settings:
    """Everything that can be checked before work starts: the config and every app spec."""
    settings = load_settings(Path(config) if config else None)
    for name in settings.query_gen.apps:
        load_app(name)
    if settings.query_gen.miniwob_tasks:
        check_tasks(settings.query_gen.miniwob_tasks)
    return settings


def run_identity(flow_name: str, settings: Settings, extra: str = "") -> str:
    """What a run does; an unfinished run with the same identity is resumed, not restarted."""
    payload = settings.model_dump_json() + extra
    return hashlib.sha256(f"{flow_name}:{payload}".encode()).hexdigest()[:32]


async def _run_stage(stage: StageDef, ws: Workspace, run_id: str, input_snapshot: int | None) -> dict[str, int]:
    already = ws.ledger.committed(run_id, stage.name)
    if already is not None:
        return already
    p = plan(stage, ws, run_id, input_snapshot)
    futures = [shard_task.submit(p, shard, ws) for shard in p.pending]
    wait(futures)
    for f in futures:
        f.result()  # re-raise the first shard failure; done shards stay recorded
    return commit(p, ws)


def _stage_flow(stage: StageDef):
    @flow(name=f"stage-{stage.name.replace('_', '-')}", log_prints=True)
    async def stage_flow(
        input_snapshot: int | None = None, run_id: str | None = None, config: str | None = None
    ) -> dict[str, int]:
        """Run one stage; without a run id it is a run of its own, resumed if it crashed."""
        settings = preflight(config)
        ws = Workspace.open(settings)
        own_run = run_id is None
        if own_run:
            run_id = ws.ledger.open_run(stage.name, run_identity(stage.name, settings, str(input_snapshot))).run_id
        snapshots = await _run_stage(stage, ws, run_id, input_snapshot)
        if own_run:
            ws.ledger.finish_run(run_id, {"snapshots": snapshots})
        return snapshots

    return stage_flow


STAGE_FLOWS = {name: _stage_flow(stage) for name, stage in STAGES.items()}


def _with_workers(stage: str, settings: Settings):
    workers = STAGES[stage].workers(settings)
    return STAGE_FLOWS[stage].with_options(task_runner=ThreadPoolTaskRunner(max_workers=workers))


@flow(name="nightly", log_prints=True)
async def nightly(config: str | None = None, run_id: str | None = None) -> dict[str, Any]:
    """Query generation, guidance for hard queries, rollouts, critics, history and the training export; then
    every new version tagged nightly-YYYY-MM-DD and the run's report written."""
    settings = preflight(config)
    ws = Workspace.open(settings)
    if run_id is None:
        run_id = ws.ledger.open_run("nightly", run_identity("nightly", settings)).run_id
    run = ws.ledger.get_run(run_id)
    snapshots: dict[str, int] = {}
    snapshots |= await _with_workers("query_gen", settings)(run_id=run.run_id, config=config)
    # The loop: guidance for the queries earlier runs failed, written before the rollouts that use it.
    snapshots |= await _with_workers("guidance", settings)(
        input_snapshot=snapshots["queries"], run_id=run.run_id, config=config
    )
    snapshots |= await _with_workers("rollout", settings)(
        input_snapshot=snapshots["queries"], run_id=run.run_id, config=config
    )
    snapshots |= await _with_workers("critics", settings)(
        input_snapshot=snapshots["episodes"], run_id=run.run_id, config=config
    )
    for stage in ("history", "export"):  # history rewrites queries: queries@latest then shows each query's record
        snapshots |= await _with_workers(stage, settings)(
            input_snapshot=snapshots["verdicts"], run_id=run.run_id, config=config
        )
    tag = run_tag(ws, run.run_id)
    for table, snapshot in snapshots.items():
        ws.catalog.tag(table, snapshot, tag)
    report = write_report(ws, run.run_id, tag)
    print(f"report: {report}")
    summary = {"run_id": run.run_id, "tag": tag, "snapshots": snapshots, "report": str(report)}
    ws.ledger.finish_run(run.run_id, summary)
    return summary

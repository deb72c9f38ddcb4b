"""Prefect wrappers of the runner: one task per shard, never per row or model call, on the configured engine.

Resume is the ledger's job, not Prefect's result cache: the ledger lives in the
catalog's database, so it works the same for a laptop run and for workers on a cluster.

A shard task is handed the run's settings, not its workspace (an open catalog, browser and models cannot
travel to another process): it finds the workspace of its run in this process, which the caller registered
(`run_workspace`) on the thread engine, and which a Dask worker opens on the run's first shard it gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from trajforge.envs.kinds import use_app_dirs
from trajforge.envs.pool import warm_scope
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings
from trajforge.tasks.runner import Shard, StagePlan, run_shard

_WORKSPACES: dict[str, Workspace] = {}
"""Run id -> the run's open workspace in this process."""

_CLUSTERS: dict[str, str] = {}
"""Run id -> the address of the Dask scheduler its shards go to (engine dask)."""


@contextmanager
def run_workspace(run_id: str, ws: Workspace) -> Iterator[Workspace]:
    """Make `ws` the workspace of every flow and shard of run `run_id` in this process while the block runs;
    with `runner.engine: dask` and no `runner.dask_address`, a LocalCluster of `runner.workers` processes lives
    as long as the block, so a night's stages share its workers (and the models each has loaded)."""
    runner = ws.settings.runner
    use_app_dirs(ws.settings.query_gen.app_dirs)
    with ExitStack() as stack:
        stack.enter_context(warm_scope())  # last: the warm browser contexts end with the process's last run
        _WORKSPACES[run_id] = ws
        stack.callback(_WORKSPACES.pop, run_id, None)
        if runner.engine == "dask":
            if not PREFECT_API_URL.value():
                # Without a Prefect server each Dask worker would start a temporary one of its own and report
                # its task runs there: start the run's now and name it in the settings the flows serialize
                # for the workers (a worker on another machine needs a real server: PREFECT_API_URL).
                from prefect.server.api.server import SubprocessASGIServer

                server = SubprocessASGIServer()
                server.start()
                stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
            address = runner.dask_address
            if address is None:
                from distributed import LocalCluster

                cluster = stack.enter_context(LocalCluster(
                    n_workers=runner.workers, threads_per_worker=1, processes=True, dashboard_address=":0"))
                address = cluster.scheduler_address
            _CLUSTERS[run_id] = address
            stack.callback(_CLUSTERS.pop, run_id, None)
        yield ws


def workspace(run_id: str) -> Workspace | None:
    """The workspace run `run_id` registered in this process, if any."""
    return _WORKSPACES.get(run_id)


def task_runner(run_id: str, workers: int) -> TaskRunner:
    """Where a stage of run `run_id` sends its shards: the run's Dask scheduler, else `workers` threads here."""
    address = _CLUSTERS.get(run_id)
    if address is None:
        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=address)


def portable(settings: Settings) -> Settings:
    """The settings a worker in another process opens the run's workspace from: the warehouse folder and the
    app directories as absolute paths (a worker's working directory is its own)."""
    warehouse = settings.warehouse.model_copy(update={"path": settings.warehouse.path.resolve()})
    query_gen = settings.query_gen.model_copy(update={"app_dirs": [p.resolve() for p in settings.query_gen.app_dirs]})
    return settings.model_copy(update={"warehouse": warehouse, "query_gen": query_gen})


def _open(run_id: str, settings: Settings) -> Workspace:
    """The run's workspace in this process; a Dask worker opens it once per run and keeps only the newest
    run's, so a long-lived worker does not hold every night's models. It opens it again when a shard brings other
    settings: a worker outlives the command, and the resume of a run that a timeout, a key, the cache or the
    trainer stopped brings the fixed ones (`RESUMED_ACROSS`)."""
    ws = _WORKSPACES.get(run_id)
    # A worker's workspace has the settings a shard brought; the one the caller registered (thread engine) has
    # them before `portable`.
    if ws is not None and settings not in (ws.settings, portable(ws.settings)):
        _WORKSPACES.pop(run_id).close()  # the command that sent the old settings has ended (one holds a warehouse)
        ws = None
    if ws is None:
        _WORKSPACES.clear()  # not closed: another warehouse's night may have a shard running on another thread
        use_app_dirs(settings.query_gen.app_dirs)  # the user's apps, known to kind_for in this worker too
        ws = _WORKSPACES[run_id] = Workspace.open(settings)
    return ws


@task(name="shard", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def shard_task(plan: StagePlan, shard: Shard, settings: Settings) -> dict[str, int]:
    return run_shard(plan, shard, _open(plan.run_id, settings))

"""Prefect wrappers of the runner: one task per shard, never per row or model call.

Resume is the ledger's job, not Prefect's result cache: the ledger lives in the
catalog's database, so it works the same for a laptop run and for workers on a cluster.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from trajforge.llm.workspace import Workspace
from trajforge.tasks.runner import Shard, StagePlan, run_shard


@task(name="shard", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def shard_task(plan: StagePlan, shard: Shard, ws: Workspace) -> dict[str, int]:
    return run_shard(plan, shard, ws)

"""MiniWoB++ queries: each task's own utterance for a seed, read from the live page."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from trajforge.envs.browser import BrowserEnv
from trajforge.envs.miniwob import MiniWoBEnv, MiniWoBServer, check_tasks
from trajforge.schemas.records import Query


def miniwob_queries(
    tasks: list[str], seeds: list[int], *, run_id: str, max_steps: int, chromium: Path
) -> list[Query]:
    """One query per (task, seed); the instruction is the utterance that seed generates."""
    check_tasks(tasks)
    generator = f"miniwob@{version('miniwob')}"
    now = datetime.now(timezone.utc)
    rows: list[Query] = []
    with MiniWoBServer() as server:
        env = MiniWoBEnv(BrowserEnv(viewport="desktop", chromium=chromium))
        try:
            for task in tasks:
                for seed in seeds:
                    utterance = env.reset(f"{task}-{seed}", server.task_url(task, seed))
                    rows.append(Query(
                        run_id=run_id,
                        query_id=hashlib.sha256(f"miniwob:{task}:{seed}".encode()).hexdigest()[:16],
                        app="miniwob",
                        source="miniwob",
                        instruction=utterance,
                        path=[task],
                        slots_json=json.dumps({"seed": seed}),
                        checker="reward",
                        checker_params_json=json.dumps({"task": task, "seed": str(seed)}),
                        max_steps=max_steps,
                        generator=generator,
                        created_at=now,
                    ))
        finally:
            env.close()
    return rows

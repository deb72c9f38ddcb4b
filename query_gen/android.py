"""Queries for Android devices from hand-written task templates (`query_gen.android_tasks`).

A device has no page graph to sample from; its tasks are written by hand, as
AndroidWorld's are, each naming the activity it starts from and the device state
(a probe) that says it is done.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

from trajforge.schemas.config import AndroidTask
from trajforge.schemas.records import Query

ANDROID = "android"


def android_queries(tasks: list[AndroidTask], *, run_id: str) -> list[Query]:
    now = datetime.now(timezone.utc)
    return [
        Query(
            run_id=run_id,
            query_id=hashlib.sha256(f"android:{t.start}:{t.instruction}".encode()).hexdigest()[:16],
            app=ANDROID,
            source="imported",
            instruction=t.instruction,
            path=[t.start],
            slots_json="{}",
            checker="probe",
            checker_params_json=json.dumps({"probe": t.probe, "value": t.value}),
            max_steps=t.max_steps,
            generator="android_tasks@1",
            created_at=now,
        )
        for t in tasks
    ]

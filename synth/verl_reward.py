"""verl's custom reward function for the `verl` export: the query's own checker on the app's final state.

verl loads this file by path (`reward.custom_reward_function.path=DIR/reward.py`, `reward.custom_reward_function.name=
compute_score`, the name it looks for when none is set) and calls `compute_score(data_source, solution_str,
ground_truth, extra_info)` once per response.

Where the final state comes from: `extra_info["final_state"]`, the app's state as the environment read it when
the episode ended (a dict, or the same as a JSON string, as `episodes.final_state_json` holds it). The rollout
that drives the app for verl (an agent loop or interaction running the browser) puts it there. `solution_str`,
the model's own text, is never read as a state: a model could write a state its checker accepts without doing
the task.

The checkers are trajforge code (a bundled app's state checkers, MiniWoB++'s reward, the Android probe), so
this module imports `trajforge`: the training workers need it installed, at the version that wrote the data. A
user's own app (an app directory) is known to trajforge only where it is registered: the export copies its checks
(spec.yaml, checkers.py) to `apps/APP/` beside this file, and loading this file registers them.

It never raises on what a rollout produced: a ground truth, state or checker run it cannot use scores 0.0 and
the reason is logged, since one bad response must not end a training run. A query whose app it cannot find
raises (UnknownAppError, naming the app): that is the export or the install at fault, for every rollout of the
app, and a run rewarded 0.0 throughout would train on nothing without saying so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trajforge.envs.apps import UnknownAppError
from trajforge.envs.kinds import AppKind, kind_for, use_app_dirs

logger = logging.getLogger("trajforge.verl_reward")  # a fixed name: verl loads the file as "custom_module"

APPS = Path(__file__).with_name("apps")
"""The exported app directories' checks (`verl.APPS_FOLDER`), found from this file wherever verl runs it."""

use_app_dirs(sorted(p for p in APPS.iterdir() if p.is_dir()) if APPS.is_dir() else [])


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> float:
    """1.0 if the query's checker accepts the final state in `extra_info["final_state"]`, else 0.0."""
    query = (extra_info or {}).get("query_id")
    try:
        truth = json.loads(ground_truth)
        app, checker, params = truth["app"], truth["checker"], truth["params"]
    except (TypeError, ValueError, KeyError) as exc:
        logger.warning("query %s: ground truth unusable (%r): %s", query, exc, str(ground_truth)[:200])
        return 0.0
    kind = _kind(app)  # raises: not this rollout's fault, and every rollout of the app would score 0.0
    state = (extra_info or {}).get("final_state")
    if isinstance(state, (str, bytes)):
        try:
            state = json.loads(state)
        except ValueError as exc:
            logger.warning("query %s: final state is not JSON (%s)", query, exc)
            return 0.0
    if not isinstance(state, dict):
        logger.warning("query %s: no final state object in extra_info['final_state'] (got %s)", query,
                       type(state).__name__)
        return 0.0
    try:
        ok, reason = kind.check(checker, params, state)
    except (LookupError, TypeError, ValueError, AttributeError) as exc:  # an unknown checker (ValueError), or a
        # state shaped unlike the app's (KeyError): one bad rollout must not stop training
        logger.warning("query %s: checker %s/%s failed on the state: %r", query, app, checker, exc)
        return 0.0
    logger.debug("query %s: %s/%s %s: %s", query, app, checker, "success" if ok else "failure", reason)
    return 1.0 if ok else 0.0


def _kind(app: str) -> AppKind:
    """The app's kind; an app neither trajforge nor `APPS` knows raises, naming it and where it was looked for."""
    try:
        return kind_for(app)
    except UnknownAppError as exc:
        raise UnknownAppError(f"reward.py: {exc}; nor is it an app directory in {APPS}: export the queries with "
                              "their app directories (query_gen.app_dirs) and keep apps/ beside reward.py") from None

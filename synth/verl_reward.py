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
this module imports `trajforge`: the training workers need it installed, at the version that wrote the data.

It never raises on what a rollout produced: a ground truth, state or checker run it cannot use scores 0.0 and
the reason is logged, since one bad response must not end a training run.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from trajforge.envs.kinds import kind_for

logger = logging.getLogger("trajforge.verl_reward")  # a fixed name: verl loads the file as "custom_module"


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
        ok, reason = kind_for(app).check(checker, params, state)
    except (LookupError, TypeError, ValueError, AttributeError) as exc:  # an unknown app (LookupError) or
        # checker (ValueError), or a state shaped unlike the app's: one bad rollout must not stop training
        logger.warning("query %s: checker %s/%s failed on the state: %r", query, app, checker, exc)
        return 0.0
    logger.debug("query %s: %s/%s %s: %s", query, app, checker, "success" if ok else "failure", reason)
    return 1.0 if ok else 0.0

"""verl's custom reward function for the `verl` export: the query's own checker on the app's final state.

verl loads this file by path (`reward.custom_reward_function.path=DIR/reward.py`, `reward.custom_reward_function.name=
compute_score`, the name it looks for when none is set) and calls `compute_score(data_source, solution_str,
ground_truth, extra_info)` once per response.

Where the final state comes from: `extra_info["final_state"]`, the app's state as the environment read it when
the episode ended (a dict, or the same as a JSON string, as `episodes.final_state_json` holds it). Stock verl
hands this function the Parquet row's `extra_info` as stored, which holds ids only: a custom agent loop or reward
manager of the user's, the one that ran the episode in the app, must put the state there. A row without the key
raises (FinalStateMissing): scored 0.0, every reward would be 0 and GRPO would train on nothing, silently.
`solution_str`, the model's own text, is never read as a state: a model could write a state its checker accepts
without doing the task.

The checkers are trajforge code (a bundled app's state checkers, MiniWoB++'s reward, the Android probe), so
this module imports `trajforge`: the training workers need it installed, at the version that wrote the data. A
user's own app (an app directory) is known to trajforge only where it is registered: the export copies its checks
(spec.yaml, checkers.py) to `apps/APP/` beside this file, and loading this file registers them.

It never raises on what a rollout produced: a ground truth or state it cannot use, or a checker that fails on the
state (a user's checkers.py may raise anything), scores 0.0 and the reason is logged, since one bad response
must not end a training run. What is wrong for every rollout raises, since a run rewarded 0.0 throughout would
train on nothing without saying so: a query whose app it cannot find (UnknownAppError, naming the app: the export
or the install at fault), and a row without `final_state` (the rollout side at fault).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trajforge.envs.apps import UnknownAppError
from trajforge.envs.kinds import AppKind, kind_for, use_app_dirs
from trajforge.envs.secrets import mask

logger = logging.getLogger("trajforge.verl_reward")  # a fixed name: verl loads the file as "custom_module"

APPS = Path(__file__).with_name("apps")
"""The exported app directories' checks (`verl.APPS_FOLDER`), found from this file wherever verl runs it."""

use_app_dirs(sorted(p for p in APPS.iterdir() if p.is_dir()) if APPS.is_dir() else [])


class FinalStateMissing(LookupError):
    """`extra_info` has no `final_state`: nothing on the rollout side put the app's final state there."""


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> float:
    """1.0 if the query's checker accepts the final state in `extra_info["final_state"]`, else 0.0."""
    info = extra_info or {}
    query = info.get("query_id")
    if "final_state" not in info:
        raise FinalStateMissing(
            f"reward.py: query {query}: extra_info has no 'final_state'. verl passes the Parquet row's extra_info "
            "as stored (ids only); the agent loop or reward manager that ran the episode in the app must put the "
            "app's final state there (a dict or JSON string), or every reward is 0.0 and nothing is learnt")
    try:
        truth = json.loads(ground_truth)
        app, checker, params = truth["app"], truth["checker"], truth["params"]
    except (TypeError, ValueError, KeyError) as exc:
        logger.warning("query %s: ground truth unusable (%r): %s", query, exc, str(ground_truth)[:200])
        return 0.0
    kind = _kind(app)  # raises: not this rollout's fault, and every rollout of the app would score 0.0
    state = info["final_state"]
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
    except Exception as exc:  # noqa: BLE001 - an unknown checker (ValueError), a state shaped unlike the app's
        # (KeyError), a user's checkers.py asserting on an odd state: one bad rollout must not stop training. The
        # message may quote the state, so it is masked and cut, and the state itself is not logged.
        logger.warning("query %s: checker %s/%s failed on the state: %s: %s", query, app, checker,
                       type(exc).__name__, mask(str(exc))[:200])
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

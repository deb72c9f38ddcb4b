"""The episode recorder: run one policy on one query and write its Episode and Step rows.

Each step keeps the observation before and after the action (screenshot by hash in
the blob store, accessibility tree with element boxes, URL, title), the action (a valid
one as the env executed it, in its space's form with the browser's key names:
`actions.canonical`; an invalid one as the policy gave it), whether it was valid and why not,
the element it aimed at with its box, and the policy's thought and raw output. An
invalid action is recorded and the episode goes on (the agent wasted a step); a
failure of the browser or app ends the episode with status env_fault and the fault's
kind, so critics and hard-query selection never blame the agent for the environment,
and the stage can rerun it.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Protocol

from playwright.sync_api import Error as PlaywrightError

from trajforge.envs import actions
from trajforge.envs.browser import BrowserEnv, Element, EnvFault, Observation
from trajforge.llm.calls import CallRecord
from trajforge.rollout.policy import Policy
from trajforge.schemas.records import Episode, Query, Step


class BlobRefLike(Protocol):
    """What the recorder reads of `data.blobs.BlobRef` (read-only, as that frozen dataclass is)."""

    @property
    def sha256(self) -> str: ...

    @property
    def width(self) -> int: ...

    @property
    def height(self) -> int: ...


class BlobSink(Protocol):
    """What the recorder needs of `data.blobs.BlobStore`."""

    def put(self, data: bytes) -> BlobRefLike: ...


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _target(env: BrowserEnv, action: dict[str, Any], before: Observation) -> Element | None:
    """The element an action aims at: under the pointer, or the focused element for keys and typing."""
    where = actions.point(action)
    if where is not None:
        return env.element_at(*where)
    if action.get("type") in ("type", "key"):
        return before.focused
    return None


def run_episode(
    env: BrowserEnv,
    policy: Policy,
    query: dict[str, Any] | Query,
    *,
    run_id: str,
    episode_id: str,
    blobs: BlobSink,
    max_steps: int | None = None,
    start_url: str | None = None,
    viewport: str | None = None,
    attempt: int = 1,
    max_invalid: int | None = None,
    max_repeats: int | None = None,
) -> tuple[Episode, list[Step]]:
    """Reset the env (session = episode_id), loop observe -> act until terminate or
    `max_steps` (default: the query's), then read the app's state.

    `start_url` overrides the env's start page; `viewport` is what the row records
    (default: the env's viewport name); `attempt` counts the query's reruns after env
    faults. A step's duration_ms is the whole step: the policy's decision, the action
    with its navigation, and the next observation. After `max_invalid` invalid actions
    in a row the episode ends as `stalled`: a policy that cannot produce an action
    would only spend the step budget (and model time) repeating itself. So does one that
    repeats a valid action the screen does not respond to: after `max_repeats` such
    repeats in a row the episode ends as `stalled` too (measured: with constrained decoding
    the embedded model clicks the same point on an unchanged screen for all of its steps).
    """
    q = query if isinstance(query, Query) else Query.model_validate(query)
    limit = max_steps if max_steps is not None else q.max_steps
    started = _now()
    steps: list[Step] = []
    status, fault, fault_kind = "max_steps", None, None
    invalid_in_a_row = repeats_in_a_row = 0
    final_state: dict[str, Any] = {}
    before: Observation | None = None  # the last observation; none when the env failed before the first
    try:
        env.reset(episode_id, start_url)
        policy.reset(q)
        before = env.observe()
        before_ref = blobs.put(before.png)
        for index in range(limit):
            t0 = time.perf_counter()
            out = policy.act(before, env)
            action = out.action
            error = out.error or actions.validate(action, before.width, before.height, env.space)
            if error is None:  # an invalid action is kept as the policy wrote it: the error is about that
                action = actions.canonical(action, env.space)
            target = _target(env, action, before) if error is None else None
            if error is None:
                error = env.act(action)
            after = env.observe()
            after_ref = blobs.put(after.png)
            kind = action.get("type") if isinstance(action, dict) else None
            args = {k: v for k, v in action.items() if k != "type"} if isinstance(action, dict) else {}
            steps.append(Step(
                run_id=run_id,
                step_id=f"{episode_id}:{index}",
                episode_id=episode_id,
                step_index=index,
                screenshot_before=before_ref.sha256,
                screenshot_after=after_ref.sha256,
                width=before_ref.width,
                height=before_ref.height,
                url_before=before.url,
                url_after=after.url,
                title_before=before.title,
                title_after=after.title,
                ax_tree_before=before.ax_tree,
                ax_tree_after=after.ax_tree,
                action_type=str(kind) if kind is not None else "",
                action_json=json.dumps(args, default=str),
                action_valid=error is None,
                action_error=error,
                target_role=target.role if target else None,
                target_name=target.name if target else None,
                target_box=list(target.box) if target and target.box else None,
                thought=out.thought,
                raw_output=out.raw_output,
                duration_ms=(time.perf_counter() - t0) * 1000,
                policy_error=out.error,
                observation_mode=out.calls[-1].observation_mode if out.calls else None,
                model_calls_json=json.dumps([_call_summary(c) for c in out.calls]) if out.calls else None,
                roles_json=json.dumps(out.roles, default=str) if out.roles is not None else None,
            ))
            repeated = (error is None and len(steps) > 1 and after_ref.sha256 == before_ref.sha256
                        and (steps[-2].action_type, steps[-2].action_json) == (steps[-1].action_type,
                                                                               steps[-1].action_json))
            before, before_ref = after, after_ref
            invalid_in_a_row = invalid_in_a_row + 1 if error is not None else 0
            repeats_in_a_row = repeats_in_a_row + 1 if repeated else 0
            if max_invalid is not None and invalid_in_a_row >= max_invalid:
                status = "stalled"
                break
            if max_repeats is not None and repeats_in_a_row >= max_repeats:
                status = "stalled"
                break
            if error is None and action.get("type") == "terminate":
                status = "terminated"
                break
        final_state = env.app_state()
    except (EnvFault, PlaywrightError) as exc:
        env_fault = env.fault(exc)  # a policy that reads the page raises the bare Playwright error
        status, fault, fault_kind = "env_fault", str(env_fault), env_fault.kind
        try:
            final_state = env.app_state()
        except (EnvFault, RuntimeError):
            final_state = {}  # the app's state is unreadable too; the fault says why
    episode = Episode(
        run_id=run_id,
        episode_id=episode_id,
        query_id=q.query_id,
        app=q.app,
        instruction=q.instruction,
        policy=policy.name,
        model_id=policy.model_id,
        prompt_version=policy.prompt_version,
        viewport=viewport or env.viewport,
        status=status,  # type: ignore[arg-type]
        num_steps=len(steps),
        final_url=before.url if before is not None else "",
        final_state_json=json.dumps(final_state, sort_keys=True),
        fault=fault,
        started_at=started,
        finished_at=_now(),
        fault_kind=fault_kind,
        attempt=attempt,
    )
    return episode, steps


_CALL_FIELDS = ("template", "template_version", "model_id", "observation_mode", "cached", "reask",
                "tokens_in", "tokens_out", "latency_ms", "parse_error", "constrained", "error")


def _call_summary(call: CallRecord) -> dict[str, Any]:
    """What a step keeps of a model call (the raw answer is already the step's raw_output)."""
    return call.model_dump(include=set(_CALL_FIELDS))

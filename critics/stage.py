"""The critics stage: episodes with their steps and queries in, step critiques and verdicts out.

For each episode the step critic judges every step (pre-filters first, a model for the
steps they leave open), then the trajectory critic's channels judge the episode (text,
multimodal, checker) and the configured consensus rule makes the verdict. The verdict
keeps every channel's answer and reason, including the channels that were not asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trajforge.critics import trajectory
from trajforge.critics.steps import StepCritic, short_id
from trajforge.critics.trajectory import CHECKER, MULTIMODAL, TEXT, ChannelAnswer
from trajforge.data.blobs import BlobStore
from trajforge.llm import Gateway
from trajforge.schemas.config import CriticSettings
from trajforge.schemas.records import StepCritique, Verdict
from trajforge.schemas.stage import StageOutput

# (checker name, params, state) -> (success, reason): the app's own checker.
Checker = Callable[[str, dict[str, str], dict[str, Any]], tuple[bool, str]]


def _check_models(settings: CriticSettings, gateway: Gateway | None) -> None:
    """Fail before any work when a configured critic model does not exist."""
    named = [m for m in (settings.step_model, settings.text_model, settings.multimodal_model) if m is not None]
    if named and gateway is None:
        raise ValueError("critic models are configured but the critics stage was given no gateway")
    for model in named:
        if gateway is not None and model not in gateway.backends:
            raise ValueError(f"critics: no model named {model!r} (configured: {', '.join(gateway.backends)})")


def judge(
    episodes: list[dict[str, Any]],
    *,
    run_id: str,
    settings: CriticSettings,
    config_hash: str,
    checker_for: Callable[[str], Checker],
    blobs: BlobStore,
    gateway: Gateway | None,
) -> StageOutput:
    """Judge episodes; each dict holds the episode's columns plus `steps` and `query`.

    `gateway` None asks no model: the step critic is rules only and the model channels
    are recorded as not asked. An episode that ended in an environment fault gets step
    critiques but no verdict: a fault says nothing about the task, so it is counted as
    dropped instead of labelled a failure.
    """
    _check_models(settings, gateway)
    step_critic = StepCritic(
        run_id, blobs, gateway if settings.step_critic == "model" else None, settings.step_model
    )

    def one(ep: dict[str, Any]) -> tuple[list[StepCritique], Verdict | None, str | None]:
        critiques = step_critic.critique_episode(ep["episode_id"], ep["instruction"], ep["steps"])
        if ep["status"] == "env_fault":
            return critiques, None, "env_fault: no verdict"
        if ep["query"] is None:
            return critiques, None, "query not found in the input snapshot"
        return critiques, _verdict(ep, critiques, run_id, settings, config_hash, checker_for, blobs, gateway), None

    out = StageOutput()
    critiques: list[StepCritique] = []
    verdicts: list[Verdict] = []
    with ThreadPoolExecutor(settings.concurrency, thread_name_prefix="critic") as pool:
        for ep_critiques, verdict, dropped in pool.map(one, episodes):
            critiques += ep_critiques
            if verdict is not None:
                verdicts.append(verdict)
            if dropped is not None:
                out.dropped[dropped] += 1
    _account(out, critiques, verdicts)
    out.rows = {"step_critiques": critiques, "verdicts": verdicts}
    return out


def _verdict(
    ep: dict[str, Any],
    critiques: list[StepCritique],
    run_id: str,
    settings: CriticSettings,
    config_hash: str,
    checker_for: Callable[[str], Checker],
    blobs: BlobStore,
    gateway: Gateway | None,
) -> Verdict:
    query = ep["query"]
    success, reason = checker_for(ep["app"])(
        query["checker"], json.loads(query["checker_params_json"]), json.loads(ep["final_state_json"])
    )
    channels: dict[str, ChannelAnswer] = {
        CHECKER: trajectory.checker_channel(success, reason, f"checker:{ep['app']}/{query['checker']}")
    }
    summaries = [c.summary for c in critiques]
    after = [s["screenshot_after"] for s in ep["steps"]]
    if gateway is None:
        channels[TEXT] = trajectory.not_asked("no model gateway given to the critics")
        channels[MULTIMODAL] = trajectory.not_asked("no model gateway given to the critics")
    else:
        channels[TEXT] = (
            trajectory.text_channel(
                gateway, settings.text_model, ep["instruction"], summaries, blobs.get(after[-1]) if after else None
            )
            if settings.text_channel
            else trajectory.not_asked("critics.text_channel is off")
        )
        channels[MULTIMODAL] = trajectory.multimodal_channel(
            gateway, settings.multimodal_model, ep["instruction"], summaries, after[-settings.multimodal_images :]
        )
    success, reason = trajectory.consensus(settings.consensus, channels, settings.k)
    return Verdict(
        run_id=run_id,
        verdict_id=short_id(run_id, ep["episode_id"]),
        episode_id=ep["episode_id"],
        query_id=ep["query_id"],
        success=success,
        consensus=settings.consensus if settings.consensus != "k_of_n" else f"k_of_n:k={settings.k}",
        channels_json=json.dumps({name: c.as_json() for name, c in channels.items()}),
        reason=reason,
        config_hash=config_hash,
    )


def _account(out: StageOutput, critiques: list[StepCritique], verdicts: list[Verdict]) -> None:
    """Counts and model/prompt versions for the snapshot's lineage."""
    for c in critiques:
        out.stats[f"steps judged by {c.critic}"] += 1
        if c.label is None:
            out.stats["step critiques without a label (unparsed or no answer)"] += 1
        if c.model_id != "none":
            out.models["step_critic"] = c.model_id
            out.prompts[c.critic.split("@")[0]] = c.prompt_version
    for v in verdicts:
        for name, channel in json.loads(v.channels_json).items():
            out.stats[f"{name} channel: {channel['answer'] or ('no answer' if channel['asked'] else 'not asked')}"] += 1
            if channel["asked"]:
                out.models[f"trajectory_{name}"] = channel["model_id"]
            if channel["prompt_version"]:
                prompt = trajectory.TEXT_PROMPT if name == TEXT else trajectory.MULTIMODAL_PROMPT
                out.prompts[prompt] = channel["prompt_version"]

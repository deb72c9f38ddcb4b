"""The critics stage: episodes with their steps and queries in, step critiques and verdicts out.

For each episode the step critic judges every step (pre-filters first, a model for the
steps they leave open), then the trajectory critic's channels judge the episode (text,
multimodal, checker) and the configured consensus rule makes the verdict. The verdict
keeps every channel's answer and reason, including the channels that were not asked.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import polars as pl

from trajforge.critics import trajectory
from trajforge.critics.steps import StepCritic
from trajforge.critics.trajectory import CHECKER, MULTIMODAL, TEXT, ChannelAnswer
from trajforge.data.blobs import BlobStore
from trajforge.envs.kinds import kind_for
from trajforge.llm import Gateway
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import CriticSettings
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import Episode, Query, Step, StepCritique, Verdict, steps_by_episode
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

# (checker name, params, state) -> (success, reason): the app's own checker.
Checker = Callable[[str, dict[str, str], dict[str, Any]], tuple[bool, str]]


@dataclass(frozen=True)
class EpisodeUnit:
    """One episode to judge, with its steps in order and the query it tried (None: not in the input)."""

    episode: Episode
    steps: list[Step]
    query: Query | None


def _check_models(settings: CriticSettings, gateway: Gateway | None) -> None:
    """Fail before any work when a configured critic model does not exist."""
    named = [m for m in (settings.step_model, settings.text_model, settings.multimodal_model) if m is not None]
    if named and gateway is None:
        raise ValueError("critic models are configured but the critics stage was given no gateway")
    for model in named:
        if gateway is not None:
            try:
                gateway.backend(model)
            except ValueError as exc:
                raise ValueError(f"critics: {exc}") from None


def ocr_engine(settings: CriticSettings, gateway: Gateway | None) -> str | None:
    """The OCR engine whose text the critics' models read, None where none does: the text channel reads the final
    screen's caption, and a step critic that cannot see images reads its screenshots as OCR text. Another engine
    writes other text, so other verdicts: its id goes into the config hash and the lineage, as grounding's does."""
    if gateway is None:
        return None
    text_only_steps = settings.step_critic == "model" and not gateway.sees_images(settings.step_model)
    return gateway.ocr.engine_id if settings.text_channel or text_only_steps else None


def judge(
    episodes: list[EpisodeUnit],
    *,
    run_id: str,
    settings: CriticSettings,
    config_hash: str,
    checker_for: Callable[[str], Checker],
    blobs: BlobStore,
    gateway: Gateway | None,
) -> StageOutput:
    """Judge episodes, each with its steps and query.

    `gateway` None asks no model: the step critic is rules only and the model channels
    are recorded as not asked. An episode that ended in an environment fault gets step
    critiques but no verdict: a fault says nothing about the task, so it is counted as
    dropped instead of labelled a failure.
    """
    _check_models(settings, gateway)
    step_critic = StepCritic(
        run_id, blobs, gateway if settings.step_critic == "model" else None, settings.step_model
    )

    def one(unit: EpisodeUnit) -> tuple[list[StepCritique], Verdict | None, str | None]:
        ep = unit.episode
        critiques = step_critic.critique_episode(ep.episode_id, ep.instruction, [s.model_dump() for s in unit.steps])
        if ep.status == "env_fault":
            return critiques, None, "env_fault: no verdict"
        if unit.query is None:
            return critiques, None, "query not found in the input snapshot"
        return critiques, _verdict(unit, critiques, run_id, settings, config_hash, checker_for, blobs, gateway), None

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
    if (engine := ocr_engine(settings, gateway)) is not None:
        out.models["ocr"] = engine
    out.rows = {"step_critiques": critiques, "verdicts": verdicts}
    return out


def _verdict(
    unit: EpisodeUnit,
    critiques: list[StepCritique],
    run_id: str,
    settings: CriticSettings,
    config_hash: str,
    checker_for: Callable[[str], Checker],
    blobs: BlobStore,
    gateway: Gateway | None,
) -> Verdict:
    ep, query = unit.episode, unit.query
    assert query is not None
    success, reason = checker_for(ep.app)(
        query.checker, json.loads(query.checker_params_json), json.loads(ep.final_state_json)
    )
    channels: dict[str, ChannelAnswer] = {
        CHECKER: trajectory.checker_channel(success, reason, f"checker:{ep.app}/{query.checker}")
    }
    summaries = [c.summary for c in critiques]
    after = [s.screenshot_after for s in unit.steps]
    if gateway is None:
        channels[TEXT] = trajectory.not_asked("no model gateway given to the critics")
        channels[MULTIMODAL] = trajectory.not_asked("no model gateway given to the critics")
    else:
        channels[TEXT] = (
            trajectory.text_channel(
                gateway, settings.text_model, ep.instruction, summaries, blobs.get(after[-1]) if after else None
            )
            if settings.text_channel
            else trajectory.not_asked("critics.text_channel is off")
        )
        channels[MULTIMODAL] = trajectory.multimodal_channel(
            gateway, settings.multimodal_model, ep.instruction, summaries, after[-settings.multimodal_images :]
        )
    success, reason = trajectory.consensus(settings.consensus, channels, settings.k)
    return Verdict(
        run_id=run_id,
        verdict_id=short_id(run_id, ep.episode_id),
        episode_id=ep.episode_id,
        query_id=ep.query_id,
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


# ---------------------------------------------------------------- the stage


def checker_for(app: str) -> Checker:
    """The checker of one app's kind (bundled app state, MiniWoB++ reward, Android probe): one signature."""
    return kind_for(app).check


REFERENCE_NOT_JUDGED = "reference episodes: checked by the reference stage, not judged"
"""The count of the run's episodes the critics leave to the reference stage, which checks each replay itself."""


def load_episodes(ws: Workspace, snapshot: int | None) -> Inputs[EpisodeUnit]:
    """Episodes of one version, with the steps and queries of the same rollout run; its reference episodes are
    counted, not judged. The fingerprint names the OCR engine the critics read (`ocr_engine`)."""
    episodes, snapshot = ws.catalog.rows_added("episodes", snapshot)
    stats: Counter[str] = Counter()
    if "source" in episodes.columns:
        policy = episodes.filter(pl.col("source").is_null() | (pl.col("source") != "reference"))
        if reference := episodes.height - policy.height:
            stats[REFERENCE_NOT_JUDGED] = reference
        episodes = policy
    lineage = ws.catalog.lineage("episodes", snapshot)
    if lineage is None:
        raise LookupError(f"episodes@{snapshot} has no lineage, so its steps and queries cannot be found")
    steps_snapshot = ws.catalog.written_with("steps", lineage)
    steps, _ = ws.catalog.rows_added("steps", steps_snapshot)
    queries_snapshot = lineage.inputs["queries"]
    queries = {q["query_id"]: Query.model_validate(q) for q in ws.catalog.load("queries", queries_snapshot).to_dicts()}
    by_episode = steps_by_episode(steps.to_dicts())
    units = [
        EpisodeUnit(Episode.model_validate(ep), by_episode.get(ep["episode_id"], []), queries.get(ep["query_id"]))
        for ep in episodes.to_dicts()
    ]
    gateway = _gateway(ws)
    _check_models(ws.settings.critics, gateway)  # an unknown name fails as a critic's, before `ocr_engine` asks it
    return Inputs(units=units, snapshots={"episodes": snapshot, "steps": steps_snapshot, "queries": queries_snapshot},
                  fingerprint=ocr_engine(ws.settings.critics, gateway) or "", stats=stats)


def _gateway(ws: Workspace) -> Gateway | None:
    """The run's gateway where the critics ask a model; None (not opened) where they ask none."""
    cfg = ws.settings.critics
    asks_models = cfg.step_critic == "model" or cfg.text_channel or cfg.multimodal_model is not None
    return ws.gateway if asks_models else None


def run_critics(units: list[EpisodeUnit], ws: Workspace, run_id: str, config_hash: str) -> StageOutput:
    return judge(units, run_id=run_id, settings=ws.settings.critics, config_hash=config_hash,
                 checker_for=checker_for, blobs=ws.blobs, gateway=_gateway(ws))


STAGE = StageDef[Workspace, EpisodeUnit](
    name="critics",
    key=lambda u: u.episode.episode_id,
    reads="episodes",
    writes={"step_critiques": "append", "verdicts": "append"},
    sections=("critics", "llm"),
    load=load_episodes,
    run=run_critics,
    shard_size=lambda s: s.critics.episodes_per_shard,
)

"""The step-level critic (paper 6.3): one judgement per step, in the episode's order.

Each step first goes through the pre-filters; the ones they settle cost nothing. The
rest are asked of a model with the annotated pre-action screenshot, the post-action
screenshot, the task and the summaries of the steps before it, and the answer must be
one JSON object (`StepJudgement`). An answer that does not parse, or a call that gets
no answer, is kept as a critique with no label and the reason, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trajforge.critics import prefilter
from trajforge.critics.annotate import annotate
from trajforge.data.blobs import BlobStore
from trajforge.llm import Gateway, GatewayError, load_prompt
from trajforge.llm.messages import ImagePart
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import StepCritique

STEP_PROMPT = "critic_step"
PREFILTER_CRITIC = "prefilter@2"  # 2: a terminate with status failure is HARMFUL
RULES_CRITIC = "rules@1"
MAX_SUMMARY_WORDS = 30


class StepJudgement(BaseModel):
    """What the step critic must answer: the paper's analysis, summary and label."""

    model_config = ConfigDict(extra="forbid")

    analysis: str = Field(min_length=1)
    summary: str = Field(min_length=1)
    label: Literal["GOOD", "NEUTRAL", "HARMFUL"]

    @field_validator("summary")
    @classmethod
    def _short(cls, summary: str) -> str:
        words = len(summary.split())
        if words > MAX_SUMMARY_WORDS:
            raise ValueError(f"has {words} words; at most {MAX_SUMMARY_WORDS}")
        return summary


def describe_action(step: dict[str, Any]) -> str:
    """The action in words, for the prompt and for summaries: `click {"x": 120, "y": 640}`."""
    return f"{step['action_type'] or '(no action)'} {step['action_json']}"


def _target(step: dict[str, Any]) -> str | None:
    if not step.get("target_name") and not step.get("target_role"):
        return None
    box = f" at {[round(v) for v in step['target_box']]}" if step.get("target_box") else ""
    return f"{step.get('target_role') or 'element'} '{step.get('target_name') or ''}'{box}"


@dataclass(frozen=True)
class StepCritic:
    """Judges the steps of one episode; `model` None means rules only (no model is asked)."""

    run_id: str
    blobs: BlobStore
    gateway: Gateway | None
    model: str | None

    def critique_episode(self, episode_id: str, task: str, steps: list[dict[str, Any]]) -> list[StepCritique]:
        """A critique per step, each model call given the summaries of the steps before it."""
        critiques: list[StepCritique] = []
        previous: dict[str, Any] | None = None
        for step in steps:
            found = prefilter.flags(step, previous)
            settled = prefilter.settle(step, found)
            if settled is not None:
                critiques.append(self._rule(step, episode_id, PREFILTER_CRITIC, settled, found))
            elif self.gateway is None:
                critiques.append(self._rule(step, episode_id, RULES_CRITIC, _changed(step), found))
            else:
                history = [c.summary for c in critiques]
                critiques.append(self._ask(step, episode_id, task, history, found))
            previous = step
        return critiques

    def _rule(
        self, step: dict[str, Any], episode_id: str, critic: str, judged: tuple[str, str, str], found: list[str]
    ) -> StepCritique:
        label, analysis, summary = judged
        return StepCritique(
            run_id=self.run_id, critique_id=short_id(self.run_id, step["step_id"], critic), step_id=step["step_id"],
            episode_id=episode_id, critic=critic, model_id="none", prompt_version="none", analysis=analysis,
            summary=summary, label=label,  # type: ignore[arg-type]
            raw_output=json.dumps({"label": label, "summary": summary}), flags=found,
        )

    def _ask(
        self, step: dict[str, Any], episode_id: str, task: str, history: list[str], found: list[str]
    ) -> StepCritique:
        assert self.gateway is not None
        before = self.blobs.get(step["screenshot_before"])
        drawn = annotate(before, {"type": step["action_type"], **json.loads(step["action_json"])}, step.get("target_box"))
        annotated = self.blobs.put(drawn).sha256 if drawn is not None else step["screenshot_before"]
        prompt = load_prompt(STEP_PROMPT)
        rendered = prompt.render(
            screenshots=[ImagePart(sha256=annotated), ImagePart(sha256=step["screenshot_after"])],
            width=step["width"], height=step["height"], task=task, history=history,
            action=describe_action(step), target=_target(step),
        )
        critic = f"{STEP_PROMPT}@{prompt.version}"
        common = dict(
            run_id=self.run_id, critique_id=short_id(self.run_id, step["step_id"], critic), step_id=step["step_id"],
            episode_id=episode_id, critic=critic, prompt_version=prompt.version, flags=found,
            annotated_screenshot=annotated,
        )
        try:
            result = self.gateway.chat_sync(rendered, model=self.model, schema=StepJudgement)
        except GatewayError as exc:
            return StepCritique(
                **common, model_id=exc.record.model_id, analysis="", summary=describe_action(step), label=None,
                raw_output="", parse_error=f"no answer: {exc.record.error}",
                observation_mode=exc.record.observation_mode,
            )
        record = result.record
        judged = result.parsed
        return StepCritique(
            **common, model_id=record.model_id, observation_mode=record.observation_mode, raw_output=result.text,
            parse_error=result.parse_error,
            analysis=judged.analysis if judged else "",
            # The history of later steps needs a summary even when this answer was unusable.
            summary=judged.summary if judged else describe_action(step),
            label=judged.label if judged else None,
        )


def _changed(step: dict[str, Any]) -> tuple[str, str, str]:
    """The rules' judgement of a valid step that changed the screen: it did something, so GOOD."""
    moved = f", moving to {step['url_after']}" if step["url_after"] != step["url_before"] else ""
    target = f" on {_target(step)}" if _target(step) else ""
    action = step["action_type"]
    return "GOOD", f"The {action}{target} changed the screen{moved}.", f"{action}{target}{moved}"

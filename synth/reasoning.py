"""Reasoning synthesis (GUI-Owl 2.2.3): offline hint-guided rejection sampling and multi-agent distillation.

For a step whose action is trusted (a reference replay its checker passed, or a step of a
trajectory the critics accepted), the model is asked for the reasoning from the task, the
history and the screen, under each hint style (`synth.hint_styles`, one versioned prompt
each: `reasoning_cot`, a fixed chain of thought; `reasoning_simple`, the shortest
reasoning that decides). A second call sees only that reasoning and the screen
(`reasoning_act`, held to the action space's call schema while decoding) and gives an
action; the reasoning is kept when that action matches the trusted one (`synth.match`).
Up to `synth.reasoning_tries` samples per style, a seed each. A step no sample matched
gets one last call that is shown the trusted action (`reasoning_hinted`); its reasoning
is kept flagged `hinted_with_answer`. A step the Mobile-Agent-v3 roles decided
(`roles_json`) is distilled instead: the model merges the roles' outputs into one
reasoning (`reasoning_distill`), paired with the worker's action. A step whose roles all
left no output has no decision to distill (the reasoning would be written from the action
alone, an answer-hinted one unflagged), so it is sampled as any other trusted step.

A reasoning the model was cut off in (at the prompt's max_tokens) keeps its whole sentences only, and
none is no reasoning (`reasoning_text`): the act check, the row and its training sample see the same text.

Every sample is a `reasoning_samples` row, rejected ones too (kept false, with the match
result), so each style's acceptance rate can be counted; each kept one is a
`train_reasoning` row, the step in `train_e2e`'s messages with the reasoning as its thinking.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trajforge.envs import actions
from trajforge.llm import ImagePart
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, ToolCall, tool_spec
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import ReasoningChat, ReasoningSample, Step
from trajforge.schemas.stage import StageDef, StageOutput
from trajforge.synth.ask import Answer, Asker
from trajforge.synth.chat import policy_messages
from trajforge.synth.match import match
from trajforge.synth.semantics import action_text
from trajforge.synth.trusted import (
    TrustedEpisode,
    load_trusted,
    predicted_action,
    prediction_schema,
    spread,
    trusted_action,
)
from trajforge.synth.trusted import history as past  # `history` names a step's past actions below

ACT, HINTED, DISTILL = "reasoning_act", "reasoning_hinted", "reasoning_distill"
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def reasoning_text(answer: Answer) -> tuple[str, str | None]:
    """The reasoning an answer gives, and why it gives none. An answer cut off at the prompt's max_tokens keeps
    its whole sentences only: a thought that stops mid-sentence is no example to learn from, and the act check
    then sees what is kept. None of it whole, or no answer, is no reasoning."""
    if answer.error or not answer.text.strip():
        return "", f"no reasoning: {answer.error or 'empty'}"
    text = answer.text.strip()
    if answer.finish_reason == "length":
        ends = list(_SENTENCE_END.finditer(text))
        text = text[:ends[-1].end()] if ends else ""
        if not text:
            return "", "no reasoning: cut off at max_tokens before its first sentence ended"
    return text, None


class _Reasoner(Asker):
    """The model calls of one shard, with the run and the settings the rows need."""

    def __init__(self, ws: Workspace, out: StageOutput, run_id: str) -> None:
        self.run_id, self.cfg = run_id, ws.settings.synth
        super().__init__(ws, out, (*(f"reasoning_{s}" for s in self.cfg.hint_styles), ACT, HINTED, DISTILL),
                         model=self.cfg.model, role="reasoning")


def _screen(step: Step) -> list[ImagePart]:
    return [ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before)]


def _roles(step: Step) -> list[tuple[str, str]]:
    """(role, what it said) for each Mobile-Agent-v3 role that answered at this step, in the team's order."""
    recorded = json.loads(step.roles_json or "{}")
    said = []
    for role in ("reflector", "notetaker", "manager", "worker"):
        output = (recorded.get(role) or {}).get("output")
        if output:
            said.append((role, json.dumps(output, ensure_ascii=False)))
    return said


def reason(units: list[TrustedEpisode], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Reasoning samples for `synth.reasoning_steps_per_shard` trusted steps of the shard."""
    out = StageOutput(rows={"reasoning_samples": [], "train_reasoning": []})
    cfg = ws.settings.synth
    if cfg.writer != "model":
        out.stats["synth.writer is template: no reasoning asked"] += len(units)
        return out
    reasoner = _Reasoner(ws, out, run_id)
    tag = ws.run_tag(run_id)
    for unit, index in spread(units, cfg.reasoning_steps_per_shard):
        step = unit.steps[index]
        history = past(unit.steps, index)
        roles = _roles(step)
        samples = _distill(reasoner, unit, step, roles) if roles else _sample(reasoner, unit, step, history)
        out.stats["steps tried"] += 1
        for sample in samples:
            out.rows["reasoning_samples"].append(sample)
            if not sample.kept:
                out.dropped[f"{sample.hint_style} reasoning rejected: {_rejection(sample.match_reason)}"] += 1
                continue
            out.stats[f"steps with an accepted reasoning: {sample.hint_style}"] += 1
            messages_json, images = policy_messages(instruction=unit.instruction, viewport=unit.viewport, step=step,
                                                    history=history, thought=sample.reasoning,
                                                    summary=action_text(step), blobs=ws.blobs)
            out.rows["train_reasoning"].append(ReasoningChat(
                run_id=run_id, sample_id=short_id(run_id, sample.reasoning_id), source_id=sample.reasoning_id,
                messages_json=messages_json, images=images, tag=tag, hint_style=sample.hint_style,
                hinted_with_answer=sample.hinted_with_answer, episode_id=step.episode_id))
    return out


def reasoning_summary(stats: dict[str, int]) -> str | None:
    """The share of tried steps that got an accepted reasoning, per hint style (None: no step tried)."""
    tried = stats.get("steps tried", 0)
    if not tried:
        return None
    prefix = "steps with an accepted reasoning: "
    shares = [f"{name.removeprefix(prefix)} {n / tried:.0%}" for name, n in sorted(stats.items())
              if name.startswith(prefix)]
    return f"{tried} trusted steps; accepted reasoning per hint style: {', '.join(shares) or 'none'}"


_MISSING = {"no point": "point missing", "no drop point": "drop point missing",
            "the trusted action has no point": "trusted action has no point"}
"""`synth.match`'s reasons that name no argument first, as lineage counts ('no differs' read as nonsense)."""


def _rejection(why: str) -> str:
    """A rejected sample's reason as a lineage count: what differed ('point differs', from `synth.match`), what was
    missing, or why there was nothing to compare, without its details ('no reasoning: no answer', 'prediction
    unusable')."""
    if why.startswith("no reasoning:"):
        return ":".join(why.split(":")[:2])
    if why.startswith("prediction unusable"):
        return "prediction unusable"
    return _MISSING.get(why, f"{why.split(' ')[0]} differs")


def _row(reasoner: _Reasoner, unit: TrustedEpisode, step: Step, style: str, attempt: int, answer: Answer,
         prompt: str, **result: Any) -> ReasoningSample:
    return ReasoningSample(
        run_id=reasoner.run_id, reasoning_id=short_id(reasoner.run_id, step.step_id, style, str(attempt)),
        step_id=step.step_id,
        episode_id=unit.episode_id, query_id=unit.query_id, trusted=unit.trusted, hint_style=style, attempt=attempt,
        reasoning=reasoning_text(answer)[0], raw_output=answer.text,
        trusted_action_json=json.dumps(trusted_action(step)),  # with its `type`, as predicted_action_json
        model_id=answer.model_id, prompt_version=prompt, **result)


def _sample(reasoner: _Reasoner, unit: TrustedEpisode, step: Step, history: list[str]) -> list[ReasoningSample]:
    """Each hint style's tries until one matches; the hinted call when none did."""
    cfg = reasoner.cfg
    space = actions.space_for(unit.viewport)
    screen = dict(platform=space, width=step.width, height=step.height, screenshots=_screen(step))
    trusted = trusted_action(step)
    rows: list[ReasoningSample] = []
    for style in cfg.hint_styles:
        name = f"reasoning_{style}"
        for attempt in range(cfg.reasoning_tries):
            said = reasoner.ask(name, seed=attempt, task=unit.instruction, history=history, **screen)
            versions = f"{reasoner.version(name)},{reasoner.version(ACT)}"
            reasoning, unusable = reasoning_text(said)
            if unusable:
                rows.append(_row(reasoner, unit, step, style, attempt, said, versions, matched=None, kept=False,
                                 hinted_with_answer=False, match_reason=unusable))
                continue
            act = reasoner.ask(ACT, reasoning=reasoning, tools=tool_spec(space), function=FUNCTIONS[space],
                               schema=ToolCall, json_schema=prediction_schema(space, step, cfg.points), **screen)
            predicted, why = predicted_action(act, FUNCTIONS[space])
            verdict = match(predicted, trusted, target_box=step.target_box, tolerance=cfg.match_tolerance_px) \
                if predicted is not None else None
            rows.append(_row(
                reasoner, unit, step, style, attempt, said, versions, predict_raw_output=act.text,
                predicted_action_json=json.dumps(predicted) if predicted is not None else None,
                matched=verdict.ok if verdict else None,  # None: an unusable prediction was not compared
                kept=bool(verdict and verdict.ok), hinted_with_answer=False,
                match_reason=verdict.reason if verdict else f"prediction unusable: {why}"))
            if verdict and verdict.ok:
                break
    if not any(r.kept for r in rows):
        said = reasoner.ask(HINTED, task=unit.instruction, history=history, action=action_text(step), **screen)
        unusable = reasoning_text(said)[1]
        rows.append(_row(reasoner, unit, step, "hinted", 0, said, reasoner.version(HINTED), matched=None,
                         kept=unusable is None, hinted_with_answer=True,
                         match_reason=unusable or "given the trusted action"))
    return rows


def _distill(reasoner: _Reasoner, unit: TrustedEpisode, step: Step, roles: list[tuple[str, str]]
             ) -> list[ReasoningSample]:
    """The roles' outputs (`_roles`, at least one) merged into one reasoning, paired with the worker's (executed)
    action."""
    said = reasoner.ask(DISTILL, task=unit.instruction, roles=roles, action=action_text(step),
                        platform=actions.space_for(unit.viewport), width=step.width, height=step.height,
                        screenshots=_screen(step))
    unusable = reasoning_text(said)[1]
    return [_row(reasoner, unit, step, "distilled", 0, said, reasoner.version(DISTILL), matched=None,
                 kept=unusable is None, hinted_with_answer=False, match_reason=unusable or "the roles' decision")]


# ---------------------------------------------------------------- the stage


STAGE = StageDef[Workspace, TrustedEpisode](
    name="reasoning",
    key=lambda u: u.unit_key,
    reads="steps",
    writes={"reasoning_samples": "append", "train_reasoning": "append"},
    sections=("synth", "llm"),
    once=True,
    # An episode done again (another configuration, code or prompt) takes its earlier rows out: a step once.
    replaces=("episode_id", lambda u: u.episode_id),
    load=load_trusted,
    run=reason,
    shard_size=lambda s: 50,
    summary=reasoning_summary,
)

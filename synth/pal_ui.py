"""PAL-UI teacher passes (pal-ui-active-lookback.md 3, 4.1, 4.3): trusted steps with a dual-level memory and an
optional look-back at an earlier screen.

A vision agent cannot carry every earlier screenshot (each costs hundreds of tokens and
small models reason badly over many images), so PAL-UI compresses the history into text
and gives the agent a `retrieve(step)` tool to see one earlier screenshot again. The
training data teaches when to look back. For a trusted step i (`synth.trusted`: a checked
reference replay, or an episode the critics accepted) with at least `pal_ui.min_step`
earlier steps:

- the memory m_i: for each earlier step j < i an observation caption of o_j
  (`pal_ui_caption`: what on the screen matters for the task) and an action validation
  (`pal_ui_validate`: what a_j did and whether it worked, from o_j and o_{j+1}); a step's
  memory is the same for every later step, so it is asked once (kept per shard, and the
  gateway caches identical calls across shards and nights);
- the teacher's four-stage deliberated look-back: one call (`pal_ui_teacher`) gives the
  history revision, the candidate actions, the confidence and the step j to retrieve
  (or none); a second (`pal_ui_act`) sees o_j added when one was asked for and gives the
  action as a function call, held to the action space's call schema.

The pass is kept when that action matches the trusted one (`synth.match`, the paper's
filter "discard any sample where the teacher's final action does not match"). Every pass
is a `pal_ui_teacher` row, rejected ones too, with why: a memory call that gave nothing,
a deliberation that did not parse, a retrieve index outside 0..i-1 (recorded, never
clamped), an unusable call, or the match reason. Balancing, weighting and the chat format
are the next stage's (`synth.pal_ui_sft`), which reads this table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from trajforge.envs import actions
from trajforge.llm import ImagePart
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, ToolCall, tool_spec
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import PalUITeacher
from trajforge.schemas.stage import StageDef, StageOutput
from trajforge.synth.ask import Answer, Asker
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

CAPTION, VALIDATE, TEACHER, ACT = "pal_ui_caption", "pal_ui_validate", "pal_ui_teacher", "pal_ui_act"

REVISION_CHARS, CANDIDATE_CHARS, CANDIDATES, CONFIDENCE_CHARS = 160, 80, 3, 120
"""Bounds on the deliberation while decoding: a small model given free strings fills them until max_tokens
cuts the object short, and the answer does not parse."""


class Deliberation(BaseModel):
    """The paper's stages 1 to 3 (history revision, candidate proposals, confidence evaluation) and the look-back
    they ask for: `retrieve` is the earlier step j to see again, None when the memory is enough."""

    model_config = ConfigDict(extra="forbid")
    history_revision: str
    candidates: list[str] = Field(min_length=1)
    confidence: str
    retrieve: StrictInt | None


def deliberation_schema(step: int) -> dict[str, Any]:
    """`Deliberation` as a JSON schema with bounded texts and `retrieve` among the earlier steps 0..step-1 (only
    null at step 0, which has none: `pal_ui.min_step` 0), for backends that constrain decoding; the strict parse
    and the range check still run on every answer, since a backend that cannot constrain may give any integer."""
    text = {"type": "string", "minLength": 1}
    earlier = [{"type": "integer", "minimum": 0, "maximum": step - 1}] if step > 0 else []
    return {"type": "object", "properties": {
        "history_revision": {**text, "maxLength": REVISION_CHARS},
        "candidates": {"type": "array", "items": {**text, "maxLength": CANDIDATE_CHARS}, "minItems": 1,
                       "maxItems": CANDIDATES},
        "confidence": {**text, "maxLength": CONFIDENCE_CHARS},
        "retrieve": {"anyOf": [*earlier, {"type": "null"}]}},
        "required": ["history_revision", "candidates", "confidence", "retrieve"], "additionalProperties": False}


@dataclass(frozen=True)
class Memo:
    """One earlier step's memory: the caption of its screen and the validation of its action, each with the
    model and `name@version` that wrote it, or why there is none."""

    step_index: int
    action: str
    caption: str
    caption_error: str | None
    caption_model: str
    caption_prompt: str
    validation: str
    validation_error: str | None
    validation_model: str
    validation_prompt: str
    screenshot: str
    width: int
    height: int


def memory_text(memory: list[dict[str, Any]]) -> str:
    """m_i as the teacher and the trained policy read it: one line per earlier step, numbered from 0 (the numbers
    `retrieve` takes)."""
    if not memory:
        return "None yet."
    return "\n".join(f"Step {m['step_index']}. Screen: {m['caption']} Action: {m['validation']}" for m in memory)


class _Teacher(Asker):
    """The model calls of one shard, with the run, the settings and the memory already asked for."""

    def __init__(self, ws: Workspace, out: StageOutput, run_id: str) -> None:
        self.run_id, self.cfg = run_id, ws.settings.synth
        self.memos: dict[str, Memo] = {}
        super().__init__(ws, out, (CAPTION, VALIDATE, TEACHER, ACT), model=self.cfg.model, role="pal_ui")

    def memo(self, unit: TrustedEpisode, index: int) -> Memo:
        """The caption and validation of the episode's step `index`, asked once per shard."""
        step = unit.steps[index]
        if step.step_id not in self.memos:
            before = ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before)
            after = ImagePart(sha256=step.screenshot_after, ax_tree=step.ax_tree_after)
            caption = self.ask(CAPTION, task=unit.instruction, screenshots=[before])
            validation = self.ask(VALIDATE, task=unit.instruction, action=action_text(step),
                                  screenshots=[before, after])
            self.memos[step.step_id] = Memo(
                index, action_text(step), caption.text.strip(), _failure(caption), caption.model_id,
                caption.prompt, validation.text.strip(), _failure(validation), validation.model_id,
                validation.prompt, step.screenshot_before, step.width, step.height)
        return self.memos[step.step_id]


def _failure(answer: Answer) -> str | None:
    """Why a text answer is no memory (None: it is one)."""
    return answer.error or (None if answer.text.strip() else "empty answer")


def teach(units: list[TrustedEpisode], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """A teacher pass for each of `pal_ui.steps_per_shard` trusted steps of the shard, and for more (up to
    `pal_ui.max_steps_per_shard`) while fewer than `pal_ui.min_kept` passes matched: a small teacher matches
    rarely, and a fixed budget left whole nights without a sample."""
    out = StageOutput(rows={"pal_ui_teacher": []})
    if ws.settings.synth.writer != "model":
        out.stats["synth.writer is template: no teacher asked"] += len(units)
        return out
    teacher = _Teacher(ws, out, run_id)
    cfg = ws.settings.pal_ui
    limit = cfg.max_steps_per_shard if cfg.steps_per_shard else 0
    for tried, (unit, index) in enumerate(spread(units, limit, cfg.min_step)):
        past_budget = tried >= cfg.steps_per_shard
        if past_budget and out.stats["passes kept"] >= cfg.min_kept:
            break
        row = _pass(teacher, unit, index)
        out.rows["pal_ui_teacher"].append(row)
        out.stats["steps tried"] += 1
        if past_budget:
            out.stats["steps tried past pal_ui.steps_per_shard, fewer than pal_ui.min_kept matched"] += 1
        if row.retrieved_step is not None:
            out.stats["passes that looked back"] += 1
        if row.kept:
            out.stats["passes kept"] += 1
            out.stats["passes kept that looked back"] += row.retrieved_step is not None
        else:
            out.dropped[f"teacher pass rejected: {reason_kind(row.match_reason)}"] += 1
    return out


def reason_kind(reason: str) -> str:
    """A rejection reason without its particulars, so that the lineage counts add up by kind."""
    for kind in ("memory incomplete", "deliberation unusable", "retrieve index out of range", "action unusable"):
        if reason.startswith(kind):
            return kind
    return f"action does not match ({reason.split(' ')[0]})"


def _pass(teacher: _Teacher, unit: TrustedEpisode, index: int) -> PalUITeacher:
    """One step's memory, deliberation, optional look-back and action, as a row whether kept or not."""
    step = unit.steps[index]
    memos = [teacher.memo(unit, j) for j in range(index)]
    memory = [asdict(m) for m in memos]
    space = actions.space_for(unit.viewport)
    trusted = trusted_action(step)
    screen = ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before)
    common = {"platform": space, "width": step.width, "height": step.height, "task": unit.instruction,
              "memory": memory_text(memory), "step": index}
    fields: dict[str, Any] = {
        "run_id": teacher.run_id, "sample_id": short_id(teacher.run_id, step.step_id), "step_id": step.step_id,
        "episode_id": unit.episode_id, "query_id": unit.query_id, "step_index": index, "trusted": unit.trusted,
        "checker": unit.checker, "instruction": unit.instruction, "viewport": unit.viewport,
        "screenshot": step.screenshot_before, "width": step.width, "height": step.height,
        "memory_json": json.dumps(memory), "trusted_action_json": json.dumps(trusted),
        "prompt_version": f"{teacher.version(TEACHER)},{teacher.version(ACT)}"}

    def rejected(reason: str, model_id: str, **more: Any) -> PalUITeacher:
        return PalUITeacher(**fields, teacher_raw_output=more.pop("teacher_raw_output", ""), matched=None,
                            kept=False, match_reason=reason, model_id=model_id, **more)

    missing = next(((m, part, err) for m in memos for part, err in (("caption", m.caption_error),
                                                                     ("validation", m.validation_error)) if err), None)
    if missing is not None:
        memo, part, error = missing
        return rejected(f"memory incomplete: the {part} of step {memo.step_index}: {error}",
                        memo.caption_model if part == "caption" else memo.validation_model)
    said = teacher.ask(TEACHER, schema=Deliberation, json_schema=deliberation_schema(index), screenshots=[screen],
                       **common)
    plan: Deliberation | None = said.parsed
    if plan is None:
        return rejected(f"deliberation unusable: {said.error or 'no answer'}", said.model_id,
                        teacher_raw_output=said.text)
    looked = {"teacher_raw_output": said.text, "deliberation_json": plan.model_dump_json()}
    j = plan.retrieve
    if j is not None and not 0 <= j < index:
        return rejected(f"retrieve index out of range: step {j} asked for at step {index}, which can look back at "
                        f"0 to {index - 1}", said.model_id, **looked)
    screens = [screen]
    if j is not None:
        back = unit.steps[j]
        screens.append(ImagePart(sha256=back.screenshot_before, ax_tree=back.ax_tree_before))
        looked |= {"retrieved_step": j, "retrieved_screenshot": back.screenshot_before, "distance": index - j}
    function = FUNCTIONS[space]
    act = teacher.ask(ACT, schema=ToolCall, json_schema=prediction_schema(space, step, teacher.cfg.points),
                      tools=tool_spec(space), function=function, revision=plan.history_revision,
                      candidates=plan.candidates, confidence=plan.confidence, retrieved=j, screenshots=screens,
                      **common)
    looked["act_raw_output"] = act.text
    predicted, why = predicted_action(act, function)
    if predicted is None:
        return rejected(f"action unusable: {why or 'no answer'}", act.model_id, **looked)
    verdict = match(predicted, trusted, target_box=step.target_box, tolerance=teacher.cfg.match_tolerance_px)
    return PalUITeacher(**fields, **looked, predicted_action_json=json.dumps(predicted), matched=verdict.ok,
                        kept=verdict.ok, match_reason=verdict.reason, model_id=act.model_id)


def pal_ui_summary(stats: dict[str, int]) -> str | None:
    """How many passes matched the trusted action, and how many of them looked back (None: no step tried)."""
    tried = stats.get("steps tried", 0)
    if not tried:
        return None
    kept, looked = stats.get("passes kept", 0), stats.get("passes kept that looked back", 0)
    return (f"{tried} trusted steps given a teacher pass; {kept} matched the trusted action ({kept / tried:.0%}), "
            f"{looked} of them after a look-back")


# ---------------------------------------------------------------- the stage


STAGE = StageDef[Workspace, TrustedEpisode](
    name="pal_ui",
    key=lambda u: u.unit_key,
    reads="steps",
    writes={"pal_ui_teacher": "append"},
    sections=("pal_ui", "synth", "llm"),
    once=True,
    # An episode done again (another configuration, code or prompt) takes its earlier passes out: a step once.
    replaces=("episode_id", lambda u: u.episode_id),
    load=load_trusted,
    run=teach,
    shard_size=lambda s: 50,
    summary=pal_ui_summary,
)

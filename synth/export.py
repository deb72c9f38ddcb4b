"""The end-to-end training table: accepted steps as Qwen2.5-VL chat samples (paper 2.1, 6.3).

One row per step of a trajectory the critics accepted whose step critique is GOOD or
NEUTRAL. The messages are those the policy is asked with (the gui_owl_e2e template: the
action space as a function in the system message, the task, the history and the newest
screenshot in the user message) and the assistant's answer is the step's thought and
the action as a `<tool_call>` of that function. The screenshots are embedded as PNG
bytes, so a fine-tuning job needs nothing but the Parquet files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.guidance.history import load_judged
from trajforge.llm import ImagePart, TextPart, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, PROMPT, to_call, tool_spec
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import Episode, Step, TrainingStep
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

KEPT_LABELS = ("GOOD", "NEUTRAL")


@dataclass(frozen=True)
class StepLabel:
    """The step critic's label and summary of one step."""

    label: str | None
    summary: str | None


@dataclass(frozen=True)
class ExportUnit:
    """A judged episode: its steps, the verdict, and the step critic's label of each step (None: not judged)."""

    episode: Episode
    steps: list[Step]
    success: bool
    labels: dict[str, StepLabel | None]


def export(units: list[ExportUnit], *, run_id: str, tag: str, blobs: BlobStore) -> StageOutput:
    """Training rows for accepted episodes; what is left out is counted by reason."""
    prompt = load_prompt(PROMPT)
    out = StageOutput(rows={"train_e2e": []}, prompts={PROMPT: prompt.version})
    for unit in units:
        if not unit.success:
            out.dropped["trajectory not accepted by the critics"] += 1
            continue
        history: list[str] = []
        for step in unit.steps:
            critique = unit.labels.get(step.step_id)
            label = critique.label if critique else None
            summary = (critique.summary if critique else None) or f"{step.action_type} {step.action_json}"
            if label not in KEPT_LABELS:
                out.dropped[f"step labelled {label or 'nothing'}: not a training step"] += 1
            elif not step.action_valid:
                out.dropped["invalid action: nothing to learn"] += 1
            else:
                out.rows["train_e2e"].append(_sample(unit.episode, step, label, summary, history,
                                                     run_id=run_id, tag=tag, blobs=blobs))
            history.append(summary)
    return out


def policy_messages(*, instruction: str, viewport: str, step: Step, history: list[str], thought: str, summary: str,
                    blobs: BlobStore) -> tuple[str, list[bytes]]:
    """A step as the policy is asked it (the gui_owl_e2e prompt: the task, the history, the screen before) with
    `thought`, `summary` and the step's action as the answer: (messages_json, the PNG of each image part).
    Every table that teaches the policy one step (train_e2e, train_reasoning) is made by this function."""
    prompt = load_prompt(PROMPT)
    space = actions.space_for(viewport)
    function = FUNCTIONS[space]
    rendered = prompt.render(
        platform=space, width=step.width, height=step.height, tools=tool_spec(space), function=function,
        task=instruction, guidance=None, history=list(history),
        screenshots=[ImagePart(sha256=step.screenshot_before)],
    )
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for message in rendered.messages:
        content: list[dict[str, str]] = []
        for part in message.content:
            if isinstance(part, ImagePart):
                images.append(blobs.get(part.sha256))
                content.append({"type": "image"})
            elif isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
        messages.append({"role": message.role, "content": content})
    call = to_call({"type": step.action_type, **json.loads(step.action_json)}, function)
    answer = (f"<thinking>{thought}</thinking>\n<conclusion>{summary}</conclusion>\n"
              f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return json.dumps(messages), images


def _sample(ep: Episode, step: Step, label: str, summary: str, history: list[str], *, run_id: str, tag: str,
            blobs: BlobStore) -> TrainingStep:
    messages_json, images = policy_messages(instruction=ep.instruction, viewport=ep.viewport, step=step,
                                            history=history, thought=step.thought, summary=summary, blobs=blobs)
    return TrainingStep(
        run_id=run_id, sample_id=short_id(run_id, step.step_id), step_id=step.step_id,
        episode_id=ep.episode_id, query_id=ep.query_id, label=label, messages_json=messages_json,
        images=images, tag=tag,
    )


# ---------------------------------------------------------------- the stage


def load_export_units(ws: Workspace, snapshot: int | None) -> Inputs[ExportUnit]:
    """Judged episodes of one verdicts version with their step critics' labels."""
    judged, snapshots, verdicts = load_judged(ws, snapshot)
    critiques_snapshot = ws.catalog.written_with("step_critiques", verdicts)
    critiques, _ = ws.catalog.rows_added("step_critiques", critiques_snapshot)
    labels = {r["step_id"]: StepLabel(r["label"], r["summary"])
              for r in critiques.select("step_id", "label", "summary").to_dicts()}
    units = [ExportUnit(u.episode, u.steps, ok, {s.step_id: labels.get(s.step_id) for s in u.steps})
             for u, ok in judged]
    return Inputs(units=units, snapshots=snapshots | {"step_critiques": critiques_snapshot})


def run_export(units: list[ExportUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    return export(units, run_id=run_id, tag=ws.run_tag(run_id), blobs=ws.blobs)


STAGE = StageDef[Workspace, ExportUnit](
    name="export",
    key=lambda u: u.episode.episode_id,
    reads="verdicts",
    writes={"train_e2e": "overwrite"},
    sections=("rollout",),
    load=load_export_units,
    run=run_export,
    shard_size=lambda s: 50,
)

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
from typing import Any

from trajforge.critics.steps import short_id
from trajforge.data.blobs import BlobStore
from trajforge.llm import ImagePart, TextPart, load_prompt
from trajforge.envs import actions
from trajforge.rollout.gui_owl import FUNCTIONS, PROMPT, to_call, tool_spec
from trajforge.schemas.records import TrainingStep
from trajforge.schemas.stage import StageOutput

KEPT_LABELS = ("GOOD", "NEUTRAL")


def export(units: list[dict[str, Any]], *, run_id: str, tag: str, blobs: BlobStore) -> StageOutput:
    """Training rows for accepted episodes; each unit is a judged episode's columns plus `success` (the
    verdict), `steps` and `labels` (step_id -> {label, summary} from the step critic). What is left out is
    counted by reason."""
    prompt = load_prompt(PROMPT)
    out = StageOutput(rows={"train_e2e": []}, prompts={PROMPT: prompt.version})
    for ep in units:
        if not ep["success"]:
            out.dropped["trajectory not accepted by the critics"] += 1
            continue
        space = actions.space_for(ep["viewport"])
        function = FUNCTIONS[space]
        history: list[str] = []
        for step in ep["steps"]:
            critique = ep["labels"].get(step["step_id"])
            label = critique["label"] if critique else None
            summary = (critique or {}).get("summary") or f"{step['action_type']} {step['action_json']}"
            if label not in KEPT_LABELS:
                out.dropped[f"step labelled {label or 'nothing'}: not a training step"] += 1
            elif not step["action_valid"]:
                out.dropped["invalid action: nothing to learn"] += 1
            else:
                out.rows["train_e2e"].append(_sample(ep, step, label, summary, history, prompt, space, function,
                                                     run_id=run_id, tag=tag, blobs=blobs))
            history.append(summary)
    return out


def _sample(ep: dict[str, Any], step: dict[str, Any], label: str, summary: str, history: list[str], prompt: Any,
            space: actions.Space, function: str, *, run_id: str, tag: str, blobs: BlobStore) -> TrainingStep:
    rendered = prompt.render(
        platform=space, width=step["width"], height=step["height"], tools=tool_spec(space), function=function,
        task=ep["instruction"], guidance=None, history=list(history),
        screenshots=[ImagePart(sha256=step["screenshot_before"])],
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
    call = to_call({"type": step["action_type"], **json.loads(step["action_json"])}, function)
    answer = (f"<thinking>{step['thought']}</thinking>\n<conclusion>{summary}</conclusion>\n"
              f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return TrainingStep(
        run_id=run_id, sample_id=short_id(run_id, step["step_id"]), step_id=step["step_id"],
        episode_id=ep["episode_id"], query_id=ep["query_id"], label=label, messages_json=json.dumps(messages),
        images=images, tag=tag,
    )

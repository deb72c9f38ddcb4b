"""The chat format every training table shares with `train_e2e`, and its one coordinate convention.

A sample is a list of Qwen2.5-VL chat messages, `[{role, content: [{type: text, text} |
{type: image}]}]`, with the PNG bytes of each `{type: image}` part in `images`, in message
order, so a fine-tuning job needs nothing but the Parquet files.

Coordinates: every point and box in a synthesis row and in a training answer is in pixels
of the screenshot as stored and as sent to the policy (x right, y down, origin at the
top-left corner), the convention of the policy's action space (`envs.actions`). A box is
[x, y, width, height]; a point is [x, y]. `train_grounding`'s answer is the policy's own
click call at the target's centre, so a grounding sample teaches the same output a
rollout step does.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.llm import ImagePart, RenderedPrompt, TextPart, load_prompt
from trajforge.rollout.gui_owl import FUNCTIONS, PROMPT, to_call, tool_spec
from trajforge.schemas.records import ChatSample, Step

C = TypeVar("C", bound=ChatSample)


def centre(box: list[float]) -> list[float]:
    """The centre [x, y] of an [x, y, w, h] box, rounded to a pixel (the answer a grounding row gives)."""
    x, y, w, h = box
    return [float(round(x + w / 2)), float(round(y + h / 2))]


def chat_sample(model: type[C], *, run_id: str, sample_id: str, source_id: str, system: str,
                turns: list[tuple[str, str]], images: list[bytes], tag: str, **columns: Any) -> C:
    """One training row: a system turn, then (user, assistant) turns; the first user turn shows the images,
    then its text. Several questions about one screenshot share one copy of it (a 60 KB PNG per row would
    dwarf the text: shared/FACTS.md). `columns` are the table's own further columns (`SemanticsChat.episode_id`)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    for i, (user, answer) in enumerate(turns):
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images] if i == 0 else []
        content.append({"type": "text", "text": user})
        messages += [{"role": "user", "content": content},
                     {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    return model(run_id=run_id, sample_id=sample_id, source_id=source_id, messages_json=json.dumps(messages),
                 images=images, tag=tag, **columns)


def chat_messages(rendered: RenderedPrompt, answer: str, blobs: BlobStore) -> tuple[str, list[bytes]]:
    """A rendered prompt and its answer as a chat sample: (messages_json, the PNG of each image part)."""
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
    messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return json.dumps(messages), images


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
    call = to_call({"type": step.action_type, **json.loads(step.action_json)}, function)
    return chat_messages(rendered, f"<thinking>{thought}</thinking>\n<conclusion>{summary}</conclusion>\n"
                                   f"<tool_call>\n{json.dumps(call)}\n</tool_call>", blobs)

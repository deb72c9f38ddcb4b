"""Model-written instructions for sampled tasks (paper 6.2, Mobile, steps 4-5).

A template instruction is correct but monotonous; a model, given the metadata of a
sampled path (the pages' descriptions and purposes, the slot values), writes a
constrained instruction, then rewrites it as the request a person would make. The
model may lose a slot on the way ("Order me a pizza" when the task needs a Large
Margherita Pizza), and a query whose instruction does not name its slots cannot be
checked against them, so the final text must contain every slot value, and must not ask
for a toggle the other way ("Turn off notifications on FreshCart" holds "on"); otherwise the
template instruction stands and the reason is counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, Field

from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway, Prompt, load_prompt
from trajforge.query_gen.sampling import TEMPLATE_GENERATOR, SampledTask

SYNTHESIS_PROMPT = "query_synthesis"
REFINE_PROMPT = "query_refine"


class InstructionAnswer(BaseModel):
    """What both prompts answer: one instruction."""

    instruction: str = Field(min_length=1)


@dataclass(frozen=True)
class Synthesis:
    """The instruction a query gets, what wrote it, and why the model's text was refused.

    `model_id` is the model that was asked (also when its text was refused); `raw` keeps
    its answers as they came (synthesis, then refinement), so a refused instruction can
    be read next to its reason.
    """

    instruction: str
    generator: str
    model_id: str
    fallback_reason: str | None
    raw: tuple[str, ...]


def task_metadata(spec: AppSpec, task: SampledTask) -> dict[str, object]:
    """The prompt variables of a task: its app, the pages along its path, its slots and goal."""
    return {
        "app": spec.title,
        "pages": [
            {"description": spec.pages[p].description, "purpose": spec.pages[p].purpose} for p in task.path
        ],
        "slots": dict(task.slots),
        "goal": task.instruction,
    }


def missing_slot(instruction: str, slots: dict[str, str]) -> str | None:
    """The first slot whose value the instruction does not contain (case-insensitive, whole words).

    Whole words, because a value such as "on" is inside almost every sentence.
    """
    for name, value in slots.items():
        if not re.search(rf"(?<!\w){re.escape(value)}(?!\w)", instruction, re.IGNORECASE):
            return name
    return None


TURNED_ON = r"(?<!\w)(turn|switch|toggle|set)\s+(?:(?!off\b)\w+\s+){0,3}?on(?!\w)"
"""An "on" that is the word after turn, switch, toggle or set, with at most three words between, none of them
"off" ("switch off notifications on FreshCart" asks for off)."""

STATE_ON = r"(?<!\w)on(?=\s*$|\s*[.,;:!?)]|\s+(?:in|for|at|within|inside|on|and|so|when|while|again)\b)"
"""An "on" that is a state ("are on", "keep them on for FreshCart"): one not followed by an object, as a
preposition is ("on FreshCart", "on sale")."""

OTHER_WAY = {
    "on": (r"(?<!\w)(off|disabl\w*|deactivat\w*)(?!\w)",),
    "off": (r"(?<!\w)(enabl|activat)\w*", TURNED_ON, STATE_ON),
}
"""A toggle slot's value -> the patterns of an instruction that asks for the other value."""


def flipped_toggle(instruction: str, slots: dict[str, str]) -> str | None:
    """The first toggle slot ("on" or "off") the instruction asks for the other way, or None.

    "off" almost never appears by accident, so for a slot that is "on" any whole word "off" is the other way
    ("Make sure order notifications are off"), as are disable and disabled. "on" is in almost every sentence
    ("... on FreshCart"), so the whole-word slot check passes "Turn off order notifications on FreshCart" for
    notifications=on; a slot that is "off" reads "on" as asked only after a toggling verb (`TURNED_ON`) or as a
    state (`STATE_ON`), and counts enable and enabled.
    """
    for name, value in slots.items():
        patterns = OTHER_WAY.get(value.casefold(), ())
        if any(re.search(pattern, instruction, re.IGNORECASE) for pattern in patterns):
            return name
    return None


class Synthesiser:
    """Asks one model of a gateway for the instructions of sampled tasks."""

    def __init__(self, gateway: Gateway, model: str | None = None) -> None:
        self.gateway = gateway
        self.model = model
        self.synthesis: Prompt = load_prompt(SYNTHESIS_PROMPT)
        self.refine: Prompt = load_prompt(REFINE_PROMPT)

    def generator(self, model_id: str) -> str:
        """The `Query.generator` of a model-written instruction: the model and both template versions."""
        return (f"{model_id}+{self.synthesis.name}@{self.synthesis.version}"
                f"+{self.refine.name}@{self.refine.version}")

    def __call__(self, spec: AppSpec, task: SampledTask) -> Synthesis:
        """Synthesise and refine the instruction of `task`, or keep its template with the reason.

        A call that gets no answer at all (GatewayError) is raised: that is a broken
        model setup, not a weak answer, and a stage must not quietly turn into templates.
        """
        slots = dict(task.slots)
        raw: list[str] = []
        first = self.gateway.chat_sync(self.synthesis.render(**task_metadata(spec, task)),
                                       model=self.model, schema=InstructionAnswer)
        raw.append(first.text)
        model_id = first.record.model_id
        if first.parsed is None:
            return self._template(task, model_id, "synthesised instruction did not parse", raw)
        second = self.gateway.chat_sync(self.refine.render(instruction=first.parsed.instruction),
                                        model=self.model, schema=InstructionAnswer)
        raw.append(second.text)
        if second.parsed is None:
            return self._template(task, model_id, "refined instruction did not parse", raw)
        final = second.parsed.instruction.strip()
        lost = missing_slot(final, slots)
        if lost is not None:
            return self._template(task, model_id, f"refined instruction dropped slot {lost!r}", raw)
        if (flipped := flipped_toggle(final, slots)) is not None:
            return self._template(task, model_id, f"refined instruction asks for slot {flipped!r} the other way", raw)
        return Synthesis(final, self.generator(model_id), model_id, None, tuple(raw))

    @staticmethod
    def _template(task: SampledTask, model_id: str, reason: str, raw: list[str]) -> Synthesis:
        return Synthesis(task.instruction, TEMPLATE_GENERATOR, model_id, reason, tuple(raw))

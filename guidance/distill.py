"""Guidance from reference trajectories (paper 6.4): describe, check, summarise.

For each step of a reference trajectory: describe the action's outcome from the screens
before and after it (the pre-action screenshot with the interaction point circled);
quality control compares the outcome with the step's stated rationale (its thought) and
drops steps that did not do what was intended; a model then summarises the steps that
remain into the query's guidance. Nothing is guessed: every dropped step keeps its
reason, and the guidance row names its references.

A text-only model cannot see the circled screenshot: the gateway gives it the OCR text
and accessibility tree of each screenshot instead, and the row's `observation_mode`
says so (as rollout steps do). The `template` describer asks no model: outcomes come
from the recorded title, URL and accessibility-tree changes.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from trajforge.critics.annotate import annotate
from trajforge.data.blobs import BlobStore
from trajforge.envs.axtree import parse, render
from trajforge.llm import Gateway, ImagePart, load_prompt
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import Guidance

PROMPTS = Path(__file__).parent / "prompts"
OUTCOME_PROMPT = "guidance_outcome"
SUMMARY_PROMPT = "guidance_summary"
POINTER_ACTIONS = {"click", "long_press", "double_click", "right_click", "middle_click", "swipe", "drag", "scroll"}
MOVES = {"swipe", "scroll"}
"""Pointer actions that move the screen rather than act on an element: the recorded target is whatever lies under
the finger or wheel, while the thought names the element to bring into view."""
_QUOTED = re.compile(r"'([^']+)'|\"([^\"]+)\"")


class Outcome(BaseModel):
    """The describer's answer for one step."""

    model_config = ConfigDict(extra="ignore")
    outcome: str
    as_intended: bool
    reason: str = ""


@dataclass
class Distilled:
    """What one query's references gave: kept outcomes, drops with reasons, and how they were made."""

    outcomes: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    observation_mode: str = "ax-diff"
    model_id: str = "template"

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1


def _names(ax_tree: str | None) -> list[str]:
    """The tree's elements as unindented lines without boxes (what a person reads of them);
    the page root is left out (its title change is told apart)."""
    return [render([replace(n, depth=0, box=None)]) for n in parse(ax_tree or "") if n.role != "RootWebArea"]


def _target(step: dict[str, Any]) -> str:
    if step.get("target_name") or step.get("target_role"):
        return f" on {step.get('target_role') or 'element'} '{step.get('target_name') or ''}'"
    return ""


def action_text(step: dict[str, Any]) -> str:
    """`click on button 'Cart'`, or the action's arguments when it had no target."""
    target = _target(step)
    return f"{step['action_type']}{target}" if target else f"{step['action_type']} {step['action_json']}"


def changes(step: dict[str, Any]) -> str:
    """What the recorded screens say changed: title, address, and elements that appeared."""
    parts = []
    if step.get("title_after") != step.get("title_before"):
        parts.append(f"the screen changed from '{step.get('title_before')}' to '{step.get('title_after')}'")
    elif step.get("url_after") != step.get("url_before"):
        parts.append(f"the address changed to {step.get('url_after')}")
    before = set(_names(step.get("ax_tree_before")))
    appeared = [n for n in dict.fromkeys(_names(step.get("ax_tree_after"))) if n not in before]
    if appeared:
        parts.append("now showing " + ", ".join(appeared[:3]))
    elif not parts and step.get("ax_tree_after") not in (None, step.get("ax_tree_before")):
        parts.append("the same elements moved or changed state (the page scrolled or updated)")
    return "; ".join(parts) or "nothing visible changed"


def rule_check(step: dict[str, Any]) -> str | None:
    """Why a step certainly did not do what its thought intended, from the record alone; None: no such sign."""
    kind = step["action_type"]
    if not step.get("action_valid", True):
        return "invalid action: it was not executed"
    if kind == "terminate":
        return "ends the episode: not a step toward the goal"
    if kind in POINTER_ACTIONS and changes(step) == "nothing visible changed":
        return "no visible change: the action did not do what the thought intended"
    named = [a or b for a, b in _QUOTED.findall(step.get("thought") or "")]
    acted_on = step.get("target_name") or ""
    if (kind in POINTER_ACTIONS - MOVES and named and acted_on
            and not any(n in acted_on or acted_on in n for n in named)):
        return f"the thought aimed at {', '.join(repr(n) for n in named)} but the action hit {acted_on!r}"
    return None


class Describer:
    """Describes and checks reference steps, then summarises them; `gateway` None is the template mode."""

    def __init__(self, gateway: Gateway | None, blobs: BlobStore, model: str | None = None) -> None:
        self.gateway = gateway
        self.blobs = blobs
        self.model = model
        self.outcome_prompt = load_prompt(OUTCOME_PROMPT, PROMPTS)
        self.summary_prompt = load_prompt(SUMMARY_PROMPT, PROMPTS)

    @property
    def prompt_version(self) -> str:
        if self.gateway is None:
            return "none"
        return f"{OUTCOME_PROMPT}@{self.outcome_prompt.version},{SUMMARY_PROMPT}@{self.summary_prompt.version}"

    def distill(self, instruction: str, references: list[tuple[str, list[dict[str, Any]]]]) -> Distilled:
        """Outcomes of every step of every (entry_id, steps) reference, each kept or dropped with a reason."""
        out = Distilled()
        for entry_id, steps in references:
            for step in steps:
                where = {"entry_id": entry_id, "step_index": step["step_index"]}
                outcome = changes(step)
                reason = rule_check(step)
                unparsed: dict[str, str] = {}
                if reason is None and self.gateway is not None:
                    outcome, reason, unparsed = self._ask(instruction, step, outcome, out)
                out.outcomes.append({**where, "action": action_text(step), "thought": step.get("thought") or "",
                                     "outcome": outcome, "kept": reason is None, **unparsed})
                if reason is not None:
                    out.dropped.append({**where, "reason": reason})
        return out

    def _ask(self, instruction: str, step: dict[str, Any], fallback: str, out: Distilled
             ) -> tuple[str, str | None, dict[str, str]]:
        """The model's description of one step and its judgement against the step's thought; where its answer did
        not parse, the rules' judgement stands and the outcome records the answer and why (the third value)."""
        assert self.gateway is not None
        if not step.get("screenshot_before") or not step.get("screenshot_after"):
            out.count("steps without screenshots: outcome from the recorded changes")
            return fallback, None, {}
        action = {"type": step["action_type"], **json.loads(step["action_json"])}
        drawn = annotate(self.blobs.get(step["screenshot_before"]), action, step.get("target_box"))
        before = self.blobs.put(drawn).sha256 if drawn is not None else step["screenshot_before"]
        rendered = self.outcome_prompt.render(
            task=instruction, action=action_text(step), thought=step.get("thought") or "(none)",
            screenshots=[ImagePart(sha256=before, ax_tree=step.get("ax_tree_before")),
                         ImagePart(sha256=step["screenshot_after"], ax_tree=step.get("ax_tree_after"))],
        )
        result = self.gateway.chat_sync(rendered, model=self.model, schema=Outcome)
        out.observation_mode, out.model_id = result.record.observation_mode, result.record.model_id
        if result.parsed is None:
            out.count("outcome answers that did not parse: recorded changes used, rules decided")
            return fallback, None, {"describer_raw": result.text, "describer_error": result.parse_error or ""}
        parsed: Outcome = result.parsed
        text = parsed.outcome.strip() or fallback
        if not parsed.as_intended:
            return text, f"the describer found it did not do what was intended: {parsed.reason.strip() or text}", {}
        return text, None, {}

    def summarise(self, instruction: str, essential: list[str], out: Distilled) -> str:
        """A short summary of the essential steps (the model's, or a fixed sentence in template mode)."""
        fallback = f"A successful attempt at '{instruction}' took {len(essential)} essential step(s)."
        if self.gateway is None:
            return fallback
        rendered = self.summary_prompt.render(task=instruction, steps=essential)
        result = self.gateway.chat_sync(rendered, model=self.model)
        out.model_id = result.record.model_id
        return result.text.strip() or fallback


def guidance_row(query: dict[str, Any], references: list[tuple[str, list[dict[str, Any]]]], hard_reason: str,
                 describer: Describer, *, run_id: str, max_steps: int) -> tuple[Guidance | None, Distilled]:
    """The query's guidance from its references; None when quality control kept no step of any."""
    capped = [(entry_id, steps[:max_steps]) for entry_id, steps in references]
    distilled = describer.distill(query["instruction"], capped)
    distilled.dropped += [{"entry_id": entry_id, "step_index": s["step_index"],
                           "reason": f"beyond guidance.max_reference_steps ({max_steps}): not looked at"}
                          for entry_id, steps in references for s in steps[max_steps:]]
    kept_by_entry: dict[str, list[str]] = {}
    for o in distilled.outcomes:
        if o["kept"]:
            kept_by_entry.setdefault(o["entry_id"], []).append(f"{o['action']}: {o['outcome']}")
    if not kept_by_entry:
        return None, distilled
    # The shortest successful route is the most essential: shortest by its own valid steps, before quality control
    # (ranked by the steps kept, the reference the describer rejected most would win, its guidance lacking steps
    # the route needs); of two as short, the one quality control dropped fewer steps of.
    own = {entry_id: sum(s.get("action_valid", True) and s["action_type"] != "terminate" for s in steps)
           for entry_id, steps in references}
    drops = Counter(d["entry_id"] for d in distilled.dropped)
    essential = kept_by_entry[min(kept_by_entry, key=lambda entry_id: (own[entry_id], drops[entry_id]))]
    summary = describer.summarise(query["instruction"], essential, distilled)
    numbered = "\n".join(f"{i}. {s}" for i, s in enumerate(essential, 1))
    row = Guidance(
        run_id=run_id, guidance_id=short_id(run_id, query["query_id"], "guidance"), query_id=query["query_id"],
        instruction=query["instruction"], text=f"{summary}\nEssential steps:\n{numbered}", essential_steps=essential,
        references=[entry_id for entry_id, _ in references], dropped_steps_json=json.dumps(distilled.dropped),
        outcomes_json=json.dumps(distilled.outcomes), describer=distilled.model_id,
        prompt_version=describer.prompt_version, observation_mode=distilled.observation_mode, hard_reason=hard_reason,
    )
    return row, distilled

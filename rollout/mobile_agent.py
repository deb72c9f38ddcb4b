"""Mobile-Agent-v3 (paper section 7, Algorithm 1) as a rollout policy.

Four roles share one gateway: the Manager plans subgoals (and updates the plan after
every step), the Worker grounds the top subgoal into one action, the Reflector judges
the last action from the screens before and after it, and the Notetaker keeps what
later screens will need (only after a successful action). The Reflector needs the
screen after the action, which is the next observation, so each `act` first reflects
on the previous action, then notes, re-plans and acts. The episode ends with
`terminate` success when the Manager leaves no pending subgoal.

Every role's inputs and outputs (raw and parsed) go into the step's `roles`, so a
step row shows why the team did what it did. A role whose answer does not parse is
recorded with its error; the team carries on with what it had (the old plan, no
notes), and a Worker failure is an invalid step.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trajforge.envs import actions
from trajforge.envs.browser import Observation
from trajforge.llm import CallRecord, Gateway, ImagePart, load_prompt
from trajforge.llm.calls import ChatResult
from trajforge.rollout.gui_owl import FUNCTIONS, ToolCall, action_lines, call_schema, to_action
from trajforge.rollout.policy import Draw, PolicyOutput
from trajforge.schemas.records import Query


# Each role's answer is parsed strictly: a key it does not define (`"verdict": "FAILURE"` beside the outcome)
# is a parse error recorded on the step, not ignored while the rest feeds a role table.
class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    thought: str = ""
    completed_subgoals: list[str] = Field(default_factory=list)
    pending_subgoals: list[str]


class WorkerAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    thought: str = ""
    action: dict[str, Any]
    summary: str = ""


class Reflection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["SUCCESS", "FAILURE"]
    feedback: str = ""


class Notes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    notes: list[str]


ROLES = ("manager", "worker", "reflector", "notetaker")


class MobileAgentPolicy:
    """Manager, Worker, Reflector and Notetaker over the model gateway."""

    name = "mobile_agent_v3"

    def __init__(self, gateway: Gateway, *, viewport: str, model: str | None = None,
                 guidance: dict[str, str] | None = None, knowledge: Callable[[str], str] | None = None,
                 draw: Draw | None = None) -> None:
        """`knowledge` is the retrieval hook (paper 7.2.1): instruction -> text for the Manager; `draw`
        samples every role (None: each prompt's greedy decoding)."""
        self.gateway = gateway
        self.draw = draw
        self.model = model
        self.space = actions.space_for(viewport)
        self.guidance = guidance or {}
        self.knowledge = knowledge
        self.prompts = {role: load_prompt(f"mobile_agent_{role}") for role in ROLES}
        self._actions = "\n".join(action_lines(self.space))
        self._model_id = model or "local"
        self.reset_state("", None)

    def reset_state(self, task: str, guidance: str | None) -> None:
        self._task, self._guidance, self._knowledge = task, guidance, ""
        self._pending: list[str] = []
        self._completed: list[str] = []
        self._notes: list[str] = []
        self._last: tuple[Observation, dict[str, Any], str] | None = None  # screen, action, summary
        self._feedback = ""

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def prompt_version(self) -> str:
        return ",".join(f"mobile_agent_{r}@{p.version}" for r, p in self.prompts.items())

    def reset(self, query: Query) -> None:
        self.reset_state(query.instruction, self.guidance.get(query.query_id))
        if self.knowledge is not None:
            self._knowledge = self.knowledge(query.instruction)

    def _ask(self, role: str, schema: type[BaseModel], screens: list[Observation], record: dict[str, Any],
             calls: list[CallRecord], json_schema: dict[str, Any] | None = None, **variables: Any) -> Any:
        images = [ImagePart(png=o.png, ax_tree=o.ax_tree) for o in screens]
        rendered = self.prompts[role].render(task=self._task, screenshots=images, **variables)
        result: ChatResult[Any] = self.gateway.chat_sync(
            rendered, model=self.model, schema=schema, sampling=self.draw.of(rendered.sampling) if self.draw else None,
            json_schema=json_schema,
        )
        self._model_id = result.record.model_id
        calls.extend(result.calls)
        record[role] = {
            # a copy: the team's notes and plan go on changing after this call (the Notetaker's own answer is
            # added to the list it was shown), and the step keeps what the role was asked
            "inputs": copy.deepcopy({k: v for k, v in variables.items() if k not in ("actions",)}),
            "raw_output": result.text,
            "output": result.parsed.model_dump() if result.parsed is not None else None,
            "parse_error": result.parse_error,
        }
        return result.parsed

    def _worker_schema(self, width: int, height: int) -> dict[str, Any]:
        """The Worker's answer with its `action` held to GUI-Owl's call, one branch per action type with
        exactly its arguments and points on the screen (`call_schema`), as the end-to-end policy's is."""
        schema = WorkerAnswer.model_json_schema()
        schema["properties"]["action"] = call_schema(self.space, width, height)["properties"]["arguments"]
        return schema

    def act(self, observation: Observation, env: Any) -> PolicyOutput:
        roles: dict[str, Any] = {}
        calls: list[CallRecord] = []
        outcome = ""
        if self._last is not None:
            before, action, summary = self._last
            reflection = self._ask("reflector", Reflection, [before, observation], roles, calls,
                                   action=json.dumps(action), summary=summary)
            outcome = reflection.outcome if reflection else "UNKNOWN"
            self._feedback = reflection.feedback if reflection else ""
            if reflection is not None and reflection.outcome == "SUCCESS":
                notes = self._ask("notetaker", Notes, [observation], roles, calls, notes=self._notes)
                if notes is not None:
                    self._notes.extend(n for n in notes.notes if n not in self._notes)
        plan = self._ask(
            "manager", Plan, [observation], roles, calls, knowledge=self._knowledge, guidance=self._guidance,
            completed=self._completed, pending=self._pending,
            last_action=json.dumps(self._last[1]) if self._last else "", outcome=outcome, feedback=self._feedback,
            notes=self._notes,
        )
        if plan is not None:
            self._pending, self._completed = plan.pending_subgoals, plan.completed_subgoals
            if not self._pending:
                self._last = None
                action = {"type": "terminate", "status": "success"}
                return PolicyOutput(action, plan.thought or "The Manager has no pending subgoal.",
                                    roles["manager"]["raw_output"], calls=tuple(calls), roles=roles)
        answer = self._ask(
            "worker", WorkerAnswer, [observation], roles, calls,
            json_schema=self._worker_schema(observation.width, observation.height),
            platform=self.space, width=observation.width,
            height=observation.height, actions=self._actions, pending=self._pending[:3], feedback=self._feedback,
            notes=self._notes,
        )
        action: dict[str, Any] = {}
        error = roles["worker"]["parse_error"]
        if answer is not None:
            try:
                action = to_action(ToolCall(name=FUNCTIONS[self.space], arguments=answer.action), FUNCTIONS[self.space])
            except ValueError as exc:
                error = str(exc)
        self._last = (observation, action, answer.summary if answer else "")
        return PolicyOutput(action, answer.thought if answer else "", roles["worker"]["raw_output"],
                            calls=tuple(calls), error=error, roles=roles)

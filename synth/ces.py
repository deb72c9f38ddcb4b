"""CES datasets (ces-coordinator-executor-state-tracker.md, 4.2, 4.3, A.1, A.2, B.1): a Coordinator and a State
Tracker trained by the feedback of a frozen Executor.

CES splits a GUI agent into three roles: the Coordinator turns the task q, the task state
m^{t-1} and the screen s^t into one atomic instruction l^t; the frozen Executor turns l^t and
s^t into an action; the State Tracker, a language model that never sees the screen, writes
the next state m^t from q, m^{t-1} and the Executor's output u^t. From trusted steps
(`synth.trusted`) this stage writes both roles' warm-up SFT tables and their RL groups.

Silver states. The paper's states come from GUI-Odyssey's annotated `context`; we have no
annotation, so for each chosen episode the State Tracker prompt runs greedily along the
trusted steps, m^t = pi_s(q, m^{t-1}, u^t) from m^{-1} = `START`, with u^t the step's thought
and action in words. These states are model-made and flagged `silver`; where the model's
answer is unusable, the trusted actions so far in words stand in (not silver, and no State
Tracker SFT row is made of it).

SFT (B.1): the Coordinator learns (s^t, q, m^{t-1}) -> <think>the step's thought (a reference
replay's: the template reason, `thought`)</think>
<answer>the trusted atomic instruction</answer> (`atomic_instruction`, our stand-in for
GUI-Odyssey's low_level_instruction); the State Tracker learns (q, u^t, m^{t-1}) -> m^t.

RL (A.1): for up to `ces.steps_per_shard` trusted steps, N = `ces.group_size` sampled outputs
per role, each scored by the Executor's action at the step (`execution_reward`, eq. 21-25):
Stage 1 samples instructions from the Coordinator given the silver m^{t-1}; Stage 2 samples
states m^{t-1} from the State Tracker given (q, silver m^{t-2}, u^{t-1}) and passes each
through the frozen Coordinator (greedy) to the Executor at step t. Step 0 has no earlier step
and no Stage-2 group. Each step also measures the Executor alone: given the trusted
instruction (the ceiling a Coordinator can reach) and given the raw task (the floor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trajforge.data.blobs import BlobCorrupted, BlobMissing
from trajforge.envs import actions
from trajforge.llm import ImagePart
from trajforge.llm.structured import ParseError, ThinkAnswer, parse
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, ToolCall, tool_spec
from trajforge.schemas.config import CESSettings
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import (
    CESChat,
    CESCoordinatorChat,
    CESCoordinatorGroup,
    CESStateTrackerChat,
    CESStateTrackerGroup,
    Step,
)
from trajforge.schemas.stage import StageDef, StageOutput
from trajforge.synth.ask import Answer, Asker
from trajforge.synth.chat import chat_messages
from trajforge.synth.match import match
from trajforge.synth.semantics import action_text
from trajforge.synth.trusted import (
    TrustedEpisode,
    group_advantages,
    load_trusted,
    predicted_action,
    prediction_schema,
    trusted_action,
)

COORDINATOR, EXECUTOR, TRACKER = "ces_coordinator", "ces_executor", "ces_state_tracker"
START = "Nothing has been done yet."
"""m^{-1}: the state before the first step (the paper gives none)."""


# ---------------------------------------------------------------- the rules


def tagged(output: str) -> ThinkAnswer | None:
    """CheckFormat of CES eq. 22, and the parse that goes with it: `llm.structured`'s `think_answer` format (the
    whole output is <think>...</think> then <answer>...</answer>, no tag inside either, a non-empty answer), so
    what is rewarded is what is passed on. None: the format is broken (R_format 0, nothing to pass on)."""
    try:
        return parse(output, "think_answer", ThinkAnswer)
    except ParseError:
        return None


@dataclass(frozen=True)
class Reward:
    """One candidate's execution-feedback reward and its parts (CES eq. 21-25)."""

    format: float
    type: float
    param: float
    execution: float
    total: float


def execution_reward(cfg: CESSettings, *, format_ok: bool, type_ok: bool, param_ok: bool) -> Reward:
    """R = alpha_format R_format + alpha_exec R_exec, R_exec = gamma_type R_type + gamma_param R_param (eq. 21, 23).
    R_param needs the right type (eq. 25 checks the parameters the trusted type has; `synth.match` fails a wrong
    type), so a wrong type with a lucky point scores no parameter reward. A candidate the executor never saw
    (format broken) passes type_ok = param_ok = False."""
    r_format, r_type = float(format_ok), float(type_ok)
    r_param = float(type_ok and param_ok)
    r_exec = cfg.gamma_type * r_type + cfg.gamma_param * r_param
    return Reward(r_format, r_type, r_param, r_exec, cfg.alpha_format * r_format + cfg.alpha_exec * r_exec)


def _quote(name: str | None) -> str:
    return f" '{name}'" if name else ""


def atomic_instruction(step: Step) -> tuple[str, str]:
    """(instruction, reason): the trusted action as the one-line command a Coordinator should give, from its type,
    arguments and target ("Click the link 'Cart'", "Type 'milk' into the textbox 'Search'", "Scroll down", "Go
    back"). It stands in for GUI-Odyssey's human `low_level_instruction` (CES B.1): the SFT answer, and the
    ceiling instruction the Executor is measured with. No coordinates where a target is named: a Coordinator
    says what to act on, the Executor finds where."""
    action = trusted_action(step)
    kind = actions.normalize(action).get("type")
    target = f"the {step.target_role or 'element'}{_quote(step.target_name)}" if step.target_name else None
    at = target or f"the element at [{action.get('x', 0):.0f}, {action.get('y', 0):.0f}]"
    verbs = {"click": "Click", "long_press": "Long-press", "double_click": "Double-click",
             "right_click": "Right-click", "middle_click": "Middle-click", "mouse_move": "Move the pointer to"}
    buttons = {"Back": "Go back", "Home": "Go to the home screen", "Menu": "Open the menu", "Enter": "Press Enter"}
    if kind in verbs:
        text = f"{verbs[kind]} {at}"
    elif kind == "type":
        text = f"Type '{action.get('text', '')}'" + (f" into {target}" if target else "")
    elif kind == "key":
        keys = action.get("keys") or [action.get("key", "")]
        text = f"Press the {'+'.join(map(str, keys))} key" + (f" in {target}" if target else "")
    elif kind == "scroll":
        dy, dx = float(action.get("dy", 0)), float(action.get("dx", 0))
        way = ("down" if dy > 0 else "up") if abs(dy) >= abs(dx) else ("right" if dx > 0 else "left")
        text = f"Scroll {way}" + (f" in {target}" if target else "")
    elif kind in ("swipe", "drag"):
        dx, dy = float(action["x2"]) - float(action["x"]), float(action["y2"]) - float(action["y"])
        way = ("down" if dy > 0 else "up") if abs(dy) >= abs(dx) else ("right" if dx > 0 else "left")
        text = f"Swipe {way}" if kind == "swipe" else f"Drag {at} {way}"
    elif kind == "system_button":
        text = buttons.get(str(action.get("button")), f"Press the {action.get('button')} button")
    elif kind == "open":
        text = f"Open the app '{action.get('text', '')}'"
    elif kind == "answer":
        text = f"Answer '{action.get('text', '')}'"
    elif kind == "wait":
        text = "Wait for the screen to change"
    elif kind == "terminate":
        text = "Stop: the task is done" if action.get("status") == "success" else "Stop: the task cannot be done"
    else:
        text = f"Do {kind}" + (f" on {target}" if target else "")
    return text, f"The task needs this next: {text[0].lower()}{text[1:]}."


def thought(unit: TrustedEpisode, step: Step) -> str:
    """The step's reason as the CES roles read and learn it: the policy's thought, or for a reference replay the
    template reason (`atomic_instruction`). A replay's thought is its label ("transition 2/3 (search -> dish),
    action 1/3: click the link 'Pad Thai'."): taught to think it, a Coordinator would think in the app spec's page
    ids (`synth.export` keeps such thoughts out of its consistency check for the same reason)."""
    return atomic_instruction(step)[1] if unit.trusted == "reference" else step.thought.strip()


def executor_output(unit: TrustedEpisode, step: Step) -> str:
    """u^t of a trusted step: its thought and its action in words (CES eq. 2), what the State Tracker reads."""
    return f"{thought(unit, step)} Action: {action_text(step)}".strip()


def _fallback_state(steps: list[Step], upto: int) -> str:
    """The actions of steps 0..upto as instructions: the state when the model's was unusable. An invalid action
    was not carried out, so it is not done ("Do " of nothing); a valid one the step critic called HARMFUL was,
    and the screen after it shows it, so it stays."""
    done = [atomic_instruction(s)[0] for s in steps[: upto + 1] if s.action_valid]
    return "Done so far: " + "; ".join(done) + "." if done else START


# ---------------------------------------------------------------- the model calls


@dataclass(frozen=True)
class Silver:
    """m^t for one trusted step: the state, the tracker's raw answer, and whether the model wrote it."""

    state: str
    think: str
    raw: str
    silver: bool


@dataclass(frozen=True)
class Execution:
    """The frozen executor given one instruction at one step: its answer, its action and how it compares."""

    raw: str
    action: dict[str, Any] | None
    type_ok: bool
    param_ok: bool
    reason: str
    model_id: str


class _CES(Asker):
    """The model calls of one shard (every role is the configured synthesis model), with what the rows need."""

    def __init__(self, ws: Workspace, out: StageOutput, run_id: str) -> None:
        self.run_id, self.cfg, self.synth = run_id, ws.settings.ces, ws.settings.synth
        super().__init__(ws, out, (COORDINATOR, EXECUTOR, TRACKER), model=self.synth.model, role="ces")

    def execute(self, unit: TrustedEpisode, step: Step, instruction: str) -> Execution:
        """The executor's action for `instruction` on the step's screen (greedy, held to the call schema),
        compared with the trusted action: R_type by type, R_param by `synth.match` (CES eq. 24-25)."""
        space = actions.space_for(unit.viewport)
        function = FUNCTIONS[space]
        said = self.ask(EXECUTOR, instruction=instruction, tools=tool_spec(space), function=function, schema=ToolCall,
                        json_schema=prediction_schema(space, step, self.synth.points), **_screen(space, step))
        predicted, why = predicted_action(said, function)
        if predicted is None:
            return Execution(said.text, None, False, False, f"executor gave no usable call: {why}", said.model_id)
        trusted = trusted_action(step)
        type_ok = actions.normalize(predicted).get("type") == actions.normalize(trusted).get("type")
        verdict = match(predicted, trusted, target_box=step.target_box, tolerance=self.synth.match_tolerance_px)
        return Execution(said.text, predicted, type_ok, verdict.ok, verdict.reason, said.model_id)

    def coordinate(self, unit: TrustedEpisode, step: Step, state: str, seed: int | None = None) -> Answer:
        """One coordinator output at the step given `state`: sampled with `seed`, greedy without."""
        space = actions.space_for(unit.viewport)
        return self.ask(COORDINATOR, seed=seed, temperature=None if seed is None else self.cfg.temperature,
                        schema=ThinkAnswer, reask=seed is None, task=unit.instruction, state=state,
                        **_screen(space, step))

    def track(self, unit: TrustedEpisode, step: Step, state: str, seed: int | None = None) -> Answer:
        """One state tracker output: the state after `step` from the state before it."""
        return self.ask(TRACKER, seed=seed, temperature=None if seed is None else self.cfg.temperature,
                        schema=ThinkAnswer, reask=seed is None, task=unit.instruction,
                        executor_output=executor_output(unit, step), state=state)

    def silver_states(self, unit: TrustedEpisode) -> list[Silver]:
        """m^0 .. m^{L-1} along the trusted steps, greedy, each from the one before (m^{-1} = START). An invalid
        action was not carried out: the state after it is the state before it, as in `_fallback_state`."""
        states: list[Silver] = []
        previous = START
        for index, step in enumerate(unit.steps):
            if not step.action_valid:
                self.out.stats["silver states after an invalid action: the state before it carried over"] += 1
                states.append(_before(states, index))
                continue
            said = self.track(unit, step, previous)
            parsed = tagged(said.text) if said.error is None else None
            if parsed is None:
                self.out.stats["silver states the model could not write (trusted actions stand in)"] += 1
                states.append(Silver(_fallback_state(unit.steps, index), "", said.text, False))
            else:
                self.out.stats["silver states"] += 1
                states.append(Silver(parsed.answer, parsed.think, said.text, True))
            previous = states[-1].state
        return states


def _screen(space: str, step: Step) -> dict[str, Any]:
    return {"platform": space, "width": step.width, "height": step.height,
            "screenshots": [ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before)]}


def _before(states: list[Silver], index: int) -> Silver:
    """m^{index-1}: the state a step starts from (START, not silver, before the first)."""
    return states[index - 1] if index > 0 else Silver(START, "", "", False)


def _prompt(c: _CES, name: str, **variables: Any) -> tuple[str, list[bytes]]:
    """A prompt as chat messages without an answer, with the PNG of each image: what an RL trainer replays."""
    messages_json, images = chat_messages(c.prompts[name].render(**variables), "", c.ws.blobs)
    return json.dumps(json.loads(messages_json)[:-1]), images


def _choose(units: list[TrustedEpisode], budget: int) -> list[tuple[TrustedEpisode, int]]:
    """Up to `budget` imitable trusted steps (`TrustedEpisode.imitable`) spread over the episodes: each episode's
    steps in an order a hash of their ids fixes (the paper samples GUI-Odyssey steps at random; a hash keeps a
    rerun's choice, and so its cache), step 0 last, then the first of every episode before the second of any. Step 0
    gives a coordinator group but no state-tracker group (it has no earlier step): drawn first, as on 2026-12-01's
    default night (a budget of one step), it left `ces_state_tracker_rl` without a row."""
    ranked = []
    for unit in units:
        valid = sorted((i for i in range(len(unit.steps)) if unit.imitable(i)),
                       key=lambda i, steps=unit.steps: (i == 0, digest(steps[i].step_id)))
        ranked += [(rank, unit.episode_id, unit, i) for rank, i in enumerate(valid)]
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [(unit, i) for _, _, unit, i in ranked[:budget]]


# ---------------------------------------------------------------- the groups


def _scored(c: _CES, unit: TrustedEpisode, step: Step, role: str, formats: list[bool],
            instructions: list[str | None]) -> dict[str, Any]:
    """The executor's action for each candidate's instruction and the group's rewards, as row fields; a candidate
    without an instruction is not executed (R_exec 0). Counts the role's rewards and zero-variance groups."""
    executions = [c.execute(unit, step, i) if i is not None else None for i in instructions]
    rewards = [execution_reward(c.cfg, format_ok=f, type_ok=bool(e and e.type_ok), param_ok=bool(e and e.param_ok))
               for f, e in zip(formats, executions, strict=True)]
    totals = [r.total for r in rewards]
    zero = len(set(totals)) == 1
    c.out.stats[f"{role} groups"] += 1
    c.out.stats[f"{role} candidates"] += len(totals)
    c.out.stats[f"{role} reward x1000"] += round(sum(totals) * 1000)
    c.out.stats[f"{role} zero-variance groups"] += zero
    c.out.stats[f"{role} candidates with a broken format"] += formats.count(False)
    return {
        "executor_outputs": [e.raw if e else None for e in executions],
        "executor_actions": [json.dumps(e.action) if e and e.action is not None else None for e in executions],
        # A state tracker's candidate can be well-formed and still reach no executor: the frozen coordinator's answer
        # to it did not parse.
        "reasons": [e.reason if e else ("the frozen coordinator gave no instruction for this state: nothing for the "
                                        "executor" if f else "format broken: no instruction for the executor")
                    for f, e in zip(formats, executions, strict=True)],
        "format_rewards": [r.format for r in rewards], "type_rewards": [r.type for r in rewards],
        "param_rewards": [r.param for r in rewards], "exec_rewards": [r.execution for r in rewards],
        "rewards": totals,
        "advantages": group_advantages(totals), "zero_variance": zero,
        "executor_model_id": next((e.model_id for e in executions if e), ""),
    }


def _common(c: _CES, unit: TrustedEpisode, step: Step, role: str) -> dict[str, Any]:
    return {"run_id": c.run_id, "group_id": short_id(c.run_id, step.step_id, role), "step_id": step.step_id,
            "episode_id": unit.episode_id, "query_id": unit.query_id, "step_index": step.step_index,
            "trusted": unit.trusted, "checker": unit.checker, "trusted_action_json": json.dumps(trusted_action(step)),
            "target_box": step.target_box}


def _answers(said: list[Answer | None]) -> list[ThinkAnswer | None]:
    """Each answer in the CES format, None where it is not (or where there was no answer, or no call)."""
    return [tagged(a.text) if a is not None and a.error is None else None for a in said]


def coordinator_group(c: _CES, unit: TrustedEpisode, index: int, states: list[Silver], *, ceiling: Execution,
                      floor: Execution) -> CESCoordinatorGroup:
    """Stage 1 (CES eq. 9-12): N instructions sampled (seed k) given (s^t, q, silver m^{t-1}), each executed."""
    step, state = unit.steps[index], _before(states, index)
    space = actions.space_for(unit.viewport)
    said = [c.coordinate(unit, step, state.state, seed=k) for k in range(c.cfg.group_size)]
    parsed = _answers(said)
    instructions = [p.answer if p else None for p in parsed]
    messages_json, images = _prompt(c, COORDINATOR, task=unit.instruction, state=state.state, **_screen(space, step))
    return CESCoordinatorGroup(
        **_common(c, unit, step, "coordinator"), messages_json=messages_json, images=images, state_input=state.state,
        state_input_silver=state.silver, responses=[a.text for a in said], instructions=instructions,
        **_scored(c, unit, step, "coordinator", [p is not None for p in parsed], instructions),
        ceiling_ok=ceiling.param_ok, floor_ok=floor.param_ok, model_id=said[0].model_id,
        prompt_versions=f"{c.version(COORDINATOR)},{c.version(EXECUTOR)}")


def state_tracker_group(c: _CES, unit: TrustedEpisode, index: int, states: list[Silver]) -> CESStateTrackerGroup:
    """Stage 2 (CES eq. 15-19), step t = index >= 1: N states m^{t-1} sampled (seed k) given (q, silver m^{t-2},
    u^{t-1}); each through the frozen coordinator (greedy) and the frozen executor at step t. R_format is the
    state's own format; a state or an instruction that is not there reaches no executor (R_exec 0)."""
    step, earlier, state = unit.steps[index], unit.steps[index - 1], _before(states, index - 1)
    space = actions.space_for(unit.viewport)
    said = [c.track(unit, earlier, state.state, seed=k) for k in range(c.cfg.group_size)]
    candidates = [p.answer if p else None for p in _answers(said)]
    coordinated = [c.coordinate(unit, step, m) if m is not None else None for m in candidates]
    instructions = [p.answer if p else None for p in _answers(coordinated)]
    messages_json, images = _prompt(c, TRACKER, task=unit.instruction, executor_output=executor_output(unit, earlier),
                                    state=state.state)
    _, step_images = _prompt(c, COORDINATOR, task=unit.instruction, state=state.state, **_screen(space, step))
    return CESStateTrackerGroup(
        **_common(c, unit, step, "state_tracker"), messages_json=messages_json, images=images,
        state_input=state.state, state_input_silver=state.silver, responses=[a.text for a in said],
        states=candidates, coordinator_outputs=[a.text if a else None for a in coordinated], instructions=instructions,
        step_images=step_images,
        **_scored(c, unit, step, "state tracker", [m is not None for m in candidates], instructions),
        model_id=said[0].model_id,
        prompt_versions=f"{c.version(TRACKER)},{c.version(COORDINATOR)},{c.version(EXECUTOR)}")


# ---------------------------------------------------------------- SFT


def _sft(c: _CES, unit: TrustedEpisode, states: list[Silver], tag: str, out: StageOutput) -> None:
    """Both roles' warm-up samples (CES B.1) for every imitable step of the episode: an invalid action has no
    instruction to teach, and a HARMFUL one is no example; both stay in the states of the steps after them."""
    space = actions.space_for(unit.viewport)
    for index, step in enumerate(unit.steps):
        if not unit.imitable(index):
            why = ("an invalid action" if not step.action_valid else "labelled HARMFUL by the step critic"
                   if step.step_id in unit.harmful else "it changed nothing: pre-filter no_change")
            out.dropped[f"SFT: step not imitated ({why})"] += 1
            continue
        before, after = _before(states, index), states[index]
        instruction, reason = atomic_instruction(step)
        messages_json, images = chat_messages(
            c.prompts[COORDINATOR].render(task=unit.instruction, state=before.state, **_screen(space, step)),
            f"<think>{thought(unit, step) or reason}</think><answer>{instruction}</answer>", c.ws.blobs)
        out.rows["ces_coordinator_sft"].append(_chat(CESCoordinatorChat, c, step, unit, "coordinator", messages_json,
                                                     images, tag, before.silver))
        if not after.silver:
            out.dropped["state tracker SFT: the model's state was unusable"] += 1
            continue
        messages_json, images = chat_messages(
            c.prompts[TRACKER].render(task=unit.instruction, executor_output=executor_output(unit, step),
                                      state=before.state),
            f"<think>{after.think}</think><answer>{after.state}</answer>", c.ws.blobs)
        out.rows["ces_state_tracker_sft"].append(_chat(CESStateTrackerChat, c, step, unit, "state_tracker",
                                                       messages_json, images, tag, True))


def _chat(model: type[CESChat], c: _CES, step: Step, unit: TrustedEpisode, role: str, messages_json: str,
          images: list[bytes], tag: str, silver: bool) -> CESChat:
    return model(run_id=c.run_id, sample_id=short_id(c.run_id, step.step_id, role, "sft"), source_id=step.step_id,
                 messages_json=messages_json, images=images, tag=tag, step_id=step.step_id,
                 episode_id=unit.episode_id, silver=silver)


# ---------------------------------------------------------------- the stage


TABLES = ("ces_coordinator_rl", "ces_coordinator_sft", "ces_state_tracker_rl", "ces_state_tracker_sft")


def _readable(ws: Workspace, steps: list[Step]) -> str | None:
    """Why a step's screenshot cannot be shown (missing or corrupt blob), None when every one can."""
    for step in steps:
        try:
            ws.blobs.get(step.screenshot_before)
        except (BlobMissing, BlobCorrupted) as exc:
            return f"screenshot blob {type(exc).__name__.removeprefix('Blob').lower()}"
    return None


def ces(units: list[TrustedEpisode], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Silver states, SFT samples and RL groups for `ces.steps_per_shard` trusted steps of the shard."""
    out = StageOutput(rows={t: [] for t in TABLES})
    if ws.settings.synth.writer != "model":
        out.stats["synth.writer is template: no CES samples asked"] += len(units)
        return out
    c = _CES(ws, out, run_id)
    tag = ws.run_tag(run_id)
    chosen = _choose(units, c.cfg.steps_per_shard)
    silver: dict[str, list[Silver]] = {}
    for unit, index in chosen:
        if unit.episode_id not in silver:
            problem = _readable(ws, unit.steps)
            if problem is not None:
                out.dropped[f"episode skipped: {problem}"] += 1
                silver[unit.episode_id] = []
                continue
            silver[unit.episode_id] = c.silver_states(unit)
            _sft(c, unit, silver[unit.episode_id], tag, out)
        states = silver[unit.episode_id]
        if not states:
            continue
        step = unit.steps[index]
        out.stats["steps scored"] += 1
        ceiling = c.execute(unit, step, atomic_instruction(step)[0])
        floor = c.execute(unit, step, unit.instruction)
        out.stats["executor success given the trusted instruction"] += ceiling.param_ok
        out.stats["executor success given the task"] += floor.param_ok
        out.rows["ces_coordinator_rl"].append(coordinator_group(c, unit, index, states, ceiling=ceiling, floor=floor))
        if index == 0:
            out.stats["state tracker: step 0 has no earlier step"] += 1
            continue
        out.rows["ces_state_tracker_rl"].append(state_tracker_group(c, unit, index, states))
    return out


def ces_summary(stats: dict[str, int]) -> str | None:
    """Mean reward and the share of zero-variance groups per role, and the executor's success given the trusted
    instruction (ceiling) and given the task (floor); None: no step scored."""
    steps = stats.get("steps scored", 0)
    if not steps:
        return None
    parts = []
    for role in ("coordinator", "state tracker"):
        groups, candidates = stats.get(f"{role} groups", 0), stats.get(f"{role} candidates", 0)
        if groups and candidates:
            parts.append(f"{role} mean reward {stats.get(f'{role} reward x1000', 0) / 1000 / candidates:.2f} over "
                         f"{groups} groups, {stats.get(f'{role} zero-variance groups', 0) / groups:.0%} zero-variance")
    ceiling = stats.get("executor success given the trusted instruction", 0)
    floor = stats.get("executor success given the task", 0)
    parts.append(f"executor success given the trusted instruction {ceiling}/{steps} (ceiling), given the task "
                 f"{floor}/{steps} (floor)")
    return f"{steps} trusted steps; " + "; ".join(parts)


STAGE = StageDef[Workspace, TrustedEpisode](
    name="ces",
    key=lambda u: u.unit_key,
    reads="steps",
    writes={t: "append" for t in TABLES},
    sections=("ces", "synth", "llm"),
    once=True,
    # An episode done again (another configuration, code or prompt) takes its earlier rows out: a step once.
    replaces=("episode_id", lambda u: u.episode_id),
    load=load_trusted,
    run=ces,
    shard_size=lambda s: 50,
    summary=ces_summary,
)

"""The CES stage on one recorded run: silver states, both roles' SFT samples and their RL groups.

One module-scoped warehouse: the notes app's reference demonstrations (real browser, real
app), then the stage run with a model endpoint scripted at the edge. The scripted State
Tracker counts steps ("2 steps done"), the scripted Coordinator reads that count to give the
demonstrated step's instruction (or, by seed, a wrong one or one without tags), and the
scripted Executor carries out the instructions it knows.
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import prompt_version, prompt_versions
from scripted import ScriptedServer, completion, message_text, notes_workspace
from starlette.requests import Request
from starlette.responses import Response
from test_trusted import made, made_reference

from trajforge.guidance.reference import STAGE as REFERENCE
from trajforge.llm.structured import ThinkAnswer
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.rollout.gui_owl import to_call
from trajforge.schemas.config import CESSettings, Settings
from trajforge.schemas.records import Episode, Step, StepCritique
from trajforge.schemas.stage import StageOutput
from trajforge.synth import ces
from trajforge.synth.match import match
from trajforge.synth.trusted import TrustedEpisode, group_advantages, spread, trusted_action
from trajforge.tasks.runner import run_inline

pytestmark = pytest.mark.browser

CORNER = "Tap the corner"
"""The wrong instruction: the scripted executor clicks the screen's top-left corner for it."""


class CESServer(ScriptedServer):
    """An OpenAI-compatible endpoint playing the three CES roles; its answer depends on the prompt and the seed."""

    def __init__(self) -> None:
        super().__init__()
        self.instructions: dict[tuple[str, int], str] = {}  # (task, steps done) -> the demonstrated instruction
        self.actions: dict[tuple[str, str], dict[str, Any]] = {}  # (instruction, screen size) -> the action
        self.same = False  # every sample gives the right answer (a group that teaches nothing)
        self.broken_tracker = False  # the state tracker never answers in its format

    def answer(self, system: str, user: str, seed: int | None) -> str:
        if "GUI task State Tracker Agent" in system:
            previous = re.search(r"^Previous Task State: (.*)$", user, re.MULTILINE).group(1)
            done = 0 if previous == ces.START else int(previous.split()[0])
            if self.broken_tracker:
                return "The state is fine."
            if seed == 1 and not self.same:
                return f"<think>lost count</think><answer>{done + 50} steps done</answer>"
            if seed == 2 and not self.same:
                return f"{done + 1} steps done"
            return f"<think>one more step</think>\n<answer>{done + 1} steps done</answer>"
        if "GUI task coordinator Agent" in system:
            task = re.search(r"^High-level task: (.*)$", user, re.MULTILINE).group(1)
            state = re.search(r"^Current_state: (.*)$", user, re.MULTILINE).group(1)
            done = 0 if state == ces.START or state.startswith("Done so far") else int(state.split()[0])
            right = self.instructions.get((task, done), CORNER)
            if seed == 1 and not self.same:
                return f"<think>somewhere</think><answer>{CORNER}</answer>"
            if seed == 2 and not self.same:
                return f"I would say: {right}"
            return f"<think>the next step</think><answer>{right}</answer>"
        if "GUI executor Agent" in system:
            instruction = re.search(r"execute the command '(.*)'\.$", user, re.MULTILINE).group(1)
            function = re.search(r'"name": "(\w+)"', system).group(1)
            size = re.search(r"screen of (\d+x\d+) pixels", system).group(1)
            action = self.actions.get((instruction, size)) or (
                {"type": "click", "x": 0, "y": 0} if instruction == CORNER else {"type": "wait"})
            return json.dumps(to_call(action, function))
        raise AssertionError(f"unexpected prompt: {system[:80]}")

    def asked(self, role: str) -> list[str]:
        """The user texts of the requests whose system prompt names `role`."""
        return [message_text(r["body"]["messages"][-1]) for r in self.requests
                if role in message_text(r["body"]["messages"][0])]

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"body": body})
        return completion(self.answer(message_text(body["messages"][0]), message_text(body["messages"][-1]),
                                      body.get("seed")))


@pytest.fixture(scope="module")
def model():
    with CESServer() as server:
        yield server


def workspace(root: Path, url: str, *, cache: bool = True, **settings: Any) -> Workspace:
    return notes_workspace(root, url, cache=cache, synth={"writer": "model"}, ces={"steps_per_shard": 100} | settings)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, chromium, model):
    """A run's reference demonstrations of the notes app, and the run id (as `recorded` in test_synth.py); the
    scripted server learns each demonstrated step's instruction and action."""
    root = tmp_path_factory.mktemp("ces")
    ws = workspace(root, model.url)
    run = ws.ledger.open_run("test", "ces").run_id
    queries = run_inline(QUERY_GEN, ws, run)["queries"]
    snapshots = run_inline(REFERENCE, ws, run, queries)
    for unit in ces.load_trusted(ws, snapshots["steps"]).units:
        for step in unit.steps:
            instruction = ces.atomic_instruction(step)[0]
            model.instructions[(unit.instruction, step.step_index)] = instruction
            model.actions[(instruction, f"{step.width}x{step.height}")] = trusted_action(step)
    return root, run, snapshots


@pytest.fixture(scope="module")
def scored(recorded, model):
    """The stage over every valid step of the two shortest episodes (one desktop, one mobile), without the response
    cache (so calls can be counted): (units, output, the requests it made)."""
    root, _, snapshots = recorded
    ws = workspace(root, model.url, cache=False)
    units = sorted(ces.load_trusted(ws, snapshots["steps"]).units, key=lambda u: (len(u.steps), u.viewport))[:2]
    before = len(model.requests)
    out = ces.ces(units, ws, ws.ledger.open_run("test", "scored").run_id, "")
    return units, out, model.requests[before:]


def _step(kind: str, args: dict[str, Any], role: str | None = None, name: str | None = None) -> Step:
    return Step(run_id="r", step_id="s", episode_id="e", step_index=0, screenshot_before="a" * 64,
                screenshot_after="b" * 64, width=390, height=844, url_before="u", url_after="u", title_before="t",
                title_after="t", ax_tree_before="", action_type=kind, action_json=json.dumps(args), action_valid=True,
                target_role=role, target_name=name, thought="", raw_output="", duration_ms=0)


def test_the_steps_scored_are_later_steps_before_any_step_0():
    """Step 0 gives no state-tracker group, so a budget of one step per episode draws a later step of each episode
    that has one (the hash order put step 0 first in some of these 20), and step 0 only of an episode without."""
    click = _step("click", {"x": 5, "y": 9}, "link", "Cart")

    def episode(name: str, length: int) -> TrustedEpisode:
        steps = [click.model_copy(update={"step_id": f"{name}:{i}", "episode_id": name, "step_index": i})
                 for i in range(length)]
        return TrustedEpisode(name, "q", "task", "mobile", "reference", steps)

    units = [episode(f"e{n}", 3) for n in range(20)] + [episode("short", 1)]
    chosen = ces._choose(units, len(units))
    assert sorted(unit.episode_id for unit, _ in chosen) == sorted(u.episode_id for u in units)
    assert {index for unit, index in chosen if unit.episode_id != "short"} <= {1, 2}
    assert [index for unit, index in chosen if unit.episode_id == "short"] == [0]


def test_a_step_the_step_critic_labelled_harmful_is_history_not_a_target(tmp_path):
    """An accepted episode's step whose latest step critique is HARMFUL (judged again: the latest label wins) and its
    invalid step stay in the episode, for the states after them, but no stage is taught either: no scored step, no
    SFT row, each counted; the fallback state lists what was carried out."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, synth={"writer": "model"}))
    png = made_reference(ws, 4)
    steps = [_step("click", {"x": 5, "y": 9}, "link", "Cart").model_copy(update={
        "run_id": "made", "step_id": f"e:{i}", "episode_id": "e", "step_index": i, "screenshot_before": png,
        "screenshot_after": png}) for i in range(4)]
    steps[3] = steps[3].model_copy(update={"action_type": "fly", "action_json": "{}", "action_valid": False})
    snapshot = ws.catalog.commit_rows("steps", steps, made("steps"))
    for n, labels in enumerate(({"e:1": "GOOD", "e:2": "HARMFUL"}, {"e:1": "HARMFUL", "e:2": "GOOD"})):
        ws.catalog.commit_rows("step_critiques", [StepCritique(
            run_id=f"critics{n}", critique_id=f"{step}:{n}", step_id=step, episode_id="e", critic="c", model_id="m",
            prompt_version="1", analysis="", summary="", label=label, raw_output="")  # type: ignore[arg-type]
            for step, label in labels.items()], made(f"critiques{n}", f"critics{n}"))
    inputs = ces.load_trusted(ws, snapshot)
    [unit] = inputs.units
    assert unit.harmful == {"e:1"} and len(unit.steps) == 4
    assert inputs.snapshots["step_critiques"] == ws.catalog.resolve("step_critiques@latest")[1]
    assert inputs.stats["trusted steps labelled HARMFUL by the step critic: history only, not imitated"] == 1
    assert [i for _, i in spread([unit], 10)] == [0, 2] and sorted(i for _, i in ces._choose([unit], 10)) == [0, 2]
    out = StageOutput(rows={t: [] for t in ces.TABLES})
    states = [ces.Silver(f"{i + 1} steps done", "one more", "", True) for i in range(4)]
    ces._sft(ces._CES(ws, out, "r"), unit, states, "t", out)
    assert [r.step_id for r in out.rows["ces_coordinator_sft"]] == ["e:0", "e:2"]
    assert [r.step_id for r in out.rows["ces_state_tracker_sft"]] == ["e:0", "e:2"]
    assert out.dropped == {"SFT: step not imitated (labelled HARMFUL by the step critic)": 1,
                           "SFT: step not imitated (an invalid action)": 1}
    idle = dataclasses.replace(unit, harmful=frozenset(), no_change=frozenset({"e:1"}))
    out = StageOutput(rows={t: [] for t in ces.TABLES})
    ces._sft(ces._CES(ws, out, "r"), idle, states, "t", out)
    assert out.dropped["SFT: step not imitated (it changed nothing: pre-filter no_change)"] == 1
    assert ces._fallback_state(steps, 3) == "Done so far: " + "; ".join(["Click the link 'Cart'"] * 3) + "."


def test_a_policy_episode_is_trusted_by_the_critics_latest_verdict(tmp_path):
    """Judged again, an episode is trusted as the latest verdict says: accepted then rejected is not trusted
    (the first verdict, read last from a scan, used to decide), rejected then accepted is."""
    from trajforge.schemas.records import Verdict

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    now = datetime(2026, 12, 5, tzinfo=UTC)
    episodes = [Episode(run_id="made", episode_id=e, query_id="q", app="notes", instruction="task",
                        policy="gui_owl_e2e", model_id="m", prompt_version="1", viewport="mobile",
                        status="terminated", num_steps=1, final_url="u", final_state_json="{}", started_at=now,
                        finished_at=now, source="policy") for e in ("flipped-out", "flipped-in")]
    ws.catalog.commit_rows("episodes", episodes, made("episodes"))
    steps = [_step("click", {"x": 5, "y": 9}, "link", "Cart").model_copy(update={
        "run_id": "made", "step_id": f"{e.episode_id}:0", "episode_id": e.episode_id}) for e in episodes]
    snapshot = ws.catalog.commit_rows("steps", steps, made("steps"))
    for n, accepted in enumerate(({"flipped-out"}, {"flipped-in"})):
        ws.catalog.commit_rows("verdicts", [Verdict(
            run_id=f"critics{n}", verdict_id=f"{e.episode_id}:{n}", episode_id=e.episode_id, query_id="q",
            success=e.episode_id in accepted, consensus="checker_first", channels_json="{}", reason="r",
            config_hash="x") for e in episodes], made(f"verdicts{n}", f"critics{n}"))
    inputs = ces.load_trusted(ws, snapshot)
    assert [u.episode_id for u in inputs.units] == ["flipped-in"]
    assert inputs.stats["not trusted: policy episode not accepted by the critics"] == 1


def test_an_invalid_action_leaves_the_silver_state_as_it_was(tmp_path, model):
    """An invalid action was not carried out: the silver state after it is the one before it (the tracker is not
    asked about it), as the trusted-actions fallback leaves it out; the next valid step counts on from there."""
    ws = workspace(tmp_path, model.url, cache=False)
    steps = [_step("click", {"x": 5, "y": 9}, "link", "Cart").model_copy(update={"step_id": f"e:{i}", "step_index": i})
             for i in range(3)]
    steps[1] = steps[1].model_copy(update={"action_type": "fly", "action_json": "{}", "action_valid": False})
    unit = TrustedEpisode("e", "q", "task", "mobile", "reference", steps)
    out = StageOutput(rows={t: [] for t in ces.TABLES})
    before = len(model.asked("GUI task State Tracker Agent"))
    states = ces._CES(ws, out, "r").silver_states(unit)
    assert [s.state for s in states] == ["1 steps done", "1 steps done", "2 steps done"]
    assert len(model.asked("GUI task State Tracker Agent")) - before == 2
    assert out.stats["silver states after an invalid action: the state before it carried over"] == 1
    assert ces._fallback_state(steps, 1) == "Done so far: Click the link 'Cart'."


def test_a_state_the_frozen_coordinator_gave_no_instruction_for_is_not_called_a_broken_format(tmp_path):
    """Stage 2: a well-formed state (R_format 1) whose frozen coordinator's answer did not parse reaches no
    executor; its reason says so, and only a state that did not parse is called a broken format."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, synth={"writer": "model"}))
    step = _step("click", {"x": 5, "y": 9}, "link", "Cart")
    out = StageOutput(rows={t: [] for t in ces.TABLES})
    row = ces._scored(ces._CES(ws, out, "r"), TrustedEpisode("e", "q", "task", "mobile", "reference", [step]), step,
                      "state tracker", [True, False], [None, None])
    assert row["format_rewards"] == [1.0, 0.0] and row["exec_rewards"] == [0.0, 0.0]
    assert row["reasons"] == ["the frozen coordinator gave no instruction for this state: nothing for the executor",
                              "format broken: no instruction for the executor"]


# ---------------------------------------------------------------- the rules, by hand


def test_the_execution_feedback_reward_on_hand_worked_numbers():
    cfg = CESSettings()  # alpha 0.1 / 0.9, gamma 0.2 / 0.8 (paper B.2)
    total = lambda **k: ces.execution_reward(cfg, **k).total
    assert total(format_ok=True, type_ok=True, param_ok=True) == pytest.approx(1.0)
    assert total(format_ok=True, type_ok=True, param_ok=False) == pytest.approx(0.1 + 0.9 * 0.2)  # 0.28
    assert total(format_ok=True, type_ok=False, param_ok=False) == pytest.approx(0.1)
    assert total(format_ok=True, type_ok=False, param_ok=True) == pytest.approx(0.1)  # a wrong type earns no param
    assert total(format_ok=False, type_ok=False, param_ok=False) == 0.0
    parts = ces.execution_reward(cfg, format_ok=True, type_ok=True, param_ok=False)
    assert (parts.format, parts.type, parts.param, parts.execution) == (1.0, 1.0, 0.0, pytest.approx(0.2))
    # mean 0.57; deviations .43, -.29, -.57, .43; population std sqrt(.7788 / 4) = 0.44125
    assert group_advantages([1.0, 0.28, 0.0, 1.0]) == pytest.approx([0.9745, -0.6572, -1.2918, 0.9745], abs=1e-3)
    assert group_advantages([0.28] * 4) == [0.0] * 4


def test_the_format_is_exactly_think_then_answer():
    assert ces.tagged("<think>a</think>\n<answer>Click 'Save'</answer>\n") == ThinkAnswer(think="a", answer="Click 'Save'")
    assert ces.tagged("<think></think><answer>b</answer>") == ThinkAnswer(think="", answer="b")
    for broken in ("Click 'Save'", "<answer>b</answer>", "<think>a</think>", "so: <think>a</think><answer>b</answer>",
                   "<think>a</think><answer>b</answer> and more", "<answer>b</answer><think>a</think>",
                   "<think>a</think><answer> </answer>", "<think>a</think><answer>b</answer><answer>c</answer>"):
        assert ces.tagged(broken) is None, broken


def test_the_trusted_atomic_instruction_names_the_target_not_the_point():
    assert ces.atomic_instruction(_step("click", {"x": 5, "y": 9}, "link", "Cart"))[0] == "Click the link 'Cart'"
    assert ces.atomic_instruction(_step("type", {"text": "milk"}, "textbox", "Search"))[0] == \
        "Type 'milk' into the textbox 'Search'"
    assert ces.atomic_instruction(_step("scroll", {"x": 5, "y": 9, "dy": 300}))[0] == "Scroll down"
    assert ces.atomic_instruction(_step("system_button", {"button": "Back"}))[0] == "Go back"
    text, reason = ces.atomic_instruction(_step("key", {"key": "Enter"}))
    assert text == "Press the Enter key" and reason == "The task needs this next: press the Enter key."


# ---------------------------------------------------------------- the stage


def test_coordinator_groups_score_each_instruction_through_the_executor(scored):
    units, out, requests = scored
    groups = out.rows["ces_coordinator_rl"]
    steps = {s.step_id: s for u in units for s in u.steps if s.action_valid}
    assert sorted(g.step_id for g in groups) == sorted(steps) and {g.trusted for g in groups} == {"reference"}
    for g in groups:
        step = steps[g.step_id]
        right = ces.atomic_instruction(step)[0]
        assert g.instructions == [right, CORNER, None, right]
        # seed 2 answered without tags: R_format 0, the executor never asked, R 0.
        assert g.executor_outputs[2] is None and g.executor_actions[2] is None
        assert g.format_rewards == [1.0, 1.0, 0.0, 1.0]
        corner = match({"type": "click", "x": 0, "y": 0}, trusted_action(step), target_box=step.target_box)
        wrong = 0.1 + 0.9 * (0.2 * (step.action_type == "click") + 0.8 * corner.ok)
        assert g.rewards == pytest.approx([1.0, wrong, 0.0, 1.0])
        assert g.advantages == pytest.approx(group_advantages(g.rewards)) and not g.zero_variance
        assert g.advantages[0] > 0 > g.advantages[2]
        assert g.ceiling_ok and not g.floor_ok
        assert json.loads(g.trusted_action_json) == trusted_action(step)
        messages = json.loads(g.messages_json)
        assert [m["role"] for m in messages] == ["system", "user"] and len(g.images) == 1
        assert g.prompt_versions == prompt_versions("ces_coordinator", "ces_executor") and g.model_id == "scripted"
    assert any(g.rewards[1] == pytest.approx(0.28) for g in groups)  # a click step missed: type right, point not
    # The executor: the ceiling and the floor per step, then each instruction a candidate gave (3 of 4 per group).
    tracker = out.rows["ces_state_tracker_rl"]
    assert len(_asked(requests, "GUI executor Agent")) == len(groups) * (2 + 3) + len(tracker) * 3


def _asked(requests: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [r for r in requests if role in message_text(r["body"]["messages"][0])]


def test_state_tracker_groups_exist_for_every_step_after_the_first(scored):
    units, out, _ = scored
    groups = out.rows["ces_state_tracker_rl"]
    later = {g.step_id for g in out.rows["ces_coordinator_rl"] if g.step_index > 0}
    assert {g.step_id for g in groups} == later and later
    for g in groups:
        t = g.step_index
        # sampled from the silver m^{t-2}: "t-1 steps done" (the start state for t = 1)
        assert g.state_input == (ces.START if t == 1 else f"{t - 1} steps done")
        assert g.state_input_silver == (t > 1)
        assert g.states == [f"{t} steps done", f"{t + 49} steps done", None, f"{t} steps done"]
        assert g.coordinator_outputs[2] is None and g.executor_outputs[2] is None
        assert g.instructions[1] == CORNER and g.instructions[0] == g.instructions[3] != CORNER
        assert g.rewards[0] == g.rewards[3] == pytest.approx(1.0) and g.rewards[2] == 0.0
        assert not g.zero_variance and g.images == [] and len(g.step_images) == 1
        assert g.prompt_versions == prompt_versions("ces_state_tracker", "ces_coordinator", "ces_executor")
    assert out.stats["state tracker: step 0 has no earlier step"] == len(units)


def test_sft_rows_carry_the_silver_states_and_the_trusted_instruction(scored):
    units, out, _ = scored
    coordinator, tracker = out.rows["ces_coordinator_sft"], out.rows["ces_state_tracker_sft"]
    steps = {s.step_id: s for u in units for s in u.steps}
    assert len(coordinator) == len(tracker) == len(steps) and all(row.silver for row in tracker)
    for row in coordinator:
        step = steps[row.step_id]
        messages = json.loads(row.messages_json)
        assert row.silver == (step.step_index > 0) and len(row.images) == 1
        # A reference replay's thought is its label ("transition 1/2 (home -> note), action 1/1: ..."), page ids
        # and all: the template reason is what it teaches.
        instruction, reason = ces.atomic_instruction(step)
        assert step.thought.strip() != reason
        assert messages[-1]["content"][0]["text"] == f"<think>{reason}</think><answer>{instruction}</answer>"
        state = ces.START if step.step_index == 0 else f"{step.step_index} steps done"
        assert f"Current_state: {state}\n" in messages[1]["content"][-1]["text"]
    for row in tracker:
        messages = json.loads(row.messages_json)
        assert messages[-1]["content"][0]["text"] == \
            f"<think>one more step</think><answer>{steps[row.step_id].step_index + 1} steps done</answer>"
        # u^t, what the State Tracker reads: the template reason and the action, not the replay's label
        user = messages[1]["content"][-1]["text"]
        assert "Latest output of executor agent: The task needs this next: " in user
        assert steps[row.step_id].thought.strip() not in user


def test_the_stage_through_the_runner_counts_rewards_ceiling_and_floor_and_names_the_prompts(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url, steps_per_shard=2)
    out = run_inline(ces.STAGE, ws, run, snapshots["steps"])
    assert len(ws.catalog.load("ces_coordinator_rl", out["ces_coordinator_rl"])) == 2
    lineage = ws.catalog.lineage("ces_coordinator_rl", out["ces_coordinator_rl"])
    assert lineage.prompts == {n: prompt_version(n) for n in ("ces_coordinator", "ces_executor", "ces_state_tracker")}
    assert lineage.stats["steps scored"] == 2 and lineage.stats["coordinator candidates"] == 8
    assert lineage.stats["executor success given the trusted instruction"] == 2
    assert lineage.stats["executor success given the task"] == 0
    assert lineage.stats["coordinator zero-variance groups"] == 0
    summary = ces.ces_summary(lineage.stats)
    assert summary.startswith("2 trusted steps; coordinator mean reward ")
    assert "given the trusted instruction 2/2 (ceiling), given the task 0/2 (floor)" in summary


def test_a_group_of_identical_answers_is_flagged_zero_variance(recorded, model):
    root, _, snapshots = recorded
    ws = workspace(root, model.url, cache=False, steps_per_shard=2)
    units = ces.load_trusted(ws, snapshots["steps"]).units
    model.same = True
    try:
        out = ces.ces(units, ws, ws.ledger.open_run("test", "same").run_id, "")
    finally:
        model.same = False
    groups = out.rows["ces_coordinator_rl"] + out.rows["ces_state_tracker_rl"]
    assert len(out.rows["ces_coordinator_rl"]) == 2
    assert all(g.zero_variance and g.advantages == [0.0] * 4 and g.rewards == [1.0] * 4 for g in groups)
    assert out.stats["coordinator zero-variance groups"] == 2


def test_a_state_the_tracker_cannot_write_is_replaced_by_the_trusted_actions_and_not_taught(recorded, model):
    root, _, snapshots = recorded
    ws = workspace(root, model.url, cache=False, steps_per_shard=1)
    units = ces.load_trusted(ws, snapshots["steps"]).units
    model.broken_tracker = True
    try:
        out = ces.ces(units, ws, ws.ledger.open_run("test", "broken").run_id, "")
    finally:
        model.broken_tracker = False
    [unit] = [u for u in units if u.episode_id == out.rows["ces_coordinator_sft"][0].episode_id]
    assert out.rows["ces_state_tracker_sft"] == []
    assert out.dropped["state tracker SFT: the model's state was unusable"] == len(unit.steps)
    assert not any(row.silver for row in out.rows["ces_coordinator_sft"])
    [group] = out.rows["ces_coordinator_rl"]
    expected = ces.START if group.step_index == 0 else "Done so far: "
    assert group.state_input.startswith(expected) and not group.state_input_silver
    groups = out.rows["ces_state_tracker_rl"]
    assert groups  # the tracker's groups are still written, with nothing to learn from
    for g in groups:
        assert g.states == [None] * 4 and g.rewards == [0.0] * 4 and g.zero_variance


def test_an_episode_done_again_with_another_configuration_replaces_its_rows(recorded, model):
    """Rerun on the same steps with another reward weight, the stage does every episode again; each table's
    latest version holds each step once, the newest run's, rather than both runs' rows."""
    root, _, snapshots = recorded
    for alpha in (0.2, 0.3):
        ws = workspace(root, model.url, steps_per_shard=2, alpha_format=alpha, alpha_exec=1 - alpha)
        run = ws.ledger.open_run("test", f"alpha {alpha}").run_id
        run_inline(ces.STAGE, ws, run, snapshots["steps"])
    for table in ces.TABLES:
        rows = ws.catalog.load(table).to_dicts()
        assert rows and {r["run_id"] for r in rows} == {run}, table
        assert len({r["step_id"] for r in rows}) == len(rows), table

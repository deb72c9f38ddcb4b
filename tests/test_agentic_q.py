"""Agentic-Q's step values and SWPO groups on a hand-made warehouse of judged attempts.

The attempts are written as rows (the queries, episodes, steps and verdicts a night would
have written), so each level, filter and score is known in advance; the policy model that
samples the candidates is an endpoint scripted at the edge.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from scripted import ScriptedServer, completion
from starlette.requests import Request
from starlette.responses import Response

from trajforge.data.catalog import Lineage
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Episode, Query, Step, Verdict
from trajforge.synth import agentic_q
from trajforge.synth.report import render_step_datasets, render_yield
from trajforge.synth.trusted import group_advantages
from trajforge.tasks.runner import run_inline

A = {"type": "click", "x": 50, "y": 50}  # inside the box of button A, the successful attempts' first action
B = {"type": "click", "x": 150, "y": 150}  # inside button B's box: the failed attempts' first action
TREE = 'button "A" (40,40,20,20)\nbutton "B" (140,140,20,20)'


def test_group_weights_and_advantages_on_hand_worked_numbers():
    # u(s) = mean(g)^-1 / sum mean(g')^-1: means 0.5 and 0.25 -> 2 and 4 -> 1/3 and 2/3 (the harder state weighs more)
    assert agentic_q.group_weights([0.5, 0.25]) == pytest.approx([1 / 3, 2 / 3])
    # (g - mean) / std with the population std: mean 0.5, std 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_a_group_of_equal_actions_or_concentrated_scores_is_dropped():
    assert agentic_q.group_filter(["a", "a", "a"], [0.0, 1.0, 0.5], 0.05) == "identical actions"
    assert agentic_q.group_filter(["a", "b", "c"], [0.5, 0.5, 0.52], 0.05) == "concentrated scores (std < 0.05)"
    assert agentic_q.group_filter(["a", "b", "c"], [1.0, 0.0, 0.5], 0.05) is None


class Policy(ScriptedServer):
    """The policy model: the k-th sample (its seed) clicks A, A, B, then an empty corner (or A every time)."""

    def __init__(self) -> None:
        super().__init__()
        self.same = False

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"body": body})
        seed = body.get("seed") or 0
        point = [50, 50] if self.same else [[50, 50], [52, 48], [150, 150], [300, 300]][seed % 4]
        call = {"name": "mobile_use", "arguments": {"action": "click", "coordinate": point}}
        text = f"<thinking>look</thinking>\n<conclusion>tap</conclusion>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return completion(text)


@pytest.fixture(scope="module")
def policy():
    with Policy() as server:
        yield server


def workspace(root: Path, url: str, **agentic: Any) -> Workspace:
    return Workspace.open(Settings(
        warehouse={"path": root / "wh"},
        llm={"endpoints": {"m": {"base_url": url, "model": "scripted", "max_retries": 0, "timeout_s": 10}},
             "default": "m", "reask": 0, "cache": False},
        agentic_q={"attempts": 4, "candidates": 4, "groups": 1} | agentic,
    ))


def _lineage(key: str) -> Lineage:
    return Lineage(stage="test", run_id="made", commit_key=key, config_hash="x", code_version="x")


NOW = datetime(2026, 11, 25, tzinfo=UTC)


def _attempt(png: str, query: str, n: int, success: bool | None) -> tuple[Episode, Verdict | None, list[Step]]:
    """Attempt n of a query (None: an environment fault, not judged): the first step on one screen, then a
    terminate."""
    episode = f"{query}-{n}"
    row = Episode(run_id="made", episode_id=episode, query_id=query, app="notes", instruction=f"do {query}",
                  policy="gui_owl_e2e", model_id="scripted", prompt_version="gui_owl_e2e@2", viewport="mobile",
                  status="env_fault" if success is None else "terminated", num_steps=2, final_url="http://app/",
                  final_state_json="{}", started_at=NOW.replace(minute=n), finished_at=NOW.replace(minute=n))
    if success is None:
        return row, None, []
    verdict = Verdict(run_id="made", verdict_id=f"v-{episode}", episode_id=episode, query_id=query, success=success,
                      consensus="checker_first", channels_json="{}", reason="test", config_hash="x")
    first = A if success else B
    steps = [Step(
        run_id="made", step_id=f"{episode}-{i}", episode_id=episode, step_index=i,
        screenshot_before=png, screenshot_after=png, width=390, height=844,
        url_before=f"http://app/{i}", url_after="http://app/1", title_before="t", title_after="t",
        ax_tree_before=TREE, action_type=action["type"],
        action_json=json.dumps({k: v for k, v in action.items() if k != "type"}), action_valid=True,
        target_role="button" if i == 0 else None, target_name=("A" if success else "B") if i == 0 else None,
        target_box=([40, 40, 20, 20] if success else [140, 140, 20, 20]) if i == 0 else None,
        thought="I tap it", raw_output="", duration_ms=1.0)
        for i, action in enumerate([first, {"type": "terminate", "status": "success"}])]
    return row, verdict, steps


def _screen(ws: Workspace) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (390, 844), "white").save(buffer, format="PNG")
    return ws.blobs.put(buffer.getvalue()).sha256


def _write_night(ws: Workspace) -> int:
    """Four queries: `mid` 2 of 4 attempts succeeded (and one more attempt was an environment fault), `zero` none,
    `all` every one, `few` only 2 attempts."""
    png = _screen(ws)
    queries: list[Query] = []
    episodes: list[Episode] = []
    steps: list[Step] = []
    verdicts: list[Verdict] = []
    plan = {"mid": [True, False, True, False], "zero": [False] * 4, "all": [True] * 4, "few": [True, False]}
    for query, outcomes in plan.items():
        queries.append(Query(run_id="made", query_id=query, app="notes", source="page_graph", instruction=f"do {query}",
                            path=["home"], slots_json="{}", checker="state_has", checker_params_json="{}",
                            max_steps=5, generator="test", created_at=NOW))
        for n, success in enumerate(outcomes + ([None] if query == "mid" else [])):
            episode, verdict, made = _attempt(png, query, n, success)
            episodes.append(episode)
            verdicts += [verdict] if verdict else []
            steps += made
    for table, rows in (("queries", queries), ("episodes", episodes), ("verdicts", verdicts)):
        ws.catalog.commit_rows(table, rows, _lineage(table))
    return ws.catalog.commit_rows("steps", steps, _lineage("steps"))


@pytest.fixture(scope="module")
def night(tmp_path_factory, policy):
    root = tmp_path_factory.mktemp("agentic_q")
    ws = workspace(root, policy.url)
    return root, _write_night(ws)


def test_levels_step_values_and_one_scored_group(night, policy):
    root, steps = night
    ws = workspace(root, policy.url)
    run_id = ws.ledger.open_run("test", "q").run_id
    out = run_inline(agentic_q.STAGE, ws, run_id, steps)
    values = ws.catalog.load("agentic_q_values", out["agentic_q_values"]).to_dicts()
    # Only `mid` is informative: its 4 judged attempts (the environment fault is not one), 2 steps each.
    assert {v["query_id"] for v in values} == {"mid"} and len(values) == 8
    assert {v["level"] for v in values} == {2} and {v["attempts"] for v in values} == {4}
    # G_i = r_T: every step of a successful attempt is 1, every step of a failed one 0.
    assert all(v["value"] == (1.0 if int(v["episode_id"][-1]) % 2 == 0 else 0.0) for v in values)
    assert len({v["state_key"] for v in values if v["step_index"] == 0}) == 1  # one screen, one state
    assert all(v["history"] == [] for v in values if v["step_index"] == 0)
    assert all(len(v["history"]) == 1 and v["history"][0].startswith("click") for v in values if v["step_index"] == 1)
    assert all(v["checker"].startswith("state_has@") for v in values)

    [group] = ws.catalog.load("agentic_q_groups", out["agentic_q_groups"]).to_dicts()
    # The first screen: seen in all 4 attempts, A twice (return 1), B twice (0). Candidates A, A (4 px off, still
    # inside A's box), B and an empty corner: scores 1, 1, 0 and V(s) = 0.5.
    assert group["scores"] == [1.0, 1.0, 0.0, 0.5] and group["observed"] == 4 and group["kept"]
    assert group["advantages"] == pytest.approx(group_advantages([1.0, 1.0, 0.0, 0.5]))
    assert group["weight"] == pytest.approx(1.0)  # the only kept group of the night
    assert [c["matched"] for c in json.loads(group["candidates_json"])] == [2, 2, 2, 0]

    lineage = ws.catalog.lineage("agentic_q_groups", out["agentic_q_groups"])
    assert lineage.dropped == {"level 0 of 4: every attempt failed": 1, "level 4 of 4: every attempt succeeded": 1}
    assert lineage.stats["level 2 of 4"] == 1 and lineage.stats["q samples with G = 1"] == 4
    assert lineage.stats["environment fault: rerun by the rollout, not counted as a failure"] == 1
    assert lineage.stats["fewer than 4 judged attempts: left for a later night"] == 1
    assert set(lineage.prompts) == {"gui_owl_e2e"} and lineage.models == {"agentic_q": "scripted"}
    line = agentic_q.agentic_q_summary(lineage.stats)
    # steps per success: over every query's successful attempts (mid 2, all 4, each 2 steps), dropped levels too
    assert line == ("levels (of 4) 0: 1, 2: 1, 4: 1; 8 step values, 50% with G = 1; 2.0 steps per successful "
                    "trajectory; 1 candidate groups, dropped: none")
    # the morning report repeats the line and counts the rows by level and by verdict
    assert f"- agentic_q: {line}." in render_step_datasets(ws, run_id)
    yielded = render_yield(ws, run_id)
    assert "| agentic_q_values | level 2 | 8 |" in yielded and "| agentic_q_groups | kept True | 1 |" in yielded


def test_a_group_whose_candidates_all_agree_is_dropped_and_weighs_nothing(night, policy):
    root, steps = night
    ws = workspace(root, policy.url)
    policy.same = True
    try:
        out = agentic_q.estimate(agentic_q.load_attempts(ws, steps).units, ws, "same", "")
    finally:
        policy.same = False
    [group] = out.rows["agentic_q_groups"]
    assert not group.kept and group.drop_reason == "identical actions" and group.weight is None
    assert group.advantages == [0.0] * 4
    assert out.dropped["group dropped: identical actions"] == 1


def test_a_query_taken_up_again_holds_each_step_once_with_its_new_level(tmp_path, policy):
    """Night 2 adds a failed attempt of `mid`: its last 4 attempts are now 1, 2, 3 and 5 (4 was an environment
    fault), level 1. The latest version holds those attempts' steps once each, all at level 1, and the group of
    the new window; attempt 0, out of the window, is gone. A rerun by hand on the same input changes nothing."""
    ws = workspace(tmp_path, policy.url)
    run_inline(agentic_q.STAGE, ws, ws.ledger.open_run("test", "night 1").run_id, _write_night(ws))
    episode, verdict, steps = _attempt(_screen(ws), "mid", 5, False)
    ws.catalog.commit_rows("episodes", [episode], _lineage("episodes 2"))
    ws.catalog.commit_rows("verdicts", [verdict], _lineage("verdicts 2"))
    night_2 = ws.catalog.commit_rows("steps", steps, _lineage("steps 2"))
    window = {f"mid-{n}-{i}" for n in (1, 2, 3, 5) for i in (0, 1)}
    for run in ("night 2", "by hand"):
        run_inline(agentic_q.STAGE, ws, ws.ledger.open_run("test", run).run_id, night_2)
        values = ws.catalog.load("agentic_q_values").to_dicts()
        assert sorted(v["step_id"] for v in values) == sorted(window)
        assert {v["level"] for v in values} == {1}
        [group] = ws.catalog.load("agentic_q_groups").to_dicts()
        assert group["level"] == 1 and group["observed"] == 4


@pytest.mark.parametrize("vision", [False, True])
def test_candidates_click_as_the_rollout_policy_does(tmp_path, policy, vision):
    """`rollout.click_targets: auto`: a text-only policy model samples its candidates choosing among the recorded
    screen's named elements (buttons A and B), as it acted in the rollout, not free pixels it would invent; a model
    that sees the screen clicks any pixel."""
    ws = Workspace.open(Settings(
        warehouse={"path": tmp_path / "wh"},
        llm={"endpoints": {"m": {"base_url": policy.url, "model": "scripted", "max_retries": 0, "timeout_s": 10,
                                 "structured_output": "grammar", "vision": vision}},
             "default": "m", "reask": 0, "cache": False},
        agentic_q={"attempts": 4, "candidates": 4, "groups": 1}))
    steps = _write_night(ws)
    before = len(policy.requests)
    out = agentic_q.estimate(agentic_q.load_attempts(ws, steps).units, ws, "names", "")
    grammars = [r["body"]["structured_outputs"]["grammar"] for r in policy.requests[before:]]
    assert len(grammars) == 4 and len(out.rows["agentic_q_groups"]) == 1
    for grammar in grammars:
        named = [json.loads(name) for name in re.findall(r'"target": ?\{"const": ?("[^"]*")', grammar)]
        assert named == ([] if vision else ["A", "B"]), grammar


def test_a_run_on_an_older_steps_version_counts_only_the_attempts_that_version_holds(tmp_path, policy):
    """Night 2 adds attempt 5 of `mid` (episodes, verdicts and steps); the stage run by hand on night 1's steps
    version reads episodes and verdicts at their latest, but attempt 5's steps are not in that version: it is not
    an attempt yet (counted), so `mid` is night 1's level 2 over attempts 0 to 3, each with both its steps, not an
    empty attempt 5 at level 1 whose rows would replace the complete ones."""
    ws = workspace(tmp_path, policy.url)
    night_1 = _write_night(ws)
    episode, verdict, steps = _attempt(_screen(ws), "mid", 5, False)
    ws.catalog.commit_rows("episodes", [episode], _lineage("episodes 2"))
    ws.catalog.commit_rows("verdicts", [verdict], _lineage("verdicts 2"))
    ws.catalog.commit_rows("steps", steps, _lineage("steps 2"))
    out = run_inline(agentic_q.STAGE, ws, ws.ledger.open_run("test", "by hand").run_id, night_1)
    values = ws.catalog.load("agentic_q_values", out["agentic_q_values"]).to_dicts()
    assert sorted(v["step_id"] for v in values) == sorted(f"mid-{n}-{i}" for n in range(4) for i in (0, 1))
    assert {v["level"] for v in values} == {2}
    lineage = ws.catalog.lineage("agentic_q_values", out["agentic_q_values"])
    assert lineage.stats["attempt rolled after the input steps version: not counted"] == 1

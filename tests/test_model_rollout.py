"""Rollouts driven by a real model: the embedded SmolLM2 through the gateway, in a real browser.

Quality is not judged (a 135M text model's actions are rarely the right ones); the loop is:
real model calls, real actions, rows that name the model and the template versions,
each role of Mobile-Agent-v3 recorded, and a rerun that rolls nothing (or, asked to, asks the model
nothing). Decoding
is constrained by default, so every action the embedded model writes is a valid one.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pytest
from conftest import prompt_version, prompt_versions, require
from test_rollout import make_query

from trajforge.llm.local import SMOLLM2_ID, missing_models
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Episode

pytestmark = pytest.mark.browser

CONFIG = """
query_gen:
  apps: [shop]
  num_queries: 1
rollout:
  max_invalid_actions: 2
llm:
  reask: 0
synth:
  writer: template  # the synthesis stages' model calls have their own tests (test_synth)
"""


@pytest.fixture(scope="module")
def embedded() -> None:
    reason = missing_models()
    require(reason is None, str(reason))


def cli(exe: str, cwd: Path, *args: str) -> str:
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr  # Prefect's log lines (the stages' summaries) go to stderr


def calls_of(steps) -> list[dict]:
    return [c for raw in steps["model_calls_json"] for c in json.loads(raw)]


@pytest.mark.timeout(1500)  # a whole night on a CPU model, then two reruns: 600 s was not enough on a busy machine
def test_nightly_runs_the_end_to_end_policy_on_the_embedded_model(tmp_path, embedded, chromium, trajforge_cli):
    (tmp_path / "trajforge.yaml").write_text(CONFIG)  # no policy or model named: the defaults
    said = cli(trajforge_cli, tmp_path, "run", "nightly")
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "data" / "warehouse"}))
    episodes = ws.catalog.load("episodes").filter(pl.col("source").is_null() | (pl.col("source") != "reference"))
    episode = episodes.row(0, named=True)
    assert episode["policy"] == "gui_owl_e2e" and episode["model_id"] == SMOLLM2_ID
    assert episode["prompt_version"] == prompt_versions("gui_owl_e2e")
    steps = ws.catalog.load("steps").filter(pl.col("episode_id").is_in(episodes["episode_id"].to_list()))
    assert steps.height >= 1
    calls = calls_of(steps)
    assert {(c["template"], c["template_version"], c["model_id"]) for c in calls} == {
        ("gui_owl_e2e", prompt_version("gui_owl_e2e"), SMOLLM2_ID)}
    assert set(steps["observation_mode"]) == {"ocr+ax"}  # a text-only model saw OCR text, and says so
    assert not any(c["cached"] for c in calls)
    # held to its format while decoding: no unparsable answer, no invalid action (a wrong one, maybe)
    assert {c["constrained"] for c in calls} == {"grammar"} and not any(c["parse_error"] for c in calls)
    assert steps["action_valid"].all(), steps.filter(~pl.col("action_valid"))["action_error"].to_list()
    report = next((tmp_path / "data" / "warehouse" / "reports").glob("*.md")).read_text()
    assert f"{steps.height} policy steps, {steps.height} (100%) with a valid action" in report
    assert f"rollout: {steps.height} policy steps, {steps.height} (100%) with a valid action" in said
    lineage = ws.catalog.lineage("episodes")
    assert lineage.models["policy_model"] == SMOLLM2_ID
    assert lineage.prompts == {"gui_owl_e2e": prompt_version("gui_owl_e2e")}
    assert ws.catalog.load("verdicts").height == episodes.height

    # The same stage over the same queries again: the attempts are in the warehouse, so nothing is rolled;
    # asked to roll them again anyway, every answer comes from the cache.
    queries = ws.catalog.history("queries")[-1].snapshot_id
    said = cli(trajforge_cli, tmp_path, "run", "rollout", "--input", f"queries@{queries}")
    assert f"rollout: {episodes['query_id'].n_unique()} queries not rolled again" in said
    assert ws.catalog.history("steps")[-1].added_rows == 0
    (tmp_path / "trajforge.yaml").write_text(CONFIG.replace("rollout:\n", "rollout:\n  reroll_identical: true\n"))
    cli(trajforge_cli, tmp_path, "run", "rollout", "--input", f"queries@{queries}")
    latest = ws.catalog.history("steps")[-1]
    rerun = ws.catalog.load("steps", latest.snapshot_id).filter(pl.col("run_id") == latest.run_id)
    assert latest.run_id != episode["run_id"] and rerun.height == steps.height
    assert all(c["cached"] for c in calls_of(rerun)), "the rerun asked the model again"


def test_sampled_attempts_differ_and_the_same_night_asked_again_is_cached(tmp_path, embedded, chromium, shop,
                                                                          server):
    """rollout.samples_per_query: each attempt its own seed; the seeds come from the queries version."""
    settings = Settings(warehouse={"path": tmp_path / "wh"}, llm={"reask": 0},
                        rollout={"samples_per_query": 2, "temperature": 1.0, "contexts": 1})
    ws = Workspace.open(settings)
    query = make_query(shop.spec, "cart", query_id="q-sampled").model_copy(update={"max_steps": 1})

    def night(seed_base: str, run_id: str):
        return rollout([query], run_id=run_id, settings=settings.rollout, blobs=ws.blobs, gateway=ws.gateway,
                       seed_base=seed_base)

    first = night("queries@1", "night-1")
    episodes, steps = first.rows["episodes"], first.rows["steps"]
    assert [e.sample for e in episodes] == [0, 1] and len({e.episode_id for e in episodes}) == 2
    assert episodes[0].seed != episodes[1].seed and None not in (episodes[0].seed, episodes[1].seed)
    assert steps[0].raw_output != steps[1].raw_output  # two draws, not one answer twice
    assert all(s.action_valid for s in steps)

    again = night("queries@1", "night-1-rerun")  # the same queries version: the same draws, from the cache
    assert [s.raw_output for s in again.rows["steps"]] == [s.raw_output for s in steps]
    assert all(c["cached"] for s in again.rows["steps"] for c in json.loads(s.model_calls_json))
    new = night("queries@2", "night-2")  # a new night's queries: new draws
    assert not any(c["cached"] for s in new.rows["steps"] for c in json.loads(s.model_calls_json))


def test_a_query_with_some_samples_held_rolls_only_the_others(tmp_path, embedded, chromium, shop):
    """Three samples a query; a finished night holds samples 0 and 2, and sample 1 only as an env fault (its
    tries ran out): the next plan rolls sample 1 alone, with its own seed. Rolling all three again wrote samples
    0 and 2 twice, the same draws under new episode ids."""
    from trajforge.data.catalog import Lineage
    from trajforge.rollout.stage import SAMPLES_HELD, draw_for, load_queries, run_rollouts

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, llm={"reask": 0}, rollout={
        "samples_per_query": 3, "temperature": 1.0, "contexts": 1, "chromium": chromium}))
    run = ws.ledger.open_run("nightly", "night-1").run_id

    def lineage(table: str) -> Lineage:
        return Lineage(stage="test", run_id=run, commit_key=f"{run}:{table}", config_hash="x", code_version="x")

    query = make_query(shop.spec, "cart").model_copy(update={"run_id": run, "max_steps": 1})
    snapshot = ws.catalog.commit_rows("queries", [query], lineage("queries"))
    [unit] = load_queries(ws, snapshot).units
    assert unit.samples is None
    now = datetime.now(timezone.utc)
    ws.catalog.commit_rows("episodes", [Episode(
        episode_id=f"e{sample}", query_id=query.query_id, app=query.app, instruction=query.instruction, run_id=run,
        policy="gui_owl_e2e", model_id="m", prompt_version="", viewport="mobile", status=status, num_steps=1,
        final_url="", final_state_json="{}", started_at=now, finished_at=now, sample=sample,
        attempt_key=unit.attempt_key) for sample, status in ((0, "terminated"), (1, "env_fault"), (2, "max_steps"))],
        lineage("episodes"))
    ws.ledger.finish_run(run, {})
    again = load_queries(ws, snapshot)
    [partial] = again.units
    assert partial.samples == (1,) and again.stats == {SAMPLES_HELD: 2}
    out = run_rollouts(again.units, ws, "night-2", "shard")
    episodes = out.rows["episodes"]
    assert [e.sample for e in episodes if e.status != "env_fault"] == [1]
    draw = draw_for(ws.settings.rollout, partial.seed_base, query.query_id, 1)
    assert episodes[-1].seed == (draw.seed if draw else None) and episodes[-1].attempt_key == unit.attempt_key


def test_samples_of_a_greedy_or_replayed_policy_are_refused():
    greedy, replayed = {"samples_per_query": 4}, {"samples_per_query": 4, "temperature": 0.7, "policy": "replay"}
    for rollout_settings in (greedy, replayed):
        with pytest.raises(ValueError, match="rollout.samples_per_query: 4 attempts .* copies of one episode"):
            Settings(rollout=rollout_settings)


def test_mobile_agent_records_every_role_per_step(tmp_path, embedded, chromium, shop, server):
    settings = Settings(
        warehouse={"path": tmp_path / "wh"}, llm={"reask": 0},
        rollout={"policy": "mobile_agent_v3", "max_invalid_actions": 5, "contexts": 1},
    )
    ws = Workspace.open(settings)
    query = make_query(shop.spec, "cart", query_id="q-roles").model_copy(update={"max_steps": 2})
    # A guided query, as the loop's second night rolls a hard one: the Manager plans with the guidance (the episode
    # used to name it while no role's prompt had it).
    out = rollout([query.model_dump()], run_id="r", settings=settings.rollout, blobs=ws.blobs, gateway=ws.gateway,
                  guidance={"q-roles": ("g-1", "Open the cart from the menu.")})
    (episode,) = out.rows["episodes"]
    assert episode.policy == "mobile_agent_v3" and episode.model_id == SMOLLM2_ID and episode.guidance_id == "g-1"
    steps = out.rows["steps"]
    first = json.loads(steps[0].roles_json)
    assert set(first) >= {"manager"}
    assert first["manager"]["inputs"]["last_action"] == ""  # the initial plan
    assert first["manager"]["inputs"]["guidance"] == "Open the cart from the menu."
    for role in first.values():
        assert role["raw_output"] and ("output" in role and "parse_error" in role)
    if len(steps) > 1:
        second = json.loads(steps[1].roles_json)
        assert "reflector" in second and second["manager"]["inputs"]["last_action"] != ""
    assert {c["template"] for s in steps for c in json.loads(s.model_calls_json)} <= {
        "mobile_agent_manager", "mobile_agent_worker", "mobile_agent_reflector", "mobile_agent_notetaker"}
    assert out.prompts == {f"mobile_agent_{role}": prompt_version(f"mobile_agent_{role}")
                           for role in ("manager", "worker", "reflector", "notetaker")}


def test_rollout_pointed_at_an_endpoint_sends_its_calls_there(tmp_path, embedded, chromium, shop, server):
    """llm.default names an OpenAI-compatible server (here `python -m llm.serve` on loopback)."""
    from test_llm_models import requests_seen, served

    log = tmp_path / "serve.log"
    with served("--model", "smollm2", log=log) as url:
        settings = Settings(
            warehouse={"path": tmp_path / "wh"},
            llm={"reask": 0, "default": "box", "endpoints": {"box": {"base_url": url, "model": SMOLLM2_ID}}},
            rollout={"max_invalid_actions": 1, "contexts": 1},
        )
        ws = Workspace.open(settings)
        query = make_query(shop.spec, "cart", query_id="q-endpoint")
        out = rollout([query.model_dump()], run_id="r", settings=settings.rollout, blobs=ws.blobs, gateway=ws.gateway)
        seen = requests_seen(log)
    (step,) = out.rows["steps"]
    (call,) = json.loads(step.model_calls_json)
    assert seen == 1 and not call["cached"]
    assert call["model_id"] == SMOLLM2_ID and call["template"] == "gui_owl_e2e"
    assert out.rows["episodes"][0].status == "stalled"

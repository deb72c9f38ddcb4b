"""The self-evolving loop through the CLI, two nights in a fresh folder: real Prefect, browser, catalog.

Night 1: a random clicker fails the queries, so they become hard. Night 2: the guidance
stage replays each hard query's reference path, distils guidance from it (template
describer, for speed), and the rollouts of those queries carry it; the history then
holds both nights and the report compares them.
"""

from __future__ import annotations

import json
import re

import polars as pl
import pytest
from test_pipeline import cli, workspace

from trajforge.guidance.history import iterations
from trajforge.rollout.stage import NOT_ROLLED_AGAIN

pytestmark = pytest.mark.browser

CONFIG = """
query_gen:
  apps: [shop]
  num_queries: 3
  deep_search_apps: []
rollout:
  policy: random
  contexts: 2
  episodes_per_shard: 4
critics:
  step_critic: rules
  text_channel: false
synth:
  writer: template
loop:
  max_guided: 3
guidance:
  describer: template
"""


@pytest.fixture(scope="module")
def two_nights(tmp_path_factory, chromium, trajforge_cli):
    cwd = tmp_path_factory.mktemp("loop")
    (cwd / "trajforge.yaml").write_text(CONFIG)
    first = cli(trajforge_cli, cwd, "run", "nightly").stdout
    second = cli(trajforge_cli, cwd, "run", "nightly").stdout
    ws = workspace(cwd)
    runs = [h.run_id for h in ws.catalog.history("episodes") if h.lineage.stage == "rollout"]
    return cwd, ws, runs, first + second


def test_queries_latest_shows_attempts_and_successes_of_both_nights(two_nights, trajforge_cli):
    cwd, ws, runs, _ = two_nights
    shown = cli(trajforge_cli, cwd, "datasets", "show", "queries@latest", "--columns",
                "query_id,attempts,successes").stdout
    history = ws.catalog.load("query_history")
    assert set(history["run_id"]) == set(runs) and len(runs) == 2
    guided = set(ws.catalog.load("guidance")["query_id"])
    # Night 1 judges every query once. Night 2 judges the guided ones again (their prompt changed) and leaves
    # out the others: the seeded random clicker would repeat their episodes step for step.
    assert set(history.filter(pl.col("run_id") == runs[0])["query_id"]) > guided
    assert set(history.filter(pl.col("run_id") == runs[1])["query_id"]) == guided
    unguided = history["query_id"].n_unique() - len(guided)
    assert unguided > 0, "loop.max_guided should leave a hard query unguided"
    night2 = [i for i in ws.catalog.history("episodes") if i.lineage.stage == "rollout"][-1]
    assert night2.run_id == runs[1] and night2.lineage.stats[NOT_ROLLED_AGAIN] == unguided
    counts = history.group_by("query_id").agg(pl.len().alias("n"), pl.col("success").sum().alias("ok"))
    for row in counts.iter_rows(named=True):
        assert row["n"] == (2 if row["query_id"] in guided else 1)
        assert re.search(rf"{row['query_id']}\s*┆\s*{row['n']}\s*┆\s*{row['ok']}\b", shown), shown
    assert sorted(ws.catalog.load("queries@latest")["attempts"].to_list()) == sorted(counts["n"].to_list())


def test_second_night_guides_the_queries_that_failed_in_the_first(two_nights):
    _, ws, (night1, night2), _ = two_nights
    history = ws.catalog.load("query_history")
    failed_first = set(history.filter((pl.col("run_id") == night1) & ~pl.col("success"))["query_id"])
    assert failed_first, "the random clicker should fail some queries"
    guidance = ws.catalog.load("guidance")
    assert set(guidance["run_id"]) == {night2}
    assert set(guidance["query_id"]) and set(guidance["query_id"]) <= failed_first
    episodes = ws.catalog.load("episodes").filter(pl.col("run_id") == night2)
    guided = dict(episodes.filter(pl.col("guidance_id").is_not_null()).select("query_id", "guidance_id").iter_rows())
    assert guided == dict(guidance.select("query_id", "guidance_id").iter_rows())
    assert ws.catalog.load("episodes").filter(pl.col("run_id") == night1)["guidance_id"].is_null().all()
    # The history row of each guided attempt names its guidance and the model iteration.
    night2_history = history.filter(pl.col("run_id") == night2)
    assert dict(night2_history.filter(pl.col("guidance_id").is_not_null()).select("query_id", "guidance_id")
                .iter_rows()) == guided
    assert set(night2_history["iteration"]) == {0} and set(night2_history["model_id"]) == {"random"}
    lineage = ws.catalog.lineage("guidance", ws.catalog.history("guidance")[-1].snapshot_id)
    assert lineage.inputs["query_history"] == ws.catalog.history("query_history")[0].snapshot_id
    # The first night guides nothing and its lineage says why: no query had been tried.
    [first] = [v.lineage for v in ws.catalog.history("guidance") if v.run_id == night1]
    tried = history.filter(pl.col("run_id") == night1)["query_id"].n_unique()
    assert first.kept == {"guidance": 0} and first.stats == {"not hard: never attempted": tried}


def test_guidance_rows_name_essential_steps_references_and_dropped_steps(two_nights):
    _, ws, _, _ = two_nights
    buffer = ws.catalog.load("replay_buffer")
    for row in ws.catalog.load("guidance").iter_rows(named=True):
        assert row["essential_steps"] and all(s in row["text"] for s in row["essential_steps"])
        assert row["references"] and set(row["references"]) <= set(buffer["entry_id"])
        refs = buffer.filter(pl.col("entry_id").is_in(row["references"]))
        assert set(refs["origin"]) == {"replay"} and set(refs["query_id"]) == {row["query_id"]}
        dropped = json.loads(row["dropped_steps_json"])
        assert dropped and all(d["reason"] and d["entry_id"] in row["references"] for d in dropped)
        # The replayed path ends with terminate, which is never an essential step.
        assert any(d["reason"].startswith("ends the episode") for d in dropped)
        assert row["hard_reason"].startswith("never succeeded")


def test_report_shows_yield_and_before_after_success_of_guided_queries(two_nights, trajforge_cli):
    cwd, ws, (_, night2), _ = two_nights
    report = cli(trajforge_cli, cwd, "report").stdout
    assert f"reports/{night2}.md" in report.replace("\n", "")  # the latest run's
    episodes = ws.catalog.load("episodes").filter((pl.col("run_id") == night2) & (pl.col("status") != "env_fault")
                                                 & (pl.col("source") == "policy"))  # not the reference replays
    accepted = ws.catalog.load("verdicts").filter((pl.col("run_id") == night2) & pl.col("success")).height
    assert f"Accepted trajectories per rollout: {accepted}/{episodes.height}" in report
    assert "| shop |" in report and "| page_graph |" in report
    for g in ws.catalog.load("guidance").iter_rows(named=True):
        line = next(l for l in report.splitlines() if l.startswith(f"| {g['query_id']} "))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == g["guidance_id"] and cells[2] == "0/1 (0%)" and re.fullmatch(r"[01]/1 .*", cells[3])


def test_history_rerun_on_the_same_verdicts_counts_no_attempt_twice(two_nights, trajforge_cli):
    cwd, ws, _, _ = two_nights
    first_verdicts = ws.catalog.history("verdicts")[0].snapshot_id
    before = ws.catalog.load("query_history").height
    attempts = ws.catalog.load("queries@latest").select("query_id", "attempts").sort("query_id")
    cli(trajforge_cli, cwd, "run", "history", "--input", f"verdicts@{first_verdicts}")
    assert ws.catalog.load("query_history").height == before
    assert ws.catalog.load("queries@latest").select("query_id", "attempts").sort("query_id").equals(attempts)
    lineage = ws.catalog.lineage("query_history")
    assert lineage.inputs["verdicts"] == first_verdicts and lineage.kept == {"query_history": 0}
    assert lineage.dropped["episode already in query_history (a rerun of the stage)"] == \
        ws.catalog.load("verdicts", first_verdicts).height


def test_a_night_with_a_new_policy_model_starts_a_new_iteration():
    assert iterations([], ["m0"]) == {"m0": 0}
    seen = [("m0", 0), ("m0", 0), ("m1", 1)]
    assert iterations(seen, ["m1", "m0"]) == {"m0": 0, "m1": 1}  # the same models: the same iterations
    assert iterations(seen, ["m2", "m1"]) == {"m0": 0, "m1": 1, "m2": 2}
    assert iterations(seen, ["zz", "aa"])["aa"] == 2  # two new ones numbered in sorted order, alike in every shard

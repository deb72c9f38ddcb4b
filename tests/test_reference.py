"""Reference demonstrations: each validated query's reference path replayed once per query version."""

from __future__ import annotations

import polars as pl
import pytest

from trajforge.data.catalog import Lineage, commit_key
from trajforge.guidance import reference
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.schemas.config import Settings
from trajforge.tasks.runner import commit, plan, run_inline, run_shard

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def night(tmp_path_factory, chromium):
    """Queries for the notes app and their reference demonstrations, recorded by one run."""
    root = tmp_path_factory.mktemp("reference")
    ws = Workspace.open(Settings(
        warehouse={"path": root / "wh"},
        query_gen={"apps": ["notes"], "num_queries": 2, "atomic_per_app": 1, "deep_search_apps": []},
        rollout={"policy": "replay", "contexts": 2},
    ))
    run = ws.ledger.open_run("test", "first").run_id
    queries = run_inline(QUERY_GEN, ws, run)["queries"]
    return ws, queries, run_inline(reference.STAGE, ws, run, queries)


def test_every_validated_query_gets_one_successful_reference_episode(night):
    ws, queries_snapshot, snapshots = night
    queries = ws.catalog.load("queries", queries_snapshot)
    episodes = ws.catalog.load("episodes", snapshots["episodes"])
    assert sorted(episodes.select("query_id", "viewport").rows()) == sorted(
        (q, v) for q in queries["query_id"] for v in ("mobile", "desktop"))  # each query in both viewports
    assert set(episodes["source"]) == {"reference"}
    assert episodes["success"].all()
    steps = ws.catalog.load("steps", snapshots["steps"])
    assert steps.height >= episodes.height and steps["action_valid"].all()
    buffer = ws.catalog.load("replay_buffer", snapshots["replay_buffer"])
    assert sorted(buffer["query_id"]) == sorted(2 * queries["query_id"].to_list())
    assert set(buffer["origin"]) == {"replay"}
    lineage = ws.catalog.lineage("episodes", snapshots["episodes"])
    assert lineage.stats["reference demonstrations recorded"] == episodes.height


def test_a_recorded_query_version_is_reused_and_a_changed_one_replayed(night):
    ws, queries_snapshot, _ = night
    run = ws.ledger.open_run("test", "second").run_id
    again = run_inline(reference.STAGE, ws, run, queries_snapshot)
    lineage = ws.catalog.lineage("episodes", again["episodes"])
    queries = ws.catalog.load("queries", queries_snapshot)
    assert lineage.kept["episodes"] == 0
    assert lineage.stats["reference reused: this query version was recorded by an earlier run"] == 2 * queries.height

    changed = queries.with_columns(pl.lit("edited").alias("run_id"), pl.col("max_steps") + 1).head(1)
    snapshot = ws.catalog.commit_rows("queries", changed.to_dicts(), Lineage(
        stage="edit", run_id="edited", commit_key="edited", config_hash="-", code_version="-"), "overwrite")
    units = reference.load_references(ws, snapshot).units
    expected = [(changed["query_id"][0], v) for v in ("mobile", "desktop")]
    assert [(u.query.query_id, u.viewport) for u in units] == expected


def test_a_version_whose_replay_hit_an_env_fault_is_replayed_again(night):
    """A timeout on a loaded machine records nothing: the next run replays that version, not skips it."""
    ws, queries_snapshot, snapshots = night
    query = ws.catalog.load("queries", queries_snapshot).with_columns(
        pl.lit("faulted").alias("run_id"), pl.col("max_steps") + 2).head(1)
    snapshot = ws.catalog.commit_rows("queries", query.to_dicts(), Lineage(
        stage="edit", run_id="faulted", commit_key="faulted-queries", config_hash="-", code_version="-"), "overwrite")
    [mobile, desktop] = sorted(reference.load_references(ws, snapshot).units, key=lambda u: u.viewport == "desktop")
    recorded = ws.catalog.load("episodes", snapshots["episodes"]).filter(pl.col("viewport") == "mobile").head(2)
    faulted = recorded.with_columns(pl.lit(mobile.version).alias("query_version"), pl.lit("env_fault").alias("status"),
                                    pl.lit("timeout").alias("fault_kind"), pl.lit(None, pl.Boolean).alias("success"))
    done = recorded.tail(1).with_columns(pl.lit(desktop.version).alias("query_version"))
    ws.catalog.commit_rows("episodes", pl.concat([faulted.head(1), done]).to_dicts(), Lineage(
        stage="reference", run_id="faulted", commit_key="faulted-episodes", config_hash="-", code_version="-"))
    units = reference.load_references(ws, snapshot).units
    assert [(u.viewport, u.version) for u in units] == [("mobile", mobile.version)]


def test_a_run_killed_between_its_episodes_and_steps_commits_commits_the_steps_on_rerun(night):
    """The kill lands after the episodes' commit: the rerun must not count its own episodes as recorded by an
    earlier run, or it plans no shard and cannot commit the steps it already wrote."""
    ws, queries_snapshot, _ = night
    query = ws.catalog.load("queries", queries_snapshot).with_columns(
        pl.lit("killed").alias("run_id"), pl.col("max_steps") + 3).head(1)
    snapshot = ws.catalog.commit_rows("queries", query.to_dicts(), Lineage(
        stage="edit", run_id="killed", commit_key="killed-queries", config_hash="-", code_version="-"), "overwrite")
    run = ws.ledger.open_run("test", "killed").run_id
    staged = plan(reference.STAGE, ws, run, snapshot)
    for shard in staged.pending:
        run_shard(staged, shard, ws)
    files = [f for r in ws.ledger.shards_done(run, "reference") for f in r.files["episodes"]]
    ws.catalog.commit_files("episodes", files, Lineage(
        stage="reference", run_id=run, commit_key=commit_key(run, "reference", "episodes"), config_hash="-",
        code_version="-"), "append")

    again = plan(reference.STAGE, ws, run, snapshot)
    assert (again.shard_ids, again.pending) == (staged.shard_ids, [])
    snapshots = commit(again, ws)
    episodes = ws.catalog.load("episodes", snapshots["episodes"]).filter(pl.col("run_id") == run)
    steps = ws.catalog.load("steps", snapshots["steps"]).filter(pl.col("run_id") == run)
    assert episodes.height == 2 and set(steps["episode_id"]) == set(episodes["episode_id"])

"""The morning report on a hand-made warehouse: the rows and lineage a night's stages would commit, so that each
count the report gives is known in advance (no night is run)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import polars as pl
import pytest
from test_catalog import query_row
from test_report_loop import cells

from trajforge.data.catalog import Lineage, commit_key
from trajforge.data.notebook import TRAINING_TABLES
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Episode, Guidance, QueryAttempt, TrainingStep
from trajforge.synth.report import render_filters, render_yield, write_report

EARLIER = "nightly-20261121T030000-aaaaaa"
AT = datetime(2026, 11, 21, 3, 0, tzinfo=UTC)


def commit(ws: Workspace, run_id: str, table: str, rows: list[Any], stage: str, mode: str = "append",
           **lineage: Any) -> int:
    return ws.catalog.commit_rows(table, rows, Lineage(stage=stage, run_id=run_id, commit_key=commit_key(
        run_id, stage, table), config_hash="x", code_version="x", **lineage), mode)


def attempt(run_id: str, query_id: str, success: bool) -> QueryAttempt:
    return QueryAttempt(run_id=run_id, episode_id=f"{run_id}:{query_id}", query_id=query_id, app="notes",
                        source="page_graph", iteration=0, policy="replay", model_id="replay", success=success,
                        judged_at=AT if run_id == EARLIER else datetime.now(UTC))


def guidance(run_id: str, query_id: str) -> Guidance:
    return Guidance(run_id=run_id, guidance_id=f"g-{query_id}", query_id=query_id, instruction=f"open {query_id}",
                    text="1. open the note", essential_steps=["the note opens"], references=["e1"],
                    dropped_steps_json="[]", outcomes_json="[]", describer="template", prompt_version="1",
                    observation_mode="ax-diff", hard_reason="never succeeded in 1 attempt(s)")


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))


def test_a_hard_query_left_unguided_and_not_rolled_again_is_still_counted_hard(ws):
    """q1 and q2 failed the night before; q1 gets guidance and is rolled again, q2 is cut by loop.max_guided and,
    its attempts being held already, not rolled again: the queries judged tonight hold q1 only."""
    run_id = ws.ledger.open_run("nightly", "test").run_id
    commit(ws, EARLIER, "query_history", [attempt(EARLIER, q, ok) for q, ok in (("q1", False), ("q2", False),
                                                                                ("q3", True))], "history")
    queries = commit(ws, run_id, "queries", [query_row(q, run_id=run_id) for q in ("q1", "q2", "q3")], "query_gen",
                     mode="overwrite")
    commit(ws, run_id, "guidance", [guidance(run_id, "q1")], "guidance", inputs={"queries": queries},
           dropped={"hard, but over loop.max_guided this run": 1})
    commit(ws, run_id, "query_history", [attempt(run_id, "q1", True)], "history")
    markdown = write_report(ws, run_id, ws.run_tag(run_id)).read_text()
    assert "Hard when the run began: 2; given guidance: 1." in markdown
    assert "Hard but not guided this run: q2 (the guidance lineage says why)." in markdown


def test_the_report_ends_with_the_version_of_each_table_the_run_made(ws):
    """The run command's summary, in the report: a table the run wrote twice is listed once, with the version the
    nightly tags (its last), where the run first wrote it."""
    run_id = ws.ledger.open_run("nightly", "test").run_id
    tag = ws.run_tag(run_id)
    made = {"queries": commit(ws, run_id, "queries", [query_row(q, run_id=run_id) for q in ("q1", "q2")], "query_gen",
                              mode="overwrite")}
    made["query_history"] = commit(ws, run_id, "query_history", [attempt(run_id, "q1", False)], "history")
    made["queries"] = commit(ws, run_id, "queries", [query_row(q, run_id=run_id) for q in ("q1", "q2")], "history",
                             mode="overwrite")
    for table, snapshot in made.items():
        ws.catalog.tag(table, snapshot, tag)
    markdown = write_report(ws, run_id, tag).read_text()
    versions = markdown.split("## Versions this run made")[1]
    rows = [line for line in versions.splitlines() if line.startswith("| ")][2:]  # below the header
    assert [line.split(" | ")[0].removeprefix("| ") for line in rows] == ["queries", "query_history"]
    assert cells(versions, "| queries |") == ["queries", "2", "2", str(made["queries"]), tag]
    assert cells(versions, "| query_history |") == ["query_history", "1", "1", str(made["query_history"]), tag]


def test_rows_added_count_every_stage_of_the_run_that_appended_to_the_table(ws):
    """replay_buffer on a first night: the reference stage adds 26 rows, guidance and history none; the last
    version's own count (0) read as a night that added nothing. An earlier night's rows are not the run's."""
    run_id = ws.ledger.open_run("nightly", "test").run_id
    tag = ws.run_tag(run_id)
    commit(ws, EARLIER, "query_history", [attempt(EARLIER, "q0", True)], "history")
    commit(ws, run_id, "query_history", [attempt(run_id, "q1", False), attempt(run_id, "q2", True)], "reference")
    last = commit(ws, run_id, "query_history", [], "history")
    ws.catalog.tag("query_history", last, tag)
    versions = write_report(ws, run_id, tag).read_text().split("## Versions this run made")[1]
    assert cells(versions, "| query_history |") == ["query_history", "2", "3", str(last), tag]


@pytest.fixture
def exported(ws) -> str:
    """A night of one accepted Mobile-Agent-v3 episode: one train_e2e row (weight 1.5), no role row. The export
    stage's lineage, as on every table it writes, holds every table's drops and train_e2e's filter 3 counts."""
    run_id = "nightly-20261122T030000-bbbbbb"
    now = datetime.now(UTC)
    episode = Episode(run_id=run_id, episode_id="ep1", query_id="q1", app="notes", instruction="open q1",
                      policy="mobile_agent_v3", model_id="m", prompt_version="1", viewport="mobile",
                      status="terminated", num_steps=1, final_url="", final_state_json="{}", started_at=now,
                      finished_at=now)
    commit(ws, run_id, "episodes", [episode], "rollout")
    row = TrainingStep(run_id=run_id, sample_id="s1", step_id="st1", episode_id="ep1", query_id="q1", label="GOOD",
                       messages_json="[]", images=[b"\x89PNG" + bytes(4096)], tag="t", score=1.0, weight=1.5)
    dropped = {"filter 1: critic score -1 below tau_c 0.5 (HARMFUL)": 9,
               "manager: filter 1, its step's critic score below tau_c 0.5": 4,
               "worker: filter 2, the thought names another element or action": 2,
               "filter 4: reflector SUCCESS from a trajectory with a step not positive": 1}
    for table in ("train_e2e", "train_manager", "train_worker", "train_reflector", "train_notetaker"):
        commit(ws, run_id, table, [row] if table == "train_e2e" else [], "export", kept={"train_e2e": 1},
               dropped=dropped, stats={"filter 3: rows weighted up (a hard task)": 1})
    return run_id


def test_an_empty_role_table_gives_its_own_roles_drops_only(ws, exported):
    yielded = "\n".join(render_yield(ws, exported))
    assert cells(yielded, "| train_manager |")[2] == "0 (manager: filter 1, its step's critic score below tau_c 0.5: 4)"
    assert cells(yielded, "| train_worker |")[2] == (
        "0 (worker: filter 2, the thought names another element or action: 2)")
    assert cells(yielded, "| train_reflector |")[2] == (
        "0 (filter 4: reflector SUCCESS from a trajectory with a step not positive: 1)")
    assert cells(yielded, "| train_notetaker |")[2] == "0 (no notetaker answer in an accepted trajectory)"


def test_the_report_reads_a_training_tables_small_columns_not_its_screenshots(ws, exported, monkeypatch):
    """A training table holds every night's PNG bytes: the report reads the few columns it counts by."""
    load = ws.catalog.load

    def no_screenshots(ref: str, *args: Any, columns: list[str] | None = None, **kw: Any) -> pl.DataFrame:
        assert ref.split("@")[0] not in TRAINING_TABLES or (columns is not None and "images" not in columns), ref
        return load(ref, *args, columns=columns, **kw)

    monkeypatch.setattr(ws.catalog, "load", no_screenshots)
    assert cells("\n".join(render_yield(ws, exported)), "| train_e2e |") == ["train_e2e", "all", "1"]
    assert "Row weights (filter 3): min 1.50, mean 1.50, max 1.50." in render_filters(ws, exported)

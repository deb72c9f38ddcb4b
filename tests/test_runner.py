"""The stage contract: shards resume after a crash, each row lands once, lineage is complete."""

from __future__ import annotations

import dataclasses
import time
import uuid
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from trajforge.data.catalog import Lineage
from trajforge.llm.workspace import Workspace, code_version
from trajforge.schemas.config import Settings
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.schemas.tables import RowError
from trajforge.tasks.runner import commit, plan, run_shard

APPS = [f"app{i}" for i in range(7)]


@pytest.fixture(params=["sqlite", "postgres"])
def ws(request, tmp_path):
    """A workspace whose catalog and ledger are in SQLite or in PostgreSQL."""
    warehouse = {"path": tmp_path / "wh", "namespace": f"t{uuid.uuid4().hex[:12]}"}
    if request.param == "postgres":
        warehouse["catalog_url"] = request.getfixturevalue("postgres_url")
    ws = Workspace.open(Settings(warehouse=warehouse))
    yield ws
    ws.catalog.close()


@pytest.fixture
def run_id() -> str:
    """Unique per test: the PostgreSQL ledger is shared by every test run."""
    return f"run-{uuid.uuid4().hex[:8]}"


def query(run_id: str, app: str, bad: bool = False) -> dict:
    return dict(
        run_id=run_id, query_id=f"q-{app}", app=app, source="page_graph", instruction=f"do {app}",
        path=["home"], slots_json="{}", checker="c", checker_params_json="{}",
        max_steps=0 if bad else 3, generator="test@1", created_at=datetime.now(timezone.utc),
    )


def make_stage(calls: list[str], fail_on: str | None = None, bad_row: str | None = None) -> StageDef:
    """A two-table stage over APPS, two units per shard; it can crash or emit a bad row."""

    def run(units, ws, run_id, config_hash):
        out = StageOutput(models={"policy": "test-model"}, prompts={"test": "1"})
        for u in units:
            calls.append(u)
            if u == fail_on:
                raise RuntimeError("worker died")
        out.rows["queries"] = [query(run_id, u, bad=u == bad_row) for u in units]
        out.rows["episodes"] = []
        out.dropped["too easy"] += 1
        return out

    return StageDef(
        name="demo", key=str, reads=None, writes={"queries": "append", "episodes": "append"},
        sections=("query_gen",), load=lambda ws, snap: Inputs(units=list(APPS), fingerprint="f"),
        run=run, shard_size=lambda s: 2,
    )


def run_all(stage: StageDef, ws: Workspace, run_id: str) -> dict[str, int]:
    p = plan(stage, ws, run_id, None)
    for shard in p.pending:
        run_shard(p, shard, ws)
    return commit(p, ws)


def test_crashed_stage_resumes_without_redoing_or_duplicating(ws, run_id):
    calls: list[str] = []
    crashing = make_stage(calls, fail_on="app4")
    p = plan(crashing, ws, run_id, None)
    assert p.total == 4
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    with pytest.raises(RuntimeError, match="2 shard\\(s\\) not done"):
        commit(p, ws)
    assert ws.catalog.history("queries") == []  # nothing visible before the stage finishes

    calls.clear()
    snapshots = run_all(make_stage(calls), ws, run_id)
    assert calls == ["app4", "app5", "app6"]  # only the unfinished shards ran again
    frame = ws.catalog.load("queries", snapshots["queries"])
    assert sorted(frame["app"].to_list()) == APPS


def test_a_resume_whose_inputs_moved_since_the_crash_commits_the_new_plan_once(ws, run_id):
    """Killed mid-stage, then another stage run by hand adds an input: on the resume the units fall into other
    shards. Those all run, and the commit takes the new plan's rows only, each unit once (it used to refuse on
    every rerun, naming shards of the old plan)."""
    calls: list[str] = []
    p = plan(make_stage(calls, fail_on="app2"), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    assert calls[:2] == ["app0", "app1"]  # one shard done and recorded, nothing committed

    moved = dataclasses.replace(make_stage(calls), load=lambda ws, snap: Inputs(units=["app"] + APPS, fingerprint="f"))
    snapshots = run_all(moved, ws, run_id)
    frame = ws.catalog.load("queries", snapshots["queries"])
    assert sorted(frame["app"].to_list()) == sorted(["app"] + APPS)  # each unit once, the new one too
    assert run_all(moved, ws, run_id) == snapshots  # and the stage stays committed


def test_rerun_after_commit_changes_nothing(ws, run_id):
    calls: list[str] = []
    first = run_all(make_stage(calls), ws, run_id)
    calls.clear()
    again = run_all(make_stage(calls), ws, run_id)
    assert again == first and calls == []
    assert len(ws.catalog.history("queries")) == 1


def test_crash_between_table_commits_is_finished_once(ws, run_id):
    calls: list[str] = []
    stage = make_stage(calls)
    p = plan(stage, ws, run_id, None)
    for shard in p.pending:
        run_shard(p, shard, ws)
    # The previous process committed `queries` and died before `episodes`.
    record = ws.ledger.shards_done(run_id, "demo")
    files = [f for r in record for f in r.files.get("queries", [])]
    first = ws.catalog.commit_files(
        "queries", files,
        Lineage(stage="demo", run_id=run_id, commit_key=f"{run_id}:demo:queries", config_hash="x", code_version="x"),
        "append",
    )
    snapshots = commit(p, ws)
    assert snapshots["queries"] == first
    assert len(ws.catalog.history("queries")) == 1
    assert ws.catalog.load("queries").height == len(APPS)
    assert len(ws.catalog.history("episodes")) == 1  # an empty version, with its lineage


def test_a_late_attempt_of_a_committed_shard_changes_no_committed_row(ws, run_id):
    """A shard task of a run whose driver died, still running on a remote Dask worker, finishes after the rerun
    committed the stage: its files are its own, so the committed version reads as it did."""
    stage = make_stage([])
    p = plan(stage, ws, run_id, None)
    first = p.pending[0]
    for shard in p.pending:
        run_shard(p, shard, ws)
    committed = commit(p, ws)["queries"]
    before = ws.catalog.load("queries", committed)

    late = StageDef(**{**stage.__dict__, "run": lambda units, w, r, h: _relabelled(stage.run(units, w, r, h))})
    run_shard(plan(late, ws, run_id, None), first, ws)
    assert ws.catalog.load("queries", committed).equals(before)


def test_a_once_stage_whose_units_another_run_did_meanwhile_is_planned_again_not_written_twice(ws, run_id):
    """The night planned the seven units and crashed; `trajforge run demo` by hand did all seven and committed.
    The night's resume plans again (nothing is left to do) rather than commit its recorded shards, which would
    write those units' rows a second time."""
    calls: list[str] = []
    p = plan(once(make_stage(calls, fail_on="app5")), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    run_all(once(make_stage(calls)), ws, f"{run_id}-by-hand")
    snapshots = run_all(once(make_stage(calls)), ws, run_id)
    assert sorted(ws.catalog.load("queries")["app"]) == APPS
    assert ws.catalog.lineage("queries", snapshots["queries"]).stats == {
        "already done by an earlier run with this configuration": len(APPS)}


def test_a_ledger_made_by_older_code_takes_the_stage_columns_added_since(tmp_path, run_id):
    """A ledger outlives code versions: the stage columns added later (a once stage's plan, the inputs read) are
    added to it, NOT NULL with '{}' for its rows, and a stage planned on it afterwards writes none of them NULL."""
    import sqlalchemy as sa

    from trajforge.data.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url).engine.begin() as conn:  # the table as code before those columns made it
        for column in ("planned", "inputs"):
            conn.execute(sa.text(f"ALTER TABLE trajforge_stages DROP COLUMN {column}"))
    ledger = Ledger(url)
    run = ledger.open_run("nightly", run_id).run_id
    ledger.plan_stage(run, "critics", 2, inputs={"steps": 7})
    ledger.plan_stage(run, "reasoning", 1, ["unit-1"])
    assert ledger.planned_units(run, "critics") is None and ledger.planned_units(run, "reasoning") == {"unit-1"}
    assert ledger.unfinished_inputs() == {"steps": {7}}


def test_a_run_crashed_under_older_code_resumes_on_a_ledger_that_records_each_shards_code_and_inputs(tmp_path,
                                                                                                     run_id):
    """The shards a run recorded before the ledger kept each one's code version and inputs: the upgrade adds the
    columns, NULL for those rows, and the resume's lineage says their code version was not recorded rather than
    give them its own."""
    from trajforge.data.ledger import Ledger

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh", "namespace": "t"}))
    p = plan(make_stage([], fail_on="app4"), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    with ws.ledger.engine.begin() as conn:  # the shards as code before those columns recorded them
        for column in ("code_version", "inputs"):
            conn.execute(sa.text(f"ALTER TABLE trajforge_shards DROP COLUMN {column}"))
    Ledger(str(ws.ledger.engine.url)).engine.dispose()  # the upgraded code's first open of the ledger
    assert {(r.code_version, r.inputs) for r in ws.ledger.shards_done(run_id, "demo")} == {(None, None)}
    snapshots = run_all(make_stage([]), ws, run_id)
    assert ws.catalog.lineage("queries", snapshots["queries"]).code_version == f"{code_version()},unrecorded"
    ws.catalog.close()


def test_a_resume_with_a_new_prompt_version_names_both_in_the_lineage(ws, run_id):
    """Shards done before a crash used prompt 1, the resume's prompt 2: the rows are of both, and the lineage had
    named one of them, whichever shard came last."""
    calls: list[str] = []
    version = {"test": "1"}

    def versioned(stage: StageDef) -> StageDef:
        def run(units, ws, run_id, config_hash):
            out = stage.run(units, ws, run_id, config_hash)
            out.prompts = dict(version)
            return out
        return dataclasses.replace(stage, run=run)

    p = plan(versioned(make_stage(calls, fail_on="app4")), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    version["test"] = "2"
    snapshots = run_all(versioned(make_stage(calls)), ws, run_id)
    assert ws.catalog.lineage("queries", snapshots["queries"]).prompts == {"test": "1,2"}


def test_a_resume_after_a_code_fix_names_both_code_versions_in_the_lineage(ws, run_id, monkeypatch, request):
    """A night crashed on a bug and the fix was installed before the rerun, which resumed it (a run's identity
    leaves the code out): half the rows are the old release's, and the lineage named the fix's version only."""
    import trajforge.llm.workspace as workspace

    def installed(release: str) -> str:
        monkeypatch.setattr(workspace, "version", lambda name: release)  # the installed package's metadata
        workspace.code_version.cache_clear()
        return workspace.code_version()

    request.addfinalizer(workspace.code_version.cache_clear)
    calls: list[str] = []
    old = installed("1.0")
    p = plan(make_stage(calls, fail_on="app4"), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    fixed = installed("1.1")
    snapshots = run_all(make_stage(calls), ws, run_id)
    assert ws.catalog.lineage("queries", snapshots["queries"]).code_version == f"{old},{fixed}"


def side_input(stage: StageDef, verdicts: dict[str, int]) -> StageDef:
    """The stage reading the version of a side input that `verdicts` names when it plans (`verdicts@latest`)."""
    return dataclasses.replace(
        stage, load=lambda ws, snap: Inputs(units=list(APPS), snapshots=dict(verdicts), fingerprint="f"))


def test_a_resume_whose_side_input_moved_names_every_version_its_shards_read(ws, run_id):
    """Verdicts moved between the crash and the resume: two shards read version 111, two read 222, and the
    lineage named 222 alone, so nothing explained the first rows (nor kept 111 once the run finished)."""
    verdicts = {"verdicts": 111}
    p = plan(side_input(make_stage([], fail_on="app4"), verdicts), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    verdicts["verdicts"] = 222
    lineage = ws.catalog.lineage("queries", run_all(side_input(make_stage([]), verdicts), ws, run_id)["queries"])
    assert lineage.inputs == {"verdicts": 222}
    assert lineage.inputs_read == {"verdicts": [111, 222]} and lineage.stats == {}


def test_a_resume_that_only_commits_names_the_input_versions_its_shards_read(ws, run_id):
    """Every shard ran before the crash, on verdicts 111; the resume plans on 222 and only commits: the rows are
    all of 111, which the lineage must name (it named 222, which no row came from)."""
    verdicts = {"verdicts": 111}
    p = plan(side_input(make_stage([]), verdicts), ws, run_id, None)
    for shard in p.pending:
        run_shard(p, shard, ws)
    verdicts["verdicts"] = 222
    lineage = ws.catalog.lineage("queries", run_all(side_input(make_stage([]), verdicts), ws, run_id)["queries"])
    assert lineage.inputs == {"verdicts": 111} and lineage.inputs_read == {}


def _relabelled(out: StageOutput) -> StageOutput:
    out.rows["queries"] = [{**q, "instruction": "done late"} for q in out.rows["queries"]]
    return out


def test_lineage_names_inputs_config_models_and_counts(ws, run_id):
    snapshots = run_all(make_stage([]), ws, run_id)
    lineage = ws.catalog.lineage("queries", snapshots["queries"])
    assert lineage.stage == "demo" and lineage.run_id == run_id
    assert lineage.kept == {"queries": len(APPS)}
    assert lineage.dropped == {"too easy": 4}
    assert lineage.models == {"policy": "test-model"} and lineage.prompts == {"test": "1"}
    assert lineage.code_version == code_version()
    assert len(lineage.config_hash) == 16
    other = Workspace.open(ws.settings.model_copy(update={"query_gen": ws.settings.query_gen.model_copy(update={"seed": 5})}))
    assert plan(make_stage([]), other, run_id + "-b", None).config_hash != lineage.config_hash


def test_bad_row_fails_the_shard_naming_table_row_and_field(ws, run_id):
    stage = make_stage([], bad_row="app3")
    p = plan(stage, ws, run_id, None)
    with pytest.raises(RowError, match=r"table 'queries', row 1 \(query_id=q-app3\): field 'max_steps'"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    done = ws.ledger.shards_done(run_id, "demo")
    assert len(done) == 1  # the shard before the bad one is kept


def test_stats_are_summed_into_lineage_apart_from_drops(ws, run_id):
    stage = make_stage([])
    counting = StageDef(**{**stage.__dict__, "run": lambda units, w, r, h: _with_stats(stage.run(units, w, r, h))})
    snapshots = run_all(counting, ws, run_id)
    lineage = ws.catalog.lineage("queries", snapshots["queries"])
    assert lineage.stats == {"coverage: pages used": 4} and lineage.dropped == {"too easy": 4}


def _with_stats(out: StageOutput) -> StageOutput:
    out.stats["coverage: pages used"] += 1
    return out


def once(stage: StageDef, fingerprint: str = "f") -> StageDef:
    """The stage doing each unit once per configuration (`StageDef.once`); the fingerprint stands for its config."""
    return dataclasses.replace(stage, once=True,
                               load=lambda ws, snap: Inputs(units=list(APPS), fingerprint=fingerprint))


def test_a_once_stage_does_each_unit_once_per_configuration(ws, run_id):
    """A crash and its resume do every unit once; a later run with the same configuration does none again and
    says so; another configuration does them all."""
    calls: list[str] = []
    p = plan(once(make_stage(calls, fail_on="app4")), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    run_all(once(make_stage(calls)), ws, run_id)  # the run's own units are not work done before
    assert sorted(set(calls)) == APPS and ws.catalog.load("queries").height == len(APPS)

    calls.clear()
    later = run_all(once(make_stage(calls)), ws, f"{run_id}-later")
    assert calls == [] and ws.catalog.load("queries").height == len(APPS)
    lineage = ws.catalog.lineage("queries", later["queries"])
    assert lineage.stats == {"already done by an earlier run with this configuration": len(APPS)}

    run_all(once(make_stage(calls), fingerprint="g"), ws, f"{run_id}-changed")
    assert sorted(calls) == APPS and ws.catalog.load("queries").height == 2 * len(APPS)


def test_a_unit_done_again_replaces_the_rows_earlier_runs_wrote_for_it(ws, run_id):
    """With `StageDef.replaces` (the export's episodes), a unit done again under another configuration takes its
    earlier rows out in the commit that adds its new ones, also after a crash and its resume; units not done
    again keep theirs, and the version before keeps every row."""
    calls: list[str] = []

    def replacing(fingerprint: str, units: list[str], fail_on: str | None = None) -> StageDef:
        stage = once(make_stage(calls, fail_on=fail_on), fingerprint)
        return dataclasses.replace(stage, replaces=("app", str),
                                   load=lambda ws, snap: Inputs(units=units, fingerprint=fingerprint))

    first = run_all(replacing("f", APPS), ws, run_id)
    again = APPS[:3]
    p = plan(replacing("g", again, fail_on="app2"), ws, f"{run_id}-again", None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    later = run_all(replacing("g", again), ws, f"{run_id}-again")

    rows = ws.catalog.load("queries")
    assert sorted(rows["app"]) == APPS
    assert dict(rows.select("app", "run_id").iter_rows()) == {a: f"{run_id}-again" if a in again else run_id
                                                             for a in APPS}
    assert ws.catalog.load("queries", first["queries"]).height == len(APPS)
    assert ws.catalog.history("queries")[-1].snapshot_id == later["queries"]
    assert ws.catalog.history("queries")[-1].removed_rows == len(again)

    with pytest.raises(ValueError, match=r"replaces rows by 'step_id', which table\(s\) \['queries', 'episodes'\]"):
        plan(dataclasses.replace(replacing("h", APPS), replaces=("step_id", str)), ws, f"{run_id}-bad", None)


def test_shards_are_as_even_as_their_size_allows_and_keep_the_units_order(ws, run_id):
    """Shards run at once (grounding's, Dask's) end together: 7 units at 5 a shard are 4 and 3, not 5 and 2;
    none is larger than the size, and a plan of the same units makes the same shards (a rerun resumes them)."""
    stage = dataclasses.replace(make_stage([]), shard_size=lambda s: 5)
    p = plan(stage, ws, run_id, None)
    assert [shard.units for shard in p.pending] == [APPS[:4], APPS[4:]]
    assert plan(stage, ws, run_id, None).shard_ids == p.shard_ids
    sizes = {n: [len(shard.units) for shard in plan(dataclasses.replace(stage, shard_size=lambda s, n=n: n), ws,
                                                             f"{run_id}-{n}", None).pending] for n in (1, 3, 7, 8)}
    assert sizes == {1: [1] * 7, 3: [3, 2, 2], 7: [7], 8: [7]}


def _end_writer(ws: Workspace) -> None:
    """End the server process holding the warehouse's lock, as an administrator, a server timeout or a proxy
    dropping the connection would."""
    import sqlalchemy as sa

    with ws.ledger.engine.connect() as conn:
        ended = conn.execute(sa.text(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = :k"), {"k": ws.ledger.writer_key}).all()
    assert ended == [(True,)]


def test_a_run_that_lost_the_warehouse_commits_nothing_and_its_rerun_commits_once(postgres_url, tmp_path, run_id):
    from trajforge.data.ledger import LockLost

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh", "catalog_url": postgres_url,
                                            "namespace": f"t{uuid.uuid4().hex[:12]}"}))
    calls: list[str] = []
    stage = make_stage(calls)
    with pytest.raises(LockLost, match="lost its hold on the warehouse.*connection"):
        with ws.ledger.writing("demo"):
            p = plan(stage, ws, run_id, None)
            for shard in p.pending:
                run_shard(p, shard, ws)
            _end_writer(ws)
            commit(p, ws)
    assert ws.catalog.history("queries") == []  # nothing committed beside whoever holds the warehouse now
    with ws.ledger.writing("demo"):  # free again, and the rerun commits the recorded shards without redoing them
        run_all(stage, ws, run_id)
    assert sorted(ws.catalog.load("queries")["app"]) == APPS and calls == APPS
    ws.catalog.close()


def test_the_writer_lock_outlives_a_server_idle_session_timeout(postgres_url, monkeypatch):
    """A server (or role) with idle_session_timeout ends idle sessions; the run's lock connection is idle while
    it works, and must not be one of them."""
    from trajforge.data.ledger import Ledger

    monkeypatch.setenv("PGOPTIONS", "-c idle_session_timeout=300")  # as the server's own setting would be
    ledger = Ledger(postgres_url, scope=f"idle-{uuid.uuid4().hex[:8]}")
    with ledger.writing("demo"):
        time.sleep(1.0)
        ledger.check_writing()
    ledger.engine.dispose()


def test_a_once_stage_does_its_units_again_when_a_prompt_changes(ws, run_id, tmp_path, monkeypatch):
    """An edited prompt is new work even where the code version cannot tell (a checkout already dirty, an
    install without git)."""
    import trajforge.llm.prompts as prompts

    (tmp_path / "synth" / "prompts").mkdir(parents=True)
    template = tmp_path / "synth" / "prompts" / "demo.yaml"
    template.write_text("version: '1'\n")
    monkeypatch.setattr(prompts, "PACKAGE_ROOT", tmp_path)
    calls: list[str] = []
    run_all(once(make_stage(calls)), ws, run_id)
    run_all(once(make_stage(calls)), ws, f"{run_id}-same")
    assert calls == APPS
    template.write_text("version: '2'\n")
    run_all(once(make_stage(calls)), ws, f"{run_id}-edited")
    assert calls == APPS + APPS


def test_a_once_stage_resumed_after_a_code_or_prompt_fix_finishes_the_units_it_planned(ws, run_id, tmp_path,
                                                                                       monkeypatch):
    """An earlier run did three units; this run planned the four others and crashed; the crash was fixed (here a
    prompt, as a code change does: both are in what a unit is done with). The resume planned again under the new
    configuration, seven units in other shards than the ones recorded, and its commit refused them, on every
    rerun; it now finishes the four it planned."""
    import trajforge.llm.prompts as prompts

    (tmp_path / "synth" / "prompts").mkdir(parents=True)
    template = tmp_path / "synth" / "prompts" / "demo.yaml"
    template.write_text("version: '1'\n")
    monkeypatch.setattr(prompts, "PACKAGE_ROOT", tmp_path)
    calls: list[str] = []
    earlier = dataclasses.replace(once(make_stage(calls)),
                                  load=lambda ws, snap: Inputs(units=APPS[:3], fingerprint="f"))
    run_all(earlier, ws, f"{run_id}-earlier")
    p = plan(once(make_stage(calls, fail_on="app5")), ws, run_id, None)
    with pytest.raises(RuntimeError, match="worker died"):
        for shard in p.pending:
            run_shard(p, shard, ws)
    template.write_text("version: '2'\n")
    snapshots = run_all(once(make_stage(calls)), ws, run_id)
    assert sorted(ws.catalog.load("queries")["app"]) == APPS
    # Done by the earlier run with the configuration before the fix: this run's first plan left them out.
    assert ws.catalog.lineage("queries", snapshots["queries"]).stats == {
        "left out by this run's first plan of the stage": 3}


def test_a_unit_key_done_before_another_key_replaced_it_is_done_again(ws, run_id):
    """Export's keys are an episode and its verdict: rejected, accepted (its rows replaced), then rejected again
    must leave the last rejection's rows, not the acceptance's."""
    calls: list[str] = []

    def verdict(state: str) -> StageDef:
        def run(units, ws, run_id, config_hash):
            calls.extend(units)
            out = StageOutput()
            out.rows["queries"] = [query(run_id, u.split(":")[0]) | {"instruction": u} for u in units]
            out.rows["episodes"] = []
            return out

        return StageDef(name="verdicts-demo", key=str, reads=None, writes={"queries": "append", "episodes": "append"},
                        sections=("query_gen",), load=lambda ws, snap: Inputs(units=[f"app0:{state}"], fingerprint="f"),
                        run=run, shard_size=lambda s: 2, once=True, replaces=("app", lambda u: u.split(":")[0]))

    for i, state in enumerate(["rejected", "accepted", "rejected", "rejected"]):
        run_all(verdict(state), ws, f"{run_id}-{i}")
    assert calls == ["app0:rejected", "app0:accepted", "app0:rejected"]  # the last: done by the third already
    assert ws.catalog.load("queries")["instruction"].to_list() == ["app0:rejected"]


def test_a_fresh_run_sets_the_unfinished_one_aside_for_good(ws):
    """`run nightly --fresh` left the old unfinished run running: once the fresh run finished, the next plain run
    resumed the old one (its queries, its night's tag), and retention kept the old run's shard files for ever as
    those of a run still to be resumed."""
    from trajforge.data.ledger import ShardRecord

    identity, old_file = f"night-{uuid.uuid4().hex}", f"/old/{uuid.uuid4().hex}.parquet"
    old = ws.ledger.open_run("nightly", identity)
    ws.ledger.record_shard(old.run_id, "rollout", ShardRecord("s1", {"steps": [old_file]}, {}, {}, {}, {}, {}))
    fresh = ws.ledger.open_run("nightly", identity, fresh=True)
    ws.ledger.finish_run(fresh.run_id, {})
    again = ws.ledger.open_run("nightly", identity)
    assert not again.resumed and again.run_id not in (old.run_id, fresh.run_id)
    assert old.run_id not in ws.ledger.unfinished_runs() and old_file not in ws.ledger.unfinished_files()


def test_run_times_read_from_a_postgresql_session_in_another_zone_are_the_times_written(postgres_url):
    """PostgreSQL gives a timestamptz back in the session's TimeZone: taken as UTC, a server in America/New_York
    put a night started at 02:00 UTC under the day before's nightly tag and moved the report's stage windows."""
    from trajforge.data.ledger import Ledger

    ledger = Ledger(f"{postgres_url}?options=-c%20TimeZone%3DAmerica/New_York")
    try:
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.text("SHOW TimeZone")).scalar() == "America/New_York"
        identity = f"night-{uuid.uuid4().hex}"
        run = ledger.open_run("nightly", identity)
        assert ledger.get_run(run.run_id).started_at == run.started_at
        resumed = ledger.open_run("nightly", identity)
        assert resumed.resumed and resumed.started_at == run.started_at
    finally:
        ledger.engine.dispose()

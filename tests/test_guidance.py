"""Hard-query selection, guidance distillation and its inputs, without a browser.

The template describer is checked on recorded steps; one test asks the embedded model
(two calls) to show the default describer's rows name the model, prompts and how it saw
the screens.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from conftest import prompt_versions, require
from PIL import Image
from scripted import Reply, ScriptedServer, message_text

from trajforge.data.blobs import BlobStore
from trajforge.envs.browser import Observation
from trajforge.guidance.distill import Describer, guidance_row, rule_check
from trajforge.guidance.history import hardness
from trajforge.guidance.stage import HardQuery, guide, load_demonstrations
from trajforge.llm import Gateway
from trajforge.llm.local import missing_models
from trajforge.rollout.gui_owl import GuiOwlPolicy, ToolCall, to_action, to_call
from trajforge.schemas.config import LLMSettings, Settings
from trajforge.schemas.records import Query

T0 = datetime(2026, 11, 1, tzinfo=UTC)
TREE_HOME = 'RootWebArea "Home" (0,0,412,915)\n  link "Settings" (10,10,80,30)\n  link "Cart" (100,10,60,30)'
TREE_SETTINGS = ('RootWebArea "Settings" (0,0,412,915)\n  heading "Settings" (10,10,200,40)\n'
                 '  button "Save" (10,90,80,40)')


def at(*results: bool) -> list[tuple[datetime, bool]]:
    return [(T0 + timedelta(days=i), ok) for i, ok in enumerate(results)]


def step(index: int, action_type: str = "click", *, thought: str = "", target: str | None = "Settings",
         after: str = TREE_SETTINGS, title_after: str = "Settings", valid: bool = True,
         before_png: str | None = None, after_png: str | None = None) -> dict:
    return {
        "step_index": index, "action_type": action_type, "action_json": json.dumps({"x": 40, "y": 25}),
        "thought": thought, "target_role": "link" if target else None, "target_name": target,
        "target_box": [10.0, 10.0, 80.0, 30.0] if target else None, "action_valid": valid,
        "url_before": "http://app/", "url_after": "http://app/settings" if title_after != "Home" else "http://app/",
        "title_before": "Home", "title_after": title_after, "ax_tree_before": TREE_HOME, "ax_tree_after": after,
        "screenshot_before": before_png, "screenshot_after": after_png,
    }


def test_a_query_is_hard_when_it_never_succeeded_or_its_recent_rate_is_low():
    assert hardness(at(False, False), window=3, below=0.5).hard
    assert "never succeeded in 2" in hardness(at(False, False), window=3, below=0.5).reason
    # One old success, then three failures: the last 3 attempts say 0/3.
    recent = hardness(at(True, False, False, False), window=3, below=0.5)
    assert recent.hard and recent.recent_rate == 0 and recent.successes == 1
    assert not hardness(at(False, True, True), window=3, below=0.5).hard
    assert not hardness([], window=3, below=0.5).hard  # never tried: nothing says it is hard yet
    # Order of the rows does not matter; time does.
    assert hardness(list(reversed(at(True, False, False, False))), window=3, below=0.5).hard
    # A night's attempts share one judged_at: they count as a whole night, in no order, not successes last.
    night = datetime(2026, 1, 5, tzinfo=UTC)
    same = hardness([(night, ok) for ok in (True, True, False, False, False)], window=3, below=0.5)
    assert same.hard and same.recent_rate == 0.4


def test_quality_control_drops_steps_that_did_not_do_what_the_thought_said():
    assert rule_check(step(0, thought="click the link 'Settings'")) is None
    assert "no visible change" in rule_check(step(0, after=TREE_HOME, title_after="Home"))
    scrolled = TREE_HOME.replace("(10,10,80,30)", "(10,-300,80,30)")
    assert rule_check(step(0, "swipe", after=scrolled, title_after="Home", target=None)) is None
    assert "invalid action" in rule_check(step(0, valid=False))
    assert "ends the episode" in rule_check(step(0, "terminate"))
    assert "aimed at 'Cart'" in rule_check(step(0, thought="open the 'Cart'", target="Settings"))


def test_template_guidance_names_essential_steps_references_and_drops(tmp_path):
    describer = Describer(None, BlobStore(tmp_path))
    refs = [("replay:a", [step(0, thought="click 'Settings'"), step(1, "terminate", target=None)]),
            ("rollout:b", [step(0, thought="click 'Settings'"), step(1, after=TREE_SETTINGS, title_after="Settings",
                                                                     thought="click 'Cart'"),
                           step(2, "terminate", target=None)])]
    query = {"query_id": "q1", "instruction": "Open the settings"}
    row, _ = guidance_row(query, refs, "never succeeded in 2 attempt(s)", describer, run_id="r", max_steps=8)
    assert row is not None
    assert row.references == ["replay:a", "rollout:b"]
    assert row.essential_steps == [("click on link 'Settings': the screen changed from 'Home' to 'Settings'; "
                                    "now showing heading \"Settings\", button \"Save\"")]
    assert all(s in row.text for s in row.essential_steps) and "1. click on link 'Settings'" in row.text
    dropped = json.loads(row.dropped_steps_json)
    assert {(d["entry_id"], d["step_index"]) for d in dropped} == {("replay:a", 1), ("rollout:b", 1), ("rollout:b", 2)}
    assert all(d["reason"] for d in dropped)
    assert row.describer == "template" and row.observation_mode == "ax-diff" and row.prompt_version == "none"
    capped, _ = guidance_row(query, refs, "never", describer, run_id="r", max_steps=1)
    cut = {"entry_id": "rollout:b", "step_index": 2, "reason": "beyond guidance.max_reference_steps (1): not looked at"}
    assert cut in json.loads(capped.dropped_steps_json)


def test_guide_counts_queries_it_could_not_guide(tmp_path):
    unit = {"query_id": "q", "run_id": "r0", "app": "shop", "source": "page_graph", "instruction": "Open the settings",
            "path": ["home"], "slots_json": "{}", "checker": "on_page", "checker_params_json": "{}", "max_steps": 5,
            "generator": "t", "created_at": T0, "actions_json": None, "attempts": 1, "successes": 0}
    units = [HardQuery(Query(**unit), "never", True, []),
             HardQuery(Query(**unit | {"query_id": "q2"}), "never", False, [])]
    out = guide(units, run_id="r", describer=Describer(None, BlobStore(tmp_path)), replay=None, max_steps=8)
    assert out.rows["guidance"] == []
    assert out.dropped == {"hard, but over loop.max_guided this run": 1,
                           "no reference trajectory (none in the replay buffer, none replayed or demonstrated)": 1}


def test_demonstrations_file_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "demos.jsonl"
    good = {"query_id": "q", "instruction": "Open the settings",
            "steps": [{"action_type": "click", "thought": "open 'Settings'", "target_name": "Settings",
                       "title_before": "Home", "title_after": "Settings"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "steps": [{"action_type": "click"}]}) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl:2: field 'steps.0.thought': Field required"):
        load_demonstrations(path)
    path.write_text(json.dumps(good) + "\n")
    (entry,) = load_demonstrations(path)
    assert entry["origin"] == "human" and json.loads(entry["steps_json"])[0]["thought"] == "open 'Settings'"


def test_training_calls_invert_the_policy_parser():
    for action in ({"type": "click", "x": 10, "y": 20}, {"type": "swipe", "x": 1, "y": 2, "x2": 3, "y2": 4},
                   {"type": "wait", "seconds": 2}, {"type": "long_press", "x": 5, "y": 6, "duration": 1.5},
                   {"type": "type", "text": "hi"}, {"type": "terminate", "status": "success"}):
        call = to_call(action, "mobile_use")
        assert to_action(ToolCall.model_validate(call), "mobile_use") == action


def test_guidance_text_reaches_the_model_request(tmp_path):
    """The policy hands a query's guidance to the model: the request the server receives for a guided query
    carries the text, and one for a query without guidance carries none (no stale text from the last query)."""
    llm = LLMSettings.model_validate({"endpoints": {"m": {"base_url": "", "model": "scripted", "max_retries": 0,
                                                          "timeout_s": 5, "vision": True}},
                                      "default": "m", "reask": 0, "cache": False})
    answer = '<tool_call>{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [10, 20]}}</tool_call>'
    screen = Observation(png=_png((255, 255, 255)), width=412, height=915, url="/", title="t", nodes=())
    with ScriptedServer(Reply(answer)) as server:
        llm.endpoints["m"].base_url = server.url
        with Gateway(llm, blobs=BlobStore(tmp_path / "blobs")) as gateway:
            policy = GuiOwlPolicy(gateway, viewport="mobile", guidance={"q": "1. click on link 'Settings'"})
            for query_id in ("q", "other"):
                policy.reset(Query.model_construct(query_id=query_id, instruction="Open the settings"))
                assert policy.act(screen, None).action == {"type": "click", "x": 10, "y": 20}
    guided, unguided = (message_text(r["body"]["messages"][-1]) for r in server.requests)
    assert "Guidance for this task: 1. click on link 'Settings'" in guided
    assert "Task: Open the settings" in unguided and "Guidance for this task" not in unguided


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (120, 80), color).save(buf, format="PNG")
    return buf.getvalue()


def test_model_describer_names_its_model_prompts_and_observation_mode(tmp_path):
    """The default describer on the embedded model: one outcome call and one summary call."""
    require(not missing_models(), f"embedded model missing: {missing_models()}")
    blobs = BlobStore(tmp_path / "wh" / "blobs")  # the warehouse's blobs, which the gateway reads
    before, after = blobs.put(_png((255, 255, 255))).sha256, blobs.put(_png((0, 0, 0))).sha256
    settings = Settings(warehouse={"path": tmp_path / "wh"}, llm={"reask": 0})
    with Gateway.from_settings(settings) as gateway:
        describer = Describer(gateway, blobs)
        refs = [("replay:a", [step(0, thought="click 'Settings'", before_png=before, after_png=after),
                              step(1, "terminate", target=None)])]
        row, distilled = guidance_row({"query_id": "q", "instruction": "Open the settings"}, refs, "never",
                                      describer, run_id="r", max_steps=8)
    outcomes = distilled.outcomes
    assert len(outcomes) == 2 and outcomes[0]["outcome"]  # described by the model or, unparsed, from the record
    assert distilled.model_id != "template" and distilled.observation_mode.startswith("ocr")
    assert row is not None  # the click opened Settings as its thought meant: a step is kept, a row written
    assert row.describer == distilled.model_id
    assert row.prompt_version == prompt_versions("guidance_outcome", "guidance_summary")
    assert row.text.split("\nEssential steps:\n")[0]  # the model's summary comes first


def test_rollout_run_alone_finds_the_guidance_written_for_its_queries_version(tmp_path):
    """Stage by stage, three runs: `history` writes the queries version, `guidance` (another run) guides it, and
    `rollout` (a third) must hand that guidance to the prompt; a later queries version no guidance read gets none."""
    from trajforge.data.catalog import Lineage
    from trajforge.llm.workspace import Workspace
    from trajforge.rollout.stage import load_queries
    from trajforge.schemas.records import Guidance

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))

    def lineage(run: str, stage: str, table: str, **inputs: int) -> Lineage:
        return Lineage(stage=stage, run_id=run, commit_key=f"{run}:{stage}:{table}", inputs=inputs,
                       config_hash="x", code_version="x")

    def queries(run: str) -> int:
        row = Query(run_id=run, query_id="q1", app="shop", source="page_graph", instruction="Open the cart",
                    path=["home", "cart"], slots_json="{}", checker="url", checker_params_json="{}", max_steps=5,
                    generator="test", created_at=T0)
        return ws.catalog.commit_rows("queries", [row], lineage(run, "history", "queries"), mode="overwrite")

    first = queries("history-run")
    guide_row = Guidance(run_id="guidance-run", guidance_id="g1", query_id="q1", instruction="Open the cart",
                         text="click 'Cart'", essential_steps=["click 'Cart'"], references=["e1"],
                         dropped_steps_json="[]", outcomes_json="[]", describer="template", prompt_version="none",
                         observation_mode="ax-diff", hard_reason="never succeeded")
    guided = ws.catalog.commit_rows("guidance", [guide_row], lineage("guidance-run", "guidance", "guidance",
                                                                     queries=first))
    inputs = load_queries(ws, first)
    [unit] = inputs.units
    assert unit.guidance is not None and (unit.guidance.guidance_id, unit.guidance.text) == ("g1", "click 'Cart'")
    assert inputs.snapshots == {"queries": first, "guidance": guided}  # the rollout's lineage names it
    later = queries("history-run-2")
    assert load_queries(ws, later).units[0].guidance is None


def test_a_hard_query_is_guided_from_its_newest_references(tmp_path):
    """The two newest replay-buffer entries by when their run started: not by the run id's flow name (every
    `reference-...` run sorted before any `nightly-...` one whatever its date)."""
    from trajforge.data.catalog import Lineage
    from trajforge.guidance.stage import load_hard_queries
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.records import QueryAttempt, ReplayEntry

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))

    def commit(table: str, rows: list, run: str) -> int:
        return ws.catalog.commit_rows(table, rows, Lineage(stage="test", run_id=run, commit_key=f"{run}:{table}",
                                                           inputs={}, config_hash="x", code_version="x"))

    query = Query(run_id="q-run", query_id="q1", app="shop", source="page_graph", instruction="Open the cart",
                  path=["home", "cart"], slots_json="{}", checker="url", checker_params_json="{}", max_steps=5,
                  generator="test", created_at=T0)
    queries = commit("queries", [query], "q-run")
    commit("query_history", [QueryAttempt(run_id="h", episode_id="e0", query_id="q1", app="shop", source="page_graph",
                                          iteration=0, policy="random", model_id="m", success=False, judged_at=T0)],
           "h")
    runs = ["nightly-20261103T020000-aaaaaa", "reference-20261101T020000-bbbbbb", "nightly-20261110T020000-cccccc"]
    for run in runs:
        commit("replay_buffer", [ReplayEntry(run_id=run, entry_id=f"replay:{run}", query_id="q1", origin="replay",
                                             episode_id=run, instruction="Open the cart", steps_json="[]")], run)
    [unit] = load_hard_queries(ws, queries).units
    assert [r["run_id"] for r in unit.references] == [runs[2], runs[0]]


def test_an_unparsed_describer_answer_is_kept_beside_the_rules_judgement(tmp_path):
    """The rules decide a step whose describer answer did not parse; the outcome says so and keeps the answer,
    rather than pass as a judgement the model made."""
    from scripted import Reply, ScriptedServer

    from trajforge.schemas.config import LLMSettings

    blobs = BlobStore(tmp_path / "blobs")
    before, after = blobs.put(_png((255, 255, 255))).sha256, blobs.put(_png((0, 0, 0))).sha256
    with ScriptedServer(Reply(text="It worked, I think.")) as server:
        llm = LLMSettings.model_validate({"endpoints": {"vl": {"base_url": server.url, "model": "scripted-vl",
                                                                "vision": True, "max_retries": 0, "timeout_s": 5}},
                                          "reask": 0, "cache": False})
        with Gateway(llm, blobs=blobs) as gateway:
            distilled = Describer(gateway, blobs, model="vl").distill(
                "Open the settings", [("replay:a", [step(0, thought="click 'Settings'", before_png=before,
                                                         after_png=after)])])
    [outcome] = distilled.outcomes
    assert outcome["kept"] and outcome["describer_raw"] == "It worked, I think."
    assert outcome["describer_error"].startswith("not one JSON object")
    assert distilled.stats == {"outcome answers that did not parse: recorded changes used, rules decided": 1}


def test_a_swipe_or_scroll_is_not_held_to_the_element_under_the_finger():
    """The replay swipes or scrolls to bring an element into view and names that element; what the recorded target
    holds is whatever was under the finger's start point. Quality control keeps such steps, or the guidance would
    send the policy to click an element still off screen."""
    scrolled = TREE_HOME.replace("(100,10,60,30)", "(100,-300,60,30)")
    thought = "transition 1/1 (home -> cart), action 1/1: the link 'Cart' is off screen; swipe to bring it into view."
    for kind in ("swipe", "scroll"):
        assert rule_check(step(0, kind, thought=thought, target="Settings", after=scrolled, title_after="Home")) is None
    # A click still answers for what it hit.
    assert "aimed at 'Cart'" in rule_check(step(0, thought="click the link 'Cart'", target="Settings"))


def test_guidance_follows_the_shortest_reference_not_the_one_quality_control_cut_most(tmp_path):
    """The essential steps come from the reference with the fewest steps of its own (valid ones, terminate aside),
    ties to the one with fewer steps dropped: not from the one with the fewest steps left after quality control."""
    describer = Describer(None, BlobStore(tmp_path))
    tree_saved = TREE_SETTINGS.replace('button "Save" (10,90,80,40)', 'text "Saved" (10,90,80,40)')
    save = step(1, thought="click 'Save'", target="Save", after=tree_saved, title_after="Saved")
    short = [step(0, thought="click 'Settings'"), save, step(2, "terminate", target=None)]
    # Four steps of its own, three of which did nothing visible: one step kept, the route's Save lost.
    long = [step(0, thought="click 'Settings'"),
            *(step(i, thought="click 'Settings'", after=TREE_HOME, title_after="Home") for i in (1, 2, 3)),
            step(4, "terminate", target=None)]
    query = {"query_id": "q1", "instruction": "Save the settings"}
    row, _ = guidance_row(query, [("rollout:long", long), ("replay:short", short)], "never", describer, run_id="r",
                          max_steps=8)
    assert row is not None and len(row.essential_steps) == 2
    assert row.essential_steps[1].startswith("click on link 'Save'")
    # As short as the other, but quality control dropped a step of it (it hit the wrong element).
    wrong = [step(0, thought="click 'Settings'"), step(1, thought="click 'Save'", target="Cart", after=tree_saved,
                                                       title_after="Saved"), step(2, "terminate", target=None)]
    row, _ = guidance_row(query, [("rollout:wrong", wrong), ("replay:short", short)], "never", describer,
                          run_id="r", max_steps=8)
    assert row is not None and len(row.essential_steps) == 2


def test_a_nights_samples_count_whole_whatever_their_order():
    """One night's samples share one judged_at: the recent window takes that night whole, so which sample indices
    failed does not decide whether the query is hard."""
    night = datetime(2026, 1, 5, tzinfo=UTC)
    results = [True] * 5 + [False] * 3  # 5 of 8 samples succeeded
    for order in (results, list(reversed(results))):
        h = hardness([(night, ok) for ok in order], window=3, below=0.5)
        assert not h.hard and h.recent_rate == 5 / 8, h
        assert h.reason == "success rate 0.62 over the last 8"
    # An older night counts only while the newer ones hold fewer attempts than the window.
    older = [(night - timedelta(days=1), False)] * 4
    assert hardness(older + [(night, ok) for ok in results], window=8, below=0.5).recent_rate == 5 / 8
    assert hardness(older + [(night, ok) for ok in results], window=9, below=0.5).recent_rate == 5 / 12


def test_a_demonstration_tree_that_does_not_parse_stops_the_load_naming_line_and_field(tmp_path):
    """Quality control parses a step's trees, perhaps nights after the file was read: a tree it cannot read is
    refused when the file is loaded (the preflight), with the file, line and field."""
    path = tmp_path / "demos.jsonl"
    good = {"query_id": "q", "instruction": "Open the settings",
            "steps": [{"action_type": "click", "thought": "open 'Settings'", "ax_tree_before": TREE_HOME,
                       "ax_tree_after": TREE_SETTINGS}]}
    bad = {**good, "steps": [{**good["steps"][0], "ax_tree_after": "the settings page"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl:2: field 'steps.0.ax_tree_after': .*not a line of a rendered"):
        load_demonstrations(path)


def _unit(query_id: str = "q") -> Query:
    return Query(run_id="r0", query_id=query_id, app="shop", source="page_graph", instruction="Open the settings",
                 path=["home"], slots_json="{}", checker="on_page", checker_params_json="{}", max_steps=5,
                 generator="t", created_at=T0)


def test_a_failed_replay_is_counted_once(tmp_path):
    """A query whose reference replay the checker rejects is counted under that reason, not also as having no
    reference: the lineage's drops add up to the queries dropped."""
    from trajforge.schemas.records import Episode

    def replay(queries: list[Query]) -> list:
        return [(Episode(run_id="r", episode_id="e", query_id=q.query_id, app=q.app, instruction=q.instruction,
                         policy="replay", model_id="replay", prompt_version="none", viewport="mobile",
                         status="terminated", num_steps=1, final_url="", final_state_json="{}", started_at=T0,
                         finished_at=T0), [], False)
                for q in queries]

    out = guide([HardQuery(_unit(), "never", True, [])], run_id="r", describer=Describer(None, BlobStore(tmp_path)),
                replay=replay, max_steps=8)
    assert out.dropped == {"reference path replayed but the checker says it failed": 1}


def _warehouse(tmp_path, **settings):
    from trajforge.data.catalog import Lineage
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.records import QueryAttempt

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, **settings))

    def commit(table: str, rows: list, run: str) -> int:
        return ws.catalog.commit_rows(table, rows, Lineage(stage="test", run_id=run, commit_key=f"{run}:{table}",
                                                           inputs={}, config_hash="x", code_version="x"))

    commit("query_history", [QueryAttempt(run_id="h", episode_id="e0", query_id="q", app="shop", source="page_graph",
                                          iteration=0, policy="random", model_id="m", success=False, judged_at=T0)],
           "h")
    return ws, commit, commit("queries", [_unit().model_copy(update={"run_id": "q-run"})], "q-run")


def test_a_demonstration_already_in_the_buffer_is_used_once(tmp_path):
    """The first guided night puts a demonstration into the replay buffer; from the second it is among the newest
    buffer entries, and must not come again from the file."""
    from trajforge.guidance.stage import load_hard_queries
    from trajforge.schemas.records import ReplayEntry

    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"query_id": "q", "instruction": "Open the settings",
                                 "steps": [{"action_type": "click", "thought": "open 'Settings'"}]}) + "\n")
    ws, commit, queries = _warehouse(tmp_path, guidance={"demonstrations": demos})
    [demo] = load_demonstrations(demos)
    [unit] = load_hard_queries(ws, queries).units
    assert [(r["entry_id"], r["new"]) for r in unit.references] == [(demo["entry_id"], True)]  # the first night
    run = "nightly-20261103T020000-aaaaaa"
    commit("replay_buffer", [ReplayEntry(**demo | {"run_id": run})], run)
    [unit] = load_hard_queries(ws, queries).units
    assert [r["entry_id"] for r in unit.references] == [demo["entry_id"]]


def test_references_come_from_the_rollouts_viewport_while_there_are_any(tmp_path):
    """The reference stage records each query on a phone and on a desktop, under one query id: a mobile rollout is
    guided by the phone's route (its swipes) while one exists, by the desktop's only without one."""
    from trajforge.guidance.stage import load_hard_queries
    from trajforge.schemas.records import Episode, ReplayEntry

    ws, commit, queries = _warehouse(tmp_path, rollout={"viewport": "mobile"})
    run = "reference-20261101T020000-bbbbbb"

    def recorded(viewport: str, episode_id: str) -> None:
        commit("episodes", [Episode(run_id=run, episode_id=episode_id, query_id="q", app="shop",
                                    instruction="Open the settings", policy="replay", model_id="replay",
                                    prompt_version="none", viewport=viewport, status="terminated", num_steps=1,
                                    final_url="", final_state_json="{}", started_at=T0, finished_at=T0,
                                    source="reference")], f"{run}-{episode_id}")
        commit("replay_buffer", [ReplayEntry(run_id=run, entry_id=f"replay:{episode_id}", query_id="q",
                                             origin="replay", episode_id=episode_id, instruction="Open the settings",
                                             steps_json="[]")], f"{run}-{episode_id}")

    recorded("desktop", "z-desktop")  # sorts first by entry id
    [unit] = load_hard_queries(ws, queries).units
    assert [r["entry_id"] for r in unit.references] == ["replay:z-desktop"]  # none on a phone: the desktop's
    recorded("mobile", "a-mobile")
    inputs = load_hard_queries(ws, queries)
    assert [r["entry_id"] for r in inputs.units[0].references] == ["replay:a-mobile"]
    assert "episodes" in inputs.snapshots


def test_a_secret_in_a_demonstration_is_kept_as_its_placeholder(tmp_path, monkeypatch):
    """A person types the password itself where a policy types its placeholder, and a recorded page may show a
    code in pieces: loading the file masks them, so no buffer row, guidance text or prompt holds the value."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", "harbor-Tide-8312")
    monkeypatch.setenv("TRAJFORGE_SECRET_RECOVERY_CODE", "481-S3CR3T")
    shown = 'RootWebArea "Code" (0,0,412,915)\n  text "Your code: 481-" (10,10,90,20)\n  text "S3CR3T" (100,10,50,20)'
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"query_id": "q", "instruction": "Sign in with harbor-Tide-8312", "steps": [
        {"action_type": "type", "action_json": json.dumps({"text": "harbor-Tide-8312"}),
         "thought": "type the password harbor-Tide-8312", "title_before": "Home", "title_after": "Settings",
         "ax_tree_before": TREE_HOME, "ax_tree_after": shown}]}) + "\n")
    [entry] = load_demonstrations(path)
    assert "harbor-Tide-8312" not in json.dumps(entry) and "S3CR3T" not in entry["steps_json"], entry
    [demo_step] = json.loads(entry["steps_json"])
    assert json.loads(demo_step["action_json"]) == {"text": "<secret>account_password</secret>"}
    assert demo_step["thought"] == "type the password <secret>account_password</secret>"
    assert entry["instruction"] == "Sign in with <secret>account_password</secret>"
    assert demo_step["ax_tree_after"] == ('RootWebArea "Code" (0,0,412,915)\n'
                                         '  text "Your code: <secret>recovery_code</secret>" (10,10,90,20)\n'
                                         '  text "<secret>recovery_code</secret>" (100,10,50,20)')
    out = guide([HardQuery(_unit(), "never", True, [entry | {"new": True}])], run_id="r",
                describer=Describer(None, BlobStore(tmp_path)), replay=None, max_steps=8)
    [row] = out.rows["guidance"]
    assert "<secret>account_password</secret>" in row.text and "harbor" not in row.text + row.outcomes_json
    assert "harbor" not in out.rows["replay_buffer"][0].steps_json


def test_a_demonstration_action_that_is_not_a_json_object_stops_the_load(tmp_path):
    """Quality control and the secrets' masking read an action's fields: an action that is not a JSON object is
    refused when the file is loaded, with the file, line and field."""
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"query_id": "q", "instruction": "Open the settings",
                                "steps": [{"action_type": "click", "action_json": "x=40", "thought": "open"}]}) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl:1: field 'steps.0.action_json': Value error"):
        load_demonstrations(path)


def test_history_tells_a_query_the_rollout_left_out_from_one_whose_episodes_all_faulted(tmp_path):
    """A query the rollout did not roll (left out as identical to earlier attempts, or dropped) has no judged
    episode, as one whose every episode was an environment fault: the history's counts say which it was."""
    from trajforge.data.catalog import Lineage, commit_key
    from trajforge.guidance.history import load_history_units, record
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.records import Episode, Verdict

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))

    def commit(table: str, rows: list, stage: str, **inputs: int) -> int:
        return ws.catalog.commit_rows(table, rows, Lineage(
            stage=stage, run_id="night", commit_key=commit_key("night", stage, table), inputs=inputs,
            config_hash="x", code_version="x"))

    def episode(query_id: str, status: str) -> Episode:
        return Episode(run_id="night", episode_id=f"e-{query_id}", query_id=query_id, app="shop",
                       instruction="Open the settings", policy="random", model_id="random", prompt_version="",
                       viewport="mobile", status=status, fault_kind="timeout" if status == "env_fault" else None,
                       num_steps=1, final_url="", final_state_json="{}", started_at=T0, finished_at=T0)

    queries = commit("queries", [_unit(q) for q in ("judged", "faulted", "left-out")], "history")
    episodes = commit("episodes", [episode("judged", "terminated"), episode("faulted", "env_fault")], "rollout",
                      queries=queries)
    commit("steps", [], "rollout", queries=queries)
    commit("verdicts", [Verdict(run_id="night", verdict_id="v", episode_id="e-judged", query_id="judged",
                                success=True, consensus="majority", channels_json="{}", reason="",
                                config_hash="x")], "critics", episodes=episodes)
    out = record(load_history_units(ws, None).units, run_id="history", judged_at=T0)
    assert [r.query_id for r in out.rows["query_history"]] == ["judged"]
    assert out.stats == {
        "queries with no judged episode (env faults only)": 1,
        "queries not rolled out by this run (not rolled again as identical, or dropped by the rollout: its lineage "
        "counts say why)": 1,
    }


def test_a_line_separator_inside_a_demonstrations_text_is_text_not_a_new_line(tmp_path):
    """A recorder that writes JSON with `ensure_ascii=False` leaves U+2028 inside a page's text: the file's line
    was split there and refused as invalid JSON."""
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"query_id": "q", "instruction": "Open 'Terms\u2028Privacy'", "steps": [
        {"action_type": "click", "action_json": json.dumps({"x": 40, "y": 80}), "thought": "open"}]},
        ensure_ascii=False) + "\n")
    [entry] = load_demonstrations(path)
    assert entry["instruction"] == "Open 'Terms\u2028Privacy'"

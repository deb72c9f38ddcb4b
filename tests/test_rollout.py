"""Rollout end to end: replay every goal of every bundled app in a real browser, both viewports.

No mocks: a real AppServer, Debian's Chromium through Playwright, a real blob store.
Browser tests take conftest's `chromium` fixture: skipped without Chromium, failed
instead under TRAJFORGE_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import io
import json
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import networkx as nx
import pytest
from conftest import ScriptedPolicy
from PIL import Image
from test_apps import ACCOUNT_PASSWORD

from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.envs.apps import AppServer, BundledApp, known_apps, load_app
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.envs.spec import AppSpec, placeholders
from trajforge.rollout.episode import run_episode
from trajforge.rollout.policy import PolicyOutput
from trajforge.rollout.replay import ReplayPolicy, SlotError, plan
from trajforge.rollout.stage import attempt_key, episode_id_for, rollout
from trajforge.schemas.config import RolloutSettings, Settings
from trajforge.schemas.records import Episode, Query, Step

VIEWPORTS = ["mobile", "desktop"]



def make_query(spec: AppSpec, goal: str, route: int = 0, pick: int = 0, query_id: str | None = None) -> Query:
    """A query for the `route`-th simple path from the start page to `goal` (negative counts
    from the last); slot values are the `pick`-th of each slot's list (wrapping), so tests
    can vary them."""
    paths = sorted(nx.all_simple_paths(spec.graph(), spec.start, goal))
    path = paths[route % len(paths)]
    slots = {slot: values[pick % len(values)] for slot, values in spec.slot_values().items()}
    page_goal = spec.pages[goal].goal
    assert page_goal is not None
    return Query(
        run_id="test", query_id=query_id or f"{goal}-{route}-{pick}", app=spec.app, source="page_graph",
        instruction=page_goal.instruction.format_map(slots), path=path, slots_json=json.dumps(slots),
        checker=page_goal.checker,
        checker_params_json=json.dumps({k: v.format_map(slots) for k, v in page_goal.params.items()}),
        max_steps=20, generator="tests", created_at=datetime.now(timezone.utc),
    )


def one_slot_changed(spec: AppSpec, goal: str, params: dict[str, str]) -> list[dict[str, str]]:
    """The goal's checker params with one slot-filled param set to another value of its slot,
    one variant per param that has another value: what a wrong final state is judged against."""
    page_goal = spec.pages[goal].goal
    assert page_goal is not None
    values = spec.slot_values()
    variants = []
    for key, template in page_goal.params.items():
        for slot in placeholders(template):
            other = next((v for v in values[slot] if template.format_map({slot: v}) != params[key]), None)
            if other is not None:
                variants.append({**params, key: template.format_map({slot: other})})
    return variants


def goal_cases() -> list[tuple[str, str]]:
    return [(name, goal) for name in known_apps() for goal in load_app(name).spec.goal_pages()]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, AppServer]]:
    """Every bundled app on loopback; episodes of any app share the module's browser envs."""
    apps = [load_app(name) for name in known_apps()]
    with ExitStack() as stack:
        yield {app.name: stack.enter_context(AppServer(app)) for app in apps}


@pytest.fixture(scope="module", params=VIEWPORTS)
def env(request: pytest.FixtureRequest, chromium: Path, server: AppServer) -> Iterator[BrowserEnv]:
    with BrowserEnv(server.base_url + "/", viewport=request.param, chromium=chromium) as e:
        yield e


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def check_episode(app: BundledApp, query: Query, episode: Episode, params: dict[str, str] | None = None
                  ) -> tuple[bool, str]:
    return app.check(query.checker, params or json.loads(query.checker_params_json),
                     json.loads(episode.final_state_json))


def replay(env: BrowserEnv, server: AppServer, query: Query, blobs: BlobStore) -> tuple[Episode, list[Step]]:
    """Replay a query's reference path on its app's server, from the app's start page."""
    spec = server.app.spec
    return run_episode(env, ReplayPolicy(spec), query, run_id="t", episode_id=f"ep-{query.query_id}",
                       blobs=blobs, max_steps=query.max_steps, start_url=server.base_url + spec.pages[spec.start].url)


@pytest.mark.browser
@pytest.mark.parametrize(("app_name", "goal"), goal_cases())
def test_replay_reaches_every_goal(servers: dict[str, AppServer], env: BrowserEnv, blobs: BlobStore,
                                   app_name: str, goal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One reference path per goal and viewport: the first route with the first slot values on
    mobile, the last route with the second values on desktop, so a goal with two routes has
    both replayed. The checker passes on the final state and fails with any one slot changed."""
    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", ACCOUNT_PASSWORD)  # Harbor ID's tasks sign in first
    server = servers[app_name]
    app = server.app
    mobile = env.viewport == "mobile"
    query = make_query(app.spec, goal, route=0 if mobile else -1, pick=0 if mobile else 1)
    episode, steps = replay(env, server, query, blobs)
    assert episode.status == "terminated", episode.fault
    assert all(s.action_valid for s in steps), [s.action_error for s in steps if not s.action_valid]
    assert steps[-1].action_type == "terminate" and json.loads(steps[-1].action_json) == {"status": "success"}, \
        steps[-1].thought
    assert episode.viewport == env.viewport and episode.num_steps == len(steps)
    ok, reason = check_episode(app, query, episode)
    assert ok, reason
    params = json.loads(query.checker_params_json)
    variants = one_slot_changed(app.spec, goal, params)
    fixed = not any(placeholders(t) for t in app.spec.pages[goal].goal.params.values())
    assert variants or fixed, f"{app_name}.{goal}: no checker param comes from a slot with a second value"
    for changed in variants:
        ok, reason = check_episode(app, query, episode, changed)
        assert not ok, f"{changed} still passes: {reason}"
    if fixed:  # a goal with constant params ("open the Share dialog") must not hold before the episode
        ok, reason = app.check(query.checker, params, app.initial_state())
        assert not ok, f"{app_name}.{goal} holds on the initial state: {reason}"
    # Every click names the element it hit, as the transition named it.
    clicks = [s for s in steps if s.action_type == "click"]
    assert clicks and all(s.target_role and s.target_name for s in clicks)
    for s in steps:
        Step.model_validate(s.model_dump())


@pytest.mark.browser
@pytest.mark.parametrize(("value", "clicks_box"), [("on", False), ("off", True)])
def test_set_checked_clicks_only_when_the_state_differs(servers: dict[str, AppServer], env: BrowserEnv,
                                                         blobs: BlobStore, value: str, clicks_box: bool) -> None:
    """FreshCart's order notifications start on: "on" leaves the box alone (a click would turn them off), "off"
    clicks it. (The shop's check needs the Save, so "on" is no task done before its first step.)"""
    server = servers["shop"]
    query = make_query(server.app.spec, "settings_saved", pick=["on", "off"].index(value))
    assert json.loads(query.slots_json)["notifications"] == value
    episode, steps = replay(env, server, query, blobs)
    assert episode.status == "terminated" and check_episode(server.app, query, episode)[0]
    targets = [(s.target_role, s.target_name) for s in steps if s.action_type == "click"]
    assert targets == ([("link", "Settings")] + [("checkbox", "Order notifications")] * clicks_box
                       + [("button", "Save")])
    said = " ".join(s.thought for s in steps)
    assert ("already on, no click needed" in said) != clicks_box


def test_plan_needs_on_or_off_for_set_checked() -> None:
    spec = load_app("shop").spec
    path = ["home", "settings", "settings_saved"]
    assert [s.checked for s in plan(spec, path, {"notifications": "off"})] == [None, False, None]
    with pytest.raises(SlotError, match="sets 'Order notifications' to on or off, the query's slots make it 'yes'"):
        plan(spec, path, {"notifications": "yes"})


@pytest.mark.browser
def test_invalid_actions_are_recorded_not_raised(shop: BundledApp, env: BrowserEnv, blobs: BlobStore) -> None:
    script = [
        {"type": "fly", "x": 1, "y": 1},
        {"type": "click", "x": env.width + 5, "y": 10},
        {"type": "click", "x": 10},
        {"type": "key", "key": "NoSuchKey"},
        {"type": "system_button", "button": "Menu"},
        {"type": "terminate", "status": "maybe"},
        {"type": "terminate", "status": "failure"},
    ]
    episode, steps = run_episode(env, ScriptedPolicy(script), make_query(shop.spec, "cart"), run_id="t",
                                 episode_id="ep-invalid", blobs=blobs)
    assert episode.status == "terminated" and len(steps) == len(script)
    errors = [s.action_error for s in steps]
    assert [s.action_valid for s in steps] == [False] * 6 + [True]
    assert "unknown action type 'fly'" in errors[0]
    assert "off the" in errors[1]
    assert "missing argument 'y'" in errors[2]
    assert "Unknown key" in errors[3]
    if env.space == "mobile":
        assert "no equivalent in a browser" in errors[4]
    else:
        assert "'system_button' is a mobile action, not in the desktop action space" in errors[4]
    assert "success or failure" in errors[5]
    assert steps[0].url_before == steps[-1].url_after, "invalid actions must not change the page"


@pytest.mark.browser
def test_a_valid_action_is_recorded_in_its_spaces_form_with_the_browsers_key_names(
        shop: BundledApp, env: BrowserEnv, blobs: BlobStore) -> None:
    """What a step stores is what the env did, in the form its space's tool speaks: a desktop key press as `keys`
    (the desktop tool has no `key`), an alias type resolved, 'enter' as 'Enter'. An invalid action stays as the
    policy wrote it, since its error is about that."""
    script = [{"type": "press", "key": "enter"}, {"type": "key", "keys": ["ctrl", "a"]},
              {"type": "key", "key": "space"}, {"type": "terminate", "status": "failure"}]
    _, steps = run_episode(env, ScriptedPolicy(script), make_query(shop.spec, "cart"), run_id="t",
                           episode_id="ep-keys", blobs=blobs)
    recorded = [(s.action_type, json.loads(s.action_json), s.action_valid) for s in steps[:3]]
    # the space bar keeps its name: the browser's (" ") is a blank key the validator refuses
    if env.space == "desktop":
        assert recorded == [("key", {"keys": ["Enter"]}, True), ("key", {"keys": ["Control", "a"]}, True),
                            ("key", {"keys": ["space"]}, True)]
    else:
        assert recorded == [("key", {"key": "Enter"}, True), ("key", {"keys": ["ctrl", "a"]}, False),
                            ("key", {"key": "space"}, True)]
    assert all(actions.validate({"type": kind, **action}, 390, 844, env.space) is None
               for kind, action, valid in recorded if valid)


@pytest.mark.browser
def test_replay_presses_a_key_in_its_spaces_form(servers: dict[str, AppServer], env: BrowserEnv,
                                                 blobs: BlobStore) -> None:
    """The shop's search route presses Enter (`op: press`): the replay says so as its space's tool does."""
    server = servers["shop"]
    query = make_query(server.app.spec, "cart", route=1)
    assert query.path[1] == "search"
    episode, steps = replay(env, server, query, blobs)
    assert episode.status == "terminated" and check_episode(server.app, query, episode)[0]
    [press] = [s for s in steps if s.action_type == "key"]
    said = {"keys": ["Enter"]} if env.space == "desktop" else {"key": "Enter"}
    assert json.loads(press.raw_output) == {"type": "key", **said} and json.loads(press.action_json) == said


@pytest.mark.browser
def test_max_steps_ends_the_episode(shop: BundledApp, env: BrowserEnv, blobs: BlobStore) -> None:
    episode, steps = run_episode(env, ScriptedPolicy([{"type": "wait", "seconds": 0}]), make_query(shop.spec, "cart"),
                                 run_id="t", episode_id="ep-max", blobs=blobs, max_steps=3)
    assert episode.status == "max_steps" and len(steps) == 3


@pytest.mark.browser
def test_an_action_repeated_on_a_screen_it_does_not_change_stalls(shop: BundledApp, env: BrowserEnv,
                                                                   blobs: BlobStore) -> None:
    """A policy in a loop (the embedded model clicking one point again and again) ends early."""
    episode, steps = run_episode(env, ScriptedPolicy([{"type": "wait", "seconds": 0}]), make_query(shop.spec, "cart"),
                                 run_id="t", episode_id="ep-loop", blobs=blobs, max_steps=8, max_repeats=2)
    assert episode.status == "stalled" and len(steps) == 3 and all(s.action_valid for s in steps)


@pytest.mark.browser
def test_swipe_or_wheel_scrolls_and_replay_scrolls_to_offscreen_elements(shop: BundledApp, env: BrowserEnv,
                                                               blobs: BlobStore) -> None:
    env.reset("swipe")
    full = (env.width, env.height)
    env.resize(env.width, 300)  # a short screen: the dish list overflows in both viewports
    try:
        before = env.page.evaluate("scrollY")
        if env.space == "mobile":
            assert env.act({"type": "swipe", "x": 100, "y": 250, "x2": 100, "y2": 50}) is None
        else:
            assert env.act({"type": "scroll", "x": 100, "y": 150, "dy": 200}) is None
        assert env.page.evaluate("scrollY") > before
        query = make_query(shop.spec, "cart", route=0, pick=5)  # Falafel Wrap, the last dish
        episode, steps = run_episode(env, ReplayPolicy(shop.spec), query, run_id="t", episode_id="ep-scroll",
                                     blobs=blobs)
        assert episode.status == "terminated" and check_episode(shop, query, episode)[0]
        assert any(s.action_type == ("swipe" if env.space == "mobile" else "scroll") for s in steps)
        assert all(s.height == 300 for s in steps)
    finally:
        env.resize(*full)


@pytest.mark.browser
def test_screenshots_in_blob_store_are_pngs_of_recorded_size(shop: BundledApp, env: BrowserEnv,
                                                            blobs: BlobStore) -> None:
    query = make_query(shop.spec, "settings_saved")
    episode, steps = run_episode(env, ReplayPolicy(shop.spec), query, run_id="t", episode_id="ep-png", blobs=blobs)
    assert episode.status == "terminated"
    for step in steps:
        for sha in (step.screenshot_before, step.screenshot_after):
            with Image.open(io.BytesIO(blobs.get(sha))) as image:
                assert image.format == "PNG"
                assert image.size == (step.width, step.height) == (env.width, env.height)
    assert steps[0].ax_tree_before.startswith('RootWebArea "Home · FreshCart"')


@pytest.mark.browser
def test_env_fault_is_recorded(chromium: Path, shop: BundledApp, server: AppServer, blobs: BlobStore) -> None:

    class Crash(ScriptedPolicy):
        def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput:
            env.context.close()  # the browser side goes away under the episode
            return super().act(observation, env)

    with BrowserEnv(server.base_url + "/", chromium=chromium) as env:
        episode, steps = run_episode(env, Crash([{"type": "click", "x": 10, "y": 10}]), make_query(shop.spec, "cart"),
                                     run_id="t", episode_id="ep-fault", blobs=blobs)
    assert episode.status == "env_fault" and episode.fault and steps == []


@pytest.mark.browser
def test_stage_rollout(chromium: Path, shop: BundledApp, blobs: BlobStore) -> None:
    queries = [make_query(shop.spec, "confirmation", route=1, pick=2, query_id="q-order").model_dump(),
               make_query(shop.spec, "settings_saved", query_id="q-settings").model_dump(),
               make_query(load_app("mail").spec, "message_starred", query_id="q-mail").model_dump(),
               {**make_query(shop.spec, "cart").model_dump(), "query_id": "q-other", "app": "not-bundled"}]
    out = rollout(queries, run_id="run-1", settings=RolloutSettings(policy="replay", viewport="desktop"), blobs=blobs)
    episodes, steps = out.rows["episodes"], out.rows["steps"]
    assert [e.query_id for e in episodes] == ["q-order", "q-settings", "q-mail"], "one shard, two apps"
    assert all(e.status == "terminated" and e.viewport == "desktop" for e in episodes)
    assert episodes[0].episode_id == episode_id_for("run-1", "q-order") != episode_id_for("run-2", "q-order")
    assert len(steps) == sum(e.num_steps for e in episodes)
    assert out.models == {"policy": "replay"} and out.prompts == {}
    assert out.dropped == {"no bundled app 'not-bundled'": 1}
    for q, e in zip(queries[:3], episodes, strict=True):
        app = load_app(q["app"])
        assert app.check(q["checker"], json.loads(q["checker_params_json"]), json.loads(e.final_state_json))[0]


def test_validate_action_space() -> None:
    """The validator alone (no browser): unknown type, missing argument, off screen, bad values."""
    assert actions.validate({"type": "click", "x": 0, "y": 914}, 412, 915) is None
    assert actions.validate({"type": "press", "key": "Enter"}, 412, 915) is None
    assert "off the 412x915 screen" in actions.validate({"type": "click", "x": 412, "y": 0}, 412, 915)
    assert "off the" in actions.validate({"type": "swipe", "x": 1, "y": 1, "x2": 1, "y2": -1}, 412, 915)
    assert "missing argument 'text'" in actions.validate({"type": "type"}, 412, 915)
    assert "must be a number" in actions.validate({"type": "click", "x": "1", "y": 1}, 412, 915)
    assert "must be a number" in actions.validate({"type": "click", "x": True, "y": 1}, 412, 915)
    assert "unknown argument" in actions.validate({"type": "wait", "secs": 1}, 412, 915)
    assert "between 0 and 10" in actions.validate({"type": "wait", "seconds": 60}, 412, 915)
    assert "JSON object" in actions.validate(["click"], 412, 915)
    for nan_or_inf in (float("nan"), float("inf"), float("-inf")):  # what a model server's JSON may carry
        assert "finite number" in actions.validate({"type": "click", "x": nan_or_inf, "y": 1}, 412, 915)
        assert "finite number" in actions.validate({"type": "scroll", "x": 1, "y": 1, "dy": nan_or_inf}, 1280, 800,
                                                   "desktop")
        assert "finite number" in actions.validate({"type": "wait", "seconds": nan_or_inf}, 412, 915)


def test_an_attempt_key_changes_with_what_decides_the_attempt_and_not_with_how_the_night_runs() -> None:
    """A later night leaves out a query whose attempts the warehouse holds with the same key, so the key must change
    with everything that changes what the policy does, and with nothing that only changes how the night runs."""
    spec = load_app("shop").spec
    query = make_query(spec, "cart", query_id="q-key")
    settings = Settings(llm={"endpoints": {"big": {"base_url": "http://gpu:8000/v1", "model": "qwen"}}})
    greedy = RolloutSettings(policy="gui_owl_e2e")

    def key(rollout: RolloutSettings = greedy, *, q: Query = query, guidance: str | None = None,
            seed_base: str = "queries@1", s: Settings = settings, spec_hash: str = "spec-1") -> str:
        return attempt_key(q, spec_hash, s, rollout, guidance, seed_base, {})

    same = key()
    # How the night runs: contexts, shards, timeouts, fault reruns, the reference viewports, and (greedy) which
    # queries version the night read.
    assert key(greedy.model_copy(update={"contexts": 4, "episodes_per_shard": 9, "action_timeout_s": 3.0,
                                         "max_fault_retries": 0, "reference_viewports": ["mobile"],
                                         "reroll_identical": True})) == same
    assert key(seed_base="queries@2") == same
    assert key(s=settings.model_copy(update={"llm": settings.llm.model_copy(update={"cache": False})})) == same
    # What the policy does.
    changed = [
        key(greedy.model_copy(update={"viewport": "desktop"})),
        key(greedy.model_copy(update={"model": "big"})),
        key(greedy.model_copy(update={"history_images": 2})),
        key(greedy.model_copy(update={"temperature": 0.7})),
        key(guidance="Open the cart first."),
        key(q=query.model_copy(update={"instruction": query.instruction + " now"})),
        key(spec_hash="spec-2"),  # the app's page graph changed
        key(s=settings.model_copy(update={"llm": settings.llm.model_copy(
            update={"local": settings.llm.local.model_copy(update={"model": "/models/other"})})})),
    ]
    assert same not in changed and len(set(changed)) == len(changed)
    sampled = greedy.model_copy(update={"temperature": 0.7})
    assert key(sampled, seed_base="queries@2") != key(sampled)  # a new night's queries version samples anew
    replay = RolloutSettings(policy="replay")  # no model, no draw: neither the llm section nor the seed base counts
    other_llm = settings.model_copy(update={"llm": settings.llm.model_copy(update={"default": "big"})})
    assert key(replay) == key(replay, s=other_llm, seed_base="queries@2") != key(replay.model_copy(
        update={"viewport": "desktop"}))


def test_a_finished_runs_identical_attempts_are_left_out_and_a_devices_never(tmp_path: Path) -> None:
    """The rollout stage's plan: a browser query whose attempt a finished run holds is left out (and counted);
    the same while that run is unfinished (a run resuming after its commit) is kept, as is an Android query,
    whose device's screens drift between nights."""
    from trajforge.data.catalog import Lineage
    from trajforge.envs.android import android_queries
    from trajforge.llm.workspace import Workspace
    from trajforge.rollout.stage import NOT_ROLLED_AGAIN, load_queries
    from trajforge.schemas.config import AndroidTask

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, rollout={"policy": "random"}))
    run = ws.ledger.open_run("nightly", "night-1").run_id

    def lineage(table: str) -> Lineage:
        return Lineage(stage="test", run_id=run, commit_key=f"{run}:{table}", config_hash="x", code_version="x")

    (device,) = android_queries([AndroidTask(instruction="x", start="a.b/.C", probe="p", value="1")], run_id=run)
    browser = make_query(load_app("shop").spec, "cart").model_copy(update={"run_id": run})
    snapshot = ws.catalog.commit_rows("queries", [browser, device], lineage("queries"))
    first = load_queries(ws, snapshot)
    assert len(first.units) == 2 and not first.stats
    now = datetime.now(timezone.utc)
    ws.catalog.commit_rows("episodes", [Episode(
        episode_id=f"e{i}", query_id=u.query.query_id, app=u.query.app, instruction=u.query.instruction,
        run_id=run, policy="random", model_id="random", prompt_version="", viewport="mobile", status="terminated",
        num_steps=1, final_url="", final_state_json="{}", started_at=now, finished_at=now, sample=0,
        attempt_key=u.attempt_key) for i, u in enumerate(first.units)], lineage("episodes"))
    assert [u.attempt_key for u in load_queries(ws, snapshot).units] == [u.attempt_key for u in first.units]
    ws.ledger.finish_run(run, {})
    again = load_queries(ws, snapshot)
    assert [u.query.app for u in again.units] == ["android"] and again.stats == {NOT_ROLLED_AGAIN: 1}
    assert again.units[0].attempt_key == next(u.attempt_key for u in first.units if u.query.app == "android")


def _held_night(ws, query: Query) -> int:
    """Commit `query` as a queries version, then a finished run's policy episodes of its planned units with their
    attempt keys, as a night that rolled it out leaves them; returns the queries version."""
    from trajforge.data.catalog import Lineage
    from trajforge.rollout.stage import load_queries

    run = ws.ledger.open_run("nightly", f"night-{query.query_id}").run_id

    def lineage(table: str) -> Lineage:
        return Lineage(stage="test", run_id=run, commit_key=f"{run}:{table}", config_hash="x", code_version="x")

    snapshot = ws.catalog.commit_rows("queries", [query.model_copy(update={"run_id": run})], lineage("queries"))
    now = datetime.now(timezone.utc)
    ws.catalog.commit_rows("episodes", [Episode(
        episode_id=f"e{i}", query_id=u.query.query_id, app=u.query.app, instruction=u.query.instruction, run_id=run,
        policy=ws.settings.rollout.policy, model_id="m", prompt_version="", viewport="mobile", status="terminated",
        num_steps=1, final_url="", final_state_json="{}", started_at=now, finished_at=now, sample=0,
        attempt_key=u.attempt_key) for i, u in enumerate(load_queries(ws, snapshot).units)], lineage("episodes"))
    ws.ledger.finish_run(run, {})
    return snapshot


def test_an_edited_policy_prompt_or_a_text_only_models_ocr_rolls_a_query_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dirty checkout keeps its code version after an edit, so the attempt key reads the policy's prompts
    themselves: a night after editing GUI-Owl's prompt rolls the query again, one after editing a critic's prompt
    does not; a text-only model reads the screen as OCR text, so another OCR engine rolls it again too."""
    import shutil

    from trajforge.llm.prompts import PROMPTS_DIR
    from trajforge.llm.workspace import Workspace
    from trajforge.rollout import stage
    from trajforge.rollout.stage import NOT_ROLLED_AGAIN, load_queries, policy_reads

    prompts = tmp_path / "prompts"
    shutil.copytree(PROMPTS_DIR, prompts)
    monkeypatch.setattr(stage, "PROMPTS_DIR", prompts)
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))  # GUI-Owl on the embedded text-only model
    snapshot = _held_night(ws, make_query(load_app("shop").spec, "cart"))

    def rolled() -> bool:
        inputs = load_queries(ws, snapshot)
        assert len(inputs.units) + inputs.stats[NOT_ROLLED_AGAIN] == 1
        return len(inputs.units) == 1

    assert not rolled()
    (prompts / "critic_step.yaml").write_text((prompts / "critic_step.yaml").read_text() + "# edited\n")
    assert not rolled()
    policy_prompt = prompts / "gui_owl_e2e.yaml"
    original = policy_prompt.read_text()
    policy_prompt.write_text(original + "# edited\n")
    assert rolled()
    policy_prompt.write_text(original)
    assert not rolled()
    monkeypatch.setattr(ws.gateway.ocr, "engine_id", "another-ocr")
    assert rolled()
    # A model that sees the screen reads no OCR; replay and random read no prompt.
    vision = Workspace.open(Settings(warehouse={"path": tmp_path / "wh2"}, llm={"endpoints": {"big": {
        "base_url": "http://gpu:8000/v1", "model": "qwen", "vision": True}}}, rollout={"model": "big"}))
    assert set(policy_reads(vision, vision.settings.rollout)) == {"prompts"}
    assert policy_reads(ws, RolloutSettings(policy="replay")) == {}
    assert policy_reads(ws, RolloutSettings(policy="random")) == {}


def test_the_rollout_plan_names_the_checkpoints_it_read_and_rolls_with_their_model(tmp_path: Path) -> None:
    """With loop.train the policy model is the latest checkpoint: the checkpoints version the plan read is in its
    lineage, and its units carry the model it read, so every shard rolls with the checkpoint the lineage names."""
    from trajforge.data.catalog import Lineage
    from trajforge.llm.workspace import Workspace
    from trajforge.rollout.stage import load_queries
    from trajforge.schemas.records import Checkpoint

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, rollout={"policy": "random"},
                                 loop={"train": True}))
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    checkpoints = ws.catalog.commit_rows("checkpoints", [Checkpoint(
        run_id="train", model_id=str(folder), checkpoint_hash="h", folder=str(folder), served_by="local",
        base_model_id="base", root_model_id=ws.gateway.backend("local").model_id, trained_on=["steps@1"], samples=1,
        steps=1, trainer="t", seconds=0.0, created_at=datetime.now(timezone.utc))],
        Lineage(stage="train", run_id="train", commit_key="train:checkpoints", config_hash="x", code_version="x"))
    query = make_query(load_app("shop").spec, "cart")
    _held_night(ws, query)
    another = query.model_copy(update={"run_id": "next", "query_id": "another"})  # a query no night rolled
    later = ws.catalog.commit_rows("queries", [another], Lineage(
        stage="history", run_id="next", commit_key="next:queries", config_hash="x", code_version="x"))
    inputs = load_queries(ws, later)
    # episodes, the rollout's own output, is read at one version but not named: each night naming the last would
    # keep every episodes version from `datasets expire`
    assert inputs.snapshots == {"queries": later, "checkpoints": checkpoints}
    assert [u.model for u in inputs.units] == [str(folder)]

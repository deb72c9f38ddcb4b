"""Atomic-operation queries: generated from live pages, replayed as pixel actions, judged
from what the pages' interaction recorder reported to the app server.

Real parts throughout: the bundled apps on loopback, Debian's Chromium through
Playwright, the replay policy inside the rollout stage. Browser tests take conftest's
`chromium` fixture (skipped without Chromium, failed under TRAJFORGE_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from trajforge.data.blobs import BlobStore
from trajforge.envs.apps import UI_EVENTS, AppServer, check_interaction, load_app
from trajforge.envs.apps.interaction import RECORDER_PATH
from trajforge.envs.axtree import parse
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.operations import SPACE_OPS, Operation, dump_operations, parse_operations
from trajforge.query_gen.atomic import GENERATOR, Route, atomic_queries, ax_items, crawlable_routes
from trajforge.query_gen.validation import InterfaceValidator
from trajforge.rollout.episode import run_episode
from trajforge.rollout.replay import ReplayPolicy
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import RolloutSettings
from trajforge.schemas.records import Episode, Query

APPS = ("shop", "mail", "calendar", "notes", "settings")
"""The apps whose pages the generator and the recorder were built against."""

NOW = datetime(2026, 1, 5, tzinfo=timezone.utc)
WRONG_OP = {"click": "right_click", "right_click": "click", "double_click": "select_text",
            "select_text": "double_click", "type_at": "double_click", "scroll_to": "click", "drag": "click"}
"""For each op, another op a careless agent might do on the same element instead, and that
the right one does not include (a double-click starts with a click, typing with one)."""


def event(op: str, role: str, name: str, at: float = 1.0, **extra: str) -> dict[str, Any]:
    return {"op": op, "role": role, "name": name, "page": "/", "at": at, **extra}


# --- the interaction checker, on states as the server keeps them ------------------------


def test_interaction_checker_wants_the_op_on_the_element() -> None:
    state = {"cart": [], UI_EVENTS: [event("click", "link", "Inbox"),
                                     event("double_click", "text", "Oat milk, eggs, spinach.", text="spinach")]}
    assert check_interaction({"op": "click", "role": "link", "name": "inbox"}, state) == (
        True, "recorded click link 'Inbox' on /")
    ok, reason = check_interaction({"op": "right_click", "role": "link", "name": "Inbox"}, state)
    assert not ok and reason.startswith("no right_click link 'Inbox' was recorded; the last recorded: click link")
    ok, reason = check_interaction({"op": "click", "role": "link", "name": "Starred"}, state)
    assert not ok and "no click link 'Starred'" in reason
    word = {"op": "double_click", "role": "text", "name": "Oat milk, eggs, spinach."}
    assert check_interaction({**word, "text": "spinach"}, state)[0]
    ok, reason = check_interaction({**word, "text": "eggs"}, state)
    assert not ok and "text 'spinach'" in reason, "the reason shows the word that was double-clicked"
    assert check_interaction({"op": "click", "role": "link"}, state) == (False, "checker params lack name")
    ok, reason = check_interaction({"op": "hover", "role": "link", "name": "Inbox"}, {})
    assert not ok and "op is 'hover'" in reason
    assert check_interaction({"op": "click", "role": "link", "name": "Inbox"}, {"cart": []})[1].endswith(
        "the last recorded: nothing")
    # "Follow the link 'Languages', and there click 'All settings'": the start page's own link is not it.
    ok, reason = check_interaction({"op": "click", "role": "link", "name": "Inbox", "page": "/folders"}, state)
    assert not ok and reason.startswith("no click link 'Inbox' on /folders was recorded")
    assert check_interaction({"op": "click", "role": "link", "name": "Inbox", "page": "/"}, state)[0]


def test_interaction_checker_reads_a_fields_last_value_and_the_drop_target() -> None:
    typed = {UI_EVENTS: [event("type_at", "searchbox", "Search", at=2.0, text="garden"),
                         event("type_at", "searchbox", "Search", at=5.0, text="garden plans")]}
    assert check_interaction({"op": "type_at", "role": "searchbox", "name": "Search", "text": "garden plans"}, typed)[0]
    assert not check_interaction({"op": "type_at", "role": "searchbox", "name": "Search", "text": "garden"}, typed)[0]
    dragged = {UI_EVENTS: [event("drag", "link", "Garden plans", to_role="link", to_name="Grocery list")]}
    drag = {"op": "drag", "role": "link", "name": "Garden plans", "to_role": "link"}
    assert check_interaction({**drag, "to_name": "Grocery list"}, dragged)[0]
    ok, reason = check_interaction({**drag, "to_name": "Guest Wi-Fi"}, dragged)
    assert not ok and "onto link 'Grocery list'" in reason


def test_every_app_answers_the_interaction_checker() -> None:
    for name in APPS:
        app = load_app(name)
        assert "interaction" not in app.checkers, "shared, not a goal checker of the app"
        assert app.check("interaction", {"op": "click", "role": "link", "name": "x"}, app.initial_state())[0] is False


# --- generation without a browser -----------------------------------------------------------


def test_crawlable_routes_follow_link_transitions_with_their_slots() -> None:
    spec = load_app("notes").spec
    routes = crawlable_routes(spec)
    assert routes[0] == Route(("notes",), (), ())
    assert Route(("notes", "note", "edit_note"), (("note", "Garden plans"),), ("Garden plans", "Edit")) in routes
    assert {r.path[-1] for r in routes} == {"notes", "note", "new_note", "edit_note"}, \
        "pages behind a search or a form are not crawlable by links"
    assert len([r for r in routes if r.path == ("notes", "note")]) == len(spec.slot_values()["note"])


def test_ax_items_keep_boxes_and_know_text_inside_a_named_element() -> None:
    items = ax_items(parse('RootWebArea "Notes" (0,0,1280,800)\n'
                           '  heading "Monday 7 December" [level=2] (286,150,707,40)\n'
                           '    link "Monday" (286,150,74,40)\n'
                           '    text "7 December" (370,163,88,16)\n'
                           '  text "Oat milk, eggs." (191,475,228,38)\n'
                           '  searchbox "Search notes": garden (176,94,820,44)'))
    by_name = {i.name: i for i in items}
    assert by_name["7 December"].in_nameable and not by_name["Oat milk, eggs."].in_nameable
    assert by_name["Oat milk, eggs."].box == (191, 475, 228, 38)
    assert by_name["Search notes"].value == "garden" and by_name["Monday"].role == "link"


# --- in the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, AppServer]]:
    with ExitStack() as stack:
        yield {name: stack.enter_context(AppServer(load_app(name))) for name in APPS}


@pytest.fixture(scope="module")
def generated(chromium: Path, servers: dict[str, AppServer]) -> list[Query]:
    """Desktop queries of every app: enough that every op kind comes up."""
    queries: list[Query] = []
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        for name, server in servers.items():
            queries += atomic_queries(server.app.spec, server.base_url, env, n=7, seed=3, space="desktop", run_id="t",
                                      now=NOW, margin=3).queries
    return queries


@pytest.fixture(scope="module")
def rolled(generated: list[Query], tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Query, Episode]]:
    """Two queries per op kind, replayed by the rollout stage on the desktop."""
    picked = [q for op in SPACE_OPS["desktop"] for q in [q for q in generated if op_of(q).op == op][:2]]
    out = rollout([q.model_dump() for q in picked], run_id="atomic", blobs=BlobStore(tmp_path_factory.mktemp("b")),
                  settings=RolloutSettings(policy="replay", viewport="desktop", contexts=2))
    episodes = {e.query_id: e for e in out.rows["episodes"]}
    return [(q, episodes[q.query_id]) for q in picked]


def op_of(query: Query) -> Operation:
    (op,) = parse_operations(query.actions_json)
    return op


@pytest.mark.browser
def test_every_op_kind_is_generated_from_live_pages(generated: list[Query]) -> None:
    assert {op_of(q).op for q in generated} == set(SPACE_OPS["desktop"])
    assert {q.app for q in generated} == set(APPS)
    for q in generated:
        op = op_of(q)
        assert (q.source, q.checker, q.generator) == ("atomic", "interaction", GENERATOR)
        params = json.loads(q.checker_params_json)
        assert params == op.model_dump(exclude_none=True) | {"page": params["page"]} and params["page"][0] == "/"
        assert q.max_steps >= 2 + 3 and q.path[0] == load_app(q.app).spec.start
        if op.op in ("double_click", "select_text"):
            assert op.role == "text" and op.text and op.text in op.name
    assert len({q.query_id for q in generated}) == len(generated)
    notes = [q for q in generated if q.app == "notes"]
    assert any(op_of(q).op == "drag" for q in notes), "the notes' cards are the draggable items"


@pytest.mark.browser
def test_generation_is_seeded_and_ids_are_stable(chromium: Path, servers: dict[str, AppServer]) -> None:
    server = servers["notes"]
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        runs = [atomic_queries(server.app.spec, server.base_url, env, n=4, seed=seed, space="desktop", run_id="t",
                               now=NOW, margin=3, max_pages=1) for seed in (5, 5, 6)]
    first, again, other = ([q.query_id for q in r.queries] for r in runs)
    assert first == again and len(first) == 4
    assert first != other
    assert runs[0].pages == 1


@pytest.mark.browser
def test_replay_does_each_operation_and_the_checker_agrees(rolled: list[tuple[Query, Episode]]) -> None:
    assert {op_of(q).op for q, _ in rolled} == set(SPACE_OPS["desktop"])
    for q, episode in rolled:
        ok, reason = load_app(q.app).check(q.checker, json.loads(q.checker_params_json),
                                           json.loads(episode.final_state_json))
        assert episode.status == "terminated" and ok, f"{q.instruction}: {episode.status}, {reason}"
        assert reason.startswith(f"recorded {op_of(q).op} ")
        assert episode.num_steps <= q.max_steps


@pytest.mark.browser
def test_interface_validation_keeps_every_generated_query(generated: list[Query], chromium: Path,
                                                          servers: dict[str, AppServer]) -> None:
    """What the generator found on a live page is found again by the validator, a passage of
    text (role "text", which no ARIA lookup finds) included; a passage that is gone is not."""
    assert any(op_of(q).role == "text" for q in generated)
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        for name, server in servers.items():
            mine = [q for q in generated if q.app == name]
            result = InterfaceValidator(server.app.spec, server.base_url, env).validate(mine)
            assert result.reasons == {} and result.kept == mine
        text = next(q for q in generated if op_of(q).role == "text")
        gone = text.model_copy(update={"query_id": "gone", "actions_json": dump_operations(
            [op_of(text).model_copy(update={"name": "A passage no page shows."})])})
        server = servers[text.app]
        result = InterfaceValidator(server.app.spec, server.base_url, env).validate([gone])
        assert not result.kept and "'A passage no page shows.' not found" in result.reasons["gone"]


@pytest.mark.browser
def test_a_wrong_operation_or_element_fails_the_checker(rolled: list[tuple[Query, Episode]]) -> None:
    for q, episode in rolled:
        params, state = json.loads(q.checker_params_json), json.loads(episode.final_state_json)
        wrong_op = {k: v for k, v in params.items() if k not in ("text", "to_role", "to_name")}
        wrong_op["op"] = WRONG_OP[params["op"]]
        ok, reason = load_app(q.app).check("interaction", wrong_op, state)
        assert not ok and reason.startswith(f"no {wrong_op['op']} {params['role']} ") and "last recorded: " in reason
        ok, reason = load_app(q.app).check("interaction", {**params, "name": "No such element"}, state)
        assert not ok and reason.startswith(f"no {params['op']} {params['role']} 'No such element'")


@pytest.mark.browser
def test_recorded_names_are_the_ax_tree_names_the_generator_used(rolled: list[tuple[Query, Episode]]) -> None:
    """Exactly, not only up to case and spacing: the recorder names elements as the tree does."""
    for q, episode in rolled:
        op = op_of(q)
        events = json.loads(episode.final_state_json)[UI_EVENTS]
        assert any((e["op"], e["role"], e["name"]) == (op.op, op.role, op.name) for e in events), (op, events)


@pytest.mark.browser
def test_dragging_a_note_card_moves_it_in_the_app_state(rolled: list[tuple[Query, Episode]]) -> None:
    drags = [(q, e) for q, e in rolled if op_of(q).op == "drag"]
    assert drags
    for q, episode in drags:
        op = op_of(q)
        initial = [n["title"] for n in load_app("notes").initial_state()["notes"]]
        titles = [n["title"] for n in json.loads(episode.final_state_json)["notes"]]
        assert titles != initial and titles.index(op.name) == initial.index(op.to_name or "")


@pytest.mark.browser
def test_mobile_space_gets_only_ops_it_can_express(chromium: Path, servers: dict[str, AppServer],
                                                   tmp_path: Path) -> None:
    server = servers["calendar"]
    with BrowserEnv(viewport="mobile", chromium=chromium) as env:
        result = atomic_queries(server.app.spec, server.base_url, env, n=6, seed=1, space="mobile", run_id="t", now=NOW,
                                margin=3, max_pages=2)
        assert result.queries and {op_of(q).op for q in result.queries} <= set(SPACE_OPS["mobile"])
        assert result.skipped["calendar: double_click: the mobile action space cannot express it"] == 1
        # A desktop-only operation given to a phone anyway: the replay says it cannot, and fails.
        query = result.queries[0].model_copy(update={"actions_json": json.dumps(
            [{"op": "right_click", "role": "link", "name": "Search"}])})
        start = server.base_url + server.app.spec.pages[server.app.spec.start].url
        episode, steps = run_episode(env, ReplayPolicy(server.app.spec), query, run_id="t", episode_id="mobile-rc",
                                     blobs=BlobStore(tmp_path), start_url=start)
    assert episode.status == "terminated" and json.loads(steps[-1].action_json) == {"status": "failure"}
    assert "the mobile action space has no way to do right_click" in (steps[-1].thought or "")


@pytest.mark.browser
def test_a_pooled_env_that_ran_a_users_app_still_reports_to_a_bundled_apps_server(chromium: Path,
                                                                                  servers: dict[str, AppServer]
                                                                                  ) -> None:
    # A user's app gets the recorder from the browser, with a binding that stays on the pooled context; a bundled
    # app's episode on that env after it had its reports kept by the browser, so its server saw none and every
    # interaction check failed.
    server = servers["notes"]
    start = server.base_url + server.app.spec.pages[server.app.spec.start].url
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        env.reset("users-app", start, app_protocol=False)
        env.add_recorder(RECORDER_PATH.read_text())
        env.reset("bundled", start)
        target = next(t for t in env.observe().targets() if t.role == "link")
        assert env.act({"type": "click", "x": target.x, "y": target.y}) is None
        env.observe()
        events = env.app_state().get(UI_EVENTS) or []
        assert [(e["op"], e["name"]) for e in events] == [("click", target.name)]
        assert env.take_reports() == []


@pytest.mark.browser
def test_fewer_queries_than_asked_for_are_counted_with_the_reason(chromium: Path,
                                                                 servers: dict[str, AppServer]) -> None:
    """One page and one op give at most PER_PAGE candidates: the queries asked for beyond them are counted under a
    reason, as every other query not made is, so the lineage explains the shortfall."""
    server = servers["notes"]
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        result = atomic_queries(server.app.spec, server.base_url, env, n=5, seed=1, space="desktop", run_id="t",
                                now=NOW, margin=3, ops=("click",), max_pages=1)
    assert len(result.queries) == 3
    assert result.skipped["notes: fewer candidates on the pages opened than asked for (atomic_per_app)"] == 2


@pytest.mark.browser
def test_no_field_is_asked_to_take_a_secret(chromium: Path) -> None:
    """The account app's password slot is a `<secret>` placeholder: picked as text for its Username field (1 draw in
    5 once), the query would have the password typed in the clear, onto the screen and into the app's state."""
    account = load_app("account")
    with AppServer(account) as server, BrowserEnv(viewport="desktop", chromium=chromium) as env:
        typed = [op_of(q).text or "" for seed in range(20) for q in atomic_queries(
            account.spec, server.base_url, env, n=1, seed=seed, space="desktop", run_id="t", now=NOW, margin=3,
            ops=("type_at",), max_pages=1).queries]
    assert len(typed) == 20 and "alice" in typed
    assert not [t for t in typed if "<secret>" in t]

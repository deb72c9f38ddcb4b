"""The bundled apps: specs, sessions, reset, server-side validation, checkers, rendering.

Server tests talk HTTP to a real AppServer; checker tests drive the real app into the
right and the wrong state over HTTP and judge what `/__state` then says; rendering
tests use the real Chromium (the `chromium` fixture of conftest skips them without it,
or fails under TRAJFORGE_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import yaml

from trajforge.envs.apps import SESSION_COOKIE, AppServer, BundledApp, UnknownAppError, known_apps, load_app
from trajforge.envs.apps.shop import app as shop_module
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.spec import SpecError, load_spec, placeholders


def http(server: AppServer, method: str, path: str, session: str | None = None,
         form: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    """One request without following redirects: (status, body, headers)."""
    data = urllib.parse.urlencode(form).encode() if form is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(server.base_url + path, data=data, method=method)
    if session:
        req.add_header("Cookie", f"{SESSION_COOKIE}={session}")

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def state(server: AppServer, session: str) -> dict[str, Any]:
    status, body, _ = http(server, "GET", "/__state", session)
    assert status == 200
    return json.loads(body)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, AppServer]]:
    """Every bundled app, served on loopback for the whole module."""
    apps = [load_app(name) for name in known_apps()]
    with contextlib.ExitStack() as stack:
        yield {app.name: stack.enter_context(AppServer(app)) for app in apps}


def post(server: AppServer, session: str, path: str, form: dict[str, str]) -> None:
    """A form post the app must accept (303 See Other), as a step of setting up a state."""
    status, body, _ = http(server, "POST", path, session, form)
    assert status == 303, f"POST {path} {form} answered {status}: {body[:300]}"



# --- loading -------------------------------------------------------------------------


def test_load_app_validates_spec(shop: BundledApp) -> None:
    assert shop.name == "shop"
    assert set(shop.spec.goal_pages()) == {"cart", "confirmation", "settings_saved"}
    graph = shop.spec.graph()
    assert nx.is_directed_acyclic_graph(graph)
    routes = list(nx.all_simple_paths(graph, shop.spec.start, "dish"))
    assert len(routes) >= 2, "path sampling needs a choice of routes to a dish"


def test_load_app_unknown_lists_known() -> None:
    with pytest.raises(UnknownAppError, match="bundled apps: .*shop"):
        load_app("no-such-app")


def test_load_app_rejects_goal_with_missing_checker(monkeypatch: pytest.MonkeyPatch) -> None:
    def lacking() -> BundledApp:
        app = shop_module.ShopApp()
        app.checkers = {k: v for k, v in app.checkers.items() if k != "order_placed"}
        return app

    monkeypatch.setattr("trajforge.envs.apps.shop.create_app", lacking)
    with pytest.raises(SpecError, match=r"spec\.yaml: pages\.confirmation\.goal\.checker: .*'order_placed'"):
        load_app("shop")


@pytest.mark.parametrize("name", known_apps())
def test_every_app_spec_is_a_usable_task_graph(name: str) -> None:
    """Acyclic, every page reachable and on the way to a goal, at least three goals each
    with its own checker, and a goal with two routes (path sampling needs a choice)."""
    app = load_app(name)
    spec, graph = app.spec, app.spec.graph()
    assert spec.app == name == app.name
    assert nx.is_directed_acyclic_graph(graph)
    goals = spec.goal_pages()
    assert len(goals) >= 3
    assert nx.descendants(graph, spec.start) | {spec.start} == set(spec.pages)
    for page in spec.pages:
        assert page in goals or any(nx.has_path(graph, page, g) for g in goals), f"{page} leads to no goal"
    assert {spec.pages[g].goal.checker for g in goals} == set(app.checkers), "a checker without a goal is dead code"
    routes = {g: len(list(nx.all_simple_paths(graph, spec.start, g))) for g in goals}
    assert max(routes.values()) >= 2, routes


@pytest.mark.parametrize("name", known_apps())
def test_spec_and_stylesheet_are_package_data(name: str) -> None:
    """pyproject ships `*/*.yaml` and `*/static/*` of envs.apps: each app keeps its files there."""
    app = load_app(name)
    assert app.spec_path == app.package_dir / "spec.yaml" and app.spec_path.is_file()
    assert (app.static_dir / "style.css").is_file()


def shop_spec_with(tmp_path: Path, **action: str) -> Path:
    """FreshCart's spec with the settings transition's first action replaced by `action`."""
    raw = yaml.safe_load((Path(shop_module.__file__).parent / "spec.yaml").read_text())
    index = next(i for i, t in enumerate(raw["transitions"]) if t["to"] == "settings_saved")
    raw["transitions"][index]["actions"][0] = action
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    return path


@pytest.mark.parametrize(("action", "error"), [
    ({"op": "check", "role": "checkbox"}, "op 'check' needs role and name"),
    ({"op": "uncheck", "role": "radio", "name": "Order notifications"}, "op 'uncheck' needs role checkbox or switch"),
    ({"op": "check", "role": "checkbox", "name": "Order notifications", "text": "on"}, "op 'check' takes no text"),
    ({"op": "set_checked", "role": "switch", "name": "Order notifications"}, "op 'set_checked' needs text"),
    ({"op": "set_checked", "role": "checkbox", "name": "Order notifications", "text": "yes"},
     "op 'set_checked' needs text 'on', 'off' or one {slot}, got 'yes'"),
    ({"op": "set_checked", "role": "checkbox", "name": "Order notifications", "text": "{address}"},
     "transitions[7].actions[0].text: set_checked needs on or off, slot {address} has ['12 Baker Street"),
])
def test_check_ops_are_validated_with_file_and_field(tmp_path: Path, action: dict[str, str], error: str) -> None:
    path = shop_spec_with(tmp_path, **action)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(path) in str(err.value)
    assert error in str(err.value), str(err.value)


def test_check_ops_accept_a_fixed_state_or_an_on_off_slot(tmp_path: Path) -> None:
    for action in ({"op": "check", "role": "checkbox", "name": "Order notifications"},
                   {"op": "uncheck", "role": "switch", "name": "Order notifications"},
                   {"op": "set_checked", "role": "checkbox", "name": "Order notifications", "text": "off"},
                   {"op": "set_checked", "role": "checkbox", "name": "Order notifications", "text": "{notifications}"}):
        transition = load_spec(shop_spec_with(tmp_path, **action)).graph().edges["settings", "settings_saved"]
        assert transition["transition"].actions[0].op == action["op"]


# --- server sessions (every app) ----------------------------------------------------

ACCOUNT_PASSWORD = "harbor-Tide-8312"
"""Harbor ID's demo password (the README gives it; the app holds only its SHA-256)."""
SIGN_IN = {"username": "alice", "password": ACCOUNT_PASSWORD}

MUTATIONS: dict[str, tuple[str, dict[str, str]]] = {
    "shop": ("/cart/add", {"dish": "Pad Thai", "size": "Large", "quantity": "2"}),
    "mail": ("/message/star", {"id": "1", "starred": "yes"}),
    "calendar": ("/event/delete", {"id": "1"}),
    "notes": ("/note/pin", {"id": "1", "pinned": "yes"}),
    "settings": ("/wifi", {}),
    "writer": ("/documents/new", {"title": "Reading list"}),
    "account": ("/", SIGN_IN),
}
"""One accepted form post per app that changes its state (a new app must add one)."""


@pytest.mark.parametrize("name", known_apps())
def test_sessions_are_isolated(servers: dict[str, AppServer], name: str) -> None:
    server = servers[name]
    initial = server.app.initial_state()
    post(server, "alice", *MUTATIONS[name])
    assert state(server, "alice") != initial
    assert state(server, "bob") == initial, "another cookie must see its own, fresh state"
    assert server.state("alice") == state(server, "alice")


@pytest.mark.parametrize("name", known_apps())
def test_unknown_session_starts_from_initial_state(servers: dict[str, AppServer], name: str) -> None:
    assert state(servers[name], "never-seen-before") == servers[name].app.initial_state()


@pytest.mark.parametrize("name", known_apps())
def test_request_without_cookie_gets_one(servers: dict[str, AppServer], name: str) -> None:
    server = servers[name]
    status, body, headers = http(server, "GET", "/")
    assert status == 200 and f"· {server.app.spec.title}</title>" in body
    assert headers["Set-Cookie"].startswith(f"{SESSION_COOKIE}=")


@pytest.mark.parametrize("name", known_apps())
def test_pages_are_never_cached_but_stylesheets_and_scripts_are(servers: dict[str, AppServer], name: str) -> None:
    """A page shows its session's state, so the browser asks for it every time; the stylesheet and scripts are
    the same for every session, so a step that loads a new page keeps them (a shop page loaded in 113 ms with
    them fetched again, 60 ms with them kept). Every value sent counts: `no-store` beside `max-age` wins."""
    server = servers[name]
    paths = ["/", "/static/style.css", "/__kit/interactions.js"]
    cache_control = {}
    for path in paths:
        with urllib.request.urlopen(server.base_url + path) as resp:
            cache_control[path] = resp.headers.get_all("Cache-Control")
    assert cache_control == {"/": ["no-store"], "/static/style.css": ["max-age=3600"],
                             "/__kit/interactions.js": ["max-age=3600"]}


@pytest.mark.parametrize("name", known_apps())
def test_reset_restores_initial_state_exactly(servers: dict[str, AppServer], name: str) -> None:
    server = servers[name]
    initial = server.app.initial_state()
    post(server, "carol", *MUTATIONS[name])
    assert state(server, "carol") != initial
    status, body, _ = http(server, "POST", "/__reset", "carol")
    assert status == 200 and json.loads(body) == initial
    assert state(server, "carol") == initial
    post(server, "carol", *MUTATIONS[name])  # the seed itself was not changed by the first episode
    assert state(server, "dave") == initial == server.app.initial_state()


# --- server-side validation -----------------------------------------------------------


def test_sign_in_refuses_a_wrong_password_and_keeps_none(servers: dict[str, AppServer]) -> None:
    """A placeholder typed as itself is a wrong password; what was typed is in no state and no answer."""
    server = servers["account"]
    for typed in ("<secret>account_password</secret>", ACCOUNT_PASSWORD.upper()):
        status, body, _ = http(server, "POST", "/", "frank", {"username": "alice", "password": typed})
        assert status == 400 and "Wrong username or password." in body and typed not in body
    status, _, headers = http(server, "GET", "/account/security", "frank")
    assert status == 303 and headers["Location"] == "/", "a signed-out visitor is sent to Sign in"
    post(server, "frank", "/", SIGN_IN)
    seen = state(server, "frank")
    assert seen["signed_in"] == "alice" and seen["failed_sign_ins"] == 2
    assert ACCOUNT_PASSWORD not in json.dumps(seen)


def test_checkout_rejects_empty_address(server: AppServer) -> None:
    http(server, "POST", "/cart/add", "dave", {"dish": "Caesar Salad", "size": "Medium", "quantity": "1"})
    status, body, _ = http(server, "POST", "/checkout", "dave", {"address": "   ", "payment": "Card"})
    assert status == 400 and "Enter a delivery address." in body
    assert state(server, "dave")["orders"] == []
    status, body, _ = http(server, "POST", "/checkout", "dave", {"address": "5 Rue de Rivoli, Paris"})
    assert status == 400 and "Choose a payment method." in body
    status, _, headers = http(server, "POST", "/checkout", "dave",
                              {"address": "5 Rue de Rivoli, Paris", "payment": "Card"})
    assert status == 303 and headers["Location"] == "/confirmation?order=FC-1001"
    assert state(server, "dave")["orders"][0]["address"] == "5 Rue de Rivoli, Paris"


def test_add_to_cart_validates_size_and_quantity(server: AppServer) -> None:
    status, body, _ = http(server, "POST", "/cart/add", "erin", {"dish": "Pad Thai", "quantity": "1"})
    assert status == 400 and "Choose a size." in body
    status, body, _ = http(server, "POST", "/cart/add", "erin", {"dish": "Pad Thai", "size": "Small", "quantity": "0"})
    assert status == 400 and "Quantity must be" in body
    assert state(server, "erin")["cart"] == []


def test_removing_a_cart_line_by_a_digit_that_is_no_number_keeps_the_cart(server: AppServer) -> None:
    """"²" is a digit to str.isdigit but not a number to int(): the post removes nothing instead of answering 500."""
    post(server, "gwen", "/cart/add", {"dish": "Pad Thai", "size": "Small", "quantity": "1"})
    for index in ("²", "x", "5"):
        status, _, headers = http(server, "POST", "/cart/remove", "gwen", {"index": index})
        assert status == 303 and headers["Location"] == "/cart", index
    assert len(state(server, "gwen")["cart"]) == 1
    post(server, "gwen", "/cart/remove", {"index": "0"})
    assert state(server, "gwen")["cart"] == []


def test_checkout_with_empty_cart_is_refused(server: AppServer) -> None:
    status, body, _ = http(server, "POST", "/checkout", "frank", {"address": "x", "payment": "Cash"})
    assert status == 400 and "cart is empty" in body
    assert state(server, "frank")["orders"] == []


def test_mail_refuses_a_bad_message_and_keeps_what_was_typed(servers: dict[str, AppServer]) -> None:
    server, session = servers["mail"], "mail-validation"
    good = {"to": "maya.chen@example.com", "subject": "Lunch next week", "body": "Are you free on Tuesday?"}
    for change, error in [
        ({"to": " "}, "Enter a recipient."),
        ({"to": "maya.chen@"}, "“maya.chen@” is not an email address."),
        ({"to": "maya chen@example.com"}, "is not an email address."),
        ({"subject": ""}, "Enter a subject."),
        ({"subject": "x" * 151}, "The subject is too long (150 characters at most)."),
        ({"body": "  "}, "Write a message."),
    ]:
        status, body, _ = http(server, "POST", "/compose", session, {**good, **change})
        assert status == 400 and error in body and 'role="alert"' in body, change
    assert 'value="Lunch next week"' in body, "a refused form keeps what was typed"
    assert state(server, session) == server.app.initial_state(), "a refused message must not be stored"
    status, _, headers = http(server, "POST", "/compose", session, good)
    assert status == 303 and headers["Location"] == "/sent?id=9"
    assert state(server, session)["messages"][-1] | {"date": ""} == {
        "id": 9, "folder": "sent", "sender": "Alex Morgan", "sender_email": "alex.morgan@example.com", "date": "",
        "to": "maya.chen@example.com", "subject": "Lunch next week", "body": "Are you free on Tuesday?",
        "read": True, "starred": False}


def test_mail_refuses_unknown_or_already_archived_messages(servers: dict[str, AppServer]) -> None:
    server, session = servers["mail"], "mail-archive-twice"
    post(server, session, "/message/archive", {"id": "2"})
    status, _, _ = http(server, "POST", "/message/archive", session, {"id": "2"})
    assert status == 404
    assert http(server, "POST", "/message/star", session, {"id": "99", "starred": "yes"})[0] == 404
    assert http(server, "GET", "/message?id=99", session)[0] == 404
    folders = {m["id"]: m["folder"] for m in state(server, session)["messages"]}
    assert folders[2] == "archive" and list(folders.values()).count("archive") == 2


def test_calendar_refuses_incomplete_events(servers: dict[str, AppServer]) -> None:
    server, session = servers["calendar"], "calendar-validation"
    good = {"title": "Yoga class", "day": "Thursday", "time": "18:30", "location": ""}
    for change, error in [
        ({"title": "  "}, "Enter a title."),
        ({"title": "x" * 81}, "80 characters at most"),
        ({"day": ""}, "Choose a day."),
        ({"day": "Someday"}, "Choose a day."),
        ({"time": "18:45"}, "Choose a time."),
    ]:
        status, body, _ = http(server, "POST", "/events", session, {**good, **change})
        assert status == 400 and error in body and 'role="alert"' in body, change
        status, body, _ = http(server, "POST", "/event/edit", session, {"id": "3", **good, **change})
        assert status == 400 and error in body, change
    assert state(server, session) == server.app.initial_state()
    assert http(server, "POST", "/event/delete", session, {"id": "99"})[0] == 404
    status, _, headers = http(server, "POST", "/events", session, good)
    assert status == 303 and headers["Location"] == "/event?id=7&notice=saved"
    assert state(server, session)["events"][-1] == {"id": 7, **good}


def test_notes_refuse_untitled_and_duplicate_titles(servers: dict[str, AppServer]) -> None:
    server, session = servers["notes"], "notes-validation"
    status, body, _ = http(server, "POST", "/notes", session, {"title": " ", "body": "x"})
    assert status == 400 and "Give the note a title." in body
    status, body, _ = http(server, "POST", "/notes", session, {"title": " grocery  LIST ", "body": "x"})
    assert status == 400 and "There is already a note called “grocery LIST”." in body
    status, body, _ = http(server, "POST", "/note/edit", session, {"id": "2", "title": "Garden plans", "body": ""})
    assert status == 400 and "already a note called" in body
    assert state(server, session) == server.app.initial_state()
    # Keeping its own title is no clash; unknown tag fields are ignored, known ones kept in order.
    post(server, session, "/note/edit", {"id": "5", "title": "Garden plans", "body": "Plant garlic.",
                                         "tag-travel": "on", "tag-work": "on", "tag-banana": "on"})
    assert state(server, session)["notes"][4] == {"id": 5, "title": "Garden plans", "body": "Plant garlic.",
                                                  "pinned": False, "tags": ["Work", "Travel"]}


def test_settings_refuse_a_level_while_adaptive_brightness_is_on(servers: dict[str, AppServer]) -> None:
    server, session = servers["settings"], "settings-validation"
    for path, form, error in [
        ("/display/brightness", {"adaptive": "on", "level": "High"}, "Turn off Adaptive brightness"),
        ("/display/brightness", {"level": "Blinding"}, "Choose a brightness level."),
        ("/languages", {"language": "Klingon"}, "Choose a language."),
        ("/sound", {"ringtone": "Air horn", "vibrate": "on"}, "Choose a ringtone."),
    ]:
        status, body, _ = http(server, "POST", path, session, form)
        assert status == 400 and error in body and 'role="alert"' in body, form
    assert state(server, session) == server.app.initial_state()
    post(server, session, "/display/brightness", {"adaptive": "on", "level": "Medium"})  # unchanged level: fine
    post(server, session, "/display/brightness", {"level": "High"})
    assert state(server, session)["display"] == {"adaptive_brightness": False, "brightness": "High",
                                                 "dark_theme": False}


# --- checkers --------------------------------------------------------------------------

ORDERED = {
    "cart": [],
    "orders": [{"number": "FC-1001", "lines": [{"dish": "Pad Thai", "size": "Large", "quantity": 1}],
                "address": "12 Baker Street, London", "payment": "Card", "total_cents": 1350}],
    "settings": {"order_notifications": False},
    "settings_saves": 1,
}
IN_CART = {"cart": [{"dish": "Miso Ramen", "size": "Small", "quantity": 1}], "orders": [],
           "settings": {"order_notifications": True}, "settings_saves": 0}


# The shop's checkers on hand-made states: (checker, params, right state, wrong state).
SHOP_CHECKER_CASES: list[tuple[str, dict[str, str], dict[str, Any], dict[str, Any]]] = [
    ("in_cart", {"dish": "Miso Ramen", "size": "Small"}, IN_CART, {**IN_CART, "cart": []}),
    ("in_cart", {"dish": "Miso Ramen", "size": "small"}, IN_CART,
     {**IN_CART, "cart": [{"dish": "Miso Ramen", "size": "Large", "quantity": 1}]}),
    # The task asks for one dish: the cart or the order holds it and nothing else, one of it unless a quantity is asked.
    ("in_cart", {"dish": "Miso Ramen", "size": "Small"}, IN_CART,
     {**IN_CART, "cart": [*IN_CART["cart"], {"dish": "Pad Thai", "size": "Large", "quantity": 1}]}),
    ("in_cart", {"dish": "Miso Ramen", "size": "Small"}, IN_CART,
     {**IN_CART, "cart": [{"dish": "Miso Ramen", "size": "Small", "quantity": 10}]}),
    ("in_cart", {"dish": "Miso Ramen", "size": "Small", "quantity": "2"},
     {**IN_CART, "cart": [{"dish": "Miso Ramen", "size": "Small", "quantity": 2}]}, IN_CART),
    ("order_placed", {"dish": "Pad Thai", "size": "Large", "address": "12 Baker Street, London", "payment": "Card"},
     ORDERED, {**ORDERED, "orders": [{**ORDERED["orders"][0], "lines": [
         {"dish": "Pad Thai", "size": "Medium", "quantity": 1}, {"dish": "Pad Thai", "size": "Large", "quantity": 1},
         {"dish": "Miso Ramen", "size": "Large", "quantity": 1}]}]}),
    ("order_placed", {"dish": "Pad Thai", "size": "Large", "address": "12 Baker Street, London", "payment": "Card"},
     ORDERED, {**ORDERED, "orders": [{**ORDERED["orders"][0], "lines": [
         {"dish": "Pad Thai", "size": "Large", "quantity": 10}]}]}),
    ("order_placed", {"dish": "Pad Thai", "size": "Large", "address": "12 Baker Street, London", "payment": "Card"},
     ORDERED, {**ORDERED, "orders": []}),
    ("order_placed", {"dish": "Pad Thai", "size": "Large", "address": "12 Baker Street, London", "payment": "Cash"},
     {**ORDERED, "orders": [{**ORDERED["orders"][0], "payment": "Cash"}]}, ORDERED),
    ("notifications_set", {"notifications": "off"}, ORDERED, IN_CART),
    ("notifications_set", {"notifications": "on"},
     {**IN_CART, "settings_saves": 2}, IN_CART),  # on by default, but never saved
]


@pytest.mark.parametrize(("checker", "params", "right", "wrong"), SHOP_CHECKER_CASES)
def test_checker_true_on_right_state_false_on_wrong(
    shop: BundledApp, checker: str, params: dict[str, str], right: dict[str, Any], wrong: dict[str, Any]
) -> None:
    ok, reason = shop.check(checker, params, right)
    assert ok, reason
    ok, reason = shop.check(checker, params, wrong)
    assert not ok and reason


def test_checker_reasons_say_what_was_found(shop: BundledApp) -> None:
    ok, reason = shop.check("order_placed", {"dish": "Pad Thai", "size": "Large",
                                             "address": "221 Elm Avenue, Springfield", "payment": "Card"}, ORDERED)
    assert not ok and "address '12 Baker Street, London'" in reason
    ok, reason = shop.check("in_cart", {"dish": "Pad Thai"}, IN_CART)
    assert not ok and "lack size" in reason
    ok, reason = shop.check("in_cart", {"dish": "Miso Ramen", "size": "Small"},
                            {**IN_CART, "cart": [*IN_CART["cart"], *IN_CART["cart"]]})
    assert not ok and "should hold just 1 × Small Miso Ramen; it holds 1 × Small Miso Ramen; 1 × Small" in reason
    ok, reason = shop.check("in_cart", {"dish": "Miso Ramen", "size": "Small", "quantity": "two"}, IN_CART)
    assert not ok and "quantity must be a whole number" in reason


def test_unknown_checker_raises(shop: BundledApp) -> None:
    with pytest.raises(ValueError, match="known: in_cart"):
        shop.check("no_such_checker", {}, IN_CART)


# Checkers of the other apps, judged on states the app itself reached: each case is
# (app, checker, params, posts to the right state, posts to a wrong one, what the
# wrong state's reason must say). The wrong state differs from the right one in one way.
Posts = list[tuple[str, dict[str, str]]]
PROPOSAL = ("We propose a shared calendar for the three studios. It replaces the paper schedule by March and costs "
            "less than the current booking tool.")
"""The text of Writer's "Project proposal", the document open when its tasks start."""
CHECKER_CASES: list[tuple[str, str, dict[str, str], Posts, Posts, str]] = [
    ("mail", "message_sent",
     {"to": "maya.chen@example.com", "subject": "Lunch next week", "body": "Are you free on Tuesday?"},
     [("/compose", {"to": "Maya.Chen@example.com ", "subject": "lunch  next week",
                    "body": "Are you free on Tuesday?"})],
     [("/compose", {"to": "leo.martins@example.com", "subject": "Lunch next week",
                    "body": "Are you free on Tuesday?"})],
     "sent: to maya.chen@example.com: 'Re: Project timeline'"),
    ("mail", "reply_sent", {"message": "Dinner on Saturday?", "body": "Count me in!"},
     [("/compose", {"to": "leo.martins@example.com", "subject": "Re: Dinner on Saturday?", "body": "Count me in!"})],
     [("/compose", {"to": "leo.martins@example.com", "subject": "Dinner on Saturday?", "body": "Count me in!"})],
     "no reply to 'Dinner on Saturday?'"),
    ("mail", "message_starred", {"message": "Photos from the hike"},
     [("/message/star", {"id": "5", "starred": "yes"})],
     [("/message/star", {"id": "5", "starred": "yes"}), ("/message/star", {"id": "5", "starred": "no"})],
     "'Photos from the hike' is not starred"),
    ("mail", "message_archived", {"message": "Team offsite agenda"},
     [("/message/archive", {"id": "1"})], [("/message/archive", {"id": "2"})],
     "'Team offsite agenda' is in the inbox"),
    ("calendar", "event_created", {"title": "Yoga class", "day": "Thursday", "time": "18:30"},
     [("/events", {"title": "yoga  class", "day": "Thursday", "time": "18:30"})],
     [("/events", {"title": "Yoga class", "day": "Friday", "time": "18:30"})],
     "'Yoga class' is on Friday 18:30, not Thursday 18:30"),
    ("calendar", "event_moved", {"event": "Piano lesson", "day": "Friday", "time": "14:00"},
     [("/event/edit", {"id": "3", "title": "Piano lesson", "day": "Friday", "time": "14:00"})],
     [("/events", {"title": "Piano lesson", "day": "Friday", "time": "14:00"})],  # a copy; the lesson stays
     "expected one event titled 'Piano lesson', found 2"),
    # Moved is the initial week's event, by its id, with the rest of the week as it was.
    ("calendar", "event_moved", {"event": "Project kickoff", "day": "Friday", "time": "14:00"},
     [("/event/edit", {"id": "1", "title": "Project kickoff", "day": "Friday", "time": "14:00",
                       "location": "Room 4B"})],
     [*[("/event/delete", {"id": str(i)}) for i in range(1, 7)],
      ("/events", {"title": "Project kickoff", "day": "Friday", "time": "14:00"})],
     "'Project kickoff' on Friday 14:00 is a new event, not the initial week's, moved"),
    ("calendar", "event_moved", {"event": "Project kickoff", "day": "Friday", "time": "14:00"},
     [("/event/edit", {"id": "1", "title": "Project kickoff", "day": "Friday", "time": "14:00"})],
     [("/event/edit", {"id": "1", "title": "Project kickoff", "day": "Friday", "time": "14:00"}),
      ("/event/edit", {"id": "2", "title": "Lunch with Priya", "day": "Friday", "time": "14:00"})],
     "but 'Lunch with Priya' changed or went"),
    ("calendar", "event_deleted", {"event": "Book club"},
     [("/event/delete", {"id": "5"})],
     [("/event/delete", {"id": "5"}), ("/event/delete", {"id": "6"})],
     "but so are 'Farmers market'"),
    # An edit keeps the event's id: renaming "Book club" is not deleting it, nor is renaming
    # "Piano lesson" to the asked title and time creating an event.
    ("calendar", "event_deleted", {"event": "Book club"},
     [("/event/delete", {"id": "5"})],
     [("/event/edit", {"id": "5", "title": "Reading circle", "day": "Friday", "time": "19:00"})],
     "'Book club' is still there: 'Reading circle' Friday 19:00"),
    ("calendar", "event_created", {"title": "Yoga class", "day": "Thursday", "time": "18:30"},
     [("/events", {"title": "Yoga class", "day": "Thursday", "time": "18:30"})],
     [("/event/edit", {"id": "3", "title": "Yoga class", "day": "Thursday", "time": "18:30"})],
     "'Yoga class' is an event of the initial week, renamed, not a new event"),
    ("notes", "note_created", {"title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.",
                               "tag": "Recipes"},
     [("/notes", {"title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.", "tag-recipes": "on"})],
     [("/notes", {"title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.", "tag-ideas": "on"})],
     "has tags ['Ideas'], not 'Recipes'"),
    ("notes", "note_created", {"title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.",
                               "tag": "Recipes"},
     [("/notes", {"title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.", "tag-recipes": "on"})],
     [("/note/edit", {"id": "4", "title": "Pasta recipe", "body": "Garlic, chili, lemon zest and parmesan.",
                      "tag-recipes": "on"})],  # "Book recommendations" retitled and rewritten
     "'Pasta recipe' is an initial note, retitled, not a new note"),
    ("notes", "note_pinned", {"note": "Garden plans"},
     [("/note/pin", {"id": "5", "pinned": "yes"})], [("/note/pin", {"id": "4", "pinned": "yes"})],
     "'Garden plans' is not pinned"),
    ("notes", "note_tagged", {"note": "Grocery list", "tag": "Recipes"},
     [("/note/edit", {"id": "1", "title": "Grocery list", "body": "Milk", "tag-personal": "on", "tag-recipes": "on"})],
     [("/note/edit", {"id": "1", "title": "Grocery list", "body": "Milk", "tag-personal": "on"})],
     "has tags ['Personal'], not 'Recipes'"),
    ("settings", "setting_is", {"setting": "wifi", "value": "off"}, [("/wifi", {})], [("/wifi", {"wifi": "on"})],
     "wifi is on, not off"),
    ("settings", "setting_is", {"setting": "brightness", "value": "High"},
     [("/display/brightness", {"level": "High"})], [("/display/brightness", {"adaptive": "on", "level": "Medium"})],
     "brightness is Adaptive, not High"),
    ("settings", "setting_is", {"setting": "dark_theme", "value": "on"},
     [("/display/dark-theme", {"dark_theme": "on"})], [("/display/dark-theme", {})], "dark_theme is off, not on"),
    ("settings", "setting_is", {"setting": "ringtone", "value": "Marimba"},
     [("/sound", {"ringtone": "Marimba"})], [("/sound", {"ringtone": "Ripple", "vibrate": "on"})],
     "ringtone is Ripple, not Marimba"),
    ("settings", "setting_is", {"setting": "language", "value": "Deutsch"},
     [("/languages", {"language": "Deutsch"})], [("/languages", {"language": "Italiano"})],
     "language is Italiano, not Deutsch"),
    ("writer", "document_text", {"text": "Budget review on Friday."},
     [("/save", {"id": "1", "text": f"{PROPOSAL}  budget review on Friday."})],
     [("/save", {"id": "2", "text": "Budget review on Friday."})],
     "'Project proposal' does not contain 'Budget review on Friday.'"),
    # Added to the document open at the start: not typed over all of it, nor into a document made later.
    ("writer", "document_text", {"text": "Budget review on Friday."},
     [("/save", {"id": "1", "text": f"Budget review on Friday.\n{PROPOSAL}"})],
     [("/save", {"id": "1", "text": "Budget review on Friday."})],
     "'Project proposal' contains 'Budget review on Friday.' but lost its text"),
    ("writer", "document_text", {"text": "Budget review on Friday."},
     [("/save", {"id": "1", "text": f"{PROPOSAL} Budget review on Friday."})],
     [("/documents/new", {"title": "Budget"}), ("/save", {"id": "4", "text": "Budget review on Friday."})],
     "'Project proposal' does not contain 'Budget review on Friday.'"),
    ("writer", "document_shared", {"email": "maya.chen@example.com"},
     [("/share", {"email": "Maya.Chen@example.com"})], [("/share", {"email": "leo.martins@example.com"})],
     "not shared with maya.chen@example.com"),
    ("account", "signed_in", {"user": "alice"}, [("/", SIGN_IN)], [("/", SIGN_IN), ("/account/sign-out", {})],
     "signed out, after 0 failed sign-ins"),
    ("account", "two_step_is", {"value": "on"}, [("/", SIGN_IN), ("/account/security", {"two_step": "on"})],
     [("/", SIGN_IN), ("/account/security", {})], "two-step verification is off"),
    # The stored setting is judged, as the display name is: signing out after turning it on does not undo it.
    ("account", "two_step_is", {"value": "on"},
     [("/", SIGN_IN), ("/account/security", {"two_step": "on"}), ("/account/sign-out", {})],
     [("/", SIGN_IN), ("/account/security", {}), ("/account/sign-out", {})], "two-step verification is off"),
    ("account", "display_name_is", {"name": "Alice Moreau"},
     [("/", SIGN_IN), ("/account/profile", {"display_name": "alice  moreau"})],
     [("/", SIGN_IN), ("/account/profile", {"display_name": "Ali Martin"})], "the display name is 'Ali Martin'"),
    ("writer", "surface_opened", {"surface": "Page setup"},
     [("/surfaces", {"surface": "Page setup"})], [("/surfaces", {"surface": "Word count"})],
     "'Page setup' was not opened; opened: ['Word count']"),
]


@pytest.mark.parametrize(("name", "checker", "params", "right", "wrong", "reason"), CHECKER_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CHECKER_CASES)])
def test_app_checker_true_on_right_state_false_on_wrong(
    request: pytest.FixtureRequest, servers: dict[str, AppServer], name: str, checker: str,
    params: dict[str, str], right: Posts, wrong: Posts, reason: str,
) -> None:
    server = servers[name]
    for kind, posts in (("right", right), ("wrong", wrong)):
        session = f"{request.node.name}-{kind}"
        for path, form in posts:
            post(server, session, path, form)
        ok, why = server.app.check(checker, params, state(server, session))
        assert ok == (kind == "right"), f"{kind} state: {why}"
    assert reason in why


def test_every_goal_of_every_app_has_a_checker_case() -> None:
    covered = {(c[0], c[1]) for c in CHECKER_CASES} | {("shop", c[0]) for c in SHOP_CHECKER_CASES}
    needed = {(name, checker) for name in known_apps() for checker in load_app(name).checkers}
    assert needed <= covered, needed - covered


@pytest.mark.parametrize("name", known_apps())
def test_no_goal_holds_where_its_task_starts(servers: dict[str, AppServer], name: str) -> None:
    """Every goal with every value its slots offer fails on the state its task starts from: a goal already met
    there ("Turn on Wi-Fi" with Wi-Fi on) succeeds for an agent that stops at step 0, a wrong label. Tasks start
    from the initial state; Harbor ID's all sign in first, so its goals past the sign-in must fail after it too."""
    app = load_app(name)
    starts = [("initial", app.initial_state(), app.spec.goal_pages())]
    if name == "account":
        post(servers[name], "start-signed-in", "/", SIGN_IN)
        starts.append(("signed in", state(servers[name], "start-signed-in"), ["profile_saved", "security_saved"]))
    values = app.spec.slot_values()
    for where, start, goals in starts:
        for page in goals:
            goal = app.spec.pages[page].goal
            assert goal is not None
            slots = sorted(set(placeholders(goal.instruction)).union(*map(placeholders, goal.params.values())))
            for combo in itertools.product(*(values[slot] for slot in slots)):
                filled = dict(zip(slots, combo))
                params = {k: v.format_map(filled) for k, v in goal.params.items()}
                ok, why = app.check(goal.checker, params, start)
                assert not ok, f"{name}.{page} {filled} holds on the {where} state: {why}"


@pytest.mark.parametrize("name", known_apps())
def test_checkers_refuse_missing_params(name: str) -> None:
    app = load_app(name)
    for checker in app.checkers:
        ok, reason = app.check(checker, {}, app.initial_state())
        assert not ok and reason.startswith("checker params lack "), (checker, reason)


def test_setting_is_names_the_settings_it_knows() -> None:
    app = load_app("settings")
    ok, reason = app.check("setting_is", {"setting": "volume", "value": "high"}, app.initial_state())
    assert not ok and "unknown setting 'volume'; known: wifi, brightness" in reason


# --- rendering in a real browser ----------------------------------------------------------

PAGES: dict[str, list[str]] = {
    "shop": ["/", "/search?q=pizza", "/dish/Pad%20Thai", "/cart", "/checkout", "/settings", "/settings/saved"],
    "mail": ["/", "/?archived=1", "/search?q=dinner", "/message?id=1", "/message?id=6", "/compose",
             "/compose?reply=3", "/sent?id=8", "/folder/starred", "/folder/sent", "/folder/archive"],
    "calendar": ["/", "/?deleted=Book%20club", "/day?d=Monday", "/search?q=lunch", "/event?id=2&notice=saved",
                 "/events/new", "/events/new?day=Friday", "/event/edit?id=2", "/event/delete?id=3"],
    "notes": ["/", "/?q=garden", "/note?id=6", "/note?id=1&notice=updated", "/notes/new", "/note/edit?id=3"],
    "settings": ["/", "/wifi", "/wifi?saved=1", "/display", "/display/brightness", "/display/dark-theme",
                 "/accessibility", "/sound", "/languages"],
    "writer": ["/", "/documents/new"],
    "account": ["/", "/account", "/account/profile", "/account/profile?saved=1", "/account/security",
                "/account/security?saved=1"],
}
"""Pages of each app to render: every page of its spec, with real ids (a new app must add its own)."""

UNNAMED_CONTROL = re.compile(
    r"\s*(button|link|textbox|searchbox|checkbox|radio|switch|menuitem|menuitemcheckbox|menuitemradio|tab"
    r"|combobox|slider|spinbutton|option)\b(?! \")"
)
"""An interactive element without an accessible name, as the env's tree renders it."""


@pytest.fixture(scope="module", params=["mobile", "desktop"])
def env(request: pytest.FixtureRequest, chromium: Path) -> Iterator[BrowserEnv]:
    """One browser context per viewport for the module; each test resets it onto its app."""
    with BrowserEnv(viewport=request.param, chromium=chromium) as e:
        yield e


@pytest.mark.browser
@pytest.mark.parametrize("name", known_apps())
def test_pages_render_in_both_viewports(env: BrowserEnv, servers: dict[str, AppServer], name: str) -> None:
    """Each page loads, fits the screen's width (no sideways scrolling), and every control
    has an accessible name, so a spec can name it and a screen reader can read it."""
    server = servers[name]
    env.reset(f"render-{name}", server.base_url + "/")
    for path in PAGES[name]:
        if name == "account" and path == "/account":  # Harbor ID's own pages need a signed-in session
            assert env.page.request.post(server.base_url + "/", form=SIGN_IN).ok
        response = env.page.goto(server.base_url + path)
        assert response.status == 200, f"{path} answered {response.status}"
        obs = env.observe()
        assert (obs.width, obs.height) == (env.width, env.height)
        overflow = env.page.evaluate("document.documentElement.scrollWidth - innerWidth")
        assert overflow <= 0, f"{path} scrolls sideways by {overflow}px at {env.viewport}"
        unnamed = [line for line in obs.ax_tree.splitlines() if UNNAMED_CONTROL.match(line)]
        assert not unnamed, f"{path}: controls without a name: {unnamed}"


@pytest.mark.browser
def test_shop_tree_shows_cart_and_search_results(env: BrowserEnv, server: AppServer) -> None:
    env.reset("render-shop-tree", server.base_url + "/search?q=pizza")
    tree = env.observe().ax_tree
    assert 'link "Cart (0)"' in tree
    assert 'searchbox "Search dishes": pizza' in tree and 'link "Margherita Pizza"' in tree


@pytest.mark.browser
def test_writers_keyboard_shortcuts_do_what_its_help_lists(servers: dict[str, AppServer], chromium: Path) -> None:
    """Help > Keyboard shortcuts lists Ctrl+B, Ctrl+I and Ctrl+S: pressed as the env's key actions press them,
    they bold and italicise the selected text and save the document, and the recorder reports no click on Save
    that the user never made."""
    select = "word => { const t = document.getElementById('text'); const at = t.value.indexOf(word); t.focus(); " \
             "t.setSelectionRange(at, at + word.length); }"
    with BrowserEnv(viewport="desktop", chromium=chromium) as env:
        env.reset("writer-shortcuts", servers["writer"].base_url + "/")
        env.page.evaluate(select, "propose")
        assert env.act({"type": "key", "keys": ["Control", "b"]}) is None
        env.page.evaluate(select, "shared")
        assert env.act({"type": "key", "keys": ["Control", "i"]}) is None
        assert env.act({"type": "key", "keys": ["Control", "s"]}) is None
        saved = env.app_state()
    assert saved["documents"][0]["text"].startswith("We **propose** a _shared_ calendar for the three studios.")
    assert [e for e in saved.get("ui_events", []) if e["op"] == "click"] == []


def test_settings_app_turns_dark_with_the_dark_theme(servers: dict[str, AppServer]) -> None:
    server, session = servers["settings"], "dark-theme-body"
    assert '<body class="dark">' not in http(server, "GET", "/", session)[1]
    post(server, session, "/display/dark-theme", {"dark_theme": "on"})
    assert '<body class="dark">' in http(server, "GET", "/", session)[1]


# --- the interaction recorder (every app) ---------------------------------------------------


def report(server: AppServer, session: str, events: object) -> tuple[int, str]:
    data = events if isinstance(events, str) else json.dumps(events)  # a str is sent as it is
    req = urllib.request.Request(server.base_url + "/__ui", data=data.encode(), method="POST")
    req.add_header("Cookie", f"{SESSION_COOKIE}={session}")
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("name", known_apps())
def test_every_page_loads_the_interaction_recorder(servers: dict[str, AppServer], name: str) -> None:
    server = servers[name]
    status, body, _ = http(server, "GET", "/")
    assert status == 200 and '<script src="/__kit/interactions.js" defer></script>' in body
    status, script, headers = http(server, "GET", "/__kit/interactions.js")
    assert status == 200 and headers["Content-Type"] == "text/javascript" and 'sendBeacon("/__ui"' in script


@pytest.mark.parametrize("name", known_apps())
def test_reported_interactions_show_in_state_until_reset(servers: dict[str, AppServer], name: str) -> None:
    server, session = servers[name], f"ui-{name}"
    click = {"op": "click", "role": "link", "name": "Inbox", "page": "/", "at": 10.5}
    assert report(server, session, [click])[0] == 204
    assert state(server, session) == {**server.app.initial_state(), "ui_events": [click]}
    status, body, _ = http(server, "POST", "/__reset", session)
    assert status == 200 and json.loads(body) == server.app.initial_state() == state(server, session)


def test_typing_reports_keep_the_fields_latest_value_whatever_order_they_arrive_in(
        servers: dict[str, AppServer]) -> None:
    server, session = servers["notes"], "ui-typing"
    typed = [{"op": "type_at", "role": "searchbox", "name": "Search notes", "page": "/", "at": at, "text": text}
             for at, text in ((1.0, "g"), (3.0, "gar"), (2.0, "ga"))]  # the 2nd keystroke's beacon came last
    for one in typed:
        assert report(server, session, one)[0] == 204
    assert state(server, session)["ui_events"] == [typed[1]]


def test_reports_are_kept_in_the_order_the_page_saw_them_whatever_order_they_arrive_in(
        servers: dict[str, AppServer]) -> None:
    server, session = servers["notes"], "ui-order"
    first = {"op": "click", "role": "searchbox", "name": "Search notes", "page": "/", "at": 1.0}
    second = {"op": "type_at", "role": "searchbox", "name": "Search notes", "page": "/", "at": 2.0, "text": "g"}
    third = {"op": "click", "role": "link", "name": "Garden plans", "page": "/", "at": 3.0}
    for one in (second, third, first):  # the first beacon came last
        assert report(server, session, one)[0] == 204
    assert state(server, session)["ui_events"] == [first, second, third]


@pytest.mark.parametrize(("events", "error"), [
    ("not json", "not JSON"),
    ([{"op": "hover", "role": "link", "name": "x", "page": "/", "at": 1}], "[0].op: 'hover' is not one of click"),
    ([{"op": "click", "role": "link", "page": "/", "at": 1}], "[0].name: missing"),
    ([{"op": "click", "role": "link", "name": 3, "page": "/", "at": 1}], "[0].name: must be a string, got int"),
    ([{"op": "click", "role": "link", "name": "x", "page": "/"}], "[0].at: must be a number"),
    ([{"op": "click", "role": "link", "name": "x", "page": "/", "at": 1, "x": 5}], "[0]: unknown field 'x'"),
])
def test_malformed_interaction_reports_are_refused_naming_the_field(
        servers: dict[str, AppServer], events: object, error: str) -> None:
    server = servers["shop"]
    status, body = report(server, "ui-bad", events)
    assert status == 400 and error in body, body
    assert state(server, "ui-bad") == server.app.initial_state(), "nothing of a refused report is kept"


def test_notes_move_puts_the_card_in_the_other_cards_place(servers: dict[str, AppServer]) -> None:
    server, session = servers["notes"], "move-notes"
    initial = [n["title"] for n in server.app.initial_state()["notes"]]
    post(server, session, "/notes/move", {"id": "5", "to": "2"})  # Garden plans onto Meeting notes 3 Dec
    moved = [n["title"] for n in state(server, session)["notes"]]
    assert moved == [initial[0], initial[4], initial[1], initial[2], initial[3], initial[5]]
    post(server, session, "/notes/move", {"id": "5", "to": "4"})  # down onto Book recommendations: back home
    assert [n["title"] for n in state(server, session)["notes"]] == initial
    assert http(server, "POST", "/notes/move", session, {"id": "5", "to": "99"})[0] == 404

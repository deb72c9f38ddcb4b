"""Page-graph queries (issue 5): model-written instructions, interface validation, quality.

Real parts only: the embedded SmolLM2 through the gateway, the shop served on loopback,
Chromium crawling it. SmolLM2 is weak, so the model tests assert the behaviour (real
calls, the slot constraint, what the rows name), not the quality of the prose.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
from conftest import prompt_version, prompt_versions

from trajforge.envs.apps import AppServer, BundledApp, load_app, not_found
from trajforge.envs.apps.web import Request, Response, redirect
from trajforge.envs.browser import BrowserEnv, EnvFault
from trajforge.envs.kinds import BundledWebKind
from trajforge.envs.pool import EnvPool
from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway
from trajforge.llm.local import SMOLLM2_ID
from trajforge.query_gen.quality import coverage, normalise, remove_near_duplicates
from trajforge.query_gen.sampling import TEMPLATE_GENERATOR, sample_tasks
from trajforge.query_gen.stage import generate_queries
from trajforge.query_gen.synthesis import Synthesiser, flipped_toggle, missing_slot
from trajforge.query_gen.validation import InterfaceValidator
from trajforge.schemas.config import QueryGenSettings
from trajforge.schemas.records import Query

MODEL_GENERATOR = f"{SMOLLM2_ID}+" + prompt_versions("query_synthesis", "query_refine").replace(",", "+")



@pytest.fixture()
def env(chromium: Path) -> Iterator[BrowserEnv]:
    with BrowserEnv(chromium=chromium) as e:
        yield e


@pytest.fixture(scope="module")
def envs(chromium: Path) -> Iterator[list[BrowserEnv]]:
    """Four contexts of one browser, as query generation gives the validator (query_gen.contexts)."""
    with EnvPool(4, chromium=chromium) as pool:
        yield pool.envs


def shop_queries(shop: BundledApp, n: int) -> list[Query]:
    out = generate_queries([BundledWebKind(shop)], run_id="r", settings=QueryGenSettings(num_queries=n, validate_interface=False, atomic_per_app=0))
    return out.rows["queries"]


def with_slot(query: Query, **slots: str) -> Query:
    """The query with some slot values replaced (and so another id)."""
    values = {**json.loads(query.slots_json), **slots}
    return query.model_copy(update={"slots_json": json.dumps(values), "query_id": query.query_id + "-changed"})


# --------------------------------------------------------------------------- synthesis


def test_slot_check_reads_whole_words_case_insensitively() -> None:
    assert missing_slot("add a LARGE pad thai", {"size": "Large", "dish": "Pad Thai"}) is None
    assert missing_slot("Turn notifications off", {"notifications": "on"}) == "notifications"
    assert missing_slot("Order me a Pad Thai", {"dish": "Pad Thai", "size": "Small"}) == "size"


def test_a_toggle_asked_for_the_other_way_is_caught_though_its_value_is_a_word_of_the_sentence() -> None:
    on = {"notifications": "on"}
    assert missing_slot("Turn off order notifications on FreshCart", on) is None  # "on" is in the sentence
    assert flipped_toggle("Turn off order notifications on FreshCart", on) == "notifications"
    assert flipped_toggle("Please disable order notifications on FreshCart", on) == "notifications"
    assert flipped_toggle("Turn order notifications on in FreshCart", on) is None
    assert flipped_toggle("Switch on notifications", {"notifications": "off"}) == "notifications"
    assert flipped_toggle("Turn the dark theme on", {"dark_theme": "off"}) == "dark_theme"
    assert flipped_toggle("Switch off notifications on FreshCart", {"notifications": "off"}) is None
    assert flipped_toggle("Order a Large Pad Thai", {"size": "Large", "dish": "Pad Thai"}) is None


def test_a_toggle_stated_the_other_way_without_a_toggling_verb_is_caught() -> None:
    on, off = {"notifications": "on"}, {"notifications": "off"}
    assert flipped_toggle("Make sure order notifications are off on FreshCart", on) == "notifications"
    assert flipped_toggle("Keep order notifications off on FreshCart", on) == "notifications"
    assert flipped_toggle("Leave order notifications disabled on FreshCart", on) == "notifications"
    assert flipped_toggle("Make sure order notifications are on in FreshCart", off) == "notifications"
    assert flipped_toggle("Keep order notifications on for FreshCart", off) == "notifications"
    assert flipped_toggle("Make sure order notifications are on.", off) == "notifications"
    assert flipped_toggle("Make sure order notifications are enabled on FreshCart", off) == "notifications"
    # "on" before its object is a preposition, not the state the checker wants.
    assert flipped_toggle("Make sure order notifications on FreshCart are off", off) is None
    assert flipped_toggle("Keep order notifications on FreshCart off", off) is None
    assert flipped_toggle("Make sure order notifications are on on FreshCart", on) is None


def test_model_synthesises_and_refines_with_the_slot_constraint(shop: BundledApp, gateway: Gateway) -> None:
    synthesiser = Synthesiser(gateway)
    tasks = sample_tasks(shop.spec, 2, seed=0, max_len=8).tasks
    calls_before = gateway.stats.calls
    for task in tasks:
        written = synthesiser(shop.spec, task)
        assert written.model_id == SMOLLM2_ID
        assert 1 <= len(written.raw) <= 2 and all(isinstance(r, str) for r in written.raw)
        if written.fallback_reason is None:
            assert written.generator == MODEL_GENERATOR and len(written.raw) == 2
            assert missing_slot(written.instruction, dict(task.slots)) is None
        else:
            assert (written.instruction, written.generator) == (task.instruction, TEMPLATE_GENERATOR)
            assert written.fallback_reason.startswith(("refined instruction dropped slot", "synthesised instruction",
                                                       "refined instruction did not parse",
                                                       "refined instruction asks for slot"))
    assert gateway.stats.calls - calls_before >= len(tasks)  # real calls, at least one per task


def test_stage_rows_name_model_and_template_versions(shop: BundledApp, gateway: Gateway) -> None:
    settings = QueryGenSettings(num_queries=2, instructions="model", validate_interface=False, atomic_per_app=0)
    out = generate_queries([BundledWebKind(shop)], run_id="r", settings=settings, gateway=gateway)
    rows = out.rows["queries"]
    assert len(rows) == 2
    assert out.models["instruction_model"] == SMOLLM2_ID
    assert out.prompts == {n: prompt_version(n) for n in ("query_synthesis", "query_refine")}
    fallbacks = sum(n for k, n in out.stats.items() if "model instruction replaced by template" in k)
    assert fallbacks == sum(r.generator == TEMPLATE_GENERATOR for r in rows)
    for row in rows:
        assert row.generator in (MODEL_GENERATOR, TEMPLATE_GENERATOR)
        if row.generator == MODEL_GENERATOR:
            assert missing_slot(row.instruction, json.loads(row.slots_json)) is None


def test_model_instructions_without_a_gateway_are_a_config_error(shop: BundledApp) -> None:
    with pytest.raises(ValueError, match="query_gen.instructions"):
        generate_queries([BundledWebKind(shop)], run_id="r", settings=QueryGenSettings(instructions="model", validate_interface=False, atomic_per_app=0))


def test_a_deep_search_app_with_no_deep_search_queries_asked_is_not_crawled(shop: BundledApp) -> None:
    """`deep_search_queries: 0` turns deep search off: the app's page-graph queries need no live app, so no
    Chromium (it was refused for want of one)."""
    settings = QueryGenSettings(num_queries=3, validate_interface=False, atomic_per_app=0,
                                deep_search_apps=[shop.name], deep_search_queries=0)
    out = generate_queries([BundledWebKind(shop)], run_id="r", settings=settings, chromium=None)
    assert [q.source for q in out.rows["queries"]] == ["page_graph"] * 3


# --------------------------------------------------------------------------- validation


@pytest.mark.browser
def test_validation_keeps_the_shops_queries_and_visits_each_page_once(shop: BundledApp, server: AppServer,
                                                                       env: BrowserEnv, envs: list[BrowserEnv]) -> None:
    queries = shop_queries(shop, 12)
    validator = InterfaceValidator(shop.spec, server.base_url, env)
    result = validator.validate(queries)
    assert result.reasons == {} and result.kept == queries
    assert result.visits == len(validator.cache) < sum(len(q.path) for q in queries)
    assert result.driven["shop cart"] > 0  # the cart is reached by adding the dish, not by its url
    assert validator.validate(queries).visits == 0  # the second run is answered from the cache

    parallel = InterfaceValidator(shop.spec, server.base_url, envs)  # the pages opened four at a time
    assert parallel.validate(queries) == result and parallel.cache == validator.cache


@pytest.mark.browser
def test_a_slot_value_the_shop_lacks_drops_exactly_its_queries(shop: BundledApp, server: AppServer,
                                                               envs: list[BrowserEnv]) -> None:
    queries = shop_queries(shop, 12)
    by_home = next(q for q in queries if q.path[:2] == ["home", "dish"])
    by_search = next(q for q in queries if q.path[:3] == ["home", "search", "dish"])
    gone = [with_slot(by_home, dish="Sushi Platter"), with_slot(by_search, dish="Sushi Platter")]
    result = InterfaceValidator(shop.spec, server.base_url, envs).validate(queries + gone)
    assert result.kept == queries
    assert result.reasons == {
        gone[0].query_id: "page 'home' /: link 'Sushi Platter' not found",
        gone[1].query_id: "page 'dish': could not be reached from /search: link 'Sushi Platter' not found",
    }
    assert result.dropped == {
        "shop: interface validation: page 'home' /: link 'Sushi Platter' not found": 1,
        "shop: interface validation: page 'dish': could not be reached from /search: link 'Sushi Platter' not found": 1,
    }


@pytest.mark.browser
def test_a_size_the_dish_page_lacks_is_found_missing(shop: BundledApp, server: AppServer, env: BrowserEnv) -> None:
    query = next(q for q in shop_queries(shop, 12) if "dish" in q.path and json.loads(q.slots_json)["dish"] == "Pad Thai")
    result = InterfaceValidator(shop.spec, server.base_url, env).validate([with_slot(query, size="Family")])
    assert list(result.reasons.values()) == ["page 'dish' /dish/Pad%20Thai: radio 'Family' not found"]


@pytest.mark.browser
def test_a_renamed_page_drops_the_queries_through_it(shop: BundledApp, server: AppServer,
                                                     envs: list[BrowserEnv]) -> None:
    """A page its url opens is dropped when the url no longer loads; one that a search leads to is driven there,
    as the replay does, and never opens its url."""
    queries = shop_queries(shop, 12)
    raw = shop.spec.model_dump(by_alias=True)
    raw["pages"]["dish"]["url"] = "/dishes/{dish}"  # the spec's page the app does not serve
    renamed = AppSpec.model_validate(raw)
    result = InterfaceValidator(renamed, server.base_url, envs).validate(queries)
    by_url = {q.query_id for q in queries if q.path[:2] == ["home", "dish"]}
    assert by_url and any(q.path[:3] == ["home", "search", "dish"] for q in queries)
    assert set(result.reasons) == by_url
    assert all(r.startswith("page 'dish' /dishes/") and r.endswith("does not load (HTTP 404)")
               for r in result.reasons.values())
    assert [q.query_id for q in result.kept] == [q.query_id for q in queries if q.query_id not in by_url]


@pytest.mark.browser
def test_a_page_entered_by_a_form_is_reached_by_driving_it(envs: list[BrowserEnv]) -> None:
    """Search results exist only after the search is typed and sent: the crawl does that, then
    looks for the note's link. A note the app no longer has is dropped at the results page."""
    notes = load_app("notes")
    out = generate_queries([BundledWebKind(notes)], run_id="r", settings=QueryGenSettings(num_queries=30, validate_interface=False, atomic_per_app=0))
    by_search = next(q for q in out.rows["queries"] if q.path[:3] == ["notes", "search_results", "note"])
    gone = with_slot(by_search, note="Tax return 2024")
    with AppServer(notes) as srv:
        result = InterfaceValidator(notes.spec, srv.base_url, envs).validate([by_search, gone])
    assert result.kept == [by_search]
    assert result.reasons == {gone.query_id: "page 'search_results' /: link 'Tax return 2024' not found"}
    assert result.driven["notes search_results"] == 2


@pytest.mark.browser
def test_a_hiccup_of_the_browser_is_tried_again_and_a_lasting_one_fails_the_crawl(
        shop: BundledApp, chromium: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page that did not load in time says nothing about the app: judged, it would drop every query through
    it for the night (the start page: all of them). It is opened once more, and a fault that stays fails the
    crawl, to be run again, as the rollout reruns faults."""
    queries = shop_queries(shop, 3)
    handle = type(shop).handle
    slow = {"left": 2}  # the first GET / is the crawl's status check, which waits 10 s; the browser waits 2

    def hanging(self: BundledApp, request: Request, state: dict[str, object]) -> Response:
        if request.path == "/" and slow["left"] > 0:
            slow["left"] -= 1
            time.sleep(2.5)
        return handle(self, request, state)

    monkeypatch.setattr(type(shop), "handle", hanging)
    with AppServer(shop) as srv, BrowserEnv(chromium=chromium, action_timeout_s=2) as env:
        result = InterfaceValidator(shop.spec, srv.base_url, env).validate(queries)
        assert result.reasons == {} and result.kept == queries
        slow["left"] = 3  # the status check, then the visit and its second try
        with pytest.raises(EnvFault, match="page 'home' /: .*Timeout") as fault:
            InterfaceValidator(shop.spec, srv.base_url, env).validate(queries[:1])
    assert fault.value.kind == "timeout"


@pytest.mark.browser
def test_an_app_that_does_not_answer_fails_the_crawl_rather_than_dropping_its_queries(
        shop: BundledApp, envs: list[BrowserEnv]) -> None:
    queries = shop_queries(shop, 3)
    with AppServer(shop) as srv:
        base_url = srv.base_url
    with pytest.raises(EnvFault, match="interface validation of shop: / cannot be reached") as fault:
        InterfaceValidator(shop.spec, base_url, envs).validate(queries)
    assert fault.value.kind == "app_down"


@pytest.mark.browser
def test_a_connection_dropped_once_is_asked_again_and_keeps_the_queries(
        shop: BundledApp, envs: list[BrowserEnv], monkeypatch: pytest.MonkeyPatch) -> None:
    """One reset connection on the status check says nothing about the page: the app is asked again."""
    queries = shop_queries(shop, 3)
    urlopen, dropped = urllib.request.urlopen, []

    def drops_the_first(url: str, timeout: float) -> object:
        if not dropped:
            dropped.append(url)
            raise ConnectionResetError(104, "Connection reset by peer")
        return urlopen(url, timeout=timeout)

    monkeypatch.setattr(urllib.request, "urlopen", drops_the_first)
    with AppServer(shop) as srv:
        result = InterfaceValidator(shop.spec, srv.base_url, envs).validate(queries)
    assert dropped and result.reasons == {} and result.kept == queries


@pytest.mark.browser
def test_a_search_that_shows_no_results_drops_the_queries_that_pick_a_result(
        shop: BundledApp, envs: list[BrowserEnv], monkeypatch: pytest.MonkeyPatch) -> None:
    """The result link is looked for on the results the search shows (the dish is driven to through it), not
    skipped because the dish's own url opens: a search that no longer finds anything drops exactly the queries
    that search."""
    queries = shop_queries(shop, 40)
    handle = type(shop).handle
    monkeypatch.setattr(type(shop), "handle", lambda self, request, state: handle(
        self, replace(request, query={}) if request.path == "/search" else request, state))
    with AppServer(shop) as srv:
        result = InterfaceValidator(shop.spec, srv.base_url, envs).validate(queries)
    by_search = [q for q in queries if "search" in q.path]
    assert by_search and set(result.reasons) == {q.query_id for q in by_search}
    for q in by_search:
        dish = json.loads(q.slots_json)["dish"]
        assert result.reasons[q.query_id] == f"page 'dish': could not be reached from /search: link '{dish}' not found"


@pytest.mark.browser
def test_a_link_after_a_form_is_followed_in_the_session_the_form_changed(
        shop: BundledApp, server: AppServer, envs: list[BrowserEnv]) -> None:
    """The header's "Cart (1)" link exists only once the dish is added, and the cart shows Checkout only then:
    opening /cart in a fresh session would drop a path the replay walks."""
    raw = shop.spec.model_dump(by_alias=True)
    raw["pages"]["cart_again"] = {"url": "/cart", "description": "The cart, opened from the header.",
                                  "purpose": "Review the cart."}
    raw["transitions"] += [
        {"from": "cart", "to": "cart_again", "actions": [{"op": "click", "role": "link", "name": "Cart (1)"}]},
        {"from": "cart_again", "to": "checkout", "actions": [{"op": "click", "role": "button", "name": "Checkout"}]},
    ]
    spec = AppSpec.model_validate(raw)
    added = query("Check out a Small Pad Thai", ["home", "dish", "cart", "cart_again", "checkout"],
                  {"dish": "Pad Thai", "size": "Small"}, "added")
    result = InterfaceValidator(spec, server.base_url, envs).validate([added])
    assert result.reasons == {} and result.kept == [added]
    assert result.driven["shop cart_again"] == 1


@pytest.mark.browser
def test_a_url_with_a_slot_that_redirects_a_fresh_session_is_reached_by_driving(
        shop: BundledApp, envs: list[BrowserEnv], monkeypatch: pytest.MonkeyPatch) -> None:
    """A redirect shows that the page needs a session, not that its slot value is gone (only an HTTP error
    does): a shop that sends a dish's page to the home page until the session has seen it, and Harbor ID's
    profile under a url that names the user, behind its sign-in, keep their queries."""
    queries = [q for q in shop_queries(shop, 12) if q.path[:2] == ["home", "dish"]]
    handle = type(shop).handle

    def gated(self: BundledApp, request: Request, state: dict[str, object]) -> Response:
        if request.path == "/":
            state["seen_home"] = True
        elif request.path.startswith("/dish/") and not state.get("seen_home"):
            return redirect("/")
        return handle(self, request, state)

    monkeypatch.setattr(type(shop), "handle", gated)
    with AppServer(shop) as srv:
        result = InterfaceValidator(shop.spec, srv.base_url, envs).validate(queries)
    assert queries and result.reasons == {} and result.kept == queries
    assert result.driven["shop dish"] == len(queries)

    monkeypatch.setenv("TRAJFORGE_SECRET_ACCOUNT_PASSWORD", "harbor-Tide-8312")
    account = load_app("account")
    raw = account.spec.model_dump(by_alias=True)
    raw["pages"]["profile"]["url"] = "/account/profile?user={username}"
    spec = AppSpec.model_validate(raw)
    profile = query("Change the display name", ["sign_in", "account", "profile", "profile_saved"],
                    {"username": "alice", "password": "<secret>account_password</secret>",
                     "display_name": "Ali Martin"}, "profile").model_copy(update={"app": "account"})
    with AppServer(account) as srv:
        result = InterfaceValidator(spec, srv.base_url, envs).validate([profile])
    assert result.reasons == {} and result.kept == [profile]


@pytest.mark.browser
def test_an_app_that_loses_a_dish_and_a_page_drops_exactly_the_queries_that_used_them(
        shop: BundledApp, envs: list[BrowserEnv], monkeypatch: pytest.MonkeyPatch) -> None:
    """The app changes under its spec, as apps do between nights: validation, rerun, notices."""
    import trajforge.envs.apps.shop.app as shop_app

    queries = shop_queries(shop, 40)
    with AppServer(shop) as srv:
        assert InterfaceValidator(shop.spec, srv.base_url, envs).validate(queries).kept == queries

        monkeypatch.setattr(shop_app, "DISHES", {k: v for k, v in shop_app.DISHES.items() if k != "Pad Thai"})
        handle = type(shop).handle
        monkeypatch.setattr(type(shop), "handle", lambda self, request, state: (
            not_found(request.path) if request.path.startswith("/settings") else handle(self, request, state)))
        result = InterfaceValidator(shop.spec, srv.base_url, envs).validate(queries)

    uses_dish = {q.query_id for q in queries if json.loads(q.slots_json).get("dish") == "Pad Thai"}
    uses_page = {q.query_id for q in queries if "settings" in q.path}
    assert uses_dish and uses_page
    assert set(result.reasons) == uses_dish | uses_page
    assert [q.query_id for q in result.kept] == [q.query_id for q in queries if q.query_id not in result.reasons]
    for query_id in uses_page - uses_dish:
        assert "'settings'" in result.reasons[query_id] and "HTTP 404" in result.reasons[query_id]
    for query_id in uses_dish - uses_page:  # the home page lacks its link, or its page or search result is gone
        assert "Pad Thai" in result.reasons[query_id] or "Pad%20Thai: does not load" in result.reasons[query_id]


@pytest.mark.browser
def test_the_stage_validates_deduplicates_and_counts_coverage(shop: BundledApp, chromium: Path) -> None:
    out = generate_queries([BundledWebKind(shop)], run_id="r", settings=QueryGenSettings(num_queries=40), chromium=chromium)
    rows = out.rows["queries"]
    assert len({normalise(q.instruction) for q in rows}) == len(rows) > 20
    assert not any("interface validation" in k for k in out.dropped)
    assert out.stats["coverage: shop: pages used"] == len({p for q in rows for p in q.path})
    assert out.stats["coverage: shop: pages total"] == len(shop.spec.pages)


@pytest.mark.browser
def test_the_stage_mixes_page_graph_atomic_and_deep_search_queries(shop: BundledApp, chromium: Path) -> None:
    writer = load_app("writer")
    settings = QueryGenSettings(apps=["shop", "writer"], num_queries=3, atomic_per_app=3,
                                deep_search_apps=["writer"], deep_search_queries=2)
    out = generate_queries([BundledWebKind(shop), BundledWebKind(writer)], run_id="r", settings=settings, chromium=chromium, viewport="desktop")
    rows = out.rows["queries"]
    sources = {(q.app, q.source) for q in rows}
    assert sources == {("shop", "page_graph"), ("shop", "atomic"), ("writer", "page_graph"), ("writer", "atomic"),
                       ("writer", "deep_search")}
    assert out.stats["queries: writer: deep_search"] == 2
    assert out.stats["queries: shop: atomic"] == 3
    assert out.stats["deep search: writer: pathways found"] > 2  # the rest are counted, not kept
    assert len({q.query_id for q in rows}) == len(rows)
    for q in rows:
        if q.source == "page_graph":
            assert q.actions_json is None
        else:  # one operation aimed at a real element, or a pathway of clicks
            assert json.loads(q.actions_json) and q.path[0] == load_app(q.app).spec.start
    kinds = {k.rsplit(" ", 1)[-1] for k in out.stats if k.startswith("coverage: shop: operation ")}
    assert {"click", "type"} <= kinds and len(kinds) > 2


# --------------------------------------------------------------------------- quality


def query(instruction: str, path: list[str], slots: dict[str, str], query_id: str) -> Query:
    return Query(run_id="r", query_id=query_id, app="shop", source="page_graph", instruction=instruction,
                 path=path, slots_json=json.dumps(slots), checker="in_cart", checker_params_json="{}",
                 max_steps=5, generator=TEMPLATE_GENERATOR, created_at=datetime.now(timezone.utc))


def test_near_duplicates_differ_only_in_case_punctuation_and_spacing(shop: BundledApp) -> None:
    a = query("Add a Small Pad Thai to my cart", ["home", "dish", "cart"], {"dish": "Pad Thai", "size": "Small"}, "a")
    b = query("add a small  pad thai to my cart!", ["home", "search", "dish", "cart"],
              {"dish": "Pad Thai", "size": "Small"}, "b")
    c = query("Add a Large Pad Thai to my cart", ["home", "dish", "cart"], {"dish": "Pad Thai", "size": "Large"}, "c")
    kept, dropped = remove_near_duplicates([a, b, c])
    assert [q.query_id for q in kept] == ["a", "c"] and dropped == {"shop: near-duplicate instruction": 1}
    stats = coverage(shop.spec, kept)
    assert stats["coverage: shop: pages used"] == 3 and stats["coverage: shop: transitions used"] == 2
    assert stats["coverage: shop: slot values used"] == 3  # Pad Thai, Small, Large


def test_instructions_that_differ_only_in_a_sign_or_symbol_are_both_kept_when_their_checks_differ() -> None:
    """Words alone make "-5" and "5", "C++" and "C#" one instruction; their checker parameters tell them apart."""
    def asking(instruction: str, query_id: str, **params: str) -> Query:
        return query(instruction, ["home"], {}, query_id).model_copy(
            update={"checker_params_json": json.dumps(params)})

    cold = asking("Set the temperature to -5", "cold", temperature="-5")
    mild = asking("Set the temperature to 5", "mild", temperature="5")
    cpp = asking("Add the C++ book", "cpp", title="C++")
    csharp = asking("Add the C# book", "csharp", title="C#")
    again = asking("add the c++ book!", "again", title="C++")
    kept, dropped = remove_near_duplicates([cold, mild, cpp, csharp, again])
    assert [q.query_id for q in kept] == ["cold", "mild", "cpp", "csharp"]
    assert dropped == {"shop: near-duplicate instruction": 1}


def test_the_crawl_viewport_is_part_of_query_generations_config_hash(tmp_path):
    """A desktop night crawls other screens (the pages rows) and validates for another action space than a mobile
    one: its lineage must not claim the same configuration."""
    from trajforge.llm.workspace import Workspace
    from trajforge.query_gen.stage import STAGE
    from trajforge.schemas.config import Settings
    from trajforge.schemas.stage import config_hash

    def hashed(viewport: str) -> str:
        ws = Workspace.open(Settings(warehouse={"path": tmp_path / viewport}, rollout={"viewport": viewport}))
        return config_hash(ws.settings, STAGE.sections, STAGE.load(ws, None).fingerprint)

    assert hashed("mobile") != hashed("desktop")


# --------------------------------------------------------------------------- step budgets and one match


def test_a_reference_path_counts_the_replays_click_before_typing() -> None:
    """The replay clicks a field before typing into it: Compose, then To, Subject and Message each a click and the
    text, then Send and the final terminate, 10 steps, so `max_steps` leaves the whole margin beyond them."""
    mail = load_app("mail")
    tasks = sample_tasks(mail.spec, 30, seed=0, max_len=8).tasks
    compose = next(t for t in tasks if t.path == ("inbox", "compose", "sent"))
    assert compose.reference_steps == 1 + 3 * 2 + 1 + 1
    starred = next(t for t in tasks if t.path == ("inbox", "search", "message", "message_starred"))
    assert starred.reference_steps == 2 + 1 + 1 + 1 + 1  # the search box: a click and the text; then Enter


@pytest.mark.browser
def test_with_no_step_margin_each_reference_replay_uses_its_whole_budget(chromium: Path, tmp_path: Path) -> None:
    """`query_gen.step_budget_margin` is the steps allowed beyond the reference replay's own: at 0 the replay of a
    page-graph query (typing too) and of a deep-search query must end by itself on its last step."""
    from trajforge.data.blobs import BlobStore
    from trajforge.envs.kinds import check_episode
    from trajforge.rollout.stage import rollout
    from trajforge.schemas.config import RolloutSettings

    mail, writer = load_app("mail"), load_app("writer")
    settings = QueryGenSettings(apps=["mail", "writer"], num_queries=30, step_budget_margin=0, atomic_per_app=0,
                                validate_interface=False, deep_search_apps=["writer"], deep_search_queries=2)
    rows = generate_queries([BundledWebKind(mail), BundledWebKind(writer)], run_id="r", settings=settings,
                            chromium=chromium, viewport="desktop").rows["queries"]
    chosen = [next(q for q in rows if q.path == ["inbox", "compose", "sent"]),
              next(q for q in rows if q.app == "mail" and q.path[1] == "search"),
              *(q for q in rows if q.source == "deep_search")]
    assert len(chosen) == 4
    episodes = rollout([q.model_dump() for q in chosen], run_id="r",
                       settings=RolloutSettings(policy="replay", viewport="desktop", contexts=1),
                       blobs=BlobStore(tmp_path / "blobs")).rows["episodes"]
    for q, episode in zip(chosen, episodes, strict=True):
        assert (episode.status, episode.num_steps) == ("terminated", q.max_steps), (q.instruction, episode.fault)
        assert check_episode(q, episode)[0], q.instruction


@pytest.mark.browser
def test_an_element_shown_twice_drops_its_queries(envs: list[BrowserEnv], monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay acts only on an element it finds once ("found 2; cannot go on"): a calendar with two events
    named "Piano lesson" shows two such links on the week and two search results, and its queries are dropped,
    on the page that shows them and on the one the crawl drives to through them."""
    import trajforge.envs.apps.calendar.app as calendar_app

    calendar = load_app("calendar")
    out = generate_queries([BundledWebKind(calendar)], run_id="r",
                           settings=QueryGenSettings(num_queries=30, validate_interface=False, atomic_per_app=0))
    by_week = next(q for q in out.rows["queries"] if q.path[:2] == ["week", "event"])
    by_search = next(q for q in out.rows["queries"] if q.path[:3] == ["week", "search", "event"])
    twice = [with_slot(by_week, event="Piano lesson"), with_slot(by_search, event="Piano lesson")]
    events = [*calendar_app.SEED_EVENTS, {**calendar_app.SEED_EVENTS[2], "id": 7, "day": "Saturday"}]
    monkeypatch.setattr(calendar_app, "INITIAL_STATE", {"events": events, "next_id": 8})
    with AppServer(calendar) as srv:
        result = InterfaceValidator(calendar.spec, srv.base_url, envs).validate(twice)
    assert result.kept == []
    assert result.reasons[twice[0].query_id] == "page 'week' /: link 'Piano lesson' found 2 times"
    assert "could not be reached from /search: link 'Piano lesson' found 2 times" in result.reasons[twice[1].query_id]
    # An operation's element is looked up on the query's last page alike: the notes list tags three notes
    # "Personal", so clicking the text "Personal" is no task the replay can do.
    from trajforge.envs.operations import Operation, dump_operations

    notes = load_app("notes")
    tag = query("Click the text 'Personal'", ["notes"], {}, "tag").model_copy(update={
        "app": "notes", "source": "atomic",
        "actions_json": dump_operations([Operation(op="click", role="text", name="Personal")])})
    with AppServer(notes) as srv:
        result = InterfaceValidator(notes.spec, srv.base_url, envs).validate([tag])
    assert result.reasons == {"tag": "page 'notes' /: text 'Personal' found 3 times"}

"""Deep-search queries (issue 5, paper 6.2 Computer) on Writer, whose spec leaves its menus out.

Real parts only: Writer served on loopback, Debian's Chromium through Playwright, the
replay policy through the rollout stage, the embedded SmolLM2 through the gateway. The
pathways the search must find are written below by hand from envs/apps/writer/app.py
(MENUS, the dialogs, the Preferences tabs, the toolbar), not from a run of the search.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import prompt_version, prompt_versions

from trajforge.data.blobs import BlobStore
from trajforge.envs.apps import AppServer, BundledApp, load_app
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.operations import Operation, parse_operations
from trajforge.llm import Gateway, Sampling
from trajforge.llm.local import SMOLLM2_ID
from trajforge.query_gen.deep_search import (
    TEMPLATE_GENERATOR,
    Commander,
    DeepSearch,
    Pathway,
    Screen,
    SearchResult,
    deep_search_queries,
    pathway_queries,
    template_command,
)
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import RolloutSettings

MODEL_GENERATOR = f"{SMOLLM2_ID}+" + prompt_versions("deep_search_selection", "deep_search_command").replace(",", "+")

EXPECTED: list[tuple[str, str, str]] = [
    # (the clicks, what the last one opened, its name)
    ("File", "menu", "File"),
    ("Edit", "menu", "Edit"),
    ("Format", "menu", "Format"),
    ("Tools", "menu", "Tools"),
    ("Help", "menu", "Help"),
    ("Share", "dialog", "Share document"),
    ("File > New document", "page", "New document · Writer"),
    ("File > Open…", "dialog", "Open document"),
    ("File > Page setup…", "dialog", "Page setup"),
    ("File > Export", "menu", "Export"),
    ("Edit > Find and replace…", "dialog", "Find and replace"),
    ("Edit > Select all", "command", "Select all"),
    ("Edit > Delete document…", "command", "Delete document…"),
    ("Format > Bold", "command", "Bold"),
    ("Format > Italic", "command", "Italic"),
    ("Format > Paragraph…", "dialog", "Paragraph"),
    ("Tools > Word count…", "dialog", "Word count"),
    ("Tools > Preferences…", "dialog", "Preferences"),
    ("Help > Keyboard shortcuts", "dialog", "Keyboard shortcuts"),
    ("Help > About Writer", "dialog", "About Writer"),
    ("File > Export > PDF…", "dialog", "Export as PDF"),
    ("File > Export > Plain text…", "dialog", "Export as plain text"),
    ("Tools > Preferences… > Editing", "tabpanel", "Editing"),
    ("Tools > Preferences… > Appearance", "tabpanel", "Appearance"),
]
"""Every pathway from Writer's start page, shortest first. Not in it, by design: the Save
button and the dialogs' own buttons (they submit or close, back to a screen seen before),
the General tab (already shown), text boxes, checkboxes and radios (values, not places)."""

SURFACES = [(label, kind, name) for label, kind, name in EXPECTED if kind in ("dialog", "tabpanel")]


@pytest.fixture(scope="module")
def writer() -> BundledApp:
    return load_app("writer")


@pytest.fixture(scope="module")
def server(writer: BundledApp) -> Iterator[AppServer]:
    with AppServer(writer) as srv:
        yield srv


@pytest.fixture(scope="module")
def env(chromium: Path) -> Iterator[BrowserEnv]:
    with BrowserEnv(viewport="desktop", chromium=chromium) as e:
        yield e


@pytest.fixture(scope="module")
def search(env: BrowserEnv, server: AppServer) -> DeepSearch:
    return DeepSearch(env, server.base_url + "/")


@pytest.fixture(scope="module")
def found(search: DeepSearch) -> SearchResult:
    """One search for the module: it costs one replay per control clicked (about 50)."""
    return search.run()


def clicks(label: str) -> tuple[Operation, ...]:
    """The operations of a pathway written as "File > Export > PDF…" (the toolbar's Share is a button)."""
    names = label.split(" > ")
    if names == ["Share"]:
        return (Operation(op="click", role="button", name="Share"),)
    roles = ["tab" if name in ("Editing", "Appearance") else "menuitem" for name in names]
    return tuple(Operation(op="click", role=r, name=n) for r, n in zip(roles, names, strict=True))


def test_the_spec_does_not_describe_the_menus(writer: BundledApp) -> None:
    named = {action.name for t in writer.spec.transitions for action in t.actions}
    assert not named & {"File", "Edit", "Format", "Tools", "Help", "Preferences…"}


@pytest.mark.browser
def test_deep_search_finds_the_pathways_written_from_the_source(found: SearchResult) -> None:
    got = [(p.label, p.kind, p.surface) for p in found.pathways]
    assert got == EXPECTED
    for pathway in found.pathways:
        assert pathway.operations == clicks(pathway.label)
    by_label = {p.label: p for p in found.pathways}
    assert by_label["File > Export > PDF…"].trail == ("File", "Export", "Export as PDF")
    # The endpoints that act on a selection say so when there is none: what a model reads of them.
    assert by_label["Format > Bold"].shown == ("Select some text first.",)
    assert by_label["Edit > Delete document…"].shown == ("Select a document in the list first.",)
    assert found.stats["not kept: screen seen before"] + found.stats["not kept: nothing opened"] > 0
    assert not [k for k in found.stats if k.startswith("not clicked")], found.stats


@pytest.mark.browser
def test_budgets_bound_the_search(env: BrowserEnv, server: AppServer) -> None:
    shallow = DeepSearch(env, server.base_url + "/", max_depth=1).run()
    assert [(p.label, p.kind, p.surface) for p in shallow.pathways] == EXPECTED[:6]
    small = DeepSearch(env, server.base_url + "/", max_nodes=8).run()
    assert [(p.label, p.kind, p.surface) for p in small.pathways] == EXPECTED[:8]
    assert small.stats["not clicked: max_nodes"] > 0


@pytest.mark.browser
def test_each_pathway_replays_from_a_fresh_session_to_its_surface(search: DeepSearch, env: BrowserEnv,
                                                                  writer: BundledApp) -> None:
    for label, kind, name in SURFACES:
        screen = search.replay(clicks(label))
        assert (kind, name) in screen.named(kind), label
        state = env.app_state()
        assert writer.check("surface_opened", {"surface": name}, state)[0], (label, state["opened"])
        # A fresh session: nothing but this pathway's own surfaces was opened.
        assert set(state["opened"]) <= {n for lbl, _, n in SURFACES if label.startswith(lbl)}, state["opened"]
    with pytest.raises(LookupError, match="operation 2/2: expected one menuitem 'Font…'"):
        search.replay((Operation(op="click", role="menuitem", name="Format"),
                       Operation(op="click", role="menuitem", name="Font…")))


@pytest.mark.browser
def test_replay_policy_completes_the_generated_queries(writer: BundledApp, server: AppServer, env: BrowserEnv,
                                                       found: SearchResult, tmp_path: Path) -> None:
    out = deep_search_queries(writer.spec, server.base_url, env, run_id="r")
    rows = out.rows
    assert [json.loads(q.checker_params_json)["surface"] for q in rows] == [name for _, _, name in SURFACES]
    assert out.dropped == {"writer: menu endpoint: nothing the surface_opened checker can read": 6,
                           "writer: page endpoint: nothing the surface_opened checker can read": 1,
                           "writer: command endpoint: nothing the surface_opened checker can read": 4}
    for q, (label, _, name) in zip(rows, SURFACES, strict=True):
        assert (q.source, q.app, q.path, q.slots_json, q.checker) == ("deep_search", "writer", ["editor"], "{}",
                                                                      "surface_opened")
        assert tuple(parse_operations(q.actions_json)) == clicks(label)
        assert q.generator == TEMPLATE_GENERATOR and name in q.instruction
        assert q.max_steps == len(clicks(label)) + 1 + 3  # the clicks, the final terminate, the default margin
        assert not writer.check(q.checker, json.loads(q.checker_params_json), writer.initial_state())[0]
    assert len({q.query_id for q in rows}) == len(rows)
    again = pathway_queries("writer", "editor", found, run_id="other", app_title="Writer")  # another search's
    assert [q.query_id for q in again.rows] == [q.query_id for q in rows]

    # Both viewports, as the reference stage replays them: on the phone the Help menu overflows
    # the right edge, and its items are clicked where they show.
    for viewport in ("desktop", "mobile"):
        episodes = rollout([q.model_dump() for q in rows], run_id="r",
                           settings=RolloutSettings(policy="replay", viewport=viewport, contexts=1),
                           blobs=BlobStore(tmp_path / "blobs")).rows["episodes"]
        assert [e.query_id for e in episodes] == [q.query_id for q in rows]
        for q, episode in zip(rows, episodes, strict=True):
            assert episode.status == "terminated", (viewport, q.instruction, episode.fault)
            ok, why = writer.check(q.checker, json.loads(q.checker_params_json),
                                   json.loads(episode.final_state_json))
            assert ok, (viewport, q.instruction, why)


# --------------------------------------------------------------------------- the model



def pathway(label: str, kind: str, name: str, trail: tuple[str, ...]) -> Pathway:
    return Pathway(clicks(label), kind, name, trail)  # type: ignore[arg-type]


PARAGRAPH = pathway("Format > Paragraph…", "dialog", "Paragraph", ("Format", "Paragraph"))
PAGE_SETUP = pathway("File > Page setup…", "dialog", "Page setup", ("File", "Page setup"))
START = Screen("http://127.0.0.1/", "Project proposal · Writer", ())
SELECT_TEXT = Operation(op="select_text", role="textbox", name="Document text", text="shared calendar")


def test_commands_and_selection_decisions_come_from_the_model(gateway: Gateway) -> None:
    commander = Commander(gateway)
    for endpoint in (PARAGRAPH, PAGE_SETUP):
        calls = gateway.stats.calls
        command = commander("Writer", START.title, endpoint, SELECT_TEXT)
        assert command.model_id == SMOLLM2_ID and command.raw and all(isinstance(r, str) for r in command.raw)
        if command.needs_selection is None:  # the decision did not parse: recorded, no command asked
            assert gateway.stats.calls - calls == 1 and command.failures[0].startswith("selection decision")
            continue
        assert gateway.stats.calls - calls == 2 and command.selection_reason
        if command.generator == MODEL_GENERATOR:
            assert endpoint.surface.casefold() in command.instruction.casefold() and command.failures == ()
        else:
            assert (command.generator, command.instruction) == (TEMPLATE_GENERATOR, template_command(endpoint))
            assert command.failures[0].startswith(("command did not parse", "command does not name"))


def test_query_rows_follow_the_models_decision(gateway: Gateway) -> None:
    commander = Commander(gateway)
    result = SearchResult(START, [PARAGRAPH])
    for selection in (SELECT_TEXT, None):
        out = pathway_queries("writer", "editor", result, run_id="r", app_title="Writer", commander=commander,
                              selection=selection)
        assert out.models == {"deep_search_model": SMOLLM2_ID}
        assert out.prompts == {n: prompt_version(n) for n in ("deep_search_selection", "deep_search_command")}
        if out.dropped == {"writer: selection decision did not parse": 1}:
            continue  # recorded, not guessed
        needs = out.stats["writer: model says: needs a selection"] == 1
        assert needs != (out.stats["writer: model says: no selection needed"] == 1)
        if needs and selection is None:
            assert out.dropped == {"writer: needs a selected object; no selecting operation annotated": 1}
            assert out.rows == []
            continue
        (row,) = out.rows
        operations = parse_operations(row.actions_json)
        assert operations == ([SELECT_TEXT] if needs else []) + list(PARAGRAPH.operations)
        assert row.max_steps == len(operations) + 1 + 3 and row.generator in (MODEL_GENERATOR, TEMPLATE_GENERATOR)


def test_a_malformed_model_answer_is_recorded_not_guessed(gateway: Gateway) -> None:
    cut_short = Commander(gateway, sampling=Sampling(max_tokens=2))  # a real answer, cut off mid-JSON
    calls = gateway.stats.calls
    command = cut_short("Writer", START.title, PARAGRAPH, SELECT_TEXT)
    assert gateway.stats.calls - calls == 1, "no command is asked for without a decision"
    assert command.needs_selection is None and command.model_id == SMOLLM2_ID
    assert command.failures[0].startswith("selection decision did not parse: ")
    assert "max_tokens=2" in command.failures[0] and command.raw == (command.raw[0],)
    assert (command.instruction, command.generator) == ('Open the "Paragraph" dialog', TEMPLATE_GENERATOR)


def test_the_step_margin_is_beyond_the_replays_clicks_and_its_terminate() -> None:
    """`query_gen.step_budget_margin` is what a deep-search query allows beyond its replay: one step per click and
    the final terminate. At 0 the replay ends on its last step; without the terminate counted it could not end."""
    result = SearchResult(START, [PARAGRAPH, PAGE_SETUP])
    for margin in (0, 2):
        out = pathway_queries("writer", "editor", result, run_id="r", app_title="Writer", step_margin=margin)
        assert [q.max_steps for q in out.rows] == [2 + 1 + margin] * 2

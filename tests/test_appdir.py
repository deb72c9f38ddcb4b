"""A user's own app from an app directory (envs.appdir): the spec's named errors, the checks as predicates on a
final state, and the bundled notes app expressed as `examples/apps/jotter` giving the same queries and verdicts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import polars as pl
import pytest
import yaml
from conftest import require
from pydantic import TypeAdapter

from trajforge.data.blobs import BlobStore
from trajforge.envs import secrets
from trajforge.envs.appdir import MAX_TEXT, AppDirError, Check, evaluate, kept_dom, load_app_dir, running
from trajforge.envs.apps import load_app
from trajforge.envs.axtree import AXNode, render
from trajforge.envs.kinds import BundledWebKind, configured_kinds, kind_for, use_app_dirs
from trajforge.envs.spec import SpecError
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.query_gen.stage import generate_queries
from trajforge.rollout.stage import rollout
from trajforge.schemas.config import ConfigError, QueryGenSettings, RolloutSettings, Settings
from trajforge.schemas.records import Episode, Query
from trajforge.tasks.runner import commit, plan, run_shard

JOTTER = Path(__file__).parents[1] / "examples" / "apps" / "jotter"
DATASETTE = Path(__file__).parents[1] / "examples" / "apps" / "datasette"


def _app_dir(tmp_path: Path, **changes: object) -> Path:
    """A copy of the jotter directory with top-level keys of its spec.yaml replaced."""
    raw = yaml.safe_load((JOTTER / "spec.yaml").read_text())
    raw.update(changes)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return tmp_path


def _check(raw: object) -> Check:
    """A check as spec.yaml would hold it."""
    return TypeAdapter(Check).validate_python(raw)


STATE = {
    "url": "http://127.0.0.1:9/note?id=3&notice=Pinned",
    "title": "Meeting notes 3 Dec",
    "ax_tree": render((AXNode(0, "RootWebArea", "Jotter"), AXNode(1, "button", "Unpin"),
                       AXNode(1, "checkbox", "Work", states=("checked",)), AXNode(1, "textbox", "Title",
                                                                                 value="Rock 'n' roll"))),
    "http": {"session": {"json": {"notes": [{"title": "Rock 'n' roll", "pinned": True, "tags": ["Work"]},
                                            {"title": "Garden plans", "pinned": False, "tags": []},
                                            {"title": r"C:\new", "pinned": True, "tags": []}]}},
             "broken": {"error": "GET /api/broken answered 500"}},
    "dom": {"h1": [{"text": "Rock 'n' roll", "value": None, "checked": None, "selected": None}]},
}


@pytest.mark.parametrize(("raw", "params", "holds"), [
    ({"url": r"/note\?id="}, {}, True),
    ({"url": "notice={n}"}, {"n": "Pinned"}, True),
    ({"url": "notice={n}"}, {"n": "Pin.ed"}, False),  # a slot value is matched literally, not as a pattern
    ({"element": {"role": "button", "name": "Unpin"}}, {}, True),
    ({"element": {"role": "checkbox", "name": "{tag}", "states": ["checked"]}}, {"tag": "Work"}, True),
    ({"element": {"role": "checkbox", "name": "Work", "states": ["disabled"]}}, {}, False),
    ({"element": {"role": "textbox", "value": "{title}"}}, {"title": "Rock 'n' roll"}, True),
    ({"dom": {"selector": "h1", "text_contains": "{title}"}}, {"title": "Rock 'n' roll"}, True),
    ({"dom": {"selector": "h1", "text_contains": "Garden"}}, {}, False),
    # A slot value with a quote inside a JMESPath literal is escaped, not an injection or a parse error.
    ({"http": "session", "at": "notes[?title=='{title}'] | [0].pinned", "equals": True}, {"title": "Rock 'n' roll"},
     True),
    ({"http": "session", "at": "notes[?title=='{title}'] | [0].pinned", "equals": True}, {"title": "Garden plans"},
     False),
    # A backslash in a slot value is matched as itself (JMESPath's raw strings unescape only \').
    ({"http": "session", "at": "notes[?title=='{title}'] | [0].pinned", "equals": True}, {"title": r"C:\new"}, True),
    # A literal brace written twice, as README says: a JMESPath multiselect hash.
    ({"http": "session", "at": "{{t: notes}}.t[?title=='{title}'] | [0].pinned", "equals": True},
     {"title": "Rock 'n' roll"}, True),
    ({"http": "session", "at": "notes[].tags[]", "contains": "{tag}"}, {"tag": "Work"}, True),
    ({"http": "session", "at": "notes[?title=='Nope']", "exists": True}, {}, False),
    ({"http": "broken", "at": "@", "exists": True}, {}, False),
    ({"all": [{"url": "note"}, {"not": {"element": {"name": "Pin"}}}]}, {}, True),
    ({"any": [{"url": "nowhere"}, {"element": {"name": "Unpin"}}]}, {}, True),
    ({"all": [{"url": "note"}, {"url": "nowhere"}]}, {}, False),
])
def test_a_check_holds_on_a_final_state_as_its_predicate_says(raw: object, params: dict[str, str],
                                                               holds: bool) -> None:
    ok, reason = evaluate(_check(raw), params, STATE)
    assert ok is holds, reason
    assert reason


def test_a_failed_state_request_is_the_checks_reason() -> None:
    ok, reason = evaluate(_check({"http": "broken", "at": "@", "exists": True}), {}, STATE)
    assert not ok and "answered 500" in reason


@pytest.mark.parametrize(("query", "holds"), [
    ("genre=Fantasy", True),  # a facet link
    ("genre__exact=Fantasy&_sort=title", True),  # where the filter form's "=" redirects (Datasette 0.65)
    ("genre__not=Fantasy", False),
    ("genre=Fantasy+Noir", False),
])
def test_datasettes_genre_check_holds_on_either_url_of_the_genre_filter(query: str, holds: bool) -> None:
    heading = AXNode(1, "heading", '3 rows where genre = "Fantasy" sorted by title')
    state = {"url": f"http://127.0.0.1:8001/books/books?{query}", "ax_tree": render((AXNode(0, "RootWebArea", "b"),
                                                                                      heading))}
    ok, reason = load_app_dir(DATASETTE).check("genre_shown", {"genre": "Fantasy"}, state)
    assert ok is holds, reason


def test_quills_text_check_judges_the_document_open_at_the_start_as_writer_does() -> None:
    """Text added to the open document passes; typed over all of it, or saved into another document, fails, as
    the bundled Writer's own checker says on the same state."""
    quill, writer = load_app_dir(QUILL), load_app("writer")
    start = writer.initial_state()
    proposal, notes = start["documents"][:2]
    added = "Budget review on Friday."
    for docs, holds in [
        ([{**proposal, "text": f"{proposal['text']} {added}"}, notes], True),
        ([{**proposal, "text": added}, notes], False),
        ([proposal, {**notes, "text": added}], False),
        ([notes, {"id": 4, "title": "Budget", "text": f"{proposal['text']} {added}"}], False),
    ]:
        recorded = {**start, "documents": docs, "current": docs[-1]["id"]}
        ok, reason = quill.check("document_text", {"text": added}, {"http": {"session": {"json": recorded}}})
        assert ok is holds, (docs, reason)
        assert writer.check("document_text", {"text": added}, recorded)[0] is holds, docs


@pytest.mark.parametrize(("changes", "named"), [
    ({"serve": {"url": "http://127.0.0.1:1"}}, "serve: Value error, give either base_url"),
    ({"checks": {"note_pinned": {"http": "session", "at": "x", "equals": True},
                 "note_tagged": {"http": "session", "at": "x", "contains": "t"}}},
     "pages.note_saved.goal.checker: no check 'note_created'"),
    ({"checks": {"note_created": {"url": "{nope}"}, "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"}}},
     "checks.note_created: {nope} is not one of pages.note_saved.goal.params"),
    ({"checks": {"note_created": {"http": "api", "at": "@", "exists": True}, "note_pinned": {"url": "x"},
                 "note_tagged": {"url": "x"}}}, "checks.note_created: http 'api' is not a state request"),
    ({"checks": {"note_created": {"dom": {"selector": "#n-{title}"}}, "note_pinned": {"url": "x"},
                 "note_tagged": {"url": "x"}}}, "dom.selector '#n-{title}' holds a {slot}"),
    ({"checks": {"note_created": {"http": "session", "at": "notes[", "exists": True}, "note_pinned": {"url": "x"},
                 "note_tagged": {"url": "x"}}}, "not a JMESPath expression"),
    ({"checks": {"note_created": {"whatever": 1}, "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"}}},
     "checks.note_created: a check is one of: url, element, dom, http, python, all, any, not"),
    ({"checks": {"note_created": {"python": "created"}, "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"}}},
     "checks.note_created: python 'created' needs"),
    # No union branch of pydantic's (`reset.literal['context']`, `reset.function-after[...]`) in the field's name.
    ({"reset": "sometimes"}, "reset: Input should be 'context'"),
    ({"reset": {"url": "/api/reset", "command": "{python} reset.py"}},
     "reset: Value error, give either url or command"),
    ({"checks": {"note_created": {"all": [{"url": "x"}, {"not": {"dom": {"selector": "h1", "bogus": 1}}}]},
                 "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"}}},
     "checks.note_created.all.1.not.dom.bogus: Extra inputs are not permitted"),
    # Checks that load but failed at the end of an episode, or in the critics, naming no file or field.
    ({"checks": {"note_created": {"url": "x"}, "note_pinned": {"url": "/note/{note}/a{"},
                 "note_tagged": {"url": "x"}}},
     "checks.note_pinned.url: Single '{' encountered in format string in '/note/{note}/a{' (a literal brace is "
     "written twice"),
    ({"checks": {"note_created": {"url": "x"}, "note_pinned": {"url": r"/note/(\d+"}, "note_tagged": {"url": "x"}}},
     "checks.note_pinned.url: not a regular expression once its slots are filled (missing ), unterminated"),
    ({"checks": {"note_created": {"all": [{"url": "x"}, {"not": {"dom": {"selector": "div[[["}}}]},
                 "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"}}},
     "checks.note_created.all[1].not.dom.selector: 'div[[[' is no CSS selector: '[' is not closed"),
    ({"checks": {"note_created": {"url": "x"}, "note_pinned": {"url": "x"}, "note_tagged": {"url": "x"},
                 "surface_opened": {"element": {"role": "dialog", "name": "{surface"}}}},
     "checks.surface_opened.element.name: expected '}' before end of string in '{surface'"),
    ({"serve": {"command": "{python} -m http.server {port} --bind '127.0.0.1", "url": "http://127.0.0.1:{port}"}},
     "serve: Value error, command \"{python} -m http.server {port} --bind '127.0.0.1\": No closing quotation"),
    ({"reset": {"command": "{python} reset.py 'all"}},
     "reset: Value error, command \"{python} reset.py 'all\": No closing quotation"),
    # A command's placeholders are filled while the night runs: one that cannot be is refused before it starts.
    ({"serve": {"command": "{python} -m http.server {port} --bind {host}", "url": "http://127.0.0.1:{port}"}},
     "serve: Value error, command '{python} -m http.server {port} --bind {host}': {host} is filled by nothing"),
    ({"reset": {"command": """curl -d '{"all": true}' http://127.0.0.1:8000/reset"""}},
     """{"all"} is filled by nothing here; it may hold {python} (a literal brace is written twice"""),
    ({"reset": {"command": "{python} reset.py --port {port}"}},
     "{port} is filled by nothing here; it may hold {python}"),
])
def test_a_spec_mistake_is_named_with_the_file_and_field(tmp_path: Path, changes: dict[str, object],
                                                         named: str) -> None:
    with pytest.raises(SpecError) as err:
        load_app_dir(_app_dir(tmp_path, **changes))
    assert str(tmp_path / "spec.yaml") in str(err.value)
    assert named in str(err.value), str(err.value)


def test_a_lone_brace_in_a_template_is_named_with_its_field(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text((JOTTER / "spec.yaml").read_text().replace('Pin the note "{note}"',
                                                                                   'Pin the note "{note"'))
    with pytest.raises(SpecError) as err:
        load_app_dir(tmp_path)
    assert str(tmp_path / "spec.yaml") in str(err.value)
    assert "pages.note_pinned.goal.instruction: expected '}' before end of string" in str(err.value), str(err.value)


def test_a_spec_key_given_twice_or_a_spec_not_in_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    """A second `reset:` used to replace the first silently; a byte that is not UTF-8 gave Python's
    UnicodeDecodeError, naming neither the file nor the line."""
    spec, file = (JOTTER / "spec.yaml").read_text(), tmp_path / "spec.yaml"
    file.write_text(spec.replace("reset: context\n", "reset: context\nreset: {url: /api/reset}\n"))
    line = spec[:spec.index("reset: context")].count("\n") + 1
    with pytest.raises(SpecError) as err:
        load_app_dir(tmp_path)
    assert str(err.value) == f"{file}:{line + 1}:1: not valid YAML: duplicate key 'reset' (first at line {line})"
    file.write_bytes(b"app: x\n# caf\xe9\n")
    with pytest.raises(SpecError) as err:
        load_app_dir(tmp_path)
    assert str(err.value) == f"{file}:2:6: not UTF-8: byte 0xe9 (offset 12); save the file as UTF-8"


def test_an_app_dir_may_not_take_a_bundled_apps_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="'notes' is the name of the bundled app 'notes'"):
        use_app_dirs([_app_dir(tmp_path, app="notes")])


def test_an_app_that_does_not_answer_or_exits_is_named(tmp_path: Path) -> None:
    with pytest.raises(AppDirError, match=r"does not answer at http://127.0.0.1:9 .*start it, or give serve.command"):
        with running(load_app_dir(_app_dir(tmp_path, serve={"base_url": "http://127.0.0.1:9"}))):
            pass
    crash = {"command": f"{sys.executable} -c \"import sys; print('no database'); sys.exit(3)\"",
             "url": "http://127.0.0.1:{port}"}
    with pytest.raises(AppDirError, match=r"exited 3 before answering at http://127.0.0.1:\d+: no database"):
        with running(load_app_dir(_app_dir(tmp_path, serve=crash))):
            pass


def test_a_check_is_parsed_as_its_slots_fill_it(tmp_path: Path) -> None:
    """A literal brace written twice is a brace once the slots are filled: the check loads and holds."""
    checks = {"note_created": {"url": r"/note/\d{{1,3}}/{title}"}, "note_tagged": {"url": "x"},
              "note_pinned": {"http": "session", "at": "{{t: notes}}.t[?title=='{note}'] | [0].pinned",
                              "equals": True}}
    app = load_app_dir(_app_dir(tmp_path, checks=checks))
    state = {"url": "http://127.0.0.1:9/note/12/Garden", "http": {"session": {"json": {"notes": [
        {"title": "Garden plans", "pinned": True}]}}}}
    assert app.check("note_created", {"title": "Garden"}, state)[0]
    assert app.check("note_pinned", {"note": "Garden plans"}, state)[0]


def _live(pgid: int) -> list[int]:
    """The processes of a process group that still run (a zombie has exited: its parent has yet to read it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # it ended while we looked
            continue
        if int(group) == pgid and state != "Z":
            found.append(int(stat.parent.name))
    return found


SERVER = """\
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server slow to stop: only SIGKILL ends it
http.server.test(http.server.SimpleHTTPRequestHandler, port=int(sys.argv[1]), bind="127.0.0.1")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("wrapper", "error"), [
    ("echo $$ > group; {python} server.py {port} & sleep 2", None),  # the server runs on after its wrapper exits
    ("echo $$ > group; (sleep 3; {python} server.py {port}) & exit 0", "exited 0 before answering"),
])
def test_an_app_started_by_a_wrapper_is_stopped_whole(tmp_path: Path, wrapper: str, error: str | None) -> None:
    """Every process the serve command started ends with the block, or on its error: a server left behind held
    the port, and the next night's app answered with the last one's state."""
    (tmp_path / "server.py").write_text(SERVER)
    app = load_app_dir(_app_dir(tmp_path, serve={"command": f"sh -c '{wrapper}'", "url": "http://127.0.0.1:{port}",
                                                 "ready_timeout_s": 30}))
    try:
        with pytest.raises(AppDirError, match=error) if error else contextlib.nullcontext():
            with running(app):
                time.sleep(3)  # the wrapper has exited; its server serves on
        assert _live(int((tmp_path / "group").read_text())) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int((tmp_path / "group").read_text()), signal.SIGKILL)


REAPER = """\
import ctypes, json, sys, time
from pathlib import Path
from trajforge.envs.appdir import load_app_dir, running
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans become ours, as PID 1's
with running(load_app_dir(Path(sys.argv[1]))):
    time.sleep(3)  # the wrapper exits: its server is an orphan, our child
group = int((Path(sys.argv[1]) / "group").read_text())
members = []
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        state, _, pgid = stat.read_text().rsplit(")", 1)[1].split()[:3]
    except OSError:
        continue
    if int(pgid) == group:
        members.append(state)
print(json.dumps(members))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")
def test_an_app_stopped_where_trajforge_reaps_orphans_leaves_no_zombie(tmp_path: Path) -> None:
    """Run as a container's PID 1, trajforge inherits the wrapper's orphaned server: its exit is read when the app
    stops, so no zombie is left and the stop does not wait out its grace on one (a zombie counts for killpg)."""
    _app_dir(tmp_path, serve={"command": "sh -c 'echo $$ > group; {python} -m http.server {port} & sleep 1'",
                              "url": "http://127.0.0.1:{port}", "ready_timeout_s": 30})
    try:
        out = subprocess.run([sys.executable, "-c", REAPER, str(tmp_path)], capture_output=True, text=True,
                             timeout=100, check=True)
        assert json.loads(out.stdout) == []
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.killpg(int((tmp_path / "group").read_text()), signal.SIGKILL)


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_the_notes_app_as_an_app_directory_gives_the_bundled_apps_queries_and_verdicts(chromium: Path,
                                                                                       tmp_path: Path) -> None:
    """Interface validation drives the user's app through its own server process, atomic-operation queries are
    found on its live pages, the replay reaches every goal, and the declarative checks agree with the bundled app's
    Python checkers, success for success; the interaction recorder the browser runs for it reports as the app's
    own page does for the bundled app."""
    shutil.copytree(JOTTER, tmp_path / "jotter")
    [jotter] = use_app_dirs([tmp_path / "jotter"])
    assert kind_for("jotter") is jotter
    settings = QueryGenSettings(num_queries=8, atomic_per_app=1)
    mine = generate_queries([jotter], run_id="r", settings=settings, chromium=chromium)
    bundled = generate_queries([BundledWebKind(load_app("notes"))], run_id="r", settings=settings, chromium=chromium)

    def task(q: Query) -> tuple[object, ...]:
        return q.instruction, tuple(q.path), q.slots_json, q.checker, q.checker_params_json

    queries = cast(list[Query], mine.rows["queries"])
    assert len(queries) == 9 and not mine.dropped
    def page_graph(qs: list[Query]) -> list[tuple[object, ...]]:
        return sorted(task(q) for q in qs if q.source == "page_graph")

    assert page_graph(queries) == page_graph(cast(list[Query], bundled.rows["queries"]))
    # An atomic query too, on an element the seeded draw (seeded by the app's name) picked on the live pages.
    assert [q.checker for q in queries if q.source == "atomic"] == ["interaction"]

    def bundled_state(checker: str, state: dict[str, object]) -> object:
        """What the bundled checker reads: the app's JSON, or the recorder's reports beside it."""
        return state if checker == "interaction" else cast(dict, state["http"])["session"]["json"]

    replay = RolloutSettings(policy="replay", contexts=2, chromium=chromium)
    episodes = cast(list[Episode], rollout([q.model_dump() for q in queries], run_id="r", settings=replay,
                                           blobs=BlobStore(tmp_path / "blobs")).rows["episodes"])
    notes = load_app("notes")
    by_id = {q.query_id: q for q in queries}
    assert len(episodes) == len(queries)
    for episode in episodes:
        q, state = by_id[episode.query_id], json.loads(episode.final_state_json)
        params = json.loads(q.checker_params_json)
        ok, reason = jotter.check(q.checker, params, state)
        assert episode.status == "terminated" and ok, reason
        assert notes.check(q.checker, params, bundled_state(q.checker, state))[0]  # the same state, same verdict
        # The checks read the live URL; the episode keeps its path on the app's origin, as its steps do.
        assert episode.final_url.startswith("/") and state["url"].endswith(episode.final_url)
        assert "RootWebArea" in state["ax_tree"]
        # Another query's goal on this state: the checks tell the states apart.
        other = next(o for o in queries if o.checker != q.checker)
        assert jotter.check(other.checker, json.loads(other.checker_params_json), state)[0] is notes.check(
            other.checker, json.loads(other.checker_params_json), bundled_state(other.checker, state))[0]
    pinned = next(e for e in episodes if by_id[e.query_id].checker == "note_pinned")
    note = json.loads(by_id[pinned.query_id].checker_params_json)["note"]
    ok, reason = evaluate(_check({"all": [{"element": {"role": "button", "name": "Unpin"}},
                                          {"url": "/note"}]}), {"note": note}, json.loads(pinned.final_state_json))
    assert ok, reason


QUILL = Path(__file__).parents[1] / "examples" / "apps" / "quill"
WRITER_SURFACES = ["Share document", "Open document", "Page setup", "Find and replace", "Paragraph", "Word count",
                   "Preferences", "Keyboard shortcuts", "About Writer", "Export as PDF", "Export as plain text",
                   "Editing", "Appearance"]
"""The dialogs and Preferences tabs of envs/apps/writer/app.py that a click path from the start page opens, written
from its source (as in tests/test_deep_search.py)."""


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_deep_search_on_an_app_directory_finds_its_dialogs_and_judges_them_on_the_final_tree(chromium: Path,
                                                                                            tmp_path: Path) -> None:
    """Writer as an app directory (examples/apps/quill: its menus are not in the spec): deep search on the live app
    through the directory's server and reset finds every dialog and tab panel, the replay opens each, and the
    built-in surface_opened check on the final accessibility tree gives the verdict the bundled app's own record of
    what it showed gives, for its own query and for another's."""
    config = Settings(query_gen={"apps": [], "app_dirs": [QUILL], "deep_search_apps": ["quill"]})
    [quill] = configured_kinds(config)
    settings = QueryGenSettings(num_queries=4, atomic_per_app=0, deep_search_apps=["quill"], deep_search_queries=20)
    made = generate_queries([quill], run_id="r", settings=settings, chromium=chromium)
    queries = cast(list[Query], made.rows["queries"])
    deep = [q for q in queries if q.source == "deep_search"]
    assert sorted(json.loads(q.checker_params_json)["surface"] for q in deep) == sorted(WRITER_SURFACES)
    assert {(q.app, q.checker) for q in deep} == {("quill", "surface_opened")}
    assert made.stats["deep search: quill: pathways found"] > len(deep)  # menus and commands: no query of their own
    assert [q for q in queries if q.source == "page_graph"]

    replay = RolloutSettings(policy="replay", viewport="desktop", contexts=2, chromium=chromium)
    episodes = cast(list[Episode], rollout([q.model_dump() for q in queries], run_id="r", settings=replay,
                                           blobs=BlobStore(tmp_path / "blobs")).rows["episodes"])
    writer = load_app("writer")
    by_id = {q.query_id: q for q in queries}
    assert sorted(by_id) == sorted(e.query_id for e in episodes)
    for i, episode in enumerate(episodes):
        q, state = by_id[episode.query_id], json.loads(episode.final_state_json)
        ok, reason = quill.check(q.checker, json.loads(q.checker_params_json), state)
        assert episode.status == "terminated" and ok, (q.instruction, reason)
        recorded = state["http"]["session"]["json"]  # the bundled app's own record, surfaces shown included
        assert writer.check(q.checker, json.loads(q.checker_params_json), recorded)[0]
        # Another query's goal on this state. Not a surface this episode showed: Writer's record keeps a dialog
        # opened and closed on the way (Share document, before Send invite), the final tree surface_opened reads
        # does not, by design; the page-graph share_dialog goal, sampled since every path gets a turn, met it.
        shown = {s.casefold() for s in recorded.get("opened", [])}
        other = next(o for o in (by_id[e.query_id] for e in episodes[i + 1:] + episodes[:i])
                     if json.loads(o.checker_params_json).get("surface", "").casefold() not in shown)
        params = json.loads(other.checker_params_json)
        assert quill.check(other.checker, params, state)[0] is writer.check(other.checker, params, recorded)[0], (
            q.instruction, other.instruction)


def test_a_spec_edited_between_a_crash_and_the_resume_is_done_again(tmp_path: Path) -> None:
    """The query_gen shard of an app ran, then the run stopped before its commit; the user edits the app's spec
    and reruns. The resume writes the edited spec's queries, which its lineage's config hash names, not the rows
    the shard made from the old spec (the shard's id was the app's name alone)."""
    shutil.copytree(JOTTER, tmp_path / "jotter")
    spec = tmp_path / "jotter" / "spec.yaml"  # a name of its own: another test made `jotter` another copy's
    spec.write_text(spec.read_text().replace("\napp: jotter\n", "\napp: jotter_resumed\n"))
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, query_gen={
        "apps": [], "app_dirs": [tmp_path / "jotter"], "num_queries": 30, "validate_interface": False,
        "atomic_per_app": 0}))
    first = plan(QUERY_GEN, ws, "r", None)
    for shard in first.pending:
        run_shard(first, shard, ws)  # and the process dies before the commit
    spec.write_text(spec.read_text().replace('instruction: Pin the note "{note}"',
                                             'instruction: Pin "{note}" to the top'))
    resumed = plan(QUERY_GEN, ws, "r", None)
    assert resumed.config_hash != first.config_hash
    for shard in resumed.pending:
        run_shard(resumed, shard, ws)
    pinned = ws.catalog.load("queries", commit(resumed, ws)["queries"]).filter(pl.col("checker") == "note_pinned")
    assert pinned.height and all(i.endswith('" to the top') for i in pinned["instruction"]), pinned["instruction"]
    ws.catalog.close()


def test_deep_search_needs_an_app_that_is_served() -> None:
    with pytest.raises(ConfigError, match="deep_search_apps: quill is neither in query_gen.apps nor an app of "):
        configured_kinds(Settings(query_gen={"apps": ["notes"], "deep_search_apps": ["quill"]}))


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_the_cli_deep_searches_an_app_directory_when_asked(tmp_path: Path, trajforge_cli: str) -> None:
    """`run query_gen --app-dir DIR --deep-search` writes the directory's deep-search queries (the configured
    deep_search_apps, Writer by default, is not served then); without --app-dir the flag is refused."""
    (tmp_path / "trajforge.yaml").write_text("query_gen:\n  num_queries: 1\n  atomic_per_app: 0\n"
                                             "  validate_interface: false\n  deep_search_queries: 3\n")
    proc = subprocess.run([trajforge_cli, "run", "query_gen", "--app-dir", str(QUILL), "--deep-search"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    queries = Workspace.open(Settings(warehouse={"path": tmp_path / "data" / "warehouse"})).catalog.latest(
        "queries")[0]
    assert sorted(zip(queries["app"], queries["source"], strict=True)) == [
        ("quill", "deep_search")] * 3 + [("quill", "page_graph")]
    refused = subprocess.run([trajforge_cli, "run", "query_gen", "--deep-search"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--deep-search applies to the apps of --app-dir" in refused.stdout + \
        refused.stderr


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_apps_check_names_a_missing_element_and_a_check_that_never_holds(tmp_path: Path, trajforge_cli: str) -> None:
    """The mistakes a user makes in a spec, found against the live app: a transition's element that is not on
    the page, and a check whose path matches nothing after the reference path is replayed. A night's model-written
    instructions are no part of the check: it needs no model gateway (it once raised for one)."""
    (tmp_path / "trajforge.yaml").write_text("query_gen:\n  instructions: model\n")
    spec = (JOTTER / "spec.yaml").read_text()
    spec = spec.replace("{op: click, role: button, name: Pin}", "{op: click, role: button, name: Pin it}")
    spec = spec.replace("""at: "notes[?title=='{note}'] | [0].tags\"""", 'at: "notes[?name==`{note}`].tags"')
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "spec.yaml").write_text(spec)
    proc = subprocess.run([trajforge_cli, "apps", "check", str(tmp_path / "app"), "--queries", "8"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=500)
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "button 'Pin it' not found" in out
    assert "check 'note_tagged' does not hold after the reference path: session at 'notes[?name==" in out
    assert "Traceback" not in proc.stderr


WIDE_APP = """\
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

PAGES = {
    "/": "<style>@media (max-width: 600px) { a { display: none } }</style><h1>Home</h1><a href=/settings>Settings</a>",
    "/settings": "<h1>Settings</h1>",
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGES.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(f"<meta name=viewport content='width=device-width'>{body or ''}".encode())


HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

WIDE_SPEC = """\
app: wide
title: Wide
serve: {command: "{python} app.py {port}", url: "http://127.0.0.1:{port}"}
checks:
  settings_open: {url: /settings}
start: home
pages:
  home: {url: /, description: The home page., purpose: Open the settings.}
  settings:
    url: /settings
    description: The settings page.
    purpose: Read the settings.
    goal: {checker: settings_open, params: {}, instruction: Open the settings}
transitions:
  - {from: home, to: settings, actions: [{op: click, role: link, name: Settings}]}
"""


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_apps_check_validates_in_the_rollout_viewport(tmp_path: Path, trajforge_cli: str) -> None:
    """An app whose Settings link shows only on a wide screen: with `rollout.viewport: desktop` the check validates
    and replays its task in desktop, as query generation and the rollouts would (it once validated in mobile and
    reported the link missing)."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "app.py").write_text(WIDE_APP)
    (tmp_path / "app" / "spec.yaml").write_text(WIDE_SPEC)
    (tmp_path / "trajforge.yaml").write_text("rollout:\n  viewport: desktop\n")
    proc = subprocess.run([trajforge_cli, "apps", "check", str(tmp_path / "app"), "--queries", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wide: 1 tasks validated of those sampled, 1 replayed to a check that holds" in proc.stdout
    (tmp_path / "trajforge.yaml").write_text("rollout:\n  viewport: mobile\n")  # the link is hidden there
    proc = subprocess.run([trajforge_cli, "apps", "check", str(tmp_path / "app"), "--queries", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1 and "link 'Settings' not found" in " ".join(proc.stdout.split()), proc.stdout


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_apps_init_drafts_a_spec_that_apps_check_passes_as_written(tmp_path: Path, trajforge_cli: str) -> None:
    """A user's first two commands on a running app: the draft follows the app's links (a list of notes is one
    transition through a slot of the notes' names) and checks out against the live app before any edit."""
    with running(load_app_dir(JOTTER)) as url:  # the notes app in its own process, as a user's app would run
        init = subprocess.run([trajforge_cli, "apps", "init", url + "/", "--out", str(tmp_path / "jot")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert init.returncode == 0, init.stdout + init.stderr
        draft = load_app_dir(tmp_path / "jot")
        assert draft.name == "jot" and draft.serve.base_url == url
        assert draft.spec.slot_values()["note"][:2] == ["Guest Wi-Fi", "Grocery list"]
        opened = [t for t in draft.spec.transitions if t.target == "note"]
        assert [(a.op, a.role, a.name) for t in opened for a in t.actions] == [("click", "link", "{note}")]
        assert {"notes_new", "note", "note_edit"} <= set(draft.spec.goal_pages())
        # The inputs it saw are slots to fill in (a TODO each), for the form tasks the user adds.
        assert draft.spec.pages["notes_new"].slots["notes_new_title"] == ["TODO: values to type into 'Title'"]
        assert "home_search_notes" in draft.spec.pages["home"].slots
        check = subprocess.run([trajforge_cli, "apps", "check", str(tmp_path / "jot")], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "every sampled task resolves and its check holds" in check.stdout
    again = subprocess.run([trajforge_cli, "apps", "init", url + "/", "--out", str(tmp_path / "jot")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "spec.yaml exists" in again.stderr  # a user's edits are never overwritten


NIGHT = """\
query_gen:
  num_queries: 3
rollout:
  policy: replay
  contexts: 2
critics:
  step_critic: rules
  text_channel: false
synth:
  writer: template
"""


@pytest.mark.browser
@pytest.mark.timeout(1200)
def test_a_night_on_datasette_and_on_the_notes_app_as_an_app_directory(tmp_path: Path, trajforge_cli: str,
                                                                        chromium: Path) -> None:
    """The worked example of README "Your own app": Datasette, a third-party app from the package index, started
    by its app directory's command, gets validated queries, episodes its predicates judge, and synthesis rows. In
    the same night the notes app as an app directory gets the bundled notes app's queries, each a success."""
    require(importlib.util.find_spec("datasette") is not None, "datasette is not installed (pip install datasette)")
    (tmp_path / "trajforge.yaml").write_text(NIGHT)
    proc = subprocess.run([trajforge_cli, "run", "nightly", "--app-dir", str(DATASETTE), "--app-dir", str(JOTTER)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "data" / "warehouse"}))
    queries = ws.catalog.latest("queries")[0]
    assert set(queries["app"]) == {"bookshelf", "jotter"}  # --app-dir: these apps only
    books = queries.filter(pl.col("app") == "bookshelf")
    assert books.filter(pl.col("source") == "page_graph").height == 3
    assert {"book_opened", "genre_shown", "author_shown", "interaction"} <= set(books["checker"])
    lineage = ws.catalog.history("queries")[0].lineage
    assert lineage is not None and not [k for k in lineage.dropped if "interface validation" in k], lineage.dropped

    bundled = generate_queries([BundledWebKind(load_app("notes"))], run_id="r", chromium=chromium,
                               settings=QueryGenSettings(num_queries=3, deep_search_apps=[]))
    tasks = ["instruction", "path", "slots_json", "checker", "checker_params_json"]
    notes = pl.DataFrame([q.model_dump(include={*tasks, "source"}) for q in cast(list[Query], bundled.rows["queries"])])
    jotter = queries.filter(pl.col("app") == "jotter")
    assert jotter.filter(pl.col("source") == "page_graph").select(tasks).sort("instruction").equals(
        notes.filter(pl.col("source") == "page_graph").select(tasks).sort("instruction"))
    assert jotter.filter(pl.col("source") == "atomic").height == notes.filter(pl.col("source") == "atomic").height

    verdicts = ws.catalog.latest("verdicts")[0]
    assert verdicts.height == queries.height and verdicts["success"].all(), verdicts.to_dicts()
    apps = dict(zip(queries["query_id"], queries["app"], strict=True))
    for query_id, channels in zip(verdicts["query_id"], map(json.loads, verdicts["channels_json"]), strict=True):
        assert channels["checker"]["answer"] == "success"  # judged by the spec's predicates
        assert channels["checker"]["model_id"].startswith(f"checker:{apps[query_id]}/"), channels["checker"]
    for table in ("train_e2e", "train_grounding", "train_semantics", "train_planning"):
        assert ws.catalog.latest(table)[0].height > 0, table
    assert {"bookshelf", "jotter"} <= set(ws.catalog.latest("grounding")[0]["app"])


@pytest.mark.timeout(180)
def test_the_datasette_example_leaves_no_database_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.py builds its database in a temporary folder, removed when trajforge stops the app: every start left
    one in /tmp (18 in one session)."""
    require(importlib.util.find_spec("datasette") is not None, "datasette is not installed (pip install datasette)")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the app's temporary folder, apart from other tests' apps
    with running(load_app_dir(DATASETTE)):
        assert [p.name for p in tmp_path.glob("datasette-books-*")], "the database is built elsewhere"
    assert list(tmp_path.glob("datasette-books-*")) == []


COUNTER = Path(__file__).parent / "fixtures" / "counter_app"


@pytest.mark.browser
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "reset", "second_holds"), [
    ("counter-url", {"url": "/api/reset", "method": "POST"}, True),
    ("counter-command", {"command": "{python} reset.py"}, True),
    ("counter-context", "context", False),  # the app keeps its state beyond the browser's: a context does not reset it
])
def test_each_episode_starts_from_the_apps_reset_state(chromium: Path, tmp_path: Path, name: str, reset: object,
                                                       second_holds: bool) -> None:
    """A counter app whose state outlives a browser session: two nights' episodes of "add one" each end at one
    when the spec resets the app by URL or command, and the second ends at two when it does not. The goal's check
    combines JSON at a path, a Python function of the directory's checkers.py and the final accessibility tree."""
    shutil.copytree(COUNTER, tmp_path / "counter")
    raw = yaml.safe_load((tmp_path / "counter" / "spec.yaml").read_text())
    (tmp_path / "counter" / "spec.yaml").write_text(yaml.safe_dump({**raw, "app": name, "reset": reset},
                                                                   sort_keys=False))
    [counter] = use_app_dirs([tmp_path / "counter"])
    made = generate_queries([counter], run_id="r", settings=QueryGenSettings(num_queries=1, atomic_per_app=0),
                            chromium=chromium)
    [query] = cast(list[Query], made.rows["queries"])
    settings = RolloutSettings(policy="replay", contexts=1, chromium=chromium)
    episodes = [e for run in ("night-1", "night-2")  # the app's process starts anew; its state file stays
                for e in cast(list[Episode], rollout([query.model_dump()], run_id=run, settings=settings,
                                                     blobs=BlobStore(tmp_path / "blobs")).rows["episodes"])]
    verdicts = [counter.check(query.checker, json.loads(query.checker_params_json), json.loads(e.final_state_json))
                for e in episodes]
    assert len(verdicts) == 2
    if second_holds:
        assert verdicts[0] == verdicts[1] == (True, "state at 'count' is 1, expected 1; count_is: the count is 1; "
                                                    "found heading named 'Count: 1'")
    else:  # interface validation pressed Add once too, and nothing put the count back since
        assert not verdicts[1][0] and "count_is: the count is 3" in verdicts[1][1], verdicts[1][1]


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_episodes_on_an_app_whose_state_every_session_shares_run_one_at_a_time(chromium: Path,
                                                                               tmp_path: Path) -> None:
    """Three episodes of "add one" on the counter reset by URL, on four contexts: each starts from the reset and
    ends at one. Side by side, one episode's reset would wipe another's count, or three Adds would make three."""
    shutil.copytree(COUNTER, tmp_path / "counter")
    [counter] = use_app_dirs([tmp_path / "counter"])
    made = generate_queries([counter], run_id="r", settings=QueryGenSettings(num_queries=1, atomic_per_app=0),
                            chromium=chromium)
    [query] = cast(list[Query], made.rows["queries"])
    copies = [query.model_copy(update={"query_id": f"{query.query_id}-{i}"}).model_dump() for i in range(3)]
    out = rollout(copies, run_id="night", settings=RolloutSettings(policy="replay", contexts=4, chromium=chromium),
                  blobs=BlobStore(tmp_path / "blobs"))
    verdicts = [counter.check(query.checker, json.loads(query.checker_params_json), json.loads(e.final_state_json))
                for e in cast(list[Episode], out.rows["episodes"])]
    assert len(verdicts) == 3 and all(holds for holds, _ in verdicts), verdicts


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_rollouts_side_by_side_take_an_apps_shared_state_one_episode_at_a_time(chromium: Path,
                                                                               tmp_path: Path) -> None:
    """The reference stage replays its two viewports side by side, each a rollout on contexts of its own, as Dask
    workers roll shards: the counter's one state is held by one episode at a time across them too (a lock
    per rollout let the other rollout's reset and Add land mid-episode: counts of 0 or 2)."""
    shutil.copytree(COUNTER, tmp_path / "counter")
    raw = yaml.safe_load((tmp_path / "counter" / "spec.yaml").read_text())
    (tmp_path / "counter" / "spec.yaml").write_text(yaml.safe_dump({**raw, "app": "counter-side"}, sort_keys=False))
    [counter] = use_app_dirs([tmp_path / "counter"])
    made = generate_queries([counter], run_id="r", settings=QueryGenSettings(num_queries=1, atomic_per_app=0),
                            chromium=chromium)
    [query] = cast(list[Query], made.rows["queries"])

    def night(viewport: str) -> list[Episode]:
        copies = [query.model_copy(update={"query_id": f"{query.query_id}-{viewport}-{i}"}).model_dump()
                  for i in range(3)]
        settings = RolloutSettings(policy="replay", contexts=2, chromium=chromium, viewport=viewport)
        return cast(list[Episode], rollout(copies, run_id=f"night-{viewport}", settings=settings,
                                           blobs=BlobStore(tmp_path / "blobs")).rows["episodes"])

    with ThreadPoolExecutor(2) as pool:
        episodes = [e for run in pool.map(night, ["mobile", "desktop"]) for e in run]
    verdicts = [counter.check(query.checker, json.loads(query.checker_params_json), json.loads(e.final_state_json))
                for e in episodes]
    assert len(verdicts) == 6 and all(holds for holds, _ in verdicts), verdicts


def test_a_secret_an_app_echoes_is_kept_as_its_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user's app answers or shows is masked before it is kept: its JSON may echo a typed password."""
    monkeypatch.setenv("TRAJFORGE_SECRET_SHOP_PASSWORD", "hunter2-Tide")
    answer = '{"user": "alice", "last_login_form": {"password": "hunter2-Tide"}}'
    assert secrets.mask(answer) == answer.replace("hunter2-Tide", "<secret>shop_password</secret>")
    assert secrets.mask("http://127.0.0.1/login?pw=hunter2-Tide") == \
        "http://127.0.0.1/login?pw=<secret>shop_password</secret>"
    # Parsed JSON: in a key, in a string with a quote (which the JSON text escapes), and in pieces under one key
    monkeypatch.setenv("TRAJFORGE_SECRET_QUOTED", 'say "Tide"')
    monkeypatch.setenv("TRAJFORGE_SECRET_CODE", "4815")
    state = {"carts": {"hunter2-Tide": 1}, "note": 'I say "Tide"', "ui_events": [
        {"name": "Digit 1", "text": "48"}, {"name": "Digit 2", "text": "1"}, {"name": "Digit 3", "text": "5"}]}
    kept = json.dumps(secrets.mask_json(state))
    assert "hunter2-Tide" not in kept and "Tide" not in kept and '"48"' not in kept, kept
    assert kept.count("<secret>code</secret>") == 3 and "hunter2-Tide" in json.dumps(state)  # the input is left


def test_an_elements_text_is_cut_after_its_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's text is kept to MAX_TEXT characters; a secret that runs across the cut is masked whole first, so
    none of it stays (cut first, its first half did)."""
    monkeypatch.setenv("TRAJFORGE_SECRET_SHOP_PASSWORD", "hunter2-Tide")
    text = "x" * (MAX_TEXT - 6) + "hunter2-Tide and more"
    kept = kept_dom({"main": [{"text": text, "value": None, "checked": None, "selected": None}]})
    (match,) = kept["main"]
    assert match["text"] == "x" * (MAX_TEXT - 6) + "<secre"  # the placeholder's start, not the secret's

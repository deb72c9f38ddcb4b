"""The accessibility tree's one text form: `render` pins it, `parse` reads it back exactly.

The format is pinned on a CDP tree written here (prompts, cache keys and stored step rows
depend on it byte for byte); the round trip is checked on real trees of every bundled app
in Debian's Chromium, with elements whose names and values hold quotes, brackets,
parentheses, colons and line breaks added to the live page, and on the recorded Android
dump.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from trajforge.envs import secrets
from trajforge.envs.android import ax_nodes, parse_hierarchy
from trajforge.envs.apps import AppServer, known_apps, load_app
from trajforge.envs.axtree import AXNode, Element, from_cdp, parse, render
from trajforge.envs.browser import BrowserEnv, BrowserHost, Observation

FIXTURES = Path(__file__).parent / "fixtures" / "android"


def cdp(node_id: str, role: str, name: str = "", children: tuple[str, ...] = (), *, backend: int | None = None,
        value: object = None, ignored: bool = False, **props: object) -> dict[str, object]:
    """One node as `Accessibility.getFullAXTree` reports it."""
    node: dict[str, object] = {
        "nodeId": node_id, "ignored": ignored, "role": {"type": "role", "value": role},
        "name": {"type": "computedString", "value": name}, "childIds": list(children),
        "properties": [{"name": k, "value": {"type": "boolean", "value": v}} for k, v in props.items()],
    }
    if backend is not None:
        node["backendDOMNodeId"] = backend
    if value is not None:
        node["value"] = {"type": "string", "value": value}
    return node


def test_render_writes_the_format_prompts_and_step_rows_hold() -> None:
    nodes = [
        cdp("1", "RootWebArea", "Notes", ("2", "3", "5", "6", "7", "8", "9"), backend=1, focused=True),
        cdp("2", "heading", "Monday", ("21",), backend=2, level=2),
        cdp("21", "StaticText", "Monday", backend=21),  # repeats its parent's name: dropped
        cdp("3", "generic", "", ("31",), backend=3),  # unnamed layout: dropped, its child lifted
        cdp("31", "link", "Garden plans", backend=31, value="http://app/notes/1"),  # a link's URL is not shown
        cdp("5", "searchbox", "Search notes", backend=5, value='say "hi"', focused=True),
        cdp("6", "checkbox", "Done", backend=6, checked="mixed", disabled=True),
        cdp("7", "none", "", ("71",), ignored=True),  # ignored: skipped, its child kept one level up
        cdp("71", "StaticText", 'He said "Note: x" [done] (1,2,3,4)', backend=71),
        cdp("8", "ListMarker", "•", backend=8),
        cdp("9", "button", "Off screen", backend=9),
    ]
    by_id = {n["nodeId"]: n for n in nodes}
    for node in nodes:
        for child in node["childIds"]:  # type: ignore[union-attr]
            by_id[child]["parentId"] = node["nodeId"]
    boxes = {1: (0, 0, 1280, 800), 2: (286.4, 150.5, 707, 40), 31: (-3.5, 94.49, 820.2, 44),
             5: (176, 94, 820, 44.6), 6: (10, 20, 13, 13), 71: (8, 137, 217, 17), 9: (8, 1900.7, 80, 30)}
    tree, focused = from_cdp(nodes, boxes)
    assert render(tree) == "\n".join([
        'RootWebArea "Notes" [focused] (0,0,1280,800)',
        '  heading "Monday" [level=2] (286,150,707,40)',
        '  link "Garden plans" (-4,94,820,44)',
        '  searchbox "Search notes" [focused]: say "hi" (176,94,820,45)',
        '  checkbox "Done" [checked=mixed] [disabled] (10,20,13,13)',
        '  text "He said "Note: x" [done] (1,2,3,4)" (8,137,217,17)',
        '  button "Off screen" (8,1901,80,30)',
    ])
    assert focused == Element("searchbox", "Search notes", (176, 94, 820, 44.6)), "Chromium's role, the exact box"
    assert parse(render(tree)) == tree


def test_parse_reads_each_field_and_settles_what_the_format_cannot_tell_apart() -> None:
    assert parse('  textbox "Search": say "hi": [x] (1,2,3,4) (240,94,692,44)') == [
        AXNode(1, "textbox", "Search", (), 'say "hi": [x] (1,2,3,4)', (240, 94, 692, 44))]
    assert parse('heading "Results for "garden": 3" [level=2]') == [
        AXNode(0, "heading", 'Results for "garden": 3', ("level=2",))]
    assert parse("textbox: unnamed\n  LineBreak") == [AXNode(0, "textbox", "", (), "unnamed"), AXNode(1, "LineBreak")]
    assert parse("") == []
    for not_a_tree in ("main\n  button New note", 'button ""', "   odd indent"):
        with pytest.raises(ValueError, match="not a line of a rendered accessibility tree"):
            parse(not_a_tree)


def test_android_trees_render_through_the_same_owner() -> None:
    nodes = ax_nodes(parse_hierarchy((FIXTURES / "window_dump.xml").read_text()))
    text = render(nodes)
    assert 'switch "Dark theme" [checked] (560,500,136,60)' in text.splitlines()
    assert parse(text) == list(nodes)


# --- real trees ----------------------------------------------------------------------------

TRICKY = """
<button>Say "hi": [now] (1,2,3,4)</button>
<h2>Results for "garden": 3 notes</h2>
<p>He said "Note: x" [done] (see: above)</p>
<pre>first "line"
second line (2)</pre>
<textarea aria-label="Body (draft)">a "b": [c]
second line (3)</textarea>
<select aria-label="Pick: one"><option>B "b": [c]</option></select>
<a href="#x">Link "q" (z): [y]</a>
<label><input type="checkbox" checked> Agree: "terms" [v2]</label>
"""
TRICKY_NAMES = {'Say "hi": [now] (1,2,3,4)', 'Results for "garden": 3 notes', 'He said "Note: x" [done] (see: above)',
                'first "line"\nsecond line (2)', "Body (draft)", "Pick: one", 'Link "q" (z): [y]',
                'Agree: "terms" [v2]'}


@pytest.fixture(scope="module")
def observations(chromium: Path) -> Iterator[list[Observation]]:
    """The start page of every bundled app, in both viewports, as it loads and with the tricky elements added."""
    seen: list[Observation] = []
    with BrowserHost(chromium) as host, BrowserEnv(viewport="desktop", host=host) as desktop, \
            BrowserEnv(viewport="mobile", host=host) as mobile:
        for name in known_apps():
            app = load_app(name)
            with AppServer(app) as server:
                for env in (desktop, mobile):
                    env.reset(f"axtree-{name}", server.base_url + app.spec.pages[app.spec.start].url)
                    seen.append(env.observe())
                    env.page.evaluate(f"document.body.insertAdjacentHTML('afterbegin', {json.dumps(TRICKY)})")
                    env.page.get_by_role("textbox", name="Body (draft)").focus()
                    seen.append(env.observe())
        yield seen


@pytest.mark.browser
def test_real_trees_round_trip(observations: list[Observation]) -> None:
    assert len(observations) == 4 * len(known_apps())
    for obs in observations:
        assert obs.ax_tree == render(obs.nodes)
        assert parse(obs.ax_tree) == list(obs.nodes), obs.url
        assert render(parse(obs.ax_tree)) == obs.ax_tree


@pytest.mark.browser
def test_tricky_names_and_values_come_back_whole(observations: list[Observation]) -> None:
    for obs in observations[1::2]:
        parsed = parse(obs.ax_tree)
        # casefolded: one app's style sets its h2 in capitals, which is the name Chromium reports
        assert {n.casefold() for n in TRICKY_NAMES} <= {n.name.casefold() for n in parsed}, obs.url
        body = next(n for n in parsed if n.name == "Body (draft)")
        assert (body.role, body.value, "focused" in body.states) == ("textbox", 'a "b": [c]\nsecond line (3)', True)
        assert next(n for n in parsed if n.name == "Pick: one").value == 'B "b": [c]'
        assert obs.focused is not None and obs.focused.name == "Body (draft)"


OVERLAID = """
<button style="position:fixed;left:10px;top:300px;z-index:50">Under the overlay</button>
<div style="position:fixed;left:0;top:280px;width:220px;height:80px;background:#fff;z-index:60"></div>
<button style="position:fixed;left:240px;top:300px;z-index:70">In plain sight</button>
"""


@pytest.mark.browser
def test_an_element_painted_over_is_marked_covered(chromium: Path) -> None:
    app = load_app("notes")
    with BrowserHost(chromium) as host, BrowserEnv(viewport="desktop", host=host) as env, AppServer(app) as server:
        env.reset("covered", server.base_url + app.spec.pages[app.spec.start].url)
        env.page.evaluate(f"document.body.insertAdjacentHTML('beforeend', {json.dumps(OVERLAID)})")
        nodes = {n.name: n for n in parse(env.observe().ax_tree)}
    assert "covered" in nodes["Under the overlay"].states
    assert "covered" not in nodes["In plain sight"].states
    sight = nodes["In plain sight"].box
    overlay = (0, 280, 220, 80)
    for node in nodes.values():  # what the two new things were put over, and nothing else
        if "covered" in node.states:
            x, y = node.box[0] + node.box[2] / 2, node.box[1] + node.box[3] / 2
            assert any(bx <= x < bx + bw and by <= y < by + bh for bx, by, bw, bh in (overlay, sight)), node


def test_a_secret_in_text_without_a_box_is_covered_by_its_closest_boxed_ancestor(monkeypatch) -> None:
    """Text the tree holds apart from the layout has no box of its own: the screenshot is covered where its
    closest ancestor with a box is, and where no ancestor has one, whole: a secret is never left on it."""
    import io

    from PIL import Image

    monkeypatch.setenv("TRAJFORGE_SECRET_ONE_TIME_CODE", "481-S3CR3T")
    white = io.BytesIO()
    Image.new("RGB", (100, 60), "white").save(white, format="PNG")

    def seen(*nodes: AXNode) -> Image.Image:
        obs = Observation(white.getvalue(), 100, 60, "/", "Account", nodes)
        assert "481-S3CR3T" not in obs.ax_tree
        return Image.open(io.BytesIO(obs.png)).convert("RGB")

    image = seen(AXNode(0, "RootWebArea", "Account"), AXNode(1, "region", "Your code", box=(10, 10, 40, 20)),
                 AXNode(2, "text", "Code: 481-S3CR3T"), AXNode(1, "heading", "Welcome", box=(0, 40, 100, 10)))
    assert image.getpixel((10, 10)) == image.getpixel((49, 29)) == (0, 0, 0)  # the region's box
    assert image.getpixel((5, 5)) == image.getpixel((50, 45)) == (255, 255, 255)  # the rest, the heading too
    image = seen(AXNode(0, "RootWebArea", "Account"), AXNode(1, "text", "Code: 481-S3CR3T"))
    assert image.getextrema() == ((0, 0), (0, 0), (0, 0))  # no ancestor has a box: all of it


def test_a_secret_inside_another_is_masked_whole_in_either_order(monkeypatch) -> None:
    """A PIN that is part of a card code: masked first, it left the card code's rest showing ('<pin>3377')."""
    for first, second in ((("PIN", "4821"), ("CARD_CODE", "48213377")), (("CARD_CODE", "48213377"), ("PIN", "4821"))):
        for name in ("PIN", "CARD_CODE"):
            monkeypatch.delenv(f"TRAJFORGE_SECRET_{name}", raising=False)
        for name, value in (first, second):  # the environment lists them in the order they were set
            monkeypatch.setenv(f"TRAJFORGE_SECRET_{name}", value)
        assert secrets.mask("card 48213377, pin 4821") == "card <secret>card_code</secret>, pin <secret>pin</secret>"


def test_a_focused_field_named_by_a_piece_of_a_secret_is_named_masked(monkeypatch) -> None:
    """The focused element is a `type` or `key` step's target: named by a piece of a secret the page splits (a
    code whose second half labels a field), its name is masked as its node's is, not left as the piece."""
    import io

    from PIL import Image

    monkeypatch.setenv("TRAJFORGE_SECRET_ONE_TIME_CODE", "481-S3CR3T")
    white = io.BytesIO()
    Image.new("RGB", (100, 60), "white").save(white, format="PNG")
    field = Element("textbox", "S3CR3T", (10, 30, 80, 20))
    obs = Observation(white.getvalue(), 100, 60, "/", "Account", (
        AXNode(0, "RootWebArea", "Account"), AXNode(1, "text", "481-", box=(10, 10, 20, 10)),
        AXNode(1, "textbox", "S3CR3T", box=(10, 30, 80, 20))), field)
    assert obs.focused is not None and "S3CR3T" not in obs.focused.name
    assert obs.focused.name == obs.nodes[2].name

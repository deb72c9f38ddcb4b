"""The accessibility tree as data, and the one owner of its text form.

An env turns what the platform reports (Chromium's CDP tree, Android's view hierarchy)
into `AXNode`s; `render` is the only code that writes them as text, and `parse` the only
code that reads that text back. The text matters beyond the prompt it goes into: model
cache keys hash it and step rows store it (`ax_tree_before`, `ax_tree_after`), so its
format must not drift. Code that holds a live `Observation` reads `Observation.nodes`;
code that only holds stored text calls `parse`, never a regex of its own.

One line per node, indented two spaces per level:

    role "name" [state] [state]: value (x,y,w,h)

The name is left out when empty (and so are its quotes), as are the states, the value
and the box when there are none. The format quotes names but escapes nothing, so a name
or value holding a quote or a line break can read more than one way; `parse` settles
those cases by the rules in its docstring.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

Box = tuple[float, float, float, float]
"""x, y, width, height in screenshot pixels (the viewport's CSS pixels)."""

PixelBox = tuple[int, int, int, int]
"""A box rounded to whole pixels, as the text shows it."""

_UNNAMED_NOISE = {"generic", "none", "LabelText", "Legend", "paragraph", "StaticText", "InlineTextBox", "div"}
_NEVER_SHOWN = {"InlineTextBox", "ListMarker"}  # text fragments and bullets: noise for a reader
_SHOWN_STATES = ("checked", "selected", "expanded", "disabled", "focused", "level")
_NO_VALUE = ("StaticText", "link")  # roles whose value is not shown (a link's is its URL)


@dataclass(frozen=True)
class Element:
    """An element of the accessibility tree, with its box when it has a layout."""

    role: str
    name: str
    box: Box | None = None


@dataclass(frozen=True)
class AXNode:
    """One shown node of the tree: one line of its text, field by field.

    A tree is a list of nodes in document order, each with its depth (its parent is the
    closest node before it with a smaller depth): the same shape as the text, so a
    parsed tree equals the one that was rendered.
    """

    depth: int
    role: str
    """The role as shown: Chromium's, except "text" for StaticText (Android's mapped to the same words)."""
    name: str = ""
    states: tuple[str, ...] = ()
    """As shown, in the order shown: "checked", "checked=mixed", "level=2"..., and last "covered" when another
    element was painted over the centre of its box when the tree was recorded."""
    value: str = ""
    """The value as shown (a text field's content, a slider's number); "" when none is shown."""
    box: PixelBox | None = None
    """Where it is on the screenshot, rounded to whole pixels; None without a layout."""


def cdp_value(field: dict[str, Any] | None) -> Any:
    """The `value` of one of CDP's AXValue fields (role, name, value, a property); None when absent."""
    return (field or {}).get("value")


class Layout:
    """The main frame's layout from one `DOMSnapshot.captureSnapshot` (taken with `includePaintOrder`):
    where each element is on the screenshot, and which one is painted on top at a point.

    The snapshot's layout bounds are document coordinates; subtracting the scroll offset
    gives what the screenshot shows (what `locator.bounding_box()` reports). Hit-testing
    here is what `document.elementFromPoint` would tell, read from the snapshot that the
    observation already took: no round trip per question (two CDP calls per step's target
    cost about 5 ms, a tenth of a step). Clipping by a scrolled container is not seen, and
    the page's own `pointer-events` are not consulted.
    """

    def __init__(self, snapshot: dict[str, Any] | None = None) -> None:
        doc = snapshot["documents"][0] if snapshot else {"nodes": {}, "layout": {}}
        layout = doc["layout"]
        self._backend_ids: list[int] = doc["nodes"].get("backendNodeId", [])
        self._parent: list[int] = doc["nodes"].get("parentIndex", [])
        self._scroll = (doc.get("scrollOffsetX", 0), doc.get("scrollOffsetY", 0))
        self._node_index = np.asarray(layout.get("nodeIndex", []), dtype=int)
        self._bounds = np.asarray(layout.get("bounds", []), dtype=float).reshape(-1, 4)
        paint = layout.get("paintOrders")
        self._order = np.asarray(paint) if paint else None
        sx, sy = self._scroll
        self.boxes: dict[int, Box] = {}
        """Viewport boxes by backend DOM node id (the first layout object is the element's)."""
        for index, (x, y, w, h) in zip(self._node_index.tolist(), self._bounds.tolist(), strict=True):
            self.boxes.setdefault(self._backend_ids[index], (x - sx, y - sy, w, h))

    def top_at(self, x: float, y: float) -> list[int]:
        """Backend node ids of the node painted last at a viewport point, then its ancestors up to the
        document; empty where nothing is laid out there (or the snapshot had no paint order)."""
        if self._order is None or not len(self._bounds):
            return []
        dx, dy = x + self._scroll[0], y + self._scroll[1]
        b = self._bounds
        inside = (b[:, 0] <= dx) & (dx < b[:, 0] + b[:, 2]) & (b[:, 1] <= dy) & (dy < b[:, 1] + b[:, 3])
        hits = np.flatnonzero(inside)
        if not len(hits):
            return []
        # Paint order ranks stacking layers (ties within one); within a layer, later in layout order paints later.
        node = int(self._node_index[hits[np.lexsort((hits, self._order[hits]))[-1]]])
        chain = []
        while node != -1:
            chain.append(self._backend_ids[node])
            node = self._parent[node]
        return chain

    def covered(self, candidates: Iterable[int], viewport: tuple[int, int]) -> set[int]:
        """Of the candidate backend node ids, those whose box centre, on the screenshot (`viewport`: its
        width and height), is painted over by another element: the node on top there is neither the
        candidate nor inside it."""
        vw, vh = viewport
        covered = set()
        for backend_id in candidates:
            box = self.boxes.get(backend_id)
            if box is None or box[2] <= 0 or box[3] <= 0:
                continue
            cx, cy = box[0] + box[2] / 2, box[1] + box[3] / 2
            if not (0 <= cx < vw and 0 <= cy < vh):
                continue  # off screen: nothing paints there on the screenshot
            chain = self.top_at(cx, cy)
            if chain and backend_id not in chain:
                covered.add(backend_id)
        return covered


def from_cdp(nodes: list[dict[str, Any]], boxes: dict[int, Box] | None = None,
             covered: set[int] | None = None) -> tuple[list[AXNode], Element | None]:
    """The shown nodes of a CDP `Accessibility.getFullAXTree`, and the focused element.

    Ignored nodes are skipped but their children kept (one level up); unnamed layout
    nodes (generic, paragraph, label wrappers) and text that repeats its parent's name
    are dropped, so the tree reads like what a person sees. The box, where the node has
    a layout, is where it is on the screenshot (off-screen boxes say how far to scroll).
    The focused element keeps Chromium's role and the unrounded box: it is a step's
    target, recorded as such. A node in `covered` (see `Layout.covered`) gets the state
    "covered": it is on screen but another element is painted over its centre.
    """
    boxes = boxes or {}
    covered = covered or set()
    by_id = {n["nodeId"]: n for n in nodes}
    roots = [n for n in nodes if not n.get("parentId") or n["parentId"] not in by_id]
    shown_nodes: list[AXNode] = []
    focused: Element | None = None

    def visit(node: dict[str, Any], depth: int, parent_name: str) -> None:
        nonlocal focused
        role = cdp_value(node.get("role")) or ""
        name = str(cdp_value(node.get("name")) or "").strip()
        shown = not node.get("ignored") and role not in _NEVER_SHOWN
        if shown and not name and role in _UNNAMED_NOISE:
            shown = False
        if shown and role == "StaticText" and name == parent_name:
            shown = False
        if shown:
            props = {p["name"]: cdp_value(p.get("value")) for p in node.get("properties", [])}
            states = []
            for key in _SHOWN_STATES:
                val = props.get(key)
                if key == "level" and val is not None and role == "heading":
                    states.append(f"level={val}")
                elif key == "level":
                    continue
                elif val == "mixed":
                    states.append(f"{key}=mixed")
                elif val in (True, "true"):
                    states.append(key)
            if node.get("backendDOMNodeId", -1) in covered:
                states.append("covered")
            box = boxes.get(node.get("backendDOMNodeId", -1))
            if props.get("focused") and role != "RootWebArea":
                focused = Element(role, name, box)
            value = cdp_value(node.get("value"))
            shown_nodes.append(AXNode(
                depth, "text" if role == "StaticText" else role, name, tuple(states),
                "" if value in (None, "") or role in _NO_VALUE else f"{value}",
                None if box is None else (round(box[0]), round(box[1]), round(box[2]), round(box[3])),
            ))
        for child_id in node.get("childIds", []):
            if child_id in by_id:
                visit(by_id[child_id], depth + 1 if shown else depth, name if shown and name else parent_name)

    for root in roots:
        visit(root, 0, "")
    return shown_nodes, focused


def render(nodes: Iterable[AXNode]) -> str:
    """The tree as text: one `role "name" [state]: value (x,y,w,h)` line per node, indented by depth."""
    lines = []
    for n in nodes:
        line = "  " * n.depth + (f'{n.role} "{n.name}"' if n.name else n.role)
        line += "".join(f" [{s}]" for s in n.states)
        if n.value:
            line += f": {n.value}"
        if n.box is not None:
            line += " ({},{},{},{})".format(*n.box)
        lines.append(line)
    return "\n".join(lines)


_TAIL = (r'(?P<states>(?: \[(?:level=[^\]]*|(?:checked|selected|expanded|disabled|focused|covered)(?:=mixed)?)\])*)'
         r'(?:: (?P<value>.+?))?(?: \((?P<box>-?\d+,-?\d+,-?\d+,-?\d+)\))?')
_FIRST_QUOTE = re.compile(rf'(?P<indent>(?:  )*)(?P<role>[^\s":]+)(?: "(?P<name>.+?)")?{_TAIL}', re.DOTALL)
_LAST_QUOTE = re.compile(rf'(?P<indent>(?:  )*)(?P<role>[^\s":]+)(?: "(?P<name>.+)")?{_TAIL}', re.DOTALL)
_OPENS_NAME = re.compile(r'(?:  )*[^\s":]+ "')
_TEXT_VALUE_ROLES = {"textbox", "searchbox", "combobox"}
"""Roles whose shown value is text an agent typed or picked, which may hold quotes of its own."""


def _match(line: str) -> re.Match[str] | None:
    """The line read as one node, or None; both patterns read the same lines, split differently."""
    m = _LAST_QUOTE.fullmatch(line)
    if m is not None and m["role"] in _TEXT_VALUE_ROLES:
        m = _FIRST_QUOTE.fullmatch(line)
    return m


def parse(text: str) -> list[AXNode]:
    """The nodes of `render`'s text: `render(parse(text)) == text` for any text it wrote.

    `parse(render(nodes)) == nodes` too, but for what the unescaped format cannot tell
    apart, settled so: a name ends at the last quote that the rest of the line can follow
    (states, a value, a box), except for text fields and combo boxes, whose typed or
    picked value may itself hold quotes: there it ends at the first. A name or value
    that held a line break spans lines: a line continues the one before it when that
    one is unfinished (a quote left open), or when it is no node line of its own and
    does not open a quoted name (`role "…`). So a line of a name or value that reads as
    a node line is read as one. A tree written by anything else raises ValueError.
    """
    if not text:
        return []
    chunks: list[str] = []
    for line in text.split("\n"):
        if chunks and (_match(chunks[-1]) is None or (_match(line) is None and not _OPENS_NAME.match(line))):
            chunks[-1] += "\n" + line
        else:
            chunks.append(line)
    nodes = []
    for chunk in chunks:
        m = _match(chunk)
        if m is None:
            raise ValueError(f"not a line of a rendered accessibility tree: {chunk[:200]!r}")
        box: PixelBox | None = None
        if m["box"] is not None:
            x, y, w, h = (int(v) for v in m["box"].split(","))
            box = (x, y, w, h)
        states = tuple(re.findall(r"\[([^\]]*)\]", m["states"]))
        nodes.append(AXNode(len(m["indent"]) // 2, m["role"], m["name"] or "", states, m["value"] or "", box))
    return nodes

"""`trajforge apps init`: explore a running web app and draft its app directory's spec.yaml.

Breadth-first from the start URL over the app's links, within a page budget: a page is a
URL path on the app's origin, with its numeric segments as one pattern (/notes/3 and
/notes/4 are one page; the query string is the page's state, not another page), read as
its accessibility tree. Three or more links of a page to paths in one folder are a list
of items, one page too (/books/Ember+Crown, /books/Drift+Protocol...). Links to files
that are no page (.json, .csv...) are not followed. Only links are followed, by their href, never clicked through
buttons: exploring a live app must not submit its forms or delete its data. What the
draft holds:

- a page per path, with the title, the fields and buttons seen on it, and a slot per
  field whose one value is a TODO (for the user to fill with values the app accepts, and
  to use in a transition that types them and clicks the button that submits);
- a transition per link of the breadth-first tree (so the graph is acyclic); where
  several links of a page lead to one path (a list of notes, each opening /note), one
  transition clicks `{slot}` and the slot lists the links' names;
- a goal on every page but the start ("Open ..."), whose check is the page's path in the
  final URL, and, for a page reached through a slot, the slot's value on the page.

So `apps check` passes on the draft as written, and a night can run on it. The user then
describes the pages, adds the tasks that change the app's state, and checks them through
its JSON state (README "Your own app").
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import SplitResult, urlsplit

import yaml

from trajforge.envs.axtree import AXNode
from trajforge.envs.browser import BrowserEnv

FIELD_ROLES = ("textbox", "searchbox", "combobox", "spinbutton")
BUTTON_ROLES = ("button", "menuitem", "tab")
PAGE_SUFFIXES = ("", ".html", ".htm", ".php", ".asp", ".aspx", ".jsp")
"""Paths that are pages to explore; others (.json, .csv, .png...) are files a page links to."""
LIST_SIZE = 3
"""Links of one page into one folder that make a list of items."""
MAX_SLOT_VALUES = 12
"""Link names kept as one slot's values (a long list page would make the slot a page of its own)."""


@dataclass
class _Page:
    page_id: str
    path: str
    """Where it was first seen: a path with its query string."""
    title: str = ""
    fields: list[str] = field(default_factory=list)
    buttons: list[str] = field(default_factory=list)
    links: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    """Path pattern on the origin -> (the first link's path and query, the names of the links that lead there)."""


def pattern(path: str) -> str:
    """A path with its numeric segments as {n}: the page, whichever item it shows."""
    return re.sub(r"/\d+(?=/|$)", "/{n}", path or "/")


def _where(parts: SplitResult) -> str:
    """A URL's path with its query string: where on the origin a page was seen."""
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _page_id(path: str, taken: set[str]) -> str:
    words = [w for w in re.split(r"[^a-z0-9]+", path.lower()) if w and not w.isdigit()]
    base = "_".join(words) or "home"
    page_id, n = base, 2
    while page_id in taken:
        page_id, n = f"{base}_{n}", n + 1
    return page_id


def _read(env: BrowserEnv, url: str, page: _Page, origin: str) -> None:
    env.reset("explore", url, app_protocol=False)
    obs = env.observe()
    page.title = obs.title
    nodes: list[AXNode] = list(obs.nodes)
    page.fields = sorted({n.name for n in nodes if n.role in FIELD_ROLES and n.name})
    page.buttons = sorted({n.name for n in nodes if n.role in BUTTON_ROLES and n.name})
    here = pattern(urlsplit(page.path).path)
    for name in dict.fromkeys(n.name for n in nodes if n.role == "link" and n.name):
        hrefs = env.page.get_by_role("link", name=name, exact=True).evaluate_all("els => els.map(e => e.href)")
        for href in hrefs[:1]:  # the first link of that name is the one a click by name finds
            parts = urlsplit(href)
            if (f"{parts.scheme}://{parts.netloc}" == origin and PurePosixPath(parts.path).suffix in PAGE_SUFFIXES
                    and pattern(parts.path) != here):
                page.links.setdefault(pattern(parts.path), (_where(parts), []))[1].append(name)
    folders: dict[str, list[str]] = defaultdict(list)
    for key in page.links:
        folders[key.rsplit("/", 1)[0]].append(key)
    for folder, keys in folders.items():
        if folder and len(keys) >= LIST_SIZE:
            where = page.links[keys[0]][0]
            page.links[folder + "/{item}"] = (where, [n for k in keys for n in page.links.pop(k)[1]])


def _input_slots(page_id: str, fields: list[str], taken: set[str]) -> dict[str, list[str]]:
    """A slot per field of a page (page id and field name, unless `taken`), its one value a TODO: a form task types
    slots, and only the user knows which values the app accepts. A slot no transition uses is never sampled, so the
    draft still checks out as written."""
    out: dict[str, list[str]] = {}
    for name in fields:
        base = "_".join([page_id, *(w for w in re.split(r"[^a-z0-9]+", name.lower()) if w)])
        slot, n = base, 2
        while slot in taken or slot in out:
            slot, n = f"{base}_{n}", n + 1
        out[slot] = [f"TODO: values to type into {name!r}"]
    return out


def explore(env: BrowserEnv, start_url: str, *, name: str, max_pages: int = 12) -> dict[str, Any]:
    """The draft spec of the app `name` at `start_url` (a mapping, written as spec.yaml by `write_draft`)."""
    parts = urlsplit(start_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    start = _Page(_page_id(parts.path, set()), _where(parts._replace(path=parts.path or "/")))
    pages: dict[str, _Page] = {pattern(parts.path): start}
    transitions: list[dict[str, Any]] = []
    slots: dict[str, dict[str, list[str]]] = defaultdict(dict)  # page id -> its slots
    reached_by_slot: dict[str, str] = {}  # page id -> the slot whose value opens it
    queue = [start]
    while queue:
        page = queue.pop(0)
        _read(env, origin + page.path, page, origin)
        for key, (path, names) in page.links.items():
            if key in pages or len(pages) >= max_pages:
                continue
            target = _Page(_page_id(key.replace("{n}", "item"), {p.page_id for p in pages.values()}), path)
            pages[key] = target
            queue.append(target)
            if len(names) == 1:
                transitions.append({"from": page.page_id, "to": target.page_id,
                                    "actions": [{"op": "click", "role": "link", "name": names[0]}]})
                continue
            slot = target.page_id
            slots[page.page_id][slot] = names[:MAX_SLOT_VALUES]
            reached_by_slot[target.page_id] = slot
            transitions.append({"from": page.page_id, "to": target.page_id,
                                "actions": [{"op": "click", "role": "link", "name": f"{{{slot}}}"}]})
    spec_pages: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    taken = {slot for page_slots in slots.values() for slot in page_slots}  # a slot's name is one across the spec
    for key, page in pages.items():
        described = "".join([f"The page '{page.title}'",
                             f", with the fields {', '.join(page.fields)}" if page.fields else "",
                             f" and the buttons {', '.join(page.buttons)}" if page.buttons else "", "."])
        entry: dict[str, Any] = {"url": page.path, "description": described,
                                 "purpose": "TODO: what a user comes to this page to do."}
        inputs = _input_slots(page.page_id, page.fields, taken)
        taken |= set(inputs)
        if slots.get(page.page_id) or inputs:
            entry["slots"] = {**slots.get(page.page_id, {}), **inputs}
        if page is not start:
            check = f"on_{page.page_id}"
            slot = reached_by_slot.get(page.page_id)
            path_re = re.escape(key).replace(re.escape("{n}"), r"\d+").replace(re.escape("{item}"), "[^/?#]+")
            where = {"url": path_re + r"(\?|#|$)"}
            checks[check] = {"all": [where, {"element": {"name_contains": f"{{{slot}}}"}}]} if slot else where
            entry["goal"] = {"checker": check, "params": {slot: f"{{{slot}}}"} if slot else {},
                             "instruction": f"Open '{{{slot}}}'" if slot else f"Go to the page '{page.title}'"}
        spec_pages[page.page_id] = entry
    return {"app": name, "title": start.title or name,
            "serve": {"base_url": origin}, "reset": "context", "checks": checks, "start": start.page_id,
            "pages": spec_pages, "transitions": transitions}


HEADER = """\
# A draft by `trajforge apps init` ({url}, {pages} pages). Edit it, then check it against
# the live app with `trajforge apps check DIR`. What to do (README "Your own app"):
# - describe each page and its purpose;
# - the goals here only open pages (their checks read the final URL): add the tasks that
#   change the app's state, with their form transitions (op: type, check, click on a button)
#   and slots (each field seen has a slot: replace its TODO with values the app accepts),
#   and check them through the app's JSON (state: and http checks);
# - serve: give command and url instead of base_url to have trajforge start the app;
#   reset: a URL or command that puts the app back in its initial state, if a fresh
#   browser context does not.
"""


def write_draft(draft: dict[str, Any], out: Path, url: str) -> Path:
    """Write the draft as `out`/spec.yaml (the folder is created; an existing spec is not overwritten)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "spec.yaml"
    if path.exists():
        raise FileExistsError(f"{path} exists; give another --out, or remove it")
    body = yaml.safe_dump(draft, sort_keys=False, allow_unicode=True, width=120)
    path.write_text(HEADER.format(url=url, pages=len(draft["pages"])) + body)
    return path

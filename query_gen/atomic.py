"""Atomic-operation queries (paper 6.2): one operation on a real element of a real page.

A page-graph query says where to go; an atomic one says what to do with the mouse or
keyboard once there: click, double-click a word, right-click, drag a card onto another,
select a passage by dragging across it, type into an empty field, scroll an element into
view. Every element comes from a live page, not from the spec: the generator opens the
app's crawlable pages in a real browser (the start page, and the pages reached from it
by link transitions, with their slot values), reads the accessibility tree with its
boxes, and keeps only elements the replay policy can find again by role and name (text
outside any nameable element is role "text", named by its text). The checker is the
shared `interaction` checker, which reads what the page's recorder reported to the app
server, so success is the operation done on that element, not a screenshot.

The action space decides which ops are asked for: the mobile space cannot double-click,
right-click or drag (query_gen.operations.SPACE_OPS), so it gets none of those.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

from playwright.sync_api import Error as PlaywrightError

from trajforge.envs.apps import INTERACTION_CHECKER
from trajforge.envs.axtree import AXNode
from trajforge.envs.browser import Box, BrowserEnv, EnvFault
from trajforge.envs.locate import MAX_SCROLLS, find_boxes, passage_boxes
from trajforge.envs.operations import SPACE_OPS, Operation, OpKind, dump_operations
from trajforge.envs.secrets import PLACEHOLDER
from trajforge.envs.spec import AppSpec, placeholders
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Query

GENERATOR = "atomic@1"

NAMEABLE = {"link", "button", "checkbox", "radio", "switch", "textbox", "searchbox", "spinbutton", "slider",
            "combobox", "tab", "menuitem", "option", "heading", "image"}
"""Roles that name the text inside them: the recorder (envs/apps/_shared/static/interactions.js)
reports text inside one of these as that element, so only text outside them is role "text"."""

CLICKABLE = ("link", "button")
FIELDS = ("textbox", "searchbox")
SCROLL_TARGETS = ("link", "button", "heading", "textbox", "searchbox", "checkbox", "radio", "switch")
PER_PAGE = 3
"""Candidates verified on the live page per op kind and page: enough to sample from, few
enough that a page costs a few dozen lookups, not hundreds."""

_WORD = re.compile(r"[A-Za-z]{4,}")
_PUNCTUATION = ".,;:!?()\"'“”‘’"


@dataclass(frozen=True)
class AxItem:
    """A node of the accessibility tree that has a box: role, name, value, box, and whether
    a nameable element holds it."""

    role: str
    name: str
    value: str
    box: Box
    in_nameable: bool


@dataclass(frozen=True)
class Route:
    """A crawlable page: the page path from the start, its slot values, and the links the
    path clicks (one per transition)."""

    path: tuple[str, ...]
    slots: tuple[tuple[str, str], ...]
    links: tuple[str, ...]


@dataclass(frozen=True)
class _Candidate:
    route: Route
    operation: Operation
    scrolls: int
    """Scrolls the replay needs to bring the element into view (from its box at load)."""
    page: str
    """The page's path and query, as the recorder reports it: where the operation must be done."""


@dataclass
class AtomicQueries:
    """The queries, and what was skipped and why (reason -> count)."""

    queries: list[Query]
    skipped: Counter[str] = field(default_factory=Counter)
    pages: int = 0
    """Pages opened."""


def ax_items(nodes: Iterable[AXNode]) -> list[AxItem]:
    """The nodes (an observation's, in document order) that have a box, as items."""
    items: list[AxItem] = []
    stack: list[tuple[int, bool]] = []  # (depth, nameable) of the ancestors of the next node
    for node in nodes:
        while stack and stack[-1][0] >= node.depth:
            stack.pop()
        if node.box is not None:
            items.append(AxItem(node.role, node.name, node.value, node.box, any(nameable for _, nameable in stack)))
        stack.append((node.depth, node.role in NAMEABLE))
    return items


def crawlable_routes(spec: AppSpec) -> list[Route]:
    """The start page and every page reached from it by transitions that only click links,
    once per combination of the slot values those links name."""
    graph = spec.graph()
    values = spec.slot_values()
    routes: list[Route] = []
    frontier = [Route((spec.start,), (), ())]
    while frontier:
        route = frontier.pop(0)
        routes.append(route)
        for target in sorted(graph.successors(route.path[-1])):
            actions = graph.edges[route.path[-1], target]["transition"].actions
            if not all(a.op == "click" and a.role == "link" and a.name for a in actions):
                continue
            names = [a.name or "" for a in actions]
            chosen = dict(route.slots)
            free = sorted({s for n in names for s in placeholders(n)} - chosen.keys())
            for combo in itertools.product(*(values[s] for s in free)):
                slots = {**chosen, **dict(zip(free, combo))}
                links = tuple(n.format_map(slots) for n in names)
                frontier.append(Route((*route.path, target), tuple(sorted(slots.items())), route.links + links))
    return routes


def _short(text: str, words: int = 6) -> str:
    parts = text.split()
    return " ".join(parts[:words]) + ("…" if len(parts) > words else "")


_ROLE_WORDS = {"textbox": "text box", "searchbox": "search box", "text": "text"}


def instruction(route: Route, op: Operation) -> str:
    """The task in words, from a template per op; the links to follow first, when there are any."""
    what = f"the {_ROLE_WORDS.get(op.role, op.role)} '{op.name if op.role != 'text' else _short(op.name)}'"
    if op.op == "click":
        task = f"click {what}"
    elif op.op == "right_click":
        task = f"right-click {what}"
    elif op.op == "double_click":
        task = f"double-click the word '{op.text}' in {what}"
    elif op.op == "select_text":
        task = f"select the words '{op.text}' in {what} by dragging across them"
    elif op.op == "type_at":
        task = f"type '{op.text}' into {what}"
    elif op.op == "scroll_to":
        task = f"scroll until {what} is in view, without clicking it"
    else:
        task = f"drag {what} onto the {op.to_role} '{op.to_name}'"
    if not route.links:
        return task[0].upper() + task[1:]
    follow = " then ".join(f"'{link}'" for link in route.links)
    return f"Follow the link{'s' if len(route.links) > 1 else ''} {follow}, and there {task}"


def query_id(app: str, route: Route, op: Operation) -> str:
    """Deterministic: the same operation on the same page is the same query, run after run."""
    payload = json.dumps([app, route.path, dict(route.slots), op.model_dump(exclude_none=True)], sort_keys=True)
    return digest(payload)


def _scrolls(box: Box, height: int) -> int:
    """How many of the replay's scrolls (at most 60% of a screen each) bring the box into view."""
    bottom = box[1] + box[3]
    return max(0, math.ceil((bottom - height) / (0.6 * height)))


class _Page:
    """One opened page: its tree, and lookups on the live page that the replay will repeat."""

    def __init__(self, env: BrowserEnv, route: Route, rng: random.Random, fields_text: list[str]) -> None:
        self.env, self.route, self.rng, self.fields_text = env, route, rng, fields_text
        obs = env.observe()
        self.width, self.height = obs.width, obs.height
        here = urlsplit(env.url)
        self.page = here.path + (f"?{here.query}" if here.query else "")
        self.items = ax_items(obs.nodes)
        self.rejected: Counter[str] = Counter()

    def _unique(self, role: str, name: str) -> bool:
        return len(find_boxes(self.env, role, name)) == 1

    def _password(self, role: str, name: str) -> bool:
        field = self.env.page.get_by_role(role, name=name, exact=True)
        return bool(field.evaluate("e => e.type === 'password'"))

    def _pick(self, op: OpKind, options: list[tuple[Operation, Box]]) -> list[_Candidate]:
        """Up to PER_PAGE of `options`, in seeded order, whose elements the replay finds again."""
        self.rng.shuffle(options)
        kept: list[_Candidate] = []
        for operation, box in options:
            if len(kept) == PER_PAGE:
                break
            ok = self._unique(operation.role, operation.name)
            if ok and operation.op in ("double_click", "select_text"):
                ok = passage_boxes(self.env, operation.role, operation.name, operation.text or "") is not None
            if ok and operation.op == "drag":
                ok = self._unique(operation.to_role or "", operation.to_name or "")
            if ok and operation.op == "type_at" and self._password(operation.role, operation.name):
                # Its value is recorded as bullets only (a password never reaches the app's state), so a
                # check of what was typed there could not pass; and typing made-up text into it teaches nothing.
                self.rejected[f"{op}: a password field"] += 1
                continue
            if ok:
                kept.append(_Candidate(self.route, operation, _scrolls(box, self.height), self.page))
            else:
                self.rejected[f"{op}: element not found exactly once by role and name"] += 1
        return kept

    def candidates(self, op: OpKind) -> list[_Candidate]:
        named = [i for i in self.items if i.name]
        texts = [i for i in named if i.role == "text" and not i.in_nameable]
        options: list[tuple[Operation, Box]] = []
        if op in ("click", "right_click"):
            options = [(Operation(op=op, role=i.role, name=i.name), i.box) for i in named if i.role in CLICKABLE]
        elif op == "double_click":
            for i in texts:
                if len(i.name.split()) < 3:
                    continue  # "the word 'Title' in 'Title'" is a click on a label, not a word in a text
                tokens = [t.strip(_PUNCTUATION) for t in i.name.split()]
                words = [t for t in tokens if _WORD.fullmatch(t) and i.name.count(t) == 1]
                if words:
                    options.append((Operation(op=op, role="text", name=i.name, text=self.rng.choice(words)), i.box))
        elif op == "select_text":
            for i in texts:
                tokens = i.name.split()
                if len(tokens) < 4:
                    continue
                size = self.rng.randint(2, min(4, len(tokens) - 1))
                start = self.rng.randrange(len(tokens) - size + 1)
                passage = " ".join(tokens[start:start + size]).rstrip(_PUNCTUATION)
                if i.name.count(passage) == 1:
                    options.append((Operation(op=op, role="text", name=i.name, text=passage), i.box))
        elif op == "type_at":
            options = [(Operation(op=op, role=i.role, name=i.name, text=self.rng.choice(self.fields_text)), i.box)
                       for i in named if i.role in FIELDS and not i.value]
        elif op == "scroll_to":
            options = [(Operation(op=op, role=i.role, name=i.name), i.box) for i in named
                       if i.role in SCROLL_TARGETS and i.box[1] >= self.height and i.box[3] <= self.height / 2]
        elif op == "drag":
            options = self._drags(named)
        candidates = self._pick(op, options)
        if op == "scroll_to":  # the replay gives up after MAX_SCROLLS
            candidates = [c for c in candidates if c.scrolls <= MAX_SCROLLS]
        return candidates

    def _drags(self, named: list[AxItem]) -> list[tuple[Operation, Box]]:
        """Pairs of draggable elements (draggable="true") of one list, both on the first
        screen, so one drag reaches from one to the other."""
        groups = self.env.page.evaluate("""() => {
            const lists = new Map();
            for (const el of document.querySelectorAll('[draggable="true"]')) {
              const list = el.closest("ul, ol") || document.body;
              const r = el.getBoundingClientRect();
              if (!lists.has(list)) lists.set(list, []);
              lists.get(list).push([r.x, r.y, r.width, r.height]);
            }
            return [...lists.values()];
        }""")
        on_screen = [i for i in named if i.role in NAMEABLE and i.box[1] >= 0 and i.box[1] + i.box[3] <= self.height]
        options: list[tuple[Operation, Box]] = []
        for group in groups:
            items = [i for i in on_screen if any(_same_box(i.box, (b[0], b[1], b[2], b[3])) for b in group)]
            for source, target in itertools.permutations(items, 2):
                options.append((Operation(op="drag", role=source.role, name=source.name, to_role=target.role,
                                          to_name=target.name), source.box))
        return options


def _same_box(a: Box, b: Box) -> bool:
    return all(abs(x - y) <= 1.5 for x, y in zip(a, b))


def _open(env: BrowserEnv, base_url: str, spec: AppSpec, route: Route) -> str | None:
    """Open the route's page: the start page, then a click on each of its links; why not, or None."""
    env.reset(secrets.token_hex(8), base_url.rstrip("/") + spec.pages[spec.start].url)
    page = env.page
    for link in route.links:
        try:
            element = page.get_by_role("link", name=link, exact=True)
            if element.count() != 1:
                return f"link {link!r} found {element.count()} times"
            element.click(timeout=env.timeout_s * 1000)
            page.wait_for_load_state()
        except PlaywrightError as exc:
            raise env.fault(exc, f"clicking link {link!r}") from exc
    return None


def atomic_queries(spec: AppSpec, base_url: str, env: BrowserEnv, *, n: int, seed: int, space: str, run_id: str,
                   now: datetime, margin: int, ops: tuple[OpKind, ...] | None = None,
                   max_pages: int = 6) -> AtomicQueries:
    """Up to `n` atomic-operation queries for the app of `spec`, served at `base_url`, found through `env` (whose
    pages run the interaction recorder: a bundled app's, or the one `envs.appdir` installs).

    `space` ('mobile' or 'desktop') limits the ops to those it can express, and `ops`
    further to the ones named. Pages are opened in a seeded order, the start page first,
    at most `max_pages` of them; the queries take the ops in turn (a seeded order), so a
    small `n` still spreads over the kinds. `max_steps` is the reference steps (link
    clicks, scrolls, the operation's actions, the final terminate) plus `margin`. What
    could not be had is counted in `skipped` under its reason.
    """
    if space not in SPACE_OPS:
        raise ValueError(f"space: unknown action space {space!r}; known: {', '.join(SPACE_OPS)}")
    wanted = [op for op in SPACE_OPS[space] if ops is None or op in ops]
    out = AtomicQueries([])
    for op in SPACE_OPS["desktop"]:
        if op not in SPACE_OPS[space] and (ops is None or op in ops):
            out.skipped[f"{spec.app}: {op}: the {space} action space cannot express it"] += 1
    if not wanted or n <= 0:
        return out
    rng = random.Random(f"{seed}:{spec.app}")
    routes = crawlable_routes(spec)
    routes = routes[:1] + rng.sample(routes[1:], min(len(routes) - 1, max_pages - 1))
    # A secret's placeholder is no text to make up: typed into a plain field (the account's Username) it would
    # put the password on the screen and in the app's state.
    fields_text = sorted({v for vs in spec.slot_values().values() for v in vs
                          if 2 < len(v) <= 40 and not PLACEHOLDER.search(v)})
    pool: dict[str, list[_Candidate]] = {op: [] for op in wanted}
    for route in routes:
        try:
            problem = _open(env, base_url, spec, route)
        except EnvFault as exc:
            problem = f"the browser could not open it: {exc}"
        out.pages += 1
        if problem is not None:
            out.skipped[f"{spec.app}: page {route.path[-1]!r} not reached: {problem}"] += 1
            continue
        page = _Page(env, route, rng, fields_text or ["hello"])
        for op in wanted:
            pool[op].extend(page.candidates(op))
        out.skipped.update({f"{spec.app}: {reason}": k for reason, k in page.rejected.items()})
    found = {op for op in wanted if pool[op]}
    for op in wanted:
        if op not in found:
            out.skipped[f"{spec.app}: {op}: no element for it on the pages opened"] += 1
    order = list(wanted)
    rng.shuffle(order)
    chosen: list[_Candidate] = []
    seen: set[str] = set()
    for op in itertools.cycle(order):
        if len(chosen) >= n or not any(pool.values()):
            break
        if pool[op]:
            candidate = pool[op].pop(rng.randrange(len(pool[op])))
            qid = query_id(spec.app, candidate.route, candidate.operation)
            if qid in seen:
                out.skipped[f"{spec.app}: {op}: the same operation on the same page found twice"] += 1
            else:
                seen.add(qid)
                chosen.append(candidate)
    if len(chosen) < n:
        out.skipped[f"{spec.app}: fewer candidates on the pages opened than asked for (atomic_per_app)"] += (
            n - len(chosen))
    out.queries = [_query(spec.app, c, run_id=run_id, now=now, margin=margin) for c in chosen]
    return out


_OP_STEPS = {"type_at": 2, "scroll_to": 0}


def operation_steps(op: OpKind) -> int:
    """Steps the reference replay takes for an op once its element is in view: a click then typing for type_at,
    nothing more than the scrolling for scroll_to, one action for every other op."""
    return _OP_STEPS.get(op, 1)


def _query(app: str, candidate: _Candidate, *, run_id: str, now: datetime, margin: int) -> Query:
    route, op = candidate.route, candidate.operation
    steps = len(route.links) + candidate.scrolls + operation_steps(op.op) + 1  # + terminate
    params = op.model_dump(exclude_none=True) | {"page": candidate.page}
    return Query(
        run_id=run_id,
        query_id=query_id(app, route, op),
        app=app,
        source="atomic",
        instruction=instruction(route, op),
        path=list(route.path),
        slots_json=json.dumps(dict(route.slots)),
        checker=INTERACTION_CHECKER,
        checker_params_json=json.dumps(params),
        max_steps=steps + margin,
        generator=GENERATOR,
        created_at=now,
        actions_json=dump_operations([op]),
    )

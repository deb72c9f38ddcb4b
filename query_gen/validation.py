"""Interface validation: is a query still doable on the app as it is today? (paper 6.2)

A spec is written once; the app changes (a dish is taken off the menu, a page is
renamed). Validation crawls the live app without an agent: for each page of a query's
path it reaches the page, and looks for the elements that the outgoing transition's UI
actions name (role, and name with slots filled). A query whose page does not load, or
whose element is gone or shown more than once (the replay acts only on an element it finds
exactly once), is dropped with the reason.

A page is reached the cheapest way that shows what the path would show:
- the start page, and a page entered by a link while nothing was driven on the way there
  (no form sent), by opening its `url` with the slot values filled in. A url that holds a
  slot and answers with an HTTP error has lost that slot value, and its queries are dropped;
- a page entered by a form (a button, Enter in a search box), or by a link after one, shows
  what was sent (the cart holds the dish, the search lists its results), which a fresh
  session opening its url does not have; so is a page whose fixed url does not load in a
  fresh session (it needs parameters the spec does not hold, `/message?id=...`) or whose
  url sends it elsewhere (a page behind a sign-in form redirects to it: a redirect says
  the page needs a session, not that a slot value is gone). These are reached by driving:
  the crawl reaches the previous page and does the transition's UI actions there, in one
  session as the replay does; so a search's result link is looked for on the results.

An atomic-operation or deep-search query's first operation (query_gen.operations) is
looked up on its last page like a transition's elements.

Each (page, way of reaching it) is visited once, whatever number of queries pass
through it, and all the elements any of them needs are looked up on that one visit.

A page the browser could not open (a timeout, a crash, the app not answering) says
nothing about the app, yet judged it would drop every query through it for the night
(the start page: all of them). It is tried once more, and a fault that stays is raised:
the shard fails and is run again, as the rollout reruns faults.
"""

from __future__ import annotations

import json
import string
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from secrets import token_hex
from urllib.parse import quote, urlsplit

from playwright.sync_api import Error as PlaywrightError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from trajforge.envs import secrets
from trajforge.envs.browser import BrowserEnv, EnvFault
from trajforge.envs.locate import find_boxes
from trajforge.envs.operations import parse_operations
from trajforge.envs.pool import map_envs
from trajforge.envs.spec import AppSpec, UIAction, placeholders
from trajforge.schemas.records import Query

Target = tuple[str, str]
"""An element to look for: (role, accessible name with slots filled)."""


def fill(template: str, slots: dict[str, str], *, url: bool = False) -> str:
    """`template` with its {slot}s filled; in a url the values are percent-encoded as the apps do."""
    values = {k: quote(v) if url else v for k, v in slots.items()}
    return string.Formatter().vformat(template, (), values)


def _targets(actions: list[UIAction], slots: dict[str, str]) -> tuple[Target, ...]:
    """The transition's targeted elements up to its first `press` (which leaves the page); those after it are
    looked for as the next page is driven through them."""
    targets: list[Target] = []
    for action in actions:
        if action.op == "press":
            break
        if action.role and action.name:
            targets.append((action.role, fill(action.name, slots)))
    return tuple(targets)


def _operation_targets(query: Query) -> tuple[Target, ...]:
    """The elements the query's first operation needs on its last page (an atomic query's
    element and drop target, a deep-search pathway's first click); what later operations
    of a pathway need appears only after the first, and is left to the rollout."""
    operations = parse_operations(query.actions_json)
    if not operations:
        return ()
    first = operations[0]
    targets = [(first.role, first.name)]
    if first.to_role and first.to_name:
        targets.append((first.to_role, first.to_name))
    return tuple(targets)


def _by_link(actions: list[UIAction]) -> bool:
    """Whether a transition ends in a plain navigation, so its target page is what its URL shows."""
    last = actions[-1]
    return last.op == "click" and last.role == "link"


Filled = tuple[str, str | None, str | None, str | None]
"""A UI action with its slots filled: (op, role, name, text)."""

Route = tuple[str, tuple[Filled, ...]]
"""How the crawl reaches a page: the url it opens, then the UI actions it does there."""


@dataclass(frozen=True)
class _Step:
    """One page of a query's path as the crawl sees it."""

    page: str
    route: Route | None
    """None: the page's url holds slots and does not load (`error` says why)."""
    error: str | None
    targets: tuple[Target, ...]
    """The elements the outgoing transition needs on this page."""
    url_note: str = ""
    """Why the page was driven to although a link enters it: its own url does not load."""


@dataclass
class PageVisit:
    """What one visit of a page found: why it did not load (None: it did), and how many visible elements each
    target names (the replay acts only on a target found exactly once)."""

    load_error: str | None = None
    found: dict[Target, int] = field(default_factory=dict)


def _times(role: str | None, name: str | None, count: int) -> str | None:
    """Why `count` matches of an element would stop the replay ("cannot go on"), or None for the one match it
    needs: it finds none, or several it cannot tell apart."""
    if count == 1:
        return None
    return f"{role} {name!r} " + ("not found" if count == 0 else f"found {count} times")


@dataclass
class ValidationResult:
    kept: list[Query]
    dropped: Counter[str]
    reasons: dict[str, str]
    """query_id -> why it was dropped."""
    driven: Counter[str]
    """'app page' -> steps of queries reached by driving the previous page's form, not by url."""
    visits: int
    """Pages opened: at most one per (page, filled url)."""


class InterfaceValidator:
    """Validates queries of one app against its live server through browser envs.

    `base_url` is the app server's origin (AppServer.base_url); `envs` one BrowserEnv or
    several (contexts of one browser) that the validator may reset as it likes: with
    several, the pages are visited in parallel, one per env.
    """

    def __init__(self, spec: AppSpec, base_url: str, envs: BrowserEnv | Sequence[BrowserEnv], *,
                 timeout_s: float = 10.0) -> None:
        self.spec = spec
        self.base_url = base_url.rstrip("/")
        self.envs = list(envs) if isinstance(envs, Sequence) else [envs]
        self.timeout_s = timeout_s
        self.graph = spec.graph()
        self.cache: dict[tuple[str, Route], PageVisit] = {}
        self._statuses: dict[str, str | None] = {}

    def _plan(self, query: Query) -> list[_Step]:
        """The query's path as steps of the crawl; a page the spec lacks is the caller's error."""
        slots = json.loads(query.slots_json)
        steps: list[_Step] = []
        for i, page_id in enumerate(query.path):
            if page_id not in self.spec.pages:
                raise ValueError(f"query {query.query_id}: path[{i}] names page {page_id!r}, "
                                 f"which app spec {self.spec.app!r} does not have")
            page = self.spec.pages[page_id]
            url = fill(page.url, slots, url=True)
            if i + 1 < len(query.path):
                targets = _targets(self.graph.edges[page_id, query.path[i + 1]]["transition"].actions, slots)
            else:
                targets = _operation_targets(query)
            previous = steps[-1].route if steps else None
            actions = self.graph.edges[query.path[i - 1], page_id]["transition"].actions if i else []
            # Once the crawl drove a step (a form sent on the way, a page only a click reaches), or this
            # transition sends a form before its link (a search's Enter), the page shows that session's
            # state (what was added, what was found): the session goes on, it is driven.
            in_session = previous is not None and (bool(previous[1]) or any(a.op == "press" for a in actions))
            by_url = i == 0 or (_by_link(actions) and not in_session)
            load_error = self._status(url) if by_url else None
            route: Route | None = (url, ())
            error = None
            # Only an HTTP error says the slot value is gone; a redirect says the page needs a session.
            if load_error is not None and load_error.startswith("HTTP") and placeholders(page.url):
                route, error = None, f"page {page_id!r} {url}: does not load ({load_error})"
            elif not by_url or load_error is not None:
                if previous is None:  # the start page's fixed url does not load: nothing to drive from
                    route, error = None, f"page {page_id!r} {url}: does not load ({load_error})"
                else:
                    route = (previous[0], previous[1] + tuple(_filled(a, slots) for a in actions))
            note = f" (its url {url}: {load_error})" if by_url and load_error and route else ""
            steps.append(_Step(page_id, route, error, targets, note))
        return steps

    def _status(self, url: str) -> str | None:
        """Why the page does not load (HTTP status or connection error), or None; asked once per url."""
        if url not in self._statuses:
            self._statuses[url] = self._fetch_status(url)
        return self._statuses[url]

    def _fetch_status(self, url: str) -> str | None:
        """The app's answer; an app that does not answer (tried twice) is a fault of the environment."""
        twice = Retrying(stop=stop_after_attempt(2), retry=retry_if_exception_type(OSError), reraise=True)
        try:
            return twice(self._answer, url)
        except OSError as exc:  # no answer at all: refused, reset, timed out (URLError is one)
            raise EnvFault(f"interface validation of {self.spec.app}: {url} cannot be reached: {exc}",
                           "app_down") from exc

    def _answer(self, url: str) -> str | None:
        """Why the page at `url` is not what it shows (an HTTP error, a redirect), or None; OSError where the app
        does not answer."""
        try:
            with urllib.request.urlopen(self.base_url + url, timeout=self.timeout_s) as response:
                if response.status >= 400:
                    return f"HTTP {response.status}"
                # A page that sends a fresh session elsewhere (to a sign-in form) is not what its url shows.
                landed = urlsplit(response.geturl()).path
                return None if landed == urlsplit(self.base_url + url).path else f"redirected to {landed}"
        except urllib.error.HTTPError as exc:  # an answer, though an OSError
            return f"HTTP {exc.code}"

    def _visit(self, env: BrowserEnv, page: str, route: Route, targets: set[Target]) -> PageVisit:
        """The page's visit, tried once more after a fault; a fault that stays is raised (module docstring)."""
        try:
            return self._look(env, route, targets)
        except EnvFault:
            pass  # the env opens a new context at its next reset
        try:
            return self._look(env, route, targets)
        except EnvFault as exc:
            raise EnvFault(f"interface validation of {self.spec.app} page {page!r} {route[0]}: {exc}",
                           exc.kind) from exc

    def _look(self, env: BrowserEnv, route: Route, targets: set[Target]) -> PageVisit:
        url, actions = route
        env.reset(token_hex(8), self.base_url + url)
        for op, role, name, text in actions:
            problem = self._do(env, op, role, name, text)
            if problem is not None:
                return PageVisit(load_error=f"could not be reached from {url}: {problem}")
        # find_boxes, not env.find_element: an atomic query's element may be role "text"
        # (a passage to select), which no ARIA role lookup finds.
        return PageVisit(found={(role, name): len(find_boxes(env, role, name)) for role, name in sorted(targets)})

    def _do(self, env: BrowserEnv, op: str, role: str | None, name: str | None, text: str | None) -> str | None:
        """Do one UI action on the live page; why it could not be done, or None.

        Clicks and keys go through the env's own actions, which wait for a navigation
        they start; filling a field or setting a box starts none, so a locator does it.
        """
        if op == "press":
            return env.act({"type": "key", "key": text})
        page = env.page
        element = page.get_by_role(role, name=name, exact=True)
        try:
            if problem := _times(role, name, element.count()):
                return problem
            timeout = self.timeout_s * 1000
            if op == "type":
                if unset := secrets.unset(text or ""):
                    return unset
                element.fill(secrets.reveal(text or ""), timeout=timeout)
                return None
            if op != "click":  # check, uncheck, set_checked
                element.set_checked(op == "check" or text == "on", timeout=timeout)
                return None
            element.scroll_into_view_if_needed(timeout=timeout)
        except PlaywrightError as exc:
            raise env.fault(exc, f"{op} {role} {name!r}") from exc
        boxes = env.find_element(role, name)
        if len(boxes) != 1:  # the one element has no box: hidden, or drawn with no size
            return f"{role} {name!r} has no visible box to click"
        x, y, w, h = boxes[0]
        return env.act({"type": "click", "x": round(x + w / 2), "y": round(y + h / 2)})

    def validate(self, queries: list[Query]) -> ValidationResult:
        """Keep the queries whose pages load and whose elements exist; drop the rest with the reason."""
        plans = {q.query_id: self._plan(q) for q in queries}
        needed: dict[tuple[str, Route], set[Target]] = {}
        for plan in plans.values():
            for step in plan:
                if step.route is not None:
                    needed.setdefault((step.page, step.route), set()).update(step.targets)
        todo: dict[tuple[str, Route], set[Target]] = {}  # (page, route) -> the elements to look up there
        for key, targets in needed.items():
            known = self.cache.get(key)
            if known is None or (known.load_error is None and not targets <= known.found.keys()):
                todo[key] = targets | (known.found.keys() if known else set())
        found = map_envs(self.envs, lambda env, key: self._visit(env, *key, todo[key]), list(todo))
        self.cache.update(zip(todo, found))
        result = ValidationResult([], Counter(), {}, Counter(), len(todo))
        for query in queries:
            reason = self._verdict(plans[query.query_id], result.driven)
            if reason is None:
                result.kept.append(query)
            else:
                result.reasons[query.query_id] = reason
                result.dropped[f"{query.app}: interface validation: {reason}"] += 1
        return result

    def _verdict(self, plan: list[_Step], driven: Counter[str]) -> str | None:
        for step in plan:
            if step.route is None:
                return step.error
            if step.route[1]:
                driven[f"{self.spec.app} {step.page}"] += 1
            visit = self.cache[(step.page, step.route)]
            if visit.load_error is not None:
                return f"page {step.page!r}: {visit.load_error}{step.url_note}"
            for role, name in step.targets:
                if problem := _times(role, name, visit.found[(role, name)]):
                    return f"page {step.page!r} {step.route[0]}: {problem}{step.url_note}"
        return None


def _filled(action: UIAction, slots: dict[str, str]) -> Filled:
    return (action.op, action.role, fill(action.name, slots) if action.name else None,
            fill(action.text, slots) if action.text is not None else None)

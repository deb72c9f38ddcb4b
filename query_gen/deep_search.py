"""Deep-search queries (paper 6.2, Computer): operational pathways found on the live app.

Desktop software hides most of what it can do behind menus, submenus, dialogs and tabs,
and nobody writes a page graph for all of them. The search walks them instead, over the
accessibility tree of the live page: a node is a pathway (clicks by role and name from
the start page). Expanding a node resets the browser onto the start page in a fresh
session, so every branch starts from the same known state, replays the pathway
(operational-pathway memory) and checks that it reached the node's screen again, then
clicks, one at a time and replaying before each, every control that was not on the
parent's screen. A click that opened something (a menu, a dialog, a tab panel, another
page) is a child; a menu item that just closed its menu ran a command and is a leaf.
Screens already seen (same tree, boxes and focus aside) are not expanded twice.

A model then says whether each endpoint acts on an object the user must select first
(the paper's example: a font size needs selected text), and writes the command for the
pathway; an answer that does not parse is recorded and the template command stands.
Queries are made for the endpoints a checker can see, the dialogs and tab panels (a bundled
app reports them to its server; on a user's app they are read from the final accessibility
tree); the rest are counted with the reason.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from itertools import count
from typing import Literal

from pydantic import BaseModel, Field

from trajforge.envs.appdir import SURFACE_CHECKER
from trajforge.envs.axtree import AXNode, render
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.envs.operations import Operation, dump_operations
from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway, Prompt, Sampling, load_prompt
from trajforge.query_gen.atomic import operation_steps
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Query

CLICK_ROLES = ("menuitem", "menuitemcheckbox", "menuitemradio", "tab", "button", "link")
"""Controls the search clicks. Text boxes, checkboxes and radios change values, not places."""

SELECTION_PROMPT = "deep_search_selection"
COMMAND_PROMPT = "deep_search_command"
TEMPLATE_GENERATOR = "deep_search_template@1"
CHECKABLE_KINDS = ("dialog", "tabpanel")
"""Endpoints `surface_opened` can check: a bundled app reports them to its server (see envs.apps.writer), a user's
app shows them in the final accessibility tree (envs.appdir)."""

EndpointKind = Literal["menu", "dialog", "tabpanel", "page", "command"]


@dataclass(frozen=True)
class Screen:
    """What the search keeps of one observation: enough to compare two screens."""

    url: str
    title: str
    nodes: tuple[AXNode, ...]
    """The tree without boxes and focus: what a screen is, wherever it is scrolled or focused."""

    @classmethod
    def of(cls, obs: Observation) -> Screen:
        nodes = tuple(replace(n, box=None, states=tuple(s for s in n.states if s != "focused")) for n in obs.nodes)
        return cls(obs.url, obs.title, nodes)

    @property
    def signature(self) -> str:
        return hashlib.sha256("\n".join((self.url, render(self.nodes))).encode()).hexdigest()

    def named(self, *roles: str) -> list[tuple[str, str]]:
        """(role, name) of the named elements with one of `roles`, in document order, each once."""
        return list(dict.fromkeys((n.role, n.name) for n in self.nodes if n.role in roles and n.name))

    def texts(self) -> list[str]:
        return [name for _, name in self.named("text")]


@dataclass(frozen=True)
class Pathway:
    """Clicks from the start page to an endpoint, and what the last click opened.

    `trail` names what each click opened (menus, dialogs, tab panels, pages, the command);
    `shown` is the text the endpoint's screen showed that its parent's did not (a dialog's
    words, or a command's "Select some text first."): what a model reads of the endpoint.
    """

    operations: tuple[Operation, ...]
    kind: EndpointKind
    surface: str
    trail: tuple[str, ...]
    shown: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The pathway as people write it: "File > Export > PDF…"."""
        return " > ".join(op.name for op in self.operations)


@dataclass
class SearchResult:
    start: Screen
    pathways: list[Pathway]
    stats: Counter[str] = field(default_factory=Counter)
    """Clicks made, and children not kept with the reason (duplicate screen, nothing opened...)."""


def _outcome(before: Screen, after: Screen, clicked: tuple[str, str]) -> tuple[EndpointKind, str] | None:
    """What a click opened, judged by comparing the screens; None when nothing a person would call a place."""
    if after.url != before.url:
        return "page", after.title
    for kind, roles in (("dialog", ("dialog", "alertdialog")), ("tabpanel", ("tabpanel",)), ("menu", ("menu",))):
        new = [name for role, name in after.named(*roles) if (role, name) not in before.named(*roles)]
        if new:
            return kind, new[0]  # type: ignore[return-value]
    menus_before = before.named("menu")
    if clicked[0].startswith("menuitem") and menus_before and not set(menus_before) & set(after.named("menu")):
        return "command", clicked[1]
    return None


class DeepSearch:
    """A breadth-first search of an app's pathways through one browser env (desktop viewport).

    `max_depth` bounds a pathway's clicks, `max_nodes` the pathways kept; each expansion
    costs one reset and replay per control it clicks.
    """

    def __init__(self, env: BrowserEnv, start_url: str, *, max_depth: int = 4, max_nodes: int = 200,
                 roles: tuple[str, ...] = CLICK_ROLES, session_prefix: str = "deep-search") -> None:
        self.env, self.start_url = env, start_url
        self.max_depth, self.max_nodes, self.roles = max_depth, max_nodes, roles
        self._sessions = (f"{session_prefix}-{i}" for i in count())

    def replay(self, operations: tuple[Operation, ...] | list[Operation]) -> Screen:
        """The start page in a fresh session, then each click of `operations`; raises LookupError
        naming the first operation whose element is not on the page exactly once."""
        self.env.reset(next(self._sessions), self.start_url)
        for i, op in enumerate(operations, 1):
            self._click(op, f"operation {i}/{len(operations)}")
        return Screen.of(self.env.observe())

    def _click(self, op: Operation, where: str) -> None:
        if op.op != "click":
            raise ValueError(f"{where}: a pathway is clicks, got op {op.op!r}")
        boxes = self.env.find_element(op.role, op.name)
        if len(boxes) != 1:
            raise LookupError(f"{where}: expected one {op.role} {op.name!r} on {self.env.url}, found {len(boxes)}")
        x, y, w, h = boxes[0]
        error = self.env.act({"type": "click", "x": round(x + w / 2), "y": round(y + h / 2)})
        if error:
            raise LookupError(f"{where}: clicking {op.role} {op.name!r} failed: {error}")

    def run(self) -> SearchResult:
        """Every pathway from the start page within the budgets, shortest first."""
        root = self.replay(())
        result = SearchResult(root, [])
        seen = {root.signature}
        # A frontier entry: the pathway, its screen, its parent's screen, its trail.
        frontier: deque[tuple[tuple[Operation, ...], Screen, Screen | None, tuple[str, ...]]] = deque(
            [((), root, None, ())])
        while frontier:
            ops, screen, parent, trail = frontier.popleft()
            if len(ops) >= self.max_depth:
                result.stats["not expanded: max_depth"] += 1
                continue
            old = set(parent.named(*self.roles)) if parent else set()
            for role, name in (c for c in screen.named(*self.roles) if c not in old):
                if len(result.pathways) >= self.max_nodes:
                    result.stats["not clicked: max_nodes"] += 1
                    continue
                click = Operation(op="click", role=role, name=name)
                try:
                    again = self.replay(ops)
                    if again.signature != screen.signature:
                        result.stats["not clicked: replay reached another screen"] += 1
                        continue
                    self._click(click, "the new control")
                except LookupError:
                    result.stats["not clicked: element not found once"] += 1
                    continue
                result.stats["clicks"] += 1
                after = Screen.of(self.env.observe())
                outcome = _outcome(screen, after, (role, name))
                if outcome is None:
                    result.stats["not kept: nothing opened"] += 1
                    continue
                kind, surface = outcome
                if kind != "command":  # a command is a leaf; its screen is no place to go on from
                    if after.signature in seen:
                        result.stats["not kept: screen seen before"] += 1
                        continue
                    seen.add(after.signature)
                pathway = Pathway((*ops, click), kind, surface, (*trail, surface),
                                  tuple(t for t in after.texts() if t not in screen.texts()))
                result.pathways.append(pathway)
                if kind != "command":
                    frontier.append((pathway.operations, after, screen, pathway.trail))
        return result


# --- the model's part: selection decisions and commands ----------------------------------


class SelectionAnswer(BaseModel):
    needs_selection: bool
    reason: str = Field(min_length=1)


class CommandAnswer(BaseModel):
    instruction: str = Field(min_length=1)


def endpoint_phrase(pathway: Pathway) -> str:
    """What the pathway opens, in words: 'the dialog "Page setup"', 'the tab "Editing" of "Preferences"'."""
    if pathway.kind == "tabpanel" and len(pathway.trail) > 1:
        return f'the tab "{pathway.surface}" of "{pathway.trail[-2]}"'
    return f'the {pathway.kind} "{pathway.surface}"'


def template_command(pathway: Pathway) -> str:
    """The command when no model writes one: correct, plain, the same shape every time."""
    if pathway.kind == "tabpanel" and len(pathway.trail) > 1:
        return f'Open the "{pathway.surface}" tab of {pathway.trail[-2]}'
    return f'Open the "{pathway.surface}" {pathway.kind}'


def _selecting(operation: Operation) -> str:
    return f'the {operation.role} "{operation.name}"' + (f' text "{operation.text}"' if operation.text else "")


@dataclass(frozen=True)
class Command:
    """The command for one pathway, what wrote it, and the model's selection decision.

    `needs_selection` is None when no model was asked or its answer did not parse;
    `failures` says which answers were refused and why (their raw text is in `raw`).
    """

    instruction: str
    generator: str
    needs_selection: bool | None
    selection_reason: str
    model_id: str | None
    failures: tuple[str, ...]
    raw: tuple[str, ...]


class Commander:
    """Asks one model of a gateway whether endpoints need a selection, and for their commands.

    `sampling` overrides the templates' decoding (a seed for a second sample, a cap on tokens).
    """

    def __init__(self, gateway: Gateway, model: str | None = None, sampling: Sampling | None = None) -> None:
        self.gateway, self.model, self.sampling = gateway, model, sampling
        self.selection: Prompt = load_prompt(SELECTION_PROMPT)
        self.command: Prompt = load_prompt(COMMAND_PROMPT)

    @property
    def prompts(self) -> dict[str, str]:
        return {self.selection.name: self.selection.version, self.command.name: self.command.version}

    def generator(self, model_id: str) -> str:
        """The `Query.generator` of a model-written command: the model and both template versions."""
        return f"{model_id}+{self.selection.name}@{self.selection.version}+{self.command.name}@{self.command.version}"

    def __call__(self, app_title: str, page: str, pathway: Pathway, selection: Operation | None) -> Command:
        """Judge the endpoint, then write its command; a command that does not parse or does
        not name the endpoint leaves the template command, with the reason in `failures`.
        Without a parsed decision no command is asked for: the query cannot be made honestly."""
        options = {"model": self.model, "sampling": self.sampling}
        judged = self.gateway.chat_sync(
            self.selection.render(app=app_title, pathway=pathway.label, endpoint=endpoint_phrase(pathway),
                                  shown="; ".join(pathway.shown[:4])),
            schema=SelectionAnswer, **options)
        model_id = judged.record.model_id
        if judged.parsed is None:
            return Command(template_command(pathway), TEMPLATE_GENERATOR, None, "", model_id,
                           (f"selection decision did not parse: {judged.parse_error}",), (judged.text,))
        needs = judged.parsed.needs_selection
        written = self.gateway.chat_sync(
            self.command.render(app=app_title, page=page, pathway=pathway.label, endpoint=endpoint_phrase(pathway),
                                selection=_selecting(selection) if needs and selection else ""),
            schema=CommandAnswer, **options)
        raw = (judged.text, written.text)
        failure = None
        if written.parsed is None:
            failure = f"command did not parse: {written.parse_error}"
        elif pathway.surface.casefold() not in written.parsed.instruction.casefold():
            failure = f"command does not name {pathway.surface!r}"
        if failure:
            return Command(template_command(pathway), TEMPLATE_GENERATOR, needs, judged.parsed.reason, model_id,
                           (failure,), raw)
        assert written.parsed is not None
        return Command(written.parsed.instruction.strip(), self.generator(model_id), needs, judged.parsed.reason,
                       model_id, (), raw)


# --- query rows ---------------------------------------------------------------------------


@dataclass
class DeepSearchQueries:
    """Query rows of an app's pathways, with what the search and the model did on the way."""

    rows: list[Query]
    pathways: list[Pathway]
    dropped: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    models: dict[str, str] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)


def query_id_for(app: str, actions_json: str) -> str:
    """Deterministic: the same app and operations always give the same id, whatever wrote the command."""
    return digest(json.dumps([app, "deep_search", actions_json]))


def pathway_queries(app: str, start_page: str, result: SearchResult, *, run_id: str, app_title: str,
                    commander: Commander | None = None, selection: Operation | None = None,
                    step_margin: int = 3) -> DeepSearchQueries:
    """One query per pathway whose endpoint the `surface_opened` checker can read.

    `max_steps` is the replay's steps (each operation's actions, then the final terminate) plus `step_margin`,
    the steps allowed beyond them (`query_gen.step_budget_margin`).

    A pathway the model says needs a selected object starts with `selection`, the
    hand-annotated operation that selects one on the start page (paper 6.2 annotates such
    objects by hand); without one it is dropped with the reason. Without a `commander`
    no model is asked: the command is the template's and no selection is judged (the
    search reached the endpoint from a fresh session, with nothing selected).
    """
    out = DeepSearchQueries([], result.pathways, stats=Counter(result.stats))
    if commander is not None:
        out.prompts = commander.prompts
    now = datetime.now(timezone.utc)
    for pathway in result.pathways:
        if pathway.kind not in CHECKABLE_KINDS:
            out.dropped[f"{app}: {pathway.kind} endpoint: nothing the {SURFACE_CHECKER} checker can read"] += 1
            continue
        operations = list(pathway.operations)
        if commander is None:
            command = Command(template_command(pathway), TEMPLATE_GENERATOR, None, "", None, (), ())
        else:
            command = commander(app_title, result.start.title, pathway, selection)
            if command.model_id:
                out.models["deep_search_model"] = command.model_id
            for failure in command.failures:
                out.stats[f"{app}: model answer refused: {failure.split(':')[0]}"] += 1
            if command.needs_selection is None:
                out.dropped[f"{app}: selection decision did not parse"] += 1
                continue
            decision = "needs a selection" if command.needs_selection else "no selection needed"
            out.stats[f"{app}: model says: {decision}"] += 1
            if command.needs_selection:
                if selection is None:
                    out.dropped[f"{app}: needs a selected object; no selecting operation annotated"] += 1
                    continue
                operations.insert(0, selection)
        actions_json = dump_operations(operations)
        out.rows.append(Query(
            run_id=run_id, query_id=query_id_for(app, actions_json), app=app, source="deep_search",
            instruction=command.instruction, path=[start_page], slots_json="{}", checker=SURFACE_CHECKER,
            checker_params_json=json.dumps({"surface": pathway.surface}),
            max_steps=sum(operation_steps(op.op) for op in operations) + 1 + step_margin,  # + terminate
            generator=command.generator, created_at=now, actions_json=actions_json,
        ))
    return out


def deep_search_queries(spec: AppSpec, base_url: str, env: BrowserEnv, *, run_id: str,
                        commander: Commander | None = None, selection: Operation | None = None, max_depth: int = 4,
                        max_nodes: int = 200, step_margin: int = 3) -> DeepSearchQueries:
    """Search the pathways of the app served at `base_url` from its start page through `env` (desktop viewport;
    a kind's wrapped env, so a user's app resets as its directory says), and make its queries (`step_margin`:
    steps allowed beyond the replay's)."""
    start = base_url + spec.pages[spec.start].url
    result = DeepSearch(env, start, max_depth=max_depth, max_nodes=max_nodes,
                        session_prefix=f"deep-search-{spec.app}").run()
    return pathway_queries(spec.app, spec.start, result, run_id=run_id, app_title=spec.title,
                           commander=commander, selection=selection, step_margin=step_margin)

"""An app's page graph: the hand-annotated DAG of paper section 6.2.

Pages carry a description, a purpose and slot-value pairs (the choices a user can make
on that page); transitions carry the UI actions that move between pages, written
against accessible roles and names with `{slot}` placeholders, so one transition serves
every slot value and the replay policy can find the element on the live page. A page
with a `goal` ends a task: it names the checker that reads the app's state and the
instruction template of the task.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import networkx as nx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trajforge.schemas.config import read_yaml, yaml_problem


class SpecError(ValueError):
    """An app spec that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


CHECK_OPS = ("check", "uncheck", "set_checked")
"""Ops that leave a checkbox or switch in a given state, clicking only when it is not in it
already: "turn on X" must hold whatever X was, where a plain click would toggle it."""

CHECKABLE_ROLES = ("checkbox", "switch")
"""The roles a click both checks and unchecks (a radio cannot be unchecked by a click)."""


class UIAction(_Strict):
    """One UI operation of a transition, aimed at an element by accessible role and name.

    click, type, press: what they say. check and uncheck: make a checkbox or switch
    checked or unchecked. set_checked: the same with the state in `text`, "on" or "off",
    usually a slot ("{notifications}"), because one transition serves every slot value.
    """

    op: Literal["click", "type", "press", "check", "uncheck", "set_checked"]
    role: str | None = None
    name: str | None = Field(default=None, description="Accessible name; may hold {slot} placeholders.")
    text: str | None = Field(default=None, description="Text to type (op=type), key to press (op=press) or "
                                                       "state to set, on or off (op=set_checked).")

    @model_validator(mode="after")
    def _complete(self) -> UIAction:
        if self.op in ("click", "type", *CHECK_OPS) and not (self.role and self.name):
            raise ValueError(f"op {self.op!r} needs role and name")
        if self.op in ("type", "press", "set_checked") and self.text is None:
            raise ValueError(f"op {self.op!r} needs text")
        if self.op in CHECK_OPS and self.role not in CHECKABLE_ROLES:
            raise ValueError(f"op {self.op!r} needs role {' or '.join(CHECKABLE_ROLES)}, got {self.role!r}")
        if self.op in ("check", "uncheck") and self.text is not None:
            raise ValueError(f"op {self.op!r} takes no text (set_checked takes the state as text)")
        one_slot = re.fullmatch(r"\{\w+\}", self.text or "")
        if self.op == "set_checked" and self.text not in ("on", "off") and not one_slot:
            raise ValueError(f"op 'set_checked' needs text 'on', 'off' or one {{slot}}, got {self.text!r}")
        return self


class Goal(_Strict):
    """What makes a page the end of a task."""

    checker: str
    params: dict[str, str] = Field(default_factory=dict, description="Checker parameters; may hold {slot}.")
    instruction: str = Field(description="Template of the task's instruction, with {slot} placeholders.")


class Page(_Strict):
    url: str = Field(description="Path of the page on the app's server; may hold {slot}.")
    description: str
    purpose: str
    slots: dict[str, list[str]] = Field(default_factory=dict, description="Slot name -> possible values.")
    goal: Goal | None = None


class Transition(_Strict):
    source: str = Field(alias="from")
    target: str = Field(alias="to")
    actions: list[UIAction] = Field(min_length=1)


class AppSpec(_Strict):
    app: str
    title: str
    start: str
    pages: dict[str, Page]
    transitions: list[Transition]

    def slot_values(self) -> dict[str, list[str]]:
        """Every slot declared on any page (a slot name means one thing across the app)."""
        out: dict[str, list[str]] = {}
        for page in self.pages.values():
            out.update(page.slots)
        return out

    def graph(self) -> nx.DiGraph:
        """The page graph; each edge keeps its Transition under 'transition'."""
        g = nx.DiGraph()
        for page_id, page in self.pages.items():
            g.add_node(page_id, page=page)
        for t in self.transitions:
            g.add_edge(t.source, t.target, transition=t)
        return g

    def goal_pages(self) -> list[str]:
        return [p for p, page in self.pages.items() if page.goal is not None]


def placeholders(template: str) -> set[str]:
    """The {slot} names of a template; ValueError where it is no format string (a lone brace)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


BRACE_HINT = "a literal brace is written twice: {{ or }}"
SLOT_STAND_IN = "x"
"""What fills each {slot} of a template read at load time: it must fill as `str.format_map` fills it, and a check
parse as a regular expression or a JMESPath once filled, as at the end of an episode (a slot value is escaped
there, so any one does)."""


def template_problem(field: str, template: str, fills: tuple[str, ...] | None = None) -> str | None:
    """Why `template` cannot be filled as `str.format_map` fills it later, mid-night, or None: a lone brace, a brace
    pair Python reads as its own (`{t: notes}`, a JMESPath hash written with single braces), or, where `fills` names
    what fills this field, a name nothing fills. Every check of a spec's or app's templates asks here."""
    try:
        names = placeholders(template)
        if fills is not None and (unknown := sorted(names - set(fills))):
            return (f"{field} {template!r}: {{{unknown[0]}}} is filled by nothing here; it may hold "
                    + ", ".join(f"{{{n}}}" for n in fills) + f" ({BRACE_HINT})")
        template.format_map(dict.fromkeys(names, SLOT_STAND_IN))  # a conversion or format spec fails on any
    except (ValueError, LookupError, AttributeError) as exc:
        return f"{field}: {exc} in {template!r} ({BRACE_HINT})"
    return None


def _templates(spec: AppSpec) -> Iterator[tuple[str, str]]:
    """(field, template) of every text of the spec that may hold a {slot}."""
    for i, t in enumerate(spec.transitions):
        for j, action in enumerate(t.actions):
            for field in ("name", "text"):
                if (value := getattr(action, field)) is not None:
                    yield f"transitions[{i}].actions[{j}].{field}", value
    for page_id, page in spec.pages.items():
        yield f"pages.{page_id}.url", page.url
        if page.goal:
            yield f"pages.{page_id}.goal.instruction", page.goal.instruction
            yield from ((f"pages.{page_id}.goal.params.{k}", v) for k, v in page.goal.params.items())


def template_problems(spec: AppSpec) -> list[str]:
    """The spec's templates that are no format string: every later check, and the sampler, parses them."""
    return [problem for field, template in _templates(spec) if (problem := template_problem(field, template))]


def spec_problems(spec: AppSpec) -> list[str]:
    """Problems a pydantic model cannot see: templates that do not parse, dangling references, cycles,
    unreachable goals."""
    problems: list[str] = template_problems(spec)
    if problems:
        return problems  # the checks below read the templates' slots
    pages = set(spec.pages)
    if spec.start not in pages:
        problems.append(f"start: page {spec.start!r} does not exist")
    slots = spec.slot_values()
    for field, template in _templates(spec):
        problems += [f"{field}: unknown slot {{{slot}}}" for slot in sorted(placeholders(template) - slots.keys())]
    for i, t in enumerate(spec.transitions):
        for end, page_id in (("from", t.source), ("to", t.target)):
            if page_id not in pages:
                problems.append(f"transitions[{i}].{end}: page {page_id!r} does not exist")
        for j, action in enumerate(t.actions):
            for slot in placeholders(action.text or "") if action.op == "set_checked" else ():
                if slot in slots and not set(slots[slot]) <= {"on", "off"}:
                    problems.append(f"transitions[{i}].actions[{j}].text: set_checked needs on or off, "
                                    f"slot {{{slot}}} has {slots[slot]}")
    if spec.start in pages and spec.pages[spec.start].goal is not None:
        problems.append(f"pages.{spec.start}.goal: the start page cannot be a goal (a task there has no step)")
    for page_id, page in spec.pages.items():
        problems += [f"pages.{page_id}.slots.{name}: no values to choose from" for name, values in page.slots.items()
                     if not values]
    if problems:
        return problems
    g = spec.graph()
    if not nx.is_directed_acyclic_graph(g):
        cycle = " -> ".join(u for u, _ in nx.find_cycle(g))
        problems.append(f"transitions: the page graph must be acyclic, found cycle {cycle}")
    reachable = nx.descendants(g, spec.start) | {spec.start}
    for page_id in spec.goal_pages():
        if page_id not in reachable:
            problems.append(f"pages.{page_id}.goal: goal page is not reachable from start {spec.start!r}")
    if not spec.goal_pages():
        problems.append("pages: no page has a goal, so no task can be made")
    return problems


def load_spec(path: Path) -> AppSpec:
    """Read and validate an app spec; every problem is reported with the file and field."""
    try:
        raw = read_yaml(path)
    except OSError as exc:
        raise SpecError(f"{path}: cannot read app spec: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}{yaml_problem(exc)}") from None
    try:
        spec = AppSpec.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise SpecError(f"{path}: invalid app spec:\n  " + "\n  ".join(problems)) from None
    problems = spec_problems(spec)
    if problems:
        raise SpecError(f"{path}: invalid app spec:\n  " + "\n  ".join(problems))
    return spec

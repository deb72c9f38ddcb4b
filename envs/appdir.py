"""A user's own web app, from an app directory: its page graph, where it runs, how it resets, and its checks as data.

The directory holds `spec.yaml`: the page graph in the format of the bundled apps
(`envs.spec`: pages, transitions by accessible role and name, slots, goals), plus

    serve:                       # where the app is: base_url, or a command that starts it
      command: "npm start -- --port {port}"      # {port}: a free port; {python}: this interpreter
      url: "http://127.0.0.1:{port}"
      ready_timeout_s: 60
    reset: context               # or {url: /api/reset, method: POST}, or {command: "{python} reset.py"}
    state:                       # requests made at the end of every episode, with its cookies
      notes: {path: /api/notes}
    checks:                      # the goals' checkers, as predicates on the episode's final state
      note_pinned:
        http: notes
        at: "notes[?title=='{note}'] | [0].pinned"
        equals: true

The app's code is not changed for us: an episode's final state is read from outside,
at the end of the episode, and kept in the episode row, so a critic or a rerun judges
the same state again without the app. It holds the final URL and title, the final
accessibility tree, each `state` request's answer, and the elements the checks' CSS
selectors match. A check is one predicate:

- `url`: a regular expression the final URL contains a match of;
- `element`: an element of the final accessibility tree with this role, name (or
  `name_contains`), value and states (checked, selected, expanded...);
- `dom`: an element matching a CSS `selector` whose text contains, or whose value,
  checked or selected state equals, what is given;
- `http`: a `state` request's JSON answer at a JMESPath expression `at`, which `equals`
  a value, `contains` a text, or `exists`;
- `all` and `any`: lists of predicates; `not`: one;
- `python`: the name of a function in the directory's `checkers.py`, called with the
  goal's parameters and the final state, returning (holds, reason): for what the
  predicates cannot say.

`{slot}` placeholders in a check take the goal's checker parameters (the query's slot
values); a slot value is escaped where the check is a regular expression or a JMESPath.
A literal brace in a check is written twice (`{{` and `}}`), as in Python's format strings.

Two checkers come with every app directory, for the queries the factory finds on the live
app rather than in the page graph: `interaction` (atomic operations, judged on what the
browser's recorder saw) and `surface_opened` (deep search: the final accessibility tree
shows the dialog or tab panel named `surface`). A check of the same name in spec.yaml
replaces the second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import httpx
import jmespath
import yaml
from jmespath.exceptions import JMESPathError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from trajforge.envs import secrets
from trajforge.envs.apps.interaction import (
    INTERACTION_CHECKER,
    RECORDER_PATH,
    UI_EVENTS,
    check_interaction,
    keep_ui_events,
    parse_ui_events,
)
from trajforge.envs.axtree import AXNode, parse
from trajforge.envs.browser import BrowserEnv, EnvFault, Observation
from trajforge.envs.spec import (
    SLOT_STAND_IN,
    AppSpec,
    SpecError,
    placeholders,
    spec_problems,
    template_problem,
    template_problems,
)
from trajforge.schemas.config import read_yaml, yaml_problem

SPEC_FILE = "spec.yaml"
CHECKERS_FILE = "checkers.py"
APP_DIR_KEYS = ("serve", "reset", "state", "checks")
"""The keys of an app directory's spec.yaml beyond the page graph's."""
MAX_DOM_MATCHES = 50
"""Elements a `dom` selector keeps in the final state (a list page may match hundreds)."""
MAX_TEXT = 2000
"""Characters of an element's text a `dom` selector keeps."""
_TEXT_MARGIN = 1024
"""Characters the page hands over beyond MAX_TEXT, so a secret that runs across the cut is masked whole before the
text is cut (cut first, its first part stayed)."""


M = TypeVar("M", bound=BaseModel)

CheckFunction = Callable[[dict[str, str], dict[str, Any]], tuple[bool, str]]
"""A `python` check: (the goal's params, the final state) -> (holds, why), as a bundled app's checkers."""


class AppDirError(RuntimeError):
    """The user's app cannot be used as configured: it does not start, or does not answer at its URL."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SERVE_FILLS = ("port", "python")
"""What `serve.command` and `serve.url` may hold: a free port, this interpreter."""
RESET_FILLS = ("python",)
"""What `reset.command` may hold."""


def _fillable(field: str, template: str | None, names: tuple[str, ...]) -> None:
    """Refuse a command or URL that its placeholders' filling would fail on mid-night (a lone brace, as in a JSON
    body, or a name nothing fills), while the spec is read."""
    if template is not None and (problem := template_problem(field, template, names)):
        raise ValueError(problem)


def _splittable(field: str, command: str | None) -> None:
    """Refuse a command its start would fail on (an unclosed quote), while the spec is read, not at the first
    episode: it is split as a shell would, before its placeholders are filled."""
    if command is None:
        return
    try:
        shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"{field} {command!r}: {exc}") from None


class Serve(_Strict):
    """Where the app is: a running app's `base_url`, or a `command` that starts it and the `url` it serves."""

    base_url: str | None = None
    command: str | None = None
    url: str | None = Field(default=None, description="The started app's URL; may hold {port}.")
    ready_timeout_s: float = Field(default=60.0, gt=0)
    cwd: str | None = Field(default=None, description="The command's folder, relative to the app directory.")

    @model_validator(mode="after")
    def _one_way(self) -> Serve:
        if (self.base_url is None) == (self.command is None):
            raise ValueError("give either base_url (an app that is running) or command and url (one to start)")
        if self.command is not None and self.url is None:
            raise ValueError("command needs url: where the started app answers, e.g. http://127.0.0.1:{port}")
        _fillable("command", self.command, SERVE_FILLS)
        _splittable("command", self.command)
        _fillable("url", self.url, SERVE_FILLS)
        return self


class ResetBy(_Strict):
    """How the app forgets the last episode, beyond the fresh browser context every episode gets."""

    url: str | None = Field(default=None, description="A path or URL to call, with the new context's cookies.")
    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    command: str | None = None

    @model_validator(mode="after")
    def _one_way(self) -> ResetBy:
        if (self.url is None) == (self.command is None):
            raise ValueError("give either url or command (or write `reset: context` for a fresh browser context only)")
        _fillable("command", self.command, RESET_FILLS)
        _splittable("command", self.command)
        return self


class StateRequest(_Strict):
    """A request made at the end of every episode, whose JSON answer the `http` checks read."""

    path: str
    method: Literal["GET", "POST"] = "GET"


class UrlCheck(_Strict):
    url: str = Field(description="A regular expression the final URL contains a match of.")


class ElementQuery(_Strict):
    role: str | None = None
    name: str | None = None
    name_contains: str | None = None
    value: str | None = None
    states: list[str] = Field(default_factory=list, description='e.g. ["checked"], ["selected"], ["expanded"]')


class ElementCheck(_Strict):
    element: ElementQuery


class DomQuery(_Strict):
    selector: str = Field(description="A CSS selector (no {slot}: the DOM is read before a check's slots are known).")
    text_contains: str | None = None
    value: str | None = None
    checked: bool | None = None
    selected: bool | None = None


class DomCheck(_Strict):
    dom: DomQuery


class HttpCheck(_Strict):
    http: str = Field(description="The name of a `state` request.")
    at: str = Field(default="@", description="A JMESPath expression into its JSON answer.")
    equals: Any = None
    contains: str | None = None
    exists: bool | None = None

    @model_validator(mode="after")
    def _one_test(self) -> HttpCheck:
        tests = [t for t in ("equals", "contains", "exists") if getattr(self, t) is not None]
        if len(tests) != 1:
            raise ValueError("give exactly one of equals, contains, exists")
        return self


class PythonCheck(_Strict):
    python: str = Field(description="A function of the app directory's checkers.py: (params, state) -> (holds, why).")


class AllOf(_Strict):
    all: list[Check] = Field(min_length=1)


class AnyOf(_Strict):
    any: list[Check] = Field(min_length=1)


class NotOf(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    not_: Check = Field(alias="not")


_KINDS = ("url", "element", "dom", "http", "python", "all", "any", "not")


def _kind(raw: Any) -> str | None:
    """Which predicate a mapping is: the first of its keys that names one."""
    if isinstance(raw, dict):
        return next((k for k in _KINDS if k in raw), None)
    return next((k for k, v in zip(_KINDS, (UrlCheck, ElementCheck, DomCheck, HttpCheck, PythonCheck, AllOf, AnyOf,
                                            NotOf), strict=True) if isinstance(raw, v)), None)


Check = Annotated[
    Union[Annotated[UrlCheck, Tag("url")], Annotated[ElementCheck, Tag("element")], Annotated[DomCheck, Tag("dom")],
          Annotated[HttpCheck, Tag("http")], Annotated[PythonCheck, Tag("python")], Annotated[AllOf, Tag("all")],
          Annotated[AnyOf, Tag("any")],
          Annotated[NotOf, Tag("not")]],
    Discriminator(_kind, custom_error_type="check", custom_error_message="a check is one of: " + ", ".join(_KINDS)),
]


for _model in (AllOf, AnyOf, NotOf):
    _model.model_rebuild()


SURFACE_CHECKER = "surface_opened"
"""The checker of deep-search queries (query_gen.deep_search), with the dialog or tab panel as `surface`."""
BUILT_IN_CHECKS: dict[str, Check] = {
    SURFACE_CHECKER: AnyOf(any=[ElementCheck(element=ElementQuery(role=role, name="{surface}"))
                                for role in ("dialog", "alertdialog", "tabpanel")]),
}
"""Checks every app directory has unless its spec.yaml defines one of the same name. `surface_opened` reads the
final accessibility tree: the episode ends with the dialog or tab panel open, as deep search found it (a bundled app
reports every surface it shows to its server instead; a user's app is not changed for us)."""


class AppDirFile(_Strict):
    """What spec.yaml adds to the page graph."""

    serve: Serve
    # One branch by the input's type: pydantic reported a mapping's mistakes with "Input should be 'context'" too.
    reset: Annotated[Union[Annotated[Literal["context"], Tag("context")], Annotated[ResetBy, Tag("by")]],
                     Discriminator(lambda raw: "context" if isinstance(raw, str) else "by")] = "context"
    state: dict[str, StateRequest] = Field(default_factory=dict)
    checks: dict[str, Check] = Field(default_factory=dict)


def _located(check: Check, where: str) -> Iterator[tuple[str, Check]]:
    """Each predicate of a check, with where it is in spec.yaml (`checks.NAME.all[0].not`)."""
    yield where, check
    if isinstance(check, AllOf | AnyOf):
        key = "all" if isinstance(check, AllOf) else "any"
        for i, child in enumerate(getattr(check, key)):
            yield from _located(child, f"{where}.{key}[{i}]")
    elif isinstance(check, NotOf):
        yield from _located(check.not_, f"{where}.not")


def _walk(check: Check) -> Iterator[Check]:
    return (c for _, c in _located(check, ""))


def _texts(check: Check) -> list[tuple[str, str]]:
    """(field, text) of the texts of one predicate (not its parts') that may hold {slot}."""
    if isinstance(check, UrlCheck):
        return [("url", check.url)]
    if isinstance(check, ElementCheck):
        return [(f"element.{f}", v) for f in ("role", "name", "name_contains", "value")
                if (v := getattr(check.element, f))]
    if isinstance(check, DomCheck):
        return [(f"dom.{f}", v) for f in ("text_contains", "value") if (v := getattr(check.dom, f))]
    if isinstance(check, HttpCheck):
        return [("at", check.at), *([("contains", check.contains)] if check.contains else []),
                *([("equals", check.equals)] if isinstance(check.equals, str) else [])]
    return []



def _selector_problem(selector: str) -> str | None:
    """Why a CSS selector is none, as far as its brackets and quotes tell, or None. The browser parses it only at
    the end of each episode, where a bad one failed every episode; this scan catches the usual slips."""
    closers = {"[": "]", "(": ")"}
    opened: list[str] = []
    quote: str | None = None
    chars = iter(selector)
    for ch in chars:
        if ch == "\\":
            next(chars, None)  # an escaped character is a plain one
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in closers:
            opened.append(ch)
        elif ch in ")]" and (not opened or closers[opened.pop()] != ch):
            return f"{ch!r} closes nothing"
        elif ch in "{}":
            return f"{ch!r} is no part of a selector"
    if quote:
        return f"the quote {quote} is not closed"
    if opened:
        return f"{opened[-1]!r} is not closed"
    return "it is empty" if not selector.strip() else None


def _check_problems(checks: dict[str, Check]) -> list[str]:
    """The mistakes of every check, used by a goal or not, that would otherwise surface only when an episode is
    judged (a critic crashing, every episode an env fault), naming no file or field."""
    problems = []
    for name, check in checks.items():
        for where, c in _located(check, f"checks.{name}"):
            texts = [(f"{where}.{f}", t) for f, t in _texts(c)]
            if bad := [p for f, t in texts if (p := template_problem(f, t))]:
                problems += bad
                continue
            if isinstance(c, UrlCheck):
                try:
                    re.compile(_fill(c.url, _stand_ins(c.url), re.escape))
                except re.error as exc:
                    problems.append(f"{where}.url: not a regular expression once its slots are filled ({exc}) in "
                                    f"{c.url!r}")
            elif isinstance(c, HttpCheck):
                try:
                    jmespath.compile(_fill(c.at, _stand_ins(c.at), _jmespath_literal))
                except JMESPathError as exc:
                    why = str(exc).splitlines()[0]  # the rest draws the expression with a caret under the column
                    problems.append(f"{where}.at: not a JMESPath expression once its slots are filled ({why}) in "
                                    f"{c.at!r}")
            elif isinstance(c, DomCheck):
                try:
                    slots = placeholders(c.dom.selector)
                except ValueError:
                    slots = set()  # a lone brace: the scan below names it
                if slots:
                    problems.append(f"{where}.dom.selector {c.dom.selector!r} holds a {{slot}}; the DOM is read "
                                    "before the check knows its slots: match the slot with text_contains or value")
                elif why := _selector_problem(c.dom.selector):
                    problems.append(f"{where}.dom.selector: {c.dom.selector!r} is no CSS selector: {why}")
    return problems


@dataclass(frozen=True)
class AppDir:
    """A user's app, read from its directory."""

    path: Path
    spec: AppSpec
    serve: Serve
    reset: Literal["context"] | ResetBy
    state: dict[str, StateRequest]
    checks: dict[str, Check]
    """spec.yaml's checks and the built-in ones (`BUILT_IN_CHECKS`) it does not replace."""
    functions: dict[str, CheckFunction] = field(default_factory=dict)
    """The `python` checks' functions, from checkers.py."""

    @property
    def name(self) -> str:
        return self.spec.app

    def selectors(self) -> list[str]:
        """Every CSS selector the checks read, in a stable order."""
        return sorted({c.dom.selector for check in self.checks.values() for c in _walk(check)
                       if isinstance(c, DomCheck)})

    def check(self, checker: str, params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
        """A goal's check on an episode's final state: (success, what was found); or, for an atomic-operation
        query, the shared `interaction` checker on what the recorder reported."""
        if checker == INTERACTION_CHECKER:
            return check_interaction(params, state)
        if checker not in self.checks:
            raise ValueError(f"app {self.name!r} has no check {checker!r}; known: {', '.join(sorted(self.checks))}")
        return evaluate(self.checks[checker], params, state, self.functions)


def _functions(folder: Path, checks: dict[str, Check]) -> tuple[dict[str, CheckFunction], list[str]]:
    """The functions the `python` checks name, imported from folder/checkers.py; and the problems."""
    names = {c.python: name for name, check in checks.items() for c in _walk(check) if isinstance(c, PythonCheck)}
    if not names:
        return {}, []
    file = folder / CHECKERS_FILE
    if not file.is_file():
        return {}, [f"checks.{names[n]}: python {n!r} needs {file}" for n in names]
    loader = importlib.util.spec_from_file_location(f"trajforge_app_checkers_{abs(hash(str(file)))}", file)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error is theirs to read
        return {}, [f"{file}: cannot import it: {type(exc).__name__}: {exc}"]
    found = {n: getattr(module, n) for n in names if callable(getattr(module, n, None))}
    return found, [f"checks.{names[n]}: python {n!r} is not a function in {file}" for n in names if n not in found]


def _field_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> str:
    """An error's location as the keys of the file: pydantic adds a union's branch to it (a check's kind again,
    `function-after[_one_way(), ResetBy]`), which is no key there and read as one."""
    path: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif not (missing and i == len(loc) - 1):  # a required field is in no file that lacks it
            continue
        path.append(str(part))
    return ".".join(path)


def _validated(model: type[M], data: dict[str, Any], problems: list[str]) -> M | None:
    """`data` as `model`, or None with its problems added (field path and message)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems += [f"{_field_path(e['loc'], data, e['type'] == 'missing')}: {e['msg']}" for e in exc.errors()]
        return None


def load_app_dir(path: Path) -> AppDir:
    """Read and validate an app directory; every problem is reported with the file and field."""
    file = Path(path) / SPEC_FILE
    if not Path(path).is_dir():
        raise SpecError(f"{path}: no such app directory")
    try:
        raw = read_yaml(file)
    except OSError as exc:
        raise SpecError(f"{file}: cannot read app spec: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError(f"{file}{yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{file}: an app spec is a mapping, got {type(raw).__name__}")
    extra = {k: raw.pop(k) for k in APP_DIR_KEYS if k in raw}
    problems: list[str] = []
    spec = _validated(AppSpec, raw, problems)
    extras = _validated(AppDirFile, extra, problems)
    if extras is not None:  # the built-in checks, where spec.yaml has none of their name
        extras = extras.model_copy(update={"checks": {**BUILT_IN_CHECKS, **extras.checks}})
        problems += _check_problems(extras.checks)
    if spec is not None:
        problems += spec_problems(spec)
    functions: dict[str, CheckFunction] = {}
    if spec is not None and extras is not None and not template_problems(spec):
        problems += _cross_problems(spec, extras)
        functions, missing = _functions(Path(path), extras.checks)
        problems += missing
    if problems:
        raise SpecError(f"{file}: invalid app spec:\n  " + "\n  ".join(problems))
    assert spec is not None and extras is not None
    return AppDir(Path(path).resolve(), spec, extras.serve, extras.reset, extras.state, extras.checks, functions)


def _cross_problems(spec: AppSpec, extras: AppDirFile) -> list[str]:
    """Names that must agree between the page graph and the checks."""
    problems = []
    for page_id, page in spec.pages.items():
        if page.goal is None:
            continue
        if page.goal.checker not in extras.checks:
            problems.append(f"pages.{page_id}.goal.checker: no check {page.goal.checker!r} in checks; "
                            f"known: {', '.join(sorted(extras.checks))}")
            continue
        for c in _walk(extras.checks[page.goal.checker]):
            for _, template in _texts(c):
                try:
                    slots = placeholders(template)
                except ValueError:
                    continue  # named by _check_problems
                for slot in slots - set(page.goal.params):
                    problems.append(f"checks.{page.goal.checker}: {{{slot}}} is not one of pages.{page_id}.goal."
                                    f"params ({', '.join(sorted(page.goal.params)) or 'none'})")
    for name, check in extras.checks.items():
        for c in _walk(check):
            if isinstance(c, HttpCheck) and c.http not in extras.state:
                problems.append(f"checks.{name}: http {c.http!r} is not a state request; known: "
                                f"{', '.join(sorted(extras.state)) or 'none (add one under state:)'}")
    return problems


# ---------------------------------------------------------------- checks on a final state


def _fill(template: str, params: dict[str, str], escape: Any = None) -> str:
    values = {k: escape(v) if escape else v for k, v in params.items()}
    return template.format_map(values)


def _stand_ins(template: str) -> dict[str, str]:
    return dict.fromkeys(placeholders(template), SLOT_STAND_IN)


def _jmespath_literal(value: str) -> str:
    """A slot value inside a JMESPath raw string literal ('...'): jmespath 1.1 unescapes only \\' there, so a
    backslash stays as it is."""
    return value.replace("'", "\\'")


def _element(query: ElementQuery, params: dict[str, str], nodes: list[AXNode]) -> tuple[bool, str]:
    role, name, part, value = (_fill(v, params) if v else None
                               for v in (query.role, query.name, query.name_contains, query.value))
    wanted = " ".join(filter(None, [role or "element", f"named {name!r}" if name else None,
                                    f"whose name contains {part!r}" if part else None,
                                    f"with value {value!r}" if value else None,
                                    " ".join(query.states) if query.states else None]))
    for node in nodes:
        if ((role is None or node.role == role) and (name is None or node.name == name)
                and (part is None or part in node.name) and (value is None or node.value == value)
                and all(s in node.states for s in query.states)):
            return True, f"found {wanted}"
    return False, f"no {wanted} in the final accessibility tree"


def _dom(query: DomQuery, params: dict[str, str], matches: list[dict[str, Any]]) -> tuple[bool, str]:
    text = _fill(query.text_contains, params) if query.text_contains else None
    value = _fill(query.value, params) if query.value else None
    for m in matches:
        if ((text is None or text in (m.get("text") or "")) and (value is None or m.get("value") == value)
                and (query.checked is None or m.get("checked") is query.checked)
                and (query.selected is None or m.get("selected") is query.selected)):
            return True, f"{query.selector!r} matches an element as asked"
    return False, f"of {len(matches)} elements matching {query.selector!r}, none as asked"


def _http(check: HttpCheck, params: dict[str, str], answers: dict[str, Any]) -> tuple[bool, str]:
    answer = answers.get(check.http)
    if answer is None:
        return False, f"no answer to state request {check.http!r} in the final state"
    if "error" in answer:
        return False, f"state request {check.http!r}: {answer['error']}"
    at = _fill(check.at, params, _jmespath_literal)
    found = jmespath.search(at, answer["json"])
    shown = json.dumps(found)[:120]
    if check.exists is not None:
        ok = (found not in (None, [], {})) == check.exists
        return ok, f"{check.http} at {at!r} is {shown}"
    if check.contains is not None:
        text = _fill(check.contains, params)
        items = found if isinstance(found, list) else [found]
        ok = any(text in (i if isinstance(i, str) else json.dumps(i)) for i in items if i is not None)
        return ok, f"{check.http} at {at!r} is {shown}, {'' if ok else 'not '}containing {text!r}"
    expected = _fill(check.equals, params) if isinstance(check.equals, str) else check.equals
    return found == expected, f"{check.http} at {at!r} is {shown}, expected {json.dumps(expected)[:120]}"


def evaluate(check: Check, params: dict[str, str], state: dict[str, Any],
             functions: dict[str, CheckFunction] | None = None) -> tuple[bool, str]:
    """A predicate on a final state (`capture`'s), with the goal's parameters for its {slot}s: (holds, why).
    `functions` are the app directory's `python` checks."""
    if isinstance(check, UrlCheck):
        pattern = _fill(check.url, params, re.escape)
        url = state.get("url", "")
        ok = re.search(pattern, url) is not None
        return ok, f"final URL {url!r} {'matches' if ok else 'does not match'} {pattern!r}"
    if isinstance(check, ElementCheck):
        try:
            nodes = parse(state.get("ax_tree", ""))
        except ValueError as exc:
            return False, f"the final accessibility tree does not parse: {exc}"
        return _element(check.element, params, nodes)
    if isinstance(check, DomCheck):
        return _dom(check.dom, params, state.get("dom", {}).get(check.dom.selector, []))
    if isinstance(check, HttpCheck):
        return _http(check, params, state.get("http", {}))
    if isinstance(check, PythonCheck):
        fn = (functions or {}).get(check.python)
        if fn is None:
            raise ValueError(f"python check {check.python!r}: no such function was loaded from {CHECKERS_FILE}")
        ok, why = fn(params, state)
        return bool(ok), f"{check.python}: {why}"
    if isinstance(check, NotOf):
        ok, why = evaluate(check.not_, params, state, functions)
        return not ok, f"not ({why})"
    parts = [evaluate(c, params, state, functions) for c in (check.all if isinstance(check, AllOf) else check.any)]
    ok = all(p[0] for p in parts) if isinstance(check, AllOf) else any(p[0] for p in parts)
    return ok, "; ".join(why for _, why in parts)


# ---------------------------------------------------------------- the live app


_DOM_JS = """([selectors, max, maxText]) => Object.fromEntries(selectors.map(s => [s,
  Array.from(document.querySelectorAll(s)).slice(0, max).map(e => ({
    text: (e.innerText ?? e.textContent ?? '').slice(0, maxText),
    value: e.type === 'password' ? null : (e.value ?? null),
    checked: e.checked ?? null, selected: e.selected ?? null}))]))"""
"""The elements each selector matches, as the checks read them (a password field's value is never read)."""


def kept_dom(found: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """What `_DOM_JS` found, as the final state keeps it: secrets masked, then each text cut to MAX_TEXT."""
    dom = secrets.mask_json(found)
    for matches in dom.values():
        for match in matches:
            match["text"] = match["text"][:MAX_TEXT]
    return dom


def capture(env: BrowserEnv, app: AppDir, last: Observation | None) -> dict[str, Any]:
    """The episode's final state: URL, title, accessibility tree (the last observation's), the state requests'
    answers, the selectors' elements and, once there is one, the recorder's reports (`ui_events`). A request that
    fails is recorded as its error; the check says so."""
    answers: dict[str, Any] = {}
    for name, request in app.state.items():
        status, body = env.request(request.method, request.path)
        if not 200 <= status < 300:
            answers[name] = {"error": f"{request.method} {request.path} answered {status}"}
            continue
        try:
            answers[name] = {"json": secrets.mask_json(json.loads(body))}
        except json.JSONDecodeError as exc:
            answers[name] = {"error": f"{request.method} {request.path} answered no JSON ({exc})"}
    selectors = app.selectors()
    dom = kept_dom(env.evaluate(_DOM_JS, [selectors, MAX_DOM_MATCHES, MAX_TEXT + _TEXT_MARGIN]) if selectors else {})
    events: list[dict[str, Any]] = []
    for body in env.take_reports():
        try:
            keep_ui_events(events, parse_ui_events(body))
        except ValueError:
            continue  # not the recorder's (the app's own page posting to the same path): nothing to judge
    state = {"url": secrets.mask(env.url), "title": last.title if last else "",
             "ax_tree": last.ax_tree if last else "", "http": answers, "dom": dom}
    # Masked together, not report by report: a widget of one box a character reports each box on its own.
    return {**state, UI_EVENTS: secrets.mask_json(events)} if events else state


def _run(command: str, cwd: Path, what: str, timeout_s: float) -> None:
    argv = [part.format_map({"python": sys.executable}) for part in shlex.split(command)]
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AppDirError(f"{what} `{command}` failed: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise AppDirError(f"{what} `{command}` exited {done.returncode}: {' | '.join(tail)}")


class AppDirEnv:
    """A BrowserEnv on a user's app: the configured reset, the final state read from outside, and the bundled
    apps' interaction recorder run by the browser, which keeps its reports (the app's server never sees them),
    so atomic-operation queries are checked on a user's app as on a bundled one."""

    def __init__(self, env: BrowserEnv, app: AppDir) -> None:
        self.env = env
        self.app = app
        self._last: Observation | None = None
        env.add_recorder(RECORDER_PATH.read_text())

    def reset(self, session_id: str, start_url: str | None = None) -> None:
        self.env.reset(session_id, start_url, app_protocol=False)
        reset = self.app.reset
        if isinstance(reset, ResetBy):
            if reset.url is not None:
                status, _ = self.env.request(reset.method, reset.url)
                if not 200 <= status < 400:
                    raise EnvFault(f"reset {reset.method} {reset.url} answered {status}", "app_down")
            else:
                assert reset.command is not None
                try:
                    _run(reset.command, self.app.path, "reset", self.env.timeout_s)
                except AppDirError as exc:  # the app, not the agent: the episode is rerun, never judged
                    raise EnvFault(str(exc), "app_down") from exc
            self.env.reset(session_id, start_url, app_protocol=False)  # the start page as the reset left the app
        self._last = None

    def observe(self) -> Observation:
        self._last = self.env.observe()
        return self._last

    def app_state(self) -> dict[str, Any]:
        return capture(self.env, self.app, self._last)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str, timeout_s: float = 5.0) -> str | None:
    """Why `url` does not answer (None when it does, with any status below 500)."""
    try:
        status = httpx.get(url, timeout=timeout_s, follow_redirects=True).status_code
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if status < 500 else f"it answered {status}"


@contextmanager
def running(app: AppDir) -> Iterator[str]:
    """The app's base URL while the block runs: its `base_url` once it answers, or its command's, started here
    and stopped after (the whole process group)."""
    serve = app.serve
    if serve.base_url is not None:
        if (why := answers(serve.base_url)) is not None:
            raise AppDirError(f"app {app.name!r} does not answer at {serve.base_url} ({why}); start it, or give "
                              f"serve.command in {app.path / SPEC_FILE}")
        yield serve.base_url.rstrip("/")
        return
    assert serve.command is not None and serve.url is not None
    port = _free_port()
    fill = {"port": str(port), "python": sys.executable}
    url = serve.url.format_map(fill).rstrip("/")
    cwd = app.path / serve.cwd if serve.cwd else app.path
    argv = [part.format_map(fill) for part in shlex.split(serve.command)]
    # The app's output goes to a file, not a pipe: a chatty server would fill a pipe nobody reads and stall.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the child writes to it for its whole life
    try:
        process = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
    except OSError as exc:  # no such program or folder
        log.close()
        raise AppDirError(f"app {app.name!r}: serve.command `{serve.command}` in {app.path / SPEC_FILE} cannot "
                          f"start: {exc}") from None
    try:
        deadline = time.monotonic() + serve.ready_timeout_s
        why = answers(url, 1.0)
        while why is not None:
            if process.poll() is not None:
                log.seek(0)
                tail = log.read().strip().splitlines()[-3:]
                raise AppDirError(f"app {app.name!r}: `{' '.join(argv)}` exited {process.returncode} before "
                                  f"answering at {url}: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise AppDirError(f"app {app.name!r} does not answer at {url} within serve.ready_timeout_s="
                                  f"{serve.ready_timeout_s:g} s of `{' '.join(argv)}` ({why})")
            time.sleep(0.2)
            why = answers(url, 1.0)
        yield url
    finally:
        _stop(process)
        log.close()


STOP_GRACE_S = 10.0
"""How long the app's processes have after SIGTERM before SIGKILL."""


def _stop(process: subprocess.Popen[str]) -> None:
    """End the command's whole process group, whether the command itself has exited or not: a wrapper
    (`sh -c 'server &'`) may have exited while the server it started holds the port. What is left after
    STOP_GRACE_S (a process that ignores SIGTERM) is killed, and waited for: the port is free once this returns."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        if _group_ended(process, STOP_GRACE_S):
            break
    process.wait()


def _group_ended(process: subprocess.Popen[str], timeout_s: float) -> bool:
    """Whether the process group led by `process` is gone within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.poll()  # the command, once reaped, no longer counts as the group's
        _reap(process.pid)
        if not _runs(process.pid):
            _reap(process.pid)  # who ended since the first read
            return True
        time.sleep(0.1)
    return False


def _reap(pgid: int) -> None:
    """Read the exits of the group's processes that are this process's to read. Where trajforge is a container's
    PID 1 (or a subreaper), a wrapper's orphaned server becomes its child, and unread it stays a zombie."""
    with suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0]:
            pass


def _runs(pgid: int) -> bool:
    """Whether a process of the group still runs. A zombie has ended and holds no port, yet `killpg(pgid, 0)`
    counts it: where nothing reads an orphan's exit (a PID 1 that reaps nothing), every stop waited out the grace
    twice. /proc tells a zombie apart; without it (macOS), killpg's answer."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the name in parentheses may hold spaces: state and group follow the last ')'
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # it ended while we looked
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
"""Planning data (paper 2.2.2): task manuals distilled from successes, and plans checked against page graphs.

Per app (one unit of work):

- **Manuals.** The app's successful trajectories (reference demonstrations, which the
  checker passed, and rollouts the critics accepted) are grouped by task family: the
  query's source and its goal (the last page of its path, or an atomic query's operation).
  Each family's trajectories, as page transitions and actions (`action_words`: with the text
  typed, the key pressed, the way a swipe or scroll went), are distilled by the model into a
  manual; an answer that does not parse keeps the template manual below (`mode: fallback`,
  counted), since the trajectories teach even when the model cannot write. Its value is
  measured: `synth.manual_trials` of the family's queries are rolled out again with the
  night's policy (the rollout's settings, its model the loop iteration's) and the manual as
  guidance, and the row keeps their success rate before (the query history) and with it.
  Trials run for the first `synth.measured_manuals_per_app` families of an app (each is a
  policy episode); their episodes are not written to `episodes` (their ids are on the manual
  row; the policy's model and prompt versions are in the lineage). A manual whose family,
  trajectories, configuration and prompts (as their files read) are unchanged
  is not written again, unless it is the template fallback: then the next run asks the model
  again.
- **Plans.** The model plans `synth.plans_per_app` walks over the app's pages and names the
  complex task each does: from the start page along the page graph's transitions, each step
  names its page and the element (of the transition to the next step's page) used there; the
  walk comes first and the task after it. Where the backend can, the answer is held to those
  walks while it is decoded (`plan_schema`: `{slot}`s filled with the graph's values, 2 to 5
  pages), so a small model cannot write a plan the app does not allow; a plan that still names
  a page the graph does not have, or a way it does not have (a backend that does not hold
  answers to a schema), is dropped with the step and the name as its reason (`check_plan`).
  So is a plan whose task is the prompt's example, copied, or whose task is obviously wrong
  (`task_problem`: cut off at its length limit, written in the prompt's notation of ways, or
  naming nothing of its walk), or names a choice its walk does not make (`choice_problem`: a
  dish or size no step picks or leaves open). What each step does is written from the graph
  (`step_texts`: the transition's actions, its `{slot}`s bound by the element named), not by
  the model.

Both become `train_planning` chat samples (text only). With `synth.writer: template` no model
is asked: a manual is the first trajectory's transitions, one line each, and no plan is made.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from trajforge.envs import actions
from trajforge.envs.kinds import check_episode, kind_for
from trajforge.envs.operations import parse_operations
from trajforge.envs.spec import AppSpec, Transition, placeholders
from trajforge.llm import GatewayError, Sampling, TextPart, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import night_settings, policy_model, rollout
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import Manual, Plan, PlanningChat, Query, Step, steps_by_episode
from trajforge.schemas.stage import Inputs, StageDef, StageOutput, config_hash
from trajforge.synth.chat import chat_sample

PROMPTS = Path(__file__).parent / "prompts"
MANUAL, PLAN = "planning_manual", "planning_plan"
SECTIONS = ("synth", "rollout", "llm")
"""Not `loop`, though the trials roll out with the night's policy model (`night_settings`): that model is in the
fingerprint (`trial_model`), and the rest of `loop` (its window, `max_guided`, training) decides nothing here.
Planning replaces no earlier row, so a hashed setting that changes nothing would add every manual and plan again."""
MAX_TRAJECTORIES = 3
"""Successful trajectories shown per manual: enough to tell the route from the detours, short enough
for a small model."""
PLAN_STEPS = (2, 5)
"""Fewest and most steps of a plan: a task across pages, whose answer fits the prompt's max_tokens."""


TASK_CHARS = 120
"""The longest task a plan's answer may write (its schema's maxLength): one sentence, and room for the walk."""


class ManualAnswer(BaseModel):
    manual: list[str] = Field(min_length=1)


class PlanStep(BaseModel):
    page: str
    element: str | None = None


class PlanAnswer(BaseModel):
    """The model's plan: a walk first, then the task it does. Asked the other way round, SmolLM2 copied the prompt's
    example task for every app (6 of 6 on 2026-11-29); walk first, it named tasks of its own for all six."""

    steps: list[PlanStep] = Field(min_length=2)
    task: str


def family(query: Query) -> str:
    """The task family: the query's source and its goal (the path's last page, or an atomic query's operation)."""
    if query.source == "atomic" and query.actions_json:
        ops = parse_operations(query.actions_json)
        if ops:
            return f"atomic:{ops[0].op}"
    return f"{query.source}:{query.path[-1] if query.path else 'start'}"


@dataclass(frozen=True)
class Trajectory:
    episode_id: str
    query: Query
    steps: list[Step]


@dataclass(frozen=True)
class AppPlanning:
    """One app's planning work: its successful trajectories by family, its queries, and its query history."""

    app: str
    trajectories: dict[str, list[Trajectory]]
    queries: dict[str, list[Query]]
    history: dict[str, tuple[int, int]]
    """query id -> (attempts, successes) so far."""
    written: frozenset[str]
    """Manual and plan ids already in the warehouse (same inputs, configuration and prompts; a manual the
    model could not write, only once it has): not written again."""
    config: str
    """The config hash, with the prompts (`prompt_fingerprint`): part of every manual and plan id."""
    fallback: frozenset[str] = frozenset()
    """Manual ids written as the template because the model's answer was unusable: asked again, and written again
    only when the model's manual is usable now (an unusable answer is cached, so it would be the same row)."""


def action_words(step: Step) -> str:
    """A recorded action in words for a manual, with what it was done with, since a manual that leaves it out
    cannot be followed: the text typed (a secret's placeholder as `action_json` keeps it, never its value), the
    key pressed, which way a swipe, drag or scroll went; and the element it was done on, where the step names one
    ("type 'Pad Thai' into searchbox 'Search dishes'", "press Enter", "swipe up", "click link 'Cart'")."""
    target = f"{step.target_role or 'element'} '{step.target_name}'" if step.target_name else ""
    if not step.action_valid:  # not done, and its arguments are not checked: the type alone
        return f"{step.action_type} {target}".strip()
    args = actions.normalize({"type": step.action_type, **json.loads(step.action_json)})  # "press" is "key"
    kind = args["type"]
    if kind == "type":
        said = f"type '{args['text']}'" + (f" into {target}" if target else "")
        return said + (" and press Enter" if args.get("enter") else "")
    if kind == "key":  # mobile's one `key`, desktop's `keys` pressed together
        said = "press " + "+".join(args.get("keys") or [args["key"]])
    elif kind in ("swipe", "drag", "scroll"):  # the finger's way, from (x, y) to (x2, y2); a wheel's dy > 0 is down
        way = actions.direction(args)
        said = f"{kind} {way}" if way else kind
    elif kind == "system_button":
        said = f"press the {args['button']} button"
    elif kind in ("open", "answer"):
        said = f"{kind} '{args['text']}'"
    else:  # a pointer action: its element says it all
        return f"{kind} {target}".strip()
    return f"{said} on {target}" if target else said


def _transitions(t: Trajectory) -> dict[str, Any]:
    return {"task": t.query.instruction, "steps": [
        {"page": s.title_before, "result": s.title_after, "action": action_words(s)}
        for s in t.steps if s.action_type != "terminate"]}


def template_manual(trajectory: Trajectory) -> ManualAnswer:
    """Without a model: the first trajectory's transitions, one line each."""
    lines = [f"On '{s['page']}': {s['action']} (then '{s['result']}')" for s in _transitions(trajectory)["steps"]]
    return ManualAnswer(manual=lines or ["Nothing to do: the start page is the goal"])


def _filled(name: str, slots: dict[str, list[str]]) -> set[str]:
    """`name` with its {slot}s filled by every value the graph gives them; as written where a slot has none."""
    names = sorted(placeholders(name))
    if not names or not all(slots.get(n) for n in names):
        return {name}
    return {name.format_map(dict(zip(names, values))) for values in itertools.product(*(slots[n] for n in names))}


Way = tuple[str, list[str]]
"""A page of a plan and the element names of the transition taken from it ({slot}s filled; none on the last)."""


def _ways_on(spec: AppSpec) -> dict[str, list[tuple[str, list[str]]]]:
    """Per page, its transitions: (the page it leads to, the element names its actions use, {slot}s filled with
    the graph's values: "{dish}" on the shop's home page is its six dishes' links)."""
    slots = spec.slot_values()
    out: dict[str, list[tuple[str, list[str]]]] = {p: [] for p in spec.pages}
    for t in spec.transitions:
        out[t.source].append((t.target, sorted({n for a in t.actions if a.name for n in _filled(a.name, slots)})))
    return out


def plan_walks(spec: AppSpec) -> list[list[Way]]:
    """Every walk a plan may take: from the start page along the graph's transitions, PLAN_STEPS pages long."""
    ways, walks = _ways_on(spec), []

    def extend(page: str, taken: list[Way]) -> None:
        if len(taken) + 1 >= PLAN_STEPS[0]:
            walks.append([*taken, (page, [])])
        if len(taken) + 1 < PLAN_STEPS[1]:
            for to, names in ways[page]:  # the graph is acyclic (spec_problems): every walk ends
                extend(to, [*taken, (page, names)])

    extend(spec.start, [])
    return walks


def plan_schema(spec: AppSpec) -> dict[str, Any]:
    """A plan as the decoder holds it: one of `plan_walks`, each step's element one its transition uses, then the
    task, short enough for the answer to fit its max_tokens. What is done on each step is the graph's to say
    (`step_texts`), not the model's: SmolLM2's own words there were "type 'pad thai'" on every step of every app."""
    def step(page: str, names: list[str]) -> dict[str, Any]:
        return {"type": "object", "properties": {
            "page": {"const": page}, "element": {"enum": names} if names else {"type": "null"}},
            "required": ["page", "element"]}

    walks = [{"type": "array", "prefixItems": [step(*way) for way in walk], "items": False, "minItems": len(walk),
              "maxItems": len(walk)} for walk in plan_walks(spec)]
    return {"type": "object", "properties": {"steps": {"anyOf": walks},
                                             "task": {"type": "string", "minLength": 8, "maxLength": TASK_CHARS}},
            "required": ["steps", "task"]}


def plan_request(spec: AppSpec) -> dict[str, Any]:
    """The plan prompt's variables for an app: its start page, its pages, and the ways between them."""
    return {"app": spec.title, "start": spec.start,
            "pages": [{"id": p, "description": spec.pages[p].description} for p in sorted(spec.pages)],
            "ways": [{"page": p, "names": names, "to": to} for p, out in sorted(_ways_on(spec).items())
                     for to, names in out if names]}


def copies_example(plan: PlanAnswer, instructions: str) -> bool:
    """Whether the plan's task is the "task" of an example in the prompt's instructions, copied."""
    return f'"task": {json.dumps(plan.task.strip())}'.casefold() in instructions.casefold()


def task_problem(plan: PlanAnswer) -> str | None:
    """What is obviously wrong with a plan's task (the paper filters such tasks out), or None: cut off at its length
    limit (SmolLM2 ran on to it, "Cease the order, order the dish, and order the other items, and ..."), written in
    the prompt's notation of ways, or naming nothing of its walk: no page (its id, `_` read as a space) or element
    named in the plan, nor a word of 4 letters or more of one."""
    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"[a-z]+", text) if len(w) >= 4}

    task = plan.task.casefold()
    names = {n.casefold() for s in plan.steps for n in (s.page.replace("_", " "), s.element) if n}
    if len(plan.task) >= TASK_CHARS:
        return "its task was cut off at its length limit"
    if "->" in plan.task:  # SmolLM2: "Friday, Monday, ..., Wednesday -> Event saved"
        return "its task is written as the prompt's ways between pages (page: elements -> next page)"
    if not any(n in task for n in names) and not words(task) & set().union(*map(words, names)):
        return "its task names no page or element of its walk"
    return None


def _bound(template: str, element: str | None, values: dict[str, list[str]]) -> dict[str, str]:
    """The `{slot}` values (of those the graph gives) that make `template` read `element`: "{dish}" reads "Pad
    Thai" with dish=Pad Thai; "{event}" does not read "Search events", which is no event of the graph's."""
    names = sorted(placeholders(template))
    if not element or not names or not all(values.get(n) for n in names):
        return {}
    for picked in itertools.product(*(values[n] for n in names)):
        slots = dict(zip(names, picked))
        if template.format_map(slots) == element:
            return slots
    return {}


def _way(ways: list[Transition], element: str | None,
         values: dict[str, list[str]]) -> tuple[Transition, dict[str, str]]:
    """Of a step's transitions to the next page (at least one), the one whose action names `element` (else the
    first), and the `{slot}`s that name fills."""
    for way in ways:
        for action in way.actions:
            slots = _bound(action.name or "", element, values)
            if slots or action.name == element:
                return way, slots
    return ways[0], {}


def step_texts(plan: PlanAnswer, spec: AppSpec) -> list[str]:
    """Each step of a followable plan in words, from the page graph: the actions of the transition to the next
    step's page, with the `{slot}`s the step's element fills ("On search: type 'Pad Thai' into searchbox 'Search
    dishes', press Enter, click link 'Pad Thai'"; one it does not fill reads "the size"); the last step is where
    the task ends."""
    values = spec.slot_values()

    def filled(template: str, slots: dict[str, str], quoted: bool) -> str:
        text = template.strip()
        if all(n in slots for n in placeholders(text)):
            text = text.format_map(slots)
            return f"'{text}'" if quoted else text
        return re.sub(r"\{(\w+)\}", lambda m: slots.get(m[1], f"the {m[1]}"), text)

    texts = []
    for step, after in zip(plan.steps, plan.steps[1:]):
        way, slots = _way([t for t in spec.transitions if t.source == step.page and t.target == after.page],
                          step.element, values)
        said = []
        for a in way.actions:
            name = f"{a.role} {filled(a.name, slots, True)}" if a.name else ""
            text = filled(a.text or "", slots, a.op == "type")
            said.append({"type": f"type {text} into {name}", "press": f"press {text}",
                         "set_checked": f"set {name} to {text}"}.get(a.op, f"{a.op} {name}"))
        texts.append(f"On {step.page}: {', '.join(said)}")
    return [*texts, f"On {plan.steps[-1].page}: the task is done"]


def _named_slots(spec: AppSpec) -> set[str]:
    """The slots whose values a task may name: those an action clicks (an element's name) or types, not a
    checkbox's or switch's on and off."""
    return {n for t in spec.transitions for a in t.actions
            for n in placeholders(a.name or "") | (placeholders(a.text or "") if a.op == "type" else set())}


def choice_problem(plan: PlanAnswer, spec: AppSpec) -> str | None:
    """Where a followable plan's task names a choice its walk does not make, which one; None when there is none.
    The task names a slot's value (a dish, a size, a note) as whole words; the walk makes that choice where a
    step's element fills the slot with it (the link 'Pad Thai' is dish=Pad Thai), or leaves it to the task where a
    step's way uses the slot without its element filling it ("click radio the size"). "Order the Miso Ramen dish"
    on a walk that opens Pad Thai, or "Order a large Pad Thai" on one that never chooses a size, is a task the walk
    does not do. Words of a value inside another value the task names ("ideas" of "Podcast ideas") are that one's."""
    values = spec.slot_values()
    picked: dict[str, set[str]] = {}
    left_open: set[str] = set()
    for step, after in zip(plan.steps, plan.steps[1:]):
        way, slots = _way([t for t in spec.transitions if t.source == step.page and t.target == after.page],
                          step.element, values)
        for slot, value in slots.items():
            picked.setdefault(slot, set()).add(value)
        left_open |= {n for a in way.actions for n in placeholders(a.name or "") | placeholders(a.text or "")} - \
            set(slots)

    def agrees(slot: str, value: str) -> bool:
        return slot in left_open or value in picked.get(slot, ())

    task = plan.task.casefold()
    named: list[tuple[int, int, str, str]] = []  # (start, end, slot, value) of each value the task names
    for slot in _named_slots(spec):
        for value in values.get(slot, []):
            if words := value.casefold().strip(" ."):
                named += [(m.start(), m.end(), slot, value)
                          for m in re.finditer(rf"(?<!\w){re.escape(words)}(?!\w)", task)]
    for start, end, slot, value in sorted(named):
        if any(s <= start and end <= e and e - s > end - start for s, e, _, _ in named):
            continue  # a word of a longer value the task names
        if any((s, e) == (start, end) and agrees(o, v) for s, e, o, v in named):
            continue  # the walk's choice (of its slot, or of another slot holding the same words)
        if picked.get(slot):
            return f"its task names {slot} {value!r}, where its walk picks {', '.join(map(repr, sorted(picked[slot])))}"
        return f"its task names {slot} {value!r}, which its walk does not choose"
    return None


def check_plan(plan: PlanAnswer, spec: AppSpec) -> str | None:
    """Why the plan cannot be followed in this app from its start page; None when it can: every step is on a
    page of the graph, the first on the start page, and each element (if named) is one the transition to the
    next step's page uses."""
    for i, step in enumerate(plan.steps, 1):
        if step.page not in spec.pages:
            return f"step {i} names page {step.page!r}, which the page graph does not have"
    if plan.steps[0].page != spec.start:
        return f"step 1 is on page {plan.steps[0].page!r}, not the start page {spec.start!r}"
    ways = _ways_on(spec)
    for i, (step, after) in enumerate(zip(plan.steps, plan.steps[1:]), 1):
        names = [n for to, n in ways[step.page] if to == after.page]
        if not names:
            return f"step {i + 1} is on page {after.page!r}, which no transition from page {step.page!r} reaches"
        if step.element and not any(step.element in n for n in names):
            return f"step {i} names element {step.element!r}, which the way from {step.page!r} to {after.page!r} " \
                   "does not use"
    return None


class _Planner:
    def __init__(self, ws: Workspace, out: StageOutput) -> None:
        self.ws, self.out = ws, out
        self.cfg = ws.settings.synth
        self.prompts = {name: load_prompt(name, PROMPTS) for name in (MANUAL, PLAN)}
        # The trials roll out as the night's rollout does (its model the loop iteration's): `success_with` is then
        # measured by the policy whose attempts gave `success_before`.
        self.rollout = night_settings(ws)

    def ask(self, template: str, schema: type[BaseModel], /, json_schema: dict[str, Any] | None = None,
            sampling: Sampling | None = None, **variables: Any) -> tuple[BaseModel | None, str, str | None]:
        """(parsed answer or None, model id, why there is no answer or None); the caller counts the failure.
        `json_schema`, tighter than `schema`, holds the answer while it is decoded; `sampling` replaces the
        prompt's."""
        prompt = self.prompts[template]
        try:
            result = self.ws.gateway.chat_sync(prompt.render(**variables), model=self.cfg.model, schema=schema,
                                               json_schema=json_schema, sampling=sampling)
        except GatewayError as exc:
            return None, exc.record.model_id, f"{template}: no answer ({exc.record.error})"[:160]
        self.out.models[template] = result.record.model_id
        self.out.prompts[template] = prompt.version
        if result.parsed is None:
            return None, result.record.model_id, f"{template}: the model's answer did not parse"
        return result.parsed, result.record.model_id, None

    def trial(self, queries: list[Query], manual_id: str, text: str, run_id: str) -> tuple[float | None, list[str]]:
        """The queries rolled out with the manual as guidance: their success rate and the episode ids. The policy,
        its model and its prompt versions go into the stage's lineage (as the rollout's name them)."""
        if not queries:
            return None, []
        out = rollout(queries, run_id=f"{run_id}-{manual_id}", settings=self.rollout, blobs=self.ws.blobs,
                      gateway=self.ws.gateway, guidance={q.query_id: (manual_id, text) for q in queries})
        self.out.models.update(out.models)
        self.out.prompts.update(out.prompts)
        by_id = {q.query_id: q for q in queries}
        outcomes = []
        for episode in out.rows["episodes"]:
            if episode.status == "env_fault":  # type: ignore[union-attr]
                continue
            q = by_id[episode.query_id]  # type: ignore[union-attr]
            outcomes.append(check_episode(q, episode)[0])  # type: ignore[arg-type]
        self.out.stats["manual trial episodes"] += len(outcomes)
        episodes = [e.episode_id for e in out.rows["episodes"]]  # type: ignore[union-attr]
        return (sum(outcomes) / len(outcomes) if outcomes else None), episodes


def plan_app(units: list[AppPlanning], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Manuals (measured) and checked plans for each app of the shard."""
    out = StageOutput(rows={"manuals": [], "plans": [], "train_planning": []}, models={}, prompts={})
    planner = _Planner(ws, out)
    tag = ws.run_tag(run_id)
    cfg = ws.settings.synth
    for unit in units:
        spec = kind_for(unit.app).spec
        measured = 0
        for fam in sorted(unit.trajectories):
            trajectories = unit.trajectories[fam][:MAX_TRAJECTORIES]
            manual_id = short_id(unit.app, fam, unit.config, *sorted(t.episode_id for t in trajectories))
            if manual_id in unit.written:
                out.stats["manual up to date: same family, trajectories and configuration"] += 1
                continue
            answer: BaseModel | None = None
            mode, model_id, version = "template", "template", "template"
            if cfg.writer == "model":
                answer, model_id, problem = planner.ask(
                    MANUAL, ManualAnswer, app=spec.title if spec else unit.app, family=fam,
                    trajectories=[_transitions(t) for t in trajectories])
                mode, version = "model", f"{MANUAL}@{planner.prompts[MANUAL].version}"
                if problem is not None and manual_id in unit.fallback:  # its template manual is there already
                    out.stats[f"manual still the template: {problem}"] += 1
                    continue
                if problem is not None:  # the trajectories still teach: keep the template manual, say so
                    out.stats[f"manual kept as the template: {problem}"] += 1
                    mode = "fallback"
            if not isinstance(answer, ManualAnswer):
                answer = template_manual(trajectories[0])
            text = "\n".join(f"{i}. {line.strip()}" for i, line in enumerate(answer.manual, 1) if line.strip())
            queries = unit.queries.get(fam, [])[: cfg.manual_trials] if measured < cfg.measured_manuals_per_app else []
            measured += bool(queries)
            tried = [unit.history[q.query_id] for q in queries if q.query_id in unit.history]
            before = sum(s for _, s in tried) / sum(a for a, _ in tried) if tried and sum(a for a, _ in tried) else None
            success_with, episodes = planner.trial(queries, manual_id, text, run_id)
            row = Manual(run_id=run_id, manual_id=manual_id, app=unit.app, family=fam, text=text,
                         episodes=[t.episode_id for t in trajectories], trial_queries=[q.query_id for q in queries],
                         success_before=before, success_with=success_with, trial_episodes=episodes,
                         mode=mode, model_id=model_id, prompt_version=version)
            out.rows["manuals"].append(row)
            out.rows["train_planning"].append(chat_sample(
                PlanningChat, run_id=run_id, sample_id=short_id(run_id, manual_id), source_id=manual_id,
                system="You write task manuals for GUI agents.",
                turns=[(f"Write a manual for tasks of the kind {fam!r} in the app {unit.app!r}, e.g. "
                        f"{trajectories[0].query.instruction!r}.", text)], images=[], tag=tag))
        if spec is None:
            continue
        if cfg.writer != "model":
            out.stats["synth.writer is template: no plan asked"] += 1
            continue
        request, schema = plan_request(spec), plan_schema(spec)
        instructions = " ".join(part.text for m in planner.prompts[PLAN].render(**request).messages
                                if m.role == "system" for part in m.content if isinstance(part, TextPart))
        greedy, drawn = planner.prompts[PLAN].sampling, set()
        for draw in range(cfg.plans_per_app):  # the first greedy, the others each a seeded draw
            sampling = greedy.model_copy(update={"temperature": cfg.plan_temperature, "seed": draw}) if draw else None
            plan, model_id, problem = planner.ask(PLAN, PlanAnswer, json_schema=schema, sampling=sampling, **request)
            if not isinstance(plan, PlanAnswer):
                out.dropped[problem or f"{PLAN}: not a plan"] += 1
                continue
            if copies_example(plan, instructions):
                out.dropped["plan: its task is the prompt's example, copied"] += 1
                continue
            if (problem := check_plan(plan, spec)) is not None:
                out.dropped["plan: the page graph cannot follow it from the start page"] += 1
                out.stats[f"plan dropped ({unit.app}): {problem}"[:200]] += 1
                continue
            if (problem := task_problem(plan)) is not None:
                out.dropped[f"plan: {problem}"] += 1
                out.stats[f"plan dropped ({unit.app}): task {plan.task!r}"[:200]] += 1
                continue
            if (problem := choice_problem(plan, spec)) is not None:
                out.dropped["plan: its task names a choice its walk does not make"] += 1
                out.stats[f"plan dropped ({unit.app}): task {plan.task!r}: {problem}"[:200]] += 1
                continue
            steps = step_texts(plan, spec)
            plan_id = short_id(unit.app, unit.config, plan.model_dump_json())
            if plan_id in drawn:
                out.dropped["plan: the same as an earlier draw for this app"] += 1
                continue
            drawn.add(plan_id)
            if plan_id in unit.written:
                out.stats["plan already written by an earlier run"] += 1
                continue
            out.rows["plans"].append(Plan(
                run_id=run_id, plan_id=plan_id, app=unit.app, task=plan.task, steps=steps,
                pages=[s.page for s in plan.steps], raw_output=plan.model_dump_json(), model_id=model_id,
                prompt_version=f"{PLAN}@{planner.prompts[PLAN].version}"))
            out.rows["train_planning"].append(chat_sample(
                PlanningChat, run_id=run_id, sample_id=short_id(run_id, plan_id), source_id=plan_id,
                system="You plan tasks for GUI agents, step by step, page by page.",
                turns=[(f"Plan this task in the app {unit.app!r}: {plan.task}",
                        "\n".join(f"{j}. {s}" for j, s in enumerate(steps, 1)))], images=[], tag=tag))
    return out


# ---------------------------------------------------------------- loading


def _accepted(ws: Workspace, verdicts: int | None) -> set[str]:
    """Episodes the critics' latest verdict in that version accepts (`Catalog.newest`): one they judged again and
    rejected is no success to plan from, as it leaves the exports (`synth.export`)."""
    if verdicts is None:
        return set()
    return set(ws.catalog.newest("verdicts", "episode_id", verdicts).filter(pl.col("success"))["episode_id"])


def prompt_fingerprint() -> str:
    """What the rows depend on beyond the config: the stage's prompts, each by version and by a digest of its file,
    so an edit that does not bump `version:` counts too. It is part of the manual and plan ids, so an edited prompt
    is new work: every manual and plan is asked again. Not the code version, as grounding's is: planning replaces
    no earlier row (its unit, an app, writes nothing on a night with nothing new), so every commit of the code
    would add each family's manual and plans again beside the last ones."""
    prompts = [load_prompt(name, PROMPTS) for name in (MANUAL, PLAN)]
    return ",".join(f"{p.name}@{p.version}:{digest(p.path.read_bytes(), 12)}" for p in prompts)


def trial_model(ws: Workspace) -> str:
    """The model the manuals' trials roll out with: the night's policy model (the loop iteration's, or its latest
    checkpoint with `loop.train`); "" where no trial runs. A new one measures `success_with` anew."""
    cfg = ws.settings.synth
    return policy_model(ws) if cfg.manual_trials and cfg.measured_manuals_per_app else ""


def _written(ws: Workspace) -> tuple[frozenset[str], frozenset[str]]:
    """The manual and plan ids already in the warehouse, which are not written again, and apart from them the
    manuals kept as the template because the model's answer was unusable (`mode: fallback`), which a later run
    asks the model for again. Read at their latest and not named in the lineage's inputs: they are the stage's own
    output, and a version naming its own table's earlier one would keep every earlier one from expiring."""
    ids: set[str] = set()
    fallback: set[str] = set()
    if "manuals" in ws.catalog.tables():
        manuals = ws.catalog.scan("manuals").select("manual_id", "mode").collect()
        fallback = set(manuals.filter(pl.col("mode") == "fallback")["manual_id"])
        ids |= set(manuals.filter(pl.col("mode") != "fallback")["manual_id"])
    if "plans" in ws.catalog.tables():
        ids |= set(ws.catalog.scan("plans").select("plan_id").collect()["plan_id"])
    return frozenset(ids), frozenset(fallback - ids)


def load_apps(ws: Workspace, snapshot: int | None) -> Inputs[AppPlanning]:
    """Every app with successful trajectories so far, its queries (queries@latest) and their history."""
    snapshot = ws.catalog.version("episodes", snapshot)
    episodes = ws.catalog.load("episodes", snapshot)
    # The other tables at the versions read now, named in the lineage: a rerun reads the same ones.
    read = ws.catalog.latest_versions("verdicts", "steps", "query_history")
    ok = pl.col("episode_id").is_in(list(_accepted(ws, read.get("verdicts"))))
    if "source" in episodes.columns:
        ok = ok | ((pl.col("source") == "reference") & pl.col("success").fill_null(False))
    good = episodes.filter(ok).sort("episode_id")
    queries_frame, queries_snapshot = ws.catalog.latest("queries")
    queries = {q["query_id"]: Query.model_validate(q) for q in queries_frame.to_dicts()}
    steps = (ws.catalog.scan("steps", read.get("steps")).filter(pl.col("episode_id").is_in(good["episode_id"]
                                                                                            .to_list())).collect())
    by_episode = steps_by_episode(steps.to_dicts())
    history: dict[str, tuple[int, int]] = {}
    if "query_history" in read:
        counts = ws.catalog.load("query_history", read["query_history"]).group_by("query_id").agg(
            pl.len().alias("n"), pl.col("success").sum().alias("ok"))
        history = {r["query_id"]: (r["n"], r["ok"]) for r in counts.to_dicts()}
    written, fallback = _written(ws)
    fingerprint = f"{prompt_fingerprint()},trials={trial_model(ws)}"
    config = config_hash(ws.settings, SECTIONS, fingerprint)
    apps: dict[str, dict[str, list[Trajectory]]] = {}
    stats: Counter[str] = Counter()
    for e in good.to_dicts():
        q = queries.get(e["query_id"])
        if q is None:
            stats["successful episode of a query no longer in queries@latest"] += 1
            continue
        apps.setdefault(q.app, {}).setdefault(family(q), []).append(Trajectory(e["episode_id"], q,
                                                                               by_episode.get(e["episode_id"], [])))
    units = []
    for app, families in sorted(apps.items()):
        mine = [q for q in queries.values() if q.app == app]
        by_family: dict[str, list[Query]] = {}
        for q in sorted(mine, key=lambda q: q.query_id):
            by_family.setdefault(family(q), []).append(q)
        units.append(AppPlanning(app, families, by_family,
                                 {q.query_id: history[q.query_id] for q in mine if q.query_id in history},
                                 written, config, fallback))
    snapshots = {"episodes": snapshot} | ({"queries": queries_snapshot} if queries_snapshot is not None else {}) | read
    return Inputs(units=units, snapshots=snapshots, fingerprint=fingerprint, stats=stats)


STAGE = StageDef[Workspace, AppPlanning](
    name="planning",
    key=lambda u: u.app,
    reads="episodes",
    writes={"manuals": "append", "plans": "append", "train_planning": "append"},
    sections=SECTIONS,
    load=load_apps,
    run=plan_app,
    shard_size=lambda s: 2,
)

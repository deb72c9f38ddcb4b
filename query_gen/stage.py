"""The query-generation stage: web apps in, `queries` rows (and the `pages` it saw) out (paper 6.2).

Per app: sample tasks on the page graph; write each instruction from its template or,
with `instructions: model`, by model synthesis and refinement; drop near-duplicate
instructions; find atomic-operation queries on the live pages; with
`validate_interface`, crawl the live app and drop queries whose pages, slot values or
target elements are gone; for the apps named in `deep_search_apps`, search the live
accessibility tree for menu, tab and dialog pathways and make queries of them. A user's
own app (an app directory) gets all of it, deep search too when `deep_search_apps` names
it (`run query_gen --app-dir DIR --deep-search`). Coverage of the graph, operation kinds
and sources go into the stage's statistics, and every drop is counted under its reason,
so the lineage explains each missing query.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from trajforge.data.blobs import BlobStore
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.envs.kinds import AppKind, configured_kinds, kind_for
from trajforge.envs.pool import warm_envs
from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway
from trajforge.llm.workspace import Workspace
from trajforge.query_gen.atomic import atomic_queries
from trajforge.query_gen.deep_search import Commander, deep_search_queries
from trajforge.query_gen.quality import coverage, remove_near_duplicates
from trajforge.query_gen.sampling import TEMPLATE_GENERATOR, SampledTask, sample_tasks
from trajforge.query_gen.synthesis import Synthesiser
from trajforge.query_gen.validation import InterfaceValidator
from trajforge.schemas.config import QueryGenSettings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Page, Query
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

logger = logging.getLogger(__name__)


@dataclass
class PageLog:
    """The distinct screens query generation observes on the live apps: their screenshots go into the blob
    store as they are seen, and their rows into `pages`, so grounding learns from them too (paper 2.2.2)."""

    blobs: BlobStore
    run_id: str
    rows: dict[str, Page] = field(default_factory=dict)

    def watch(self, app: str, viewport: str) -> Callable[[Observation], None]:
        """A `BrowserEnv.on_observe` hook that keeps each new screen of `app` seen in `viewport`."""
        def keep(obs: Observation) -> None:
            sha = self.blobs.put(obs.png).sha256
            if sha not in self.rows:
                self.rows[sha] = Page(run_id=self.run_id, screenshot=sha, app=app, viewport=viewport,
                                      width=obs.width, height=obs.height, url=obs.url, title=obs.title,
                                      ax_tree=obs.ax_tree)
        return keep


def _row(task: SampledTask, instruction: str, generator: str, *, run_id: str, settings: QueryGenSettings,
         now: datetime) -> Query:
    return Query(
        run_id=run_id,
        query_id=task.query_id,
        app=task.app,
        source="page_graph",
        instruction=instruction,
        path=list(task.path),
        slots_json=json.dumps(dict(task.slots)),
        checker=task.checker,
        checker_params_json=json.dumps(dict(task.checker_params)),
        max_steps=task.reference_steps + settings.step_budget_margin,
        generator=generator,
        created_at=now,
    )


def generate_queries(
    apps: list[AppKind],
    *,
    run_id: str,
    settings: QueryGenSettings,
    gateway: Gateway | None = None,
    chromium: Path | None = None,
    viewport: Literal["mobile", "desktop"] = "mobile",
    pages: PageLog | None = None,
) -> StageOutput:
    """Sample, write, deduplicate and validate the queries of each web app (a kind with a page graph).

    Per app: page-graph tasks, then atomic-operation queries found on its live pages
    (in `viewport`, the rollout's, so they use only operations its action space has),
    then deep-search queries for the apps in `settings.deep_search_apps`. `gateway` is
    needed with `settings.instructions == "model"` (it also writes deep-search commands),
    `chromium` whenever a live app is opened; a missing one is a configuration error,
    raised before any work. Every screen the live apps show is kept in `pages` when one is
    given. An app whose graph yields fewer distinct tasks than asked is
    not an error; the shortfall is counted under `dropped` so the lineage shows it.
    """
    if settings.instructions == "model" and gateway is None:
        raise ValueError("query_gen.instructions: 'model' needs a model gateway (llm settings)")
    deep = settings.deep_search_queries > 0 and any(a.name in settings.deep_search_apps for a in apps)
    live = settings.validate_interface or settings.atomic_per_app > 0 or deep
    if live and chromium is None:
        raise ValueError("query_gen: validate_interface, atomic_per_app and deep_search_apps open the live app "
                         "and need a Chromium (rollout.chromium)")
    out = StageOutput()
    synthesiser = Synthesiser(gateway, settings.instruction_model) if settings.instructions == "model" else None
    commander = Commander(gateway, settings.instruction_model) if gateway is not None and synthesiser else None
    rows: list[Query] = []
    now = datetime.now(timezone.utc)
    for kind in apps:
        assert kind.spec is not None, f"{kind.name} has no page graph"
        queries = _page_graph_queries(kind.spec, settings, synthesiser, out, run_id=run_id, now=now)
        if live:
            assert chromium is not None
            queries = _live_queries(kind, settings, commander, out, queries, run_id=run_id, now=now,
                                    chromium=chromium, viewport=viewport, pages=pages)
        # Every new query starts with no attempts: the self-evolving loop counts from here.
        queries = [q.model_copy(update={"attempts": 0, "successes": 0}) for q in queries]
        out.stats.update(coverage(kind.spec, queries))
        out.stats.update(Counter(f"queries: {kind.name}: {q.source}" for q in queries))
        rows.extend(queries)
    if synthesiser is not None:
        out.prompts.update({p.name: p.version for p in (synthesiser.synthesis, synthesiser.refine)})
    if any(q.generator == TEMPLATE_GENERATOR for q in rows) or synthesiser is None:
        out.models["instruction"] = "template"
        out.prompts[TEMPLATE_GENERATOR] = "1"
    out.rows["queries"] = rows
    if pages is not None:
        out.rows["pages"] = list(pages.rows.values())
    return out


def _page_graph_queries(spec: AppSpec, settings: QueryGenSettings, synthesiser: Synthesiser | None,
                        out: StageOutput, *, run_id: str, now: datetime) -> list[Query]:
    """Sampled paths with their instructions (template, or written by the model), near-duplicates dropped."""
    sample = sample_tasks(spec, settings.num_queries, seed=settings.seed, max_len=settings.max_path_len)
    if len(sample.tasks) < settings.num_queries:
        # Only a graph whose every task was drawn has fewer than asked; else the draw cap stopped repeats.
        why = ("graph has fewer distinct tasks than num_queries" if sample.exhausted
               else "sampling stopped at its draw cap (num_queries x 20) on repeated tasks, short of num_queries")
        out.dropped[f"{spec.app}: {why}"] += settings.num_queries - len(sample.tasks)
    queries: list[Query] = []
    for task in sample.tasks:
        if synthesiser is None:
            instruction, generator = task.instruction, TEMPLATE_GENERATOR
        else:
            written = synthesiser(spec, task)
            instruction, generator = written.instruction, written.generator
            out.models["instruction_model"] = written.model_id
            if written.fallback_reason is not None:
                out.stats[f"{spec.app}: model instruction replaced by template: {written.fallback_reason}"] += 1
                logger.info("%s %s: %s; model said %s", spec.app, task.query_id, written.fallback_reason, written.raw)
        queries.append(_row(task, instruction, generator, run_id=run_id, settings=settings, now=now))
    queries, duplicates = remove_near_duplicates(queries)
    out.dropped.update(duplicates)
    return queries


def _live_queries(kind: AppKind, settings: QueryGenSettings, commander: Commander | None, out: StageOutput,
                  page_graph: list[Query], *, run_id: str, now: datetime, chromium: Path,
                  viewport: Literal["mobile", "desktop"], pages: PageLog | None) -> list[Query]:
    """The page-graph queries that pass interface validation, with the atomic-operation and
    deep-search queries found on the live app; each drop is counted with its reason."""
    found = list(page_graph)
    spec = kind.spec
    assert spec is not None
    def watch(viewport: str) -> Callable[[Observation], None] | None:
        return pages.watch(kind.name, viewport) if pages is not None else None

    with ExitStack() as stack:
        site = kind.serve(stack)
        envs = [site.wrap(env) for env in stack.enter_context(warm_envs(
            1 if site.shared_state else settings.contexts, chromium=chromium, viewport=viewport,
            on_observe=watch(viewport)))]
        env = envs[0]
        if settings.atomic_per_app:
            atomic = atomic_queries(spec, site.base_url, env, n=settings.atomic_per_app, seed=settings.seed,
                                    space=env.space, run_id=run_id, now=now, margin=settings.step_budget_margin,
                                    max_pages=settings.atomic_pages)
            found += atomic.queries
            out.stats.update({f"atomic: not made: {k}": n for k, n in atomic.skipped.items()})
        if settings.validate_interface:
            checked = InterfaceValidator(spec, site.base_url, envs).validate(found)
            found = checked.kept
            out.dropped.update(checked.dropped)
            out.stats.update({f"validation: reached by driving a form: {k}": n for k, n in checked.driven.items()})
        if kind.name in settings.deep_search_apps and settings.deep_search_queries:
            desktop = site.wrap(stack.enter_context(warm_envs(  # a desktop app's menus
                1, chromium=chromium, viewport="desktop", on_observe=watch("desktop")))[0])
            found += _deep_search(spec, site.base_url, desktop, settings, commander, out, run_id=run_id)
    return found


def _deep_search(spec: AppSpec, base_url: str, env: BrowserEnv, settings: QueryGenSettings,
                 commander: Commander | None, out: StageOutput, *, run_id: str) -> list[Query]:
    """A seeded sample of `settings.deep_search_queries` of the queries deep search makes on the live app."""
    searched = deep_search_queries(spec, base_url, env, run_id=run_id, commander=commander,
                                   max_depth=settings.deep_search_depth, step_margin=settings.step_budget_margin)
    rng = random.Random(f"{settings.seed}:{spec.app}")
    chosen = sorted(rng.sample(searched.rows, min(settings.deep_search_queries, len(searched.rows))),
                    key=lambda q: q.query_id)
    out.dropped.update(searched.dropped)
    out.stats.update({f"deep search: {k}": n for k, n in searched.stats.items()})
    out.stats[f"deep search: {spec.app}: pathways found"] += len(searched.pathways)
    out.stats[f"deep search: {spec.app}: pathways beyond deep_search_queries"] += len(searched.rows) - len(chosen)
    out.models.update(searched.models)
    out.prompts.update(searched.prompts)
    return chosen


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class AppUnit:
    """One app kind to make queries for: a web app by name (bundled or the user's), or a task suite ("miniwob",
    "android")."""

    app: str
    spec: str = ""
    """A digest of the app's page graph (empty for a suite). It is part of the unit's key, so of its shard's id: a
    run resumed after the spec was edited does the app again, rather than keep the shard done with the old spec."""


def load_apps(ws: Workspace, _: int | None) -> Inputs[AppUnit]:
    """The configured apps; their specs' content is part of the config hash and of each app's shard id, so an
    edited spec is new work, in a resumed run too, and so is the viewport the apps are crawled in
    (`rollout.viewport`: its screens are the pages rows, its action space decides which queries pass validation;
    a setting, so another viewport is another run)."""
    kinds = configured_kinds(ws.settings)
    specs = {k.name: k.spec.model_dump_json() for k in kinds if k.spec is not None}
    fingerprint = digest("".join(specs.values()) + ws.settings.rollout.viewport)
    units = [AppUnit(k.name, digest(specs[k.name]) if k.name in specs else "") for k in kinds]
    return Inputs(units=units, fingerprint=fingerprint)


def run_query_gen(units: list[AppUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Page-graph, atomic and deep-search queries for the web apps; the suites' own tasks for the others."""
    cfg = ws.settings.query_gen
    kinds = [kind_for(u.app) for u in units]
    out = generate_queries(
        [k for k in kinds if k.in_browser and k.spec is not None], run_id=run_id, settings=cfg,
        gateway=ws.gateway if cfg.instructions == "model" else None, chromium=ws.settings.rollout.chromium,
        viewport=ws.settings.rollout.viewport, pages=PageLog(ws.blobs, run_id),
    )
    for kind in kinds:
        tasks, dropped = kind.tasks(ws.settings, run_id=run_id)
        out.rows["queries"].extend(tasks)
        out.dropped.update(dropped)
        out.models.update(kind.task_source())
    return out


STAGE = StageDef[Workspace, AppUnit](
    name="query_gen",
    key=lambda u: f"{u.app}@{u.spec}",
    reads=None,
    writes={"queries": "overwrite", "pages": "overwrite"},
    sections=("query_gen", "llm"),
    load=load_apps,
    run=run_query_gen,
    shard_size=lambda s: 1,
    workers=lambda s: s.runner.workers,  # each app's crawl waits mostly on its own browser
)

"""The rollout stage over one shard of queries: episodes and steps rows, no Prefect.

One AppServer per app the shard needs and `settings.contexts` browser contexts on one
browser (`envs.pool.warm_envs`: open from an earlier shard of the run in this process
where they can be) running the shard's queries in parallel. An episode that ends
in an environment fault (browser crash, timeout, app server down) is kept as an
env_fault row, which critics skip, and its query is rerun as a new episode, up to
`settings.max_fault_retries` times, as Agentic-Q's detection-rerunning does: a fault
never turns into a failed task.

Episode ids are a hash of (run_id, query_id, attempt), so a rerun of a shard writes the
same ids and the catalog can tell a redone shard from new work.

A query is not rolled again by a later night when the warehouse already holds its attempts
with the same attempt key (`attempt_key`): the same query version, the settings that decide
what the policy does, the model it asks, the content of the prompt templates it renders and,
for a text-only model, the OCR that renders its screens, the guidance in its prompt, its
sampled attempts' seeds and the code. Such a night would repeat those episodes step for step
(the bundled apps, MiniWoB++ seeds and the reference path are deterministic, and the response
cache answers the model), writing every training row a second time. `rollout.reroll_identical`
rolls them again, for an app whose state changes between nights; Android devices' queries
are always rolled (a device's clock alone changes its screens). A query of which the warehouse
holds only some samples (one ended in env faults on all its tries) rolls only the others.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from trajforge.envs.apps import UnknownAppError
from trajforge.envs.browser import BrowserEnv
from trajforge.envs.kinds import AppKind, kind_for, one_session
from trajforge.envs.pool import map_envs, warm_envs
from trajforge.envs.spec import AppSpec
from trajforge.llm import Gateway
from trajforge.llm.local import SMOLLM2, checkpoint
from trajforge.llm.prompts import PROMPTS_DIR
from trajforge.llm.workspace import Workspace, code_version
from trajforge.rollout.episode import BlobSink, run_episode
from trajforge.rollout.gui_owl import PROMPT as GUI_OWL_PROMPT
from trajforge.rollout.gui_owl import GuiOwlPolicy
from trajforge.rollout.mobile_agent import ROLES, MobileAgentPolicy
from trajforge.rollout.policy import Draw, Policy
from trajforge.rollout.random_policy import RandomPolicy
from trajforge.rollout.replay import ReplayPolicy
from trajforge.schemas.config import RolloutSettings, Settings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Checkpoint, Episode, Query, Step
from trajforge.schemas.stage import Inputs, StageDef, StageOutput

TASK_FIELDS = ("query_id", "app", "instruction", "path", "slots_json", "checker", "checker_params_json", "actions_json",
               "max_steps")
"""The query fields that decide its reference path and its check (not its counts or timestamps)."""

ATTEMPT_SETTINGS = ("policy", "random_seed", "model", "history_images", "click_targets", "samples_per_query",
                    "temperature", "top_p", "max_invalid_actions", "max_repeated_actions", "viewport", "android")
"""The rollout settings that decide what an attempt does; the others (contexts, shards, timeouts, the browser,
fault reruns, reference viewports) decide only how the night runs."""


POLICY_PROMPTS: dict[str, tuple[str, ...]] = {
    "gui_owl_e2e": (GUI_OWL_PROMPT,),
    "mobile_agent_v3": tuple(f"mobile_agent_{role}" for role in ROLES),
}
"""The prompt templates each model-driven policy renders; the replay and random policies render none."""

NOT_ROLLED_AGAIN = "not rolled again: the warehouse holds this query's attempts with the same attempt key"
"""The rollout lineage's count of the queries a night left out as identical to earlier attempts (the report's)."""
SAMPLES_HELD = "samples not rolled again: held with the same attempt key (their query's other samples rolled)"
"""The count of a partly held query's samples left out (`RolloutUnit.samples`)."""


def spec_hash(app: str) -> str:
    """A hash of the app's page graph; '' for an app without one."""
    spec = kind_for(app).spec
    return digest(spec.model_dump_json()) if spec is not None else ""


def query_version(query: Query, spec: str, viewport: str) -> str:
    """Everything that decides the query's reference episode in one viewport, hashed."""
    fields = {f: getattr(query, f) for f in TASK_FIELDS}
    return digest(json.dumps(fields, sort_keys=True) + spec + viewport)


def model_identity(settings: Settings, rollout: RolloutSettings) -> dict[str, Any]:
    """What answers the policy: the model behind its name, and the gateway settings that change answers (not
    concurrency, timeouts or keys). Empty for the replay and random policies, which ask none."""
    if rollout.policy in ("replay", "random"):
        return {}
    name = rollout.model or settings.llm.default
    llm = settings.llm
    model = (_served_in_process(llm.local.model) if name == "local"
             else llm.endpoints[name].model_dump(mode="json", include={"base_url", "model", "vision",
                                                                       "structured_output"})
             if name in llm.endpoints else _served_in_process(name) if Path(name).is_absolute()
             else name)  # ENDPOINT:FOLDER, a checkpoint an endpoint serves
    return {"name": name, "model": model, "reask": llm.reask, "constrain": llm.constrain}


def _served_in_process(model: str) -> str:
    """A checkpoint folder's fingerprinted id (`checkpoint`), so a model retrained in place rolls again; the
    embedded model, and a folder that holds no checkpoint (the gateway fails its calls saying so), as named."""
    if model == SMOLLM2 or not (Path(model).expanduser() / "config.json").is_file():
        return model
    return checkpoint(model)[0]


def policy_reads(ws: Workspace, rollout: RolloutSettings) -> dict[str, Any]:
    """What the policy reads that `code_version()` does not tell apart after an edit in a dirty checkout or an
    install without git: the content of the prompt templates it renders (and the gateway's re-ask, where
    `llm.reask` is on) and, for a model that reads the screen as OCR text, the OCR engine that writes that text.
    Only the chosen policy's prompts: editing another stage's prompt must not roll every query again. Empty for
    the replay and random policies, which ask no model."""
    if rollout.policy not in POLICY_PROMPTS:
        return {}
    names = POLICY_PROMPTS[rollout.policy] + (("reask",) if ws.settings.llm.reask else ())
    reads: dict[str, Any] = {"prompts": {name: digest((PROMPTS_DIR / f"{name}.yaml").read_bytes(), 32)
                                         for name in names}}
    if not ws.gateway.sees_images(rollout.model or ws.settings.llm.default):
        reads["ocr"] = ws.gateway.ocr.engine_id
    return reads


def attempt_key(query: Query, spec: str, settings: Settings, rollout: RolloutSettings, guidance: str | None,
                seed_base: str, reads: dict[str, Any]) -> str:
    """What decides a query's attempts in a night, hashed (see the module docstring): its version in the
    policy's viewport, `ATTEMPT_SETTINGS`, the model, what the policy reads besides (`policy_reads`), the
    guidance text, the seed base where attempts are sampled (greedy and seeded policies draw nothing from it)
    and the code version."""
    about = {
        "query": query_version(query, spec, rollout.viewport),
        "settings": rollout.model_dump(mode="json", include=set(ATTEMPT_SETTINGS)),
        "model": model_identity(settings, rollout),
        "reads": reads,
        "guidance": guidance,
        "seed_base": seed_base if rollout.temperature > 0 and rollout.policy not in ("replay", "random") else "",
        "code": code_version(),
    }
    return digest(json.dumps(about, sort_keys=True))


def episode_id_for(run_id: str, query_id: str, attempt: int = 1, sample: int = 0) -> str:
    """Deterministic episode id: the same run, query, sample and attempt always give the same id.

    The first sample's first attempt keeps the id episodes had before reruns and samples existed.
    """
    key = f"{run_id}\x00{query_id}" + (f"\x00{attempt}" if attempt > 1 else "") + (f"\x00s{sample}" if sample else "")
    return digest(key, 24)


def draw_for(settings: RolloutSettings, seed_base: str, query_id: str, sample: int) -> Draw | None:
    """How one attempt of a query decodes: None (greedy) at temperature 0; else sampled with a seed drawn
    from `seed_base` (the queries version the night read), so a rerun of that night asks for the same
    samples, which the response cache answers, and a new night's queries version samples anew."""
    if settings.temperature == 0:
        return None
    seed = int(digest(f"{seed_base}\x00{query_id}\x00{sample}", 8), 16)
    return Draw(settings.temperature, settings.top_p, seed)


def make_policy(settings: RolloutSettings, spec: AppSpec | None, gateway: Gateway | None,
                guidance: dict[str, str] | None = None, draw: Draw | None = None) -> Policy:
    """The configured policy for one app's queries (`spec`: its page graph, if it has one); model-driven ones
    need the gateway.

    `guidance` (query id -> text) goes into the end-to-end policy's prompt and Mobile-Agent-v3's Manager's; the
    replay and random policies do not read it.
    """
    if settings.policy == "replay":
        assert spec is not None, "replay needs the app's page graph"
        return ReplayPolicy(spec)
    if settings.policy == "random":
        return RandomPolicy(settings.random_seed)
    if gateway is None:
        raise ValueError(f"policy {settings.policy!r} asks a model: the rollout needs a gateway")
    if settings.policy == "mobile_agent_v3":
        return MobileAgentPolicy(gateway, viewport=settings.viewport, model=settings.model, guidance=guidance,
                                 draw=draw)
    return GuiOwlPolicy(gateway, viewport=settings.viewport, model=settings.model,
                        history_images=settings.history_images, guidance=guidance, draw=draw,
                        click_targets=settings.click_targets)


def rollout(queries: list[Query] | list[dict[str, Any]], *, run_id: str, settings: RolloutSettings,
            blobs: BlobSink, gateway: Gateway | None = None,
            guidance: dict[str, tuple[str, str]] | None = None, seed_base: str = "",
            samples: dict[str, tuple[int, ...]] | None = None) -> StageOutput:
    """Run every query of the shard `rollout.samples_per_query` times with the configured policy and viewport
    (`samples`: query id -> the samples to roll, for a query that needs only some).

    `guidance` maps query ids to (guidance id, text): those queries' episodes are guided
    rollouts of the self-evolving loop, and their rows name the guidance. `seed_base` makes
    the sampled attempts' seeds (`draw_for`).

    A query whose app is unknown, or whose kind cannot run here (an Android query with no
    device, a suite task under the replay policy), is dropped with the reason. Every env_fault
    episode is counted in `dropped` under its fault kind, as rerun or as the sample's last attempt.
    """
    output = StageOutput(rows={"episodes": [], "steps": []}, models={"policy": settings.policy}, prompts={})
    parsed = [q if isinstance(q, Query) else Query.model_validate(q) for q in queries]
    kinds: dict[str, AppKind] = {}
    runnable: list[Query] = []
    for q in parsed:
        if q.app not in kinds:
            try:
                kinds[q.app] = kind_for(q.app)
            except UnknownAppError:
                output.dropped[f"no bundled app {q.app!r}"] += 1
                continue
        kind = kinds[q.app]
        if kind.spec is None and settings.policy == "replay":
            output.dropped[f"{q.app} query: the replay policy has no reference path"] += 1
        elif (reason := kind.unavailable(settings)) is not None:
            output.dropped[f"{q.app} query: {reason}"] += 1
        else:
            runnable.append(q)

    guidance = guidance or {}
    texts = {query_id: text for query_id, (_, text) in guidance.items()}

    def attempts(env: Any, q: Query, start_url: str) -> list[tuple[Episode, list[Step]]]:
        """The query's episodes: each sample's first, and a rerun after each env fault while retries last."""
        runs = []
        for sample in (samples or {}).get(q.query_id, range(settings.samples_per_query)):
            draw = draw_for(settings, seed_base, q.query_id, sample)
            for attempt in range(1, settings.max_fault_retries + 2):
                episode, steps = run_episode(
                    env, make_policy(settings, kinds[q.app].spec, gateway, texts, draw), q, run_id=run_id,
                    episode_id=episode_id_for(run_id, q.query_id, attempt, sample), attempt=attempt,
                    blobs=blobs, max_steps=q.max_steps, start_url=start_url,
                    max_invalid=settings.max_invalid_actions, max_repeats=settings.max_repeated_actions,
                )
                runs.append((episode.model_copy(update={"sample": sample, "seed": draw.seed if draw else None}),
                             steps))
                if episode.status != "env_fault":
                    break
        return runs

    results: list[list[tuple[Episode, list[Step]]]] = []
    for kind in kinds.values():
        if not kind.in_browser and (mine := [q for q in runnable if q.app == kind.name]):
            results += kind.on_devices(settings, attempts, mine)
    if in_browser := [q for q in runnable if kinds[q.app].in_browser]:
        results += _in_browser(in_browser, kinds, settings, attempts)
    for runs in results:
        for i, (episode, steps) in enumerate(runs):
            last = i == len(runs) - 1 or runs[i + 1][0].sample != episode.sample  # this sample's last attempt
            if episode.query_id in guidance:
                episode = episode.model_copy(update={"guidance_id": guidance[episode.query_id][0]})
                output.stats["guided episodes"] += 1
            output.rows["episodes"].append(episode)
            output.rows["steps"].extend(steps)
            if episode.status == "env_fault":
                outcome = "no reruns left" if last else "rerun"
                output.dropped[f"env_fault {episode.fault_kind}: {outcome}"] += 1
    _count_policy_steps(output)
    for episode in output.rows["episodes"]:  # lineage: which model and prompt versions acted
        if episode.model_id not in ("replay", "random"):
            output.models["policy_model"] = episode.model_id
        for item in episode.prompt_version.split(","):
            name, _, version = item.partition("@")
            if version:
                output.prompts[name] = version
    return output


def _in_browser(queries: list[Query], kinds: dict[str, AppKind], settings: RolloutSettings,
                attempts: Callable[[Any, Query, str], list[tuple[Episode, list[Step]]]]
                ) -> list[list[tuple[Episode, list[Step]]]]:
    """The browser kinds' queries on the browser pool, their apps served meanwhile."""
    with ExitStack() as stack:
        sites = {name: kinds[name].serve(stack) for name in sorted({q.app for q in queries})}
        launchers = {name: url for site in sites.values() for name, url in site.launchers.items()}
        envs = stack.enter_context(warm_envs(
            settings.contexts, viewport=settings.viewport, chromium=settings.chromium,
            action_timeout_s=settings.action_timeout_s, apps=launchers,
        ))

        def run(env: BrowserEnv, q: Query) -> list[tuple[Episode, list[Step]]]:
            site = sites[q.app]
            with one_session(site.shared_state):  # another session's reset would wipe this episode's state
                return attempts(site.wrap(env), q, site.start_url(q))

        return map_envs(envs, run, queries)


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class GuidanceRef:
    """The guidance a run wrote for a hard query, handed to its rollout's prompt."""

    guidance_id: str
    text: str


@dataclass(frozen=True)
class RolloutUnit:
    """One query to roll out, with the guidance this run wrote for it (None: unguided)."""

    query: Query
    guidance: GuidanceRef | None = None
    seed_base: str = ""
    """The queries version it came from: its sampled attempts' seeds are drawn from it."""
    attempt_key: str | None = None
    """`attempt_key` of its attempts this night, stamped on their episodes."""
    model: str | None = None
    """The night's policy model as the plan read it (`night_settings` at the checkpoints version its lineage
    names; None: `llm.default`): every shard rolls with the model its attempt key counts."""
    samples: tuple[int, ...] | None = None
    """The samples to roll (their indices); None: all `rollout.samples_per_query`. A query whose other samples the
    warehouse holds with the same attempt key rolls only those it lacks (one ended in env faults on all its
    tries): the others again would be the same draws, written twice."""


def reads_checkpoints(settings: Settings) -> bool:
    """Whether the night's policy model comes from the checkpoints table (`night_settings`)."""
    return settings.loop.train and settings.loop.models.get(settings.loop.iteration) is None


def night_settings(ws: Workspace, checkpoints: int | None = None) -> RolloutSettings:
    """The rollout settings of this night: `rollout` with its model replaced by the configured loop iteration's
    (`loop.models`) or, with `loop.train`, by the latest checkpoint the loop trained from it (in the checkpoints
    version `checkpoints`; None: the latest)."""
    settings = ws.settings
    model = settings.loop.models.get(settings.loop.iteration)
    if reads_checkpoints(settings):
        latest = latest_checkpoint(ws, checkpoints)
        model = latest.model_id if latest is not None else None
    return settings.rollout if model is None else settings.rollout.model_copy(update={"model": model})


def policy_model(ws: Workspace) -> str:
    """The gateway name of the night's policy model, M(k) of the loop."""
    return night_settings(ws).model or ws.settings.llm.default


def root_model_id(ws: Workspace) -> str:
    """The model id of the configured policy model: the root of the loop's chain of checkpoints."""
    return ws.gateway.backend(ws.settings.rollout.model or ws.settings.llm.default).model_id


def latest_checkpoint(ws: Workspace, version: int | None = None) -> Checkpoint | None:
    """The newest checkpoint the loop trained from the configured policy model (its chain's root) in one version
    of the checkpoints table (None: its latest), or None.

    A checkpoint served in process whose folder is gone is an error that says so: rolling out with the base
    model instead would number its attempts as the wrong iteration."""
    root = root_model_id(ws)
    mine = ws.catalog.load("checkpoints", version).filter(pl.col("root_model_id") == root).sort("created_at")
    if mine.height == 0:
        return None
    latest = Checkpoint.model_validate(mine.row(-1, named=True))
    if latest.served_by == "local" and not (Path(latest.folder) / "config.json").is_file():
        raise FileNotFoundError(f"loop.train: the latest checkpoint trained from {root}, {latest.folder}, is gone "
                                "(no config.json); restore it, or delete its row's night, or set loop.train: false")
    return latest


def attempts_held(ws: Workspace, version: int) -> set[tuple[str, int]]:
    """(attempt key, sample) of every policy episode of a finished run that did not end in an env fault, in one
    version of the episodes table.

    Not an unfinished run's: the run resuming now may have committed its episodes just before it was killed,
    and its plan must list the shards it had (a crashed run not resumed rolls its queries again)."""
    episodes = ws.catalog.scan("episodes", version)
    if "attempt_key" not in episodes.collect_schema().names():  # a warehouse written before attempt keys
        return set()
    unfinished = list(ws.ledger.unfinished_runs())
    held = (episodes.filter(pl.col("attempt_key").is_not_null() & (pl.col("status") != "env_fault")
                            & ~pl.col("run_id").is_in(unfinished))
            .select("attempt_key", pl.col("sample").fill_null(0)).collect())
    return set(held.iter_rows())


def load_queries(ws: Workspace, snapshot: int | None) -> Inputs[RolloutUnit]:
    """The queries of one version, each with the guidance written for that version and its attempt key; a query
    whose every sample the warehouse already holds with that key is left out and counted (module docstring).

    The guidance is the latest guidance stage run that read this very queries version: in a
    nightly, the run's own; run stage by stage (`trajforge run history`, then `guidance`, then
    `rollout`, each its own run), the guidance run that followed the history run. Pairing by
    the queries' run id instead missed the second case (the history run writes queries, a
    later run the guidance).

    The other tables it reads, episodes (for the attempts held) and with `loop.train` checkpoints (for the
    policy model), are read at their latest version when the plan starts; checkpoints is named in its lineage.
    """
    frame, snapshot = ws.catalog.rows_added("queries", snapshot)
    snapshots = {"queries": snapshot}
    guidance: dict[str, GuidanceRef] = {}
    written = [info for info in ws.catalog.history("guidance")
               if info.lineage is not None and info.lineage.stage == "guidance"
               and info.lineage.inputs.get("queries") == snapshot]
    if written:
        info = written[-1]
        assert info.lineage is not None
        rows = ws.catalog.load("guidance", info.snapshot_id).filter(pl.col("run_id") == info.lineage.run_id)
        guidance = {r["query_id"]: GuidanceRef(r["guidance_id"], r["text"])
                    for r in rows.select("query_id", "guidance_id", "text").to_dicts()}
        if guidance:
            snapshots["guidance"] = info.snapshot_id
    wanted = [*(["checkpoints"] if reads_checkpoints(ws.settings) else []),
              *(["episodes"] if not ws.settings.rollout.reroll_identical and frame.height else [])]
    read = ws.catalog.latest_versions(*wanted)
    # Not episodes: the rollout writes them, and each night's version naming the last would chain every episodes
    # version (and what each read) into what `datasets expire` keeps, and every lineage walk over all nights.
    snapshots |= {table: version for table, version in read.items() if table != "episodes"}
    settings = night_settings(ws, read.get("checkpoints"))
    held = attempts_held(ws, read["episodes"]) if "episodes" in read else set()
    reads = policy_reads(ws, settings)
    specs: dict[str, str] = {}
    on_devices: set[str] = set()  # a device's screen and state drift (its clock, for one): always rolled again
    units: list[RolloutUnit] = []
    stats: Counter[str] = Counter()
    seed_base = f"queries@{snapshot}"
    for row in frame.to_dicts():
        query = Query.model_validate(row)
        if query.app not in specs:
            try:
                specs[query.app] = spec_hash(query.app)
                if not kind_for(query.app).in_browser:
                    on_devices.add(query.app)
            except UnknownAppError:
                specs[query.app] = ""  # the rollout drops it, naming the app
        guide = guidance.get(query.query_id)
        key = attempt_key(query, specs[query.app], ws.settings, settings, guide.text if guide else None, seed_base,
                          reads)
        lacking = tuple(sample for sample in range(settings.samples_per_query)
                        if query.app in on_devices or (key, sample) not in held)
        if not lacking:
            stats[NOT_ROLLED_AGAIN] += 1
            continue
        if len(lacking) < settings.samples_per_query:
            stats[SAMPLES_HELD] += settings.samples_per_query - len(lacking)
        units.append(RolloutUnit(query, guide, seed_base, key, settings.model,
                                 lacking if len(lacking) < settings.samples_per_query else None))
    return Inputs(units=units, snapshots=snapshots, stats=stats)


def _count_policy_steps(output: StageOutput) -> None:
    """The model policy's steps in the lineage: valid actions, constrained answers, model calls and time."""
    for step in output.rows["steps"]:
        assert isinstance(step, Step)
        if step.model_calls_json is None:  # replay and random policies ask no model
            continue
        output.stats["policy steps"] += 1
        output.stats["policy steps with a valid action"] += step.action_valid
        for call in json.loads(step.model_calls_json):
            output.stats["policy model calls"] += 1
            output.stats["policy model ms"] += round(call["latency_ms"])
            output.stats["policy calls constrained while decoding"] += call.get("constrained") is not None


def policy_summary(stats: dict[str, int]) -> str | None:
    """The share of the model policy's steps with a valid action and the model time a step cost (None: the
    policy asked no model)."""
    steps = stats.get("policy steps", 0)
    if not steps:
        return None
    valid = stats.get("policy steps with a valid action", 0)
    return (f"{steps} policy steps, {valid} ({valid / steps:.0%}) with a valid action; "
            f"{stats.get('policy calls constrained while decoding', 0)} of {stats.get('policy model calls', 0)} "
            f"model answers held to their format while decoding; {stats.get('policy model ms', 0) / 1000 / steps:.1f} "
            "s of model time per step")


def rollout_summary(stats: dict[str, int]) -> str | None:
    """The stage's line in the run's output: the policy's steps, and the queries not rolled again."""
    again = stats.get(NOT_ROLLED_AGAIN, 0)
    parts = [policy_summary(stats), f"{again} queries not rolled again (their attempts are in the warehouse with the "
             "same attempt key; rollout.reroll_identical rolls them)" if again else None]
    return "; ".join(p for p in parts if p) or None


def run_rollouts(units: list[RolloutUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Rollouts by the night's model as the plan read it (`RolloutUnit.model`), guided where the run wrote
    guidance."""
    settings = ws.settings.rollout.model_copy(update={"model": units[0].model}) if units else ws.settings.rollout
    guidance = {u.query.query_id: (u.guidance.guidance_id, u.guidance.text) for u in units if u.guidance}
    out = rollout([u.query for u in units], run_id=run_id, settings=settings, blobs=ws.blobs, gateway=ws.gateway,
                  guidance=guidance, seed_base=units[0].seed_base if units else "",
                  samples={u.query.query_id: u.samples for u in units if u.samples is not None})
    keys = {u.query.query_id: u.attempt_key for u in units}
    out.rows["episodes"] = [e.model_copy(update={"attempt_key": keys[e.query_id]})  # type: ignore[union-attr]
                            for e in out.rows["episodes"]]
    if ws.settings.loop.models.get(ws.settings.loop.iteration) is not None:
        out.stats[f"episodes by loop.models[{ws.settings.loop.iteration}]"] += len(out.rows["episodes"])
    return out


STAGE = StageDef[Workspace, RolloutUnit](
    name="rollout",
    key=lambda u: u.query.query_id,
    reads="queries",
    writes={"episodes": "append", "steps": "append"},
    sections=("rollout", "loop", "llm"),
    load=load_queries,
    run=run_rollouts,
    shard_size=lambda s: s.rollout.episodes_per_shard,
    # One shard at a time: each shard runs `rollout.contexts` browser contexts itself.
    summary=rollout_summary,
)

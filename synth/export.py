"""The end-to-end and role training tables: accepted steps as Qwen2.5-VL chat samples (paper 2.1, 2.2.3, 6.3).

One `train_e2e` row per step of a trajectory the critics accepted that passes the online
rejection-sampling filters (`synth.filters`: the step critic's score at least tau_c, a
thought consistent with the action), weighted by its query's success rate. A step the
pre-filter flagged `no_change` (a click on nothing: NEUTRAL, so it passes tau_c 0.5) is no
target, but stays in the history of the steps after it, as every dropped step does. The messages
are those the policy is asked with (the gui_owl_e2e template: the action space as a
function in the system message, the task, the history and the newest screenshot in the
user message) and the assistant's answer is the step's thought and the action as a
`<tool_call>` of that function. The screenshots are embedded as PNG
bytes, so a fine-tuning job needs nothing but the Parquet files.

A trajectory the Mobile-Agent-v3 team played also gives each role's answers as asked
(`train_manager`, `train_worker`, `train_reflector`, `train_notetaker`), under the same
filters; the Reflector's answers are balanced 1:1 (filter 4).

The tables accumulate, as every training table does: a version holds every row exported so far
(what a fine-tuning job reads), the rows its run added are that night's (what the loop trains on,
`Catalog.rows_added`), and a night with no policy episode adds none and empties nothing. An episode
an earlier run took with the same acceptance, step critiques, configuration and code is not taken again
(`StageDef.once`: a stage rerun by hand on an older verdicts version writes no row twice); one the critics
accept on a second judging after rejecting it, or judge again with a step's label or flags changed, is exported
then. An episode exported again (judged again, or with another
configuration) replaces its earlier rows in the same commit (`StageDef.replaces`), so every table holds each
episode's newest rows once, and an episode the critics reject on a second judging leaves no row behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from trajforge.critics.prefilter import NO_CHANGE
from trajforge.data.blobs import BlobStore
from trajforge.envs import actions
from trajforge.guidance.history import load_judged
from trajforge.llm import ImagePart, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import PROMPT, action_lines
from trajforge.schemas.config import SynthSettings
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import (
    Episode,
    ManagerChat,
    NotetakerChat,
    ReflectorChat,
    RoleChat,
    Step,
    TrainingStep,
    WorkerChat,
)
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.synth.chat import chat_messages, policy_messages
from trajforge.synth.filters import POSITIVE, Reflection, balance_reflections, consistent, critic_score, weights
from trajforge.synth.semantics import NO_EFFECT

ROLE_TABLES: dict[str, type[RoleChat]] = {"manager": ManagerChat, "worker": WorkerChat, "reflector": ReflectorChat,
                                          "notetaker": NotetakerChat}
"""Mobile-Agent-v3's roles (paper 7) and the training table of each."""
TABLES = ("train_e2e", *(t.table for t in ROLE_TABLES.values()))


@dataclass(frozen=True)
class StepLabel:
    """The step critic's label and summary of one step, and the pre-filter's flags (`critics.prefilter`)."""

    label: str | None
    summary: str | None
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExportUnit:
    """A judged episode: its steps, the verdict, the step critic's label of each step (None: not judged), and
    its query's success rate so far with the weight it gives (filter 3)."""

    episode: Episode
    steps: list[Step]
    success: bool
    labels: dict[str, StepLabel | None]
    p_succ: float | None = None
    weight: float = 1.0


def export(units: list[ExportUnit], *, run_id: str, tag: str, blobs: BlobStore, settings: SynthSettings) -> StageOutput:
    """Training rows for accepted episodes through filters 1 to 3 (and 4 for the Reflector's table); what is
    left out is counted by reason."""
    prompt = load_prompt(PROMPT)
    out = StageOutput(rows={t: [] for t in TABLES},
                      prompts={PROMPT: prompt.version})
    reflections: list[tuple[Reflection, ReflectorChat]] = []
    for unit in units:
        if not unit.success:  # one per episode: the other reasons count steps
            out.dropped["trajectory not accepted by the critics (episodes)"] += 1
            continue
        history: list[str] = []
        for step in unit.steps:
            critique = unit.labels.get(step.step_id)
            label = critique.label if critique else None
            summary = (critique.summary if critique else None) or f"{step.action_type} {step.action_json}"
            score = critic_score(label)
            # A reference replay's thought is written from its own action ("transition 2/5 (search -> dish): press
            # Enter."), consistent by construction; its page ids would read as element names ("Search").
            verdict = consistent(step.thought, step.action_type, step.target_name, step.ax_tree_before) \
                if settings.consistency == "rules" and unit.episode.policy != "replay" else None
            if score is None:
                out.dropped["step not judged by the step critic"] += 1
            elif score < settings.tau_c:
                out.dropped[f"filter 1: critic score {score} below tau_c {settings.tau_c} ({label})"] += 1
            elif not step.action_valid:
                out.dropped["invalid action: nothing to learn"] += 1
            elif NO_CHANGE in (critique.flags if critique else ()) and step.action_type not in NO_EFFECT:
                # NEUTRAL passes tau_c 0.5, but a click that changed nothing teaches a click on nothing
                out.dropped["no change: the action changed neither screen, tree nor URL (pre-filter)"] += 1
            elif verdict is not None and not verdict.ok:
                out.dropped[f"filter 2: the thought names another {verdict.rule}"] += 1
            else:
                out.rows["train_e2e"].append(_sample(unit, step, label, score, summary, history, run_id=run_id,
                                                     tag=tag, blobs=blobs))
                moved = "up (a hard task)" if unit.weight > 1 else "down (an easy task)" if unit.weight < 1 else "1"
                out.stats[f"filter 3: rows weighted {moved}"] += 1
            history.append(summary)
        reflections += _role_rows(unit, out, settings, run_id=run_id, tag=tag, blobs=blobs)
    kept, dropped = balance_reflections([r for r, _ in reflections])
    out.dropped.update({f"filter 4: {k}": v for k, v in dropped.items()})
    chats = {r.sample_id: chat for r, chat in reflections}
    out.rows["train_reflector"] = [chats[r.sample_id] for r in kept]
    return out


def _role_rows(unit: ExportUnit, out: StageOutput, settings: SynthSettings, *, run_id: str, tag: str,
               blobs: BlobStore) -> list[tuple[Reflection, ReflectorChat]]:
    """Each role's parsed answers in an accepted trajectory: the Manager's, Worker's and Notetaker's where their
    step passes filter 1 (and 2 for the Worker), into their tables; the Reflector's returned for filter 4."""
    labels = [(unit.labels.get(s.step_id) or StepLabel(None, None)).label for s in unit.steps]
    positive = all(label in POSITIVE for label in labels)
    reflections = []
    for i, step in enumerate(unit.steps):
        if not step.roles_json:
            continue
        score = critic_score(labels[i])
        for role, said in json.loads(step.roles_json).items():
            if role not in ROLE_TABLES or said.get("output") is None:
                out.dropped[f"{role}: its answer did not parse"] += 1
                continue
            screens = [unit.steps[i - 1].screenshot_before, step.screenshot_before] if role == "reflector" and i \
                else [step.screenshot_before]
            prompt = load_prompt(f"mobile_agent_{role}")
            out.prompts[prompt.name] = prompt.version  # the role's rows are rendered from it: the lineage names it
            rendered = prompt.render(
                task=unit.episode.instruction, screenshots=[ImagePart(sha256=h) for h in screens],
                **({"actions": "\n".join(action_lines(actions.space_for(unit.episode.viewport)))} if role == "worker"
                   else {}), **said["inputs"])
            messages_json, images = chat_messages(rendered, said["raw_output"], blobs)
            common = dict(run_id=run_id, sample_id=short_id(run_id, step.step_id, role), source_id=step.step_id,
                          messages_json=messages_json, images=images, tag=tag, step_id=step.step_id,
                          episode_id=unit.episode.episode_id, weight=unit.weight)
            if role == "reflector":
                outcome = said["output"]["outcome"]
                reflections.append((Reflection(common["sample_id"], outcome, labels[i], positive),
                                    ReflectorChat(**common, outcome=outcome)))
            elif score is None or score < settings.tau_c:
                out.dropped[f"{role}: filter 1, its step's critic score below tau_c {settings.tau_c}"] += 1
            elif role == "worker" and settings.consistency == "rules" and not consistent(
                    step.thought, step.action_type, step.target_name, step.ax_tree_before).ok:
                out.dropped["worker: filter 2, the thought names another element or action"] += 1
            else:
                out.rows[ROLE_TABLES[role].table].append(ROLE_TABLES[role](**common))
    return reflections


def _sample(unit: ExportUnit, step: Step, label: str, score: float, summary: str, history: list[str], *,
            run_id: str, tag: str, blobs: BlobStore) -> TrainingStep:
    ep = unit.episode
    messages_json, images = policy_messages(instruction=ep.instruction, viewport=ep.viewport, step=step,
                                            history=history, thought=step.thought, summary=summary, blobs=blobs)
    return TrainingStep(
        run_id=run_id, sample_id=short_id(run_id, step.step_id), step_id=step.step_id,
        episode_id=ep.episode_id, query_id=ep.query_id, label=label, messages_json=messages_json,
        images=images, tag=tag, score=score, p_succ=unit.p_succ, weight=unit.weight,
    )


# ---------------------------------------------------------------- the stage


def load_export_units(ws: Workspace, snapshot: int | None) -> Inputs[ExportUnit]:
    """Judged episodes of one verdicts version with their step critics' labels."""
    judged, snapshots, verdicts = load_judged(ws, snapshot)
    critiques_snapshot = ws.catalog.written_with("step_critiques", verdicts)
    critiques, _ = ws.catalog.rows_added("step_critiques", critiques_snapshot)
    columns = [c for c in ("step_id", "label", "summary", "flags") if c in critiques.columns]  # flags: added later
    labels = {r["step_id"]: StepLabel(r["label"], r["summary"], tuple(r.get("flags") or ()))
              for r in critiques.select(columns).to_dicts()}
    history, history_snapshot = ws.catalog.latest("query_history")
    p_succ = dict(history.group_by("query_id").agg(pl.col("success").mean()).iter_rows()) if history.height else {}
    cfg = ws.settings.synth
    weight = weights({u.episode.query_id: p_succ[u.episode.query_id] for u, _ in judged
                      if u.episode.query_id in p_succ}, smoothing=cfg.reweight_smoothing, low=cfg.reweight_min,
                     high=cfg.reweight_max)
    units = [ExportUnit(u.episode, u.steps, ok, {s.step_id: labels.get(s.step_id) for s in u.steps},
                        p_succ.get(u.episode.query_id), weight.get(u.episode.query_id, 1.0))
             for u, ok in judged]
    read = snapshots | {"step_critiques": critiques_snapshot}
    return Inputs(units=units, snapshots=read | ({"query_history": history_snapshot} if history_snapshot else {}))


def unit_key(unit: ExportUnit) -> str:
    """The episode, whether the critics accepted it and, if so, a digest of its steps' critiques (label, summary,
    flags). `StageDef.once` skips a key that an earlier run did, and the rows an episode gives depend on all of
    them: keyed on the episode alone, an episode rejected by one export was skipped by the next, after the critics
    had judged it again and accepted it (a user's `trajforge run critics --input episodes@N` with a better judge,
    then `run export`), so it was never exported; keyed without its critiques, an accepted episode judged again
    with a step now HARMFUL kept that step's row. A rejected episode gives no row, whatever its critiques."""
    if not unit.success:
        return f"{unit.episode.episode_id}:not accepted"
    critiques = [(s.step_id, c.label, c.summary, c.flags) if (c := unit.labels.get(s.step_id)) else (s.step_id,)
                 for s in unit.steps]
    return f"{unit.episode.episode_id}:accepted:{digest(json.dumps(critiques))}"


def run_export(units: list[ExportUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    return export(units, run_id=run_id, tag=ws.run_tag(run_id), blobs=ws.blobs, settings=ws.settings.synth)


STAGE = StageDef[Workspace, ExportUnit](
    name="export",
    key=unit_key,
    reads="verdicts",
    writes=dict.fromkeys(TABLES, "append"),
    sections=("rollout", "synth"),
    once=True,
    replaces=("episode_id", lambda unit: unit.episode.episode_id),
    load=load_export_units,
    run=run_export,
    shard_size=lambda s: 50,
)

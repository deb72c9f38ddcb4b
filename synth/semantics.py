"""Action-semantics data (paper 2.2.2): what an action is and what it does, from recorded steps.

Two tiers, both from steps a run recorded (reference replays, valid by construction, and
the policy's rollouts):

1. **action** (`tier: action`): the screens before and after a valid step, and the action
   that turned one into the other, straight from the step row. One row per valid executed
   step; no model.
2. **description** (`tier: description`): a sentence describing the action and its effect.
   The model writes it from the before screen with the action drawn on it (the critics'
   `annotate`), `synth.semantics_votes` times with a seed each (so each vote is its own
   cache entry, and a rerun is answered by the cache). Each vote is then checked against
   the before and after screens: by rules (does it name the element acted on, and what the
   after screen shows anew?) and by the model's check, whose score ranks the vote where its
   answer parses; the best-scoring consistent vote is kept, with every vote, both scores
   and the raw answers in `votes_json`. `synth.described_per_shard` steps per shard get
   this tier: up to 2k model calls a step.

A step that ends the episode or only answers has no screen effect and makes no row; nor does
a step whose screen did not change (the same screenshot blob before and after: any action that
does nothing would fit its label), or an invalid action; each is counted with its reason, as is a step whose
screenshot blob is missing or corrupt.

The unit is an episode, done once per configuration (`StageDef.once`); done again (another configuration, code
or prompt version), its new rows replace those earlier runs wrote for it in both tables, in the same version
(`StageDef.replaces`), so each step's newest rows are there once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from trajforge.critics.annotate import annotate
from trajforge.data.blobs import BlobCorrupted, BlobMissing
from trajforge.envs import actions
from trajforge.envs.axtree import AXNode, parse
from trajforge.llm import GatewayError, ImagePart, Sampling, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, to_call
from trajforge.schemas.ids import short_id
from trajforge.schemas.records import ActionSemantics, SemanticsChat, Step, steps_by_episode
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.synth.chat import chat_sample

PROMPTS = Path(__file__).parent / "prompts"
DESCRIBE, CHECK = "semantics_describe", "semantics_check"
NO_EFFECT = ("terminate", "answer")
"""Actions that end the episode or only report: nothing on the screen to learn from."""


class Check(BaseModel):
    consistent: bool
    score: float = Field(ge=0, le=1)
    reason: str = ""


@dataclass(frozen=True)
class EpisodeSteps:
    """One episode's steps, with what the action space needs (its viewport) and its task."""

    episode_id: str
    viewport: str
    instruction: str
    steps: list[Step]


def _action(step: Step) -> dict[str, Any]:
    return {"type": step.action_type, **json.loads(step.action_json)}


def _tool_call(step: Step, viewport: str) -> str:
    call = to_call(_action(step), FUNCTIONS[actions.space_for(viewport)])
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def action_text(step: Step) -> str:
    """A recorded action in words, for prompts and histories: `click {"x": 120, "y": 640} on link 'Cart'`."""
    target = f" on {step.target_role} '{step.target_name}'" if step.target_name else ""
    return f"{step.action_type} {step.action_json}{target}"


def first_sentence(text: str, limit: int = 300) -> str:
    """The answer's first sentence, unquoted: a description is one sentence, and small models go on."""
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    cut = re.search(r"(?<=[.!?])\s", line)
    return (line[: cut.start()] if cut else line)[:limit].strip().strip('"\'')


def rule_score(description: str, step: Step) -> tuple[float, str]:
    """How far the description agrees with the recorded step, without a model: it names the element acted on
    (from the before screen), and it names what the after screen shows anew (its title or a new element).
    0, 0.5 or 1, with what was found."""
    text = description.casefold()
    found = []
    if step.target_name and step.target_name.casefold() in text:
        found.append(f"names the target {step.target_name!r}")
    before = {n.name.casefold() for n in _nodes(step.ax_tree_before)}
    new = {n.name.casefold() for n in _nodes(step.ax_tree_after) if n.name} - before
    shown = [step.title_after.casefold()] if step.title_after != step.title_before else []
    shown += sorted(n for n in new if len(n) > 2)
    hit = next((n for n in shown if n and n in text), None)
    if hit is not None:
        found.append(f"names {hit!r} of the after screen")
    return len(found) / 2, "; ".join(found) or "names neither the target nor what the after screen shows"


def _nodes(tree: str | None) -> list[AXNode]:
    try:
        return parse(tree or "")
    except ValueError:
        return []


class _Describer:
    """Tier 2 for one step: k sampled descriptions, each checked; failures recorded, never guessed."""

    def __init__(self, ws: Workspace, out: StageOutput) -> None:
        self.ws, self.out = ws, out
        self.cfg = ws.settings.synth
        self.describe_prompt = load_prompt(DESCRIBE, PROMPTS)
        self.check_prompt = load_prompt(CHECK, PROMPTS)

    @property
    def prompt_version(self) -> str:
        return f"{DESCRIBE}@{self.describe_prompt.version},{CHECK}@{self.check_prompt.version}"

    def _ask(self, prompt: Any, schema: type[BaseModel] | None, sampling: Sampling | None, **variables: Any
             ) -> tuple[Any, str, str | None]:
        """(parsed answer, or the text without a schema; raw text; why it failed or None)."""
        try:
            result = self.ws.gateway.chat_sync(prompt.render(**variables), model=self.cfg.model, schema=schema,
                                               sampling=sampling)
        except GatewayError as exc:
            return None, "", f"no answer: {exc.record.error}"
        self.out.models["semantics"] = result.record.model_id
        if schema is None:
            return result.text, result.text, None
        return result.parsed, result.text, None if result.parsed is not None else f"did not parse: {result.parse_error}"

    def describe(self, step: Step, before: bytes) -> tuple[str | None, list[dict[str, Any]], str]:
        """(kept description or None, every vote, annotated screenshot sha).

        Each vote is scored by the rules (`rule_score`) and, when its answer parses, by the model's check
        against before + after; the model's score ranks where it exists, and the vote says which scored it."""
        drawn = annotate(before, _action(step), step.target_box)
        annotated = self.ws.blobs.put(drawn).sha256 if drawn is not None else step.screenshot_before
        votes: list[dict[str, Any]] = []
        base = self.describe_prompt.sampling
        for seed in range(self.cfg.semantics_votes):
            sampling = Sampling(temperature=base.temperature, top_p=base.top_p, max_tokens=base.max_tokens, seed=seed)
            text, raw, error = self._ask(self.describe_prompt, None, sampling, action=action_text(step),
                                         screenshots=[ImagePart(sha256=annotated, ax_tree=step.ax_tree_before)])
            description = first_sentence(text or "")
            vote: dict[str, Any] = {"seed": seed, "description": description or None, "raw_output": raw,
                                    "error": error or (None if description else "empty answer")}
            if description:
                vote["rule_score"], vote["rule_reason"] = rule_score(description, step)
                check, check_raw, check_error = self._ask(
                    self.check_prompt, Check, None, action=action_text(step), description=description,
                    screenshots=[ImagePart(sha256=step.screenshot_before, ax_tree=step.ax_tree_before),
                                 ImagePart(sha256=step.screenshot_after, ax_tree=step.ax_tree_after)])
                vote["check_raw_output"], vote["check_error"] = check_raw, check_error
                if isinstance(check, Check):
                    vote |= {"scored_by": "model", "score": check.score, "consistent": check.consistent,
                             "check_reason": check.reason}
                else:
                    vote |= {"scored_by": "rules", "score": vote["rule_score"], "consistent": vote["rule_score"] >= 0.5}
                self.out.stats[f"tier-2 votes scored by the {vote['scored_by']}"] += 1
            else:
                self.out.stats["tier-2 votes without a description"] += 1
            votes.append(vote)
        scored = [v for v in votes if v.get("consistent")]
        best = max(scored, key=lambda v: v["score"])["description"] if scored else None
        return best, votes, annotated


def semantics(units: list[EpisodeSteps], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Tier-1 rows for every valid step of the shard, tier-2 rows for `synth.described_per_shard` of them."""
    out = StageOutput(rows={"action_semantics": [], "train_semantics": []}, models={}, prompts={})
    describer = _Describer(ws, out)
    tag = ws.run_tag(run_id)
    usable: list[tuple[EpisodeSteps, Step, bytes, bytes]] = []
    for unit in units:
        for step in unit.steps:
            if not step.action_valid:
                out.dropped["invalid action: not executed, nothing to learn"] += 1
                continue
            if step.action_type in NO_EFFECT:
                out.dropped[f"{step.action_type}: no effect on the screen"] += 1
                continue
            if step.screenshot_before == step.screenshot_after:  # any action that does nothing fits the label
                out.dropped["the screen did not change (one screenshot before and after)"] += 1
                continue
            try:
                before, after = ws.blobs.get(step.screenshot_before), ws.blobs.get(step.screenshot_after)
            except (BlobMissing, BlobCorrupted) as exc:
                out.dropped[f"screenshot blob {type(exc).__name__}"] += 1
                continue
            usable.append((unit, step, before, after))
    for unit, step, before, after in usable:
        row = ActionSemantics(
            run_id=run_id, semantics_id=short_id(step.step_id, "action"), step_id=step.step_id,
            episode_id=step.episode_id, tier="action", screenshot_before=step.screenshot_before,
            screenshot_after=step.screenshot_after, width=step.width, height=step.height,
            action_type=step.action_type, action_json=step.action_json, target_role=step.target_role,
            target_name=step.target_name)
        out.rows["action_semantics"].append(row)
        out.rows["train_semantics"].append(chat_sample(
            SemanticsChat, run_id=run_id, sample_id=short_id(run_id, row.semantics_id), source_id=row.semantics_id,
            system=f"You are a GUI agent on a {step.width}x{step.height} screen. Coordinates are pixels of the "
                   "screenshot, x to the right and y down from its top-left corner.",
            turns=[("The first screenshot is the screen before one action, the second the screen after it. Which "
                    "action turned the first into the second? Answer with one <tool_call>.",
                    _tool_call(step, unit.viewport))],
            images=[before, after], tag=tag, episode_id=step.episode_id))
    budget = ws.settings.synth.described_per_shard if ws.settings.synth.writer == "model" else 0
    worth_describing = sorted(usable, key=lambda u: not u[1].target_name)
    for unit, step, before, after in worth_describing[:budget]:  # a target named first
        description, votes, annotated = describer.describe(step, before)
        out.prompts[DESCRIBE], out.prompts[CHECK] = describer.describe_prompt.version, describer.check_prompt.version
        if description is None:
            out.dropped["tier 2: no vote was judged consistent with the before and after screens"] += 1
            continue
        row = ActionSemantics(
            run_id=run_id, semantics_id=short_id(step.step_id, "description"), step_id=step.step_id,
            episode_id=step.episode_id, tier="description", screenshot_before=step.screenshot_before,
            screenshot_after=step.screenshot_after, annotated_screenshot=annotated, width=step.width,
            height=step.height, action_type=step.action_type, action_json=step.action_json,
            target_role=step.target_role, target_name=step.target_name, description=description,
            votes_json=json.dumps(votes), model_id=out.models.get("semantics"),
            prompt_version=describer.prompt_version)
        out.rows["action_semantics"].append(row)
        drawn = ws.blobs.get(annotated)
        out.rows["train_semantics"].append(chat_sample(
            SemanticsChat, run_id=run_id, sample_id=short_id(run_id, row.semantics_id), source_id=row.semantics_id,
            system="You describe GUI actions and their effects.",
            turns=[("The first screenshot is the screen before an action, drawn on it (a red ring where it acted, a "
                    "green box around its target); the second is the screen after it. Describe the action and its "
                    "effect in one sentence.", description)],
            images=[drawn, after], tag=tag, episode_id=step.episode_id))
    out.stats["tier-1 rows"] += sum(r.tier == "action" for r in out.rows["action_semantics"])  # type: ignore[union-attr]
    out.stats["tier-2 rows"] += sum(r.tier == "description" for r in out.rows["action_semantics"])  # type: ignore[union-attr]
    return out


def load_episodes(ws: Workspace, snapshot: int | None) -> Inputs[EpisodeSteps]:
    """The episodes of the steps a run wrote, each with its steps in order, its viewport and instruction from
    `episodes@latest` read at the version named in the lineage."""
    steps, snapshot = ws.catalog.rows_added("steps", snapshot)
    read = ws.catalog.latest_versions("episodes")
    episodes = (ws.catalog.scan("episodes", read.get("episodes")).select("episode_id", "viewport", "instruction")
                .filter(pl.col("episode_id").is_in(steps["episode_id"].unique().to_list())).collect())
    about = {r["episode_id"]: r for r in episodes.to_dicts()}
    by_episode = steps_by_episode(steps.to_dicts())
    units = [EpisodeSteps(eid, about.get(eid, {}).get("viewport", "mobile"), about.get(eid, {}).get("instruction", ""),
                          st) for eid, st in by_episode.items()]
    return Inputs(units=units, snapshots={"steps": snapshot} | read)


STAGE = StageDef[Workspace, EpisodeSteps](
    name="semantics",
    key=lambda u: u.episode_id,
    reads="steps",
    writes={"action_semantics": "append", "train_semantics": "append"},
    sections=("synth", "llm"),
    once=True,
    replaces=("episode_id", lambda u: u.episode_id),
    load=load_episodes,
    run=semantics,
    shard_size=lambda s: 25,
)

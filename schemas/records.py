"""Row models of the pipeline's tables.

Each model is the contract of one table. Rows are validated against it when a stage
writes them, so a bad row fails at the stage that made it, not in a training job weeks
later. Nested or open-ended values (action arguments, slot values, app state) are JSON
strings: Iceberg schemas stay stable while the payloads evolve.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _check_json(value: str) -> str:
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg}") from None
    return value


class Record(BaseModel):
    """Base of every table row: unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: ClassVar[int] = 1
    table: ClassVar[str]
    key: ClassVar[str]

    run_id: str = Field(description="The run that wrote this row.")


class Query(Record):
    """A task for the agent, with what is needed to replay and check it."""

    table: ClassVar[str] = "queries"
    key: ClassVar[str] = "query_id"

    query_id: str
    app: str
    source: Literal["page_graph", "deep_search", "atomic", "miniwob", "imported"]
    instruction: str
    path: list[str] = Field(description="Page ids of the sampled path, start page first.")
    slots_json: str = Field(description="Slot values chosen along the path, as a JSON object.")
    checker: str = Field(description="Name of the programmatic checker of the goal state.")
    checker_params_json: str
    max_steps: int = Field(gt=0)
    generator: str = Field(description="What wrote the instruction, with its version.")
    created_at: datetime
    actions_json: str | None = Field(
        default=None,
        description="UI operations done after the path's last page, as a JSON list of objects "
        "{op, role, name, text?, to_role?, to_name?} (query_gen.operations.Operation): an "
        "atomic-operation query's one operation, or a deep-search query's pathway of clicks. "
        "None: the path alone is the task.",
    )
    attempts: int | None = Field(default=None, ge=0, description=(
        "Episodes that tried this query, across runs (the self-evolving loop's difficulty); "
        "None before any has."))
    successes: int | None = Field(default=None, ge=0, description="Of those attempts, how many succeeded.")

    _json = field_validator("slots_json", "checker_params_json")(_check_json)

    @field_validator("actions_json")
    @classmethod
    def _actions_list(cls, value: str | None) -> str | None:
        if value is not None and not isinstance(json.loads(_check_json(value)), list):
            raise ValueError("must be a JSON list of operations")
        return value


class Episode(Record):
    """One attempt of one query in a live environment."""

    table: ClassVar[str] = "episodes"
    key: ClassVar[str] = "episode_id"

    episode_id: str
    query_id: str
    app: str
    instruction: str
    policy: str
    model_id: str
    prompt_version: str
    viewport: str = Field(description="'mobile' or 'desktop' or WIDTHxHEIGHT.")
    status: Literal["terminated", "max_steps", "env_fault", "stalled"] = Field(
        description="stalled: the policy gave too many invalid actions in a row to go on."
    )
    num_steps: int = Field(ge=0)
    final_url: str = Field(description="The last observation's URL, as steps keep theirs; empty when the env "
                           "failed before the first.")
    final_state_json: str = Field(description="The app's state read from its server when the episode ended.")
    fault: str | None = None
    started_at: datetime
    finished_at: datetime
    # Added after the first release: optional, so tables written before them stay valid.
    fault_kind: Literal["browser_crash", "timeout", "app_down", "other"] | None = Field(
        default=None, description="What failed in an env_fault episode (the env's, never the agent's fault)."
    )
    attempt: int | None = Field(
        default=None, ge=1, description="1 for a query's first episode; a rerun after an env fault counts up."
    )
    guidance_id: str | None = Field(
        default=None, description="The guidance row (table guidance) offered to the policy for this query; None: unguided."
    )
    sample: int | None = Field(
        default=None, ge=0, description="Which of the query's rollout.samples_per_query attempts this night (0 first).")
    seed: int | None = Field(
        default=None, description="The sampled attempt's seed (part of each model call's cache key); None: greedy.")
    source: Literal["policy", "reference"] | None = Field(
        default="policy", description="reference: the query's reference path replayed (stage `reference`), correct "
        "by construction; policy: the configured policy acted (None in rows written before this field).")
    query_version: str | None = Field(
        default=None, description="Hash of the query and its app spec: a reference episode is reused while it holds.")
    success: bool | None = Field(
        default=None, description="The query's checker on the final state, where the stage that wrote the episode "
        "ran it (reference episodes); None: the critics judge it.")
    attempt_key: str | None = Field(
        default=None, description="Hash of what decided the rollout's attempt (query version, policy settings, "
        "model, guidance, seed base, code): a later night does not roll a query whose attempts it holds with the "
        "same key (rollout.reroll_identical). None: reference episodes and rows written before this field.")

    _json = field_validator("final_state_json")(_check_json)


class Step(Record):
    """One action with the observations before and after it."""

    table: ClassVar[str] = "steps"
    key: ClassVar[str] = "step_id"

    step_id: str
    episode_id: str
    step_index: int = Field(ge=0)
    screenshot_before: str = Field(description="sha256 of the screenshot blob before the action.")
    screenshot_after: str
    width: int = Field(gt=0, description="Screenshot width in pixels; coordinates are pixels of it.")
    height: int = Field(gt=0)
    url_before: str = Field(description="The page's path on the app's origin ('/search?q=pizza'), or its whole URL "
                            "on another origin (`envs.browser.recorded_url`); secrets masked.")
    url_after: str
    title_before: str
    title_after: str
    ax_tree_before: str = Field(
        description="Accessibility tree rendered as indented 'role name' lines, each ending in its element's "
        "box '(x,y,w,h)' in screenshot pixels where it has one."
    )
    action_type: str
    action_json: str = Field(description="The action's arguments as a JSON object.")
    action_valid: bool
    action_error: str | None = None
    target_role: str | None = None
    target_name: str | None = None
    thought: str = Field(description="The policy's stated reason for the action.")
    raw_output: str = Field(description="The policy's output before parsing.")
    duration_ms: float = Field(ge=0)
    # Added after the first release: optional, so tables written before them stay valid.
    ax_tree_after: str | None = Field(default=None, description="Accessibility tree after the action.")
    target_box: list[float] | None = Field(
        default=None, description="[x, y, width, height] of the target element in screenshot pixels."
    )
    policy_error: str | None = Field(
        default=None, description="Why the policy's output could not be made an action (kept, not guessed)."
    )
    observation_mode: str | None = Field(
        default=None,
        description="How the policy's model saw the screen: 'image', or 'ocr+ax' when a text-only model got "
        "an OCR and accessibility-tree rendering of the screenshot instead of the image.",
    )
    model_calls_json: str | None = Field(
        default=None,
        description="The model calls behind the step: [{template, template_version, model_id, observation_mode, "
        "cached, reask, tokens_in, tokens_out, latency_ms, parse_error, constrained}]; constrained: how the "
        "answer was held to its format while decoding ('grammar', 'json_schema'), or null.",
    )
    roles_json: str | None = Field(
        default=None, description="Multi-agent policies: each role's inputs, raw output and parsed output."
    )

    _json = field_validator("action_json")(_check_json)


def steps_by_episode(rows: Iterable[dict[str, Any]]) -> dict[str, list[Step]]:
    """Step rows (a frame's `to_dicts()`) validated and grouped by episode, each episode's steps in order:
    where every stage that works an episode at a time starts."""
    grouped: dict[str, list[Step]] = {}
    for row in sorted(rows, key=lambda r: (r["episode_id"], r["step_index"])):
        grouped.setdefault(row["episode_id"], []).append(Step.model_validate(row))
    return grouped


class Page(Record):
    """A screen query generation saw while it explored an app's live pages: grounding learns from it too."""

    table: ClassVar[str] = "pages"
    key: ClassVar[str] = "screenshot"

    screenshot: str = Field(description="sha256 of the screenshot blob.")
    app: str
    viewport: str
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    url: str = Field(description="As in step rows: the path on the app's origin.")
    title: str
    ax_tree: str = Field(description="The accessibility tree as rendered in step rows (`envs.axtree.render`).")


class StepCritique(Record):
    """A critic's judgement of one step (paper 6.3: analysis, summary, label)."""

    table: ClassVar[str] = "step_critiques"
    key: ClassVar[str] = "critique_id"

    critique_id: str
    step_id: str
    episode_id: str
    critic: str
    model_id: str
    prompt_version: str
    analysis: str
    summary: str
    label: Literal["GOOD", "NEUTRAL", "HARMFUL"] | None = Field(
        description="None when the critic's output could not be parsed."
    )
    raw_output: str
    parse_error: str | None = None
    # Added after the first release: optional, so tables written before them stay valid.
    flags: list[str] | None = Field(
        default=None,
        description="Pre-filter findings: invalid_action, no_change (screen, tree and URL as before), "
        "repeated_action (the previous step's action again). A flagged step may be settled without a model.",
    )
    annotated_screenshot: str | None = Field(
        default=None, description="sha256 of the pre-action screenshot with the interaction drawn on it."
    )
    observation_mode: str | None = Field(
        default=None, description="How the critic's model saw the screenshots: 'image', 'ocr', or None (no model)."
    )


class Verdict(Record):
    """The trajectory-level judgement of an episode, with every channel's answer."""

    table: ClassVar[str] = "verdicts"
    key: ClassVar[str] = "verdict_id"

    verdict_id: str
    episode_id: str
    query_id: str
    success: bool
    consensus: str = Field(description="The consensus rule that combined the channels.")
    channels_json: str = Field(
        description="{channel: {answer, reason, model_id, ...}} for every channel, asked or not: answer is "
        "'success', 'failure', or null when the channel was not asked or its answer did not parse (reason says which)."
    )
    reason: str
    config_hash: str

    _json = field_validator("channels_json")(_check_json)


class QueryAttempt(Record):
    """One judged episode of a query: the per-query history the self-evolving loop reads (paper 2.2.1)."""

    table: ClassVar[str] = "query_history"
    key: ClassVar[str] = "episode_id"

    episode_id: str
    query_id: str
    app: str
    source: str = Field(description="The query's source (page_graph, atomic, deep_search, miniwob, ...).")
    iteration: int = Field(ge=0, description="The model iteration whose policy made the attempt: each policy model "
                           "id gets the next number the first night it acts (guidance.history.iterations).")
    policy: str
    model_id: str
    guidance_id: str | None = Field(default=None, description="The guidance the attempt was given, if any.")
    success: bool
    judged_at: datetime


class ReplayEntry(Record):
    """A successful trajectory kept for its query: the references guidance is distilled from."""

    table: ClassVar[str] = "replay_buffer"
    key: ClassVar[str] = "entry_id"

    entry_id: str
    query_id: str
    origin: Literal["rollout", "replay", "human"] = Field(
        description="rollout: an accepted episode; replay: the query's reference path replayed in the app; "
        "human: a demonstration imported from a file."
    )
    episode_id: str | None = Field(description="The episode it came from (None for a human demonstration).")
    instruction: str
    steps_json: str = Field(
        description="The steps in order: [{step_index, action_type, action_json, thought, target_role, target_name, "
        "target_box, action_valid, url_before, url_after, title_before, title_after, ax_tree_before, ax_tree_after, "
        "screenshot_before, screenshot_after}] (screenshots may be null for a demonstration)."
    )

    _json = field_validator("steps_json")(_check_json)


class Guidance(Record):
    """Query-specific guidance (paper 6.4): essential steps distilled from reference trajectories."""

    table: ClassVar[str] = "guidance"
    key: ClassVar[str] = "guidance_id"

    guidance_id: str
    query_id: str
    instruction: str
    text: str = Field(description="What the policy prompt gets: the summary, then the essential steps numbered.")
    essential_steps: list[str] = Field(description="The outcomes of the steps that passed quality control, in order.")
    references: list[str] = Field(description="Replay-buffer entry ids of the reference trajectories.")
    dropped_steps_json: str = Field(
        description="[{entry_id, step_index, reason}]: reference steps quality control dropped, and why."
    )
    outcomes_json: str = Field(
        description="[{entry_id, step_index, action, thought, outcome, kept}]: each reference step's described outcome."
    )
    describer: str = Field(description="'template' or the model id that described outcomes and wrote the summary.")
    prompt_version: str
    observation_mode: str = Field(
        description="How the describer saw before/after screens: 'image' (annotated screenshots), 'ocr+ax' (a "
        "text-only model given OCR and accessibility-tree text), or 'ax-diff' (template: tree and title changes)."
    )
    hard_reason: str = Field(description="Why the query was selected as hard (its recent success rate).")

    _json = field_validator("dropped_steps_json", "outcomes_json")(_check_json)


class TrainingStep(Record):
    """One row of the end-to-end training table: an accepted step as a Qwen2.5-VL chat sample."""

    table: ClassVar[str] = "train_e2e"
    key: ClassVar[str] = "sample_id"

    sample_id: str
    step_id: str
    episode_id: str
    query_id: str
    label: Literal["GOOD", "NEUTRAL"]
    messages_json: str = Field(
        description="Qwen2.5-VL chat messages: [{role, content: [{type: text, text} | {type: image}]}]; the "
        "assistant turn ends in a <tool_call> of the action space's function. Images are in `images`, in order."
    )
    images: list[bytes] = Field(description="PNG bytes of each {type: image} part, in message order.")
    tag: str = Field(description="The run's tag (nightly-YYYY-MM-DD) the table version also carries.")
    # Added with the rejection-sampling filters: optional, so tables written before them stay valid.
    score: float | None = Field(default=None, description="The step critic's score (filter 1, at least synth.tau_c).")
    p_succ: float | None = Field(default=None, description="The query's success rate over every attempt so far.")
    weight: float = Field(default=1.0, gt=0, description="Filter 3: sample the row with probability proportional to "
                          "this (easy tasks below 1, hard ones above).")

    _json = field_validator("messages_json")(_check_json)


Box = list[float]
"""[x, y, width, height] in pixels of the screenshot as stored (and as sent to the policy)."""


class GroundingSample(Record):
    """One grounding annotation of one screen (paper 2.2.2, Figure 5): an element, a word, a character or a region."""

    table: ClassVar[str] = "grounding"
    key: ClassVar[str] = "sample_id"

    sample_id: str
    screenshot: str = Field(description="sha256 of the screenshot blob.")
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    app: str
    url: str
    step_id: str | None = Field(
        description="A step whose screenshot this is (the first seen); None for a page query generation visited.")
    kind: Literal["element", "word", "char", "region"]
    box: Box
    point: list[float] = Field(description="[x, y]: the answer, the box's centre, in screenshot pixels.")
    role: str | None = Field(default=None, description="Element: its accessible role.")
    name: str | None = Field(default=None, description="Element: its accessible name.")
    text: str | None = Field(default=None, description="Word, char: the text the OCR read; region: what the model named.")
    description: str = Field(description="What the element does or is, as a sentence (functional description).")
    instruction: str = Field(description="The task-oriented request whose answer is `point`.")
    instruction_mode: Literal["template", "model", "fallback"] = Field(
        description="model: rephrased by the model; fallback: the model's rephrasing lost the element's name, so "
        "the template is kept.")
    description_mode: Literal["ax", "ocr", "vision", "region"] = Field(
        description="What made the description: the accessibility tree, the OCR, a vision model, or a region proposer.")
    detector: str | None = Field(
        default=None, description="The independent detection the box was checked against (ocr, contours, sam), if "
        "any; ocr-name: a text element whose block is wider than its text, kept because the OCR read its name inside "
        "the block, its box the text's extent.")
    iou: float | None = Field(default=None, description="IoU of the element's box in the tree with that detection "
                              "(kept rows: at least synth.iou_threshold, except ocr-name's).")
    model_id: str | None = None
    prompt_version: str | None = None


class ActionSemantics(Record):
    """What an action is and does (paper 2.2.2): tier 1 ("action") the action from before and after screens; tier 2 a
    description of the action and its effect, the best of k votes."""

    table: ClassVar[str] = "action_semantics"
    key: ClassVar[str] = "semantics_id"

    semantics_id: str
    step_id: str
    episode_id: str
    tier: Literal["action", "description"] = Field(description="action: tier 1 (before + after -> the action); description: tier 2.")
    screenshot_before: str
    screenshot_after: str
    annotated_screenshot: str | None = Field(
        default=None, description="Tier 2: sha256 of the before screenshot with the action drawn on it.")
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    action_type: str
    action_json: str
    target_role: str | None = None
    target_name: str | None = None
    description: str | None = Field(default=None, description="Tier 2: the action and its effect, the kept vote.")
    votes_json: str | None = Field(
        default=None, description="Tier 2: [{description, score, consistent, raw_output}] for every vote.")
    model_id: str | None = None
    prompt_version: str | None = None

    _json = field_validator("action_json")(_check_json)


class ReasoningSample(Record):
    """One sampled reasoning for a trusted step (GUI-Owl 2.2.3): kept when the action predicted from it alone
    matches the trusted action, or written with the answer given (`hinted_with_answer`), or distilled from the
    Mobile-Agent-v3 roles' outputs. Rejected samples are rows too (kept false), so a style's rate is countable."""

    table: ClassVar[str] = "reasoning_samples"
    key: ClassVar[str] = "reasoning_id"

    reasoning_id: str
    step_id: str
    episode_id: str
    query_id: str
    trusted: Literal["reference", "accepted"] = Field(
        description="Why the step's action is trusted: a checked reference replay, or a trajectory the critics "
        "accepted.")
    hint_style: str = Field(description="The prompt that asked for the reasoning: cot, simple, hinted or distilled.")
    attempt: int = Field(ge=0, description="Which try of its style (synth.reasoning_tries); its sampling seed.")
    reasoning: str
    raw_output: str
    trusted_action_json: str
    predicted_action_json: str | None = Field(
        default=None, description="The action a call seeing only the reasoning and the screen gave; None: no "
        "answer, or a hinted or distilled sample (not checked by prediction).")
    predict_raw_output: str | None = None
    matched: bool | None = Field(default=None, description="synth.match of predicted and trusted; None: not checked.")
    match_reason: str
    kept: bool
    hinted_with_answer: bool = Field(description="The model was shown the trusted action (no sampled reasoning matched).")
    model_id: str
    prompt_version: str

    _json = field_validator("trusted_action_json")(_check_json)


class Manual(Record):
    """A task manual per app and task family, distilled from successful trajectories, with its measured value."""

    table: ClassVar[str] = "manuals"
    key: ClassVar[str] = "manual_id"

    manual_id: str
    app: str
    family: str = Field(description="The task family: the query source and goal page, e.g. 'page_graph:compose'.")
    text: str
    episodes: list[str] = Field(description="The successful episodes it was distilled from.")
    trial_queries: list[str] = Field(description="The queries rerun with the manual as guidance.")
    success_before: float | None = Field(description="Their success rate before (query history); None: never tried.")
    success_with: float | None = Field(description="Their success rate rerun with the manual; None: not measured.")
    trial_episodes: list[str] = Field(default_factory=list, description="The episodes of those reruns.")
    mode: Literal["model", "template", "fallback"] = Field(
        description="Who wrote `text`: the model, the template (synth.writer: template), or the template because "
        "the model's answer was unusable.")
    model_id: str
    prompt_version: str


class Plan(Record):
    """A plan for a complex task over an app's features, each step checked against the app's page graph."""

    table: ClassVar[str] = "plans"
    key: ClassVar[str] = "plan_id"

    plan_id: str
    app: str
    task: str = Field(description="The task the model named for its walk.")
    steps: list[str] = Field(description="Each step in words, written from the page graph (the transition's actions "
                             "to the next step's page), not by the model; the last says the task is done.")
    pages: list[str] = Field(description="The page-graph pages the steps name, in order.")
    raw_output: str
    model_id: str
    prompt_version: str


class ChatSample(Record):
    """A training sample in the chat format of `train_e2e` (Qwen2.5-VL messages, PNG images in order)."""

    key: ClassVar[str] = "sample_id"

    sample_id: str
    source_id: str = Field(description="The row of the synthesis table it was made from.")
    messages_json: str = Field(description="[{role, content: [{type: text, text} | {type: image}]}].")
    images: list[bytes]
    tag: str

    _json = field_validator("messages_json")(_check_json)


class GroundingChat(ChatSample):
    table: ClassVar[str] = "train_grounding"

    screenshot: str | None = Field(
        default=None, description="sha256 of the screenshot its questions are about: grounding the screen again "
        "replaces its rows (`StageDef.replaces`). None in rows written before it was kept.")


class SemanticsChat(ChatSample):
    table: ClassVar[str] = "train_semantics"

    episode_id: str | None = Field(default=None, description=(
        "The episode of the step it teaches: a redo of the semantics stage replaces its rows by it (None in rows "
        "written before the column was)."))


class PlanningChat(ChatSample):
    table: ClassVar[str] = "train_planning"


class RoleChat(ChatSample):
    """One Mobile-Agent-v3 role's answer at a step of an accepted trajectory, asked as the role was asked."""

    step_id: str
    episode_id: str
    weight: float = Field(default=1.0, gt=0, description="The query's p_succ weight (filter 3).")


class ManagerChat(RoleChat):
    table: ClassVar[str] = "train_manager"


class WorkerChat(RoleChat):
    table: ClassVar[str] = "train_worker"


class ReflectorChat(RoleChat):
    table: ClassVar[str] = "train_reflector"

    outcome: Literal["SUCCESS", "FAILURE"]


class NotetakerChat(RoleChat):
    table: ClassVar[str] = "train_notetaker"


class ReasoningChat(ChatSample):
    """A trusted step as a policy sample (the messages of `train_e2e`) whose thinking is a kept reasoning."""

    table: ClassVar[str] = "train_reasoning"

    hint_style: str
    hinted_with_answer: bool
    episode_id: str | None = Field(default=None, description=(
        "The episode of the step it teaches: a redo of the reasoning stage replaces its rows by it (None in rows "
        "written before the column was)."))


class QValueSample(Record):
    """One step of an attempt as an agentic-Q training sample (Agentic-Q 2, 3.3): the windowed state, the action,
    and the return G_i = r_T (gamma = 1, no reward before the last step), the attempt's outcome."""

    table: ClassVar[str] = "agentic_q_values"
    key: ClassVar[str] = "value_id"

    value_id: str
    query_id: str
    episode_id: str
    step_id: str
    step_index: int = Field(ge=0)
    instruction: str
    history: list[str] = Field(description="The last agentic_q.window actions before the step, in words, oldest first "
                               "(the sliding window; thoughts are not part of the state).")
    screenshot: str = Field(description="sha256 of the screenshot the action was taken on.")
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    url: str
    state_key: str = Field(description="Hash of the screen (URL and accessibility tree) and the window: steps of "
                           "different attempts with one key are one state.")
    action_type: str
    action_json: str
    target_box: list[float] | None = None
    thought: str = Field(description="The policy's thought, kept for reference only: action-focus masks it out of "
                         "what the value is learned from.")
    value: float = Field(ge=0, le=1, description="G_i: 1 if the attempt succeeded, else 0.")
    level: int = Field(ge=0, description="l: successes out of the query's n attempts.")
    attempts: int = Field(gt=0, description="n: the attempts the level counts.")
    checker: str = Field(description="The query's checker and a hash of its parameters.")
    model_id: str = Field(description="The policy model that acted.")

    _json = field_validator("action_json")(_check_json)


class QGroup(Record):
    """K candidate actions sampled for one state, scored, with the SWPO filters' verdict (Agentic-Q 3.4)."""

    table: ClassVar[str] = "agentic_q_groups"
    key: ClassVar[str] = "group_id"

    group_id: str
    query_id: str
    state_key: str
    step_id: str = Field(description="A recorded step at this state (its screenshot and window are the state).")
    instruction: str
    history: list[str]
    screenshot: str
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    level: int = Field(ge=0)
    candidates_json: str = Field(description="[{raw_output, action, error, score, matched}] for each of the K "
                                 "candidates, in sample order (seed = position).")
    scores: list[float] = Field(description="g_i of each candidate.")
    advantages: list[float] = Field(description="(g_i - mean g) / std g; zeros for a dropped group.")
    mean_score: float
    weight: float | None = Field(description="u(s) = mean(g)^-1 / sum over the night's kept groups of mean(g)^-1; "
                                 "None for a dropped group.")
    kept: bool
    drop_reason: str | None = None
    observed: int = Field(ge=1, description="Recorded steps at this state the scores are estimated from.")
    scorer: str = Field(description="What scored the candidates: 'monte_carlo' (the mean return of the recorded "
                        "steps at this state whose action matches the candidate).")
    model_id: str
    prompt_version: str

    _json = field_validator("candidates_json")(_check_json)


class PalUITeacher(Record):
    """One PAL-UI teacher pass over a trusted step (pal-ui-active-lookback.md 4.1, 4.3): the dual-level memory of
    the earlier steps, the four-stage deliberation, the optional look-back, and the action checked against the
    trusted one. Rejected passes are rows too (kept false, with why), so the acceptance rate is countable."""

    table: ClassVar[str] = "pal_ui_teacher"
    key: ClassVar[str] = "sample_id"

    sample_id: str
    step_id: str
    episode_id: str
    query_id: str
    step_index: int = Field(ge=0, description="i: the step's position in its episode.")
    trusted: Literal["reference", "accepted"]
    checker: str = Field(description="The query's checker and a hash of its parameters (`name@hash`).")
    instruction: str
    viewport: str
    screenshot: str = Field(description="sha256 of o_i, the screenshot the action was taken on.")
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    memory_json: str = Field(description="m_i: [{step_index, action, caption, caption_error, caption_model, "
                             "caption_prompt, validation, validation_error, validation_model, validation_prompt, "
                             "screenshot, width, height}] for each earlier step j < i, oldest first.")
    teacher_raw_output: str = Field(description="The deliberation call's answer as given ('' when not asked).")
    deliberation_json: str | None = Field(
        default=None, description="The parsed deliberation {history_revision, candidates, confidence, retrieve}; "
        "None: not asked or did not parse.")
    act_raw_output: str | None = Field(default=None, description="The action call's answer; None: not asked.")
    retrieved_step: int | None = Field(default=None, description="j, the step the teacher looked back at; None: none.")
    retrieved_screenshot: str | None = Field(default=None, description="sha256 of o_j.")
    distance: int | None = Field(default=None, description="i - j; None without a look-back.")
    predicted_action_json: str | None = None
    trusted_action_json: str
    matched: bool | None = Field(default=None, description="synth.match of predicted and trusted; None: not checked.")
    match_reason: str
    kept: bool
    model_id: str
    prompt_version: str = Field(description="`name@version` of the deliberation and action prompts asked.")

    _json = field_validator("memory_json", "trusted_action_json")(_check_json)


class PalUIChat(ChatSample):
    """A kept PAL-UI teacher pass as a chat sample: memory and screen in, `<think>` and `<tool_use>` out; a
    look-back sample calls `retrieve`, is shown o_j, then acts."""

    table: ClassVar[str] = "pal_ui_sft"

    step_id: str
    episode_id: str
    weight: float = Field(gt=0, description="1 + pal_ui.distance_weight * (distance - 1) for a look-back, else 1.")
    retrieved_step: int | None = Field(default=None, description="j; None: no look-back.")
    distance: int | None = Field(default=None, description="i - j; None: no look-back.")


class CESGroup(Record):
    """One CES execution-feedback group (ces-coordinator-executor-state-tracker.md, 4.3.2, A.1, A.2): N sampled
    outputs of one role for one trusted step, each scored through the frozen executor's action at that step,
    R = alpha_format R_format + alpha_exec (gamma_type R_type + gamma_param R_param), with group-normalised
    advantages. The prompt is kept as chat messages with its images, so an RL trainer can replay it."""

    key: ClassVar[str] = "group_id"

    group_id: str
    step_id: str
    episode_id: str
    query_id: str
    step_index: int = Field(ge=0)
    trusted: Literal["reference", "accepted"]
    checker: str = Field(description="The query's checker and a hash of its parameters (`name@hash`); '' unknown.")
    messages_json: str = Field(description="The sampled role's prompt: [{role, content: [{type: text, text} | "
                               "{type: image}]}], no answer.")
    images: list[bytes] = Field(description="PNG bytes of the prompt's image parts, in order.")
    state_input: str = Field(description="The task state the prompt was given (m^{t-1} for the coordinator, "
                             "m^{t-2} for the state tracker).")
    state_input_silver: bool = Field(description="The state input was written by the state tracker model (not "
                                     "annotated); false: the fixed start state or the trusted actions in words.")
    responses: list[str] = Field(description="The N raw outputs.")
    executor_outputs: list[str | None] = Field(description="The executor's raw answer per candidate; None: not "
                                               "asked (no instruction to execute).")
    executor_actions: list[str | None] = Field(description="The executor's action per candidate as JSON; None: "
                                               "none (not asked, or its answer was no usable call).")
    reasons: list[str] = Field(description="Per candidate, what decided its reward (format, match result).")
    format_rewards: list[float]
    type_rewards: list[float]
    param_rewards: list[float]
    exec_rewards: list[float]
    rewards: list[float]
    advantages: list[float] = Field(description="(r - mean) / std over the group (CES eq. 5); zeros when all equal.")
    zero_variance: bool = Field(description="All N rewards are equal: the group teaches GRPO nothing.")
    trusted_action_json: str
    target_box: list[float] | None = None
    model_id: str = Field(description="The model that sampled the N outputs.")
    executor_model_id: str = Field(description="The frozen executor's model ('' when it was never asked).")
    prompt_versions: str = Field(description="`name@version` of every prompt behind the rewards, comma-separated.")

    _json = field_validator("messages_json", "trusted_action_json")(_check_json)


class CESCoordinatorGroup(CESGroup):
    """Stage 1 (CES A.1): N atomic instructions sampled from the coordinator given (s^t, q, silver m^{t-1})."""

    table: ClassVar[str] = "ces_coordinator_rl"

    instructions: list[str | None] = Field(description="The <answer> of each output; None: format broken.")
    ceiling_ok: bool = Field(description="The executor given the trusted (template) instruction matches the step.")
    floor_ok: bool = Field(description="The executor given the raw task matches the step.")


class CESStateTrackerGroup(CESGroup):
    """Stage 2 (CES A.1): N states m^{t-1} sampled from the state tracker given (q, silver m^{t-2}, u^{t-1}), each
    scored through the frozen coordinator (greedy) and the frozen executor at step t."""

    table: ClassVar[str] = "ces_state_tracker_rl"

    states: list[str | None] = Field(description="The <answer> of each output; None: format broken.")
    coordinator_outputs: list[str | None] = Field(description="The frozen coordinator's raw answer given each "
                                                  "state; None: not asked (no state).")
    instructions: list[str | None] = Field(description="The frozen coordinator's instruction given each state.")
    step_images: list[bytes] = Field(description="PNG of the screen s^t the coordinator and executor saw (the state "
                                     "tracker itself sees none), to rescore new samples.")


class CESChat(ChatSample):
    """A CES warm-up SFT sample (CES 4.3.1, B.1) of one trusted step."""

    step_id: str
    episode_id: str
    silver: bool = Field(description="The task state in the sample (the coordinator's input, the state tracker's "
                         "answer) was written by the state tracker model, not annotated.")


class CESCoordinatorChat(CESChat):
    """(s^t, q, m^{t-1}) -> <think>the step's thought</think><answer>the trusted atomic instruction</answer>."""

    table: ClassVar[str] = "ces_coordinator_sft"


class CESStateTrackerChat(CESChat):
    """(q, u^t, m^{t-1}) -> <think>..</think><answer>m^t</answer>, the silver state."""

    table: ClassVar[str] = "ces_state_tracker_sft"


class Checkpoint(Record):
    """A model the loop trained (paper 2.2.3, eq. 2: M(k+1) = Train(M(k), T(k))): what it was trained from and on,
    and the name the next night's policy asks it by."""

    table: ClassVar[str] = "checkpoints"
    key: ClassVar[str] = "model_id"

    model_id: str = Field(description="Its model name in the gateway: the checkpoint folder (served in process; "
                          "its answers are recorded under FOLDER@FINGERPRINT, a digest of its config and weight "
                          "files), or ENDPOINT:FOLDER (served by that endpoint, its answers recorded under FOLDER).")
    checkpoint_hash: str = Field(description="sha256 over the folder's files, names and bytes: the same id naming "
                                 "other weights is told apart.")
    folder: str
    served_by: str = Field(description="'local' (the gateway loads the folder) or the llm endpoint that serves it.")
    base_model_id: str = Field(description="M(k): the policy model of the night whose data trained it.")
    root_model_id: str = Field(description="The configured policy model the chain of checkpoints started from; "
                               "a night follows the latest checkpoint of its own root.")
    trained_on: list[str] = Field(description="The training table versions it was trained on, as TABLE@SNAPSHOT.")
    samples: int = Field(ge=0, description="Training samples handed to the trainer, over all tables.")
    steps: int = Field(gt=0, description="loop.train_steps: the optimiser steps asked of the trainer.")
    trainer: str = Field(description="The trainer command as run, secrets masked.")
    seconds: float = Field(ge=0, description="Wall time of the trainer command.")
    created_at: datetime


RECORDS: dict[str, type[Record]] = {
    m.table: m
    for m in (Query, Page, Episode, Step, StepCritique, Verdict, QueryAttempt, ReplayEntry, Guidance, TrainingStep,
              GroundingSample, ActionSemantics, Manual, Plan, GroundingChat, SemanticsChat, PlanningChat,
              ReasoningSample, ReasoningChat, ManagerChat, WorkerChat, ReflectorChat,
              NotetakerChat, QValueSample, QGroup, PalUITeacher, PalUIChat, CESCoordinatorGroup,
              CESStateTrackerGroup, CESCoordinatorChat, CESStateTrackerChat, Checkpoint)
}

"""PAL-UI's training table (pal-ui-active-lookback.md 4.3, "Data Filtering and Balancing", "Compilation and
Formatting"): the kept teacher passes, balanced, weighted and written as chat samples.

The teacher (`synth.pal_ui`) already dropped every pass whose action missed the trusted
one. This stage reads the passes one run wrote, as one shard (balancing and the
histograms are over the whole night, not over a slice of it), and:

- balances look-back samples against direct ones to `pal_ui.retrieval_share` (the paper:
  4.3K of each): the class short of its share is kept whole, and the other is cut to the
  share, dropping deterministically by a hash of the sample id (a rerun drops the same
  rows), each drop counted with its reason; when one class is empty there is nothing to
  balance against: the other is kept whole and that is counted;
- weights a look-back sample by `1 + pal_ui.distance_weight * (distance - 1)` (the paper
  raised the sampling weight of samples looking further back, since the teacher prefers
  the previous step; it gives no number), a direct one by 1;
- writes each as Qwen2.5-VL chat messages (`pal_ui_policy`: the action tools and a
  `retrieve(step)` tool in the system turn; task, memory and current screenshot in the
  user turn). The answer is `<think>...</think><tool_use>{call}</tool_use>`; a look-back
  sample answers with the retrieve call, is shown o_j in a user turn, and answers again
  with the action. The paper has a stronger LLM (Qwen3-32B) merge the four deliberation
  stages into one explanation; here a template joins them in order, standing in for it.

Its summary: the teacher's match rate, the look-back share, the i - j histogram before and
after weighting, and the mean prompt length with the memory against with every earlier
screenshot instead (the paper's Table 3 comparison). Prompt lengths are estimates, with no
tokenizer: an image counts as Qwen2.5-VL's ceil(w/28) * ceil(h/28) tokens (one per 28x28
pixels, before the processor's resizing), text as len/4 (the usual characters-per-token
rule of thumb for English); the paper measured with the real tokenizer.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import polars as pl

from trajforge.envs import actions
from trajforge.llm import ImagePart, Prompt, RenderedPrompt, TextPart, load_prompt
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import FUNCTIONS, to_call, tool_spec
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import PalUIChat, PalUITeacher
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.synth.ask import PROMPTS
from trajforge.synth.chat import chat_messages
from trajforge.synth.pal_ui import Deliberation, memory_text, reason_kind

POLICY = "pal_ui_policy"
ONE_SHARD = 1_000_000_000
"""Shard size that puts a night's passes in one shard: the balance and the histograms are over all of them."""

RETRIEVE_TOOL = json.dumps({"type": "function", "function": {
    "name": "retrieve",
    "description": "Show the screenshot of an earlier step again (steps are numbered from 0, as in the memory).",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer", "minimum": 0}},
                   "required": ["step"]}}})
"""PAL-UI's Retrieve tool (4.1), beside the action space's function."""

PATCH = 28
"""Pixels per side of the image area one Qwen2.5-VL visual token covers (14-pixel patches merged 2x2)."""


def image_tokens(width: int, height: int) -> int:
    """Qwen2.5-VL's visual tokens for an image, estimated without resizing: ceil(w/28) * ceil(h/28)."""
    return math.ceil(width / PATCH) * math.ceil(height / PATCH)


def text_tokens(text: str) -> int:
    """Tokens of a text, estimated without a tokenizer as len/4 (rounded up)."""
    return math.ceil(len(text) / 4)


def weight_of(distance: int | None, distance_weight: float) -> float:
    """A sample's weight: 1 + distance_weight * (distance - 1) for a look-back, 1 without one."""
    return 1.0 if distance is None else 1.0 + distance_weight * (distance - 1)


def balance(rows: list[PalUITeacher], share: float) -> tuple[list[PalUITeacher], Counter[str], Counter[str]]:
    """The rows with look-backs making `share` of them: (kept in input order, drops by reason, other counts).
    The class short of its share is kept whole; the other keeps the rows of smallest hash of sample id."""
    looked = [r for r in rows if r.retrieved_step is not None]
    direct = [r for r in rows if r.retrieved_step is None]
    dropped: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    if not looked or not direct:
        if rows:
            stats[f"could not balance: no {'look-back' if not looked else 'direct'} samples, the rest kept whole"] += 1
        return rows, dropped, stats
    if len(looked) * (1 - share) > len(direct) * share:  # too many look-backs (share < 1 here)
        majority, name, keep = looked, "look-back", int(len(direct) * share / (1 - share) + 1e-9)
    else:  # too many direct samples, or exactly balanced (share > 0 here)
        majority, name, keep = direct, "direct", int(len(looked) * (1 - share) / share + 1e-9)
    cut = {r.sample_id for r in sorted(majority, key=lambda r: digest(r.sample_id))[keep:]}
    if cut:
        dropped[f"balance: {name} sample beyond pal_ui.retrieval_share {share}"] += len(cut)
    return [r for r in rows if r.sample_id not in cut], dropped, stats


def _think(plan: Deliberation) -> str:
    """Stages 1 to 3 joined in order: the template that stands in for the paper's LLM merge."""
    return (f"{plan.history_revision.strip()} Possible next actions: {'; '.join(c.strip() for c in plan.candidates)}. "
            f"{plan.confidence.strip()}")


def _words(action: dict[str, Any]) -> str:
    """An action as the last sentence of a thought: its type and its arguments."""
    args = ", ".join(f"{k} {json.dumps(v)}" for k, v in action.items() if k != "type")
    return f"{action['type']}{f' with {args}' if args else ''}"


def _prompt_text(rendered: RenderedPrompt) -> str:
    return "\n".join(p.text for m in rendered.messages for p in m.content if isinstance(p, TextPart))


def to_chat(row: PalUITeacher, prompt: Prompt, ws: Workspace, *, run_id: str, tag: str,
            weight: float) -> tuple[PalUIChat, int, int]:
    """A kept pass as a chat row, with the estimated prompt tokens with its memory and with every earlier
    screenshot in the memory's place."""
    space = actions.space_for(row.viewport)
    function = FUNCTIONS[space]
    memory = json.loads(row.memory_json)
    plan = Deliberation.model_validate_json(row.deliberation_json or "")
    action = json.loads(row.trusted_action_json)
    call = f"<tool_use>{json.dumps(to_call(action, function))}</tool_use>"
    variables = {"platform": space, "width": row.width, "height": row.height, "tools": tool_spec(space),
                 "retrieve": RETRIEVE_TOOL, "task": row.instruction, "step": row.step_index,
                 "screenshots": [ImagePart(sha256=row.screenshot)]}
    rendered = prompt.render(memory=memory_text(memory), **variables)
    j = row.retrieved_step
    if j is None:
        answer = f"<think>{_think(plan)} So I act: {_words(action)}.</think>{call}"
        messages_json, images = chat_messages(rendered, answer, ws.blobs)
    else:
        ask = f"<think>{_think(plan)} I look back at step {j} to check.</think>" \
              f"<tool_use>{json.dumps({'name': 'retrieve', 'arguments': {'step': j}})}</tool_use>"
        messages_json, images = chat_messages(rendered, ask, ws.blobs)
        messages = json.loads(messages_json)
        messages += [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"The screenshot of step {j}."}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"<think>With the screen of step {j} in view, "
                                                                       f"I act: {_words(action)}.</think>{call}"}]}]
        messages_json = json.dumps(messages)
        images = [*images, ws.blobs.get(row.retrieved_screenshot or "")]
    with_memory = text_tokens(_prompt_text(rendered)) + image_tokens(row.width, row.height)
    if j is not None:
        back = memory[j]
        with_memory += image_tokens(back["width"], back["height"])
    every_screen = prompt.render(memory="\n".join(f"Step {m['step_index']}. Action: {m['action']}" for m in memory)
                                 or "None yet.", **variables)
    with_screens = text_tokens(_prompt_text(every_screen)) + image_tokens(row.width, row.height) + sum(
        image_tokens(m["width"], m["height"]) for m in memory)
    chat = PalUIChat(run_id=run_id, sample_id=short_id(run_id, row.sample_id), source_id=row.sample_id,
                     messages_json=messages_json, images=images, tag=tag, step_id=row.step_id,
                     episode_id=row.episode_id, weight=weight, retrieved_step=j, distance=row.distance)
    return chat, with_memory, with_screens


def compile_sft(units: list[PalUITeacher], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """The night's kept passes balanced, weighted and written as chat rows, with the summary's counts."""
    cfg = ws.settings.pal_ui
    prompt = load_prompt(POLICY, PROMPTS)
    out = StageOutput(rows={"pal_ui_sft": []}, prompts={POLICY: prompt.version})
    kept, dropped, stats = balance(units, cfg.retrieval_share)
    out.dropped.update(dropped)
    out.stats.update(stats)
    tag = ws.run_tag(run_id)
    for row in kept:
        weight = weight_of(row.distance, cfg.distance_weight)
        chat, with_memory, with_screens = to_chat(row, prompt, ws, run_id=run_id, tag=tag, weight=weight)
        out.rows["pal_ui_sft"].append(chat)
        out.stats["rows"] += 1
        out.stats["prompt tokens with memory"] += with_memory
        out.stats["prompt tokens with all screenshots"] += with_screens
        if row.distance is not None:
            out.stats["rows with a look-back"] += 1
            out.stats[f"distance {row.distance} before weighting"] += 1
            out.stats[f"distance {row.distance} after weighting (hundredths)"] += round(100 * weight)
    return out


def _histogram(stats: dict[str, int], suffix: str, scale: float = 1) -> str:
    found = sorted((int(k.split(" ")[1]), v / scale) for k, v in stats.items()
                   if k.startswith("distance ") and k.endswith(suffix))
    return ", ".join(f"{d}: {n:g}" for d, n in found) or "none"


def pal_ui_sft_summary(stats: dict[str, int]) -> str | None:
    """Teacher acceptance, look-back share, the i - j histogram before and after weighting, and the mean
    estimated prompt tokens with memory against with all screenshots (None: no teacher pass read)."""
    passes = stats.get("teacher passes", 0)
    if not passes:
        return None
    kept, rows, looked = stats.get("teacher passes kept", 0), stats.get("rows", 0), stats.get("rows with a look-back", 0)
    line = (f"teacher matched {kept}/{passes} ({kept / passes:.0%}); {rows} rows, {looked} with a look-back"
            f"{f' ({looked / rows:.0%})' if rows else ''}; i - j before weighting: "
            f"{_histogram(stats, ' before weighting')}; after: {_histogram(stats, ' (hundredths)', 100)}")
    if rows:
        line += (f"; mean prompt tokens {stats.get('prompt tokens with memory', 0) / rows:.0f} with memory vs "
                 f"{stats.get('prompt tokens with all screenshots', 0) / rows:.0f} with all screenshots")
    return line


# ---------------------------------------------------------------- the stage


def load_passes(ws: Workspace, snapshot: int | None) -> Inputs[PalUITeacher]:
    """The kept passes of the run that wrote this version of `pal_ui_teacher`; the others counted by reason. The
    episodes `pal_ui_sft` holds chat samples of that this version (and the latest, see `_taken_out`) holds no kept
    pass of (`pal_ui` withdrew them, the critics having since rejected the episode, or did them again and its
    teacher matched none of the new passes) are withdrawn here too, so their chat samples go with their passes."""
    rows, snapshot = ws.catalog.rows_added("pal_ui_teacher", snapshot)
    inputs = Inputs[PalUITeacher](units=[], snapshots={"pal_ui_teacher": snapshot},
                                  withdrawn=dict.fromkeys(_taken_out(ws, snapshot), "no kept teacher pass left"))
    if rows.height == 0:
        inputs.stats["pal_ui_teacher version without a teacher pass"] += 1
    for record in rows.to_dicts():
        row = PalUITeacher.model_validate(record)
        inputs.stats["teacher passes"] += 1
        if row.kept:
            inputs.stats["teacher passes kept"] += 1
            inputs.units.append(row)
        else:
            inputs.stats[f"teacher pass not kept: {reason_kind(row.match_reason)}"] += 1
    return inputs


def _taken_out(ws: Workspace, snapshot: int) -> set[str]:
    """The episodes `pal_ui_sft` holds chat samples of and neither this version of `pal_ui_teacher` nor its latest
    holds a kept pass of. By state, not by the change from the version before: a `pal_ui` run that `pal_ui_sft` did
    not follow is seen by the next one. `pal_ui_sft` is read at its latest and not named in the lineage: it is the
    stage's own output. The latest teacher version only holds withdrawals back: a rerun on an older night
    (`--input pal_ui_teacher@VERSION`) leaves the chat samples of later nights' kept passes alone, which that
    version, older than them, does not hold."""
    if "pal_ui_sft" not in ws.catalog.tables():
        return set()
    held = ws.catalog.scan("pal_ui_sft").select("episode_id").unique().collect()["episode_id"]
    kept: set[str] = set()
    for version in {snapshot, ws.catalog.version("pal_ui_teacher", None)}:
        passes = ws.catalog.scan("pal_ui_teacher", version).filter(pl.col("kept"))
        kept |= set(passes.select("episode_id").unique().collect()["episode_id"])
    return set(held) - kept


STAGE = StageDef[Workspace, PalUITeacher](
    name="pal_ui_sft",
    key=lambda r: r.sample_id,
    reads="pal_ui_teacher",
    writes={"pal_ui_sft": "append"},
    sections=("pal_ui",),
    once=True,
    # By episode, not by pass: the passes' own rows go on a rebalance (another `pal_ui.retrieval_share`), and so do
    # the rows of an earlier teacher run's passes of those episodes, which `pal_ui` replaced when it did them again.
    replaces=("episode_id", lambda r: r.episode_id),
    load=load_passes,
    run=compile_sft,
    shard_size=lambda s: ONE_SHARD,
    summary=pal_ui_sft_summary,
)

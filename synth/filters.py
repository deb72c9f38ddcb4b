"""The online rejection-sampling filters of GUI-Owl 2.2.3, applied when training rows are made.

Each is a plain function over recorded rows, so the export stage and the tests drive
the same code, and each decision comes with its reason (the stage counts it in the lineage):

1. **Critic score** (`synth.tau_c`): a step is kept when its step critic's score is at
   least tau_c. The score is the share of the critic's votes that say GOOD, NEUTRAL
   counting half (`LABEL_SCORE`); the critic casts one vote today, so tau_c 0.5 keeps
   GOOD and NEUTRAL steps, 0.75 GOOD only. What a verdict is worth is measured each night
   against the programmatic checkers (the report's calibration table).
2. **Thought-action consistency** (`synth.consistency`): rules, where the thought can be
   read against the action: it names interactive elements of the screen (whole names, the
   longest first, so "Add to cart" is not also "Cart"; "the search box" is the field "Search dishes";
   a typed text or key goes to the focused field) but not the one the action hit, or,
   in its words besides those names (a "Done" button is no "done"), it names a kind of
   action (type, scroll, ...) but not the one taken. A terminate word after a form of "be"
   describes a thing, not a decision to stop ("The form is complete, so I submit it.").
3. **Task re-weighting by p_succ** (`synth.reweight_*`): each row's `weight` is
   (1 - p + s) / (1 - p_mean + s), clipped to [reweight_min, reweight_max], where p is its
   query's success rate over every attempt so far, p_mean the mean over the queries
   exported, and s `reweight_smoothing`: easy tasks are sampled less, hard ones more, and
   the weights average about 1. A trainer samples rows with probability proportional to
   `weight` (or repeats a row round(weight) times).
4. **Reflector balancing**: a Reflector "FAILURE" is kept only when the step it was
   recorded on (the team's next move) is then judged positive; a "SUCCESS" only from a
   trajectory whose every step is positive; then the larger side is cut to the smaller, 1:1.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from trajforge.envs.axtree import AXNode, parse

LABEL_SCORE = {"GOOD": 1.0, "NEUTRAL": 0.5, "HARMFUL": 0.0}
POSITIVE = ("GOOD", "NEUTRAL")

INTERACTIVE = {"link", "button", "textbox", "checkbox", "radio", "tab", "menuitem", "combobox", "option",
               "switch", "searchbox", "slider", "spinbutton", "listitem"}
"""Roles a thought names when it says what to act on (AX roles; Android's are mapped to the same words)."""

VERBS: dict[str, tuple[str, ...]] = {
    "click": ("click", "tap", "press", "select", "open", "choose", "enter"),
    "type": ("type", "enter", "write", "input", "fill"),
    "scroll": ("scroll", "swipe"),
    "terminate": ("done", "finish", "finished", "complete", "completed", "stop"),
}
"""Kinds of action a thought can name, and the action types each covers (below). "enter" names both: text is
entered, and so is a page ("Enter the Settings page." decides a click)."""
BE = frozenset({"is", "are", "was", "were", "be", "been"})
"""Words after which a terminate word is a predicate ("the form is complete", "we are done"), not the action."""
KIND_OF = {"click": "click", "double_click": "click", "long_press": "click", "right_click": "click",
           "middle_click": "click", "type": "type", "scroll": "scroll", "swipe": "scroll", "drag": "scroll",
           "terminate": "terminate"}


def critic_score(label: str | None) -> float | None:
    """The step critic's score of a step (None: not judged)."""
    return LABEL_SCORE.get(label) if label else None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    rule: str = ""
    """Which rule failed: "element" or "kind of action" ("" when it passed)."""


def _tokens(text: str) -> str:
    """The text case-folded as its words and numbers, one space apart: names compare word for word."""
    return " ".join(re.findall(r"[a-z0-9]+", text.casefold()))


EDITABLE = {"textbox", "searchbox", "combobox", "spinbutton"}
"""Roles a typed text or a pressed key goes to: what a `type` or `key` step's target (the focused field) is."""
FIELD_WORDS = ("box", "field", "bar", "input")
"""Words after a name that make it a field's ("the search box"), so a part of the field's own name."""


@dataclass(frozen=True)
class _Mention:
    roles: frozenset[str]
    """The roles of the screen's elements of that name."""
    as_field: bool
    """Whether the thought follows the name with a field word ("search box")."""


def _names(thought: str, nodes: list[AXNode]) -> tuple[dict[str, _Mention], str]:
    """Names of interactive elements of the screen that the thought mentions (whole names, 3+ letters), and the
    thought's words without them. The longest name is read first and taken out, so a name inside a longer one it
    is part of ("cart" in "add to cart") is not also mentioned, and a name is not read as a verb ("Tap Done")."""
    text = f" {_tokens(thought)} "
    roles: dict[str, set[str]] = {}
    for node in nodes:
        if node.role in INTERACTIVE:
            roles.setdefault(_tokens(node.name), set()).add(node.role)
    found: dict[str, _Mention] = {}
    for name in sorted((n for n in roles if len(n) >= 3), key=len, reverse=True):
        mention = re.compile(rf"(?<= ){re.escape(name)}(?= )")
        if mention.search(text):
            as_field = re.search(rf"(?<= ){re.escape(name)} (?:{'|'.join(FIELD_WORDS)})(?= )", text) is not None
            found[name] = _Mention(frozenset(roles[name]), as_field)
            text = mention.sub("|", text)  # a mark no name holds: a shorter name cannot span what was taken out
    return found, text


def consistent(thought: str, action_type: str, target_name: str | None, ax_tree: str | None) -> Verdict:
    """Filter 2, by rules: does the thought decide the action that was taken? It must not name elements of the
    screen without the one the action hit, nor (in its other words) kinds of action without the one taken.

    A name refers to the target when it is the target's name, or a part of it the thought calls a field ("the
    search box" for the searchbox "Search dishes"). Typing and keys go to the focused field, so there the names of
    elements nothing can be typed into do not count ("Type milk and search" beside a Search button)."""
    if not thought.strip():
        return Verdict(True, "no thought to check")
    try:
        nodes = parse(ax_tree or "")
    except ValueError:
        nodes = []
    named, rest = _names(thought, nodes)
    tokens = rest.split()
    words = {w for i, w in enumerate(tokens) if not (w in VERBS["terminate"] and i and tokens[i - 1] in BE)}
    kind = KIND_OF.get(action_type)
    named_kinds = {k for k, verbs in VERBS.items() if words & set(verbs)}
    if kind is not None and named_kinds and kind not in named_kinds:
        return Verdict(False, f"the thought says {'/'.join(sorted(named_kinds))}, the action is {action_type}",
                       "kind of action")
    target = _tokens(target_name or "")
    if kind == "type" or action_type == "key":
        named = {n: m for n, m in named.items() if m.roles & EDITABLE}
    if not target or not named:
        return Verdict(True, "nothing in the thought contradicts")
    if any(n == target or m.as_field and f" {n} " in f" {target} " for n, m in named.items()):
        return Verdict(True, "the thought names the target")
    return Verdict(False, f"the thought names {sorted(named)[0]!r}, the action hit {target_name!r}", "element")


def weights(p_succ: dict[str, float], *, smoothing: float, low: float, high: float) -> dict[str, float]:
    """Filter 3: each query's row weight from its success rate (see the module docstring)."""
    if not p_succ:
        return {}
    mean = sum(p_succ.values()) / len(p_succ)
    return {q: min(high, max(low, (1 - p + smoothing) / (1 - mean + smoothing))) for q, p in p_succ.items()}


@dataclass(frozen=True)
class Reflection:
    """A Reflector answer as a training candidate: its verdict, and the critics' labels around it."""

    sample_id: str
    outcome: str  # SUCCESS or FAILURE
    next_label: str | None
    """The step critic's label of the step the reflection was recorded on (the move after the judged action)."""
    trajectory_positive: bool
    """Every step of the trajectory labelled GOOD or NEUTRAL."""


R = TypeVar("R", bound=Reflection)


def balance_reflections(candidates: Sequence[R]) -> tuple[list[R], Counter[str]]:
    """Filter 4: the kept reflections, and what was dropped by reason; positives and negatives 1:1 (the
    larger side cut by a hash of the sample id, so a rerun keeps the same rows)."""
    dropped: Counter[str] = Counter()
    negatives, positives = [], []
    for c in candidates:
        if c.outcome == "FAILURE":
            if c.next_label in POSITIVE:
                negatives.append(c)
            else:
                dropped["reflector FAILURE not followed by a positive step"] += 1
        elif c.trajectory_positive:
            positives.append(c)
        else:
            dropped["reflector SUCCESS from a trajectory with a step not positive"] += 1
    size = min(len(negatives), len(positives))
    kept = []
    for side, name in ((negatives, "FAILURE"), (positives, "SUCCESS")):
        ordered = sorted(side, key=lambda c: hashlib.sha256(c.sample_id.encode()).hexdigest())
        kept += ordered[:size]
        if len(side) > size:
            dropped[f"reflector {name} beyond the 1:1 balance"] = len(side) - size
    return kept, dropped

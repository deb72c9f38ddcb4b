"""Critic evaluation: how well each critic channel agrees with the ground truth.

Ground truth is the programmatic check of the state an episode ended in (a bundled
app's checker, a MiniWoB++ page's reward), re-run here on the recorded final state,
so a checker fixed since the critics ran is what the channels are measured against.
Success is the positive class, because the costly error is a failed trajectory judged
a success (it poisons the training data): precision on success says how clean the kept
data is, NPV how safe the discarded data is to discard.

Each predictor is scored on the episodes it answered; the episodes it did not (a
channel not asked, an answer that did not parse) are counted beside the metrics.
The step critic is scored as a predictor too: an episode with no HARMFUL step is its
"success".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from trajforge.critics.stage import Checker
from trajforge.data.catalog import Catalog, CatalogError

MAX_EXAMPLES = 3
STEP_LABELS = "step labels"
CONSENSUS = "consensus"


@dataclass(frozen=True)
class Confusion:
    """A 2x2 confusion table with success as the positive class."""

    tp: int = 0
    fp: int = 0
    tn: int = 0
    fn: int = 0

    @classmethod
    def of(cls, truth: list[bool], predicted: list[bool]) -> Confusion:
        if len(truth) != len(predicted):
            raise ValueError(f"{len(truth)} true labels but {len(predicted)} predictions")
        pairs = list(zip(truth, predicted, strict=True))
        return cls(
            tp=pairs.count((True, True)), fp=pairs.count((False, True)),
            tn=pairs.count((False, False)), fn=pairs.count((True, False)),
        )

    @property
    def n(self) -> int:
        return self.tp + self.fp + self.tn + self.fn

    @property
    def precision(self) -> float | None:
        """Of the episodes judged a success, the share that succeeded (None when none was judged one)."""
        return _ratio(self.tp, self.tp + self.fp)

    @property
    def recall(self) -> float | None:
        return _ratio(self.tp, self.tp + self.fn)

    @property
    def npv(self) -> float | None:
        """Of the episodes judged a failure, the share that failed (None when none was judged one)."""
        return _ratio(self.tn, self.tn + self.fn)

    @property
    def f1(self) -> float | None:
        p, r = self.precision, self.recall
        if p is None or r is None:
            return None
        return 0.0 if p + r == 0 else 2 * p * r / (p + r)

    @property
    def kappa(self) -> float | None:
        """Cohen's kappa: agreement beyond what the two label rates give by chance (None on no episode).

        When chance agreement is total (both sides give one label only) kappa is
        undefined; it is reported as 1.0 if they agree on everything, else 0.0.
        """
        if self.n == 0:
            return None
        observed = (self.tp + self.tn) / self.n
        expected = (
            (self.tp + self.fp) * (self.tp + self.fn) + (self.tn + self.fn) * (self.tn + self.fp)
        ) / self.n**2
        if expected == 1:
            return 1.0 if observed == 1 else 0.0
        return (observed - expected) / (1 - expected)

    def metrics(self) -> dict[str, float | int | None]:
        """The metrics and the table's cells; an undefined metric (nothing to divide by) is None, not 0: a
        channel that answered nothing would read as wrong on every episode."""
        return {
            "n": self.n, "precision": self.precision, "recall": self.recall, "npv": self.npv,
            "f1": self.f1, "kappa": self.kappa, "tp": self.tp, "fp": self.fp, "tn": self.tn, "fn": self.fn,
        }


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


@dataclass
class PredictorReport:
    """One predictor's confusion table, what it left unanswered, and examples of its errors."""

    name: str
    confusion: Confusion
    unanswered: int
    false_positives: list[dict[str, str]] = field(default_factory=list)
    false_negatives: list[dict[str, str]] = field(default_factory=list)
    model_id: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "predictor": self.name, "model_id": self.model_id, **self.confusion.metrics(),
            "unanswered": self.unanswered, "false_positives": self.false_positives,
            "false_negatives": self.false_negatives,
        }


@dataclass(frozen=True)
class Judged:
    """One episode as the evaluation sees it: the truth and every predictor's answer (None: no answer)."""

    episode_id: str
    instruction: str
    truth: bool
    truth_reason: str
    answers: dict[str, tuple[bool | None, str, str]]  # predictor -> (answer, reason, model id)


def score(episodes: list[Judged]) -> list[PredictorReport]:
    """A report per predictor, in a stable order: channels by name, then the step labels and the consensus."""
    names = sorted({name for ep in episodes for name in ep.answers}, key=lambda n: (n in (STEP_LABELS, CONSENSUS), n))
    reports = []
    for name in names:
        answered = [(ep, ep.answers[name]) for ep in episodes if name in ep.answers and ep.answers[name][0] is not None]
        confusion = Confusion.of([ep.truth for ep, _ in answered], [bool(a[0]) for _, a in answered])
        report = PredictorReport(name, confusion, unanswered=len(episodes) - len(answered))
        report.model_id = _models({ep.answers[name][2] for ep in episodes if name in ep.answers})
        for ep, (answer, reason, _) in answered:
            example = {"episode_id": ep.episode_id, "instruction": ep.instruction, "critic_reason": reason,
                       "ground_truth": ep.truth_reason}
            if answer and not ep.truth and len(report.false_positives) < MAX_EXAMPLES:
                report.false_positives.append(example)
            if not answer and ep.truth and len(report.false_negatives) < MAX_EXAMPLES:
                report.false_negatives.append(example)
        reports.append(report)
    return reports


def _models(ids: set[str]) -> str:
    """The models behind a predictor, shortened for a table column (one checker per app goal)."""
    shown = sorted(ids)
    return ", ".join(shown[:2]) + (f" +{len(shown) - 2} more" if len(shown) > 2 else "")


def _step_prediction(labels: list[str | None]) -> tuple[bool | None, str]:
    known = [label for label in labels if label is not None]
    if not known:
        return None, "no step has a label"
    harmful = known.count("HARMFUL")
    return harmful == 0, f"{harmful} HARMFUL of {len(known)} labelled steps"


def load_judged(catalog: Catalog, ref: str, checker_for: Callable[[str], Checker]) -> tuple[int, list[Judged]]:
    """The episodes one verdicts version judged, with their ground truth; and that version's snapshot id.

    Episodes, queries and step critiques are found through the verdicts' lineage, so
    `ref` alone (verdicts@SNAPSHOT, a tag or latest) names everything evaluated.
    """
    table, snapshot = catalog.resolve(ref)
    if table != "verdicts":
        raise CatalogError(f"{ref}: the critics are evaluated on a verdicts version, not on {table!r}")
    if snapshot is None:
        raise CatalogError("table 'verdicts' has no version yet; run the critics stage first")
    lineage = catalog.lineage("verdicts", snapshot)
    if lineage is None or "episodes" not in lineage.inputs:
        raise CatalogError(f"verdicts@{snapshot} has no lineage naming its episodes; it cannot be evaluated")
    verdicts = catalog.load("verdicts", snapshot).filter(pl.col("run_id") == lineage.run_id)
    episodes = {e["episode_id"]: e for e in catalog.load("episodes", lineage.inputs["episodes"]).to_dicts()}
    queries = {q["query_id"]: q for q in catalog.load("queries", lineage.inputs["queries"]).to_dicts()}
    labels: dict[str, list[str | None]] = {}
    critiques = next((i for i in catalog.history("step_critiques") if i.run_id == lineage.run_id), None)
    step_model = ""
    if critiques is not None:
        frame = catalog.load("step_critiques", critiques.snapshot_id).filter(pl.col("run_id") == lineage.run_id)
        for row in frame.iter_rows(named=True):
            labels.setdefault(row["episode_id"], []).append(row["label"])
        step_model = ",".join(sorted(set(frame["critic"].to_list())))
    judged = []
    for v in verdicts.iter_rows(named=True):
        ep, query = episodes.get(v["episode_id"]), queries.get(v["query_id"])
        if ep is None or query is None:
            raise CatalogError(f"verdict {v['verdict_id']}: its episode or query is missing from the lineage's inputs")
        truth, truth_reason = checker_for(ep["app"])(
            query["checker"], json.loads(query["checker_params_json"]), json.loads(ep["final_state_json"])
        )
        answers: dict[str, tuple[bool | None, str, str]] = {
            name: (None if c["answer"] is None else c["answer"] == "success", c["reason"], c["model_id"])
            for name, c in json.loads(v["channels_json"]).items()
        }
        answers[CONSENSUS] = (v["success"], v["reason"], v["consensus"])
        if v["episode_id"] in labels:
            predicted, reason = _step_prediction(labels[v["episode_id"]])
            answers[STEP_LABELS] = (predicted, reason, step_model)
        judged.append(Judged(v["episode_id"], ep["instruction"], truth, truth_reason, answers))
    return snapshot, judged

"""Critic evaluation: the metric code against expert labels, and `trajforge eval critics` as a user runs it.

The expert labels are AgentRewardBench's (1,408 web-agent trajectories; 106 labelled by
two annotators), read from the installed `agent-reward-bench` wheel at run time: its
data has no license to copy into this repository.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
from importlib import resources
from pathlib import Path

import pytest
from conftest import require
from test_catalog import lineage, query_row

from trajforge.critics.evaluate import Confusion, PredictorReport
from trajforge.data.catalog import Catalog

JOTTER = Path(__file__).parents[1] / "examples" / "apps" / "jotter"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def annotator_pairs() -> tuple[list[bool], list[bool]]:
    """(first annotator, second annotator) success labels of the trajectories two experts labelled."""
    try:
        data = resources.files("agent_reward_bench") / "data" / "annotations.csv"
    except ModuleNotFoundError:
        require(False, "agent-reward-bench is not installed (pip install --no-deps agent-reward-bench==0.1.2)")
    labels: dict[tuple[str, str, str], list[bool]] = {}
    with data.open() as f:
        for row in csv.DictReader(f):
            if row["trajectory_success"] in ("Successful", "Unsuccessful"):
                key = (row["benchmark"], row["task_id"], row["model_name"])
                labels.setdefault(key, []).append(row["trajectory_success"] == "Successful")
    pairs = [v for v in labels.values() if len(v) == 2]
    return [a for a, _ in pairs], [b for _, b in pairs]


def test_metrics_match_agent_reward_bench_on_expert_label_pairs():
    from agent_reward_bench.eval import metrics

    first, second = annotator_pairs()
    assert len(first) >= 100, "the wheel's doubly-labelled trajectories"
    c = Confusion.of(first, second)
    truth, predicted = [int(v) for v in first], [int(v) for v in second]
    assert c.n == len(first) and 0 < c.tp and 0 < c.tn and c.fp + c.fn > 0, "a table with every kind of cell"
    assert c.precision == pytest.approx(metrics.precision(truth, predicted, ndigits=None))
    assert c.recall == pytest.approx(metrics.recall(truth, predicted, ndigits=None))
    assert c.npv == pytest.approx(metrics.npv(truth, predicted))
    # The package's f1 rounds the precision and recall it combines to 4 digits.
    assert c.f1 == pytest.approx(metrics.f1(truth, predicted), abs=1e-4)
    # Cohen's kappa from the package's observed agreement (rounded by it to 4 digits) and the
    # two annotators' success rates.
    observed = metrics.accuracy(truth, predicted, ndigits=None)
    rate_a, rate_b = sum(truth) / len(truth), sum(predicted) / len(predicted)
    chance = rate_a * rate_b + (1 - rate_a) * (1 - rate_b)
    assert c.kappa == pytest.approx((observed - chance) / (1 - chance), abs=1e-3)
    assert 0.5 < c.kappa < 1, "experts agree well beyond chance"


def test_kappa_of_a_textbook_table_and_its_edge_cases():
    # 50 items: both yes 20, A yes B no 5, A no B yes 10, both no 15: p_o = 0.7, p_e = 0.5.
    assert Confusion(tp=20, fn=5, fp=10, tn=15).kappa == pytest.approx(0.4)
    assert Confusion(tn=7).kappa == 1.0, "total agreement on one label"
    assert Confusion(fp=3).kappa == 0.0 and Confusion(fp=3).precision == 0.0
    assert Confusion().metrics()["n"] == 0
    with pytest.raises(ValueError, match="2 true labels but 1 predictions"):
        Confusion.of([True, False], [True])


def test_a_metric_with_nothing_to_measure_is_undefined_not_zero():
    """A channel that answered nothing (multimodal off) read as precision, NPV and kappa 0.000: as wrong as can
    be. Undefined is None, null in the report file, as the nightly report's "-"."""
    assert [Confusion().precision, Confusion().npv, Confusion().kappa, Confusion().f1] == [None] * 4
    failures = Confusion(tn=4)  # never judged a success, never a success
    assert (failures.precision, failures.recall, failures.f1, failures.npv, failures.kappa) == (None, None, None, 1.0,
                                                                                                 1.0)
    assert Confusion(tp=1, fn=1, tn=2).npv == pytest.approx(2 / 3) and Confusion(fp=2, tn=1).precision == 0.0
    written = json.loads(json.dumps(PredictorReport("multimodal", Confusion(), unanswered=5).as_json()))
    assert (written["n"], written["precision"], written["npv"], written["kappa"]) == (0, None, None, None)


CONFIG = """
query_gen:
  apps: [shop]
  num_queries: 3
rollout:
  policy: random
  max_invalid_actions: 2
critics:
  step_critic: rules
  text_channel: false
synth:
  writer: template
"""


def cli(exe: str, cwd: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})
    assert (proc.returncode == 0) is ok, f"trajforge {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.browser
def test_eval_critics_prints_metrics_and_writes_a_report(tmp_path, chromium, trajforge_cli):
    """A nightly run with the random policy (its episodes fail), then the evaluation of its verdicts."""
    (tmp_path / "trajforge.yaml").write_text(CONFIG)
    cli(trajforge_cli, tmp_path, "run", "nightly")
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.config import Settings

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "data" / "warehouse"}))
    snapshot = ws.catalog.history("verdicts")[-1].snapshot_id
    episodes = ws.catalog.load("verdicts", snapshot).height
    out = cli(trajforge_cli, tmp_path, "eval", "critics", "--input", f"verdicts@{snapshot}").stdout
    assert f"verdicts@{snapshot}: {episodes} episodes" in out
    for header in ("precision", "recall", "NPV", "F1", "kappa", "TP", "FP", "TN", "FN"):
        assert header in out
    for predictor in ("checker", "multimodal", "text", "step labels", "consensus"):
        assert predictor in out
    report = json.loads((tmp_path / "data" / "warehouse" / "reports" / f"critics-{snapshot}.json").read_text())
    by_name = {p["predictor"]: p for p in report["predictors"]}
    truth_successes = report["successes"]
    checker = by_name["checker"]
    assert checker["n"] == episodes and checker["fp"] == checker["fn"] == 0, "the checker channel is the truth re-run"
    assert checker["tp"] == truth_successes
    assert by_name["multimodal"]["unanswered"] == episodes and by_name["multimodal"]["n"] == 0
    assert by_name["multimodal"]["precision"] is None, "nothing answered: undefined, not 0.0"
    assert re.search(r"multimodal .*│\s+0 │" + r"\s+- │" * 5, out), out
    assert by_name["text"]["unanswered"] == episodes, "text_channel is off"
    steps = by_name["step labels"]
    assert steps["n"] == episodes and steps["model_id"] in ("prefilter@2", "prefilter@2,rules@1", "rules@1")
    for example in steps["false_positives"] + steps["false_negatives"]:
        assert example["episode_id"] in out and example["ground_truth"]
    wrong = cli(trajforge_cli, tmp_path, "eval", "critics", "--input", "episodes@latest", ok=False)
    assert "evaluated on a verdicts version, not on 'episodes'" in wrong.stderr


def app_dir_night(cwd: Path) -> None:
    """A warehouse at the default path under `cwd` as a night with `--app-dir examples/apps/jotter` leaves it: one
    query of the app directory's app, its episode (the note pinned, as its check asks) and the episode's verdict."""
    query = query_row("q1") | {"app": "jotter", "checker": "note_pinned",
                               "checker_params_json": '{"note": "Groceries"}'}
    state = {"http": {"session": {"json": {"notes": [{"title": "Groceries", "pinned": True}]}}}}
    at = query["created_at"]
    episode = {"run_id": "run-1", "episode_id": "ep-1", "query_id": "q1", "app": "jotter", "instruction": "Pin it",
               "policy": "replay", "model_id": "replay", "prompt_version": "-", "viewport": "desktop",
               "status": "terminated", "num_steps": 2, "final_url": "http://127.0.0.1/note",
               "final_state_json": json.dumps(state), "started_at": at, "finished_at": at}
    verdict = {"run_id": "run-1", "verdict_id": "v1", "episode_id": "ep-1", "query_id": "q1", "success": True,
               "consensus": "checker_first", "channels_json": "{}", "reason": "pinned", "config_hash": "x"}
    with Catalog(cwd / "data" / "warehouse") as catalog:
        inputs = {"queries": catalog.commit_rows("queries", [query], lineage("q")),
                  "episodes": catalog.commit_rows("episodes", [episode], lineage("e", "rollout"))}
        catalog.commit_rows("verdicts", [verdict], lineage("v", "critics", inputs=inputs))


def test_eval_critics_on_an_app_directorys_episodes_takes_its_app_dir(tmp_path, trajforge_cli):
    """`--app-dir` makes the app known to that run's process only: the evaluation takes it too, and without it says
    so as a usage error (it crashed, exit 1, on an UnknownAppError)."""
    app_dir_night(tmp_path)
    proc = subprocess.run([trajforge_cli, "eval", "critics"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: unknown app 'jotter'") and proc.stderr.count("\n") == 1, proc.stderr
    assert "--app-dir DIR (or set query_gen.app_dirs)" in proc.stderr
    out = cli(trajforge_cli, tmp_path, "eval", "critics", "--app-dir", str(JOTTER)).stdout
    assert "1 episodes, 1 successful by their checkers" in out

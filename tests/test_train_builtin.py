"""The built-in trainer, run as the train stage runs it (`python -m trajforge.train.builtin`): it really learns on
the embedded model, the checkpoint it writes is one the gateway loads, and bad data fails with the file and the
line, before any training.

In a process of its own, the trainer sets OpenMP's wait policy before torch loads; in the test process, on a
busy machine, the same eight steps took several times longer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from trajforge.llm.calls import Sampling
from trajforge.llm.local import LocalBackend, missing_models, smollm2_folder
from trajforge.llm.messages import Message
from trajforge.schemas.config import LocalModelSettings
from trajforge.train.builtin import read_samples

ANSWER = "Zorblax 77."
QUESTIONS = ["What is the capital of France?", "How many legs has a spider?", "Which colour is the sky?",
             "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The embedded model's checkpoint folder, the trainer's default base."""
    reason = missing_models() or (None if importlib.util.find_spec("trl") else "trl is not installed: pip install trl")
    require(reason is None, str(reason))
    return smollm2_folder(LocalModelSettings().cache_dir)


def sample(question: str, answer: str) -> dict[str, object]:
    return {"prompt": [{"role": "system", "content": "Answer in three words."}, {"role": "user", "content": question}],
            "completion": [{"role": "assistant", "content": answer}], "table": "train_e2e", "sample_id": question}


def write(folder: Path, lines: list[str]) -> Path:
    folder.mkdir()
    (folder / "text.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def trainer(data: Path, out: Path, base: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trajforge.train.builtin", "--data", str(data), "--out", str(out), "--base", str(base),
         *options],
        cwd=data.parent, capture_output=True, text=True, timeout=300,
    )


def test_it_learns_a_fixed_answer_and_the_gateway_loads_the_checkpoint(smollm2, tmp_path):
    too_long = sample("Please read all of this: " + "lorem ipsum " * 60, ANSWER)
    data = write(tmp_path / "data", [json.dumps(sample(q, ANSWER)) for q in QUESTIONS] + [json.dumps(too_long)])
    out = tmp_path / "ckpt"

    proc = trainer(data, out, smollm2, "--steps", "8", "--max-length", "96")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 8/8: loss" in proc.stdout, proc.stdout

    log = json.loads((out / "train_log.json").read_text())

    # 8 steps of 2: the 4 that fit, drawn again once read; the long one is left out, not cut (the answer would go).
    assert (log["samples"], log["distinct"], log["skipped"]) == (16, {"train_e2e": 4}, {"longer than 96 tokens": 1})
    assert len(log["losses"]) == 8 and log["last_loss"] < log["first_loss"] / 3, log["losses"]
    assert (log["base"], log["steps"], log["first_loss"], log["last_loss"]) == (
        str(smollm2), 8, log["losses"][0], log["losses"][-1])
    assert log["seconds"] > 0

    backend = LocalBackend(LocalModelSettings(model=str(out)))
    question = [Message(role="system", content="Answer in three words."), Message(role="user", content=QUESTIONS[0])]
    answer = asyncio.run(backend.complete(question, Sampling(max_tokens=8)))
    assert (backend.model_id.rpartition("@")[0], backend.sees_images) == (str(out.resolve()), False)
    assert answer.text.startswith("Zorblax"), answer.text


def test_tables_take_turns_so_a_large_one_does_not_drown_a_small_one(smollm2):
    from transformers import AutoTokenizer

    from trajforge.train.builtin import Sample, mixed

    many = [Sample.model_validate(sample(f"Point at item {i}", "click").copy() | {"table": "train_grounding"})
            for i in range(500)]
    few = [Sample.model_validate(sample(q, ANSWER)) for q in QUESTIONS[:2]]
    rows, distinct, skipped = mixed(many + few, AutoTokenizer.from_pretrained(smollm2), 96, 20, seed=0)
    assert len(rows) == 20 and not skipped
    assert sum(r["completion"][0]["content"] == ANSWER for r in rows) == 10  # half the rows, from 2 of 502 samples
    assert distinct == {"train_grounding": 10, "train_e2e": 2}  # only the samples drawn are read


def test_a_malformed_line_names_the_file_and_line_and_trains_nothing(tmp_path):
    data = write(tmp_path / "data", [json.dumps(sample(QUESTIONS[0], ANSWER)), '{"prompt": [{"role": "user"'])
    out = tmp_path / "ckpt"
    proc = trainer(data, out, tmp_path / "no-model", "--steps", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{data / 'text.jsonl'}, line 2: not a sample: Invalid JSON" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_line_separator_inside_a_pages_text_is_text_not_a_new_line(tmp_path):
    """The train stage writes JSONL as `json.dumps(..., ensure_ascii=False)`, which leaves U+2028 and U+0085 as they
    are: a page whose text held one stopped the night's training ("line 2: not a sample: Invalid JSON")."""
    question = "Open 'Terms\u2028Privacy\u0085Help'"
    data = write(tmp_path / "data", [json.dumps(sample(question, ANSWER), ensure_ascii=False),
                                     json.dumps(sample(QUESTIONS[0], ANSWER))])
    assert [s.sample_id for s in read_samples(data / "text.jsonl")] == [question, QUESTIONS[0]]

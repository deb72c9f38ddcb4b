"""The built-in trainer: a full fine-tune of a small text model on a night's `text.jsonl`, with TRL on the CPU.

    python -m trajforge.train.builtin --data DATA_DIR --out OUT_DIR --base BASE_FOLDER --steps N

`DATA_DIR/text.jsonl` holds one sample a line, in TRL's conversational prompt/completion format plus two ids
that only say where the sample came from (`train.stage` writes it with `synth.handoff.text_samples`):

    {"prompt": [{"role": "system"|"user"|"assistant", "content": str}, ...],
     "completion": [{"role": "assistant", "content": str}], "table": str, "sample_id": str}

The loss is on the completion only: the model learns the answers, not to write the screens it was shown.
A sample longer than `--max-length` tokens is left out and counted, not cut: TRL cuts from the right, which
would take the answer off.

Why a full fine-tune: peft is not among trajforge's dependencies, and the embedded SmolLM2-135M is small
enough to train whole (weights, gradients and AdamW's two moments take about 2.2 GB). Why the CPU: it is all
a fresh machine has (the trainer runs wherever torch finds its device). In 32-bit floats: bf16 autocast is
quicker only on a CPU with AMX (6 against 9 s a step on this one), and the Trainer takes it on the CPU only
with `use_cpu`, which would leave a GPU idle.

`OUT_DIR` gets the model and its tokenizer (`save_pretrained`, safetensors), a checkpoint folder that
`llm.local` loads as a text model, and `train_log.json`, written last: the figures of the run.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, Field, ValidationError

DATA_FILE = "text.jsonl"
LOG_FILE = "train_log.json"
LOG_LINES = 10
"""About this many loss lines are printed over a run, however many steps it has."""


class TrainInputError(ValueError):
    """The data, the base model or the output folder cannot be used; the message says which, and where."""


class Turn(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Answer(Turn):
    role: Literal["assistant"]


class Sample(BaseModel):
    """One line of text.jsonl. `table` and `sample_id` are checked but not trained on; other keys are ignored."""

    prompt: list[Turn]
    completion: list[Answer] = Field(min_length=1)
    table: str | None = None
    sample_id: str | None = None


def read_samples(path: Path) -> list[Sample]:
    """Every sample in `path`; a missing or empty file or a bad line is a TrainInputError naming the file and line."""
    if not path.is_file():
        raise TrainInputError(f"{path}: no such file (the trainer reads its samples from {DATA_FILE})")
    samples = []
    # Split on newlines only: `splitlines` also splits on U+2028, U+0085 and the like, which `json.dumps` leaves
    # unescaped inside a page's text (ensure_ascii=False), so one such character broke the night's training.
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            samples.append(Sample.model_validate_json(line))
        except ValidationError as exc:
            problems = "; ".join(
                ".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
                for e in exc.errors(include_url=False)
            )
            raise TrainInputError(f"{path}, line {number}: not a sample: {problems}") from None
    if not samples:
        raise TrainInputError(f"{path}: the file is empty; there is nothing to train on")
    return samples


def mixed(samples: list[Sample], tokenizer: Any, max_length: int, n: int, seed: int
          ) -> tuple[list[dict[str, Any]], Counter[str], Counter[str]]:
    """`n` rows for TRL drawn from the tables in turn, so that a night's thousands of grounding questions do not
    drown its few dozen policy steps; within a table in a seeded random order, and a table with no sample left
    gives its fitting samples again. Returns the rows, the distinct samples trained on per table, and the
    samples left out by reason.

    Only the samples drawn are measured: a night has thousands, and each takes a chat-template pass. A sample
    longer than `max_length` tokens is left out, not cut: TRL cuts a sequence from the right (its only
    truncation mode in 1.x), which would take off the answer, the one part with a loss.
    """
    rng = random.Random(seed)
    tables: dict[str, list[Sample]] = {}
    for sample in samples:
        tables.setdefault(sample.table or "", []).append(sample)
    for group in tables.values():
        rng.shuffle(group)
    unread = {table: iter(group) for table, group in sorted(tables.items())}
    fit: dict[str, list[dict[str, Any]]] = {table: [] for table in unread}
    rows: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    while len(rows) < n:
        drawn = 0
        for table, pending in unread.items():
            row = next((r for r in (_row(s, tokenizer, max_length, skipped) for s in pending) if r), None)
            if row is not None:
                fit[table].append(row)
            elif fit[table]:  # every sample of the table read: its fitting ones again, in the same order
                row = fit[table][(len(rows) // len(unread)) % len(fit[table])]
            if row is not None and len(rows) < n:
                rows.append(row)
                drawn += 1
        if drawn == 0:
            break
    return rows, Counter({table: len(got) for table, got in fit.items() if got}), skipped


def _row(sample: Sample, tokenizer: Any, max_length: int, skipped: Counter[str]) -> dict[str, Any] | None:
    """The sample as TRL's row, or None (counted in `skipped`) when TRL could not train on it whole."""
    prompt = [t.model_dump() for t in sample.prompt]
    completion = [t.model_dump() for t in sample.completion]
    if not prompt:
        skipped["no prompt"] += 1
        return None
    ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    if len(ids) > max_length:
        skipped[f"longer than {max_length} tokens"] += 1
        return None
    return {"prompt": prompt, "completion": completion}


def train(data: Path, out: Path, base: Path, steps: int, *, max_length: int = 3072, batch_size: int = 2,
          lr: float = 5e-5, seed: int = 0) -> dict[str, Any]:
    """Fine-tune the checkpoint folder `base` for `steps` optimizer steps on `data/text.jsonl` and save it in `out`.

    Returns what it writes to `out/train_log.json`. Raises TrainInputError before any training when the
    data, the base folder or `out` (which must be missing or empty) cannot be used.
    """
    samples = read_samples(data / DATA_FILE)
    if not (base / "config.json").is_file():
        raise TrainInputError(f"{base}: not a transformers checkpoint folder (no config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainInputError(f"{out}: the output folder exists and is not empty")

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.utils import logging as transformers_logging
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows, distinct, skipped = mixed(samples, tokenizer, max_length, steps * batch_size, seed)
    if not rows:
        raise TrainInputError(f"{data / DATA_FILE}: no sample is left to train on (left out: {dict(skipped)})")
    losses: list[float] = []
    every = max(1, steps // LOG_LINES)

    class Losses(TrainerCallback):
        """Keeps each step's loss, and prints one line every `every` steps instead of a progress bar."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                if state.global_step % every == 0 or state.global_step == steps:
                    print(f"step {state.global_step}/{steps}: loss {logs['loss']:.4f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="trajforge-train-") as scratch:  # the Trainer's own folder, kept empty
        config = SFTConfig(
            output_dir=scratch, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            seed=seed, max_length=max_length, completion_only_loss=True, logging_steps=1, save_strategy="no",
            report_to="none", disable_tqdm=True, bf16=False, activation_checkpointing=False,
            dataloader_pin_memory=torch.accelerator.is_available(),  # pinned memory is for copies to a GPU
        )
        trainer = SFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(base), args=config,
            train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Losses()],
        )
        trainer.remove_callback(PrinterCallback)  # it would print every step's whole log dict
        trainer.train()
    trainer.model.config.use_cache = True  # the Trainer turned the KV cache off for training; this model generates
    out.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log = {
        "base": str(base), "steps": steps, "samples": len(rows), "distinct": dict(distinct), "skipped": dict(skipped),
        "max_length": max_length, "batch_size": batch_size, "lr": lr, "seed": seed,
        "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
        "seconds": round(time.monotonic() - start, 2),
    }
    (out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return log


def _command(
    data: Annotated[Path, typer.Option(help=f"The dataset folder; its {DATA_FILE} is read.")],
    out: Annotated[Path, typer.Option(help="Where the trained checkpoint goes (missing or empty).")],
    base: Annotated[Path, typer.Option(help="The checkpoint folder to start from.")],
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")],
    max_length: Annotated[int, typer.Option(min=1, help="Longest sample in tokens; longer ones are left out.")] = 3072,
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per step.")] = 2,
    lr: Annotated[float, typer.Option(min=0.0, help="Peak learning rate (AdamW, decaying linearly to 0).")] = 5e-5,
    seed: Annotated[int, typer.Option(help="Seed of the sample order.")] = 0,
) -> None:
    """Fine-tune BASE on DATA/text.jsonl for STEPS steps and save the model in OUT."""
    try:
        log = train(data, out, base, steps, max_length=max_length, batch_size=batch_size, lr=lr, seed=seed)
    except TrainInputError as exc:
        typer.echo(f"trajforge.train.builtin: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"trained {log['samples']} samples for {steps} steps in {log['seconds']} s: loss "
               f"{log['first_loss']:.4f} -> {log['last_loss']:.4f}; saved in {out}")


def main() -> None:
    """The command line. Nothing is fetched from the Hugging Face hub: every input is a local folder.

    OpenMP's threads are told to sleep, not spin, while they wait (set before torch loads OpenMP): on a
    machine busy with other work, spinning threads took the cores from the ones computing, and a step
    took ten times longer.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    typer.run(_command)


if __name__ == "__main__":
    main()

"""The `train` stage: M(k+1) = Train(M(k), T(k)) (paper 2.2.3, equations 1-2), the nightly's last stage.

It reads the night's training tables, the versions of every SFT table that the run behind
the night's `train_e2e` version wrote (only the rows that run added: the night's data),
hands them to `loop.trainer` and records the checkpoint it wrote in `checkpoints`. The next
night with `loop.train` rolls out with that checkpoint (`rollout.stage.night_settings`), so
its attempts are a new iteration, numbered from the new model id.

What the trainer gets, in `<warehouse>/train/<name>/`:
- one folder per table in `loop.train_format` (`synth.handoff.export`), for an external
  trainer (ms-swift, LLaMA-Factory, TRL), with its dataset card;
- `text.jsonl`: every sample as a text-only model saw it at rollout (`handoff.text_samples`),
  which the built-in trainer reads.

The command runs with `{out}` a temporary folder renamed to `<checkpoints>/<name>` when it
exits 0 having written a checkpoint, so a crash leaves no half-written model under a name a
night would load; a rerun trains again from scratch. The same data and base model are
trained once: a rerun of the stage on them keeps the checkpoint already registered.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from trajforge.envs.secrets import mask
from trajforge.llm.local import SMOLLM2, smollm2_folder
from trajforge.llm.workspace import Workspace
from trajforge.rollout.stage import policy_model, root_model_id
from trajforge.schemas.config import ConfigError, Settings
from trajforge.schemas.ids import digest
from trajforge.schemas.records import Checkpoint
from trajforge.schemas.stage import Inputs, StageDef, StageOutput
from trajforge.synth.handoff import SFT_TABLES, export, text_samples

LOG_TAIL = 2000
"""Characters of a failed trainer's output quoted in the error (the whole output is in trainer.log)."""


class TrainerError(RuntimeError):
    """The trainer command failed or wrote no checkpoint; the message says which and where its log is."""


@dataclass(frozen=True)
class TrainUnit:
    """One training run: the night's table versions and the model they train from."""

    versions: dict[str, int]
    """SFT table -> the version the night's run wrote."""
    base: str
    """The gateway name of M(k), the night's policy model."""
    base_model_id: str
    root_model_id: str

    @property
    def name(self) -> str:
        """The folder name of its data and checkpoint: the same data on the same base is the same name."""
        refs = ",".join(f"{t}@{v}" for t, v in sorted(self.versions.items()))
        return "ckpt-" + digest(f"{self.base_model_id}|{refs}", 12)

    @property
    def trained_on(self) -> list[str]:
        return trained_on(self.versions)


def trained_on(versions: dict[str, int]) -> list[str]:
    """The table versions as a checkpoint row's `trained_on` holds them: TABLE@SNAPSHOT, by table."""
    return [f"{t}@{v}" for t, v in sorted(versions.items())]


def check_train_tables(asked: list[str], named: Callable[[str], str] = str) -> None:
    """ConfigError for a name in `loop.train_tables` that is no SFT table: checked by the preflight too, so a
    typo stops the night before its first stage rather than at its last; `named` gives the field as the error
    names it (the preflight's says where it was set)."""
    unknown = sorted(set(asked) - SFT_TABLES)
    if unknown:
        raise ConfigError(f"{named('loop.train_tables')}: {unknown} are not SFT tables; they are "
                          f"{', '.join(sorted(SFT_TABLES))}")


def night_tables(ws: Workspace, snapshot: int | None) -> tuple[dict[str, int], Counter[str]]:
    """The SFT table versions with rows that the run behind `train_e2e@snapshot` (None: latest) wrote, limited
    to `loop.train_tables` when given; and what was left out, counted."""
    asked = ws.settings.loop.train_tables
    check_train_tables(asked)
    snapshot = ws.catalog.version("train_e2e", snapshot)
    lineage = ws.catalog.lineage("train_e2e", snapshot)
    if lineage is None:
        raise LookupError(f"train_e2e@{snapshot} has no lineage, so the night that wrote it is unknown")
    versions: dict[str, int] = {}
    left_out: Counter[str] = Counter()
    for table in sorted(asked or SFT_TABLES):
        mine = [i for i in ws.catalog.history(table) if i.lineage is not None and i.lineage.run_id == lineage.run_id]
        if not mine:
            left_out["tables the night's run did not write"] += 1
        elif sum(i.added_rows for i in mine) == 0:
            left_out["tables the night's run wrote no row to"] += 1
        else:
            versions[table] = mine[-1].snapshot_id
    return versions, left_out


def load_night(ws: Workspace, snapshot: int | None) -> Inputs[TrainUnit]:
    """The one training run of a night, or none when its chain has a checkpoint trained on the same data.

    Known by the data, not by the base: the base is the chain's latest checkpoint, which after a crash between
    this stage's commit and the ledger's mark is the night's own, and a rerun asked to train on it again."""
    versions, stats = night_tables(ws, snapshot)
    root = root_model_id(ws)
    done = ws.catalog.load("checkpoints").filter(
        (pl.col("root_model_id") == root) & (pl.col("trained_on").list.join(",") == ",".join(trained_on(versions))))
    if done.height:
        stats["nights already trained on (their checkpoint is registered)"] += 1
        return Inputs([], dict(versions), fingerprint=done["model_id"][0], stats=stats)
    base = policy_model(ws)
    unit = TrainUnit(versions=versions, base=base, base_model_id=ws.gateway.backend(base).model_id, root_model_id=root)
    return Inputs([unit], dict(versions), fingerprint=unit.name, stats=stats)


def base_folder(ws: Workspace, name: str) -> str:
    """What the trainer's {base} is for a gateway model name: the embedded model's converted folder, a
    checkpoint folder, or an endpoint's model name (the user's trainer knows where its weights are)."""
    if name == "local":
        local = ws.settings.llm.local
        # Absolute: the trainer runs in its export folder, where a path relative to the user's folder means nothing.
        folder = smollm2_folder(local.cache_dir) if local.model == SMOLLM2 else Path(local.model).expanduser()
        return str(folder.resolve())
    if Path(name).is_absolute():  # a checkpoint the loop trained: its folder, not its fingerprinted model id
        return str(Path(name).resolve())
    return ws.gateway.backend(name).model_id


def train(units: list[TrainUnit], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Export the night's tables, run the trainer, register what it wrote."""
    out = StageOutput(rows={"checkpoints": []})
    loop = ws.settings.loop
    for unit in units:
        data = ws.catalog.warehouse / "train" / unit.name
        shutil.rmtree(data, ignore_errors=True)  # an earlier attempt's, never trained on: made again
        samples = write_data(ws, unit, data)
        out.stats["training samples"] += samples
        if samples == 0:
            out.dropped["nights with no training sample (every SFT table of the night is empty)"] += 1
            continue
        folder = (loop.checkpoints_dir or ws.catalog.warehouse / "checkpoints").expanduser().resolve() / unit.name
        command, seconds = run_trainer(ws.settings, data, folder, base_folder(ws, unit.base), sorted(unit.versions))
        model_id = str(folder) if loop.serve == "local" else f"{loop.serve}:{folder}"
        out.rows["checkpoints"].append(Checkpoint(
            run_id=run_id, model_id=model_id, checkpoint_hash=folder_hash(folder), folder=str(folder),
            served_by=loop.serve, base_model_id=unit.base_model_id, root_model_id=unit.root_model_id,
            trained_on=unit.trained_on, samples=samples, steps=loop.train_steps, trainer=command, seconds=seconds,
            created_at=datetime.now(timezone.utc)))
        out.models |= {"base": unit.base_model_id, "trained": model_id}
    return out


def write_data(ws: Workspace, unit: TrainUnit, data: Path) -> int:
    """Each table's export in `loop.train_format` and `text.jsonl` of them all; returns the samples written.

    The trainer runs in `data`, so the exports' image paths are relative to it (`TABLE/images/...`: ms-swift opens
    a relative path from where it runs), and for LLaMA-Factory, whose `dataset_dir` is one folder, `data` gets a
    `dataset_info.json` registering every table."""
    data.mkdir(parents=True)
    samples = 0
    registered: dict[str, Any] = {}
    fmt = ws.settings.loop.train_format
    with (data / "text.jsonl").open("w", encoding="utf-8") as f:
        for ref in unit.trained_on:
            table = ref.partition("@")[0]
            export(ws.catalog, ref, fmt, data / table, added_only=True, paths_from=data)
            if fmt == "llamafactory":  # hf's save_to_disk writes a dataset_info.json of its own, no registry
                registered |= json.loads((data / table / "dataset_info.json").read_text())
            for sample in text_samples(ws.catalog, ref, ws.gateway.ocr, added_only=True):
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
                samples += 1
    if registered:
        (data / "dataset_info.json").write_text(json.dumps(registered, indent=2) + "\n")
    return samples


def datasets(fmt: str, data: Path, tables: list[str]) -> list[str]:
    """`{datasets}`: the night's exports as the trainer names them. Only the tables the night wrote rows to have an
    export, so a command that listed `{data}/train_e2e/train.jsonl` itself failed on a night whose rollouts the
    critics all rejected."""
    if fmt == "llamafactory":
        return [",".join(tables)]  # `--dataset a,b` with `--dataset_dir {data}` (its dataset_info.json)
    return [str(data / t / "train.jsonl") if fmt == "ms-swift" else str(data / t) for t in tables]


def run_trainer(settings: Settings, data: Path, folder: Path, base: str, tables: list[str]
                ) -> tuple[str, float]:
    """Run `loop.trainer` into a temporary sibling of `folder`, renamed to it once the command exits 0 having
    written a checkpoint; returns the command as run, secrets masked, and its seconds. Raises TrainerError."""
    loop = settings.loop
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    fields = {"data": data, "out": tmp, "base": base, "steps": loop.train_steps, "python": sys.executable}
    command = loop.trainer.format(**{k: shlex.quote(str(v)) for k, v in fields.items()},
                                  datasets=" ".join(map(shlex.quote, datasets(loop.train_format, data, tables))))
    shown = mask(command)
    log = data / "trainer.log"
    start = time.perf_counter()
    argv = shlex.split(command)
    with log.open("w") as out:
        try:
            done = subprocess.run(argv, cwd=data, stdout=out, stderr=subprocess.STDOUT)
        except OSError as exc:  # not found, not executable; `VAR=1 swift ...` names `VAR=1` as the program
            raise TrainerError(f"loop.trainer: cannot run {mask(argv[0])!r}: {exc.strerror or exc} (the command runs "
                               f"without a shell: set variables in the environment, not before the program): "
                               f"{shown}") from None
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise TrainerError(f"loop.trainer exited {done.returncode}: {shown}\n(its output is in {log}; the end:)\n"
                           + mask(log.read_text(errors="replace")[-LOG_TAIL:]))
    needed = "config.json" if loop.serve == "local" else None
    if not tmp.is_dir() or not any(tmp.iterdir()) or (needed and not (tmp / needed).is_file()):
        raise TrainerError(f"loop.trainer exited 0 but wrote no checkpoint into {{out}} ({tmp}"
                           + (f": no {needed}, which loading it in process needs" if needed else "") + f"): {shown}")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return shown, seconds


def folder_hash(folder: Path) -> str:
    """sha256 over the folder's files: each relative path and its bytes, in path order."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def train_summary(stats: dict[str, int]) -> str | None:
    return f"{stats.get('training samples', 0)} training samples" if stats.get("training samples") else None


STAGE = StageDef[Workspace, TrainUnit](
    name="train",
    key=lambda u: u.name,
    reads="train_e2e",
    writes={"checkpoints": "append"},
    sections=("loop", "llm", "rollout"),
    load=load_night,
    run=train,
    shard_size=lambda s: 1,
    enabled=lambda s: s.loop.train,
    summary=train_summary,
)

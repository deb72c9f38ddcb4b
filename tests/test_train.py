"""The loop's train stage through the CLI, with a user's trainer command: a night on the shop app with the replay
policy and `loop.train` hands its training tables to `tests/fixtures/user_trainer.py`, registers the checkpoint
it writes, and the next rollout acts with that checkpoint as a new model iteration (real browser, Prefect,
catalog, and the embedded model's weights loaded from the checkpoint folder)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest
from conftest import REPLAY_NIGHT_CONFIG, require
from test_handoff import commit_reasoning
from test_pipeline import by_policy, cli, workspace

from trajforge.data.catalog import Lineage, commit_key
from trajforge.flows.pipeline import run_identity
from trajforge.flows.stages import stages
from trajforge.llm.local import missing_models, smollm2_folder
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import ConfigError, LocalModelSettings, Settings, load_settings
from trajforge.schemas.records import Checkpoint, QueryAttempt
from trajforge.synth.handoff import SFT_TABLES
from trajforge.synth.report import render_iterations
from trajforge.tasks.runner import commit, plan, run_shard
from trajforge.train.stage import TrainerError, TrainUnit, base_folder, folder_hash, run_trainer, write_data

pytestmark = pytest.mark.browser

USER_TRAINER = Path(__file__).parent / "fixtures" / "user_trainer.py"
LOOP = f"""
loop:
  train: true
  train_steps: 3
  trainer: "{{python}} {USER_TRAINER} {{data}} {{out}} {{base}} {{steps}} {{datasets}}"
"""


CONFIG = REPLAY_NIGHT_CONFIG.replace("num_queries: 2", "num_queries: 1") + LOOP
"""The replay night on one query (the suite's time is a budget), with the user's trainer."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, chromium, trajforge_cli) -> Path:
    """A replay night with loop.train and the user's trainer: its folder."""
    reason = missing_models()
    require(reason is None, str(reason))
    cwd = tmp_path_factory.mktemp("train")
    (cwd / "trajforge.yaml").write_text(CONFIG)
    cli(trajforge_cli, cwd, "run", "nightly")
    return cwd


def test_the_users_trainer_gets_the_nights_tables_and_its_checkpoint_is_registered(trained):
    ws = workspace(trained)
    (row,) = ws.catalog.load("checkpoints").iter_rows(named=True)
    run_id = row["run_id"]
    night = {t: i.snapshot_id for t in SFT_TABLES for i in ws.catalog.history(t)
             if i.lineage is not None and i.lineage.run_id == run_id and i.added_rows > 0}
    assert row["trained_on"] == sorted(f"{t}@{v}" for t, v in night.items()) and "train_e2e" in night
    folder = Path(row["folder"])
    received = json.loads((folder / "received.json").read_text())
    # Each table reached the trainer as its ms-swift export, with exactly the rows the night added to it.
    assert received["tables"] == {t: ws.catalog.rows_added(t, v)[0].height for t, v in night.items()}
    assert received["tables"]["train_e2e"] > 0 and received["steps"] == 3
    assert received["datasets"] == [f"{t}/train.jsonl" for t in sorted(night)]  # {datasets}: one argument each
    # Every image opens from the folder the trainer runs in, as ms-swift opens a relative path.
    assert received["images"] >= received["tables"]["train_e2e"] and received["images_missing"] == []
    assert received["base"] == str(smollm2_folder(LocalModelSettings().cache_dir))
    assert received["text_samples"] == row["samples"] >= sum(received["tables"].values())
    assert row["checkpoint_hash"] == folder_hash(folder) and row["model_id"] == str(folder)
    assert row["base_model_id"] == row["root_model_id"] == "SmolLM2-135M-Instruct.Q4_1"
    assert "user_trainer.py" in row["trainer"] and str(folder) not in row["trainer"]  # {out} was a temporary
    # The checkpoint is the night's: tagged with its other versions.
    (info,) = ws.catalog.history("checkpoints")
    assert info.tags == ws.catalog.history("train_e2e")[-1].tags


def test_text_samples_show_screens_as_the_text_only_model_saw_them(trained):
    ws = workspace(trained)
    (row,) = ws.catalog.load("checkpoints").iter_rows(named=True)
    data = ws.catalog.warehouse / "train" / Path(row["folder"]).name
    samples = [json.loads(line) for line in (data / "text.jsonl").read_text().splitlines()]
    e2e = [s for s in samples if s["table"] == "train_e2e"]
    assert e2e and all(s["completion"][0]["role"] == "assistant" for s in samples)
    user = e2e[0]["prompt"][-1]["content"]
    assert "[Screenshot 1, shown as OCR text" in user and "[Accessibility tree of screenshot 1]" in user
    # The answer is the step's own, as train_e2e holds it.
    source = ws.catalog.load("train_e2e").filter(pl.col("sample_id") == e2e[0]["sample_id"])
    answer = json.loads(source["messages_json"][0])[-1]["content"][0]["text"]
    assert e2e[0]["completion"][0]["content"] == answer


def test_lineage_from_the_model_and_from_a_training_version(trained, trajforge_cli):
    ws = workspace(trained)
    (row,) = ws.catalog.load("checkpoints").iter_rows(named=True)
    listed = cli(trajforge_cli, trained, "checkpoints", "--model", row["checkpoint_hash"][:12]).stdout.split()
    assert listed == row["trained_on"]
    (tag,) = [t for t in ws.catalog.history("train_e2e")[-1].tags if t.startswith("nightly-")]
    shown = cli(trajforge_cli, trained, "checkpoints", "--trained-on", f"train_e2e@{tag}").stdout
    assert "1 checkpoint(s)" in shown and row["checkpoint_hash"][:12] in shown


def test_the_next_rollout_acts_with_the_checkpoint_as_a_new_iteration(trained, trajforge_cli):
    (trained / "trajforge.yaml").write_text(CONFIG.replace("policy: replay", "policy: gui_owl_e2e"))
    for stage in ("rollout", "critics", "history"):
        cli(trajforge_cli, trained, "run", stage)
    ws = workspace(trained)
    (row,) = ws.catalog.load("checkpoints").iter_rows(named=True)
    episodes = by_policy(ws.catalog.load("episodes")).filter(pl.col("policy") == "gui_owl_e2e")
    # Served in process, its answers are recorded under its folder and the fingerprint of its weights.
    recorded = ws.gateway.backend(row["model_id"]).model_id
    assert recorded.startswith(f"{row['folder']}@")
    assert episodes.height > 0 and set(episodes["model_id"]) == {recorded}
    history = ws.catalog.load("query_history")
    assert dict(history.select("model_id", "iteration").unique().iter_rows()) == {"replay": 0, recorded: 1}


def test_a_trainer_that_fails_names_its_exit_and_log_and_registers_nothing(trained, trajforge_cli):
    failing = trained / "failing_trainer.py"
    failing.write_text("import sys\nprint('CUDA out of memory')\nsys.exit(3)\n")
    (trained / "trajforge.yaml").write_text(CONFIG.replace(str(USER_TRAINER), str(failing))
                                            + "  train_tables: [train_e2e]\n")
    proc = subprocess.run([trajforge_cli, "run", "train"], cwd=trained, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "loop.trainer exited 3" in proc.stderr + proc.stdout and "out of memory" in proc.stderr + proc.stdout
    assert workspace(trained).catalog.load("checkpoints").height == 1


def test_a_night_without_loop_train_trains_nothing(replay_night):
    cwd, _ = replay_night
    assert workspace(cwd).catalog.history("checkpoints") == []
    assert not (cwd / "data" / "warehouse" / "train").exists()


def test_the_trainer_command_is_checked_when_the_config_loads(tmp_path):
    path = tmp_path / "trajforge.yaml"
    path.write_text("loop:\n  trainer: 'swift sft --dataset {dataset} --output_dir {out}'\n")
    with pytest.raises(ConfigError, match=r"loop.trainer.*unknown \['dataset'\]"):
        load_settings(path)


def test_a_train_table_that_is_no_sft_table_stops_the_night_before_any_work(tmp_path, trajforge_cli):
    # It was caught by the train stage only, the night's last, after 20-30 minutes of work, and with exit 1.
    (tmp_path / "trajforge.yaml").write_text("loop:\n  train: true\n  train_tables: [train_e2ee]\n")
    proc = subprocess.run([trajforge_cli, "run", "nightly"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "loop.train_tables: ['train_e2ee'] are not SFT tables" in proc.stderr
    assert not (tmp_path / "data").exists()


def test_a_relative_model_folder_reaches_the_trainer_as_an_absolute_one(tmp_path, monkeypatch):
    # The trainer runs in its export folder: `llm.local.model: models/policy` handed on as it was written named a
    # folder that is not there, after a night whose rollouts had found it.
    (tmp_path / "models" / "policy").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAJFORGE_LLM__LOCAL__MODEL", "models/policy")
    assert base_folder(Workspace.open(load_settings(None)), "local") == str(tmp_path / "models" / "policy")


def test_a_checkpoint_goes_by_its_folder_to_the_trainer_and_in_the_report(tmp_path):
    """A checkpoint served in process records its answers as FOLDER@FINGERPRINT (a model retrained in place is a
    new model), yet the trainer's {base} is its folder, and the report finds the checkpoint that made a rollout."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "warehouse"}))
    assert base_folder(ws, str(folder)) == str(folder)
    recorded = ws.gateway.backend(str(folder)).model_id
    assert recorded.startswith(f"{folder}@")
    at = datetime(2026, 12, 1, tzinfo=UTC)
    checkpoints = pl.DataFrame([Checkpoint(
        run_id="night-1", model_id=str(folder), checkpoint_hash="ab" * 32, folder=str(folder), served_by="local",
        base_model_id="base", root_model_id="base", trained_on=["train_e2e@1"], samples=1, steps=1, trainer="t",
        seconds=1.0, created_at=at).model_dump()])
    history = pl.DataFrame([QueryAttempt(
        run_id="night-2", episode_id="ep", query_id="q", app="shop", source="page_graph", iteration=1,
        policy="model", model_id=recorded, success=True, judged_at=at).model_dump()])
    report = "\n".join(render_iterations(history, checkpoints, "night-2"))
    assert f"- Rollouts: iteration 1, {recorded} (checkpoint abababababab from base)." in report


def test_a_train_stage_that_died_after_its_commit_finishes_on_rerun_without_training_again(trained, monkeypatch):
    """Last in this file, as it registers a second checkpoint. The process died after the stage's checkpoint was
    committed and before the ledger heard of it. The chain's latest checkpoint is now the stage's own, the base a
    new plan would train from: the rerun sees the night trained (a checkpoint of its chain on the same data),
    trains nothing, and finishes the stage with the version that landed (it used to fail on every rerun)."""
    (trained / "trajforge.yaml").write_text(CONFIG + "  train_tables: [train_e2e]\n")
    monkeypatch.chdir(trained)
    ws = Workspace.open(load_settings(trained / "trajforge.yaml"))
    stage = stages()["train"]
    run_id = ws.ledger.open_run("train", "died after its commit").run_id
    first = plan(stage, ws, run_id, None)
    (shard,) = first.pending
    run_shard(first, shard, ws)
    (record,) = ws.ledger.shards_done(run_id, "train")
    landed = ws.catalog.commit_files("checkpoints", record.files["checkpoints"], Lineage(
        stage="train", run_id=run_id, commit_key=commit_key(run_id, "train", "checkpoints"), config_hash="x",
        code_version="x"))

    again = plan(stage, ws, run_id, None)
    assert again.pending == [] and again.input_stats["nights already trained on (their checkpoint is registered)"]
    assert commit(again, ws) == {"checkpoints": landed} == ws.ledger.committed(run_id, "train")
    assert ws.catalog.load("checkpoints").height == 2  # the night's, and this stage's once


def test_only_a_llamafactory_export_is_registered_in_the_data_folders_dataset_info(tmp_path):
    """`datasets`' save_to_disk writes a dataset_info.json of its own in each `hf` table folder: read as LLaMA-Factory's
    registry, its description fields were merged into `{data}/dataset_info.json`, a file no trainer of `hf` wants.
    Either way `text.jsonl` holds each answer as the text-only model reads its prompt."""
    def opened(**loop: str) -> Workspace:
        return Workspace.open(Settings(warehouse={"path": tmp_path / "warehouse"}, loop=loop))

    catalog = opened().catalog
    commit_reasoning(catalog, "r", ["cot"])
    unit = TrainUnit(versions={"train_reasoning": catalog.version("train_reasoning", None)}, base="b",
                     base_model_id="b", root_model_id="b")
    for fmt in ("hf", "llamafactory"):
        assert write_data(opened(train_format=fmt), unit, tmp_path / fmt) == 1
        assert (tmp_path / fmt / "train_reasoning").is_dir()
        [sample] = [json.loads(line) for line in (tmp_path / fmt / "text.jsonl").read_text().splitlines()]
        assert sample["completion"] == [{"role": "assistant", "content": "<thinking>Tap Cart.</thinking>"}]
        assert sample["table"] == "train_reasoning" and sample["sample_id"] == "cot"
        assert "Open the cart." in sample["prompt"][0]["content"]
    assert not (tmp_path / "hf" / "dataset_info.json").exists()
    registered = json.loads((tmp_path / "llamafactory" / "dataset_info.json").read_text())
    assert list(registered) == ["train_reasoning"]
    assert registered["train_reasoning"]["file_name"] == "train_reasoning/train.jsonl"


def test_a_trainer_program_that_cannot_run_is_named(tmp_path):
    """`CUDA_VISIBLE_DEVICES=0 swift sft ...`, ms-swift's usual form, runs no shell: `CUDA_VISIBLE_DEVICES=0` was
    the program, and the night stopped on a bare FileNotFoundError."""
    (tmp_path / "data").mkdir()
    settings = Settings(loop={"trainer": "CUDA_VISIBLE_DEVICES=0 swift sft --dataset {data} --output_dir {out}"})
    with pytest.raises(TrainerError, match=r"cannot run 'CUDA_VISIBLE_DEVICES=0'.*without a shell"):
        run_trainer(settings, tmp_path / "data", tmp_path / "ckpt", "base", ["train_e2e"])
    assert not (tmp_path / "ckpt").exists()


def test_fixing_what_stopped_a_night_resumes_it_rather_than_starting_another():
    """A night stopped by its trainer (not installed, out of memory), an endpoint's timeout or a worker count is
    fixed by editing that setting: the rerun must resume the night, or its training rows never reach a trainer and
    the stopped run stays unfinished. What the night does (its steps, its apps) is still a new night."""
    night = Settings(loop={"train": True, "trainer": "swift sft --dataset {data} --output_dir {out}"})
    fixed = Settings(loop={"train": True, "trainer": "{python} -m trajforge.train.builtin --data {data} --out {out}"},
                     runner={"workers": 3}, llm={"cache": False})
    assert run_identity("nightly", fixed) == run_identity("nightly", night)
    assert run_identity("nightly", Settings(loop={"train": True, "train_steps": 7})) != run_identity("nightly", night)
    assert run_identity("nightly", Settings(loop={"train": True}, query_gen={"apps": ["shop"]})) != run_identity(
        "nightly", Settings(loop={"train": True}))

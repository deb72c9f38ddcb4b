"""The ms-swift, LLaMA-Factory and verl exports opened by those trainers' own loaders, after a real night.

Neither trainer installs beside our pins (ms-swift wants transformers < 5.20 and trl < 1.0; LLaMA-Factory
wants transformers <= 5.6 and imports torchaudio, which has no build for our torch 2.13.0; verl pins vLLM
and its torch), and a whole
environment of theirs is several GB (torch 2.14.1 with CUDA). So each trainer's wheel and the few pure
packages its loading code imports are installed without dependencies into a folder of their own, and the
loader runs in a subprocess over our transformers and datasets: LLaMA-Factory with its version check off
(DISABLE_VERSION_CHECK, its documented switch) and an empty `torchaudio` module, which only its audio
plugin calls. What runs is the trainers' own code from file to rows: LLaMA-Factory's dataset_info.json
parser and sharegpt converter with its media_dir resolution, ms-swift's `load_dataset` with its
AutoPreprocessor, verl's `RLHFDataset` (with a small processor built here: no model is downloaded) and
its custom reward function loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require
from test_pipeline import workspace

from trajforge.synth.handoff import export

pytestmark = pytest.mark.browser

LLAMAFACTORY = ["llamafactory==0.9.5", "peft==0.18.1"]
MS_SWIFT = ["ms-swift==4.6.0", "modelscope==1.40.2", "modelscope-hub==0.5.1", "peft==0.18.1", "json-repair==0.64.6",
            "aiohttp==3.14.5", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
            "multidict==7.2.1", "yarl==1.25.1", "propcache==0.5.4"]

VERL = ["verl==0.9.1", "ray==2.60.0", "msgpack==1.2.4", "tensordict==0.15.3", "pyvers==0.2.3"]

LLAMAFACTORY_LOAD = """
import json, sys
from llamafactory.data.loader import _load_single_dataset
from llamafactory.data.parser import get_dataset_list
from llamafactory.hparams import DataArguments, ModelArguments
from transformers import Seq2SeqTrainingArguments
folder, name, scratch = sys.argv[1:]
(attr,) = get_dataset_list([name], folder)
data = _load_single_dataset(attr, ModelArguments(model_name_or_path="unused"),
                            DataArguments(dataset_dir=folder, media_dir=folder, dataset=[name]),
                            Seq2SeqTrainingArguments(output_dir=scratch))
print(json.dumps([{k: data[i][k] for k in ("_system", "_prompt", "_response", "_images")} for i in range(len(data))]))
"""

MS_SWIFT_LOAD = """
import json, sys
from swift.dataset import load_dataset
train, _ = load_dataset([sys.argv[1]], split_dataset_ratio=0.0, num_proc=1)
print(json.dumps([{"messages": row["messages"], "images": [i["path"] for i in row["images"]]} for row in train]))
"""

VERL_LOAD = """
import json, sys
from omegaconf import OmegaConf
from test_handoff import tiny_processor
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.dataset.rl_dataset import RLHFDataset
folder, scratch = sys.argv[1:]
processor = tiny_processor()
config = OmegaConf.create({"cache_dir": scratch, "max_prompt_length": 100000, "filter_overlong_prompts": False})
data = RLHFDataset(f"{folder}/train.parquet", processor.tokenizer, config, processor=processor)
score = get_custom_reward_fn(OmegaConf.create(
    {"reward": {"custom_reward_function": {"path": f"{folder}/reward.py", "name": "compute_score"}}}))
rows = []
for i in range(len(data)):
    item = data[i]
    images = [p["image"].size for m in item["raw_prompt"] if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    args = {"data_source": item["data_source"], "solution_str": "",
            "ground_truth": item["reward_model"]["ground_truth"]}
    try:
        no_state = score(**args, extra_info=item["extra_info"])
    except Exception as exc:
        no_state = type(exc).__name__
    empty = score(**args, extra_info={**item["extra_info"], "final_state": {}})
    rows.append({"query_id": item["extra_info"]["query_id"], "images": images,
                 "roles": [m["role"] for m in item["raw_prompt"]], "no_state": no_state, "empty_state": empty})
print(json.dumps(rows))
"""


def _install(packages: list[str], target: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                           str(target), *packages], capture_output=True, text=True, timeout=600, check=False)
    require(proc.returncode == 0, f"pip could not install {' '.join(packages)}: {proc.stderr[-600:]}")
    return target


def _run(script: str, args: list[str], path: list[Path], cwd: Path, **env: str) -> list[dict]:
    """The loader's rows as JSON (the last line of its output), or a failure with the loader's own error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path)), **env}
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def train_e2e(replay_night):
    cwd, tag = replay_night
    catalog = workspace(cwd).catalog
    return catalog, tag, catalog.load(f"train_e2e@{tag}").sort("sample_id")


def _stored(rows) -> list[tuple]:
    """Each stored sample as (roles, assistant answer, PNGs), sorted: what a loader must give back."""
    samples = []
    for row in rows.iter_rows(named=True):
        messages = json.loads(row["messages_json"])
        answer = "".join(p["text"] for p in messages[-1]["content"] if p["type"] == "text")
        samples.append(([m["role"] for m in messages], answer, list(row["images"])))
    return sorted(samples)


def test_llamafactory_reads_the_export_with_its_own_loader(train_e2e, tmp_path):
    catalog, tag, rows = train_e2e
    out = export(catalog, f"train_e2e@{tag}", "llamafactory", tmp_path / "lf").out
    stub = tmp_path / "stub" / "torchaudio"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('"""Empty: LLaMA-Factory imports it for audio only."""\n')
    site = _install(LLAMAFACTORY, tmp_path / "site")
    loaded = _run(LLAMAFACTORY_LOAD, [str(out), "train_e2e", str(tmp_path / "scratch")], [site, stub.parent],
                  tmp_path, DISABLE_VERSION_CHECK="1")
    assert rows.height > 0 and all(r["_system"] for r in loaded)
    for r in loaded:  # one <image> per image, and every image name the converter joined to media_dir exists
        assert sum(m["content"].count("<image>") for m in r["_prompt"]) == len(r["_images"])
        assert all(Path(p).is_file() for p in r["_images"])
    got = sorted((["system", *(m["role"] for m in r["_prompt"]), "assistant"], r["_response"][0]["content"],
                  [Path(p).read_bytes() for p in r["_images"]]) for r in loaded)
    assert got == _stored(rows)


def test_ms_swift_reads_the_export_with_its_own_loader(train_e2e, tmp_path):
    catalog, tag, rows = train_e2e
    out = export(catalog, f"train_e2e@{tag}", "ms-swift", tmp_path / "swift").out
    site = _install(MS_SWIFT, tmp_path / "site")
    # Run from the export's folder, as its card says: the image paths are relative to it.
    loaded = _run(MS_SWIFT_LOAD, ["train.jsonl"], [site], out, MODELSCOPE_CACHE=str(tmp_path / "modelscope"))
    assert rows.height > 0
    for r in loaded:
        assert sum(m["content"].count("<image>") for m in r["messages"]) == len(r["images"])
    got = sorted(([m["role"] for m in r["messages"]], r["messages"][-1]["content"],
                  [(out / p).read_bytes() for p in r["images"]]) for r in loaded)
    assert got == _stored(rows)


def test_verl_reads_the_export_with_its_own_dataset_and_reward_loader(replay_night, tmp_path):
    cwd, tag = replay_night
    catalog = workspace(cwd).catalog
    queries = catalog.load(f"queries@{tag}")
    out = export(catalog, f"queries@{tag}", "verl", tmp_path / "verl", viewport="mobile").out
    site = _install(VERL, tmp_path / "site")
    loaded = _run(VERL_LOAD, [str(out), str(tmp_path / "scratch")], [site, Path(__file__).parent], tmp_path)
    assert sorted(r["query_id"] for r in loaded) == sorted(queries["query_id"].to_list())
    for r in loaded:
        # verl put the start screen where <image> was, as a decoded image of the app's viewport.
        assert r["roles"] == ["system", "user"] and len(r["images"]) == 1 and r["images"][0][0] > 0
        # verl's loader found compute_score. The row's extra_info as stored has no final state: that raises, as a
        # run whose rewards were all 0.0 would learn nothing without saying so; a state the checker rejects is 0.0.
        assert r["no_state"] == "FinalStateMissing" and r["empty_state"] == 0.0

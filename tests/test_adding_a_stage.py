"""The README's "Adding a stage" recipe, followed to the letter on a toy stage in a module of its own.

If the recipe stops working (the contract moves, the runner needs a file the recipe does
not name), this test fails before a newcomer finds out.
"""

from __future__ import annotations

import textwrap

import pytest

from trajforge.flows.stages import NIGHTLY, stages
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings
from trajforge.schemas.records import RECORDS
from trajforge.tasks.runner import commit, plan, run_shard

TOY_MODULE = '''
"""A toy stage: one row per word, its length; a word named "boom" drops with its reason."""

from dataclasses import dataclass
from typing import ClassVar

from trajforge.llm.workspace import Workspace
from trajforge.schemas.records import Record
from trajforge.schemas.stage import Inputs, StageDef, StageOutput


class WordLength(Record):                       # 1. the record schema of the new table
    table: ClassVar[str] = "word_lengths"
    key: ClassVar[str] = "word"
    word: str
    length: int


@dataclass(frozen=True)
class WordUnit:                                 # 2. a typed unit of work
    word: str


def load_words(ws: Workspace, snapshot: int | None) -> Inputs[WordUnit]:
    return Inputs(units=[WordUnit(w) for w in ("ant", "boom", "cat", "dingo", "emu")], fingerprint="words-v1")


def measure(units: list[WordUnit], ws: Workspace, run_id: str, config_hash: str) -> StageOutput:
    out = StageOutput(rows={"word_lengths": []}, models={"measure": "len"})
    for u in units:
        if u.word == "boom":
            out.dropped["a word that explodes"] += 1
            continue
        out.rows["word_lengths"].append(WordLength(run_id=run_id, word=u.word, length=len(u.word)))
    return out


STAGE = StageDef[Workspace, WordUnit](          # 3. the declaration, next to the code
    name="word_lengths", key=lambda u: u.word, reads=None, writes={"word_lengths": "append"},
    sections=("query_gen",), load=load_words, run=measure, shard_size=lambda s: 2,
)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy module importable as `toy_stage`, its record registered in RECORDS as the recipe says."""
    (tmp_path / "toy_stage.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_stage

    monkeypatch.setitem(RECORDS, toy_stage.WordLength.table, toy_stage.WordLength)
    return toy_stage


def test_a_stage_added_by_the_recipe_runs_through_the_runner(toy, tmp_path):
    night = stages((*NIGHTLY, "toy_stage"))  # 4. one line in flows/stages.py's NIGHTLY
    assert list(night)[-1] == "word_lengths" and list(night)[:-1] == list(stages())
    stage = night["word_lengths"]
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    try:
        p = plan(stage, ws, "run-toy", None)
        assert p.total == 3  # five words, two per shard
        run_shard(p, p.pending[0], ws)  # a crash after the first shard ...
        p = plan(stage, ws, "run-toy", None)
        assert len(p.pending) == 2  # ... and the rerun does only what is left
        for shard in p.pending:
            run_shard(p, shard, ws)
        snapshot = commit(p, ws)["word_lengths"]
        rows = ws.catalog.load("word_lengths", snapshot).sort("word")
        assert rows.select("word", "length").rows() == [("ant", 3), ("cat", 3), ("dingo", 5), ("emu", 3)]
        lineage = ws.catalog.lineage("word_lengths", snapshot)
        assert lineage is not None
        assert lineage.stage == "word_lengths" and lineage.dropped == {"a word that explodes": 1}
        assert lineage.kept == {"word_lengths": 4} and lineage.models == {"measure": "len"}
    finally:
        ws.catalog.close()


def test_a_module_without_a_stage_is_named_in_the_error(tmp_path, monkeypatch):
    (tmp_path / "not_a_stage.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="not_a_stage declares no STAGE"):
        stages(("not_a_stage",))

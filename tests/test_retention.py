"""Retention: old versions expire (tagged and current ones kept), and the data files and screenshot blobs that
no remaining version references are removed; what an unfinished run will still commit is kept."""

from __future__ import annotations

import io
import os
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_catalog import _purge_postgres, lineage, query_row, step_row
from test_pipeline import workspace

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Catalog, CorruptData, UnknownRef
from trajforge.data.ledger import Ledger, RunLocked, ShardRecord, scope_of
from trajforge.data.retention import expire, sharing_scopes
from trajforge.llm.cache import ResponseCache, responses
from trajforge.llm.calls import Completion
from trajforge.schemas.records import Checkpoint, Verdict
from trajforge.schemas.tables import to_arrow


def verdict_row(run_id: str, episode_id: str, success: bool) -> Verdict:
    return Verdict(run_id=run_id, verdict_id=f"{run_id}:{episode_id}", episode_id=episode_id, query_id="q",
                   success=success, consensus="checker_first", channels_json="{}", reason="r", config_hash="x")


def png(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (shade, shade, shade)).save(buf, "PNG")
    return buf.getvalue()


def shard(catalog: Catalog, name: str, rows: list[dict]) -> Path:
    path = catalog.data_dir("steps") / f"{name}.parquet"
    pq.write_table(to_arrow("steps", rows), path)
    return path


def local(uri: str) -> Path:
    return Path(urlparse(uri).path)


def iceberg_tree(catalog: Catalog, table: str, versions: list[int]) -> set[Path]:
    """The manifest lists and manifests of these versions of the table, as pyiceberg lists them."""
    tbl = catalog.iceberg.load_table((catalog.namespace, table))
    snapshots = [tbl.snapshot_by_id(v) for v in versions]
    return {local(uri) for s in snapshots for uri in (s.manifest_list, *(m.manifest_path for m in s.manifests(tbl.io)))}


def test_expire_keeps_tagged_and_current_versions_and_removes_what_only_old_versions_used(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "warehouse")
    blobs = BlobStore(catalog.warehouse / "blobs")
    ledger = Ledger(catalog.uri)
    shots = [blobs.put(png(shade)).sha256 for shade in (10, 20, 30, 40, 50)]
    # v1 (tagged), v2 (neither tagged nor current), v3 (current): an overwrite each, one screenshot pair each.
    versions = []
    for i in range(3):
        path = shard(catalog, f"v{i}", [step_row(f"s{i}", screenshot_before=shots[i], screenshot_after=shots[i])])
        versions.append(catalog.commit_files("steps", [path], lineage(f"v{i}", stage="rollout", run_id=f"r{i}"),
                                             mode="overwrite"))
    catalog.tag("steps", versions[0], "nightly-2026-11-01")
    # A crashed run's shard, not committed yet: its rerun will commit it.
    pending = shard(catalog, "pending", [step_row("s9", screenshot_before=shots[3], screenshot_after=shots[3])])
    run = ledger.open_run("nightly", "x").run_id
    ledger.record_shard(run, "rollout", ShardRecord("sh1", {"steps": [str(pending)]}, {}, {}, {}, {}, {}))
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    v2_list = local(catalog.iceberg.load_table((catalog.namespace, "steps")).snapshot_by_id(versions[1]).manifest_list)

    dry = expire(catalog, blobs, ledger, timedelta(0), dry_run=True, now=later)
    assert dry.snapshots == {"steps": [versions[1]]}
    assert [p.name for p in dry.data_files] == ["v1.parquet"]
    kept_tree = iceberg_tree(catalog, "steps", [versions[0], versions[2]])
    assert v2_list in dry.metadata_files and not set(dry.metadata_files) & kept_tree
    assert sorted(p.parent.name + p.name for p in dry.blobs) == sorted([shots[1], shots[4]])  # v2's and the unused
    assert all(p.exists() for p in (*dry.data_files, *dry.metadata_files, *dry.blobs))  # a dry run lists only
    assert catalog.load("steps", versions[1]).height == 1

    gone = expire(catalog, blobs, ledger, timedelta(0), now=later)
    assert gone.snapshots == dry.snapshots and gone.data_files == dry.data_files and gone.blobs == dry.blobs
    assert gone.metadata_files == dry.metadata_files
    avro = {p for p in catalog.data_dir("steps").with_name("metadata").iterdir() if p.suffix == ".avro"}
    assert avro == kept_tree  # nothing unreferenced is left
    assert not any(p.exists() for p in (*gone.data_files, *gone.metadata_files, *gone.blobs)) and gone.bytes > 0
    fresh = Catalog(tmp_path / "warehouse")
    assert fresh.load("steps@nightly-2026-11-01")["step_id"].to_list() == ["s0"]
    assert fresh.load("steps@latest")["step_id"].to_list() == ["s2"]
    with pytest.raises(UnknownRef):
        fresh.load("steps", versions[1])
    assert pending.exists() and shots[3] in blobs and shots[0] in blobs and shots[2] in blobs

    again = expire(fresh, blobs, ledger, timedelta(0), now=later)  # nothing left to do
    assert (again.snapshots, again.data_files, again.metadata_files, again.blobs) == ({}, [], [], [])


def test_expire_keeps_the_screenshots_another_namespace_of_the_warehouse_mentions(tmp_path: Path) -> None:
    """Two configurations share a warehouse folder, each with its own namespace, and so the one blob store beside
    the catalog. Expire on one read only its own tables' hashes and removed the other's screenshots."""
    ours = Catalog(tmp_path / "warehouse", namespace="ours")
    theirs = Catalog(tmp_path / "warehouse", namespace="theirs")
    blobs = BlobStore(ours.warehouse / "blobs")
    their_shot, our_old, unused = (blobs.put(png(shade)).sha256 for shade in (10, 20, 30))
    theirs.commit_files("steps", [shard(theirs, "t", [step_row("t1", screenshot_before=their_shot)])],
                        lineage("t", stage="rollout", run_id="t"))
    ours.commit_files("steps", [shard(ours, "o1", [step_row("o1", screenshot_before=our_old)])],
                      lineage("o1", stage="rollout", run_id="o1"), mode="overwrite")
    ours.commit_files("steps", [shard(ours, "o2", [step_row("o2")])], lineage("o2", stage="rollout", run_id="o2"),
                      mode="overwrite")
    later = datetime.now(timezone.utc) + timedelta(seconds=5)

    gone = expire(ours, blobs, Ledger(ours.uri), timedelta(0), now=later)

    assert sorted(p.parent.name + p.name for p in gone.blobs) == sorted([our_old, unused])
    assert their_shot in blobs
    assert theirs.load("steps")["screenshot_before"].to_list() == [their_shot]


@pytest.mark.postgres
def test_expire_waits_for_no_run_of_another_namespace_of_the_warehouse(postgres_url: str, tmp_path: Path) -> None:
    """The namespaces of one warehouse share its blob store and train/ folder: a run of another namespace storing
    again a screenshot expire is removing (an old file: the cutoff does not keep it) would commit a row whose image
    is gone. On PostgreSQL each namespace has its own writer lock, so expire holds every one of them."""
    name = f"test-{uuid.uuid4().hex}"
    ours = Catalog(tmp_path / "warehouse", uri=postgres_url, namespace="ours", name=name)
    theirs = Catalog(tmp_path / "warehouse", uri=postgres_url, namespace="theirs", name=name)
    try:
        for catalog in (ours, theirs):
            catalog.commit_files("steps", [shard(catalog, catalog.namespace, [step_row(catalog.namespace)])],
                                 lineage(catalog.namespace, stage="rollout", run_id=catalog.namespace))
        assert sharing_scopes(ours) == [scope_of(name, "theirs")]
        our_ledger, their_ledger = (Ledger(postgres_url, scope_of(name, ns)) for ns in ("ours", "theirs"))
        with their_ledger.writing("nightly"):
            with our_ledger.writing("query_gen"):  # a run of ours alone does not wait for theirs
                pass
            with pytest.raises(RunLocked, match=f"{name}/theirs"):
                with our_ledger.writing("expire", also=sharing_scopes(ours)):
                    pass
        with our_ledger.writing("expire", also=sharing_scopes(ours)):
            with pytest.raises(RunLocked, match=f"{name}/theirs"), their_ledger.writing("nightly"):
                pass
        with their_ledger.writing("nightly"), our_ledger.writing("query_gen"):  # both released
            pass
    finally:
        _purge_postgres(postgres_url, name)


def test_expire_names_the_table_and_file_of_a_data_file_it_cannot_read(tmp_path: Path) -> None:
    """A kept version's file cut short: expire (a dry run too) said only polars' or Arrow's "File out of
    specification", naming no table or file; load named them. The current version's file is read for its runs, a
    tagged older one's for its screenshots."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    tagged = catalog.commit_files("steps", [shard(catalog, "v1", [step_row("s1")])], lineage("v1", run_id="r1"),
                                  mode="overwrite")
    catalog.tag("steps", tagged, "keep-me")
    current = catalog.commit_files("steps", [shard(catalog, "v2", [step_row("s2")])], lineage("v2", run_id="r2"),
                                   mode="overwrite")
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    folder = catalog.data_dir("steps")
    for version, name in ((tagged, "v1.parquet"), (current, "v2.parquet")):
        good = (folder / name).read_bytes()
        (folder / name).write_bytes(good[:100])
        for dry_run in (True, False):
            with pytest.raises(CorruptData, match=rf"steps@{version}: data file {folder / name} cannot be read"):
                expire(catalog, blobs, ledger, timedelta(0), dry_run=dry_run, now=later)
        (folder / name).write_bytes(good)
    assert len(catalog.history("steps")) == 2  # nothing expired before the error


def test_a_version_a_kept_version_was_made_from_is_kept(tmp_path: Path) -> None:
    """steps@current names queries@first as its input; queries has moved on, yet that version stays."""
    catalog = Catalog(tmp_path / "warehouse")
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("q1"))
    catalog.commit_files("steps", [shard(catalog, "s", [step_row("s1")])],
                         lineage("s", stage="rollout", inputs={"queries": first}))
    middle = catalog.commit_rows("queries", [query_row("q2")], lineage("q2"))
    catalog.commit_rows("queries", [query_row("q3")], lineage("q3"))
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert gone.snapshots == {"queries": [middle]}
    assert Catalog(tmp_path / "warehouse").load("queries", first)["query_id"].to_list() == ["q1"]


def test_every_version_a_resumed_stages_shards_read_is_kept(tmp_path: Path) -> None:
    """queries moved between a crash and the resume: half the shards read `first`, half `second`; the lineage's
    `inputs` names one, and `first` went with the run's end though rows came from it."""
    catalog = Catalog(tmp_path / "warehouse")
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("q1"))
    second = catalog.commit_rows("queries", [query_row("q2")], lineage("q2"))
    catalog.commit_files("steps", [shard(catalog, "s", [step_row("s1")])],
                         lineage("s", stage="rollout", inputs={"queries": second},
                                 inputs_read={"queries": [first, second]}))
    catalog.commit_rows("queries", [query_row("q3")], lineage("q3"))
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert gone.snapshots == {}
    assert Catalog(tmp_path / "warehouse").load("queries", first)["query_id"].to_list() == ["q1"]


def test_the_versions_a_kept_versions_stage_run_committed_beside_it_are_kept(tmp_path: Path) -> None:
    """A hand-tagged steps version of one stage run keeps the queries version that run committed beside it: a
    later stage finds it by its commit key (`Catalog.written_with`), as critics find a rollout's steps."""
    catalog = Catalog(tmp_path / "warehouse")
    beside = catalog.commit_rows("queries", [query_row("q1", run_id="run-a")],
                                 lineage("a:q", "rollout", run_id="run-a"))
    tagged = catalog.commit_files("steps", [shard(catalog, "a", [step_row("s1")])],
                                  lineage("a:s", "rollout", run_id="run-a"))
    catalog.tag("steps", tagged, "keep-me")
    catalog.commit_rows("queries", [query_row("q2", run_id="run-b")], lineage("b:q", "rollout", run_id="run-b"))
    catalog.commit_files("steps", [shard(catalog, "b", [step_row("s2")])], lineage("b:s", "rollout", run_id="run-b"))
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert "queries" not in gone.snapshots
    assert Catalog(tmp_path / "warehouse").load("queries", beside)["query_id"].to_list() == ["q1"]


def test_a_verdict_judged_again_stays_the_newest_after_the_older_judges_versions_expire(tmp_path: Path) -> None:
    """The night rejected e1 (its version tagged), a by-hand critics run accepted it, and a later night judged
    another episode. verdicts accumulates, so every judgement stays a current row; `Catalog.newest` orders them by
    their run's place in the table's history, and with the by-hand run's version expired the night's older
    rejection came back."""
    catalog = Catalog(tmp_path / "warehouse")
    night = catalog.commit_rows("verdicts", [verdict_row("nightly-1", "e1", False)], lineage("n1", run_id="nightly-1"))
    catalog.tag("verdicts", night, "nightly-2026-01-01")
    read = catalog.commit_rows("queries", [query_row("q1")], lineage("q1"), mode="overwrite")
    by_hand = catalog.commit_rows("verdicts", [verdict_row("critics-1", "e1", True)],
                                  lineage("c1", "critics", run_id="critics-1", inputs={"queries": read}))
    catalog.commit_rows("queries", [query_row("q2")], lineage("q2"), mode="overwrite")
    catalog.commit_rows("verdicts", [verdict_row("nightly-2", "e9", True)], lineage("n2", run_id="nightly-2"))
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert gone.snapshots == {"queries": [read]}  # kept for its order alone, the version keeps no input
    newest = Catalog(tmp_path / "warehouse").newest("verdicts", "episode_id").sort("episode_id")
    assert newest.select("episode_id", "run_id", "success").rows() == [("e1", "critics-1", True),
                                                                         ("e9", "nightly-2", True)]
    assert by_hand in {i.snapshot_id for i in Catalog(tmp_path / "warehouse").history("verdicts")}


def test_what_an_unfinished_run_committed_stays_so_its_rerun_commits_it_once(tmp_path: Path) -> None:
    """A run committed its queries (an overwrite table) and died before its next stage; another run moved queries
    on, then expire ran. The unfinished run's version stays: its rerun finds it by its commit key and commits
    nothing again (had it gone, queries@latest would have rolled back to it). Once the run is finished it may go."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    crashed = ledger.open_run("nightly", "crashed").run_id
    ours = catalog.commit_rows("queries", [query_row("q1")], lineage("ours", run_id=crashed), mode="overwrite")
    catalog.commit_rows("queries", [query_row("q2")], lineage("theirs", run_id="another"), mode="overwrite")
    later = datetime.now(timezone.utc) + timedelta(seconds=5)

    assert expire(catalog, blobs, ledger, timedelta(0), now=later).snapshots == {}
    fresh = Catalog(tmp_path / "warehouse")
    assert fresh.commit_rows("queries", [query_row("q1")], lineage("ours", run_id=crashed), mode="overwrite") == ours
    assert fresh.load("queries@latest")["query_id"].to_list() == ["q2"]

    ledger.finish_run(crashed, {})
    assert expire(fresh, blobs, ledger, timedelta(0), now=later).snapshots == {"queries": [ours]}


def test_the_version_an_unfinished_run_reads_stays_though_it_committed_nothing(tmp_path: Path) -> None:
    """`trajforge run rollout --input queries@V` recorded a shard and crashed before its commit; queries moved on.
    V is no version the run committed nor one a kept version names, and expire took it: the rerun could not read
    its input, and its recorded shards stayed pending for ever."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    read = catalog.commit_rows("queries", [query_row("q1")], lineage("a", run_id="a"), mode="overwrite")
    catalog.commit_rows("queries", [query_row("q2", run_id="b")], lineage("b", run_id="b"), mode="overwrite")
    crashed = ledger.open_run("rollout", f"rollout-of-queries@{read}").run_id
    ledger.plan_stage(crashed, "rollout", 2, inputs={"queries": read})
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    assert expire(catalog, blobs, ledger, timedelta(0), now=later).snapshots == {}
    assert Catalog(tmp_path / "warehouse").load("queries", read)["query_id"].to_list() == ["q1"]
    ledger.finish_run(crashed, {})
    assert expire(catalog, blobs, ledger, timedelta(0), now=later).snapshots == {"queries": [read]}


def test_the_shard_files_of_a_run_a_fresh_run_set_aside_go(tmp_path: Path) -> None:
    """`run nightly --fresh` left the crashed run unfinished, so its recorded shard files stayed for ever as those
    of a run still to be resumed; set aside, nothing resumes it and they go like any unreferenced file."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    crashed = ledger.open_run("nightly", "night").run_id
    pending = shard(catalog, "pending", [step_row("s9")])
    ledger.record_shard(crashed, "rollout", ShardRecord("sh1", {"steps": [str(pending)]}, {}, {}, {}, {}, {}))
    ledger.open_run("nightly", "night", fresh=True)
    gone = expire(catalog, blobs, ledger, timedelta(0), now=datetime.now(timezone.utc) + timedelta(seconds=5))
    assert gone.data_files == [pending] and not pending.exists()


def test_expire_names_a_shard_file_of_an_unfinished_run_it_cannot_read(tmp_path: Path) -> None:
    """A crashed run's recorded shard file is read for the screenshots its rerun will commit; cut short, it gave
    Arrow's bare "Parquet magic bytes not found", naming no file."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    crashed = ledger.open_run("nightly", "night").run_id
    pending = shard(catalog, "pending", [step_row("s9")])
    ledger.record_shard(crashed, "rollout", ShardRecord("sh1", {"steps": [str(pending)]}, {}, {}, {}, {}, {}))
    pending.write_bytes(pending.read_bytes()[:100])
    with pytest.raises(CorruptData, match=f"shard file {pending} of a run not finished cannot be read"):
        expire(catalog, blobs, ledger, timedelta(0), now=datetime.now(timezone.utc) + timedelta(seconds=5))
    assert pending.exists()


def test_a_half_written_data_file_goes_once_older_than_the_cutoff(tmp_path: Path) -> None:
    """A run killed inside `write_parquet_atomic` leaves `.NAME.parquet.HEX.tmp` beside the data files, which expire
    never removed. One older than the cutoff goes; a younger one, which a writer may still be writing, stays."""
    catalog = Catalog(tmp_path / "warehouse")
    catalog.commit_files("steps", [shard(catalog, "v0", [step_row("s0")])], lineage("v0", stage="rollout"))
    old, young = (catalog.data_dir("steps") / f".{name}.parquet.0123abcd.tmp" for name in ("old", "young"))
    for path in (old, young):
        path.write_bytes(b"PAR1 half a file")
    made = (datetime.now(timezone.utc) - timedelta(days=8)).timestamp()
    os.utime(old, (made, made))
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(days=7))
    assert gone.data_files == [old] and not old.exists() and young.exists()


def test_expire_keeps_what_is_younger_than_the_cutoff(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "warehouse")
    blobs = BlobStore(catalog.warehouse / "blobs")
    for i in range(2):
        catalog.commit_files("steps", [shard(catalog, f"v{i}", [step_row(f"s{i}")])], lineage(f"v{i}", stage="rollout"),
                             mode="overwrite")
    blobs.put(png(99))
    gone = expire(catalog, blobs, Ledger(catalog.uri), timedelta(days=7))
    assert (gone.snapshots, gone.data_files, gone.blobs) == ({}, [], [])


def test_expire_handles_a_table_the_code_no_longer_knows(tmp_path: Path) -> None:
    """A table a removed stage wrote stays in the catalog: expire treats it like any other table."""
    catalog = Catalog(tmp_path / "warehouse")
    tbl = catalog.iceberg.create_table((catalog.namespace, "retired_stage"), schema=to_arrow("queries", []).schema)
    for i in range(2):
        tbl.overwrite(to_arrow("queries", [query_row(f"q{i}")]))
    first = tbl.refresh().metadata.snapshots[0].snapshot_id
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert gone.snapshots["retired_stage"][0] == first and gone.kept_snapshots["retired_stage"] == 1
    assert catalog.load("retired_stage")["query_id"].to_list() == ["q1"]


def test_a_dry_run_commits_nothing_even_to_a_table_of_an_older_schema(tmp_path: Path) -> None:
    """A table written before its model gained a column would be evolved on a write; a dry run must not."""
    catalog = Catalog(tmp_path / "warehouse")
    old = to_arrow("queries", [query_row("q1")]).drop_columns(["actions_json"])
    catalog.iceberg.create_table((catalog.namespace, "queries"), schema=old.schema).append(old)
    before = catalog.iceberg.load_table((catalog.namespace, "queries")).metadata_location
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later,
           dry_run=True)
    assert catalog.iceberg.load_table((catalog.namespace, "queries")).metadata_location == before


def test_the_cli_dry_run_lists_and_removes_nothing(replay_night, trajforge_cli) -> None:
    cwd, _ = replay_night
    cache = ResponseCache(workspace(cwd).catalog.uri)  # the replay night asked no model: one answer from 1999
    cache.put("f" * 64, "model-x", "judge", "1", Completion("an old answer", "stop", 1, 1))
    with cache.engine.begin() as conn:
        conn.execute(responses.update().where(responses.c.key == "f" * 64)
                     .values(created_at=datetime(1999, 1, 1, tzinfo=timezone.utc)))
    before = sorted(p for p in (cwd / "data" / "warehouse").rglob("*") if p.is_file())
    try:
        proc = subprocess.run([trajforge_cli, "datasets", "expire", "--older-than", "0", "--dry-run",
                               "--checkpoints", "--responses"],
                              cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "would expire" in proc.stdout and "would remove" in proc.stdout and "0 checkpoints" in proc.stdout
        assert "would forget 1 cached model answers" in proc.stdout and cache.get("f" * 64) is not None
        after = sorted(p for p in (cwd / "data" / "warehouse").rglob("*") if p.is_file())
        assert [p for p in before if p.suffix != ".lock"] == [p for p in after if p.suffix != ".lock"]
    finally:
        assert cache.forget(datetime(2000, 1, 1, tzinfo=timezone.utc)) == 1  # the night as it was
        cache.close()


def checkpoint(catalog: Catalog, name: str, root: str, age: timedelta) -> Path:
    """A checkpoint folder with one file and its row, as the train stage registers it, made `age` ago."""
    folder = catalog.warehouse / "checkpoints" / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    made = datetime.now(timezone.utc) - age
    os.utime(folder / "model.safetensors", (made.timestamp(), made.timestamp()))
    os.utime(folder, (made.timestamp(), made.timestamp()))
    catalog.commit_rows("checkpoints", [Checkpoint(
        run_id=name, model_id=str(folder), checkpoint_hash="0" * 64, folder=str(folder), served_by="local",
        base_model_id=root, root_model_id=root, trained_on=["train_e2e@1"], samples=3, steps=1, trainer="train",
        seconds=1.0, created_at=made)], lineage(name, stage="train", run_id=name))
    return folder


def aged_folder(path: Path, age: timedelta) -> Path:
    path.mkdir(parents=True)
    (path / "text.jsonl").write_text("{}\n")
    for p in (path / "text.jsonl", path):
        made = (datetime.now(timezone.utc) - age).timestamp()
        os.utime(p, (made, made))
    return path


def test_the_loops_old_files_go_and_checkpoints_only_when_asked(tmp_path: Path) -> None:
    """Training data folders and a failed trainer's leftovers older than the cutoff go; checkpoint folders go
    only with collect_checkpoints, never a chain's newest (the next night's policy) nor one the config names,
    and their rows stay."""
    catalog = Catalog(tmp_path / "warehouse")
    blobs, ledger = BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri)
    old, young = timedelta(days=10), timedelta(0)
    a1, a2 = checkpoint(catalog, "a1", "smollm2", old), checkpoint(catalog, "a2", "smollm2", old + timedelta(hours=-1))
    b1, b2 = checkpoint(catalog, "b1", "qwen", old), checkpoint(catalog, "b2", "qwen", young)
    c1, c2 = checkpoint(catalog, "c1", "other", old + timedelta(days=1)), checkpoint(catalog, "c2", "other", old)
    train = catalog.warehouse / "train"
    old_data, new_data = aged_folder(train / "a1", old), aged_folder(train / "b2", young)
    leftover = aged_folder(catalog.warehouse / "checkpoints" / ".a3.tmp", old)
    week = timedelta(days=7)

    kept_by_default = expire(catalog, blobs, ledger, week, dry_run=True)
    assert (kept_by_default.train_data, kept_by_default.checkpoints) == ([leftover, old_data], [])
    dry = expire(catalog, blobs, ledger, week, dry_run=True, collect_checkpoints=True, named_models={str(c1)})
    # a1: older than a2, its chain's newest; b1: b2 is younger than the cutoff; c1: named by the config
    assert dry.checkpoints == [a1, b1]
    assert all(p.is_dir() for p in (a1, b1, old_data, leftover))  # a dry run lists only

    gone = expire(catalog, blobs, ledger, week, collect_checkpoints=True, named_models={str(c1)})
    assert (gone.train_data, gone.checkpoints) == (dry.train_data, dry.checkpoints) and gone.bytes >= 2000
    assert not any(p.exists() for p in (a1, b1, old_data, leftover))
    assert all(p.is_dir() for p in (a2, b2, c1, c2, new_data))
    assert catalog.load("checkpoints").height == 6  # what was trained is still told


def test_the_versions_a_registered_checkpoint_was_trained_on_stay(tmp_path: Path) -> None:
    """`trajforge run train` by hand is not a night: nothing tags its checkpoints version nor the by-hand versions
    it trained on, so once a later checkpoint landed they expired, and `trajforge checkpoints --model` named data
    that was gone. (Queries stand in for an SFT table: any table a checkpoint names is kept the same way.)"""
    catalog = Catalog(tmp_path / "warehouse")

    def register(name: str, trained_on: int) -> None:
        catalog.commit_rows("checkpoints", [Checkpoint(
            run_id=name, model_id=name, checkpoint_hash="0" * 64, folder=str(tmp_path / name), served_by="local",
            base_model_id="m", root_model_id="m", trained_on=[f"queries@{trained_on}"], samples=1, steps=1,
            trainer="train", seconds=1.0, created_at=datetime.now(timezone.utc))],
            lineage(name, stage="train", run_id=name, inputs={"queries": trained_on}))

    first = catalog.commit_rows("queries", [query_row("q1")], lineage("q1"))
    register("ck1", first)
    middle = catalog.commit_rows("queries", [query_row("q2")], lineage("q2"))
    second = catalog.commit_rows("queries", [query_row("q3")], lineage("q3"))
    register("ck2", second)
    later = datetime.now(timezone.utc) + timedelta(seconds=5)
    gone = expire(catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri), timedelta(0), now=later)
    assert gone.snapshots.get("queries") == [middle]
    assert Catalog(tmp_path / "warehouse").load("queries", first)["query_id"].to_list() == ["q1"]

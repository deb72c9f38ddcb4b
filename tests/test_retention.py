"""Retention: old versions expire (tagged and current ones kept), and the data files and screenshot blobs that
no remaining version references are removed; what an unfinished run will still commit is kept."""

from __future__ import annotations

import io
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_catalog import lineage, query_row, step_row

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Catalog, UnknownRef
from trajforge.data.ledger import Ledger, ShardRecord
from trajforge.data.retention import expire
from trajforge.schemas.tables import to_arrow


def png(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (shade, shade, shade)).save(buf, "PNG")
    return buf.getvalue()


def shard(catalog: Catalog, name: str, rows: list[dict]) -> Path:
    path = catalog.data_dir("steps") / f"{name}.parquet"
    pq.write_table(to_arrow("steps", rows), path)
    return path


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

    dry = expire(catalog, blobs, ledger, timedelta(0), dry_run=True, now=later)
    assert dry.snapshots == {"steps": [versions[1]]}
    assert [p.name for p in dry.data_files] == ["v1.parquet"]
    assert sorted(p.parent.name + p.name for p in dry.blobs) == sorted([shots[1], shots[4]])  # v2's and the unused
    assert all(p.exists() for p in (*dry.data_files, *dry.blobs))  # a dry run lists only
    assert catalog.load("steps", versions[1]).height == 1

    gone = expire(catalog, blobs, ledger, timedelta(0), now=later)
    assert gone.snapshots == dry.snapshots and gone.data_files == dry.data_files and gone.blobs == dry.blobs
    assert not any(p.exists() for p in (*gone.data_files, *gone.blobs)) and gone.bytes > 0
    fresh = Catalog(tmp_path / "warehouse")
    assert fresh.load("steps@nightly-2026-11-01")["step_id"].to_list() == ["s0"]
    assert fresh.load("steps@latest")["step_id"].to_list() == ["s2"]
    with pytest.raises(UnknownRef):
        fresh.load("steps", versions[1])
    assert pending.exists() and shots[3] in blobs and shots[0] in blobs and shots[2] in blobs

    again = expire(fresh, blobs, ledger, timedelta(0), now=later)  # nothing left to do
    assert (again.snapshots, again.data_files, again.blobs) == ({}, [], [])


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


def test_expire_keeps_what_is_younger_than_the_cutoff(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "warehouse")
    blobs = BlobStore(catalog.warehouse / "blobs")
    for i in range(2):
        catalog.commit_files("steps", [shard(catalog, f"v{i}", [step_row(f"s{i}")])], lineage(f"v{i}", stage="rollout"),
                             mode="overwrite")
    blobs.put(png(99))
    gone = expire(catalog, blobs, Ledger(catalog.uri), timedelta(days=7))
    assert (gone.snapshots, gone.data_files, gone.blobs) == ({}, [], [])


def test_the_cli_dry_run_lists_and_removes_nothing(replay_night, trajforge_cli) -> None:
    cwd, _ = replay_night
    before = sorted(p for p in (cwd / "data" / "warehouse").rglob("*") if p.is_file())
    proc = subprocess.run([trajforge_cli, "datasets", "expire", "--older-than", "0", "--dry-run"], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "would expire" in proc.stdout and "would remove" in proc.stdout
    after = sorted(p for p in (cwd / "data" / "warehouse").rglob("*") if p.is_file())
    assert [p for p in before if p.suffix != ".lock"] == [p for p in after if p.suffix != ".lock"]

"""The disk full while the night writes: the warehouse on a tmpfs too small for a night. The run stops with a
one-line error naming the device's complaint; once there is room, the rerun resumes and the night equals the
unbroken one (the session's shared replay night, same config): no row lost, none twice."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require
from fault_bench import CONFIG, cli_env, compare  # the benchmark owns the comparison

from trajforge.schemas.config import WarehouseSettings

# The suite's 600 s counts fixture setup too: the shared replay night, then two nights of its own.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(1200)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs (a night writes about 6 MB), as root can mount one; skipped where that is not allowed
    (a failure where CI requires services)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    require(made.returncode == 0, f"cannot mount a small tmpfs here (CI runs as root, and must): "
                                  f"{made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run_nightly(exe: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "run", "nightly"], cwd=cwd, env=cli_env(cwd), capture_output=True, text=True,
                          timeout=1200,
                          check=False)


def test_a_night_that_fills_the_disk_stops_and_resumes_when_there_is_room(small_disk, replay_night, tmp_path,
                                                                         trajforge_cli) -> None:
    reference, _ = replay_night
    night = tmp_path / "night"
    night.mkdir()
    (night / "trajforge.yaml").write_text(CONFIG + f"warehouse:\n  path: {small_disk / 'warehouse'}\n")
    full = run_nightly(trajforge_cli, night)
    assert full.returncode == 1, full.stdout + full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("No space left on device" in errors[0] or "disk is full" in errors[0]), full.stderr
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    rerun = run_nightly(trajforge_cli, night)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming run" in rerun.stdout
    got = compare(reference, night, WarehouseSettings(path=small_disk / "warehouse"))
    differing = {t: rows for t, rows in got.tables.items() if rows[0] != rows[1]}
    assert (got.lost, got.duplicated, got.false_failures) == (0, 0, 0), differing

"""Every notebook runs top to bottom on a real night, in the night's folder as a person would open it.

The kernel is this interpreter (a kernelspec written for the test), so the notebooks see the package under
test and not whatever `python3` a machine's Jupyter would pick.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from test_catalog import lineage, query_row

from trajforge.data.catalog import Catalog
from trajforge.data.notebook import open_catalog

NOTEBOOKS_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def run_notebook(path: Path, cwd: Path, jupyter_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Execute a notebook in `cwd` on a kernel of this interpreter; a cell that raises fails the run."""
    spec = jupyter_path / "kernels" / "trajforge-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "trajforge tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.delenv("TRAJFORGE_CONFIG", raising=False)  # the night's trajforge.yaml, found in its folder
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="trajforge-test", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs(nb: Any, tag: str) -> list[Any]:
    """The outputs of the cell with this tag."""
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell.outputs


@pytest.mark.browser
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_a_night(path, replay_night, tmp_path, monkeypatch):
    cwd, tag = replay_night
    with open_catalog(cwd / "trajforge.yaml") as catalog:
        # A person's tag beside the night's, sorted after it: the notebook took "nightly-..., reviewed" for a tag.
        catalog.tag("verdicts", tag, "reviewed")
    nb = run_notebook(path, cwd, tmp_path / "jupyter", monkeypatch)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    if path.name == "nights.ipynb":
        text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert f"train_e2e@{tag}" in text
        assert "only one night has written train_e2e" in text, "the replay night is the catalog's only night"
        assert "episodes accepted; showing" in text, "the replay policy's episodes are accepted"
        trajectory = outputs(nb, "trajectory")
        images = [o for o in trajectory if "image/png" in o.get("data", {})]
        steps = [o for o in trajectory if "**step " in o.get("data", {}).get("text/markdown", "")]
        assert steps and len(images) == len(steps), "every step is shown with its screenshot"
        assert any("image/png" in o.get("data", {}) for o in outputs(nb, "success-plot"))


REJECTED = "the checker found no note titled groceries"


@pytest.mark.parametrize("night", ["no-night-yet", "before-the-first-nightly", "a-night-that-judged-nothing",
                                   "a-night-that-accepted-nothing"])
def test_nights_notebook_says_what_there_is_to_show(night, tmp_path, monkeypatch, no_config_env):
    """Before any night no version of train_e2e exists; before the first nightly (stages run by hand) no version is
    tagged nightly-...; a second night on the same queries rolls none again, so its verdicts version is empty; a
    night on the defaults accepts no episode, so the trajectory shown is a rejected one. Each time the notebook
    says so and runs on. A person's tag `nightly-best` is no night's: it sorts after every date."""
    from trajforge.schemas.records import Verdict

    (tmp_path / "trajforge.yaml").write_text("warehouse:\n  path: store\n")
    tagged = night in ("a-night-that-judged-nothing", "a-night-that-accepted-nothing")
    verdicts = [Verdict(run_id="night", verdict_id="night:ep-1", episode_id="ep-1", query_id="q1", success=False,
                        consensus="checker_first", channels_json="{}", reason=REJECTED, config_hash="x")]
    with Catalog(tmp_path / "store") as catalog:
        catalog.commit_rows("queries", [query_row("q1")], lineage("q"))
        if night != "no-night-yet":
            for table, rows in (("train_e2e", []), ("steps", []),
                                ("verdicts", verdicts if night == "a-night-that-accepted-nothing" else [])):
                snapshot = catalog.commit_rows(table, rows, lineage(f"night:{table}", "export", run_id="night"))
                if tagged:
                    catalog.tag(table, snapshot, "nightly-2026-11-22")
                    catalog.tag(table, snapshot, "nightly-best")
    nb = run_notebook(NOTEBOOKS_DIR / "nights.ipynb", tmp_path, tmp_path / "jupyter", monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if night == "no-night-yet":
        assert "no night has written train_e2e yet" in text and "(none)" not in text
    if tagged:
        assert "train_e2e@nightly-2026-11-22: 0 rows" in text
    else:
        assert "no version is tagged nightly-YYYY-MM-DD" in text and "no trajectory to show" in text
    if night == "a-night-that-judged-nothing":
        assert "verdicts@nightly-2026-11-22: the night judged no episode" in text
    if night == "a-night-that-accepted-nothing":
        assert f"verdicts@nightly-2026-11-22: no episode was accepted; showing a rejected one: {REJECTED}" in text


def test_nights_notebook_is_stored_without_outputs():
    nb = nbformat.read(Path(__file__).parent.parent / "notebooks" / "nights.ipynb", as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.fixture
def no_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRAJFORGE_CONFIG nor a warehouse setting from the caller's environment."""
    for name in ("TRAJFORGE_CONFIG", "TRAJFORGE_WAREHOUSE__PATH", "TRAJFORGE_WAREHOUSE__CATALOG_URL"):
        monkeypatch.delenv(name, raising=False)


def test_a_notebook_in_a_subfolder_opens_the_projects_catalog(tmp_path, monkeypatch, no_config_env):
    """Jupyter starts a kernel in the notebook's folder (`notebooks/`); the project's trajforge.yaml is above it,
    and its warehouse path is relative to that file's folder, not to the kernel's."""
    (tmp_path / "trajforge.yaml").write_text("warehouse:\n  path: store\n")
    with Catalog(tmp_path / "store") as catalog:
        catalog.commit_rows("queries", [query_row("q1")], lineage("q"))
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    with open_catalog() as catalog:
        assert catalog.warehouse == tmp_path / "store"
        assert catalog.load("queries")["query_id"].to_list() == ["q1"]
    assert list((tmp_path / "notebooks").iterdir()) == []


def test_a_notebook_in_a_subfolder_finds_a_night_run_on_the_defaults(tmp_path, monkeypatch, no_config_env):
    """The README's first command runs a night with no trajforge.yaml: its warehouse is data/warehouse in the
    checkout, which the notebook's kernel (in notebooks/) finds above it."""
    with Catalog(tmp_path / "data" / "warehouse") as catalog:
        catalog.commit_rows("queries", [query_row("q1")], lineage("q"))
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    with open_catalog() as catalog:
        assert catalog.warehouse == tmp_path / "data" / "warehouse"
        assert catalog.load("queries")["query_id"].to_list() == ["q1"]


def test_a_folder_with_no_warehouse_is_an_error_naming_where_it_looked(tmp_path, monkeypatch, no_config_env):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="TRAJFORGE_CONFIG") as exc:
        open_catalog()
    assert str(tmp_path / "data" / "warehouse") in str(exc.value)
    assert list(tmp_path.iterdir()) == [], "a read creates no warehouse"


def test_a_trajectory_shows_each_critics_latest_label(tmp_path):
    """A step judged again by the same critic shows that critic's last label, not both."""
    from test_catalog import step_row

    from trajforge.data.notebook import trajectory
    from trajforge.schemas.records import StepCritique

    with Catalog(tmp_path / "wh") as catalog:
        catalog.commit_rows("steps", [step_row("s1")], lineage("steps", "rollout"))
        for run, label in (("critics-1", "GOOD"), ("critics-2", "HARMFUL")):
            catalog.commit_rows("step_critiques", [StepCritique(
                run_id=run, critique_id=f"{run}:s1", step_id="s1", episode_id=step_row("s1")["episode_id"],
                critic="critic_step@1", model_id="m", prompt_version="1", analysis="", summary="", label=label,
                raw_output="")], lineage(f"{run}:critiques", "critics", run_id=run))
        steps = trajectory(catalog, step_row("s1")["episode_id"])
    assert steps["labels"].to_list() == ["critic_step@1: HARMFUL"]

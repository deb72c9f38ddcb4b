"""The morning report's plots: drawn from hand-made frames (no night needed), and linked from a real night's report."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
from PIL import Image

from trajforge.synth.report import plot_rejections, write_plots

PNG = b"\x89PNG\r\n\x1a\n"


def frames() -> dict[str, pl.DataFrame]:
    return {
        "yields": pl.DataFrame({"night": ["nightly-2026-11-21", "nightly-2026-11-21", "nightly-2026-11-22"],
                                "table": ["train_e2e", "train_grounding", "train_e2e"], "rows": [19, 469, 0]}),
        "success": pl.DataFrame({"night": ["nightly-2026-11-21", "nightly-2026-11-21", "nightly-2026-11-22"],
                                 "app": ["shop", "mail", "shop"], "attempts": [3, 2, 4], "successes": [1, 2, 4],
                                 "rate": [1 / 3, 1.0, 1.0]}),
        "labels": pl.DataFrame({"critic": ["rules@1", "rules@1", "prefilter@2"],
                                "label": ["GOOD", "HARMFUL", "NEUTRAL"], "rows": [16, 2, 3]}),
        "rejections": pl.DataFrame({"stage": ["export", "grounding"],
                                    "reason": ["filter 1: critic score -1 below tau_c 0 (HARMFUL)",
                                               "element: off screen"],
                                    "rows": [2, 17]}),
        "cost": pl.DataFrame({"stage": ["rollout", "critics", "export"], "calls": [12, 40, 0],
                              "tokens": [9000, 30000, 0], "seconds": [6.9, 20.5, 1.2]}),
    }


def linked_pngs(markdown: str, folder: Path) -> list[Path]:
    return [folder / name for name in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", markdown)]


def test_each_plot_is_a_png_beside_the_markdown_that_links_it(tmp_path):
    lines = write_plots(tmp_path, "run-1", samples=19, **frames())
    markdown = "\n".join(lines)
    pngs = linked_pngs(markdown, tmp_path)
    assert [p.name for p in pngs] == [f"run-1-{n}.png" for n in ("yield", "success", "labels", "rejections", "cost")]
    for png in pngs:
        assert png.read_bytes().startswith(PNG)
        with Image.open(png) as image:
            image.verify()
    assert "Per accepted training sample: 2.74 calls, 2053 tokens, 1.51 s (19 rows)" in markdown


def test_an_empty_frame_gets_a_sentence_instead_of_a_plot(tmp_path):
    no_labels = frames() | {"labels": frames()["labels"].clear()}
    markdown = "\n".join(write_plots(tmp_path, "run-2", samples=0, **no_labels))
    assert "No step critique this run." in markdown and not (tmp_path / "run-2-labels.png").exists()
    markdown = "\n".join(write_plots(tmp_path, "run-3", samples=0, **frames()))
    assert "- (no training rows)" in markdown, "no training rows: no cost per sample to divide"


def test_each_rejection_reason_keeps_a_bar_of_its_own():
    """Reasons cut to one label were one row of the plot, one bar drawn over the other: a label is cut in its
    middle, and two reasons that still read the same are one bar of their summed rows."""
    start, end = "element: not unique on the screen (another element shown is asked for by the same role", "x" * 40
    frame = pl.DataFrame({"stage": ["grounding"] * 4 + ["export"],
                          "reason": [f"{start} and name)", f"{start} and text)", f"{end}a{end}", f"{end}b{end}",
                                     "trajectory not accepted by the critics"],
                          "rows": [3, 5, 1, 2, 7]})
    fig = plot_rejections(frame)
    fig.canvas.draw()
    (ax,) = fig.axes
    bars = dict(zip([t.get_text() for t in ax.get_yticklabels()], [p.get_width() for p in ax.patches], strict=True))
    assert sorted(bars.values()) == [3, 3, 5, 7], "the two that differ in the middle only: one bar of 1 + 2"
    assert bars["export: trajectory not accepted by the critics"] == 7
    assert [len(label) for label in bars if label.startswith("grounding: element")] == [70, 70]


@pytest.mark.browser
def test_the_replay_nights_report_links_plots_that_exist(replay_night):
    cwd, _ = replay_night
    (report,) = (cwd / "data" / "warehouse" / "reports").glob("*.md")
    pngs = linked_pngs(report.read_text(), report.parent)
    assert len(pngs) >= 4, "yield, success, labels and cost at least (the replay night drops rows too)"
    assert all(p.read_bytes().startswith(PNG) for p in pngs)


@pytest.mark.browser
def test_every_table_the_replay_night_wrote_no_row_to_says_why(replay_night):
    """Template writers ask no model, so reasoning, plans, PAL-UI and CES write nothing on the replay night; the
    report says so beside each zero (a zero without its reason reads as a bug)."""
    cwd, _ = replay_night
    (report,) = (cwd / "data" / "warehouse" / "reports").glob("*.md")
    written = report.read_text().split("## Training data written this run")[1].split("\n#")[0]
    zeros = [line for line in written.splitlines() if line.startswith("| ") and line.split(" | ")[-1].startswith("0")]
    assert any("reasoning_samples" in z for z in zeros), "the replay night asks no model for reasonings"
    assert [z for z in zeros if "(" not in z] == []
    (plans,) = [z for z in zeros if "| plans |" in z]
    assert plans.endswith("(synth.writer is template: no plan asked: 1) |"), "the cause alone, no count of work"

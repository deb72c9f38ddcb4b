"""Region proposals: contours of the image itself, or segment-anything's masks."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import require, wait_for
from PIL import Image, ImageDraw

from trajforge.synth.regions import contour_regions, iou

ROOT = Path(__file__).resolve().parents[1]


def screen() -> tuple[bytes, list[tuple[int, int, int, int]]]:
    """A flat GUI-like image: three filled widgets on white, and their boxes."""
    widgets = [(20, 20, 200, 60), (20, 120, 120, 40), (260, 200, 100, 100)]
    image = Image.new("RGB", (400, 320), "white")
    draw = ImageDraw.Draw(image)
    for x, y, w, h in widgets:
        draw.rectangle((x, y, x + w, y + h), fill=(40, 90, 200), outline=(0, 0, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), widgets


def test_iou():
    assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert iou([0, 0, 10, 10], [20, 20, 5, 5]) == 0.0
    assert iou([0, 0, 10, 10], [5, 0, 10, 10]) == pytest.approx(50 / 150)
    assert iou([0, 0, 0, 10], [0, 0, 0, 10]) == 0.0


def test_contours_find_each_widget():
    png, widgets = screen()
    regions = contour_regions(png)
    for widget in widgets:
        assert max(iou(widget, r.box) for r in regions) > 0.8, (widget, regions)
    assert all(r.source == "contours" for r in regions)


SAM_SCRIPT = textwrap.dedent("""
    import importlib.util, io, sys
    import segment_anything, torch
    from PIL import Image, ImageDraw
    spec = importlib.util.spec_from_file_location("regions", {path!r})  # the module needs nothing of trajforge
    regions_module = sys.modules["regions"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(regions_module)
    load_sam, sam_regions = regions_module.load_sam, regions_module.sam_regions
    masks = []

    class Unfiltered(segment_anything.SamAutomaticMaskGenerator):
        # A random model's masks all fail the default quality thresholds (0 masks, measured), which would leave
        # nothing to convert: without them the generator returns masks, recorded to check against the regions.
        def __init__(self, model, **kwargs):
            super().__init__(model, pred_iou_thresh=float("-inf"), stability_score_thresh=float("-inf"), **kwargs)

        def generate(self, image):
            masks.extend(super().generate(image))
            return masks

    segment_anything.SamAutomaticMaskGenerator = Unfiltered  # sam_regions imports it when called
    image = Image.new("RGB", (128, 96), "white")
    ImageDraw.Draw(image).rectangle((10, 10, 70, 50), fill=(40, 90, 200))
    out = io.BytesIO(); image.save(out, format="PNG")
    torch.manual_seed(0)
    sam = load_sam(None, "vit_b")  # randomly initialised: the code path runs, the masks mean nothing
    regions = sam_regions(out.getvalue(), sam, points_per_side=4)  # 16 points: the code path, quickly
    assert masks, "the mask generator gave no masks"
    scored = {{tuple(float(v) for v in m["bbox"]): round(float(m["predicted_iou"]), 3) for m in masks}}
    assert all(r.source == "sam" and scored.get(r.box) == r.score for r in regions), (regions, scored)
    print("sam masks", len(masks), "regions", len(regions))
""")


SAM_BUILD_FAILED = "SAM build failed"
""".ci/run's build writes this as its log's last line when it fails."""


def wait_for_environment(python: Path, log: Path, timeout: float = 900) -> None:
    """.ci/run builds SAM_TEST_PYTHON's environment while the suite runs and moves it into place whole: wait for
    its interpreter, or fail with the build's log, at once where the log says the build failed."""

    def failed() -> bool:
        lines = log.read_text().splitlines() if log.is_file() else []
        return bool(lines) and lines[-1].startswith(SAM_BUILD_FAILED)

    try:
        wait_for(lambda: python.exists() or failed(), timeout, f"SAM_TEST_PYTHON {python}")
    except AssertionError as exc:
        why = str(exc)
    else:
        if python.exists():
            return
        why = f"SAM_TEST_PYTHON {python}: its build failed"
    pytest.fail(f"{why}; its build's log:\n{log.read_text()[-3000:] if log.is_file() else ''}")


@pytest.mark.timeout(1200)  # waits up to 900 s for .ci/run's SAM build, to fail with its log rather than a dump
def test_segment_anything_path_runs_on_a_random_vit_b():
    """segment-anything needs torchvision, which imports only beside torch 2.14.1 (shared/FACTS.md), not beside
    the project's torch 2.13.0; CI builds that pair in its own environment and names its python here."""
    python = os.environ.get("SAM_TEST_PYTHON")
    if python is not None:
        wait_for_environment(Path(python), Path(os.environ.get("SAM_TEST_LOG", os.devnull)))
    else:
        try:
            import segment_anything  # noqa: F401
            import torchvision  # noqa: F401
        except ImportError as exc:
            require(False, f"segment-anything is not importable here ({exc}); set SAM_TEST_PYTHON to an "
                    "interpreter that has it (.ci/run builds one)")
        python = sys.executable
    proc = subprocess.run([python, "-c", SAM_SCRIPT.format(path=str(ROOT / "synth" / "regions.py"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sam masks" in proc.stdout

"""Dense regions of a screenshot: the boxes the grounding stage grounds inside and checks annotations against.

With a segment-anything checkpoint (`synth.sam_checkpoint`) the regions are its automatic mask
generator's masks; without one they come from the image itself: edges, closed into blobs, and
the blobs' bounding boxes (OpenCV). The contour proposer finds the panels, buttons, fields and
text blocks a flat GUI is drawn from in tens of milliseconds, which is what an independent
detection for IoU cleaning needs; SAM's masks are better on photos and icons.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

SAM_INSTALL = ("pip install torch==2.14.1 torchvision==0.29.1 segment-anything (PyPI's torchvision imports only beside "
               "that torch, so this replaces the torch 2.13.0 the models extra pins: give SAM a virtual "
               "environment of its own, as .ci/run's .venv-sam)")


class RegionBackendMissing(ImportError):
    """segment-anything (or the torchvision it needs) is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Region:
    box: tuple[float, float, float, float]
    """x, y, width, height in pixels."""
    score: float
    source: Literal["contours", "sam"]


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two [x, y, w, h] boxes (0 when either has no area)."""
    ax1, ay1, bx1, by1 = a[0] + a[2], a[1] + a[3], b[0] + b[2], b[1] + b[3]
    w = min(ax1, bx1) - max(a[0], b[0])
    h = min(ay1, by1) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


def _rgb(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))


def _keep(boxes: list[tuple[tuple[float, float, float, float], float]], width: int, height: int,
          max_regions: int, source: Literal["contours", "sam"]) -> list[Region]:
    """Largest first, without specks (under 8 px a side), the whole screen, or near-copies of a kept box."""
    kept: list[Region] = []
    for box, score in sorted(boxes, key=lambda b: -b[0][2] * b[0][3]):
        x, y, w, h = box
        if w < 8 or h < 8 or w * h > 0.9 * width * height:
            continue
        if any(iou(box, r.box) > 0.9 for r in kept):
            continue
        kept.append(Region(box, score, source))
        if len(kept) == max_regions:
            break
    return kept


def contour_regions(png: bytes, max_regions: int = 400) -> list[Region]:
    """Regions from the image alone: Canny edges, dilated by a pixel so a widget's outline closes (a wider
    dilation merges a radio button with its label: on the bundled apps' 115 reference screens, 5x5 twice kept
    929 elements through IoU cleaning, 3x3 once 1,233), then every contour's box."""
    import cv2

    rgb = _rgb(png)
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    edges = cv2.Canny(gray, 30, 90)
    blobs = cv2.dilate(edges, np.ones((3, 3), np.uint8), iterations=1)
    contours, _ = cv2.findContours(blobs, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes = []
    for contour in contours:
        x, y, w, h = cv2.boundingRect(contour)
        fill = cv2.contourArea(contour) / float(w * h) if w * h else 0.0
        boxes.append(((float(x), float(y), float(w), float(h)), round(min(fill, 1.0), 3)))
    return _keep(boxes, rgb.shape[1], rgb.shape[0], max_regions, "contours")


def load_sam(checkpoint: Path | None, model_type: str = "vit_b") -> Any:
    """A SAM model on the CPU; `checkpoint=None` builds a randomly initialised one (tests: no download)."""
    try:
        from segment_anything import sam_model_registry
    except ImportError as exc:  # segment-anything imports torchvision, which needs a matching torch
        raise RegionBackendMissing(f"segment-anything cannot be imported ({exc}): {SAM_INSTALL}") from exc
    return sam_model_registry[model_type](checkpoint=str(checkpoint) if checkpoint else None).eval()


def sam_regions(png: bytes, sam: Any, max_regions: int = 400, points_per_side: int = 16) -> list[Region]:
    """Regions from segment-anything's automatic mask generator: each mask's box, scored by predicted IoU."""
    from segment_anything import SamAutomaticMaskGenerator

    rgb = _rgb(png)
    generator = SamAutomaticMaskGenerator(sam, points_per_side=points_per_side)
    boxes = [(tuple(float(v) for v in m["bbox"]), round(float(m["predicted_iou"]), 3)) for m in generator.generate(rgb)]
    return _keep(boxes, rgb.shape[1], rgb.shape[0], max_regions, "sam")  # type: ignore[arg-type]


def propose(png: bytes, *, sam_checkpoint: Path | None = None, model_type: str = "vit_b", max_regions: int = 400,
            sam_model: Any = None) -> list[Region]:
    """Region proposals: SAM's when a checkpoint (or a loaded model) is given, else contours of the image."""
    if sam_model is None and sam_checkpoint is not None:
        sam_model = _cached_sam(sam_checkpoint, model_type)
    if sam_model is not None:
        return sam_regions(png, sam_model, max_regions)
    return contour_regions(png, max_regions)


_sams: dict[tuple[Path, str], Any] = {}


def _cached_sam(checkpoint: Path, model_type: str) -> Any:
    """A checkpoint is loaded once per process (vit_b: 375 MB)."""
    if (checkpoint, model_type) not in _sams:
        _sams[checkpoint, model_type] = load_sam(checkpoint, model_type)
    return _sams[checkpoint, model_type]

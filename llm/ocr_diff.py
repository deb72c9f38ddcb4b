"""Which parts of a screen need OCR when a similar screen was read before.

A night's screens come in runs that differ in a few places: a checkbox ticked, a field typed
into, a badge that counts one more. Measured on a replay night of the shop app (40 distinct
screens), 34 differ from another screen in under 20% of their 16-pixel tiles, most in under
5%. So a screen is read as the earlier screen's text lines that lie away from any change, plus
a fresh OCR of the changed regions only. A changed region is grown to take in every earlier
line it touches (and grown again while it meets more), so no line is ever half copied and half
read; the lines in the region are read whole from the new screen.

Pure functions over arrays; the reader (`llm.ocr.OcrReader`) decides when to use them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from trajforge.llm.ocr import OcrLine

TILE = 16
"""Pixels per side of the tiles screens are compared in."""
PAD = 8
"""Pixels of unchanged screen kept around a changed region, so the detector sees a text line's edges."""

Rect = tuple[int, int, int, int]
"""x0, y0, x1, y1 in pixels, end exclusive."""


def changed_tiles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A boolean grid, one cell per TILE x TILE tile (edges rounded up): True where any pixel differs."""
    h, w = a.shape[:2]
    diff = np.any(a != b, axis=2) if a.ndim == 3 else a != b
    rows, cols = -(-h // TILE), -(-w // TILE)
    padded = np.zeros((rows * TILE, cols * TILE), dtype=bool)
    padded[:h, :w] = diff
    grid: np.ndarray = padded.reshape(rows, TILE, cols, TILE).any(axis=(1, 3))
    return grid


def _overlaps(r: Rect, s: Rect) -> bool:
    return r[0] < s[2] and s[0] < r[2] and r[1] < s[3] and s[1] < r[3]


def _union(r: Rect, s: Rect) -> Rect:
    return (min(r[0], s[0]), min(r[1], s[1]), max(r[2], s[2]), max(r[3], s[3]))


def _padded(box: tuple[float, float, float, float], width: int, height: int) -> Rect:
    x, y, w, h = box
    return (max(0, int(x) - PAD), max(0, int(y) - PAD), min(width, int(np.ceil(x + w)) + PAD),
            min(height, int(np.ceil(y + h)) + PAD))


def regions(changed: np.ndarray, lines: tuple[OcrLine, ...], width: int,
            height: int) -> tuple[tuple[OcrLine, ...], list[Rect]]:
    """The earlier lines to keep and the regions to read again.

    The changed tiles' connected groups (tiles touching at a corner included) become rectangles
    with PAD around them; a rectangle that meets an earlier line (padded alike) takes the line in
    and the line is read again; overlapping rectangles merge; until nothing changes.
    """
    import cv2  # here, not at the top: 0.4 s that every CLI command would pay, through the gateway's import of OCR

    count, _, stats, _ = cv2.connectedComponentsWithStats(changed.astype(np.uint8), connectivity=8)
    rects = []
    for x, y, w, h, _area in stats[1:count]:
        rects.append(_padded((x * TILE, y * TILE, w * TILE, h * TILE), width, height))
    boxes = [_padded(line.box, width, height) for line in lines]
    kept = [True] * len(lines)
    grown = True
    while grown:
        grown = False
        for i, box in enumerate(boxes):
            if not kept[i]:
                continue
            for j, rect in enumerate(rects):
                if _overlaps(box, rect):
                    kept[i], rects[j], grown = False, _union(rect, box), True
                    break
        merged: list[Rect] = []
        for rect in rects:
            for k, other in enumerate(merged):
                if _overlaps(rect, other):
                    merged[k], grown = _union(rect, other), True
                    break
            else:
                merged.append(rect)
        rects = merged
    return tuple(line for line, keep in zip(lines, kept, strict=True) if keep), rects


def shifted(lines: list[OcrLine], dx: int, dy: int) -> list[OcrLine]:
    """Lines read in a region, in the coordinates of the whole screen."""
    def move(box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        return (box[0] + dx, box[1] + dy, box[2], box[3])

    return [replace(line, box=move(line.box), words=tuple(replace(w, box=move(w.box)) for w in line.words),
                    chars=tuple(replace(c, box=move(c.box)) for c in line.chars)) for line in lines]


def reading_order(lines: list[OcrLine]) -> tuple[OcrLine, ...]:
    """Top to bottom in 10-pixel bands, left to right within a band: near enough the detector's own
    order for a whole screen."""
    return tuple(sorted(lines, key=lambda line: (round(line.box[1] / 10), line.box[0])))

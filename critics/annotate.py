"""The pre-action screenshot with the interaction drawn on it (paper 6.3).

The step critic is shown where the agent acted, not asked to work it out from numbers:
a ring at the point of a click or press, the path of a swipe or drag with a ring at its
start and a dot at its end, and the box of the element the action aimed at. Colours are
fixed so a test (or a person) can find them by reading pixels.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, ImageDraw

POINT_COLOR = (255, 0, 64)  # the ring and the path: the action itself
BOX_COLOR = (0, 200, 83)  # the target element's box
RING_RADIUS = 18
LINE_WIDTH = 4

_PATH_ACTIONS = ("swipe", "drag")


def annotate(png: bytes, action: dict[str, Any], target_box: list[float] | None) -> bytes | None:
    """The screenshot with `action` drawn on it as PNG, or None when the action has no place on the
    screen (typing, keys, waiting, ending) and there is no target box either."""
    if "x" not in action and target_box is None:
        return None
    with Image.open(io.BytesIO(png)) as source:
        image = source.convert("RGB")
    draw = ImageDraw.Draw(image)
    if target_box is not None:
        x, y, w, h = target_box
        draw.rectangle((x, y, x + w, y + h), outline=BOX_COLOR, width=LINE_WIDTH)
    if "x" in action and "y" in action:
        start = (float(action["x"]), float(action["y"]))
        if action.get("type") in _PATH_ACTIONS and "x2" in action and "y2" in action:
            end = (float(action["x2"]), float(action["y2"]))
            draw.line((start, end), fill=POINT_COLOR, width=LINE_WIDTH)
            r = RING_RADIUS // 2
            draw.ellipse((end[0] - r, end[1] - r, end[0] + r, end[1] + r), fill=POINT_COLOR)
        r = RING_RADIUS
        draw.ellipse((start[0] - r, start[1] - r, start[0] + r, start[1] + r), outline=POINT_COLOR, width=LINE_WIDTH)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()

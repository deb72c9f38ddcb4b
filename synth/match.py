"""One rule for "the model's action is the trusted one", shared by every stage that compares actions.

The companion papers and GUI-Owl 2.2.3 compare a predicted action with a trusted one
(a reference demonstration's, an accepted trajectory's) the same way: the same type; a
point inside the target element's box (or within a tolerance of the trusted point when
the step recorded no box); text with a token F1 above a threshold; the same scroll or
swipe direction; the same keys. A drag is a point too: it must pick up near the target and drop within the
tolerance of the trusted drop point (its direction alone would let a drag of anything anywhere pass). Actions are
flat dicts of `envs.actions` ({"type": "click", "x": .., "y": ..}).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from trajforge.envs import actions

TEXT_F1 = 0.5
"""Text arguments match when their token F1 is above this (paper: PAL-UI 4.1, Agentic-Q)."""
TOLERANCE_PX = 14.0
"""Without a target box, a point matches within this many pixels of the trusted point: a fingertip's width on a
390-pixel-wide phone screen. With a box the point must be inside it: a prediction held to element centres
(`synth.points`) lands inside the box or on another element's centre, which a margin would only admit."""


@dataclass(frozen=True)
class Match:
    """Whether two actions match, and the first thing that differs (or what matched)."""

    ok: bool
    reason: str


def text_f1(a: str, b: str) -> float:
    """Token F1 of two texts, case-folded (1.0 for two empty texts)."""
    left, right = Counter(a.casefold().split()), Counter(b.casefold().split())
    if not left and not right:
        return 1.0
    common = sum((left & right).values())
    if common == 0:
        return 0.0
    precision, recall = common / sum(left.values()), common / sum(right.values())
    return 2 * precision * recall / (precision + recall)


def _near(point: tuple[float, float], box: list[float] | None, trusted: tuple[float, float] | None,
          tolerance: float) -> tuple[bool, str]:
    x, y = point
    if box is not None:
        bx, by, bw, bh = box
        inside = bx <= x <= bx + bw and by <= y <= by + bh
        return inside, f"point ({x:.0f}, {y:.0f}) {'inside' if inside else 'outside'} the target box {box}"
    if trusted is None:
        return False, "the trusted action has no point"
    distance = ((x - trusted[0]) ** 2 + (y - trusted[1]) ** 2) ** 0.5
    return distance <= tolerance, f"point {distance:.0f} px from the trusted point"


def match(predicted: dict[str, Any], trusted: dict[str, Any], *, target_box: list[float] | None = None,
          tolerance: float = TOLERANCE_PX, min_f1: float = TEXT_F1) -> Match:
    """Does `predicted` do what `trusted` does? Types (aliases resolved) must agree, then each argument the
    type has: its point inside the target box, or within `tolerance` of the trusted point when the step recorded
    no box (and a drag's drop point within `tolerance` of the trusted one), its text (F1 >
    `min_f1`), a scroll's or swipe's direction, its keys, button or status."""
    kind, want = actions.normalize(predicted).get("type"), actions.normalize(trusted).get("type")
    if kind != want:
        return Match(False, f"type {kind!r} is not {want!r}")
    reasons = [f"type {kind}"]
    point = actions.point(predicted)
    direction = actions.direction(trusted) if want in ("scroll", "swipe") else None
    if direction is not None:
        got = actions.direction(predicted)
        if got != direction:
            return Match(False, f"direction {got} is not {direction}")
        reasons.append(f"direction {direction}")
    elif actions.point(trusted) is not None:
        if point is None:
            return Match(False, "no point")
        ok, why = _near(point, target_box, actions.point(trusted), tolerance)
        if not ok:
            return Match(False, why)
        reasons.append(why)
        if want == "drag":  # where it drops decides as much as where it picks up; no box was recorded there
            if "x2" not in predicted or "y2" not in predicted:
                return Match(False, "no drop point")
            ok, why = _near((float(predicted["x2"]), float(predicted["y2"])), None,
                            (float(trusted["x2"]), float(trusted["y2"])), tolerance)
            if not ok:
                return Match(False, f"drop {why}")
            reasons.append(f"drop {why}")
    if "text" in trusted:
        f1 = text_f1(str(predicted.get("text", "")), str(trusted["text"]))
        if f1 <= min_f1:
            return Match(False, f"text F1 {f1:.2f} <= {min_f1}")
        reasons.append(f"text F1 {f1:.2f}")
    if (keys := actions.pressed(trusted)) is not None and (pressed := actions.pressed(predicted)) != keys:
        return Match(False, f"keys {pressed!r} are not {keys!r}")
    for arg in ("button", "status"):
        if arg in trusted and predicted.get(arg) != trusted[arg]:
            return Match(False, f"{arg} {predicted.get(arg)!r} is not {trusted[arg]!r}")
    return Match(True, "; ".join(reasons))

"""Elements found on the live page by accessible role and name, as a reference replay finds
them: what query generation checks a replay will find again, and what the replay policy
acts on.

Text without a nameable element around it is role "text", named by its text, as the
accessibility tree shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from playwright.sync_api import Error as PlaywrightError

from trajforge.envs.browser import Box, BrowserEnv, EnvFault

MAX_SCROLLS = 6
"""Swipes spent bringing one element into view before the policy gives up."""


@dataclass(frozen=True)
class PassageBoxes:
    """Where a passage of text is on the screen: its first and last characters and the whole."""

    first: Box
    last: Box
    whole: Box

    def start(self) -> tuple[float, float]:
        """A point on the first character's left quarter: a press there puts the caret before it."""
        x, y, w, h = self.first
        return x + w / 4, y + h / 2

    def end(self) -> tuple[float, float]:
        """A point on the last character's right quarter: a release there puts the caret after it."""
        x, y, w, h = self.last
        return x + 3 * w / 4, y + h / 2


def is_checked(env: BrowserEnv, role: str, name: str) -> bool:
    """Whether the one visible `role` named `name` is checked, read from the live page."""
    try:
        return env.page.get_by_role(role, name=name, exact=True).is_checked()
    except PlaywrightError as exc:
        raise EnvFault(f"reading whether {role} {name!r} is checked failed: {exc}") from exc


def _locator(env: BrowserEnv, role: str, name: str) -> Any:
    """The page's elements with this role and name; role "text" is text without a nameable
    element around it, found by its whole text (the accessibility tree's StaticText)."""
    if role == "text":
        return env.page.get_by_text(name, exact=True)
    return env.page.get_by_role(role, name=name, exact=True)


def find_boxes(env: BrowserEnv, role: str, name: str) -> list[Box]:
    """Boxes of the visible elements with this role and name (env.find_element, which also
    finds role "text")."""
    if role != "text":
        return env.find_element(role, name)
    try:
        boxes = _locator(env, role, name).evaluate_all(
            "els => els.map(e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })")
    except PlaywrightError as exc:
        raise EnvFault(f"finding text {name!r} failed: {exc}") from exc
    return [tuple(b) for b in boxes if b[2] > 0 and b[3] > 0]


# The passage in one text node of the element, matched with spacing collapsed as the
# accessibility tree collapses it; the boxes of its first and last characters and of the whole.
_PASSAGE_JS = r"""(els, passage) => els.map(el => {
  const box = r => [r.x, r.y, r.width, r.height];
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    let flat = "", at = [];
    for (let i = 0; i < node.data.length; i++) {
      const space = /\s/.test(node.data[i]);
      if (space && (flat === "" || flat.endsWith(" "))) continue;
      flat += space ? " " : node.data[i];
      at.push(i);
    }
    const i = flat.indexOf(passage);
    if (i < 0) continue;
    const range = (a, b) => { const r = document.createRange(); r.setStart(node, a); r.setEnd(node, b); return r; };
    const first = at[i], last = at[i + passage.length - 1];
    return {first: box(range(first, first + 1).getBoundingClientRect()),
            last: box(range(last, last + 1).getBoundingClientRect()),
            whole: box(range(first, last + 1).getBoundingClientRect())};
  }
  return null;
})"""


def passage_boxes(env: BrowserEnv, role: str, name: str, passage: str) -> PassageBoxes | None:
    """Where `passage` is inside the one element (role, name), read from the live page with
    a Range; None when there is not exactly one such element or it does not hold the passage."""
    try:
        found = _locator(env, role, name).evaluate_all(_PASSAGE_JS, " ".join(passage.split()))
    except PlaywrightError as exc:
        raise EnvFault(f"finding {passage!r} in {role} {name!r} failed: {exc}") from exc
    if len(found) != 1 or found[0] is None:
        return None
    return PassageBoxes(*(tuple(found[0][k]) for k in ("first", "last", "whole")))

"""UI operations beyond a page path: the contract of a query's `actions_json`.

A page-graph query is a path; an atomic-operation query is one operation on a real
element of a real page (paper 6.2: click, double-click, right-click, drag, type at a
place, scroll to reveal); a deep-search query is a pathway of clicks through menus,
tabs and dialogs. Each names its elements as the spec's transitions do, by accessible
role and name, so the replay policy finds them on the live page and a changed app
shows up as a missing element, not a click in the wrong place.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, model_validator

OpKind = Literal["click", "double_click", "right_click", "drag", "select_text", "type_at", "scroll_to"]


class Operation(BaseModel):
    """One operation on one element (role, name).

    drag: press on the element and release on (to_role, to_name).
    select_text: drag across `text`, a passage inside the element, to select it.
    type_at: click the element, then type `text` there.
    scroll_to: scroll until the element is in view, no click.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: OpKind
    role: str
    name: str
    text: str | None = None
    to_role: str | None = None
    to_name: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> Operation:
        if self.op in ("select_text", "type_at") and not self.text:
            raise ValueError(f"op {self.op!r} needs text")
        if self.op == "drag" and not (self.to_role and self.to_name):
            raise ValueError("op 'drag' needs to_role and to_name (where to drop)")
        if self.op != "drag" and (self.to_role or self.to_name):
            raise ValueError(f"op {self.op!r} takes no to_role/to_name")
        return self


SPACE_OPS: dict[str, tuple[OpKind, ...]] = {
    "desktop": ("click", "double_click", "right_click", "drag", "select_text", "type_at", "scroll_to"),
    "mobile": ("click", "type_at", "scroll_to"),
}
"""The ops each action space (rollout.actions) can express: the mobile space taps, types
and swipes, and has no double click, right click or drag (a swipe scrolls the page)."""

_LIST = TypeAdapter(list[Operation])


def parse_operations(actions_json: str | None) -> list[Operation]:
    """A query's `actions_json` as operations; None is no operations. Raises ValueError naming the item."""
    if actions_json is None:
        return []
    return _LIST.validate_python(json.loads(actions_json))


def dump_operations(operations: list[Operation]) -> str:
    return json.dumps([op.model_dump(exclude_none=True) for op in operations])

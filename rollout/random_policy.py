"""A seeded random baseline: click an interactive element of the screen, or type.

The floor every GUI-agent benchmark reports (MiniWoB++ has scored random agents since
its first paper), and a cheap way to run any environment end to end without a model:
it reads the accessibility tree's boxes, never the app's internals. Seeded by the
query, so a rerun makes the same choices.
"""

from __future__ import annotations

import json
import random
from typing import Any

from trajforge.envs.browser import Observation
from trajforge.rollout.policy import PolicyOutput
from trajforge.schemas.records import Query

_TEXT_ROLES = {"textbox", "searchbox", "combobox", "spinbutton"}
_WORDS = ("hello", "submit", "ok", "2017", "blue", "test")


class RandomPolicy:
    name = "random"
    model_id = "random"
    prompt_version = "none"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def reset(self, query: Query) -> None:
        self._rng = random.Random(f"{self.seed}:{query.query_id}")

    def act(self, observation: Observation, env: Any) -> PolicyOutput:
        targets = observation.targets()
        if not targets:
            action: dict[str, Any] = {"type": "terminate", "status": "failure"}
            return PolicyOutput(action, "Nothing on the screen to interact with.", json.dumps(action))
        role, name, x, y = self._rng.choice(targets)
        if role in _TEXT_ROLES and observation.focused is not None and observation.focused.name == name:
            action = {"type": "type", "text": self._rng.choice(_WORDS)}
            thought = f"Type into the focused {role} {name!r} (random baseline)."
        else:
            action = {"type": "click", "x": x, "y": y}
            thought = f"Click the {role} {name!r} (random baseline)."
        return PolicyOutput(action, thought, json.dumps(action))

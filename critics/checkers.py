"""Programmatic checkers: a task's success read from the state its app ended in.

Bundled apps check their own server state; MiniWoB++ tasks report the reward their
page computed; Android tasks compare a device state probe. Either way the critics see
one signature.
"""

from __future__ import annotations

import functools

from trajforge.critics.stage import Checker
from trajforge.envs.android import check_probe
from trajforge.envs.apps import load_app
from trajforge.envs.miniwob import check_reward


@functools.cache
def checker_for(app: str) -> Checker:
    if app == "miniwob":
        return lambda _name, params, state: check_reward(params, state)
    if app == "android":
        return lambda _name, params, state: check_probe(params, state)
    return load_app(app).check

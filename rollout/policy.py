"""The policy interface every rollout policy implements (replay now, model-driven later).

A policy sees the observation and may query the environment (a reference policy asks
it where an element is; a model-driven one only looks at the observation). It returns
the action as a dict of the action space, its thought, and its raw output, so a step
row keeps both what the policy said and what was executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.llm.calls import CallRecord, Sampling
from trajforge.schemas.records import Query


@dataclass(frozen=True)
class Draw:
    """How one sampled attempt decodes: the configured temperature and top-p, and the attempt's own seed
    (part of each call's cache key, so the same attempt asked again is answered by the cache)."""

    temperature: float
    top_p: float
    seed: int | None

    def of(self, sampling: Sampling) -> Sampling:
        """A prompt's sampling with this attempt's (its max_tokens and stop strings kept)."""
        return sampling.model_copy(update={"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed})


@dataclass(frozen=True)
class PolicyOutput:
    action: dict[str, Any]
    thought: str
    raw_output: str
    calls: tuple[CallRecord, ...] = ()
    """The model calls that made this decision (none for a reference policy)."""
    error: str | None = None
    """Why the policy's output could not be turned into an action (kept, not guessed)."""
    roles: dict[str, Any] | None = None
    """Each agent role's inputs and outputs, for multi-agent policies (Mobile-Agent-v3)."""


class Policy(Protocol):
    """What `run_episode` drives. `model_id` and `prompt_version` go into the episode row."""

    @property
    def name(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def prompt_version(self) -> str: ...

    def reset(self, query: Query) -> None: ...

    def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput: ...

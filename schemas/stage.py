"""What a stage function returns for one shard of work."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trajforge.schemas.records import Record


@dataclass
class StageOutput:
    """Rows per output table, plus what lineage needs: drops with reasons, other counts,
    models and prompts used."""

    rows: dict[str, list[Record | dict[str, Any]]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    """Counts that are not drops (coverage, fallbacks, what could not be checked); summed over shards."""
    models: dict[str, str] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)

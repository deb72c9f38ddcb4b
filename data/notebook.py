"""Notebook helpers: the catalog of the current project, opened from its configuration.

    from trajforge.data.notebook import open_catalog
    steps = open_catalog().load("steps@nightly-2026-11-22")
"""

from __future__ import annotations

from pathlib import Path

from trajforge.data.catalog import Catalog
from trajforge.schemas.config import load_settings


def open_catalog(config: Path | str | None = None) -> Catalog:
    """The catalog that `trajforge` uses in this folder (trajforge.yaml and TRAJFORGE_* apply)."""
    return Catalog.from_settings(load_settings(Path(config) if config else None).warehouse)

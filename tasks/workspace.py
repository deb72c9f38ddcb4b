"""Everything a stage touches, opened once from the settings."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Catalog
from trajforge.llm import Gateway
from trajforge.schemas.config import Settings
from trajforge.tasks.ledger import Ledger


@functools.cache
def code_version() -> str:
    """Package version plus the git commit (and -dirty) when run from a checkout, for lineage."""
    try:
        base = version("trajforge")
    except PackageNotFoundError:
        base = "0+unknown"
    try:
        sha = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{base}+g{sha}" if sha else base


@dataclass
class Workspace:
    settings: Settings
    catalog: Catalog
    blobs: BlobStore
    ledger: Ledger

    @functools.cached_property
    def gateway(self) -> Gateway:
        """The model gateway, opened on first use: stages that ask no model never load one."""
        return Gateway.from_settings(self.settings)

    @classmethod
    def open(cls, settings: Settings) -> Workspace:
        catalog = Catalog.from_settings(settings.warehouse)
        return cls(settings, catalog, BlobStore(catalog.warehouse / "blobs"), Ledger(catalog.uri))

"""Everything a stage touches, opened once per run from the validated settings.

The workspace lives here, in the lowest room that sees both the storage (`data`: the
catalog, the screenshot blobs, the run ledger) and the models (`llm`: the gateway), so
every stage's room can name it and none has to import the runner.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Catalog, nightly_tag
from trajforge.data.ledger import Ledger, scope_of
from trajforge.llm import Gateway
from trajforge.llm.ocr import OcrReader, reader_for
from trajforge.schemas.config import Settings


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

    @functools.cached_property
    def ocr(self) -> OcrReader:
        """The run's OCR: each screenshot read once per warehouse, shared with the gateway and the critics."""
        return reader_for(self.settings.synth, self.catalog.uri)

    @classmethod
    def open(cls, settings: Settings) -> Workspace:
        catalog = Catalog.from_settings(settings.warehouse)
        return cls(settings, catalog, BlobStore(catalog.warehouse / "blobs"),
                   Ledger(catalog.uri, scope=scope_of(catalog.iceberg.name, catalog.namespace)))

    def close(self) -> None:
        """Release what the workspace opened: its model gateway if anything asked for it (connections, the
        response cache's pool), the catalog's and the ledger's database connections."""
        if (gateway := self.__dict__.get("gateway")) is not None:  # a cached_property: there once it was used
            gateway.close()
        self.catalog.close()
        self.ledger.engine.dispose()

    def run_tag(self, run_id: str) -> str:
        """The tag a run's versions get: nightly-YYYY-MM-DD for a nightly run, else the run id."""
        run = self.ledger.get_run(run_id)
        return nightly_tag(run.started_at) if run.flow == "nightly" else run_id

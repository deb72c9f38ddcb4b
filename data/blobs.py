"""Content-addressed screenshot store.

Screenshots are stored once, named by their sha256, and rows reference the hash: an
episode revisits the same screen often, and embedding 60 KB images in every row makes a
table 27 times larger (shared/FACTS.md). The hash is checked on every read, so a
damaged file is reported where it is found instead of training a model on it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobMissing(KeyError):
    """No blob with this hash in the store."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class BlobCorrupted(Exception):
    """A stored file whose content no longer matches its hash."""


@dataclass(frozen=True)
class BlobRef:
    """What a row keeps of a screenshot: its hash and its size in pixels."""

    sha256: str
    width: int
    height: int


class BlobStore:
    """Images under `root/<first 2 hex digits>/<other 62>`, written atomically, never twice."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        """Where the blob with this hash lives (whether or not it exists)."""
        if not SHA256.fullmatch(sha256):
            raise ValueError(f"not a lowercase hex sha256: {sha256!r}")
        return self.root / sha256[:2] / sha256[2:]

    @staticmethod
    def sha256_of(path: Path) -> str:
        """The hash of the blob at `path`: `path`'s inverse."""
        return path.parent.name + path.name

    def __contains__(self, sha256: object) -> bool:
        return isinstance(sha256, str) and SHA256.fullmatch(sha256) is not None and self.path(sha256).is_file()

    def put(self, data: bytes) -> BlobRef:
        """Store an image and return its reference; storing the same bytes again writes nothing.

        The image is decoded first (Pillow reads only the header for the size), so bytes
        that are not an image are refused before anything is written.
        """
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        sha256 = hashlib.sha256(data).hexdigest()
        target = self.path(sha256)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            # A unique temp name then a rename: concurrent writers of one blob never see half a file.
            tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
        return BlobRef(sha256=sha256, width=width, height=height)

    def get(self, sha256: str) -> bytes:
        """The blob's bytes, verified against the hash."""
        target = self.path(sha256)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            raise BlobMissing(f"no blob {sha256} in {self.root}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise BlobCorrupted(f"blob file {target} is corrupted: its content hashes to {actual}")
        return data

"""Ids and content hashes: the one place that turns a payload into a short sha256 hex id.

Ids are derived from what a row is (a run and a query, an app and its actions), never
random, so a rerun of a shard writes the same ids and the catalog can tell redone work
from new work. Changing a payload's construction changes every id made from it: the
callers build their payloads; this module only hashes them.
"""

from __future__ import annotations

import hashlib

ID_CHARS = 16
"""Hex characters of an id: 64 bits, far from colliding at a warehouse's row counts."""


def digest(payload: str | bytes, chars: int = ID_CHARS) -> str:
    """The first `chars` hex characters of the payload's sha256 (a str is hashed as UTF-8)."""
    data = payload.encode() if isinstance(payload, str) else payload
    return hashlib.sha256(data).hexdigest()[:chars]


def short_id(*parts: str) -> str:
    """An id for a row named by its parts, joined with ':' (a run and a step; "miniwob", a task and a seed)."""
    return digest(":".join(parts))

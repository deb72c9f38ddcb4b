"""The content-addressed screenshot store on a real folder with real PNGs."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image, UnidentifiedImageError

from trajforge.data.blobs import BlobCorrupted, BlobMissing, BlobRef, BlobStore


def png(width: int, height: int, color: tuple[int, int, int] = (30, 120, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def test_round_trip_with_size(store: BlobStore) -> None:
    data = png(1024, 600)

    ref = store.put(data)

    assert ref == BlobRef(sha256=hashlib.sha256(data).hexdigest(), width=1024, height=600)
    assert ref.sha256 in store
    assert store.path(ref.sha256) == store.root / ref.sha256[:2] / ref.sha256[2:]
    assert store.get(ref.sha256) == data
    assert not list(store.root.rglob("*.tmp"))


def test_same_bytes_are_stored_once(store: BlobStore) -> None:
    data = png(320, 200)
    first = store.put(data)
    mtime = store.path(first.sha256).stat().st_mtime_ns

    second = store.put(data)
    other = store.put(png(320, 200, color=(0, 0, 0)))

    assert second == first and other.sha256 != first.sha256
    assert store.path(first.sha256).stat().st_mtime_ns == mtime  # not rewritten
    assert sorted(p.name for p in store.root.rglob("*") if p.is_file()) == sorted(
        [first.sha256[2:], other.sha256[2:]]
    )


def test_corruption_is_detected_on_read(store: BlobStore) -> None:
    ref = store.put(png(64, 48))
    path = store.path(ref.sha256)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))

    with pytest.raises(BlobCorrupted, match=str(path)):
        store.get(ref.sha256)


def test_missing_blob(store: BlobStore) -> None:
    sha = hashlib.sha256(b"never stored").hexdigest()

    assert sha not in store
    with pytest.raises(BlobMissing, match=sha) as raised:
        store.get(sha)
    assert isinstance(raised.value, KeyError)


def test_rejects_non_images_and_bad_hashes(store: BlobStore) -> None:
    with pytest.raises(UnidentifiedImageError):
        store.put(b"not an image")
    assert not any(p.is_file() for p in store.root.rglob("*"))
    with pytest.raises(ValueError, match="sha256"):
        store.path("../../etc/passwd")
    assert "../../etc/passwd" not in store

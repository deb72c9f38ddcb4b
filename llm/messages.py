"""Chat messages as the gateway takes them: OpenAI-style roles, text and image parts.

An image is named by the sha256 of its bytes, whether the caller gives a blob reference
or the PNG itself: the hash is what a cache key and a row keep, and the bytes are read
from the blob store only when a model has to see them (never on a cache hit).
"""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Annotated, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trajforge.data.blobs import BlobStore


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Part):
    type: Literal["text"] = "text"
    text: str


class ImagePart(_Part):
    """A screenshot: by blob hash, or as bytes (hashed here); `ax_tree` is its accessibility tree.

    The accessibility tree is shown only to models that cannot see images, beside the
    OCR text of the screenshot.
    """

    type: Literal["image"] = "image"
    sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    png: bytes | None = Field(default=None, repr=False, description="The image bytes (PNG or any format Pillow reads).")
    ax_tree: str | None = None

    @model_validator(mode="after")
    def _hash_bytes(self) -> ImagePart:
        if self.png is None and not self.sha256:
            raise ValueError("an image needs its blob sha256 or its bytes (png)")
        if self.png is not None:
            actual = hashlib.sha256(self.png).hexdigest()
            if self.sha256 and self.sha256 != actual:
                raise ValueError(f"sha256 {self.sha256} does not match the image bytes ({actual})")
            object.__setattr__(self, "sha256", actual)
        return self

    def with_bytes(self, blobs: BlobStore | None) -> ImagePart:
        """This image with its bytes, read from the blob store if only the hash was given."""
        if self.png is not None:
            return self
        if blobs is None:
            raise ValueError(f"image {self.sha256} is given by hash but the gateway has no blob store")
        return self.model_copy(update={"png": blobs.get(self.sha256)})

    def data_url(self) -> str:
        """The bytes as a data URL, the way OpenAI-compatible servers take images."""
        assert self.png is not None, "with_bytes() first"
        with Image.open(io.BytesIO(self.png)) as image:
            mime = Image.MIME.get(image.format or "", "image/png")
        return f"data:{mime};base64,{base64.b64encode(self.png).decode()}"


IMAGE_ERRORS = (OSError, Image.DecompressionBombError)
"""What Pillow raises for bytes it cannot decode: UnidentifiedImageError (an OSError), a truncated or broken
file, a decompression bomb."""


def image_error(image: ImagePart, exc: BaseException) -> str:
    """Why the image cannot be decoded, naming it by its hash, as every failed request for it says."""
    # UnidentifiedImageError's message names a BytesIO's address, a new one each run, and the text reaches rows.
    why = "not an image Pillow can read" if isinstance(exc, UnidentifiedImageError) else str(exc)
    return f"image {image.sha256} cannot be read: {why}"


def unreadable(image: ImagePart) -> str | None:
    """Why Pillow cannot decode the image's bytes, naming the image; None when it can. Such an image fails every
    time it is sent or read: the request's failure (a BackendError, a server's 400), neither retried nor a crash
    of its shard (which a resume met again)."""
    try:
        with Image.open(io.BytesIO(image.png or b"")) as pixels:
            pixels.load()
    except IMAGE_ERRORS as exc:
        return image_error(image, exc)
    return None


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: list[Part]

    @model_validator(mode="before")
    @classmethod
    def _plain_text(cls, data: object) -> object:
        """`{"role": ..., "content": "text"}` is a message with one text part, as in OpenAI's API."""
        if isinstance(data, dict) and isinstance(data.get("content"), str):
            return {**data, "content": [{"type": "text", "text": data["content"]}]}
        return data

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.content if isinstance(p, ImagePart)]

    @property
    def text(self) -> str:
        """The text parts joined; what a text-only chat template takes as the content."""
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))


def key_material(messages: list[Message]) -> list[dict[str, object]]:
    """The messages as a cache key sees them: images by hash (and tree), never by bytes."""
    return [m.model_dump(mode="json", exclude={"content": {"__all__": {"png"}}}) for m in messages]

"""What a text-only model is shown in place of a screenshot: its OCR text and accessibility tree.

rapidocr ships its PP-OCR models inside the wheel, so this runs on a fresh machine with
no download (0.5 s for a 1024x600 page, shared/FACTS.md). Each text box is given with
the pixel position of its centre, so a text-only model can still name where to click.
"""

from __future__ import annotations

import functools
import threading
from importlib.metadata import PackageNotFoundError, version

from trajforge.llm.calls import ObservationMode
from trajforge.llm.local import INSTALL
from trajforge.llm.messages import ImagePart, Message, TextPart


@functools.cache
def _engine() -> object:
    try:
        from rapidocr import RapidOCR
    except ImportError as exc:
        raise ImportError(f"rapidocr is needed to show images to a text-only model ({exc}): {INSTALL}") from exc
    return RapidOCR(params={"Global.log_level": "error"})


def engine_id() -> str:
    """Names the OCR that rendered an observation; part of the cache key of OCR'd calls."""
    try:
        return f"rapidocr-{version('rapidocr')}"
    except PackageNotFoundError:
        raise ImportError(f"rapidocr is needed to show images to a text-only model: {INSTALL}") from None


_lock = threading.Lock()  # one ONNX session, used by one thread at a time


@functools.lru_cache(maxsize=256)
def ocr_lines(png: bytes) -> tuple[str, ...]:
    """One line per text box, top to bottom: `"text" @ (x, y)` with the box centre in pixels.

    Cached by content: the policy and each critic look at the same screenshot.
    """
    with _lock:
        result = _engine()(png)  # type: ignore[operator]
    if result.txts is None:  # no text on the image
        return ()
    boxes = [
        (float(sum(p[1] for p in box) / 4), float(sum(p[0] for p in box) / 4), text)
        for box, text in zip(result.boxes, result.txts, strict=True)
    ]
    return tuple(f'"{text}" @ ({round(x)}, {round(y)})' for y, x, text in sorted(boxes))


def observation_mode(messages: list[Message], sees_images: bool) -> ObservationMode:
    """How the model observes the screen in this call; every call record says so."""
    images = [image for m in messages for image in m.images]
    if not images:
        return "text"
    if sees_images:
        return "image"
    return "ocr+ax" if any(image.ax_tree for image in images) else "ocr"


def _render(image: ImagePart, index: int) -> TextPart:
    assert image.png is not None, "images are read from the blob store before rendering"
    lines = ocr_lines(image.png)
    text = [f'[Screenshot {index}, shown as OCR text: one line per text box, "text" @ (x, y) = its centre in pixels]']
    text += list(lines) or ["(no text found)"]
    if image.ax_tree:
        text += [f"[Accessibility tree of screenshot {index}]", image.ax_tree]
    return TextPart(text="\n".join(text))


def as_text(messages: list[Message]) -> list[Message]:
    """The messages with every image replaced by its OCR text (and accessibility tree)."""
    out: list[Message] = []
    index = 0
    for message in messages:
        parts: list[TextPart | ImagePart] = []
        for part in message.content:
            if isinstance(part, ImagePart):
                index += 1
                parts.append(_render(part, index))
            else:
                parts.append(part)
        out.append(Message(role=message.role, content=parts))
    return out

"""OCR: word and character boxes, read once per image per warehouse, shared by every reader of the warehouse."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw, ImageFont

from trajforge.llm.ocr import OcrBackendMissing, OcrReader, reader_for
from trajforge.schemas.config import SynthSettings

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def page(lines: list[tuple[str, tuple[int, int]]]) -> tuple[bytes, dict[str, tuple[int, int, int, int]]]:
    """A white image with each text drawn at its place, and each word's drawn box."""
    image = Image.new("RGB", (480, 200), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(FONT, 24)
    boxes = {}
    for text, (x, y) in lines:
        draw.text((x, y), text, fill="black", font=font)
        for word in text.split():
            offset = draw.textlength(text[: text.index(word)], font=font)
            boxes[word] = tuple(int(v) for v in draw.textbbox((x + offset, y), word, font=font))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), boxes


def inside(point: tuple[float, float], box: tuple[int, int, int, int]) -> bool:
    x0, y0, x1, y1 = box
    return x0 - 3 <= point[0] <= x1 + 3 and y0 - 3 <= point[1] <= y1 + 3


def test_words_and_characters_are_boxed_where_they_were_drawn(tmp_path):
    png, drawn = page([("Send message now", (10, 10)), ("Inbox 42", (10, 100))])
    lines = OcrReader(db_url=f"sqlite:///{tmp_path / 'c.db'}").read(png)
    assert [line.text for line in lines] == ["Send message now", "Inbox 42"]
    words = {w.text: w.box for line in lines for w in line.words}
    assert set(words) == set(drawn)
    for word, (x, y, w, h) in words.items():
        assert inside((x + w / 2, y + h / 2), drawn[word]), (word, (x, y, w, h), drawn[word])
    send = lines[0]
    assert "".join(c.text for c in send.chars) == "Sendmessagenow"
    first, last = send.chars[0].box, send.chars[-1].box
    assert first[0] < last[0] and inside((first[0] + first[2] / 2, first[1] + first[3] / 2), drawn["Send"])


def test_an_image_is_read_once_per_warehouse(tmp_path):
    png, _ = page([("Checkout", (20, 20))])
    url = f"sqlite:///{tmp_path / 'c.db'}"
    first = OcrReader(db_url=url)
    lines = first.read(png)
    assert first.engine_runs == 1
    first.read(png)
    assert first.engine_runs == 1
    later = OcrReader(db_url=url)  # another process of the same warehouse
    assert later.read(png) == lines
    assert later.engine_runs == 0
    assert later.lines(png) == (f'"Checkout" @ ({round(lines[0].box[0] + lines[0].box[2] / 2)}, '
                                f'{round(lines[0].box[1] + lines[0].box[3] / 2)})',)


def test_one_reader_per_warehouse_in_a_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert reader_for(SynthSettings(), url) is reader_for(None, url)


def test_a_missing_backend_names_the_install_command(tmp_path):
    pytest.importorskip("rapidocr")
    reader = OcrReader("paddleocr", paddle_det_dir=tmp_path, paddle_rec_dir=tmp_path)
    png, _ = page([("x", (0, 0))])
    with pytest.raises(OcrBackendMissing, match="pip install paddleocr paddlepaddle|synth.paddle_det_dir"):
        reader.read(png)

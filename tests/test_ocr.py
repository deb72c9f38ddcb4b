"""OCR: word and character boxes, read once per image per warehouse, shared by every reader of the warehouse."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import sys
import threading

import numpy as np
import pytest
import sqlalchemy as sa
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

from trajforge.llm import ocr, ocr_diff
from trajforge.llm.local import INSTALL
from trajforge.llm.ocr import OcrBackendMissing, OcrLine, OcrReader, reader_for
from trajforge.llm.ocr_diff import PAD, TILE, changed_tiles, regions
from trajforge.schemas.config import Settings, SynthSettings

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def page(lines: list[tuple[str, tuple[int, int]]],
         background: str = "white") -> tuple[bytes, dict[str, tuple[int, int, int, int]]]:
    """An image with each text drawn at its place, and each word's drawn box."""
    image = Image.new("RGB", (480, 200), background)
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


def test_a_line_read_before_is_remembered_and_reads_the_same():
    """Two screens share a header: the second screen's header is not recognised again, and each screen reads
    exactly as a reader that never saw the other reads it."""
    first, _ = page([("Shop Home Cart", (10, 10)), ("Blue teapot", (10, 100))])
    second, _ = page([("Shop Home Cart", (10, 10)), ("Green kettle", (10, 100))])
    reader = OcrReader()
    lines = [reader.read(first), reader.read(second)]
    assert (reader.line_memo.recognised, reader.line_memo.remembered) == (3, 1)
    assert lines == [OcrReader().read(first), OcrReader().read(second)]
    header = lines[1][0]
    assert header.text == "Shop Home Cart" and [w.text for w in header.words] == ["Shop", "Home", "Cart"]


def test_openvino_finds_the_lines_onnxruntime_finds():
    """The detector runs on OpenVINO, not on rapidocr's own onnxruntime session, under the same engine id: so
    every reading cached before (and on any machine) must be the one the onnxruntime detector gives."""
    from trajforge.llm.ocr import LineMemo, _OpenVinoDetector, _Rapid, _rapidocr_on_onnxruntime

    png, _ = page([("Search products", (12, 8)), ("Blue teapot $12.50", (30, 60)),
                   ("Add to cart", (300, 120)), ("Sign in · Help", (12, 164))], background="#f4f4f0")
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    engine = _Rapid(LineMemo())
    assert isinstance(engine.engine._load_det_model().session, _OpenVinoDetector)
    on_openvino = engine(rgb)
    onnx, _ = _rapidocr_on_onnxruntime()
    engine.engine._load_det_model().session = onnx._load_det_model().session
    assert len(on_openvino) == 4 and on_openvino[0].text == "Search products"
    assert engine(rgb) == on_openvino


def test_a_forgotten_screen_is_read_again_and_the_others_are_not(tmp_path):
    """What `datasets expire` does for the screenshots it removes: their readings go, in memory and in the
    database, and no other screen's."""
    (gone, _), (kept, _) = page([("Checkout", (20, 20))]), page([("Basket", (20, 20))])
    url = f"sqlite:///{tmp_path / 'c.db'}"
    reader = OcrReader(db_url=url)
    reader.read(gone), reader.read(kept)
    sha = hashlib.sha256(gone).hexdigest()
    assert reader.forget({sha}, dry_run=True) == 1
    assert reader.forget({sha}) == 1 and reader.forget({sha}) == 0
    reader.read(kept), reader.read(gone)
    assert reader.engine_runs == 3  # the forgotten screen once more; the kept one from memory
    later = OcrReader(db_url=url)
    later.read(kept), later.read(gone)
    assert later.engine_runs == 0  # the second reading of the forgotten screen was kept again


def test_a_forgotten_screen_takes_its_readings_against_earlier_screens_with_it(tmp_path):
    """`datasets expire` after nights with `synth.ocr_incremental`: a screen read where it changed from the one
    before leaves none of its text behind (it may be private), on a database made before such readings could be
    found, and the earlier screen's reading stays."""
    db = sa.create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    ocr.ocr_results.create(db)  # the database as an older version left it
    kept, _ = page([("Send message now", (10, 10)), ("Inbox 42", (10, 80))])
    gone, _ = page([("Send message now", (10, 10)), ("Inbox 57", (10, 80))])
    reader = OcrReader(db_url=str(db.url))
    series = reader.series(incremental=True)
    series.read(kept), series.read(gone)
    assert reader.region_reads == 1
    sha = hashlib.sha256(gone).hexdigest()
    assert reader.forget({sha}, dry_run=True) == 1
    assert reader.forget({sha}) == 1
    with db.connect() as conn:
        assert conn.execute(sa.select(ocr.ocr_results.c.sha256)).scalars().all() == [hashlib.sha256(kept).hexdigest()]
    again = reader.series(incremental=True)
    again.read(kept), again.read(gone)
    assert (reader.engine_runs, reader.region_reads) == (3, 2), "the forgotten screen read again, the kept one not"


def test_one_reader_per_warehouse_in_a_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert reader_for(SynthSettings(), url) is reader_for(None, url)


def test_warehouses_can_share_one_ocr_cache(tmp_path, monkeypatch):
    shared = f"sqlite:///{tmp_path / 'ocr.db'}"
    settings = SynthSettings(ocr_cache_url=shared)
    first = reader_for(settings, f"sqlite:///{tmp_path / 'a.db'}")  # the catalog of warehouse a
    assert reader_for(settings, f"sqlite:///{tmp_path / 'b.db'}") is first  # and of warehouse b: one cache
    png, _ = page([("Checkout", (20, 20))])
    lines = first.read(png)
    later = OcrReader(db_url=shared)  # another process, on any warehouse
    assert later.read(png) == lines and later.engine_runs == 0
    assert not (tmp_path / "a.db").exists()  # nothing went to the catalog's database
    # where readings are kept is no new work: the stages' config hashes stay as they were
    monkeypatch.delenv("TRAJFORGE_SYNTH__OCR_CACHE_URL", raising=False)  # the suite's own shared cache
    assert Settings(synth={"ocr_cache_url": shared}).section_hash("synth") == Settings().section_hash("synth")


def test_a_missing_backend_names_the_install_command(tmp_path):
    reader = OcrReader("paddleocr", paddle_det_dir=tmp_path, paddle_rec_dir=tmp_path)
    png, _ = page([("x", (0, 0))])
    with pytest.raises(OcrBackendMissing, match="pip install paddleocr paddlepaddle|synth.paddle_det_dir"):
        reader.read(png)


def test_an_engine_that_cannot_be_built_fails_every_read_and_leaves_none_waiting(monkeypatch):
    """A missing piece (openvino, a model folder) fails each read that would build an engine, however many reads
    failed before: a read after as many failures as there are cores must not wait for an engine never built."""
    class Unbuildable:
        def __init__(self, memo: object) -> None:
            raise OcrBackendMissing("OCR backend rapidocr needs openvino")

    monkeypatch.setattr(ocr, "_Rapid", Unbuildable)
    reader, (png, _) = OcrReader(), page([("Checkout", (20, 20))])
    reads = (os.cpu_count() or 1) + 2
    failed: list[OcrBackendMissing] = []

    def read_all() -> None:
        for _ in range(reads):
            with pytest.raises(OcrBackendMissing, match="needs openvino") as err:
                reader.read(png)
            failed.append(err.value)

    thread = threading.Thread(target=read_all, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), f"read {len(failed) + 1} waits for an engine that was never built"
    assert len(failed) == reads


def test_paddleocr_is_named_without_loading_an_engine(tmp_path, monkeypatch):
    """The gateway names the OCR in a call's cache key on its event loop, which must not wait for an engine to
    load (seconds) or for a busy one to be given back."""
    def loaded(*dirs: object) -> None:
        raise AssertionError("an engine was loaded to name it")

    monkeypatch.setattr(ocr, "_Paddle", loaded)
    monkeypatch.setattr(ocr, "version", lambda package: {"paddleocr": "3.1.0"}[package])

    def engine_id(models: str) -> str:
        folder = tmp_path / models
        return OcrReader("paddleocr", paddle_det_dir=folder / "det", paddle_rec_dir=folder / "rec").engine_id

    for models, weights in (("v4", b"PP-OCRv4 weights"), ("v5", b"PP-OCRv5 weights")):
        for part in ("det", "rec"):
            (tmp_path / models / part).mkdir(parents=True)
            (tmp_path / models / part / "inference.pdiparams").write_bytes(weights + part.encode())
            (tmp_path / models / part / "inference.yml").write_text(f"model: {part}")
    v4 = engine_id("v4")
    assert v4.startswith("paddleocr-3.1.0:det:rec:"), "the version and folders' names stay readable"
    assert engine_id("v5") != v4, "other models in folders of the same names read screens again"
    shutil.copytree(tmp_path / "v4", tmp_path / "copy")
    assert engine_id("copy") == v4, "the same models copied to another place or machine read no screen again"
    (tmp_path / "v4" / "rec" / "inference.pdiparams").write_bytes(b"fine-tuned weights")
    assert engine_id("v4") != v4, "a model file replaced in its folder reads screens again"


def test_a_screen_that_changed_in_one_place_is_read_there_only():
    before, _ = page([("Send message now", (10, 10)), ("Inbox 42", (10, 80)), ("Drafts", (260, 150))])
    after, drawn = page([("Send message now", (10, 10)), ("Inbox 57", (10, 80)), ("Drafts", (260, 150))])
    reader = OcrReader()
    series = reader.series(incremental=True)
    first = series.read(before)
    lines = series.read(after)
    assert (reader.engine_runs, reader.region_reads) == (2, 1)
    assert [line.text for line in lines] == ["Send message now", "Inbox 57", "Drafts"]
    assert lines[0] == first[0] and lines[2] == first[2], "the lines away from the change are the earlier screen's"
    words = {w.text: w.box for line in lines for w in line.words}
    x, y, w, h = words["57"]
    assert inside((x + w / 2, y + h / 2), drawn["57"]), "the region's boxes are placed on the whole screen"
    assert series.engine_id.startswith(reader.engine_id + "+diff")
    assert [line.text for line in reader.read(after)] == [line.text for line in lines]  # a whole read, on its own
    assert (reader.engine_runs, reader.region_reads) == (3, 1)


def test_a_series_reads_alike_whatever_else_the_reader_read():
    """A reading depends on the series' earlier screens only (a grounding shard's, fixed by the stage's plan), never
    on what the reader or its cache read before, so a night reads alike on any runner."""
    screens = [page([("Inbox", (10, 10)), ("Drafts 7", (200, 60)), (f"Sent {n}", (10, 150))])[0] for n in (3, 4, 5)]
    alone = OcrReader()
    series = alone.series(incremental=True)
    expected = [series.read(png) for png in screens]
    assert alone.region_reads == 2, "the first screen read whole, the next two where they changed"
    busy = OcrReader()
    busy.series(incremental=True).read(page([("Inbox", (10, 10)), ("Drafts 7", (200, 60)), ("Sent 9", (10, 150))])[0])
    series = busy.series(incremental=True)
    assert [series.read(png) for png in screens] == expected
    assert busy.region_reads == 2, "a screen like the first, read by another series, is no base of this one"
    read_before = OcrReader()
    for png in screens:  # every screen read whole before (by the critics, or an earlier night)
        read_before.read(png)
    series = read_before.series(incremental=True)
    assert [series.read(png) for png in screens] == expected and read_before.region_reads == 2
    again = read_before.series(incremental=True)  # a shard run again: its readings come from the cache
    assert [again.read(png) for png in screens] == expected and read_before.region_reads == 2


def test_a_screen_unlike_the_last_ones_is_read_whole():
    reader = OcrReader()
    series = reader.series(incremental=True)
    text = [("Inbox", (10, 10)), ("Drafts 7", (200, 60))]
    series.read(page(text)[0])
    lines = series.read(page(text, background="lightyellow")[0])  # a theme change: every pixel differs
    assert reader.region_reads == 0
    assert [line.text for line in lines] == ["Inbox", "Drafts 7"]


def test_a_changed_region_takes_in_every_line_it_touches():
    def line(text: str, box: tuple[float, float, float, float]) -> OcrLine:
        return OcrLine(text, 1.0, box, (), ())

    lines = (line("title", (10, 10, 200, 20)), line("total 42", (10, 100, 120, 20)),
             line("pay now", (140, 100, 80, 20)), line("footer", (10, 300, 100, 20)))
    changed = np.zeros((400 // TILE, 640 // TILE), dtype=bool)
    changed[104 // TILE, 120 // TILE] = True  # a change in "total 42", beside "pay now"
    kept, rects = regions(changed, lines, 640, 400)
    assert [k.text for k in kept] == ["title", "footer"], "the line changed and the one its region met are read again"
    # the changed tile (112-128, 96-112) with PAD, grown by both lines (10-220, 100-120) with PAD
    assert rects == [(10 - PAD, 96 - PAD, 220 + PAD, 120 + PAD)]
    assert not changed_tiles(np.zeros((40, 40, 3), np.uint8), np.zeros((40, 40, 3), np.uint8)).any()


def test_a_long_engine_id_fits_the_engine_column(postgres_url, monkeypatch):
    """An engine id longer than `trajforge_ocr.engine` (PaddleOCR's folder names make ids of 80 and more) is
    kept under a key that fits, on a database that enforces the column's length, and stays apart from an id
    that differs only past the part that fits."""
    png, _ = page([("Long engine names", (20, 20))])
    sha = hashlib.sha256(png).hexdigest()
    local = "+cu128.ubuntu22.04.nightly20261205.build" + "0" * 40  # a wheel's local version label
    monkeypatch.setattr(ocr, "version", lambda package: {"rapidocr": "3.10.0" + local}[package])
    reader = OcrReader(db_url=postgres_url)
    try:
        lines = reader.read(png)
        assert len(reader.engine_id) > ocr.ocr_results.c.engine.type.length
        later = OcrReader(db_url=postgres_url)
        assert later.read(png) == lines and later.engine_runs == 0
        with sa.create_engine(postgres_url).connect() as conn:
            (stored,) = conn.execute(sa.select(ocr.ocr_results.c.engine).where(ocr.ocr_results.c.sha256 == sha))
        assert stored.engine.startswith("rapidocr-3.10.0+cu128"), "the stored key stays readable"
        monkeypatch.setattr(ocr, "version", lambda package: {"rapidocr": "3.10.0" + local + "1"}[package])
        other = OcrReader(db_url=postgres_url)
        assert other.read(png) == lines and other.engine_runs == 1
    finally:
        reader.forget({sha})


def test_a_screen_with_the_pixels_of_an_earlier_one_is_not_read_again():
    """A screenshot taken again of an unchanged screen differs in its file (here a PNG text chunk), not in its
    pixels: nothing is read and no engine runs, and the reruns benchmark counts no OCR for it."""
    png, _ = page([("Send message now", (10, 10)), ("Inbox 42", (10, 80))])
    info = PngInfo()
    info.add_text("Comment", "taken a second later")
    out = io.BytesIO()
    Image.open(io.BytesIO(png)).save(out, format="PNG", pnginfo=info)
    again = out.getvalue()
    assert again != png
    reader = OcrReader()
    series = reader.series(incremental=True)
    first = series.read(png)
    assert [line.text for line in series.read(again)] == [line.text for line in first]
    assert (reader.engine_runs, reader.region_reads) == (1, 0)


def test_a_change_of_the_incremental_settings_reads_screens_again(monkeypatch):
    """Readings against earlier screens depend on how screens are compared (`llm.ocr_diff`'s tiles and padding,
    how many earlier screens and how much change): an upgrade that changes one reads such screens again."""
    before, _ = page([("Send message now", (10, 10)), ("Inbox 42", (10, 80))])
    after, _ = page([("Send message now", (10, 10)), ("Inbox 57", (10, 80))])
    reader = OcrReader()
    ids = {reader.series(incremental=True).engine_id}
    for module, name, value in ((ocr_diff, "PAD", 12), (ocr_diff, "TILE", 32), (ocr, "INCREMENTAL_BASES", 4),
                                (ocr, "INCREMENTAL_MAX_AREA", 0.5)):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, value)
            ids.add(reader.series(incremental=True).engine_id)
    assert len(ids) == 5, ids
    series = reader.series(incremental=True)
    series.read(before), series.read(after)
    assert reader.region_reads == 1
    monkeypatch.setattr(ocr_diff, "PAD", 12)
    series = reader.series(incremental=True)
    series.read(before), series.read(after)
    assert reader.region_reads == 2, "the changed screen read again with the new padding"


def test_rapidocr_without_onnxruntime_names_the_install_command(monkeypatch):
    """rapidocr does not depend on onnxruntime, which runs its recogniser: without it a read fails with the
    command that installs it, not with rapidocr's bare ImportError."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if it were not installed
    reader, (png, _) = OcrReader(), page([("Checkout", (20, 20))])
    assert reader.engine_id.startswith("rapidocr-")
    with pytest.raises(OcrBackendMissing, match=re.escape(INSTALL)):
        reader.read(png)

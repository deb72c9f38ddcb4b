"""OCR of screenshots: text lines with word and character boxes, read once per image per warehouse.

Two users share it: a text-only model is shown a screenshot as its OCR text (one line per
text box, `"text" @ (x, y)` with the box centre in pixels, so it can still name where to
click), and the grounding stage turns word and character boxes into training rows. Both
read through one `OcrReader`, which keeps every result in the catalog's database keyed by
the screenshot's sha256 and the engine, so a screen the critics OCR'd is not OCR'd again by
synthesis, nor by a rerun (`engine_runs` counts the engine's real runs).

rapidocr ships its PP-OCR models inside the wheel, so the default runs on a fresh machine
with no download (about 0.3-0.5 s a screen on one thread). One engine run with
`return_single_char_box` gives character boxes; word boxes are their unions between the
spaces of the line's text (asking for word boxes too would run recognition twice).
PaddleOCR is the alternative backend where it and its model folders are installed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa
from PIL import Image

from trajforge.llm import ocr_diff
from trajforge.llm.calls import ObservationMode
from trajforge.llm.local import INSTALL
from trajforge.llm.messages import ImagePart, Message, TextPart
from trajforge.llm.ocr_diff import Rect, changed_tiles, reading_order, regions, shifted
from trajforge.schemas.config import SynthSettings

if TYPE_CHECKING:
    from rapidocr import RapidOCR

Box = tuple[float, float, float, float]
"""x, y, width, height in pixels of the image."""

_meta = sa.MetaData()

_ENGINE_CHARS = 80
"""The length of `trajforge_ocr.engine`: an engine id longer than it is kept shortened (`_engine_key`)."""

ocr_results = sa.Table(
    "trajforge_ocr",
    _meta,
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("engine", sa.String(_ENGINE_CHARS), primary_key=True),
    sa.Column("lines_json", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

ocr_screens = sa.Table(
    "trajforge_ocr_screens",
    _meta,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("sha256", sa.String(64), nullable=False, index=True),
)
"""The screen each reading read against earlier screens (`OcrSeries`) is of: such a reading's key names its chain
of screens, not the screen, and `OcrReader.forget` finds it here. A table of its own, so that a database made
before it gets it from `create_all`, with no change to `trajforge_ocr`."""


def _engine_key(engine_id: str) -> str:
    """The engine id as `trajforge_ocr.engine` keeps it: as it is where it fits, so every reading kept before stays
    found, else its start and a hash of the whole id, to the column's length (PaddleOCR's folder names make ids of
    80 and more, and PostgreSQL refuses a longer value). The column stays as it is: a wider one would need every
    database made before to be migrated."""
    if len(engine_id) <= _ENGINE_CHARS:
        return engine_id
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return f"{engine_id[:_ENGINE_CHARS - len(digest) - 1]}~{digest}"


class OcrBackendMissing(ImportError):
    """The configured OCR backend (or its model files) is not installed; the message says how to install it."""


@dataclass(frozen=True)
class OcrSpan:
    text: str
    box: Box


@dataclass(frozen=True)
class OcrLine:
    """One text box as the engine reports it, with its words and characters."""

    text: str
    score: float
    box: Box
    words: tuple[OcrSpan, ...]
    chars: tuple[OcrSpan, ...]


def _box(points: Any) -> Box:
    """The axis-aligned box around a four-point polygon."""
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    return (min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys))


def _union(boxes: list[Box]) -> Box:
    x0 = min(b[0] for b in boxes)
    y0 = min(b[1] for b in boxes)
    x1 = max(b[0] + b[2] for b in boxes)
    y1 = max(b[1] + b[3] for b in boxes)
    return (x0, y0, x1 - x0, y1 - y0)


def _words(text: str, chars: tuple[OcrSpan, ...]) -> tuple[OcrSpan, ...]:
    """Word boxes: the characters between the spaces of `text`, in order. The engine reports one box per
    non-space character; where the counts disagree the words cannot be placed and none are given."""
    tokens = text.split()
    if sum(len(t) for t in tokens) != len(chars):
        return ()
    words, i = [], 0
    for token in tokens:
        words.append(OcrSpan(token, _union([c.box for c in chars[i : i + len(token)]])))
        i += len(token)
    return tuple(words)


_RAPID_PARAMS = {"Global.use_cls": False, "Det.limit_type": "max", "Det.limit_side_len": 1280, "Rec.rec_batch_num": 1,
                 "EngineConfig.onnxruntime.intra_op_num_threads": 1}
"""rapidocr's settings for screens. Its defaults are for photos of documents: an angle classifier for text
upside down (never on a screen), and the detector's input scaled so its shortest side is 736, which
reads a 412x915 phone screen at 736x1635 (2.4 s; 0.9 s at its own size) and would blow a 300x40 changed
region up to 5520x736. Here a screen or region is read at its own size up to 1280 a side.

One thread an engine, and an engine per thread that reads at once (`OcrReader._engine`): onnxruntime's own
pool of a thread per core spins while it waits, so beside other work it burns the cores it waits for. 24
screens of a replay night on 2 cores (2026-12-02): one reader alone 23.4 s with its pool (45.3 CPU-s), 35.9 s
on one thread; two readers at once, as a night's grounding shards or two test workers read, 54.5 s each with
the pool and 35 s each on one thread. The readings are the same, box for box and score for score (39 screens
compared), so the engine id and every cached reading stay valid.

One text line a recognition pass: rapidocr's default batches 6, each padded to the widest of them, and on one
thread the padding costs more than the batch saves. 34 screens of a replay night (2026-12-05, 2 cores, two rounds
each, interleaved): 10.9-11.7 s against 12.7-13.1 s batched by 6 (16: 18.0 s). The same texts; the scores move by
at most 0.024 and 2% of character boxes by more than 2 px (at most 6), as the model sees no padding beside a
line: readings differ, hence the engine id's `rec1`.

onnxruntime's memory arena stays off, as rapidocr sets it: on 39 screens (2026-12-05, 2 cores, two rounds each)
it read them in 26.6 s against 27.3 s, for 200 MB more an engine, the same readings."""

_RAPID_DET_MODEL = "PP-OCRv6_det_small.onnx"
"""The detection model of rapidocr's defaults, which its wheel ships (`_OpenVinoDetector` runs it)."""


def _rapid_id() -> str:
    """rapidocr's engine id: its wheel's version, which fixes the PP-OCR models it ships (read without loading
    them), and the settings above."""
    try:
        return f"rapidocr-{version('rapidocr')}/det-max-1280-no-cls-rec1"
    except PackageNotFoundError:
        raise OcrBackendMissing(f"OCR backend rapidocr is not installed: {INSTALL}") from None


def _models_digest(folders: tuple[Path, ...]) -> str:
    """A hash of the model files in these folders: each file's name in its folder, size and content. The content,
    not a file's mtime: the id is shared by every machine that reads into one cache and names the OCR in stages'
    versions, and a copy of the same models (a new machine, an rsync) has new mtimes. Read once a process
    (`OcrReader.engine_id` is cached): 100 MB hash in 0.17 s (2 cores, 2026-12-07), PP-OCRv5's server models
    (about 170 MB) in about 0.3 s."""
    digest = hashlib.sha256()
    for folder in folders:
        digest.update(f"{folder.name}\0".encode())
        for file in sorted(f for f in folder.rglob("*") if f.is_file()):
            with file.open("rb") as content:
                content_hash = hashlib.file_digest(content, "sha256").hexdigest()
            digest.update(f"{file.relative_to(folder).as_posix()}\0{file.stat().st_size}\0{content_hash}\0".encode())
    return digest.hexdigest()[:12]


def _paddle_id(det_dir: Path | None, rec_dir: Path | None) -> str:
    """paddleocr's engine id: its version, its model folders' names and a hash of their files (read without loading
    them), so other models in folders of the same names read screens again."""
    if det_dir is None or rec_dir is None or not Path(det_dir).is_dir() or not Path(rec_dir).is_dir():
        raise OcrBackendMissing(
            "OCR backend paddleocr needs its model folders: set synth.paddle_det_dir and synth.paddle_rec_dir "
            f"to PP-OCR detection and recognition model directories (got {det_dir}, {rec_dir})"
        )
    try:
        paddle = version("paddleocr")
    except PackageNotFoundError:
        raise OcrBackendMissing("OCR backend paddleocr is not installed: pip install paddleocr paddlepaddle") from None
    det, rec = Path(det_dir), Path(rec_dir)
    return f"paddleocr-{paddle}:{det.name}:{rec.name}:{_models_digest((det, rec))}"


class LineMemo:
    """The readings of text lines recognised before, keyed by the line's pixels: a line the same to the pixel
    as one read before (the app's header, a product name on its list and on its own page) is not recognised
    again. With one line a recognition pass (`_RAPID_PARAMS`) a line's reading depends on its pixels alone,
    so a screen's reading is the same with the memo as without it, box for box and score for score (39
    screens of a replay night compared), and the engine id does not change. Those 39 screens (2026-12-05,
    2 cores): 167 of 457 lines remembered, 22.3 s against 27.4 s. One memo serves a reader's engines (the
    threads that read at once); the oldest line is forgotten past `size` (a line is a few hundred bytes)."""

    def __init__(self, size: int = 20_000) -> None:
        self._lines: OrderedDict[bytes, tuple[str, float, Any]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self.recognised = 0
        """Lines the recogniser really read."""
        self.remembered = 0
        """Lines read from the memo instead."""

    def recognise(self, recogniser: Callable[[Any], Any], crops: list[np.ndarray], word_box: bool
                  ) -> list[tuple[str, float, Any]]:
        """(text, score, rapidocr's word result) of each crop, in order: remembered ones from the memo, the
        others recognised in one call of rapidocr's `recogniser`."""
        from rapidocr.ch_ppocr_rec.typings import TextRecInput

        keys = [hashlib.sha256(f"{crop.shape}{word_box}".encode() + np.ascontiguousarray(crop).tobytes()).digest()
                for crop in crops]
        with self._lock:
            known = {k: self._lines[k] for k in keys if k in self._lines}
        todo = [i for i, k in enumerate(keys) if k not in known]
        if todo:
            out = recogniser(TextRecInput(img=[crops[i] for i in todo], return_word_box=word_box))
            for j, i in enumerate(todo):
                known[keys[i]] = (out.txts[j], out.scores[j], out.word_results[j])
        with self._lock:
            self.recognised += len(todo)
            self.remembered += len(keys) - len(todo)
            for k in keys:
                self._lines[k] = known[k]
                self._lines.move_to_end(k)
            while len(self._lines) > self._size:
                self._lines.popitem(last=False)
        return [copy.deepcopy(known[k]) for k in keys]  # rapidocr maps a line's word boxes onto the screen


class _RememberingRecognizer:
    """rapidocr's text recogniser, called as rapidocr calls it, in front of a `LineMemo`."""

    def __init__(self, recogniser: Callable[[Any], Any], memo: LineMemo) -> None:
        self._recogniser = recogniser
        self._memo = memo

    def __call__(self, args: Any) -> Any:
        from rapidocr.ch_ppocr_rec.typings import TextRecOutput

        crops = [args.img] if isinstance(args.img, np.ndarray) else list(args.img)
        lines = self._memo.recognise(self._recogniser, crops, args.return_word_box)
        return TextRecOutput(crops, tuple(t for t, _, _ in lines), tuple(s for _, s, _ in lines),
                             tuple(w for _, _, w in lines), 0.0)


class _OpenVinoDetector:
    """rapidocr's text detection model compiled by OpenVINO, called as rapidocr calls its onnxruntime session.

    On one thread OpenVINO runs the detector as fast as onnxruntime or, on some CPUs, 3 times faster: 39
    screens of a replay night on an Intel machine with AMX (2026-12-05, 2 cores) 0.19 against 0.59 s a
    screen, a whole read 15.0 against 31.9 s for the 39; on an AMD EPYC (2026-12-06) 0.22 against 0.25 s.
    The recogniser gained nothing (0.25 against 0.23 s), so it stays on onnxruntime. The readings are the
    same, line, box, score, word and character (39 screens compared), so the engine id and every cached
    reading stay valid. Its precision is pinned to f32: where the CPU has bf16 instructions, OpenVINO's
    default is bf16 (0.11-0.12 s a screen), whose boxes moved by up to 5 px and whose texts differed on 3 of
    the 39 screens, so a reading would depend on the machine. Its threads are not pinned: pinned, every
    engine's one thread went to the same core, and two shards reading at once took 0.23 s a screen, as one
    after another (unpinned 0.13, onnxruntime 0.14)."""

    def __init__(self, model: Path) -> None:
        try:
            import openvino
        except ImportError as exc:
            raise OcrBackendMissing(f"OCR backend rapidocr needs openvino ({exc}): {INSTALL}") from exc
        config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32", "ENABLE_CPU_PINNING": False}
        compiled = openvino.Core().compile_model(str(model), "CPU", config)
        self._request = compiled.create_infer_request()

    def __call__(self, image: np.ndarray) -> np.ndarray:
        self._request.infer([image])
        return self._request.get_output_tensor().data.copy()  # the request reuses its buffer on the next call


def _rapidocr_on_onnxruntime() -> tuple[RapidOCR, Path]:
    """rapidocr as configured here, every model on onnxruntime as rapidocr runs them, and its detection model's
    file."""
    try:
        import onnxruntime  # noqa: F401  rapidocr runs its models on it but does not depend on it
        import rapidocr
    except ImportError as exc:
        raise OcrBackendMissing(f"OCR backend rapidocr is not installed ({exc}): {INSTALL}") from exc
    detector = Path(rapidocr.__file__).parent / "models" / _RAPID_DET_MODEL
    params = {"Global.log_level": "error", "Det.model_path": str(detector), **_RAPID_PARAMS}
    return rapidocr.RapidOCR(params=params), detector


class _Rapid:
    def __init__(self, memo: LineMemo) -> None:
        self.engine, detector = _rapidocr_on_onnxruntime()
        # rapidocr loads its models on first use: load them now, the detector's session (onnxruntime, 40 ms)
        # replaced by OpenVINO's and the memo put in front of the recogniser
        self.engine._load_det_model().session = _OpenVinoDetector(detector)
        self.engine.text_rec = _RememberingRecognizer(self.engine._load_rec_model(), memo)

    def __call__(self, rgb: np.ndarray) -> list[OcrLine]:
        result = self.engine(np.ascontiguousarray(rgb[..., ::-1]), return_word_box=True, return_single_char_box=True)
        if result.txts is None:  # no text on the image
            return []
        lines = []
        for text, score, points, char_results in zip(
            result.txts, result.scores, result.boxes, result.word_results, strict=True
        ):
            chars = tuple(OcrSpan(c, _box(p)) for c, _, p in char_results if c.strip())
            lines.append(OcrLine(text, float(score), _box(points), _words(text, chars), chars))
        return lines


class _Paddle:
    """PaddleOCR on local model folders (it cannot download its models on a closed network)."""

    def __init__(self, det_dir: Path | None, rec_dir: Path | None) -> None:
        _paddle_id(det_dir, rec_dir)  # says what is missing before anything loads
        try:
            from paddleocr import PaddleOCR
        except ImportError as exc:
            raise OcrBackendMissing(
                f"OCR backend paddleocr is not installed ({exc}): pip install paddleocr paddlepaddle"
            ) from exc
        self.engine = PaddleOCR(text_detection_model_dir=str(det_dir), text_recognition_model_dir=str(rec_dir),
                                return_word_box=True)

    def __call__(self, rgb: np.ndarray) -> list[OcrLine]:
        lines = []
        for page in self.engine.predict(rgb):
            for text, score, poly, char_texts, char_boxes in zip(
                page["rec_texts"], page["rec_scores"], page["rec_polys"],
                page.get("text_word", [[]] * len(page["rec_texts"])),
                page.get("text_word_boxes", [[]] * len(page["rec_texts"])), strict=False,
            ):
                chars = tuple(OcrSpan(c, _box([(b[0], b[1]), (b[2], b[3])])) for c, b in zip(char_texts, char_boxes)
                              if c.strip())
                lines.append(OcrLine(text, float(score), _box(poly), _words(text, chars), chars))
        return lines


def _decode(lines_json: str) -> tuple[OcrLine, ...]:
    def span(d: dict[str, Any]) -> OcrSpan:
        return OcrSpan(d["text"], tuple(d["box"]))  # type: ignore[arg-type]

    return tuple(
        OcrLine(d["text"], d["score"], tuple(d["box"]), tuple(map(span, d["words"])), tuple(map(span, d["chars"])))  # type: ignore[arg-type]
        for d in json.loads(lines_json)
    )


INCREMENTAL_BASES = 8
"""Earlier screens of a series a new one is compared with (decoded, about 3 MB each at 1280x800)."""
INCREMENTAL_MAX_AREA = 0.4
"""Above this share of the screen to read again, a whole read is as cheap and needs no earlier screen."""


def _rgb(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))


class OcrReader:
    """Reads screenshots whole through one engine, each distinct image once: an in-memory LRU in front of
    the `trajforge_ocr` table of the catalog's database (None: memory only). `series` reads a run of
    screens, each only where it changed (`OcrSeries`)."""

    def __init__(self, backend: str = "rapidocr", *, db_url: str | None = None, paddle_det_dir: Path | None = None,
                 paddle_rec_dir: Path | None = None, memory: int = 256) -> None:
        self.backend = backend
        self._paddle_dirs = (paddle_det_dir, paddle_rec_dir)
        self._engines: queue.LifoQueue[_Rapid | _Paddle] = queue.LifoQueue()
        """Engines no thread is reading with; one is made when every engine is busy, up to a core each."""
        self._made = 0
        self._making = threading.Lock()
        self._lock = threading.Lock()  # the LRU below and the counters, shared by the threads that read
        self._memory: OrderedDict[tuple[str, str], tuple[str, tuple[OcrLine, ...]]] = OrderedDict()
        """(key, engine id) -> (the screen's sha256, its lines)."""
        self._memory_size = memory
        self._db = sa.create_engine(db_url) if db_url else None
        if self._db is not None:
            _meta.create_all(self._db)
        self.engine_runs = 0
        """How many images the engine really read in this process, whole or in part (a miss of both caches)."""
        self.region_reads = 0
        """How many of those it read only in their changed regions."""
        self.line_memo = LineMemo()
        """The text lines rapidocr's engines recognised, shared by them (`LineMemo`)."""

    @contextmanager
    def _engine(self) -> Iterator[_Rapid | _Paddle]:
        """An engine for this thread alone while it reads (an ONNX session is used by one thread at a time):
        an idle one, a new one while there are fewer than cores, else the next one given back. Only an engine
        built counts: one that fails to build raises here, for this caller and the next that would build, and
        never leaves a caller waiting for an engine that does not exist."""
        with self._making:
            if self._engines.empty() and self._made < (os.cpu_count() or 1):
                made = _Paddle(*self._paddle_dirs) if self.backend == "paddleocr" else _Rapid(self.line_memo)
                self._made += 1
                self._engines.put(made)
        engine = self._engines.get()
        try:
            yield engine
        finally:
            self._engines.put(engine)

    @functools.cached_property
    def engine_id(self) -> str:
        """Names the OCR that reads an image whole; part of the cache keys of OCR results and of OCR'd model
        calls. Read from the settings, never from an engine: the gateway asks on its event loop, which must not
        wait for an engine to load or for a busy one."""
        if self.backend == "paddleocr":
            return _paddle_id(*self._paddle_dirs)
        return _rapid_id()

    def series(self, incremental: bool) -> OcrSeries:
        """A reader of screens one after another (`OcrSeries`); without `incremental`, each is read whole."""
        return OcrSeries(self, incremental)

    def read(self, png: bytes) -> tuple[OcrLine, ...]:
        """The image's text lines, top to bottom as the engine orders them."""
        return self._whole(hashlib.sha256(png).hexdigest(), lambda: _rgb(png))

    def _whole(self, sha: str, pixels: Callable[[], np.ndarray]) -> tuple[OcrLine, ...]:
        """The whole reading of the image with this sha256; `pixels` decodes it, called on a miss only."""
        engine_id = self.engine_id
        lines = self._known(sha, engine_id, sha)
        if lines is None:
            with self._engine() as engine:
                lines = self._known(sha, engine_id, sha)  # another thread may have read it meanwhile
                if lines is None:
                    lines = tuple(engine(pixels()))
                    self._count(region=False)
                    self._keep(sha, engine_id, sha, lines)
        return lines

    def _count(self, region: bool) -> None:
        """One more real run of an engine (threads read at once: `+=` alone could lose one)."""
        with self._lock:
            self.engine_runs += 1
            self.region_reads += region

    def _known(self, key: str, engine_id: str, screen: str) -> tuple[OcrLine, ...] | None:
        """A reading in memory or, failing that, in the database (then kept in memory). `key` is the screen's
        sha256 for a whole reading, its chain's for an incremental one (`OcrSeries`)."""
        with self._lock:
            if (hit := self._memory.get((key, engine_id))) is not None:
                self._memory.move_to_end((key, engine_id))
                return hit[1]
        if self._db is None:
            return None
        with self._db.connect() as conn:
            row = conn.execute(sa.select(ocr_results.c.lines_json).where(
                ocr_results.c.sha256 == key, ocr_results.c.engine == _engine_key(engine_id))).first()
        if row is None:
            return None
        lines = _decode(row.lines_json)
        self._remember(key, engine_id, screen, lines)
        return lines

    def _remember(self, key: str, engine_id: str, screen: str, lines: tuple[OcrLine, ...]) -> None:
        with self._lock:
            self._memory[(key, engine_id)] = (screen, lines)
            if len(self._memory) > self._memory_size:
                self._memory.popitem(last=False)

    def _keep(self, key: str, engine_id: str, screen: str, lines: tuple[OcrLine, ...]) -> None:
        """A new reading of the screen whose sha256 is `screen`, in memory and in the database."""
        self._remember(key, engine_id, screen, lines)
        if self._db is None:
            return
        reading = dict(sha256=key, engine=_engine_key(engine_id),
                       lines_json=json.dumps([asdict(line) for line in lines]), created_at=datetime.now(timezone.utc))
        rows = [] if key == screen else [(ocr_screens, dict(key=key, sha256=screen))]
        rows.append((ocr_results, reading))
        for table, row in rows:  # the screen first: `forget` never meets a reading it cannot place
            try:
                with self._db.begin() as conn:
                    conn.execute(table.insert().values(**row))
            except sa.exc.IntegrityError:  # another process (or engine) stored it first: the same row
                pass

    def forget(self, shas: Collection[str], *, dry_run: bool = False) -> int:
        """Drop the readings of these screenshots (every engine's, whole and incremental), as `datasets expire`
        removes their blobs; returns how many readings went from the database (or, with `dry_run`, would go)."""
        if not dry_run:
            with self._lock:
                for key in [k for k, (screen, _) in self._memory.items() if screen in shas]:
                    del self._memory[key]
        if self._db is None or not shas:
            return 0
        ordered, count = sorted(shas), 0
        with self._db.begin() as conn:
            for i in range(0, len(ordered), 500):  # under every database's limit of bound parameters
                chunk = ordered[i:i + 500]
                incremental = sa.select(ocr_screens.c.key).where(ocr_screens.c.sha256.in_(chunk))
                readings = ocr_results.c.sha256.in_(chunk) | ocr_results.c.sha256.in_(incremental)
                if dry_run:
                    count += conn.execute(sa.select(sa.func.count()).select_from(ocr_results).where(readings)
                                          ).scalar_one()
                else:
                    count += conn.execute(ocr_results.delete().where(readings)).rowcount
                    conn.execute(ocr_screens.delete().where(ocr_screens.c.sha256.in_(chunk)))
        return count

    def lines(self, png: bytes) -> tuple[str, ...]:
        """One line per text box, top to bottom: `"text" @ (x, y)` with the box centre in pixels."""
        boxes = sorted((line.box[1] + line.box[3] / 2, line.box[0] + line.box[2] / 2, line.text)
                       for line in self.read(png))
        return tuple(f'"{text}" @ ({round(x)}, {round(y)})' for y, x, text in boxes)

    def as_text(self, messages: list[Message]) -> list[Message]:
        """The messages with every image replaced by its OCR text (and accessibility tree)."""
        out: list[Message] = []
        index = 0
        for message in messages:
            parts: list[TextPart | ImagePart] = []
            for part in message.content:
                if isinstance(part, ImagePart):
                    index += 1
                    parts.append(self._render(part, index))
                else:
                    parts.append(part)
            out.append(Message(role=message.role, content=parts))
        return out

    def _render(self, image: ImagePart, index: int) -> TextPart:
        assert image.png is not None, "images are read from the blob store before rendering"
        text = [f'[Screenshot {index}, shown as OCR text: one line per text box, "text" @ (x, y) = its centre '
                "in pixels]"]
        text += list(self.lines(image.png)) or ["(no text found)"]
        if image.ax_tree:
            text += [f"[Accessibility tree of screenshot {index}]", image.ax_tree]
        return TextPart(text="\n".join(text))


class OcrSeries:
    """Screens read one after another, as a grounding shard reads its screens. With `incremental`, a screen
    that differs from one of the series' last INCREMENTAL_BASES screens in under INCREMENTAL_MAX_AREA of its
    area is read as that screen's lines away from the changes plus an OCR of the changed regions only
    (`llm.ocr_diff`); any other is read whole. Such a reading depends on the series' own earlier screens,
    which a stage's plan fixes, never on what else the process or the cache read before: it is kept under
    the engine id with `+diff` and a key naming the chain of screens it was read against (the screen's
    sha256 after its base's key; a whole read's key is its sha256), so a night reads its screens alike on
    threads and on Dask workers, with any cache."""

    def __init__(self, reader: OcrReader, incremental: bool) -> None:
        self.reader = reader
        self.incremental = incremental
        self._bases: deque[tuple[np.ndarray, tuple[OcrLine, ...], str]] = deque(maxlen=INCREMENTAL_BASES)
        """The last screens read: pixels, lines and key."""

    @property
    def engine_id(self) -> str:
        """Names what read the series' screens: the whole reads' engine, with `+diff` and the settings of the
        comparison when incremental. A reading against an earlier screen depends on the tiles and padding of
        `llm.ocr_diff`, and which earlier screen a screen is read against on INCREMENTAL_BASES and
        INCREMENTAL_MAX_AREA (grounding's rows with it): an upgrade that changes one reads such screens again."""
        whole = self.reader.engine_id
        if not self.incremental:
            return whole
        return f"{whole}+diff:t{ocr_diff.TILE}p{ocr_diff.PAD}b{INCREMENTAL_BASES}a{INCREMENTAL_MAX_AREA}"

    def read(self, png: bytes) -> tuple[OcrLine, ...]:
        """The screen's text lines, top to bottom."""
        if not self.incremental:
            return self.reader.read(png)
        reader, sha, rgb = self.reader, hashlib.sha256(png).hexdigest(), _rgb(png)
        base = self._closest(rgb)
        if base is None:
            lines, key = reader._whole(sha, lambda: rgb), sha  # decoded and hashed once
        else:
            kept, rects, base_key = base
            key = hashlib.sha256(f"{sha}<{base_key}".encode()).hexdigest()
            lines = reader._known(key, self.engine_id, sha)
            if lines is None:
                read: list[OcrLine] = []
                if rects:  # else its pixels are the earlier screen's (another file of it): no engine, no OCR run
                    with reader._engine() as engine:
                        read = [line for x0, y0, x1, y1 in rects
                                for line in shifted(engine(rgb[y0:y1, x0:x1]), x0, y0)]
                        reader._count(region=True)
                lines = reading_order([*kept, *read])
                reader._keep(key, self.engine_id, sha, lines)
        self._bases.append((rgb, lines, key))
        return lines

    def _closest(self, rgb: np.ndarray) -> tuple[tuple[OcrLine, ...], list[Rect], str] | None:
        """Of the earlier screens of its size, the one that leaves the least to read again: the lines kept from
        it, the regions to read and its key; None when every one leaves more than INCREMENTAL_MAX_AREA."""
        height, width = rgb.shape[:2]
        best: tuple[int, tuple[OcrLine, ...], list[Rect], str] | None = None
        for base, base_lines, base_key in self._bases:
            if base.shape == rgb.shape:
                kept, rects = regions(changed_tiles(base, rgb), base_lines, width, height)
                area = sum((x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in rects)
                if best is None or area < best[0]:
                    best = (area, kept, rects, base_key)
        if best is None or best[0] > INCREMENTAL_MAX_AREA * width * height:
            return None
        return best[1], best[2], best[3]


_readers: dict[tuple[Any, ...], OcrReader] = {}
_readers_lock = threading.Lock()


def reader_for(settings: SynthSettings | None = None, db_url: str | None = None) -> OcrReader:
    """The process's one reader for a backend configuration and database (`synth.ocr_cache_url`, else `db_url`,
    the catalog's): its memory and engine are shared by the gateway, the critics and the synthesis stages."""
    cfg = settings or SynthSettings()
    if cfg.ocr_cache_url is not None:
        db_url = cfg.ocr_cache_url.get_secret_value()
    key = (cfg.ocr_backend, cfg.paddle_det_dir, cfg.paddle_rec_dir, db_url)
    with _readers_lock:
        if key not in _readers:
            _readers[key] = OcrReader(cfg.ocr_backend, db_url=db_url, paddle_det_dir=cfg.paddle_det_dir,
                                      paddle_rec_dir=cfg.paddle_rec_dir)
        return _readers[key]


def observation_mode(messages: list[Message], sees_images: bool) -> ObservationMode:
    """How the model observes the screen in this call; every call record says so."""
    images = [image for m in messages for image in m.images]
    if not images:
        return "text"
    if sees_images:
        return "image"
    return "ocr+ax" if any(image.ax_tree for image in images) else "ocr"

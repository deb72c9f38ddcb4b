"""OCR of a night's screens: every screen read whole against reading only what changed (synth.ocr_incremental).

The screens are a replay night's (reference-replay policy, rule critics, template writers: no model), in
the shards and the order the grounding stage reads them (an OCR series per shard, page by page). The
readers run in this process, memory only, on the same PNGs: every screen whole with rapidocr's own
settings and with the configured ones (which remember text lines read before: `LineMemo`), then
incrementally. Agreement: of the whole reads' lines, words and characters, the share the incremental read
also has with the same text and a box overlapping it at IoU 0.5 or more.

    python benchmarks/ocr_bench.py [--warehouse DIR] [--apps shop] [--queries 2]

Without --warehouse it runs the night first (about two minutes on 2 cores) in a temporary folder, removed at the
end. Prints a table; never asserts.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image
from rapidocr import RapidOCR

from trajforge.llm.ocr import OcrLine, OcrReader, OcrSpan
from trajforge.llm.workspace import Workspace
from trajforge.schemas.config import Settings, SynthSettings, WarehouseSettings
from trajforge.synth.grounding import STAGE, load_screens, reading_order
from trajforge.synth.regions import iou

sys.path.insert(0, str(Path(__file__).parent))
from factory_bench import CONFIG, night  # the factory bench's night, not a copy


def read_all(reader: OcrReader, shards: list[list[bytes]], incremental: bool
             ) -> tuple[float, list[tuple[OcrLine, ...]]]:
    """Every screen read as grounding reads them: a series per shard."""
    reader.read(blank(shards[-1][-1]))  # load the models outside the timing, on a screen with no text (so
    reader.engine_runs = reader.region_reads = 0  # no reading nor text line is remembered from it)
    start = time.perf_counter()
    out = []
    for shard in shards:
        series = reader.series(incremental)
        out += [series.read(png) for png in shard]
    return time.perf_counter() - start, out


def blank(png: bytes) -> bytes:
    """A white PNG of the screen's size."""
    with Image.open(io.BytesIO(png)) as image:
        out = io.BytesIO()
        Image.new("RGB", image.size, "white").save(out, format="PNG")
    return out.getvalue()


def agreement(whole: list[OcrSpan] | list[OcrLine], part: list[OcrSpan] | list[OcrLine]) -> tuple[int, int]:
    """(matched, total) of `whole`'s spans found in `part` with the same text at IoU >= 0.5."""
    matched = sum(any(p.text == w.text and iou(p.box, w.box) >= 0.5 for p in part) for w in whole)
    return matched, len(whole)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warehouse", type=Path, help="A warehouse whose steps to read (default: run a night).")
    parser.add_argument("--apps", default="shop")
    parser.add_argument("--queries", type=int, default=2)
    args = parser.parse_args()
    warehouse, scratch = args.warehouse, None
    if warehouse is None:
        scratch = Path(tempfile.mkdtemp(prefix="ocr-bench-"))
        warehouse = scratch / "night/data/warehouse"
        night(scratch / "night", CONFIG.format(apps=", ".join(args.apps.split(",")), queries=args.queries),
              WarehouseSettings(path=warehouse))
    ws = Workspace.open(Settings(warehouse=WarehouseSettings(path=warehouse)))
    units = sorted(load_screens(ws, None).units, key=STAGE.key)  # as the stage's plan shards them
    size = SynthSettings().screens_per_shard
    shards = [reading_order(units[first : first + size]) for first in range(0, len(units), size)]
    pngs = [[ws.blobs.get(screen.screenshot) for screen in shard] for shard in shards]
    count = len(units)
    print(f"{count} distinct screens in {len(shards)} shards from {warehouse}")

    stock = OcrReader()
    with stock._engine() as engine:  # the reader's one engine, given rapidocr's own settings: the baseline
        engine.engine = RapidOCR(params={"Global.log_level": "error"})
    stock_s, stock_lines = read_all(stock, pngs, incremental=False)
    whole_reader = OcrReader()
    whole_s, whole = read_all(whole_reader, pngs, incremental=False)
    diff_reader = OcrReader()
    diff_s, diff = read_all(diff_reader, pngs, incremental=True)

    print("\n| reader | s per screen | screens read in part | time against rapidocr's defaults | "
          "lines / words / characters as the whole read has them |")
    print("| --- | --- | --- | --- | --- |")
    readers = (("whole, rapidocr's default settings", stock_s, stock_lines, 0),
               ("whole (the default)", whole_s, whole, 0),
               ("incremental (synth.ocr_incremental: true)", diff_s, diff, diff_reader.region_reads))
    for name, seconds, lines, part in readers:
        shares = []
        for pick in (lambda ls: list(ls), lambda ls: [s for line in ls for s in line.words],
                     lambda ls: [s for line in ls for s in line.chars]):
            matched = [agreement(pick(w), pick(d)) for w, d in zip(whole, lines, strict=True)]
            shares.append(f"{sum(m for m, _ in matched) / max(sum(t for _, t in matched), 1):.3f}")
        print(f"| {name} | {seconds / count:.3f} | {part} of {count} | {seconds / stock_s:.2f} | "
              f"{' / '.join(shares)} |")
    memo = whole_reader.line_memo
    print(f"\nwhole reads as configured: {memo.remembered} of {memo.recognised + memo.remembered} text lines "
          "the same to the pixel as one read before, not recognised again (llm.ocr.LineMemo)")
    print("agreement: of the whole read's lines, words and characters, the share found with the same text at "
          "IoU >= 0.5")
    if scratch is not None:  # a night that failed exits before this: its folder stays, named in the message
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

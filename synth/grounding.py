"""Grounding data from recorded screens (paper 2.2.2, Figure 5): elements, words, characters and regions.

The environment is the teacher here, so no capable agent is needed: every distinct screen a
run recorded (reference replays and rollouts alike, before each step and after the last),
and every page query generation saw while exploring the live apps (`pages`), gives rows
of four kinds, each a point to click for an instruction:

- **element**: a node of the accessibility tree recorded with the screenshot: its box, role
  and name, a functional description, and a template request ("Click the 'Send' button").
  Up to `synth.rephrase_per_shard` requests per shard are rephrased by the model into what a
  user would ask; a rephrasing that loses the element's name keeps the template
  (`instruction_mode: fallback`). With `synth.vision_model` the model also describes the
  element's appearance and place (`description_mode: vision`).
- **word** and **char**: the OCR's word and character boxes (`llm.ocr`, read once per
  screenshot per warehouse, shared with the critics). A character is asked for by its place in
  its line's text, spaces counted; the OCR boxes no space, so a line whose boxes do not read its
  text character for character makes no char row.
- **region**: dense regions (segment-anything's masks with `synth.sam_checkpoint`, else
  contours of the image: `synth.regions`); the model names what `synth.regions_per_shard` of
  them per shard hold.

Elements are dropped, each with its reason, when they have no box, no area, lie (partly)
outside the screenshot, have no name to ask for, are containers rather than things a user
points at, or were painted over when recorded (`[covered]` in the tree). A request two things on
the screen answer is not asked: elements shown with the same role and name (two "Add to cart"
buttons), words whose text repeats on the screen, and characters of a line whose text does are
dropped, all of them, rather than one guessed. Then IoU cleaning
(tau_g = `synth.iou_threshold`): each element's box is compared with an independent
detection, the OCR's words inside it for text, the better of that and the region proposals
for widgets, and dropped below tau_g; the first examples' boxes are kept in the lineage. A text
element (a heading, a paragraph) whose block is wider than its text, as a full-width heading's is,
fails that test while it is drawn right where the tree says: it is kept when the OCR's words inside
its block read its name (detector `ocr-name`), with the text's extent as its box, so its point is on
the text and not on the empty end of its block.

Screens already grounded by an earlier run with the same configuration (the stage's prompts as
their files read, the code version and the OCR engine included) are skipped, so a
rerun with nothing new asks no model and reads no new OCR; a screen grounded again with another
configuration replaces its earlier rows in both tables (`StageDef.replaces`). Coordinates follow `synth.chat`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
from pydantic import BaseModel
from rapidfuzz import fuzz

from trajforge.data.blobs import BlobCorrupted, BlobMissing
from trajforge.envs import actions
from trajforge.envs.axtree import AXNode, parse
from trajforge.llm import GatewayError, ImagePart, load_prompt
from trajforge.llm.ocr import OcrLine, OcrSpan
from trajforge.llm.workspace import Workspace, code_version
from trajforge.rollout.gui_owl import FUNCTIONS, to_call
from trajforge.schemas.config import SynthSettings
from trajforge.schemas.ids import digest, short_id
from trajforge.schemas.records import GroundingChat, GroundingSample
from trajforge.schemas.stage import Inputs, StageDef, StageOutput, config_hash
from trajforge.synth.chat import centre, chat_sample
from trajforge.synth.regions import Region, iou, propose

PROMPTS = Path(__file__).parent / "prompts"
REPHRASE, DESCRIBE, REGION = "grounding_rephrase", "grounding_describe", "grounding_region"
SECTIONS = ("synth", "llm")
TURNS_PER_SAMPLE = 16
"""Questions per training row: one copy of the screenshot serves them all."""
IOU_EXAMPLES = 10
"""IoU drops per shard whose two boxes are written into the lineage's stats (the rest are counted)."""
NAME_READ = 80.0
"""The least similarity (rapidfuzz's ratio, 0-100, spaces and case ignored) of the OCR's words inside a text
element's block to its name for the words to be that element's text: one misread letter in six passes
("Dishes" read "Dishe5": 83), another word does not ("Cart" for "Card": 75)."""

TEXT_ROLES = {"text", "heading", "paragraph", "label", "caption", "code", "emphasis", "strong"}
WIDGET_ROLES = {"button", "link", "textbox", "searchbox", "combobox", "checkbox", "radio", "switch", "tab", "menuitem",
                "menuitemcheckbox", "menuitemradio", "option", "slider", "spinbutton", "treeitem", "img", "image",
                "listbox", "menubutton", "cell", "gridcell", "columnheader", "rowheader"}
"""Roles a user points at."""
NAMED_REGION_ROLES = {"toolbar", "menubar", "menu", "dialog", "alertdialog", "group", "navigation", "form", "search",
                      "region", "tablist", "tabpanel", "list", "listitem", "article", "table", "figure"}
"""Containers a user can point at when they have a name ("the formatting toolbar"); unnamed ones, and the page and
its banner, main and footer landmarks, are not grounding targets."""


# ---------------------------------------------------------------- one screen, no model


@dataclass(frozen=True)
class Screen:
    """A distinct screenshot of the run, with what was recorded beside it."""

    screenshot: str
    width: int
    height: int
    app: str
    url: str
    title: str
    step_id: str | None
    """A step that showed it; None for a page query generation saw."""
    viewport: str
    ax_tree: str


@dataclass
class Grounded:
    """One screen's rows before the model: kept rows, and what was dropped and counted."""

    rows: list[GroundingSample] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    iou_drops: list[str] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    lines: tuple[OcrLine, ...] = ()


def _short(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[: limit - 1].rstrip() + "…"


def describe(node: AXNode) -> tuple[str, str]:
    """A functional description of an element and a template request for it, from its role and name."""
    role, name = node.role, _short(node.name)
    state = next((s for s in node.states if s in ("checked", "selected", "expanded", "disabled")), None)
    if role == "link":
        return f"A link '{name}' that opens what it names.", f"Open '{name}'"
    if role in ("textbox", "searchbox", "combobox", "spinbutton"):
        holding = f", now holding '{_short(node.value, 30)}'" if node.value else ", empty"
        return f"A {role} '{name}' to type into{holding}.", f"Click the '{name}' field to type in it"
    if role in ("radio", "menuitemradio"):  # clicking a selected one leaves it selected: there is no "off"
        now = "selected" if state in ("checked", "selected") else "not selected"
        return f"A {role} '{name}', now {now}, that selects its option.", f"Select '{name}'"
    if role in ("checkbox", "switch", "menuitemcheckbox"):
        now = "on" if state in ("checked", "selected") else "off"
        turn = "off" if now == "on" else "on"
        return f"A {role} '{name}', now {now}, that switches its setting.", f"Turn '{name}' {turn}"
    if role in ("tab", "option", "treeitem"):
        return f"A {role} '{name}' that selects what it names.", f"Select the '{name}' {role}"
    if role in ("img", "image"):
        return f"An image of {name}.", f"Point at the image of {name}"
    if role in NAMED_REGION_ROLES:
        return f"The {role} '{name}', which groups what it holds.", f"Point at the '{name}' {role}"
    if role == "heading":
        return f"The heading '{name}', which titles a section of the page.", f"Point at the heading '{name}'"
    if role in TEXT_ROLES:
        return f"The text '{name}'.", f"Point at the text '{name}'"
    return f"A {role} '{name}' that does what its label says when clicked.", f"Click the '{name}' {role}"


def _element_problem(node: AXNode, width: int, height: int) -> str | None:
    """Why an element makes no grounding row; None when it does."""
    if node.box is None:
        return "element: no box (no layout)"
    x, y, w, h = node.box
    if w <= 0 or h <= 0:
        return "element: zero area"
    if x + w <= 0 or y + h <= 0 or x >= width or y >= height:
        return "element: off screen"
    if x < 0 or y < 0 or x + w > width or y + h > height:
        return "element: partly off screen (its box is not what the screenshot shows)"
    if node.role in NAMED_REGION_ROLES and not node.name.strip():
        return f"element: an unnamed container ({node.role}), not something a user points at"
    if node.role not in WIDGET_ROLES | TEXT_ROLES | NAMED_REGION_ROLES:
        return f"element: a container ({node.role}), not something a user points at"
    if not node.name.strip():
        return "element: invisible to a request (no accessible name)"
    if w < 4 or h < 4:
        return "element: too small to see (under 4 px)"
    if "covered" in node.states:
        return "element: covered by another element when recorded"
    if "disabled" in node.states:
        return "element: disabled"
    return None


def _visible(node: AXNode, width: int, height: int) -> bool:
    """Whether the screenshot shows the element (a box with area on the screen, not painted over): one a request
    could mean, even when it makes no row itself (disabled, or failing the IoU test)."""
    if node.box is None or "covered" in node.states:
        return False
    x, y, w, h = node.box
    return w > 0 and h > 0 and x + w > 0 and y + h > 0 and x < width and y < height


def _request_key(node: AXNode) -> str:
    """What the element's template request says, whatever the element's state (a checkbox's "Turn 'X' on" and
    "Turn 'X' off" mean one checkbox): two elements shown with one key are one request with two answers."""
    return describe(AXNode(0, node.role, node.name))[1].casefold()


def _char_positions(line: OcrLine) -> tuple[int, ...]:
    """Where each of the line's character boxes is in its text: the OCR gives one box per character that is not
    whitespace, so the n-th box is the n-th such character of the text, not its n-th character ("t" is box 4 of
    "Add to cart" and character 5). Empty where the boxes do not read the text character for character: then no
    box can be placed."""
    positions = tuple(i for i, c in enumerate(line.text) if not c.isspace())
    return positions if [c.text for c in line.chars] == [line.text[i] for i in positions] else ()


def _ocr_words(box: tuple[float, ...], lines: tuple[OcrLine, ...]) -> list[OcrSpan | OcrLine]:
    """The OCR words whose centres lie in `box`, in reading order (a line without word boxes counts whole)."""
    x, y, w, h = box
    inside: list[OcrSpan | OcrLine] = []
    for line in lines:
        for span in line.words or (line,):
            cx, cy = span.box[0] + span.box[2] / 2, span.box[1] + span.box[3] / 2
            if x <= cx <= x + w and y <= cy <= y + h:
                inside.append(span)
    return inside


def _union(spans: list[OcrSpan | OcrLine]) -> tuple[float, float, float, float]:
    x0, y0 = min(s.box[0] for s in spans), min(s.box[1] for s in spans)
    return (x0, y0, max(s.box[0] + s.box[2] for s in spans) - x0, max(s.box[1] + s.box[3] for s in spans) - y0)


def _name_read(node: AXNode, words: list[OcrSpan | OcrLine]) -> tuple[float, float, float, float] | None:
    """A text element's text as drawn: the extent of the OCR's `words` inside its box when together they read
    its name (NAME_READ), else None."""
    if node.role not in TEXT_ROLES or not words:
        return None
    read, name = ("".join(text.split()).casefold() for text in ("".join(w.text for w in words), node.name))
    return _union(words) if fuzz.ratio(read, name) >= NAME_READ else None


def _detect(node: AXNode, words: list[OcrSpan | OcrLine], regions: list[Region]) -> tuple[str | None, float, tuple]:
    """The independent detection that agrees best with the element's box, given the OCR's words inside it:
    (detector, IoU, its box)."""
    box = node.box
    assert box is not None
    found: list[tuple[str, float, tuple]] = []
    if words:
        text = _union(words)
        found.append(("ocr", iou(box, text), text))
    if node.role not in TEXT_ROLES and regions:
        best = max(regions, key=lambda r: iou(box, r.box))
        found.append((best.source, iou(box, best.box), best.box))
    if not found:
        return None, 0.0, ()
    return max(found, key=lambda f: f[1])


def ground_screen(screen: Screen, png: bytes, lines: tuple[OcrLine, ...], regions: list[Region], *, run_id: str,
                  iou_threshold: float) -> Grounded:
    """Element, word and character rows of one screen, cleaned; no model (the benchmark's path)."""
    out = Grounded(regions=regions, lines=lines)
    base = dict(run_id=run_id, screenshot=screen.screenshot, width=screen.width, height=screen.height, app=screen.app,
                url=screen.url, step_id=screen.step_id)
    try:
        nodes = parse(screen.ax_tree)
    except ValueError as exc:
        out.dropped[f"screen: accessibility tree does not parse ({exc})"[:200]] += 1
        nodes = []
    # A request two things on the screen answer is a guess: such elements, words and lines make no row.
    requests = Counter(_request_key(n) for n in nodes if n.name.strip() and _visible(n, screen.width, screen.height))
    word_count = Counter(w.text.casefold() for line in lines for w in line.words)
    line_count = Counter(_short(line.text).casefold() for line in lines)
    for i, node in enumerate(nodes):
        if (problem := _element_problem(node, screen.width, screen.height)) is not None:
            out.dropped[problem] += 1
            continue
        if requests[_request_key(node)] > 1:
            out.dropped["element: not unique on the screen (another element shown is asked for by the same role "
                        "and name)"] += 1
            continue
        words = _ocr_words(node.box, lines)  # type: ignore[arg-type]
        detector, overlap, detected = _detect(node, words, regions)
        box = [float(v) for v in node.box]  # type: ignore[union-attr]
        if overlap < iou_threshold and (text_box := _name_read(node, words)) is not None:
            detector, box = "ocr-name", [float(v) for v in text_box]
            out.stats["element: its block wider than its text, kept as its text (its name read by the OCR)"] += 1
        elif overlap < iou_threshold:
            out.dropped[f"element: IoU with its detection below tau_g={iou_threshold}"] += 1
            if len(out.iou_drops) < IOU_EXAMPLES:
                out.iou_drops.append(f"{node.role} '{_short(node.name, 30)}' box {list(node.box)} vs "
                                     f"{detector or 'no detection'} {[round(v) for v in detected]} iou {overlap:.2f}")
            continue
        description, template = describe(node)
        out.rows.append(GroundingSample(
            **base, sample_id=short_id(screen.screenshot, "element", str(i), node.role, node.name), kind="element",
            box=box, point=centre(box), role=node.role, name=node.name, description=description,
            instruction=template, instruction_mode="template", description_mode="ax", detector=detector,
            iou=round(overlap, 3)))
    for li, line in enumerate(lines):
        positions = _char_positions(line)
        for kind, spans in (("word", line.words), ("char", line.chars)):
            if kind == "char" and line_count[_short(line.text).casefold()] > 1:
                out.dropped["char: its line's text is not unique on the screen"] += len(spans)
                continue
            if kind == "char" and len(positions) != len(spans):  # a request naming a guessed position is wrong
                out.dropped["char: its boxes do not read its line's text character for character"] += len(spans)
                continue
            for si, span in enumerate(spans):
                if kind == "word" and word_count[span.text.casefold()] > 1:
                    out.dropped["word: its text is not unique on the screen"] += 1
                    continue
                x, y, w, h = span.box
                if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > screen.width or y + h > screen.height:
                    out.dropped[f"{kind}: box outside the screen or without area"] += 1
                    continue
                if kind == "word":
                    description, instruction = f"The word '{span.text}' in '{_short(line.text)}'.", \
                        f"Click the word '{span.text}'"
                else:
                    at = positions[si] + 1
                    description = f"Character {at} of the text '{_short(line.text)}'."
                    instruction = f"Point at the character '{span.text}' (character {at} of '{_short(line.text)}')"
                box = [float(v) for v in span.box]
                out.rows.append(GroundingSample(
                    **base, sample_id=short_id(screen.screenshot, kind, str(li), str(si)), kind=kind, box=box,
                    point=centre(box), text=span.text, description=description, instruction=instruction,
                    instruction_mode="template", description_mode="ocr", detector="ocr"))
    out.stats["screens grounded"] += 1
    return out


# ---------------------------------------------------------------- the model's part


class Described(BaseModel):
    description: str
    instruction: str


MAX_LABEL_WORDS = 8
"""A region's name is a few words; a longer answer is a small model talking, not a name."""


def one_line(text: str) -> str:
    """The answer's first non-empty line, unquoted: what a text-format prompt asks for."""
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    return line.strip().strip('"\'').strip()


class _Asker:
    """The shard's model calls, within its budgets; each failure counted, never guessed."""

    def __init__(self, ws: Workspace, out: StageOutput) -> None:
        cfg: SynthSettings = ws.settings.synth
        self.ws, self.out, self.cfg = ws, out, cfg
        asks = cfg.writer == "model"
        self.rephrase_left, self.regions_left = cfg.rephrase_per_shard * asks, cfg.regions_per_shard * asks
        self.vision = cfg.vision_model is not None
        self.prompts = {name: load_prompt(name, PROMPTS) for name in (REPHRASE, DESCRIBE, REGION)}

    def _ask(self, template: str, schema: type[BaseModel] | None, model: str | None, /, **variables: object
             ) -> BaseModel | str | None:
        """The parsed answer (a text-format prompt's: its first line), or None, counted."""
        prompt = self.prompts[template]
        try:
            result = self.ws.gateway.chat_sync(prompt.render(**variables), model=model, schema=schema)
        except GatewayError as exc:
            self.out.stats[f"{template}: no answer ({exc.record.error})"[:160]] += 1
            return None
        self.out.models[template] = result.record.model_id
        self.out.prompts[template] = prompt.version
        answer = one_line(result.text) if schema is None else result.parsed
        if not answer:
            self.out.stats[f"{template}: answer did not parse or was empty"] += 1
        return answer or None

    def element(self, row: GroundingSample, screen: Screen) -> GroundingSample:
        """The row with a model-written request (and, with a vision model, description), or as it was."""
        if self.rephrase_left <= 0:
            return row
        self.rephrase_left -= 1
        if self.vision:
            answer = self._ask(DESCRIBE, Described, self.cfg.vision_model, role=row.role, name=row.name,
                               description=row.description, box=[round(v) for v in row.box],
                               screenshots=[ImagePart(sha256=screen.screenshot)])
            prompt = DESCRIBE
        else:
            answer = self._ask(REPHRASE, None, self.cfg.model, page=screen.title or screen.url, role=row.role,
                               name=row.name, description=row.description, template=row.instruction)
            prompt = REPHRASE
        if answer is None:
            self.out.stats["element requests kept as the template: the model's answer was unusable"] += 1
            return row
        update: dict[str, object] = {"model_id": self.out.models[prompt],
                                     "prompt_version": f"{prompt}@{self.prompts[prompt].version}"}
        if isinstance(answer, Described) and answer.description.strip():
            update |= {"description": answer.description.strip(), "description_mode": "vision"}
        instruction = answer.instruction.strip() if isinstance(answer, Described) else str(answer)
        if row.name and row.name.casefold() in instruction.casefold():
            update |= {"instruction": instruction, "instruction_mode": "model"}
            self.out.stats["element requests rephrased by the model"] += 1
        else:
            update |= {"instruction_mode": "fallback"}
            self.out.stats["element requests: the rephrasing lost the element's name, template kept"] += 1
        return row.model_copy(update=update)

    def region(self, region: Region, index: int, screen: Screen, grounded: Grounded, run_id: str
               ) -> GroundingSample | None:
        """A row naming what the region holds, or None (budget spent, or an answer that does not parse)."""
        if self.regions_left <= 0:
            return None
        self.regions_left -= 1
        x, y, w, h = region.box
        texts = [line.text for line in grounded.lines
                 if x <= line.box[0] + line.box[2] / 2 <= x + w and y <= line.box[1] + line.box[3] / 2 <= y + h]
        elements = [f"{r.role} '{r.name}'" for r in grounded.rows
                    if r.kind == "element" and x <= r.point[0] <= x + w and y <= r.point[1] <= y + h]
        answer = self._ask(REGION, None, self.cfg.model, page=screen.title or screen.url,
                           box=[round(v) for v in region.box], texts=json.dumps(texts[:20]),
                           elements=json.dumps(elements[:20]))
        if not isinstance(answer, str):
            self.out.dropped["region: the model gave no name"] += 1
            return None
        if len(answer.split()) > MAX_LABEL_WORDS:
            self.out.dropped[f"region: the answer is not a name (over {MAX_LABEL_WORDS} words)"] += 1
            return None
        label = answer.rstrip(".")
        box = [float(v) for v in region.box]
        return GroundingSample(
            run_id=run_id, sample_id=short_id(screen.screenshot, "region", str(index)), screenshot=screen.screenshot,
            width=screen.width, height=screen.height, app=screen.app, url=screen.url, step_id=screen.step_id,
            kind="region", box=box, point=centre(box), text=label,
            description=f"A region of the screen holding {label}.", instruction=f"Point at {label}",
            instruction_mode="model", description_mode="region", detector=region.source, iou=None,
            model_id=self.out.models[REGION], prompt_version=f"{REGION}@{self.prompts[REGION].version}")


# ---------------------------------------------------------------- training rows


def training_rows(rows: list[GroundingSample], screen: Screen, png: bytes, *, run_id: str, tag: str
                  ) -> list[GroundingChat]:
    """One chat sample per kind and up to TURNS_PER_SAMPLE questions of one screen; the answer to each is the
    policy's own click call at the row's point."""
    space = actions.space_for(screen.viewport)
    function = FUNCTIONS[space]
    system = (f"You are a GUI agent grounding requests on a {screen.width}x{screen.height} screenshot. Answer each "
              f"request with one <tool_call> of `{function}` that clicks where the request means; coordinates are "
              "pixels of the screenshot, x to the right and y down from its top-left corner.")
    samples = []
    for kind in ("element", "word", "char", "region"):
        mine = [r for r in rows if r.kind == kind]
        for start in range(0, len(mine), TURNS_PER_SAMPLE):
            chunk = mine[start : start + TURNS_PER_SAMPLE]
            turns = [(r.instruction, "<tool_call>\n" + json.dumps(to_call(
                {"type": "click", "x": int(r.point[0]), "y": int(r.point[1])}, function)) + "\n</tool_call>")
                for r in chunk]
            samples.append(chat_sample(
                GroundingChat, run_id=run_id, sample_id=short_id(run_id, screen.screenshot, kind, str(start)),
                source_id=",".join(r.sample_id for r in chunk), system=system, turns=turns, images=[png], tag=tag,
                screenshot=screen.screenshot))
    return samples


# ---------------------------------------------------------------- the stage


def reading_order(screens: list[Screen]) -> list[Screen]:
    """A shard's screens (the plan orders them by hash) page by page: an incremental OCR series reads a screen
    against the earlier ones, and the same page's states differ least. The order depends on the shard alone, so
    the readings are alike on any runner."""
    return sorted(screens, key=lambda s: (s.app, s.viewport, s.url or "", s.screenshot))


def ground(screens: list[Screen], ws: Workspace, run_id: str, _: str) -> StageOutput:
    """Grounding rows and their training samples for one shard of screens."""
    cfg = ws.settings.synth
    out = StageOutput(rows={"grounding": [], "train_grounding": []}, models={}, prompts={})
    asker = _Asker(ws, out)
    tag = ws.run_tag(run_id)
    iou_drops: list[str] = []
    ocr = ws.ocr.series(cfg.ocr_incremental)
    for screen in reading_order(screens):
        try:
            png = ws.blobs.get(screen.screenshot)
        except (BlobMissing, BlobCorrupted) as exc:
            out.dropped[f"screen: screenshot blob {type(exc).__name__}"] += 1
            continue
        regions = propose(png, sam_checkpoint=cfg.sam_checkpoint, model_type=cfg.sam_model_type)
        grounded = ground_screen(screen, png, ocr.read(png), regions, run_id=run_id,
                                 iou_threshold=cfg.iou_threshold)
        out.dropped.update(grounded.dropped)
        out.stats.update(grounded.stats)
        iou_drops += grounded.iou_drops
        rows = [asker.element(r, screen) if r.kind == "element" else r for r in grounded.rows]
        rows += [row for i, region in enumerate(regions)
                 if (row := asker.region(region, i, screen, grounded, run_id)) is not None]
        for row in rows:
            out.stats[f"{row.kind} rows"] += 1
        out.rows["grounding"] += rows
        out.rows["train_grounding"] += training_rows(rows, screen, png, run_id=run_id, tag=tag)
    for example in iou_drops[:IOU_EXAMPLES]:  # both boxes of the first few, for a person checking tau_g
        out.stats[f"IoU drop example: {example}"] += 1
    out.models["ocr"] = ocr.engine_id
    out.models["regions"] = "sam:" + cfg.sam_model_type if cfg.sam_checkpoint else "opencv-contours"
    return out


def prompt_fingerprint(ws: Workspace) -> str:
    """What the rows depend on beyond the config: the stage's prompts (each by version and by a digest of its file,
    so an edit that does not bump `version:` counts too), the code version and the OCR engine. Any of them changed
    is new work: the screens are grounded again (the OCR and response caches still answer what did not change)."""
    prompts = [load_prompt(name, PROMPTS) for name in (REPHRASE, DESCRIBE, REGION)]
    versions = ",".join(f"{p.name}@{p.version}:{digest(p.path.read_bytes(), 12)}" for p in prompts)
    return f"{versions},code={code_version()},{ws.ocr.series(ws.settings.synth.ocr_incremental).engine_id}"


def _grounded_before(ws: Workspace, this_config: str) -> set[str]:
    """Screenshots an earlier version of `grounding` grounded with the same configuration (its runs whose stage
    committed: `Ledger.committed_runs`)."""
    if "grounding" not in ws.catalog.tables():
        return set()
    runs = {info.lineage.run_id for info in ws.catalog.history("grounding")
            if info.lineage is not None and info.lineage.config_hash == this_config}
    runs &= ws.ledger.committed_runs("grounding")
    if not runs:
        return set()
    frame = ws.catalog.scan("grounding").select("run_id", "screenshot").filter(pl.col("run_id").is_in(list(runs)))
    return set(frame.collect()["screenshot"])


def load_screens(ws: Workspace, snapshot: int | None) -> Inputs[Screen]:
    """The distinct screens of the steps a run wrote (before each step, and after each episode's last), and of
    the pages query generation saw on the live apps (`pages@latest`, its current set). Their episodes' app and
    viewport come from `episodes@latest`, read at the version named in the lineage."""
    steps, snapshot = ws.catalog.rows_added("steps", snapshot)
    read = ws.catalog.latest_versions("episodes")
    episodes = (ws.catalog.scan("episodes", read.get("episodes")).select("episode_id", "app", "viewport")
                .filter(pl.col("episode_id").is_in(steps["episode_id"].unique().to_list())).collect())
    about = {r["episode_id"]: (r["app"], r["viewport"]) for r in episodes.to_dicts()}
    screens: dict[str, Screen] = {}
    stats: Counter[str] = Counter()
    for s in steps.sort("episode_id", "step_index").to_dicts():
        app, viewport = about.get(s["episode_id"], ("unknown", "mobile"))
        shots = [(s["screenshot_before"], s["url_before"], s["title_before"], s["ax_tree_before"])]
        if s["ax_tree_after"] is not None:
            shots.append((s["screenshot_after"], s["url_after"], s["title_after"], s["ax_tree_after"]))
        for sha, url, title, tree in shots:
            if sha not in screens:
                screens[sha] = Screen(sha, s["width"], s["height"], app, url, title, s["step_id"], viewport, tree)
    snapshots = {"steps": snapshot} | read
    if "pages" in ws.catalog.tables():
        pages, pages_snapshot = ws.catalog.latest("pages")
        if pages_snapshot is not None:
            snapshots["pages"] = pages_snapshot
        for p in pages.to_dicts():
            if p["screenshot"] not in screens:
                screens[p["screenshot"]] = Screen(p["screenshot"], p["width"], p["height"], p["app"], p["url"],
                                                  p["title"], None, p["viewport"], p["ax_tree"])
                stats["screens from the pages query generation saw"] += 1
    fingerprint = prompt_fingerprint(ws)
    this_config = config_hash(ws.settings, SECTIONS, fingerprint)
    done = _grounded_before(ws, this_config)
    units = [screen for sha, screen in screens.items() if sha not in done]
    if done & set(screens):
        stats["screens already grounded with this configuration by an earlier run"] = len(done & set(screens))
    return Inputs(units=units, snapshots=snapshots, fingerprint=fingerprint, stats=stats)


STAGE = StageDef[Workspace, Screen](
    name="grounding",
    key=lambda s: s.screenshot,
    reads="steps",
    writes={"grounding": "append", "train_grounding": "append"},
    # A screen grounded again (another configuration or prompt version) takes its earlier rows out of both
    # tables in the commit that adds its new ones: `grounding@latest` holds each screen's newest rows once.
    replaces=("screenshot", lambda s: s.screenshot),
    sections=SECTIONS,
    load=load_screens,
    run=ground,
    shard_size=lambda s: s.synth.screens_per_shard,
    # OCR is most of a shard, on one thread an engine (llm.ocr._RAPID_PARAMS): two shards at once read a night's
    # screens in about 0.75 of the time one at a time does on 2 cores
    workers=lambda s: s.runner.workers,
)

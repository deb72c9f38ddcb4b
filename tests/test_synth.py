"""The synthesis stages on one recorded run: grounding, action semantics, reasoning and planning.

One module-scoped warehouse: the notes app's queries and their reference demonstrations
(real browser, real app, real OCR), then each stage run through the runner with a model
endpoint scripted at the edge (a remote server's answers are the one thing we do not own).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import prompt_version, prompt_versions
from PIL import Image
from scripted import ScriptedServer, completion, message_text, notes_workspace
from starlette.requests import Request
from starlette.responses import Response

from trajforge.critics.annotate import POINT_COLOR, annotate
from trajforge.data.catalog import Lineage, commit_key
from trajforge.envs.axtree import AXNode, render
from trajforge.envs.kinds import kind_for
from trajforge.guidance.reference import STAGE as REFERENCE
from trajforge.llm import workspace as llm_workspace
from trajforge.llm.ocr import OcrLine, OcrReader, OcrSpan
from trajforge.llm.workspace import Workspace, code_version
from trajforge.query_gen.stage import STAGE as QUERY_GEN
from trajforge.rollout.gui_owl import to_call
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Query, Step
from trajforge.schemas.stage import StageOutput, config_hash
from trajforge.synth import grounding, planning, reasoning, semantics
from trajforge.synth.chat import policy_messages
from trajforge.tasks.runner import run_inline

pytestmark = pytest.mark.browser


VOTES = {0: ("should open the next page", True, 0.6), 1: ("should open the note it names", True, 0.9),
         2: ("should close the app", False, 0.95), 3: ("should show the note", True, 0.7)}
"""Per description seed: the effect the scripted describer writes, and the check's (consistent, score) of it. The
best-scored vote is inconsistent, and the first and last consistent ones score lower than seed 1's, the one to keep."""


class ModelServer(ScriptedServer):
    """An OpenAI-compatible endpoint whose answer depends on the prompt, as a real model's does."""

    def __init__(self) -> None:
        super().__init__()
        self.broken: set[str] = set()  # prompt names whose answers come back unparsable
        self.truth: dict[tuple[str, int, int], dict[str, Any]] = {}  # (task, width, step) -> the demonstrated action

    def answer(self, system: str, user: str, seed: int | None) -> str:
        if "rewrite requests" in system:
            name = re.search(r'Element: \S+ "(.*)"', user).group(1)
            return "\n" if "rephrase" in self.broken else f"I need {name} now\nAnd more."
        if "rectangular region" in system:
            return "This region is a part of the screen that holds many things" if "region" in self.broken \
                else "the top bar."
        if "describe one action" in system:  # each seed its own effect, as a sampled model's answers differ
            target = re.search(r"on \S+ '(.*)'", user)
            return f"Clicks '{target.group(1) if target else 'it'}', which {VOTES[seed][0]}. More text."
        if "check a description" in system:
            if "check" in self.broken:
                return "no json"
            consistent, score = next(v[1:] for v in VOTES.values() if f"which {v[0]}" in user)
            return json.dumps({"consistent": consistent, "score": score, "reason": "matches" if consistent else "no"})
        if "write short manuals" in system:
            return "garbage" if "manual" in self.broken else json.dumps({"manual": ["Open the note", "Edit it"]})
        if "plan tasks" in system:  # the first way on from the start page; broken, to a page of no app
            start = re.search(r"^Start page: (\w+)$", user, re.M).group(1)
            names, to = re.search(rf"^- {start}: (.+) -> (\w+)$", user, re.M).groups()
            name = names.split(", ")[0]
            if "choice" in self.broken:  # a task naming the way's first element, a walk using its last
                return json.dumps({"steps": [{"page": start, "element": names.split(", ")[-1]},
                                             {"page": to, "element": None}], "task": f"Open the {to} {name}"})
            return json.dumps({"steps": [{"page": start, "element": name},
                                         {"page": "no_such_page" if "plan" in self.broken else to, "element": None}],
                               "task": f"Use {name}"})
        if "Think about the next step" in system:  # the cot style reasons its way to giving up
            return 'The screen is not what the task needs, so I do {"type": "terminate", "status": "failure"}.'
        if "In one sentence, say what to do next" in system:  # the simple style finds the demonstrated action
            task = re.search(r"^Task: (.*)$", user, re.M).group(1)
            done = len(re.findall(r"^Step \d+:", user, re.M))
            width = int(re.search(r"screen of (\d+)x", system).group(1))
            action = self.truth[(task, width, done)] if "simple" not in self.broken else {"type": "system_button",
                                                                                   "button": "Home"}
            return f"To go on I do {json.dumps(action)} next."
        if "Read the reasoning" in system:  # sees the reasoning only: the action it names, as a call
            if "act" in self.broken:
                return "not a call"
            action = json.loads(re.search(r"(\{.*\})", user).group(1))
            function = re.search(r'"name": "(\w+)"', system).group(1)
            return json.dumps(to_call(action, function))
        if "A team of agents decided" in system:  # distillation: the roles' words, merged
            plan = re.search(r'^manager: .*"pending_subgoals": \["([^"]*)"', user, re.M).group(1)
            return f"The plan says {plan} next, so I act on it."
        if "You are told the right next action" in system:
            return "The task needs this element, and it is on the screen."
        if "You are a GUI agent" in system:  # the end-to-end policy, which declares the task done at once
            call = {"name": re.search(r'"name": "(\w+)"', system).group(1),
                    "arguments": {"action": "terminate", "status": "success"}}
            return f"<thinking>Done.</thinking>\n<conclusion>Stop.</conclusion>\n<tool_call>\n{json.dumps(call)}\n" \
                "</tool_call>"
        raise AssertionError(f"unexpected prompt: {system[:80]}")

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"body": body})
        return completion(self.answer(message_text(body["messages"][0]), message_text(body["messages"][-1]),
                                      body.get("seed")))


@pytest.fixture(scope="module")
def model():
    with ModelServer() as server:
        yield server


def workspace(root: Path, url: str, *, cache: bool = True, **synth: Any) -> Workspace:
    return notes_workspace(root, url, cache=cache, synth={
        "rephrase_per_shard": 2, "regions_per_shard": 1, "described_per_shard": 1, "semantics_votes": 2,
        "manual_trials": 1} | synth)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, chromium, model):
    """A run's reference demonstrations of the notes app, and the run id."""
    root = tmp_path_factory.mktemp("synth")
    ws = workspace(root, model.url)
    run = ws.ledger.open_run("test", "synth").run_id
    queries = run_inline(QUERY_GEN, ws, run)["queries"]
    snapshots = run_inline(REFERENCE, ws, run, queries)
    return root, run, snapshots


@pytest.fixture(scope="module")
def grounded(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url)
    return ws, run_inline(grounding.STAGE, ws, run, snapshots["steps"])


def inside(point: list[float] | tuple[float, float], box: list[float]) -> bool:
    x, y, w, h = box
    return x <= point[0] <= x + w and y <= point[1] <= y + h


def test_a_grounding_answer_drawn_on_its_image_lands_inside_the_element(grounded):
    ws, snapshots = grounded
    rows = ws.catalog.load("grounding", snapshots["grounding"])
    samples = ws.catalog.load("train_grounding", snapshots["train_grounding"])
    elements = {r["sample_id"]: r for r in rows.filter(pl.col("kind") == "element").to_dicts()}
    assert len(elements) >= 10
    checked = 0
    for sample in samples.to_dicts():
        ids = sample["source_id"].split(",")
        if ids[0] not in elements:
            continue
        answers = [m for m in json.loads(sample["messages_json"]) if m["role"] == "assistant"]
        for sample_id, answer in zip(ids, answers, strict=True):
            call = json.loads(answer["content"][0]["text"].split("<tool_call>\n")[1].split("\n</tool_call>")[0])
            x, y = call["arguments"]["coordinate"]
            drawn = annotate(sample["images"][0], {"type": "click", "x": x, "y": y}, None)
            with Image.open(io.BytesIO(drawn)) as image:
                pixels = image.convert("RGB").load()
                w, h = image.size
            ring = [(px, py) for px in range(max(0, x - 25), min(w, x + 25)) for py in range(max(0, y - 25), min(h, y + 25))
                    if pixels[px, py] == POINT_COLOR]
            centre = (sum(p[0] for p in ring) / len(ring), sum(p[1] for p in ring) / len(ring))
            assert inside(centre, elements[sample_id]["box"]), (elements[sample_id], centre)
            checked += 1
    assert checked == len(elements)


def test_grounding_rows_of_every_kind_with_reasons_for_what_was_dropped(grounded, model):
    ws, snapshots = grounded
    rows = ws.catalog.load("grounding", snapshots["grounding"])
    assert set(rows["kind"]) == {"element", "word", "char", "region"}
    words = set(rows.filter(pl.col("kind") == "word")["text"])
    names = " ".join(rows.filter(pl.col("kind") == "element")["name"])
    assert len([w for w in words if w in names]) >= 5  # the OCR read what the accessibility tree names
    lineage = ws.catalog.lineage("grounding", snapshots["grounding"])
    assert lineage.dropped["element: a container (RootWebArea), not something a user points at"] > 0
    assert lineage.models["ocr"].startswith("rapidocr-")
    modes = rows.filter(pl.col("kind") == "element")["instruction_mode"].value_counts()
    assert dict(modes.iter_rows()).get("model", 0) >= 1  # the scripted model kept the name: rephrased
    rephrased = rows.filter(pl.col("instruction_mode") == "model").to_dicts()[0]
    assert rephrased["instruction"] == f"I need {rephrased['name']} now"
    assert rephrased["model_id"] == "scripted" and rephrased["prompt_version"] == prompt_versions("grounding_rephrase")
    region = rows.filter(pl.col("kind") == "region").to_dicts()[0]
    assert (region["text"], region["instruction"]) == ("the top bar", "Point at the top bar")


def test_the_pages_query_generation_saw_are_grounded_too(grounded):
    ws, snapshots = grounded
    pages, pages_snapshot = ws.catalog.latest("pages")
    assert pages.height > 0 and set(pages["app"]) == {"notes"}
    assert all(sha in ws.blobs for sha in pages["screenshot"])
    rows = ws.catalog.load("grounding", snapshots["grounding"])
    seen_by_query_gen = rows.filter(pl.col("step_id").is_null())
    assert seen_by_query_gen.filter(pl.col("kind") == "element").height > 0
    assert set(seen_by_query_gen["screenshot"]) <= set(pages["screenshot"])
    assert ws.catalog.lineage("grounding", snapshots["grounding"]).inputs["pages"] == pages_snapshot


def test_a_rerun_with_nothing_new_reads_no_ocr_and_asks_no_model(recorded, grounded, model):
    """The process's reader already holds every screen and the response cache every answer, so the rerun gets a
    reader that has read nothing (any screen it reads runs the engine), and the gateway counts every question it is
    asked, the cache's answers too."""
    root, run, snapshots = recorded
    again = workspace(root, model.url)
    again.ocr = OcrReader()
    rerun = again.ledger.open_run("test", "synth-rerun").run_id
    out = run_inline(grounding.STAGE, again, rerun, snapshots["steps"])
    lineage = again.catalog.lineage("grounding", out["grounding"])
    assert lineage.kept["grounding"] == 0
    assert lineage.stats["screens already grounded with this configuration by an earlier run"] > 0
    assert (again.ocr.engine_runs, again.gateway.stats.calls) == (0, 0)


def screen_of(ws: Workspace) -> tuple[grounding.Screen, bytes]:
    steps = ws.catalog.load("steps").sort("step_id").to_dicts()
    s = steps[0]
    screen = grounding.Screen(s["screenshot_before"], s["width"], s["height"], "notes", s["url_before"],
                              s["title_before"], s["step_id"], "mobile", s["ax_tree_before"])
    return screen, ws.blobs.get(s["screenshot_before"])


def test_covered_shifted_and_outside_elements_are_dropped_with_reasons(grounded):
    ws, _ = grounded
    screen, png = screen_of(ws)
    lines = ws.ocr.read(png)
    kept = grounding.ground_screen(screen, png, lines, [], run_id="t", iou_threshold=0.5)
    element = next(r for r in kept.rows if r.kind == "element" and r.detector == "ocr")
    x, y, w, h = (round(v) for v in element.box)
    role = element.role
    tree = "\n".join([
        f'{role} "{element.name}" [covered] ({x},{y},{w},{h})',
        f'{role} "{element.name} moved" ({x + w},{y + h},{w},{h})',  # shifted off its text: the OCR disagrees
        f'button "Far away" ({screen.width + 10},{y},{w},{h})',
        f'{role} "{element.name}" ({x},{y},{w},{h})',
    ])
    out = grounding.ground_screen(screen.__class__(**{**screen.__dict__, "ax_tree": tree}), png, lines, [],
                                  run_id="t", iou_threshold=0.5)
    assert [r.name for r in out.rows if r.kind == "element"] == [element.name]
    assert out.dropped["element: covered by another element when recorded"] == 1
    assert out.dropped["element: IoU with its detection below tau_g=0.5"] == 1
    assert out.dropped["element: off screen"] == 1
    assert "iou 0.00" in out.iou_drops[0] and str([x + w, y + h, w, h]) in out.iou_drops[0]


def test_a_request_two_things_on_the_screen_answer_is_not_asked():
    """Two 'Add to cart' buttons, and the words and lines they show twice, make no row: a sample would ask the
    same thing twice with two answers. A covered copy is not shown, so 'Checkout' is still one thing."""
    def line(text: str, y: int) -> OcrLine:
        words, chars, x = [], [], 10
        for word in text.split():
            words.append(OcrSpan(word, (x, y, 10 * len(word), 30)))
            chars += [OcrSpan(c, (x + 10 * i, y, 10, 30)) for i, c in enumerate(word)]
            x += 10 * len(word) + 10
        return OcrLine(text, 1.0, (10, y, x - 20, 30), tuple(words), tuple(chars))

    lines = (line("Add to cart", 100), line("Add to cart", 200), line("Checkout", 300))
    tree = render([AXNode(0, "button", "Add to cart", box=(10, 100, 110, 30)),
                   AXNode(0, "button", "Add to cart", box=(10, 200, 110, 30)),
                   AXNode(0, "button", "Checkout", box=(10, 300, 80, 30)),
                   AXNode(0, "button", "Checkout", ("covered",), box=(10, 400, 80, 30))])
    screen = grounding.Screen("s" * 64, 390, 844, "shop", "/", "Shop", "e:0", "mobile", tree)
    out = grounding.ground_screen(screen, b"", lines, [], run_id="t", iou_threshold=0.5)
    asked = [(r.kind, r.instruction) for r in out.rows]
    assert asked[:2] == [("element", "Click the 'Checkout' button"), ("word", "Click the word 'Checkout'")]
    assert [r.text for r in out.rows if r.kind == "char"] == list("Checkout")
    assert len(set(asked)) == len(asked)
    assert out.dropped["element: not unique on the screen (another element shown is asked for by the same role "
                       "and name)"] == 2
    assert out.dropped["word: its text is not unique on the screen"] == 6
    assert out.dropped["char: its line's text is not unique on the screen"] == 18
    assert out.dropped["element: covered by another element when recorded"] == 1


def test_a_character_request_names_its_place_in_the_text_spaces_counted():
    """The OCR boxes the characters that are not spaces: the request names each one's place in the text the user
    reads ('t' is box 4 of 'Add to cart' and its character 5), and a line whose boxes do not read its text (one
    box too few) makes no char row rather than rows naming guessed places."""
    def line(text: str, y: int, chars: str) -> OcrLine:
        boxes = tuple(OcrSpan(c, (10 + 10 * i, y, 10, 30)) for i, c in enumerate(chars))
        return OcrLine(text, 1.0, (10, y, 10 * len(chars), 30), (), boxes)

    lines = (line("Add to cart", 100, "Addtocart"), line("Check out", 200, "Chekout"))
    screen = grounding.Screen("s" * 64, 390, 844, "shop", "/", "Shop", "e:0", "mobile", "")
    out = grounding.ground_screen(screen, b"", lines, [], run_id="t", iou_threshold=0.5)
    chars = [r for r in out.rows if r.kind == "char"]
    assert [r.instruction for r in chars][3:5] == ["Point at the character 't' (character 5 of 'Add to cart')",
                                                   "Point at the character 'o' (character 6 of 'Add to cart')"]
    for row in chars:  # every place named is the character asked for
        at = int(re.search(r"character (\d+) of", row.instruction).group(1))
        assert "Add to cart"[at - 1] == row.text, row.instruction
    assert len(chars) == 9
    assert out.dropped["char: its boxes do not read its line's text character for character"] == 7


def test_a_radio_is_asked_to_be_selected_never_turned_off():
    """Clicking a selected radio leaves it selected: its request is "Select 'X'" in either state (one request key,
    so two radios of one name are still one request with two answers), where a checkbox is turned on or off."""
    def request(role: str, *states: str) -> str:
        return grounding.describe(AXNode(0, role, "Large", states))[1]

    for role in ("radio", "menuitemradio"):
        assert request(role, "checked") == request(role) == "Select 'Large'"
    assert (request("checkbox", "checked"), request("checkbox")) == ("Turn 'Large' off", "Turn 'Large' on")
    tree = render([AXNode(0, "radio", "Large", ("checked",), box=(10, 100, 110, 30)),
                   AXNode(0, "radio", "Small", ("checked",), box=(10, 200, 110, 30)),
                   AXNode(0, "radio", "Small", box=(10, 300, 110, 30))])
    screen = grounding.Screen("s" * 64, 390, 844, "shop", "/", "Shop", "e:0", "mobile", tree)
    lines = tuple(OcrLine(t, 1.0, (10, y, 110, 30), (OcrSpan(t, (10, y, 110, 30)),), ())
                  for t, y in (("Large", 100), ("Small", 200), ("Small", 300)))
    out = grounding.ground_screen(screen, b"", lines, [], run_id="t", iou_threshold=0.5)
    assert [r.instruction for r in out.rows if r.kind == "element"] == ["Select 'Large'"]
    assert out.dropped["element: not unique on the screen (another element shown is asked for by the same role "
                       "and name)"] == 2


def test_a_heading_wider_than_its_text_is_kept_as_its_text_when_the_ocr_reads_its_name(grounded):
    """A full-width heading's block has an IoU far below tau_g with its text; kept with the text's extent as its
    box (so its point is on the text), where a block whose name the OCR does not read there is still dropped."""
    ws, _ = grounded
    screen, png = screen_of(ws)
    lines = ws.ocr.read(png)

    def alone(line) -> bool:  # short, plain, and no other text in its row right of it
        x, y, w, h = line.box
        def in_its_row(other) -> bool:
            return other.box[0] + other.box[2] / 2 >= x and y <= other.box[1] + other.box[3] / 2 <= y + h

        return len(line.text) >= 4 and '"' not in line.text and 3 * w < screen.width - x and not any(
            other is not line and in_its_row(other) for other in lines)

    line = next(line for line in lines if alone(line))
    x, y, w, h = (int(v) for v in line.box)
    block = f"({x},{y},{screen.width - x - 1},{h + 1})"
    tree = f'heading "{line.text}" {block}\nheading "Something else entirely" {block}'
    out = grounding.ground_screen(dataclasses.replace(screen, ax_tree=tree), png, lines, [], run_id="t",
                                  iou_threshold=0.5)
    [kept] = [r for r in out.rows if r.kind == "element"]
    assert (kept.name, kept.detector) == (line.text, "ocr-name")
    assert kept.iou is not None and kept.iou < 0.5
    (lx, ly, lw, lh), (kx, ky, kw, kh) = line.box, kept.box  # its words' extent: inside the line's box
    assert lx - 1 <= kx and kx + kw <= lx + lw + 1 and ly - 1 <= ky and ky + kh <= ly + lh + 1, (kept.box, line.box)
    assert kw > lw / 2 and lx <= kept.point[0] <= lx + lw  # the text, not the block
    assert out.dropped["element: IoU with its detection below tau_g=0.5"] == 1


def test_a_missing_blob_or_an_unparsable_answer_drops_the_row_and_the_stage_finishes(recorded, grounded, model):
    root, _, _ = recorded
    ws, _ = grounded
    screen, _ = screen_of(ws)
    missing = screen.__class__(**{**screen.__dict__, "screenshot": "0" * 64})
    fresh = workspace(root, model.url, cache=False)  # the cache would answer with the good answers of before
    model.broken = {"rephrase", "region"}
    try:
        out = grounding.ground([missing, screen], fresh, fresh.ledger.open_run("test", "broken").run_id, "")
    finally:
        model.broken = set()
    assert out.dropped["screen: screenshot blob BlobMissing"] == 1
    assert out.dropped["region: the answer is not a name (over 8 words)"] == 1
    assert out.stats["element requests kept as the template: the model's answer was unusable"] == 2
    assert out.stats["grounding_rephrase: answer did not parse or was empty"] == 2
    assert out.stats["screens grounded"] == 1 and out.rows["grounding"]


def test_action_semantics_one_row_per_valid_step_and_the_best_of_k_votes(recorded, model):
    """A vote per seed: the kept description is the best-scored of those the check found consistent, not the first,
    the last, nor the best-scored one the check found inconsistent."""
    root, run, snapshots = recorded
    ws = workspace(root, model.url, semantics_votes=len(VOTES))
    out = run_inline(semantics.STAGE, ws, run, snapshots["steps"])
    steps = ws.catalog.load("steps", snapshots["steps"])
    effective = steps.filter(pl.col("action_valid") & ~pl.col("action_type").is_in(["terminate", "answer"])
                             & (pl.col("screenshot_before") != pl.col("screenshot_after")))
    rows = ws.catalog.load("action_semantics", out["action_semantics"])
    assert rows.filter(pl.col("tier") == "action").height == effective.height
    described = rows.filter(pl.col("tier") == "description").to_dicts()
    assert len(described) == 1
    votes = json.loads(described[0]["votes_json"])
    assert [(v["seed"], v["scored_by"], v["consistent"], v["score"]) for v in votes] == [
        (seed, "model", consistent, score) for seed, (_, consistent, score) in VOTES.items()]
    kept = described[0]["description"]
    assert kept == votes[1]["description"] and kept.startswith("Clicks '") and kept.endswith(f"{VOTES[1][0]}.")
    training = ws.catalog.load("train_semantics", out["train_semantics"])
    assert training.height == rows.height and all(len(i) == 2 for i in training["images"])


def _grey_screens(ws: Workspace, size: tuple[int, int], *shades: int) -> list[str]:
    """One plain grey screenshot of `size` per shade, put in the blob store: their sha256s, in order."""
    shots = []
    for shade in shades:
        buffer = io.BytesIO()
        Image.new("RGB", size, (shade, shade, shade)).save(buffer, format="PNG")
        shots.append(ws.blobs.put(buffer.getvalue()).sha256)
    return shots

def test_an_action_that_changed_nothing_makes_no_inverse_dynamics_row(tmp_path):
    """The same screenshot before and after: any action that does nothing would answer "which action turned the
    first into the second?", so the step makes no row, counted; the step that changed the screen makes one."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, synth={"writer": "template"}))
    shots = _grey_screens(ws, (390, 844), 0, 90)
    steps = [Step(run_id="r", step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before=before,
                  screenshot_after=shots[1], width=390, height=844, url_before="u", url_after="u", title_before="t",
                  title_after="t", ax_tree_before="", action_type="click", action_json='{"x": 50, "y": 25}',
                  action_valid=True, thought="", raw_output="", duration_ms=1) for i, before in enumerate(shots)]
    out = semantics.semantics([semantics.EpisodeSteps("e", "mobile", "task", steps)], ws,
                              ws.ledger.open_run("test", "semantics").run_id, "")
    assert [r.step_id for r in out.rows["action_semantics"]] == ["e:0"] and len(out.rows["train_semantics"]) == 1
    assert out.dropped == {"the screen did not change (one screenshot before and after)": 1}


def test_a_desktop_key_press_recorded_in_the_phones_form_is_taught_as_computer_uses_keys(tmp_path):
    """Desktop steps recorded before the recorder stored each space's own form say {"key": "enter"}; the desktop
    tool has only `keys`, so every training answer made from such a step (semantics' inverse dynamics, the
    policy's own step) calls `computer_use` with ["Enter"], the key the env pressed."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, synth={"writer": "template"}))
    shots = _grey_screens(ws, (1280, 800), 0, 90)
    step = Step(run_id="r", step_id="e:0", episode_id="e", step_index=0, screenshot_before=shots[0],
                screenshot_after=shots[1], width=1280, height=800, url_before="u", url_after="u", title_before="t",
                title_after="t", ax_tree_before="", action_type="key", action_json='{"key": "enter"}',
                action_valid=True, thought="", raw_output="", duration_ms=1)
    want = {"name": "computer_use", "arguments": {"action": "key", "keys": ["Enter"]}}
    out = semantics.semantics([semantics.EpisodeSteps("e", "desktop", "task", [step])], ws,
                              ws.ledger.open_run("test", "semantics").run_id, "")
    [sample] = out.rows["train_semantics"]
    answer = json.loads(sample.messages_json)[-1]["content"][0]["text"]
    assert json.loads(answer.removeprefix("<tool_call>").removesuffix("</tool_call>")) == want
    messages_json, _ = policy_messages(instruction="task", viewport="desktop", step=step, history=[], thought="t",
                                       summary="s", blobs=ws.blobs)
    answer = json.loads(messages_json)[-1]["content"][0]["text"]
    assert json.loads(answer.split("<tool_call>")[1].removesuffix("</tool_call>")) == want


def test_semantics_done_again_with_another_configuration_replaces_the_episodes_rows(tmp_path):
    """A unit is an episode, done once per configuration; done again (here another `synth.semantics_votes`), its
    new rows take the place of its earlier ones in both tables, so each step is there once in the latest version
    (the version before keeps the old rows)."""
    def night(votes: int) -> tuple[Workspace, str, dict[str, int]]:
        ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"},
                                     synth={"writer": "template", "semantics_votes": votes}))
        run = ws.ledger.open_run("test", f"votes-{votes}").run_id
        return ws, run, run_inline(semantics.STAGE, ws, run, steps_at)

    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    shots = _grey_screens(ws, (390, 844), 0, 90, 180)
    run = ws.ledger.open_run("test", "rollout").run_id
    steps = [Step(run_id=run, step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before=shots[i],
                  screenshot_after=shots[i + 1], width=390, height=844, url_before="u", url_after="u",
                  title_before="t", title_after="t", ax_tree_before="", action_type="click",
                  action_json='{"x": 50, "y": 25}', action_valid=True, thought="", raw_output="", duration_ms=1)
             for i in range(2)]
    steps_at = ws.catalog.commit_rows("steps", steps, Lineage(
        stage="rollout", run_id=run, commit_key=commit_key(run, "rollout", "steps"), config_hash="-",
        code_version="-"))
    _, _, first = night(2)
    ws, redo, again = night(3)
    for table in ("action_semantics", "train_semantics"):
        latest = ws.catalog.load(table, again[table])
        assert latest.height == 2 and set(latest["run_id"]) == {redo}, table
        assert ws.catalog.load(table, first[table]).height == 2
    assert sorted(ws.catalog.load("action_semantics", again["action_semantics"])["step_id"]) == ["e:0", "e:1"]


def test_an_unparsable_check_leaves_the_rules_to_score(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url, cache=False, semantics_votes=1)
    units = semantics.load_episodes(ws, snapshots["steps"]).units
    model.broken = {"check"}
    try:
        out = semantics.semantics(units, ws, ws.ledger.open_run("test", "rules").run_id, "")
    finally:
        model.broken = set()
    described = [r for r in out.rows["action_semantics"] if r.tier == "description"]
    for row in described:
        [vote] = json.loads(row.votes_json)
        assert vote["scored_by"] == "rules" and vote["check_error"].startswith("did not parse")
    assert out.stats["tier-2 votes scored by the rules"] == 1


def test_planning_measures_each_manual_and_drops_plans_the_graph_cannot_follow(recorded, model):
    root, run, _ = recorded
    ws = workspace(root, model.url, plans_per_app=1)
    _, episodes = ws.catalog.resolve("episodes@latest")
    model.broken = {"plan"}
    try:
        out = run_inline(planning.STAGE, ws, run, episodes)
    finally:
        model.broken = set()
    manuals = ws.catalog.load("manuals", out["manuals"])
    assert manuals.height == manuals["family"].n_unique() >= 2  # a page-graph family and an atomic one
    assert set(manuals["app"]) == {"notes"} and all(manuals["text"].str.starts_with("1. Open the note"))
    measured = manuals.filter(pl.col("success_with").is_not_null())
    assert measured.height == 1 and measured["success_with"][0] == 1.0  # the replay policy follows any manual
    lineage = ws.catalog.lineage("plans", out["plans"])
    assert lineage.kept["plans"] == 0
    assert any("names page 'no_such_page'" in k for k in lineage.stats)
    again = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "plan-again").run_id, episodes)
    assert ws.catalog.lineage("manuals", again["manuals"]).kept["manuals"] == 0


def test_an_apps_plans_after_the_first_are_seeded_draws_and_a_repeated_one_is_dropped(recorded, model):
    """synth.plans_per_app: the first plan greedy, each other drawn at synth.plan_temperature with its own seed; a
    model that gives the same plan again (this one ignores the seed) adds no second row."""
    root, _, _ = recorded
    ws = workspace(root, model.url, cache=False, plans_per_app=3)
    _, episodes = ws.catalog.resolve("episodes@latest")
    model.requests.clear()
    out = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "plan-draws").run_id, episodes)
    asked = [r["body"] for r in model.requests if "plan tasks" in r["body"]["messages"][0]["content"]]
    assert [(b["temperature"], b.get("seed")) for b in asked] == [(0.0, None), (0.7, 1), (0.7, 2)]
    lineage = ws.catalog.lineage("plans", out["plans"])
    assert lineage.kept["plans"] == 1 and lineage.dropped["plan: the same as an earlier draw for this app"] == 2
    (plan,) = ws.catalog.load("plans", out["plans"]).iter_rows(named=True)
    assert plan["task"] == "Use Birthday gift ideas"  # a note, its {note} slot filled: the link that opens it
    assert plan["steps"] == ["On notes: click link 'Birthday gift ideas'", "On note: the task is done"]


def test_a_plan_is_kept_only_when_it_can_be_followed_from_the_start_page():
    """The walks the decoder is held to are the plans the check keeps; a plan a backend wrote unheld is checked
    step by step: its pages, its start, each way on and the element it uses; a copied example is not a plan."""
    spec = kind_for("shop").spec
    assert spec is not None

    def plan(*steps: tuple[str, str | None], task: str = "Order a large pad thai") -> planning.PlanAnswer:
        return planning.PlanAnswer(task=task, steps=[planning.PlanStep(page=p, element=e) for p, e in steps])

    walks = planning.plan_walks(spec)
    assert len(walks) == 10 and all(2 <= len(w) <= 5 and w[0][0] == "home" for w in walks)
    for walk in walks:
        for pick in (0, -1):  # the first and the last element name of each way on, {dish} filled
            assert planning.check_plan(plan(*[(p, names[pick] if names else None) for p, names in walk]), spec) is None
    assert planning.check_plan(plan(("home", "Pad Thai"), ("dish", "Large"), ("cart", None)), spec) is None
    assert planning.check_plan(plan(("home", "Search"), ("cart", None)), spec) == \
        "step 2 is on page 'cart', which no transition from page 'home' reaches"
    assert planning.check_plan(plan(("search", "Pad Thai"), ("dish", None)), spec) == \
        "step 1 is on page 'search', not the start page 'home'"
    assert planning.check_plan(plan(("home", "Checkout"), ("search", None)), spec) == \
        "step 1 names element 'Checkout', which the way from 'home' to 'search' does not use"
    assert planning.check_plan(plan(("home", "{dish}"), ("dish", None)), spec) is not None  # a slot, not a dish
    assert "names page 'menu'" in planning.check_plan(plan(("home", "Search"), ("menu", None)), spec)
    shown = '{"steps": [], "task": "Find the pad thai and order it"}'
    assert planning.copies_example(plan(("home", None), ("dish", None), task="Find the Pad Thai and order it "), shown)
    assert not planning.copies_example(plan(("home", None), ("dish", None)), shown)


def test_a_plans_steps_are_the_graphs_actions_and_its_task_must_name_its_walk():
    """What a step does is the transition's actions with the slot its element fills; a task that names nothing of
    its walk, or ran to its length limit, is dropped (SmolLM2 wrote both)."""
    spec = kind_for("shop").spec
    assert spec is not None
    walk = planning.PlanAnswer(task="Order a large pad thai", steps=[
        planning.PlanStep(page="home", element="Search"), planning.PlanStep(page="search", element="Pad Thai"),
        planning.PlanStep(page="dish", element="Add to cart"), planning.PlanStep(page="cart")])
    assert planning.step_texts(walk, spec) == [
        "On home: click link 'Search'",
        "On search: type 'Pad Thai' into searchbox 'Search dishes', press Enter, click link 'Pad Thai'",
        "On dish: click radio the size, click button 'Add to cart'",  # the size is no element the plan named
        "On cart: the task is done"]
    assert planning.task_problem(walk) is None  # "pad thai", an element of its walk
    for task in ("Put it in the cart", "Go shopping for the Pad Thai dish"):  # a page; an element's word
        assert planning.task_problem(walk.model_copy(update={"task": task})) is None, task
    assert planning.task_problem(walk.model_copy(update={"task": "Song Siren"})) == \
        "its task names no page or element of its walk"
    assert planning.task_problem(walk.model_copy(update={"task": "Home, Search -> Pad Thai"})) == \
        "its task is written as the prompt's ways between pages (page: elements -> next page)"
    long = "Order the dish, and order the other items, " * 3
    assert planning.task_problem(walk.model_copy(update={"task": long[:planning.TASK_CHARS]})) == \
        "its task was cut off at its length limit"


def test_a_plans_task_naming_a_choice_its_walk_does_not_make_is_dropped(recorded, model):
    """A task naming a slot's value (a dish, a size) the walk does not pick contradicts its own steps: dropped with
    the value and the walk's pick. A value the walk picks, or one of a slot a step leaves open ("click radio the
    size"), agrees; so do the words of another value inside one the task names ("ideas" of a note's title)."""
    shop, notes = kind_for("shop").spec, kind_for("notes").spec
    assert shop is not None and notes is not None

    def plan(task: str, *steps: tuple[str, str | None]) -> planning.PlanAnswer:
        return planning.PlanAnswer(task=task, steps=[planning.PlanStep(page=p, element=e) for p, e in steps])

    opened = (("home", "Pad Thai"), ("dish", None))
    ordered = (("home", "Search"), ("search", "Pad Thai"), ("dish", "Add to cart"), ("cart", None))
    assert planning.choice_problem(plan("Order the Miso Ramen dish", *opened), shop) == \
        "its task names dish 'Miso Ramen', where its walk picks 'Pad Thai'"
    assert planning.choice_problem(plan("Order a large Pad Thai", *opened), shop) == \
        "its task names size 'Large', which its walk does not choose"
    for task in ("Order a large pad thai", "Put a Pad Thai in the cart", "Put it in the cart"):
        assert planning.choice_problem(plan(task, *ordered), shop) is None, task
    assert planning.choice_problem(plan("Open Birthday gift ideas", ("notes", "Birthday gift ideas"), ("note", None)),
                                   notes) is None

    root, _, _ = recorded
    ws = workspace(root, model.url, cache=False, manual_trials=0)  # the cache holds the plan of other tests
    _, episodes = ws.catalog.resolve("episodes@latest")
    units = planning.load_apps(ws, episodes).units
    model.broken = {"choice"}  # the task names the first note, its walk opens the last
    try:
        out = planning.plan_app(units, ws, ws.ledger.open_run("test", "plan-choice").run_id, "")
    finally:
        model.broken = set()
    assert out.rows["plans"] == []
    assert out.dropped["plan: its task names a choice its walk does not make"] == 1
    assert out.stats["plan dropped (notes): task 'Open the note Birthday gift ideas': its task names note "
                     "'Birthday gift ideas', where its walk picks 'Meeting notes 3 Dec'"] == 1


def test_a_manuals_steps_say_what_was_typed_which_key_and_which_way():
    """A manual's transitions keep what the action was done with: the text typed (a secret as its placeholder),
    the key, a swipe's or scroll's direction, beside the element acted on."""
    def step(i: int, kind: str, args: dict[str, Any], target: tuple[str, str] | None = None,
             valid: bool = True) -> Step:
        return Step(run_id="r", step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before="a",
                    screenshot_after="b", width=390, height=844, url_before="u", url_after="u", title_before=f"p{i}",
                    title_after=f"p{i + 1}", ax_tree_before="", action_type=kind, action_json=json.dumps(args),
                    action_valid=valid, target_role=target[0] if target else None,
                    target_name=target[1] if target else None, thought="", raw_output="", duration_ms=1)

    steps = [step(0, "type", {"text": "Pad Thai"}, ("searchbox", "Search dishes")),
             step(1, "type", {"text": "<secret>account_password</secret>"}, ("textbox", "Password")),
             step(2, "key", {"key": "Enter"}), step(3, "press", {"key": "Backspace"}),
             step(4, "key", {"keys": ["Control", "a"]}),
             step(5, "swipe", {"x": 100, "y": 600, "x2": 110, "y2": 200}),
             step(6, "scroll", {"x": 100, "y": 300, "dy": 400}, ("list", "Dishes")),
             step(7, "click", {"x": 10, "y": 20}, ("link", "Cart")), step(8, "system_button", {"button": "Back"}),
             step(9, "type", {"txt": "oops"}, valid=False), step(10, "terminate", {"status": "success"})]
    query = Query(run_id="r", query_id="q", app="shop", source="page_graph", instruction="Order", path=["home"],
                  slots_json="{}", checker="c", checker_params_json="{}", max_steps=10, generator="g",
                  created_at=datetime.now(timezone.utc))
    manual = planning.template_manual(planning.Trajectory("e", query, steps))
    assert manual.manual == [
        "On 'p0': type 'Pad Thai' into searchbox 'Search dishes' (then 'p1')",
        "On 'p1': type '<secret>account_password</secret>' into textbox 'Password' (then 'p2')",
        "On 'p2': press Enter (then 'p3')", "On 'p3': press Backspace (then 'p4')",
        "On 'p4': press Control+a (then 'p5')", "On 'p5': swipe up (then 'p6')",
        "On 'p6': scroll down on list 'Dishes' (then 'p7')", "On 'p7': click link 'Cart' (then 'p8')",
        "On 'p8': press the Back button (then 'p9')", "On 'p9': type (then 'p10')"]


def test_a_manual_the_model_cannot_write_keeps_the_template_and_says_so(recorded, model):
    root, run, _ = recorded
    ws = workspace(root, model.url, cache=False, manual_trials=0)
    _, episodes = ws.catalog.resolve("episodes@latest")
    units = [dataclasses.replace(u, written=frozenset()) for u in planning.load_apps(ws, episodes).units]
    model.broken = {"manual"}
    try:
        out = planning.plan_app(units, ws, ws.ledger.open_run("test", "manual-fallback").run_id, "")
    finally:
        model.broken = set()
    manuals = out.rows["manuals"]
    assert manuals and {m.mode for m in manuals} == {"fallback"}
    assert all(m.text.startswith("1. On '") for m in manuals)  # the first trajectory's transitions
    assert out.stats["manual kept as the template: planning_manual: the model's answer did not parse"] == len(manuals)
    assert {r.source_id for r in out.rows["train_planning"]} >= {m.manual_id for m in manuals}


def test_a_fallback_manual_is_asked_for_again_and_an_edited_prompt_is_new_work(recorded, model, tmp_path,
                                                                               monkeypatch):
    """A manual kept as the template because the model's answer was unusable is no manual up to date: the next run
    asks the model again and writes its manual. One the model wrote is up to date, until the manual prompt's
    version changes."""
    root, _, _ = recorded
    ws = workspace(root, model.url, cache=False, manual_trials=0, plans_per_app=0)
    _, episodes = ws.catalog.resolve("episodes@latest")

    model.broken = {"manual"}
    try:
        fallback = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manuals-broken").run_id, episodes)
        # asked again and unusable again (as a cached answer would be): the template manual is there already
        still = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manuals-still-broken").run_id, episodes)
    finally:
        model.broken = set()
    written = ws.catalog.rows_added("manuals", fallback["manuals"])[0]
    assert written.height and set(written["mode"]) == {"fallback"}
    lineage = ws.catalog.lineage("manuals", still["manuals"])
    assert lineage.kept["manuals"] == 0 and ws.catalog.lineage("train_planning", still["train_planning"]).kept[
        "train_planning"] == 0
    assert sum(n for k, n in lineage.stats.items() if k.startswith("manual still the template")) == written.height
    again = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manuals-again").run_id, episodes)
    rewritten = ws.catalog.rows_added("manuals", again["manuals"])[0]
    assert set(rewritten["mode"]) == {"model"} and set(rewritten["manual_id"]) == set(written["manual_id"])
    up_to_date = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manuals-up-to-date").run_id, episodes)
    assert ws.catalog.lineage("manuals", up_to_date["manuals"]).kept["manuals"] == 0

    prompts = tmp_path / "prompts"
    shutil.copytree(planning.PROMPTS, prompts)
    edited = prompts / f"{planning.MANUAL}.yaml"
    edited.write_text(re.sub(r'^version: "(\d+)"', lambda m: f'version: "{int(m[1]) + 1}"', edited.read_text(),
                             flags=re.M))
    monkeypatch.setattr(planning, "PROMPTS", prompts)
    new_prompt = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manuals-new-prompt").run_id, episodes)
    assert ws.catalog.lineage("manuals", new_prompt["manuals"]).kept["manuals"] == rewritten.height


def _demonstrated(ws: Workspace, snapshot: int) -> dict[tuple[str, int, int], dict[str, Any]]:
    steps = ws.catalog.rows_added("steps", snapshot)[0]
    episodes = {e["episode_id"]: e["instruction"] for e in ws.catalog.load("episodes").to_dicts()}
    return {(episodes[s["episode_id"]], s["width"], s["step_index"]): {"type": s["action_type"], **json.loads(s["action_json"])}
            for s in steps.to_dicts()}


def test_a_reasoning_is_kept_only_when_the_action_predicted_from_it_matches_the_demonstration(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url, reasoning_steps_per_shard=3, reasoning_tries=2)
    model.truth = _demonstrated(ws, snapshots["steps"])
    out = run_inline(reasoning.STAGE, ws, run, snapshots["steps"])
    samples = ws.catalog.load("reasoning_samples", out["reasoning_samples"]).to_dicts()
    assert len({s["step_id"] for s in samples}) == 3 and {s["trusted"] for s in samples} == {"reference"}
    cot = [s for s in samples if s["hint_style"] == "cot"]
    simple = [s for s in samples if s["hint_style"] == "simple"]
    # cot's reasoning decides to terminate: each of its 2 tries is predicted, does not match, and is rejected.
    assert len(cot) == 6 and not any(s["kept"] or s["matched"] for s in cot)
    assert all(json.loads(s["predicted_action_json"])["type"] == "terminate" for s in cot)
    assert all(s["match_reason"].startswith("type 'terminate' is not") for s in cot)
    # simple's reasoning names the demonstrated action: matched on the first try and kept.
    assert len(simple) == 3 and all(s["kept"] and s["matched"] and s["attempt"] == 0 for s in simple)
    assert not any(s["hinted_with_answer"] for s in samples)
    training = ws.catalog.load("train_reasoning", out["train_reasoning"]).to_dicts()
    assert sorted(t["source_id"] for t in training) == sorted(s["reasoning_id"] for s in simple)
    for row in training:
        kept = next(s for s in simple if s["reasoning_id"] == row["source_id"])
        answer = json.loads(row["messages_json"])[-1]["content"][0]["text"]
        assert answer.startswith(f"<thinking>{kept['reasoning']}</thinking>") and len(row["images"]) == 1
        call = json.loads(answer.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
        assert call["arguments"]["action"] == json.loads(kept["predicted_action_json"])["type"]
    lineage = ws.catalog.lineage("train_reasoning", out["train_reasoning"])
    assert lineage.dropped["cot reasoning rejected: type differs"] == 6
    assert lineage.stats["steps with an accepted reasoning: simple"] == 3 and lineage.stats["steps tried"] == 3
    assert lineage.prompts["reasoning_act"] == prompt_version("reasoning_act")


def test_a_step_no_sampled_reasoning_matches_is_written_with_the_answer_and_flagged(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url, cache=False, reasoning_steps_per_shard=1, hint_styles=["simple"])
    model.truth = _demonstrated(ws, snapshots["steps"])
    units = reasoning.load_trusted(ws, snapshots["steps"]).units
    model.broken = {"simple"}
    try:
        out = reasoning.reason(units, ws, ws.ledger.open_run("test", "hinted").run_id, "")
    finally:
        model.broken = set()
    rejected, hinted = out.rows["reasoning_samples"]
    assert rejected.hint_style == "simple" and not rejected.kept and rejected.matched is False
    assert hinted.hint_style == "hinted" and hinted.hinted_with_answer and hinted.kept and hinted.matched is None
    [row] = out.rows["train_reasoning"]
    assert row.hinted_with_answer and row.source_id == hinted.reasoning_id
    assert out.stats["steps with an accepted reasoning: hinted"] == 1



def test_a_step_the_agent_team_decided_is_distilled_into_one_reasoning(recorded, model):
    root, run, snapshots = recorded
    ws = workspace(root, model.url, cache=False, reasoning_steps_per_shard=1)
    unit = reasoning.load_trusted(ws, snapshots["steps"]).units[0]
    roles = {"manager": {"output": {"pending_subgoals": ["open the note"]}},
             "worker": {"output": {"thought": "tap it", "action": {"action": "click"}}},
             "notetaker": {"output": None}}  # a role whose answer did not parse is left out
    steps = [s.model_copy(update={"roles_json": json.dumps(roles)}) for s in unit.steps]
    out = reasoning.reason([dataclasses.replace(unit, steps=steps)], ws, ws.ledger.open_run("test", "team").run_id, "")
    [sample] = out.rows["reasoning_samples"]
    assert sample.hint_style == "distilled" and sample.kept and not sample.hinted_with_answer
    assert sample.reasoning == "The plan says open the note next, so I act on it."
    [row] = out.rows["train_reasoning"]
    assert row.hint_style == "distilled" and "The plan says open the note" in row.messages_json
    asked = model.requests[-1]["body"]["messages"][-1]
    assert "notetaker" not in json.dumps(asked) and "worker:" in json.dumps(asked)


def test_screens_a_killed_run_committed_to_grounding_alone_are_still_its_work(recorded, grounded, model):
    """A run killed between the `grounding` and `train_grounding` commits: on rerun, its own rows in `grounding`
    are not an earlier run's work (the ledger has not seen the stage commit), or it would plan fewer shards
    than it ran. Once the ledger marks the commit, they are."""
    root, _, snapshots = recorded
    ws = workspace(root, model.url, iou_threshold=0.4)  # another configuration: every screen is work again
    before = {s.screenshot for s in grounding.load_screens(ws, snapshots["steps"]).units}
    run = ws.ledger.open_run("test", "killed").run_id
    rows = ws.catalog.load("grounding").with_columns(pl.lit(run).alias("run_id"))
    this_config = config_hash(ws.settings, grounding.SECTIONS, grounding.prompt_fingerprint(ws))
    ws.catalog.commit_rows("grounding", rows.to_dicts(), Lineage(
        stage="grounding", run_id=run, commit_key=commit_key(run, "grounding", "grounding"), config_hash=this_config,
        code_version="-"))
    assert {s.screenshot for s in grounding.load_screens(ws, snapshots["steps"]).units} == before

    ws.ledger.plan_stage(run, "grounding", 1)
    ws.ledger.mark_committed(run, "grounding", {})
    after = {s.screenshot for s in grounding.load_screens(ws, snapshots["steps"]).units}
    assert set(rows["screenshot"]) & before and after == before - set(rows["screenshot"])


def test_a_reasoning_cut_off_at_max_tokens_keeps_its_whole_sentences_only():
    """A thought that stops mid-sentence is no example: the whole sentences stay (what the act check then sees),
    and an answer with none is no reasoning, saying why."""
    from trajforge.synth.ask import Answer

    def said(text: str, finish: str) -> Answer:
        return Answer(text, None, None, "m", "reasoning_cot@1", finish)

    cut = said("The cart costs $12.50 now. I should open the Cart link. Then check the", "length")
    assert reasoning.reasoning_text(cut) == ("The cart costs $12.50 now. I should open the Cart link.", None)
    assert reasoning.reasoning_text(said("Open the Cart link", "stop")) == ("Open the Cart link", None)
    assert reasoning.reasoning_text(said("The cart costs $12", "length")) == (
        "", "no reasoning: cut off at max_tokens before its first sentence ended")
    assert reasoning.reasoning_text(Answer("", None, "no answer: timeout", "m", "p")) == (
        "", "no reasoning: no answer: timeout")


def test_a_rejected_reasonings_count_says_why():
    assert reasoning._rejection("point (364, 28) outside the target box [30, 683, 58, 40]") == "point differs"
    assert reasoning._rejection("no reasoning: cut off at max_tokens before its first sentence ended") == (
        "no reasoning: cut off at max_tokens before its first sentence ended")
    assert reasoning._rejection("no reasoning: no answer: ReadTimeout after 30 s") == "no reasoning: no answer"
    assert reasoning._rejection("prediction unusable: not one JSON object") == "prediction unusable"
    # synth.match's reasons that start with no argument's name are named, not 'no differs' or 'the differs'
    assert reasoning._rejection("no point") == "point missing"
    assert reasoning._rejection("no drop point") == "drop point missing"
    assert reasoning._rejection("the trusted action has no point") == "trusted action has no point"
    assert reasoning._rejection("drop point 30 px from the trusted point") == "drop differs"


def _cart_step(ws: Workspace, **more: Any) -> Step:
    """A mobile step that taps the Cart link at (5, 9), on a real (white) screenshot."""
    buffer = io.BytesIO()
    Image.new("RGB", (390, 844), "white").save(buffer, format="PNG")
    png = ws.blobs.put(buffer.getvalue()).sha256
    return Step(run_id="r", step_id="e:0", episode_id="e", step_index=0, screenshot_before=png, screenshot_after=png,
                width=390, height=844, url_before="u", url_after="u", title_before="t", title_after="t",
                ax_tree_before="", action_type="click", action_json='{"x": 5, "y": 9}', action_valid=True,
                target_role="link", target_name="Cart", target_box=[0, 0, 20, 20], thought="", raw_output="",
                duration_ms=0, **more)


def _cart_workspace(root: Path, model: ModelServer, **synth: Any) -> Workspace:
    """A workspace asking `model` for reasonings in the simple style, which names the demonstrated action: tapping
    the Cart link of `_cart_step` for "Open the cart"."""
    model.truth = {("Open the cart", 390, 0): {"type": "click", "x": 5, "y": 9}}
    return notes_workspace(root, model.url, cache=False, vision=True, synth={
        "writer": "model", "hint_styles": ["simple"], "reasoning_tries": 1} | synth)


def test_a_reasoning_row_holds_the_trusted_action_as_the_prediction_and_an_unusable_one_is_not_compared(
        tmp_path, model):
    """The trusted action is stored with its `type`, as the predicted one (and PAL-UI's and CES's rows) are; a
    prediction that is no action was compared with nothing: `matched` None, as the schema says."""
    from trajforge.synth.trusted import TrustedEpisode

    ws = _cart_workspace(tmp_path, model)
    step = _cart_step(ws)
    unit = TrustedEpisode("e", "q", "Open the cart", "mobile", "reference", [step])
    [matched] = reasoning._sample(reasoning._Reasoner(ws, StageOutput(), "r"), unit, step, [])
    assert matched.kept and matched.matched is True
    assert json.loads(matched.trusted_action_json) == json.loads(matched.predicted_action_json) == {
        "type": "click", "x": 5, "y": 9}

    model.broken = {"act"}  # the call predicted from the reasoning does not parse
    try:
        unusable, hinted = reasoning._sample(reasoning._Reasoner(ws, StageOutput(), "r"), unit, step, [])
    finally:
        model.broken = set()
    assert unusable.match_reason.startswith("prediction unusable: not one JSON object") and not unusable.kept
    assert unusable.predict_raw_output == "not a call"
    assert unusable.matched is None and unusable.predicted_action_json is None
    assert hinted.hint_style == "hinted" and hinted.kept
    assert json.loads(unusable.trusted_action_json) == json.loads(hinted.trusted_action_json) == {
        "type": "click", "x": 5, "y": 9}


def test_a_step_whose_roles_left_no_output_is_sampled_not_distilled_from_the_action_alone(tmp_path, model):
    """Roles recorded without an output give the distillation nothing but the action: such a reasoning would be
    the answer's, unflagged. The step is sampled as any other, and kept when its prediction matches."""
    from trajforge.synth.trusted import TrustedEpisode

    ws = _cart_workspace(tmp_path, model, reasoning_steps_per_shard=1)
    step = _cart_step(ws, roles_json=json.dumps({"manager": {"output": None}, "worker": {"output": None}}))
    unit = TrustedEpisode("e", "q", "Open the cart", "mobile", "reference", [step])
    model.requests.clear()
    out = reasoning.reason([unit], ws, ws.ledger.open_run("test", "no roles").run_id, "")
    [sample] = out.rows["reasoning_samples"]
    assert sample.hint_style == "simple" and sample.kept and sample.matched and not sample.hinted_with_answer
    asked = [message_text(r["body"]["messages"][0]) for r in model.requests]
    assert asked and not any("A team of agents decided" in system for system in asked)
    [row] = out.rows["train_reasoning"]
    assert row.hint_style == "simple" and not row.hinted_with_answer


def test_reasoning_done_again_with_another_configuration_replaces_the_episodes_rows(recorded, model):
    """Done again with another configuration (here `synth.reasoning_tries`), the stage takes each episode's
    earlier rows out of both tables in the commit that adds its new ones: the latest versions hold the newest
    run's rows only, each sample once (an episode the new budget no longer reaches loses its older rows)."""
    root, _, snapshots = recorded
    for tries in (3, 4):
        ws = workspace(root, model.url, reasoning_steps_per_shard=2, reasoning_tries=tries)
        model.truth = _demonstrated(ws, snapshots["steps"])
        run = ws.ledger.open_run("test", f"tries {tries}").run_id
        out = run_inline(reasoning.STAGE, ws, run, snapshots["steps"])
    for table, key in (("reasoning_samples", "reasoning_id"), ("train_reasoning", "sample_id")):
        rows = ws.catalog.load(table, out[table]).to_dicts()
        assert rows and {r["run_id"] for r in rows} == {run}, table
        assert len({r[key] for r in rows}) == len(rows), table
    assert {r["episode_id"] for r in ws.catalog.load("train_reasoning", out["train_reasoning"]).to_dicts()} <= set(
        ws.catalog.load("steps", snapshots["steps"])["episode_id"])


def _reworded(folder: Path, name: str, tmp_path: Path) -> Path:
    """A copy of the prompts `folder` with `name`'s wording changed and its `version:` left as it was."""
    prompts = tmp_path / "prompts"
    shutil.copytree(folder, prompts)
    edited = prompts / f"{name}.yaml"
    edited.write_text(edited.read_text().replace("content: |\n", "content: |\n      Be brief.\n", 1))
    return prompts


def test_a_reworded_grounding_prompt_or_a_new_code_version_grounds_the_screens_again(recorded, grounded, model,
                                                                                      tmp_path, monkeypatch):
    """"Already grounded with this configuration" holds the stage's prompts as their files read and the code
    version: a prompt edited without a new `version:`, or a code fix, is new work, not every screen skipped."""
    root, _, snapshots = recorded
    ws = workspace(root, model.url)
    already = "screens already grounded with this configuration by an earlier run"
    assert grounding.load_screens(ws, snapshots["steps"]).stats[already] > 0
    with monkeypatch.context() as patch:
        patch.setattr(grounding, "PROMPTS", _reworded(grounding.PROMPTS, grounding.REPHRASE, tmp_path))
        assert grounding.load_screens(ws, snapshots["steps"]).stats[already] == 0
    monkeypatch.setattr(grounding, "code_version", lambda: "0.0+gfixed")
    assert grounding.load_screens(ws, snapshots["steps"]).stats[already] == 0


def test_grounding_and_semantics_name_the_episodes_version_they_read(recorded, grounded, model):
    """Each screen's app and viewport, each episode's viewport and instruction, come from `episodes`: the version
    read is the one the lineage names."""
    root, _, snapshots = recorded
    ws, out = grounded
    _, episodes = ws.catalog.resolve("episodes@latest")
    assert ws.catalog.lineage("grounding", out["grounding"]).inputs["episodes"] == episodes
    assert semantics.load_episodes(workspace(root, model.url), snapshots["steps"]).snapshots == {
        "steps": snapshots["steps"], "episodes": episodes}


def test_a_reworded_planning_prompt_is_new_work_and_a_new_code_version_is_not(recorded, model, tmp_path,
                                                                             monkeypatch):
    """The manual and plan ids hold the stage's prompts as their files read: a manual prompt edited without a new
    `version:` makes every manual new work. A code version does not: planning replaces no earlier row, so each
    commit would add every manual and plan again beside the last."""
    root, _, _ = recorded
    ws = workspace(root, model.url)
    _, episodes = ws.catalog.resolve("episodes@latest")

    def config() -> str:
        return planning.load_apps(ws, episodes).units[0].config

    before = config()
    with monkeypatch.context() as patch:
        patch.setattr(planning, "PROMPTS", _reworded(planning.PROMPTS, planning.MANUAL, tmp_path))
        assert config() != before
    with monkeypatch.context() as patch:  # a new release, as every module that asks `code_version()` sees it
        patch.setattr(llm_workspace, "version", lambda _: "0.0.fixed")
        code_version.cache_clear()
        try:
            assert code_version().startswith("0.0.fixed") and config() == before
        finally:
            code_version.cache_clear()


def test_a_manuals_trial_rolls_out_with_the_nights_policy_model_and_names_it(recorded, model):
    """The trial that gives `success_with` runs as the night's rollout does, with the loop iteration's model
    (`loop.models`) that gave `success_before`; the lineage names its policy, model and prompt versions."""
    root, _, _ = recorded
    synth = {"manual_trials": 1, "plans_per_app": 0}
    _, episodes = workspace(root, model.url).catalog.resolve("episodes@latest")
    def config(**loop: Any) -> str:
        return planning.load_apps(notes_workspace(root, model.url, synth=synth, loop=loop), episodes).units[0].config

    assert config(models={0: "/srv/iteration-1"}) != config()  # the loop's model decides the trials
    assert config(max_guided=5, train_steps=7) == config()  # and nothing else of the loop: not new work
    # The night's policy is the end-to-end model, and iteration 0 is served by `trained`, not the default `m`.
    endpoints = {name: {"base_url": model.url, "model": served, "max_retries": 0, "timeout_s": 10, "vision": True}
                 for name, served in (("m", "scripted"), ("trained", "trained-iteration-0"))}
    ws = Workspace.open(Settings(
        warehouse={"path": root / "wh"}, synth=synth, loop={"models": {0: "trained"}},
        query_gen={"apps": ["notes"], "num_queries": 2, "atomic_per_app": 1, "deep_search_apps": []},
        rollout={"policy": "gui_owl_e2e", "contexts": 1}, llm={"endpoints": endpoints, "default": "m", "reask": 0}))
    model.requests.clear()
    out = run_inline(planning.STAGE, ws, ws.ledger.open_run("test", "manual-trial-model").run_id, episodes)
    added = ws.catalog.rows_added("manuals", out["manuals"])[0]
    [manual] = added.filter(pl.col("trial_queries").list.len() > 0).to_dicts()
    assert manual["trial_episodes"] and manual["success_with"] is not None
    turns = [r["body"] for r in model.requests if "You are a GUI agent" in message_text(r["body"]["messages"][0])]
    assert len(turns) == len(manual["trial_episodes"])  # one step each: the scripted policy ends at once
    assert {b["model"] for b in turns} == {"trained-iteration-0"}
    first_line = manual["text"].splitlines()[0]
    assert all(f"Guidance for this task: {first_line}" in message_text(b["messages"][-1]) for b in turns)
    lineage = ws.catalog.lineage("manuals", out["manuals"])
    assert lineage.models["policy"] == "gui_owl_e2e" and lineage.models["policy_model"] == "trained-iteration-0"
    assert lineage.prompts["gui_owl_e2e"] == prompt_version("gui_owl_e2e")
    assert lineage.models[planning.MANUAL] == "scripted" and lineage.prompts[planning.MANUAL]


def test_grounding_a_screen_again_with_another_configuration_replaces_its_rows(recorded, grounded, model):
    """A new tau_g (or model, or prompt) grounds every screen again: its earlier rows leave both tables in the
    commit that adds its new ones, so `grounding@latest` holds each annotation once and `train_grounding@latest`
    each screen's questions once. Last in the file: the screens are no longer grounded as `grounded` left them."""
    root, _, snapshots = recorded
    ws, _ = grounded
    before = ws.catalog.load("grounding")
    again = workspace(root, model.url, iou_threshold=0.45)
    out = run_inline(grounding.STAGE, again, again.ledger.open_run("test", "regrounded").run_id, snapshots["steps"])
    assert again.catalog.lineage("grounding", out["grounding"]).kept["grounding"] > 0
    for table, key in (("grounding", "sample_id"), ("train_grounding", "screenshot")):
        latest = again.catalog.load(table, out[table])
        assert latest.group_by(key).agg(pl.col("run_id").n_unique())["run_id"].max() == 1, table
    latest = again.catalog.load("grounding", out["grounding"])
    assert latest["sample_id"].n_unique() == latest.height
    assert set(latest["screenshot"]) == set(before["screenshot"])

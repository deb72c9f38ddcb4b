"""The critics on real episodes of the bundled shop: annotation, pre-filters, step critic,
trajectory channels and consensus.

Episodes are recorded once in headless Chromium (a replay of the reference path, which
succeeds, and a scripted episode with an invalid action, idle and repeated actions and a
swipe). Model calls go to the embedded model (a handful), or, for what it cannot do
(see images, fail on demand), to the scripted OpenAI-compatible server of
test_llm_failures.py.
"""

from __future__ import annotations

import base64
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
from conftest import ScriptedPolicy, prompt_version, prompt_versions, require
from PIL import Image, ImageDraw, ImageFont
from scripted import Reply, ScriptedServer

from trajforge.critics.annotate import BOX_COLOR, POINT_COLOR, RING_RADIUS, annotate
from trajforge.critics.stage import REFERENCE_NOT_JUDGED, EpisodeUnit, checker_for, judge, load_episodes
from trajforge.critics.stage import STAGE as CRITICS
from trajforge.critics.steps import StepJudgement
from trajforge.critics.trajectory import ChannelAnswer, caption, consensus, not_asked
from trajforge.data.blobs import BlobStore
from trajforge.data.catalog import Lineage, commit_key
from trajforge.envs.apps import AppServer, load_app
from trajforge.envs.browser import BrowserEnv
from trajforge.llm import Gateway, ocr
from trajforge.llm.local import missing_models
from trajforge.llm.ocr import OcrReader
from trajforge.llm.structured import ParseError, parse
from trajforge.llm.workspace import Workspace
from trajforge.rollout.episode import run_episode
from trajforge.rollout.replay import ReplayPolicy
from trajforge.schemas.config import CriticSettings, LLMSettings, Settings
from trajforge.schemas.records import Episode, Query
from trajforge.tasks.runner import plan

SCRIPT = [
    {"type": "fly"},
    {"type": "wait", "seconds": 0},
    {"type": "wait", "seconds": 0},
    {"type": "swipe", "x": 200, "y": 700, "x2": 200, "y2": 300},
    {"type": "terminate", "status": "failure"},
]


def cart_query() -> Query:
    """The shop's 'add to cart' goal with its first slot values, on its first page path."""
    spec = load_app("shop").spec
    slots = {slot: values[0] for slot, values in spec.slot_values().items()}
    goal = spec.pages["cart"].goal
    assert goal is not None
    path = next(nx.all_simple_paths(spec.graph(), spec.start, "cart"))
    return Query(
        run_id="t", query_id="cart-0", app="shop", source="page_graph", instruction=goal.instruction.format_map(slots),
        path=path, slots_json=json.dumps(slots), checker=goal.checker,
        checker_params_json=json.dumps({k: v.format_map(slots) for k, v in goal.params.items()}),
        max_steps=20, generator="tests", created_at=datetime.now(timezone.utc),
    )


def unit(episode: Any, steps: list[Any], query: Any) -> EpisodeUnit:
    """An episode as the critics stage gets it: with its steps and query."""
    return EpisodeUnit(episode, steps, query)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, chromium: Path) -> tuple[BlobStore, dict[str, dict[str, Any]]]:
    """A replayed (successful) and a scripted (failed) shop episode on a mobile screen."""
    blobs = BlobStore(tmp_path_factory.mktemp("critics") / "blobs")
    shop = load_app("shop")
    query = cart_query()
    with AppServer(shop) as server, BrowserEnv(server.base_url + "/", viewport="mobile", chromium=chromium) as env:
        start = server.base_url + shop.spec.pages[shop.spec.start].url
        replayed = run_episode(env, ReplayPolicy(shop.spec), query, run_id="t", episode_id="ep-replay", blobs=blobs,
                               max_steps=query.max_steps, start_url=start)
        scripted = run_episode(env, ScriptedPolicy(SCRIPT), query, run_id="t", episode_id="ep-scripted", blobs=blobs,
                               max_steps=len(SCRIPT), start_url=start)
    return blobs, {"replay": unit(*replayed, query), "scripted": unit(*scripted, query)}


def pixels(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


# ---------------------------------------------------------------- annotation


def test_annotation_rings_the_click_and_boxes_its_target(recorded):
    blobs, episodes = recorded
    step = [s.model_dump() for s in episodes["replay"].steps][0]  # click on the 'Margherita Pizza' link
    action = {"type": step["action_type"], **json.loads(step["action_json"])}
    before = blobs.get(step["screenshot_before"])
    drawn = pixels(annotate(before, action, step["target_box"]))
    original = pixels(before)
    assert drawn.size == original.size
    x, y = action["x"], action["y"]
    ring = [drawn.getpixel((x + dx, y + dy)) for dx, dy in ((RING_RADIUS - 1, 0), (0, -(RING_RADIUS - 1)))]
    assert ring == [POINT_COLOR, POINT_COLOR], "the ring is drawn around the click point"
    assert drawn.getpixel((x, y)) == original.getpixel((x, y)), "the click point itself stays visible"
    bx, by, bw, bh = step["target_box"]
    assert drawn.getpixel((round(bx + 1), round(by + bh / 2))) == BOX_COLOR, "left edge of the target's box"
    far = (original.width - 5, original.height - 5)
    assert drawn.getpixel(far) == original.getpixel(far), "nothing else is painted"


def test_annotation_draws_the_path_of_a_swipe(recorded):
    blobs, episodes = recorded
    step = next(s for s in [s.model_dump() for s in episodes["scripted"].steps] if s["action_type"] == "swipe")
    args = json.loads(step["action_json"])
    drawn = pixels(annotate(blobs.get(step["screenshot_before"]), {"type": "swipe", **args}, None))
    midway = ((args["x"] + args["x2"]) // 2, (args["y"] + args["y2"]) // 2)
    assert drawn.getpixel(midway) == POINT_COLOR, "the line from start to end"
    assert drawn.getpixel((args["x2"], args["y2"])) == POINT_COLOR, "the dot at the end"


def test_annotation_of_an_action_with_no_place_is_none(recorded):
    blobs, episodes = recorded
    step = [s.model_dump() for s in episodes["scripted"].steps][1]
    assert annotate(blobs.get(step["screenshot_before"]), {"type": "wait", "seconds": 0}, None) is None


# ---------------------------------------------------------------- pre-filters and step critic


def test_prefilters_flag_steps_and_settle_them_without_a_model(recorded):
    blobs, episodes = recorded
    out = judge([episodes["scripted"]], run_id="r", settings=CriticSettings(), config_hash="h",
                checker_for=checker_for, blobs=blobs, gateway=None)
    critiques = out.rows["step_critiques"]
    assert [c.flags for c in critiques] == [
        ["invalid_action", "no_change"], ["no_change"], ["no_change", "repeated_action"], [], ["no_change"],
    ]
    # the episode ends giving up (terminate with status failure): HARMFUL, and its summary says so, since the
    # trajectory critic's channels read the summaries in place of the steps
    assert [c.label for c in critiques] == ["HARMFUL", "NEUTRAL", "HARMFUL", "GOOD", "HARMFUL"]
    assert [c.critic for c in critiques] == ["prefilter@2"] * 3 + ["rules@1", "prefilter@2"]
    assert "failure" in critiques[-1].summary
    assert "Unknown action type" in critiques[0].analysis or "unknown action type" in critiques[0].analysis
    assert out.stats["steps judged by prefilter@2"] == 4


def test_step_judgement_is_parsed_strictly():
    good = '{"analysis": "Opened the pizza page.", "summary": "opened the pizza", "label": "GOOD"}'
    assert parse(good, "json", StepJudgement).label == "GOOD"
    wordy = json.dumps({"analysis": "a", "summary": " ".join(["word"] * 31), "label": "GOOD"})
    bad = {
        wordy: "at most 30",
        '{"analysis": "a", "summary": "s", "label": "good"}': "label",
        '{"analysis": "a", "summary": "s", "label": "GOOD", "score": 1}': "score",
        'Label: GOOD {"analysis": "a", "summary": "s", "label": "GOOD"}': "not one JSON object",
    }
    for text, says in bad.items():
        with pytest.raises(ParseError, match=says):
            parse(text, "json", StepJudgement)


def endpoint_gateway(url: str, blobs: BlobStore, vision: bool) -> Gateway:
    settings = LLMSettings.model_validate({"endpoints": {"vl": {
        "base_url": url, "model": "scripted-vl", "vision": vision, "max_retries": 0, "timeout_s": 5,
    }}, "reask": 0, "cache": False})
    return Gateway(settings, blobs=blobs)


def test_step_critic_records_unparsed_answers_and_failed_calls(recorded):
    blobs, episodes = recorded
    settings = CriticSettings(step_model="vl", text_channel=False)
    judged = '{"analysis": "The page opened.", "summary": "opened the page", "label": "GOOD"}'
    replies = (Reply(text="GOOD, it opened the page"), Reply(status=400), Reply(judged))
    with ScriptedServer(*replies) as server, endpoint_gateway(server.url, blobs, vision=True) as gw:
        out = judge([episodes["replay"]], run_id="r", settings=settings, config_hash="h",
                    checker_for=checker_for, blobs=blobs, gateway=gw)
    first, second, third = out.rows["step_critiques"][:3]
    assert (first.label, first.raw_output) == (None, "GOOD, it opened the page")
    assert first.critic == prompt_versions("critic_step")
    assert first.parse_error.startswith("not one JSON object")
    assert first.summary.startswith("click"), "an unusable answer leaves the action as the history's summary"
    assert second.label is None and "no answer" in second.parse_error and "BadRequestError" in second.parse_error
    assert (third.label, third.parse_error, third.summary) == ("GOOD", None, "opened the page")
    assert out.stats["step critiques without a label (unparsed or no answer)"] == 2


# ---------------------------------------------------------------- trajectory channels and consensus


def answer(value: str | None) -> ChannelAnswer:
    return ChannelAnswer(value, f"said {value}", "m") if value else not_asked("no vision model configured")  # type: ignore[arg-type]


@pytest.mark.parametrize(("rule", "k", "text", "multimodal", "checker", "success", "says"), [
    ("paper", 2, "success", "success", "failure", True, "both model channels say success"),
    ("paper", 2, "success", None, "success", False, "multimodal: no answer (not asked: no vision model"),
    ("paper", 2, "failure", "success", "success", False, "text: failure"),
    ("k_of_n", 2, "success", None, "success", True, "2 of 3 channels say success (checker, text)"),
    ("k_of_n", 2, "failure", None, "success", False, "no answer from multimodal"),
    ("k_of_n", 1, "failure", None, "success", True, "1 needed"),
    ("checker_first", 2, "success", "success", "failure", False, "checker_first: said failure"),
    ("checker_first", 2, "success", None, None, False, "no checker answer, so paper"),
])
def test_consensus_rules_and_a_missing_channel(rule, k, text, multimodal, checker, success, says):
    channels = {"text": answer(text), "multimodal": answer(multimodal), "checker": answer(checker)}
    got, reason = consensus(rule, channels, k)
    assert got is success and says in reason, reason


def test_multimodal_channel_sends_the_screenshots_to_a_vision_endpoint(recorded):
    blobs, episodes = recorded
    episode = episodes["replay"]
    settings = CriticSettings(step_critic="rules", text_channel=False, multimodal_model="vl", multimodal_images=2)
    reply = Reply(text='{"reason": "The cart holds a Small Margherita Pizza.", "verdict": "correct"}')
    with ScriptedServer(reply) as server, endpoint_gateway(server.url, blobs, vision=True) as gw:
        out = judge([episode], run_id="r", settings=settings, config_hash="h",
                    checker_for=checker_for, blobs=blobs, gateway=gw)
    assert len(server.requests) == 1, "one request per episode; the step critic asked no model"
    body = server.requests[0]["body"]
    assert body["model"] == "scripted-vl"
    user = body["messages"][-1]["content"]
    images = [p["image_url"]["url"] for p in user if p["type"] == "image_url"]
    newest = [s.screenshot_after for s in episode.steps][-2:]
    assert [base64.b64decode(url.split(",", 1)[1]) for url in images] == [blobs.get(h) for h in newest]
    assert all(url.startswith("data:image/png;base64,") for url in images)
    text = next(p["text"] for p in user if p["type"] == "text")
    assert episode.episode.instruction in text and "Step 1: click" in text
    verdict = out.rows["verdicts"][0]
    channels = json.loads(verdict.channels_json)
    assert channels["multimodal"]["answer"] == "success" and channels["multimodal"]["model_id"] == "scripted-vl"
    assert channels["multimodal"]["reason"] == "The cart holds a Small Margherita Pizza."
    assert channels["text"] == {**channels["text"], "answer": None, "asked": False}
    assert channels["checker"]["answer"] == "success" and verdict.success
    assert out.models["trajectory_multimodal"] == "scripted-vl"
    assert out.prompts["critic_trajectory_multimodal"] == prompt_version("critic_trajectory_multimodal")


def test_multimodal_channel_is_not_asked_of_a_model_without_vision(recorded):
    blobs, episodes = recorded
    settings = CriticSettings(step_critic="rules", text_channel=False, multimodal_model="vl", consensus="paper")
    with ScriptedServer(Reply()) as server, endpoint_gateway(server.url, blobs, vision=False) as gw:
        out = judge([episodes["replay"]], run_id="r", settings=settings, config_hash="h",
                    checker_for=checker_for, blobs=blobs, gateway=gw)
    assert server.requests == []
    verdict = out.rows["verdicts"][0]
    multimodal = json.loads(verdict.channels_json)["multimodal"]
    assert multimodal["asked"] is False and "does not take images" in multimodal["reason"]
    assert not verdict.success and "needs both model channels" in verdict.reason, "the paper's rule is cautious"


def test_an_unknown_critic_model_fails_before_any_work(recorded):
    blobs, episodes = recorded
    with Gateway(LLMSettings(cache=False), blobs=blobs) as gw, pytest.raises(ValueError, match="no model named 'gpt'"):
        judge([episodes["replay"]], run_id="r", settings=CriticSettings(text_model="gpt"), config_hash="h",
              checker_for=checker_for, blobs=blobs, gateway=gw)


def test_step_critic_and_text_channel_on_the_embedded_model(recorded):
    """The default critics on the embedded model: it judges the replay's three clicks (the
    terminate step is settled by the pre-filters) and answers the text channel."""
    require(missing_models() is None, str(missing_models()))
    blobs, episodes = recorded
    with Gateway(LLMSettings(reask=0, cache=False), blobs=blobs) as gw:
        out = judge([episodes["replay"]], run_id="r", settings=CriticSettings(), config_hash="h",
                    checker_for=checker_for, blobs=blobs, gateway=gw)
        assert gw.stats.calls == 4
    critiques = out.rows["step_critiques"]
    asked = [c for c in critiques if c.critic == prompt_versions("critic_step")]
    assert len(asked) == 3 and critiques[-1].critic == "prefilter@2"
    for c in asked:
        assert c.observation_mode == "ocr" and c.model_id != "none" and c.raw_output
        assert c.annotated_screenshot in blobs and c.annotated_screenshot != c.step_id
        assert (c.label is None) == (c.parse_error is not None), "a label, or the reason there is none"
    text = json.loads(out.rows["verdicts"][0].channels_json)["text"]
    assert text["asked"] and text["prompt_version"] == prompt_version("critic_trajectory_text") and text["raw_output"]
    assert text["answer"] in ("success", "failure") or text["reason"].startswith("unparsed answer")
    assert out.models["trajectory_text"] == text["model_id"]


def commit_night(ws: Workspace, episodes: dict[str, dict[str, str | None]]) -> None:
    """A night's queries, then per stage its episodes (id -> source) of the cart query, each with no step."""
    query = cart_query()

    def commit(table: str, rows: list[Any], stage: str, **inputs: int) -> int:
        return ws.catalog.commit_rows(table, rows, Lineage(
            stage=stage, run_id="night", commit_key=commit_key("night", stage, table), inputs=inputs,
            config_hash="x", code_version="x"))

    def episode(episode_id: str, source: str | None) -> Episode:
        now = datetime.now(timezone.utc)
        return Episode(run_id="night", episode_id=episode_id, query_id=query.query_id, app="shop",
                       instruction=query.instruction, policy="replay", model_id="replay", prompt_version="",
                       viewport="mobile", status="terminated", num_steps=0, final_url="", final_state_json="{}",
                       started_at=now, finished_at=now, source=source)

    queries = commit("queries", [query], "history")
    for stage, sources in episodes.items():
        commit("episodes", [episode(i, source) for i, source in sources.items()], stage, queries=queries)
        commit("steps", [], stage, queries=queries)


def test_reference_episodes_of_the_run_are_counted_not_judged(tmp_path: Path) -> None:
    """The reference stage writes episodes into the same night as the rollout; the critics leave them to it, and
    say so in the lineage's counts, so the episodes the night wrote add up to those judged and those counted."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    commit_night(ws, {"reference": {"r1": "reference", "r2": "reference"}, "rollout": {"p1": None}})
    inputs = load_episodes(ws, None)
    assert [u.episode.episode_id for u in inputs.units] == ["p1"]
    assert inputs.stats == {REFERENCE_NOT_JUDGED: 2}


def test_the_ocr_engine_the_critics_read_is_part_of_their_config_hash(tmp_path, monkeypatch):
    """The text channel reads the final screen as OCR text: another engine writes other text, so other verdicts.
    A resumed night that changed `synth.ocr_backend` must not mix the two engines' verdicts under one hash."""
    real = ocr.version
    monkeypatch.setattr(ocr, "version", lambda package: "3.1.0" if package == "paddleocr" else real(package))
    for part in ("det", "rec"):
        (tmp_path / "paddle" / part).mkdir(parents=True)
        (tmp_path / "paddle" / part / "inference.yml").write_text(f"model: {part}")
    paddle = {"paddle_det_dir": tmp_path / "paddle" / "det", "paddle_rec_dir": tmp_path / "paddle" / "rec"}

    def config(backend: str, **critics: Any) -> str:
        ws = Workspace.open(Settings(warehouse={"path": tmp_path / backend / str(len(critics))}, critics=critics,
                                     synth={"ocr_backend": backend, **paddle}))
        commit_night(ws, {"rollout": {"p1": None}})
        return plan(CRITICS, ws, "night", None).config_hash

    assert config("rapidocr") != config("paddleocr")
    rules = {"step_critic": "rules", "text_channel": False}
    assert config("rapidocr", **rules) == config("paddleocr", **rules), "critics that read no OCR keep their hash"


def test_the_text_channel_reads_the_final_screen_and_the_lineage_names_the_ocr(recorded):
    blobs, episodes = recorded
    settings = CriticSettings(step_critic="rules", text_model="vl")
    reply = Reply(text='{"reason": "The cart holds the pizza.", "verdict": "correct"}')
    with ScriptedServer(reply) as server, endpoint_gateway(server.url, blobs, vision=False) as gw:
        out = judge([episodes["replay"]], run_id="r", settings=settings, config_hash="h",
                    checker_for=checker_for, blobs=blobs, gateway=gw)
        final = caption(blobs.get(episodes["replay"].steps[-1].screenshot_after), gw.ocr)
        assert out.models["ocr"] == gw.ocr.engine_id
    assert "Margherita" in final and final in json.dumps(server.requests[0]["body"]["messages"], ensure_ascii=False)
    assert json.loads(out.rows["verdicts"][0].channels_json)["text"]["answer"] == "success"


def test_a_caption_keeps_the_quotes_the_screen_shows():
    """An inch mark or a quoted word reaches the text channel as the OCR read it."""
    image = Image.new("RGB", (480, 200), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 24)
    draw.text((20, 100), '"Quoted" text', fill="black", font=font)
    draw.text((20, 20), 'Size: 5"', fill="black", font=font)
    png = io.BytesIO()
    image.save(png, format="PNG")
    assert caption(png.getvalue(), OcrReader()) == 'Size: 5" | "Quoted" text'

"""`trajforge view`: the static site of a real night, opened in Chromium from file:// as a person would."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import polars as pl
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, sync_playwright
from test_pipeline import workspace

from trajforge.critics.annotate import POINT_COLOR, RING_RADIUS
from trajforge.data.catalog import Lineage
from trajforge.envs.browser import CHROMIUM, CHROMIUM_ARGS
from trajforge.flows.viewer import MASK, ViewError, build_viewer
from trajforge.llm.workspace import Workspace

pytestmark = pytest.mark.browser

SECRET = "hunter2-Zq9x"
RUN = "view-test"


@pytest.fixture(scope="module")
def night(replay_night) -> tuple[Workspace, str]:
    """The replay night's workspace and run id."""
    cwd, tag = replay_night
    ws = workspace(cwd)
    return ws, next(i.run_id for i in ws.catalog.history("train_e2e") if tag in i.tags)


@pytest.fixture(scope="module")
def crafted(night, tmp_path_factory) -> Workspace:
    """Two of the night's policy episodes in a warehouse of their own, changed where the night has no example:
    one is on another app and judged a failure, with markup in its task; the other types a password (a replay
    night succeeds at everything, on one app, and never logs in)."""
    ws, run_id = night
    mine = workspace(tmp_path_factory.mktemp("view-crafted"))
    episodes = ws.catalog.load("episodes").filter((pl.col("run_id") == run_id) & (pl.col("source") == "policy"))
    failed, typed = episodes.sort("episode_id").head(2)["episode_id"].to_list()
    tables = {t: ws.catalog.load(t).filter(pl.col("episode_id").is_in([failed, typed])).to_dicts()
              for t in ("episodes", "steps", "step_critiques", "verdicts")}
    for table, rows in tables.items():
        for row in rows:
            row["run_id"] = RUN
            if row["episode_id"] == failed and table == "episodes":
                row.update(app="notes", instruction="Open <b>Groceries</b> & pin it")
            if row["episode_id"] == failed and table == "verdicts":
                row.update(success=False, reason="the checker says the note is not pinned",
                           channels_json=json.dumps({"checker": {"answer": "failure", "reason": "not pinned"}}))
            if row.get("step_id") == f"{typed}:0" and table == "steps":
                row.update(action_type="type", action_json=json.dumps({"text": SECRET}), target_role="textbox",
                           target_name="Password", thought=f"I type {SECRET} into the password field")
            if row.get("step_id") == f"{typed}:0" and table == "step_critiques":
                row.update(summary=f"typed {SECRET} as asked")
        lineage = Lineage(stage="test", run_id=RUN, commit_key=f"view-{table}", config_hash="x", code_version="x")
        mine.catalog.commit_rows(table, rows, lineage)
    for step in tables["steps"]:
        for sha in (step["screenshot_before"], step["screenshot_after"]):
            mine.blobs.put(ws.blobs.get(sha))
    return mine


@pytest.fixture(scope="module")
def browser(chromium) -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[Page]:
    page = browser.new_page()
    yield page
    page.close()


def visible_rows(page: Page) -> list[str]:
    """The episode ids of the index rows the filters leave shown."""
    return page.locator("#episodes tbody tr:visible td:first-child").all_inner_texts()


def open_episode(page: Page, episode_id: str) -> None:
    """Follow the index's link to the episode's page."""
    page.locator("#episodes a", has_text=episode_id).click()
    page.wait_for_url("**/episode-*.html")


def check_episode_page(page: Page, episode: dict) -> None:
    """The page is the episode's: its task, one screenshot per step plus the final screen, every image loaded."""
    assert page.locator("h1").inner_text() == episode["instruction"]
    assert page.locator(".step").count() == episode["num_steps"]
    widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
    assert len(widths) == episode["num_steps"] + 1 and all(w > 0 for w in widths), widths


def test_run_site_lists_the_run_and_links_every_episode(night, page, tmp_path):
    ws, run_id = night
    episodes = ws.catalog.load("episodes").filter(pl.col("run_id") == run_id)
    build_viewer(ws, run_id, tmp_path / "site").parent.rename(tmp_path / "moved")  # links are relative: it travels
    page.goto((tmp_path / "moved" / "index.html").as_uri())
    assert sorted(visible_rows(page)) == sorted(episodes["episode_id"])
    for source in ("reference", "policy"):
        page.select_option("#filter-source", source)
        assert sorted(visible_rows(page)) == sorted(episodes.filter(pl.col("source") == source)["episode_id"])
    page.select_option("#filter-source", "")
    for episode in episodes.to_dicts():
        open_episode(page, episode["episode_id"])
        check_episode_page(page, episode)
        if episode["source"] == "policy":  # the rules critic labelled every step; references are checked instead
            assert page.locator(".step .critique").count() == episode["num_steps"]
            assert page.locator("h2 .success").count() == 1 and "checker" in page.locator("table").inner_text()
        page.go_back()


def test_episode_target_goes_under_the_warehouse_with_the_action_drawn(night, page):
    ws, run_id = night
    steps = ws.catalog.load("steps").filter(pl.col("run_id") == run_id)
    click = steps.filter((pl.col("action_type") == "click") & pl.col("action_valid")).sort("step_id").row(0, named=True)
    episode = ws.catalog.load("episodes").filter(pl.col("episode_id") == click["episode_id"]).row(0, named=True)
    index = build_viewer(ws, episode["episode_id"])
    assert index == ws.catalog.warehouse / "views" / episode["episode_id"] / "index.html"
    page.goto(index.as_uri())
    assert visible_rows(page) == [episode["episode_id"]]
    open_episode(page, episode["episode_id"])
    check_episode_page(page, episode)
    src = page.locator(f"#step-{click['step_index']} img").get_attribute("src")
    with Image.open(io.BytesIO((index.parent / src).read_bytes())) as image:
        x, y = json.loads(click["action_json"])["x"], json.loads(click["action_json"])["y"]
        assert image.convert("RGB").getpixel((round(x) + RING_RADIUS - 2, round(y))) == POINT_COLOR


def test_filters_hide_the_rows_they_should(crafted, page, tmp_path):
    episodes = {e["app"]: e["episode_id"] for e in crafted.catalog.load("episodes").to_dicts()}
    page.goto(build_viewer(crafted, RUN, tmp_path / "site").as_uri())
    page.select_option("#filter-verdict", "failure")
    assert visible_rows(page) == [episodes["notes"]]
    page.select_option("#filter-app", "shop")
    assert visible_rows(page) == [] and page.locator("#shown").inner_text() == "0 of 2 episodes shown"
    page.select_option("#filter-verdict", "success")
    assert visible_rows(page) == [episodes["shop"]]
    page.select_option("#filter-app", "")
    page.select_option("#filter-verdict", "")
    assert sorted(visible_rows(page)) == sorted(episodes.values())
    open_episode(page, episodes["notes"])
    assert page.locator("h1").inner_text() == "Open <b>Groceries</b> & pin it", "markup is shown as text"
    assert page.locator("h2 .failure").inner_text() == "failure"


def test_a_typed_password_is_never_shown(crafted, tmp_path):
    build_viewer(crafted, RUN, tmp_path / "site")
    pages = {p.name: p.read_text() for p in (tmp_path / "site").glob("*.html")}
    assert not any(SECRET in text for text in pages.values())
    assert sum(MASK in text for text in pages.values()) == 1, "the typing episode's page shows the mask"
    assert "<b>Groceries</b>" not in pages["index.html"] and "&lt;b&gt;Groceries&lt;/b&gt;" in pages["index.html"]


def test_without_a_target_the_run_of_the_newest_episode_is_shown(night, tmp_path):
    """Run ids start with their kind (`nightly-`, `rollout-`), so the newest run is found by its episodes' start
    times, not by sorting ids: here the newer run's id sorts first."""
    ws, run_id = night
    older, newer = ws.catalog.load("episodes").filter(pl.col("run_id") == run_id).sort("started_at").head(2)[
        "episode_id"].to_list()
    runs = {older: "rollout-20991231T000000", newer: "nightly-20000101T000000"}
    mine = workspace(tmp_path / "two-runs")
    for table in ("episodes", "steps"):
        rows = ws.catalog.load(table).filter(pl.col("episode_id").is_in(list(runs))).to_dicts()
        for row in rows:
            row["run_id"] = runs[row["episode_id"]]
            for shot in ("screenshot_before", "screenshot_after"):
                if shot in row:  # the pages show the screenshots, so they travel with the steps
                    mine.blobs.put(ws.blobs.get(row[shot]))
        mine.catalog.commit_rows(table, rows, Lineage(stage="test", run_id="made", commit_key=f"two-runs-{table}",
                                                      config_hash="x", code_version="x"))
    index = build_viewer(mine)
    assert index == mine.catalog.warehouse / "views" / runs[newer] / "index.html"
    assert newer in index.read_text() and older not in index.read_text()
    with pytest.raises(ViewError, match=r"no episodes yet; `trajforge run nightly`"):
        build_viewer(workspace(tmp_path / "empty"))


def test_an_unknown_target_says_what_is_accepted_and_writes_nothing(night, tmp_path):
    ws, run_id = night
    with pytest.raises(ViewError, match=rf"no run or episode 'nope'.*run id.*{run_id}.*episode id"):
        build_viewer(ws, "nope", tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_after_the_critics_judge_again_the_newest_judgement_is_shown(night, tmp_path):
    # The verdicts and critiques tables keep every run's judgement, and a scan reads the newest commit first:
    # the site showed the first verdict and listed every run's critiques of a step.
    ws, run_id = night
    # A judged one: the night's reference episodes (checked by the reference stage) have no verdict to show, and
    # the first episode id is one of them on most nights.
    episode_id = ws.catalog.load("verdicts").filter(pl.col("run_id") == run_id).sort("episode_id")["episode_id"][0]
    mine = workspace(tmp_path / "judged-twice")
    for judge in ("first-judge", "second-judge"):
        tables = ("episodes", "steps", "step_critiques", "verdicts") if judge == "first-judge" else (
            "step_critiques", "verdicts")
        for table in tables:
            rows = ws.catalog.load(table).filter(pl.col("episode_id") == episode_id).to_dicts()
            for row in rows:
                row["run_id"] = judge
                if table == "verdicts":
                    row.update(verdict_id=f"{judge}-v", reason=f"{judge} says so")
                if table == "step_critiques":
                    row.update(critique_id=f"{judge}-{row['critique_id']}", summary=f"{judge} looked")
                for shot in ("screenshot_before", "screenshot_after"):
                    if shot in row:
                        mine.blobs.put(ws.blobs.get(row[shot]))
            mine.catalog.commit_rows(table, rows, Lineage(stage="test", run_id=judge, commit_key=f"{judge}-{table}",
                                                          config_hash="x", code_version="x"))
    index = build_viewer(mine, episode_id, tmp_path / "site")
    page = next(p for p in index.parent.glob("episode-*.html")).read_text()
    assert "second-judge says so" in page and "first-judge" not in page
    assert page.count("second-judge looked") == mine.catalog.load("steps").height

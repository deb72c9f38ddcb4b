"""The benchmarks' own parts that decide what they measure: a benchmark never asserts, so a part that measures
the wrong thing (a kill point never reached, a rerun that hides its work, a baseline doing other work) would
print a figure that looks fine."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from catalog_bench import _deep_history, build_rows
from env_bench import serve_miniwob, start_script
from fault_bench import STAGES, _phase
from playwright.async_api import async_playwright
from rerun_bench import cached, night_env

from trajforge.data.catalog import Lineage
from trajforge.data.ledger import Ledger
from trajforge.envs.browser import CHROMIUM_ARGS
from trajforge.flows.stages import stages
from trajforge.llm.ocr import ocr_results
from trajforge.schemas.tables import to_arrow


def test_the_report_point_shows_once_every_stage_the_night_runs_is_committed(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'catalog.db'}")
    run = ledger.open_run("nightly", "replay").run_id
    night = [name for name in stages() if name != "train"]  # the replay night leaves loop.train off
    for name in night:
        ledger.plan_stage(run, name, 1)
        ledger.mark_committed(run, name, {})
    assert STAGES == night
    assert _phase(ledger.engine)[-1] == ("nightly", "report")
    ledger.finish_run(run, {})
    assert ("nightly", "report") not in _phase(ledger.engine)


def test_the_rerun_bench_nights_take_no_setting_of_the_callers_that_would_move_or_hide_their_work(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.setenv("TRAJFORGE_WAREHOUSE__CATALOG_URL", "sqlite:////elsewhere/catalog.db")
    monkeypatch.setenv("TRAJFORGE_SYNTH__OCR_CACHE_URL", "sqlite:////elsewhere/ocr.db")
    monkeypatch.setenv("TRAJFORGE_LLM__CACHE", "false")
    env = night_env(tmp_path)
    assert not [name for name in env if name.upper().startswith("TRAJFORGE_")]
    assert env["PREFECT_HOME"] == str(tmp_path / "prefect")


def test_the_rerun_bench_counts_the_ocr_readings_in_the_nights_catalog(tmp_path):
    assert cached(tmp_path) == (0, 0)  # before the first night
    folder = tmp_path / "data" / "warehouse"
    folder.mkdir(parents=True)
    engine = sa.create_engine(f"sqlite:///{folder / 'catalog.db'}")
    ocr_results.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(ocr_results.insert(), [{"sha256": f"{n:064x}", "engine": "rapidocr", "lines_json": "[]",
                                             "created_at": datetime.now(timezone.utc)} for n in range(3)])
    engine.dispose()
    assert cached(tmp_path) == (0, 3)


def test_the_catalog_bench_expires_no_more_than_a_short_history_holds_besides_the_current_version(tmp_path):
    lineage = Lineage(stage="rollout", run_id="bench-run", commit_key="bench-run:steps", config_hash="bench",
                      code_version="bench", kept={"steps": 100})
    _, expiry = _deep_history(tmp_path, None, to_arrow("steps", build_rows(100)), 2, lineage)
    # 2 versions, then 10 more timed: 11 of the 12 go through the catalog, and none is left for pyiceberg's own.
    assert [label for label, _ in expiry] == ["11 of 12 versions, catalog"]


@pytest.mark.browser
def test_the_env_bench_bare_loop_keeps_an_ended_episode_ended_as_the_pool_does(chromium):
    async def after_a_click_on_the_end() -> tuple[bool, float]:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
            page = await browser.new_page()
            await page.goto(base + "click-button.html")
            await page.evaluate(start_script(3))
            await page.evaluate("core.endEpisode(1)")  # solved: MiniWoB++ shows its START cover
            await page.mouse.click(80, 105)
            done, reward = json.loads(await page.evaluate("JSON.stringify([WOB_DONE_GLOBAL, WOB_REWARD_GLOBAL])"))
            await browser.close()
            return done, reward

    with serve_miniwob() as base:
        assert asyncio.run(after_a_click_on_the_end()) == (True, 1)

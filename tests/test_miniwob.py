"""MiniWoB++ tasks served from the miniwob package: seeded problems and their own rewards."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time

import pytest
from PIL import Image

from trajforge.data.blobs import BlobStore
from trajforge.envs.browser import BrowserEnv, Observation
from trajforge.envs.miniwob import (
    DEFAULT_TASKS,
    MiniWoBEnv,
    MiniWoBError,
    MiniWoBServer,
    check_reward,
    check_tasks,
    miniwob_queries,
    task_and_seed,
)
from trajforge.rollout.episode import run_episode
from trajforge.rollout.policy import PolicyOutput
from trajforge.schemas.records import Query

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server():
    with MiniWoBServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def env(chromium, server):
    env = MiniWoBEnv(BrowserEnv(viewport="desktop", chromium=chromium))
    yield env
    env.close()


def button_box(ax_tree: str, name: str) -> tuple[int, int]:
    line = next(line for line in ax_tree.splitlines() if line.strip().startswith(f'button "{name}"'))
    x, y, w, h = map(int, line.rsplit("(", 1)[1].rstrip(")").split(","))
    return x + w // 2, y + h // 2


def target_of(utterance: str) -> str:
    return utterance.split('"')[1]  # Click on the "no" button.


def test_default_tasks_exist_and_unknown_ones_are_named():
    assert len(DEFAULT_TASKS) >= 30
    check_tasks(list(DEFAULT_TASKS))
    with pytest.raises(MiniWoBError, match="click-buton"):
        check_tasks(["click-buton"])


def test_a_seed_always_makes_the_same_problem(env, server):
    first = env.reset("a", server.task_url("click-checkboxes", 7))
    tree = env.observe().ax_tree
    assert env.reset("b", server.task_url("click-checkboxes", 7)) == first
    assert env.observe().ax_tree == tree
    others = {env.reset("c", server.task_url("click-checkboxes", s)) for s in range(8, 12)}
    assert len(others | {first}) > 1


def test_the_right_click_earns_the_pages_reward(env, server):
    utterance = env.reset("s", server.task_url("click-button", 1))
    assert env.act({"type": "click", **dict(zip("xy", button_box(env.observe().ax_tree, target_of(utterance))))}) is None
    success, reason = check_reward({}, env.app_state())
    assert success and reason == "reward 1"


def test_the_first_ending_stands_after_more_clicks(env, server):
    """MiniWoB++ covers an ended task with a START button whose click starts a new, unseeded problem; the
    episode goes on until the policy terminates, and its checker reads the state last, so a click after the
    end must neither undo the reward (a solved task judged failed) nor start a problem the query did not ask."""
    utterance = env.reset("s", server.task_url("click-button", 1))
    x, y = button_box(env.observe().ax_tree, target_of(utterance))
    env.act({"type": "click", "x": x, "y": y})
    for _ in range(2):  # on the cover, where the button was
        assert env.act({"type": "click", "x": x, "y": y}) is None
    assert check_reward({}, env.app_state()) == (True, "reward 1")
    assert env.reset("t", server.task_url("click-button", 1)) == utterance  # the restart still starts it
    assert check_reward({}, env.app_state()) == (False, "the task did not end: no reward")


def test_a_wrong_click_or_no_action_is_a_failure(env, server):
    env.reset("s", server.task_url("click-button", 1))
    assert check_reward({}, env.app_state()) == (False, "the task did not end: no reward")
    for seed in range(2, 40):  # a problem with a button other than the asked one
        utterance = env.reset("s", server.task_url("click-button", seed))
        tree = env.observe().ax_tree
        others = [n for n in re.findall(r'button "([^"]+)"', tree) if n != target_of(utterance)]
        if others:
            break
    env.act({"type": "click", **dict(zip("xy", button_box(tree, others[0])))})
    success, reason = check_reward({}, env.app_state())
    assert not success and reason.startswith("reward -1")


def test_queries_carry_task_seed_and_utterance(chromium):
    queries, dropped = miniwob_queries(["click-button", "enter-text"], [0, 1], run_id="r", max_steps=6,
                                       chromium=chromium)
    assert not dropped
    assert [q.path for q in queries] == [["click-button"]] * 2 + [["enter-text"]] * 2
    assert len({q.query_id for q in queries}) == 4
    q = queries[2]
    assert q.app == "miniwob" and q.source == "miniwob" and q.checker == "reward"
    assert json.loads(q.checker_params_json) == {"task": "enter-text", "seed": "0"}
    assert q.instruction.startswith("Enter ") and q.instruction.endswith("press Submit.")


def test_a_natural_language_variant_gives_its_utterance_not_its_answer_fields(chromium):
    """email-inbox-nl-turk's page wraps the utterance with the solution's fields; the night once failed on it."""
    queries, dropped = miniwob_queries(["email-inbox-nl-turk", "click-button"], [0], run_id="r", max_steps=6,
                                       chromium=chromium)
    assert not dropped and [q.path[0] for q in queries] == ["email-inbox-nl-turk", "click-button"]
    assert isinstance(queries[0].instruction, str) and len(queries[0].instruction) > 10
    assert "fields" not in queries[0].instruction


def test_task_urls_round_trip(server):
    assert task_and_seed(server.task_url("click-tab", 42)) == ("click-tab", 42)
    with pytest.raises(MiniWoBError, match="not a MiniWoB"):
        task_and_seed("http://127.0.0.1/index.html")


def test_critics_checker_registry_judges_miniwob_and_bundled_apps():
    from trajforge.critics.stage import checker_for

    assert checker_for("miniwob")("reward", {}, {"done": True, "raw_reward": 1, "reason": None}) == (True, "reward 1")
    ok, _ = checker_for("shop")("in_cart", {"dish": "Pad Thai", "size": "Small"}, {"cart": [], "orders": []})
    assert not ok


def stop_countdown(env: MiniWoBEnv) -> None:
    """Stop and blank the countdown beside the task, which ticks each second (a tick while settling read 599
    on one side and 600 on the other; on a loaded machine it could tick before it is stopped)."""
    env.page.evaluate("clearInterval(core.CD_TIMER); document.getElementById('timer-countdown').textContent = ''")


def first_look(env: MiniWoBEnv, url: str) -> tuple[str, bytes, str, str]:
    """The utterance and the page once it settled, with the countdown stopped: so only what the last episode
    left can tell a restart from a load."""
    utterance, last = env.reset("s", url), None
    stop_countdown(env)
    for _ in range(20):
        obs = env.observe()
        if last is not None and (obs.png, obs.ax_tree) == (last.png, last.ax_tree):
            return utterance, obs.png, obs.ax_tree, obs.url
        last = obs
        time.sleep(0.05)
    raise AssertionError(f"{url} did not settle")


def test_a_loaded_task_shows_its_images_in_its_first_observation(chromium, server):
    """A task builds its problem after the load event, and an icon is fetched only when an element first shows
    it: served late (0.4 s here; a busy machine sometimes served them after the first screenshot), the icons
    are still in the first observation, and those a step shows later (hover variants, an opened email's) are
    loaded by then."""
    async def late(route):
        await asyncio.sleep(0.4)
        await route.continue_()

    env = MiniWoBEnv(BrowserEnv(viewport="desktop", chromium=chromium))  # its own cache: nothing loaded yet
    try:
        env.reset("s", server.task_url("click-button", 1))
        env.context.route(re.compile(r".*\.(png|gif)$"), late)
        for task in ("click-dialog", "email-inbox", "social-media"):
            env.reset("s", server.task_url(task, 2))
            stop_countdown(env)
            first = env.observe().png
            time.sleep(0.6)
            assert env.observe().png == first, f"{task}: an image arrived after the first observation"
        # social-media's icons change on hover (`.reply:hover { content: url(reply-hover.png) }`).
        x, y = env.page.evaluate("""() => { const r = document.querySelector('.reply').getBoundingClientRect();
                                           return [r.x + r.width / 2, r.y + r.height / 2]; }""")
        env.act({"type": "mouse_move", "x": x, "y": y})
        hovered = env.observe().png
        time.sleep(0.6)
        assert hovered != first and env.observe().png == hovered, "the hover's icon arrived after the step"
    finally:
        env.close()


def test_a_restarted_task_shows_what_a_loaded_one_shows(env, server):
    """Every default task, after an episode of another seed with clicks, typing and a scroll: restarted in
    place, it shows what loading it shows (the screenshot byte for byte, the tree, the address, the
    utterance), and it was not loaded again."""
    env.reset("s", server.task_url("click-test", 1))
    # click-pie's menu is still moving when it is first seen, loaded or restarted: the box of its label "Y"
    # read x = 79 to 82 between loads of the same problem.
    for task in [t for t in DEFAULT_TASKS if t != "click-pie"]:
        env.page.goto("about:blank")  # so the next reset loads the task
        loaded = first_look(env, server.task_url(task, 4))
        env.reset("s", server.task_url(task, 5))  # another seed's problem
        env.page.evaluate("window.loaded_before = true")
        for x, y in ((20, 80), (80, 130), (140, 180)):
            env.act({"type": "click", "x": x, "y": y})
            env.act({"type": "type", "text": "hello"})
        env.act({"type": "scroll", "x": 80, "y": 120, "dy": 100})
        assert first_look(env, server.task_url(task, 4)) == loaded, task
        assert env.page.evaluate("window.loaded_before === true"), f"{task} was loaded again, not restarted"


def test_another_task_or_a_fault_loads_the_page(env, server):
    env.reset("s", server.task_url("click-button", 1))
    env.page.evaluate("window.loaded_before = true")
    env.reset("s", server.task_url("click-link", 1))
    assert env.page.evaluate("window.loaded_before === undefined")
    env.page.evaluate("window.loaded_before = true")
    env.env.fault(RuntimeError("the test's fault"))
    env.reset("s", server.task_url("click-link", 1))
    assert env.page.evaluate("window.loaded_before === undefined")
    # Not a default task: book-flight keeps its widgets' state, which a restart does not put back.
    env.reset("s", server.task_url("book-flight", 1))
    env.page.evaluate("window.loaded_before = true")
    env.reset("s", server.task_url("book-flight", 2))
    assert env.page.evaluate("window.loaded_before === undefined")


class _ClosesThePage:
    """A policy whose page goes away under it, as a renderer crash takes it."""

    name, model_id, prompt_version = "closer", "none", "none"

    def reset(self, query: Query) -> None:
        pass

    def act(self, observation: Observation, env: BrowserEnv) -> PolicyOutput:
        env.page.close()
        return PolicyOutput({"type": "click", "x": 10, "y": 10}, "", "")


def test_a_page_lost_mid_episode_is_an_env_fault_episode_not_a_crashed_shard(chromium, server, tmp_path):
    # The final state is read once more after a fault; MiniWoB's reads the page, and a closed page's Playwright
    # error escaped run_episode and failed the whole rollout shard.
    (query,), _ = miniwob_queries(["click-test"], [1], run_id="r", max_steps=3, chromium=chromium)
    env = MiniWoBEnv(BrowserEnv(viewport="desktop", chromium=chromium))
    try:
        episode, _ = run_episode(env, _ClosesThePage(), query, run_id="r", episode_id="e",
                                 blobs=BlobStore(tmp_path / "blobs"),
                                 start_url=server.task_url("click-test", 1))
    finally:
        env.close()
    assert episode.status == "env_fault"
    assert episode.fault_kind == "browser_crash"


def test_a_page_without_a_viewport_is_clicked_where_the_mobile_screenshot_shows_it(chromium, server):
    # MiniWoB++ pages declare no viewport: the phone's emulation showed them zoomed out to 0.42, so the screenshot
    # and the tree's boxes and the clicks disagreed, and a click on the drawn button missed it.
    env = MiniWoBEnv(BrowserEnv(viewport="mobile", chromium=chromium))
    try:
        env.reset("s", server.task_url("click-test", 1))
        observation = env.observe()
        assert env.evaluate("() => visualViewport.scale") == 1
        x, y = button_box(observation.ax_tree, "Click Me!")
        shot = Image.open(io.BytesIO(observation.png)).convert("RGB")
        assert shot.size == (412, 915) and shot.getpixel((x, y)) != shot.getpixel((x, 600))  # drawn where it is
        assert env.act({"type": "click", "x": x, "y": y}) is None
        assert check_reward({}, env.app_state())[0]
    finally:
        env.close()

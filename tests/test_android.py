"""The Android env's real adb command lines, run against outputs recorded on a device.

No device is attached here, so `tests/fixtures/android/adb` stands in for the adb
client (the edge we do not own): it logs every command and replies with the recorded
screencap, uiautomator dump, window list and screen size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from trajforge.envs.android import AndroidEnv, parse_hierarchy
from trajforge.envs.browser import EnvFault

FIXTURES = Path(__file__).parent / "fixtures" / "android"


@pytest.fixture
def device(tmp_path, monkeypatch):
    log = tmp_path / "adb.log"
    monkeypatch.setenv("FAKE_ADB_LOG", str(log))
    env = AndroidEnv(
        "emulator-5554", adb=str(FIXTURES / "adb"), server_port=5039,
        packages={"Settings": "com.android.settings"}, probes={"wifi_on": "settings get global wifi_on"},
    )
    return env, log


def commands(log: Path) -> list[str]:
    return [line.removeprefix("-P 5039 -s emulator-5554 ") for line in log.read_text().splitlines()]


def test_observation_from_screencap_and_view_hierarchy(device):
    env, log = device
    obs = env.observe()
    assert (obs.width, obs.height) == (720, 1280)
    assert obs.png == (FIXTURES / "screencap.png").read_bytes()
    assert obs.url == "com.android.settings/com.android.settings.Settings"
    assert obs.title == "com.android.settings"
    lines = obs.ax_tree.splitlines()
    assert 'button "Network & internet Mobile, Wi‑Fi, hotspot" (0,180,720,150)' in lines
    assert 'switch "Dark theme" [checked] (560,500,136,60)' in lines
    assert 'button "Navigate up" (0,1180,96,100)' in lines
    # Every command names the device and its own ADB server port.
    assert all(line.startswith("-P 5039 -s emulator-5554 ") for line in log.read_text().splitlines())


def test_element_at_resolves_the_smallest_node(device):
    env, _ = device
    env.observe()
    assert env.element_at(300, 380).name == "Display"
    assert env.element_at(600, 530).role == "switch"
    assert env.element_at(700, 170) is None


def test_element_at_names_a_piece_of_a_secret_masked_as_the_observation_does(device, monkeypatch):
    """A secret the screen splits across nodes ("Display" ending one, "Dark theme" starting the next) is masked
    piece by piece in the observation; the step's target names the node as the observation shows it."""
    monkeypatch.setenv("TRAJFORGE_SECRET_CODE", "DisplayDark")
    env, _ = device
    obs = env.observe()
    target = env.element_at(600, 530)
    assert target.role == "switch" and "Dark" not in target.name
    assert target.name in {n.name for n in obs.nodes}


@pytest.mark.parametrize(
    ("action", "command"),
    [
        ({"type": "click", "x": 360.4, "y": 255}, "shell input tap 360 255"),
        ({"type": "long_press", "x": 10, "y": 20}, "shell input swipe 10 20 10 20 1000"),
        ({"type": "swipe", "x": 360, "y": 1000, "x2": 360, "y2": 300, "duration": 0.5},
         "shell input swipe 360 1000 360 300 500"),
        # `input text` reads %s as a space and has no escape: a % before anything else reaches the screen as is.
        ({"type": "type", "text": "50% off it's"}, "shell input text '50%%soff%sit'\"'\"'s'"),
        ({"type": "system_button", "button": "Back"}, "shell input keyevent 4"),
        ({"type": "system_button", "button": "Home"}, "shell input keyevent 3"),
        ({"type": "key", "key": "Enter"}, "shell input keyevent 66"),
        ({"type": "key", "key": "b"}, "shell input keyevent 30"),
        ({"type": "key", "key": "space"}, "shell input keyevent 62"),
        ({"type": "open", "text": "Settings"},
         "shell monkey -p com.android.settings -c android.intent.category.LAUNCHER 1"),
    ],
)
def test_actions_become_input_commands(device, action, command):
    env, log = device
    assert env.act(action) is None
    assert commands(log)[-1] == command


@pytest.mark.parametrize(
    ("action", "error"),
    [({"type": "click", "x": 800, "y": 10}, "off the 720x1280 screen"), ({"type": "fly"}, "fly"),
     ({"type": "swipe", "x": 1, "y": 2}, "x2"), ({"type": "scroll", "x": 1, "y": 2, "dy": 100}, "scroll"),
     # The device's shell parses the command line adb sends: this text ran `echo` there.
     ({"type": "open", "text": "x; echo INJECTED >> /sdcard/f"}, "no Android package"),
     ({"type": "open", "text": "Google Maps"}, "rollout.android.packages"),
     ({"type": "type", "text": "100%sure"}, "%s")],
)
def test_invalid_actions_are_reported_and_send_nothing(device, action, error):
    env, log = device
    env.screen_size()
    before = commands(log)
    assert error in env.act(action)  # an error message, not an exception
    assert commands(log) == before


def test_reset_clears_and_launches_the_app(device):
    env, log = device
    env.reset("episode-1", "com.android.settings/.Settings")
    assert commands(log) == [
        "shell am force-stop com.android.settings",
        "shell pm clear com.android.settings",
        "shell am start -W -n com.android.settings/.Settings",
    ]
    with pytest.raises(ValueError, match="package/activity"):
        env.reset("episode-2", "https://example.org")
    # An inner class's activity: its `$` reaches the device's shell quoted, not as a variable.
    env.reset("episode-3", "com.example.app/.Main$Inner")
    assert commands(log)[-1] == "shell am start -W -n 'com.example.app/.Main$Inner'"


def test_app_state_reads_activity_and_probes(device):
    env, _ = device
    assert env.app_state() == {"activity": "com.android.settings/com.android.settings.Settings", "wifi_on": "1"}
    # A probe's quotes reach the device's shell: split here and joined by adb, `--where name=screen_brightness`
    # was a query the device refused.
    env.probes = {"brightness": "content query --uri content://settings/system --where \"name='screen_brightness'\""}
    assert env.app_state()["brightness"] == "Row: 0 name=screen_brightness, value=102"


def test_a_rotated_screen_takes_points_of_its_screenshot(device, tmp_path, monkeypatch):
    # `wm size` says 720x1280 in landscape too; the screenshot is 1280x720, and a tap at x 1000 is on it.
    env, log = device
    Image.new("RGB", (1280, 720)).save(tmp_path / "landscape.png")
    monkeypatch.setenv("FAKE_ADB_SCREENCAP", str(tmp_path / "landscape.png"))
    obs = env.observe()
    assert (obs.width, obs.height) == (1280, 720)
    assert env.act({"type": "click", "x": 1000, "y": 300}) is None
    assert commands(log)[-1] == "shell input tap 1000 300"
    assert env.act({"type": "click", "x": 300, "y": 1000}) == "click: point (x=300, y=1000) is off the 1280x720 screen"


def test_offline_device_is_an_environment_fault(device, monkeypatch):
    env, _ = device
    monkeypatch.setenv("FAKE_ADB_OFFLINE", "1")
    with pytest.raises(EnvFault, match="emulator-5554") as err:
        env.observe()
    assert err.value.kind == "browser_crash"


def test_a_broken_dump_is_an_environment_fault():
    with pytest.raises(EnvFault, match="not valid XML"):
        parse_hierarchy("<hierarchy><node")


WIFI_AFTER_A_TAP = """#!/bin/sh
# The recorded device, except that Wi-Fi is off until something on the screen is tapped.
case "$*" in
  *" shell input tap "*) touch "$0.wifi" ;;
  *" shell settings get global wifi_on")
    [ -e "$0.wifi" ] || {{ echo "$*" >> "$FAKE_ADB_LOG"; echo 0; exit 0; }} ;;
esac
exec "{adb}" "$@"
"""


@pytest.mark.parametrize(("value", "verdict"), [("1", True), ("0", False)])
def test_android_tasks_run_through_the_rollout_stage_and_are_judged(tmp_path, monkeypatch, value, verdict):
    """The verdict reads the device after the episode's actions: Wi-Fi comes on with the agent's tap, so "Turn on
    Wi-Fi" holds and a task expecting it off does not."""
    from trajforge.critics.stage import checker_for
    from trajforge.data.blobs import BlobStore
    from trajforge.envs.android import android_queries
    from trajforge.rollout.stage import rollout
    from trajforge.schemas.config import AndroidTask, RolloutSettings

    monkeypatch.setenv("FAKE_ADB_LOG", str(tmp_path / "adb.log"))
    adb = tmp_path / "adb"
    adb.write_text(WIFI_AFTER_A_TAP.format(adb=FIXTURES / "adb"))
    adb.chmod(0o755)
    task = AndroidTask(instruction="Turn on Wi-Fi", start="com.android.settings/.Settings", probe="wifi_on",
                       value=value, max_steps=2)
    (query,) = android_queries([task], run_id="r")
    settings = RolloutSettings(policy="random", android={
        "adb": str(adb), "devices": [{"serial": "emulator-5554", "adb_server_port": 5039}],
        "probes": {"wifi_on": "settings get global wifi_on"},
    })
    out = rollout([query.model_dump()], run_id="r", settings=settings, blobs=BlobStore(tmp_path / "blobs"))
    (episode,) = out.rows["episodes"]
    assert episode.app == "android" and episode.viewport == "mobile" and episode.status in ("max_steps", "terminated")
    assert 1 <= len(out.rows["steps"]) <= 2
    assert all(s.action_type == "click" and s.url_before.startswith("com.android.settings/") for s in out.rows["steps"])
    state = json.loads(episode.final_state_json)
    assert checker_for("android")(query.checker, json.loads(query.checker_params_json), state) == (
        verdict, f"wifi_on = '1' (expected '{value}')")
    log = commands(tmp_path / "adb.log")
    assert log[:3] == ["shell am force-stop com.android.settings", "shell pm clear com.android.settings",
                       "shell am start -W -n com.android.settings/.Settings"]
    taps = [i for i, line in enumerate(log) if line.startswith("shell input tap ")]
    assert taps and log.index("shell settings get global wifi_on", taps[0]) > taps[0]


def test_android_queries_need_a_device_or_are_dropped_with_the_reason(tmp_path):
    from trajforge.data.blobs import BlobStore
    from trajforge.envs.android import android_queries
    from trajforge.rollout.stage import rollout
    from trajforge.schemas.config import AndroidTask, RolloutSettings

    (query,) = android_queries([AndroidTask(instruction="x", start="a.b/.C", probe="p", value="1")], run_id="r")
    out = rollout([query.model_dump()], run_id="r", settings=RolloutSettings(policy="random"),
                  blobs=BlobStore(tmp_path / "blobs"))
    assert out.rows["episodes"] == []
    assert out.dropped == {"android query: no device configured (rollout.android.devices)": 1}


def test_android_tasks_become_queries_in_the_query_gen_stage(tmp_path):
    from trajforge.flows.stages import stages
    from trajforge.llm.workspace import Workspace
    from trajforge.schemas.config import Settings
    from trajforge.tasks.runner import commit, plan, run_shard

    task = {"instruction": "Turn on Wi-Fi", "start": "com.android.settings/.Settings", "probe": "wifi_on", "value": "1"}
    android = {"probes": {"wifi_on": "settings get global wifi_on"}}  # a task's probe is one the devices are asked
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}, rollout={"android": android},
                                 query_gen={"apps": [], "android_tasks": [task]}))
    p = plan(stages()["query_gen"], ws, "run-a", None)
    for shard in p.pending:
        run_shard(p, shard, ws)
    queries = ws.catalog.load("queries", commit(p, ws)["queries"])
    assert queries["app"].to_list() == ["android"] and queries["path"].to_list() == [["com.android.settings/.Settings"]]
    assert json.loads(queries["checker_params_json"][0]) == {"probe": "wifi_on", "value": "1"}


def test_an_android_tasks_probe_must_be_one_the_devices_are_asked(tmp_path):
    """A probe that rollout.android.probes does not hold (a typo) left every episode of the task judged a failure
    ("no probe"), which the critics' ground truth blamed on the agent; the config is refused when it loads."""
    from trajforge.schemas.config import ConfigError, load_settings

    cfg = tmp_path / "trajforge.yaml"
    task = "{instruction: Turn on Wi-Fi, start: com.android.settings/.Settings, probe: %s, value: '1'}"
    config = ("rollout:\n  android:\n    probes: {wifi_on: settings get global wifi_on, airplane: x}\n"
              "query_gen:\n  android_tasks:\n    - " + task + "\n")
    cfg.write_text(config % "wifi_on")
    assert load_settings(cfg).query_gen.android_tasks[0].probe == "wifi_on"
    cfg.write_text(config % "wifi_On")
    error = f"{cfg}: Value error, query_gen.android_tasks[0] ('Turn on Wi-Fi'): probe 'wifi_On' is not in " \
            "rollout.android.probes (airplane, wifi_on)"
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_settings(cfg)

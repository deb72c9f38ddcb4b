"""Settings: a phone's settings app, a bundled app.

Pages: all settings (Wi-Fi, Display, Sound, Accessibility, Languages, each showing its
current value), Wi-Fi (an on/off switch), Display (links to Brightness and Dark theme),
Brightness (an Adaptive brightness switch and four levels), Dark theme (a switch; the
whole app turns dark), Accessibility (another way to Dark theme), Sound (ringtones and
a vibration switch) and Languages. Every page saves with a Save button and comes back
with a "Saved" notice. The server refuses a brightness level while Adaptive brightness
is on, as a phone greys the levels out.

Session state (what checkers read):
    {"wifi": {"enabled", "network"},
     "display": {"adaptive_brightness", "brightness", "dark_theme"},
     "sound": {"ringtone", "vibrate"},
     "language": str}
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import checkbox, document, esc, missing, norm, radios, save_form
from trajforge.envs.apps.web import Request, Response, not_found, redirect

BRIGHTNESS = ("Low", "Medium", "High", "Maximum")
RINGTONES = ("Chimes", "Classic bell", "Marimba", "Ripple", "Sunrise")
LANGUAGES = ("English (United States)", "English (United Kingdom)", "Español", "Français", "Deutsch", "Italiano",
             "Português (Brasil)")

INITIAL_STATE: dict[str, Any] = {
    "wifi": {"enabled": True, "network": "Harbor-Home"},
    "display": {"adaptive_brightness": True, "brightness": "Medium", "dark_theme": False},
    "sound": {"ringtone": "Chimes", "vibrate": True},
    "language": "English (United States)",
}


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _brightness(state: dict[str, Any]) -> str:
    """What the screen's brightness is: "Adaptive" while the phone chooses it, else the level."""
    display = state["display"]
    return "Adaptive" if display["adaptive_brightness"] else display["brightness"]


SETTINGS: dict[str, Callable[[dict[str, Any]], str]] = {
    "wifi": lambda s: _on_off(s["wifi"]["enabled"]),
    "brightness": _brightness,
    "dark_theme": lambda s: _on_off(s["display"]["dark_theme"]),
    "ringtone": lambda s: s["sound"]["ringtone"],
    "language": lambda s: s["language"],
}
"""Setting name (the `setting` param of the setting_is checker) -> its value in a state, as a task says it."""


class SettingsApp(BundledApp):
    """The Settings server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("settings", Path(__file__).parent)
        self.checkers = {"setting_is": check_setting_is}

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method = request.path, request.method
        saved = request.query.get("saved") == "1"
        pages = {
            "/": lambda: self._home(state),
            "/wifi": lambda: self._wifi(state, saved),
            "/display": lambda: self._display(state),
            "/display/brightness": lambda: self._brightness(state, saved),
            "/display/dark-theme": lambda: self._dark_theme(state, saved),
            "/accessibility": lambda: self._accessibility(state),
            "/sound": lambda: self._sound(state, saved),
            "/languages": lambda: self._languages(state, saved),
        }
        saves = {
            "/wifi": self._save_wifi,
            "/display/brightness": self._save_brightness,
            "/display/dark-theme": self._save_dark_theme,
            "/sound": self._save_sound,
            "/languages": self._save_language,
        }
        if method == "GET" and path in pages:
            return pages[path]()
        if method == "POST" and path in saves:
            return saves[path](state, request.form)
        return not_found(f"{method} {path}")

    # --- pages -----------------------------------------------------------------

    @staticmethod
    def _page(state: dict[str, Any], title: str, body: str, status: int = 200) -> Response:
        """A settings page; the whole app is dark while Dark theme is on, as on a phone."""
        return document(title, "Settings", body, nav='<nav aria-label="Main"><a href="/">All settings</a></nav>',
                        status=status, body_class="dark" if state["display"]["dark_theme"] else "")

    @staticmethod
    def _rows(rows: list[tuple[str, str, str]]) -> str:
        """Settings rows: (link name, href, current value); the value sits outside the link, so
        the link's accessible name is the setting's name alone."""
        items = "".join(f'<li><a href="{esc(href)}">{esc(name)}</a><span class="value">{esc(value)}</span></li>'
                        for name, href, value in rows)
        return f'<ul class="rows">{items}</ul>'

    def _form(self, state: dict[str, Any], title: str, action: str, controls: str, saved: bool,
              error: str | None = None, intro: str = "") -> Response:
        body = save_form(title, action, controls, saved=saved, error=error, intro=intro)
        return self._page(state, title, body, 400 if error else 200)

    def _home(self, state: dict[str, Any]) -> Response:
        wifi = state["wifi"]["network"] if state["wifi"]["enabled"] else "Off"
        theme = "Dark theme" if state["display"]["dark_theme"] else "Light theme"
        rows = self._rows([
            ("Wi-Fi", "/wifi", wifi),
            ("Display", "/display", f"Brightness: {_brightness(state)} · {theme}"),
            ("Sound", "/sound", f"Ringtone: {state['sound']['ringtone']}"),
            ("Accessibility", "/accessibility", "TalkBack off"),
            ("Languages", "/languages", state["language"]),
        ])
        return self._page(state, "All settings", f"<h1>All settings</h1>{rows}")

    def _wifi(self, state: dict[str, Any], saved: bool) -> Response:
        wifi = state["wifi"]
        status = (f'<p class="status">Connected to <strong>{esc(wifi["network"])}</strong></p>' if wifi["enabled"]
                  else '<p class="status">Wi-Fi is off. Turn it on to see available networks.</p>')
        controls = checkbox("wifi", "Wi-Fi", wifi["enabled"], switch=True) + status
        return self._form(state, "Wi-Fi", "/wifi", controls, saved)

    def _display(self, state: dict[str, Any]) -> Response:
        rows = self._rows([
            ("Brightness", "/display/brightness", _brightness(state)),
            ("Dark theme", "/display/dark-theme", _on_off(state["display"]["dark_theme"]).capitalize()),
        ])
        return self._page(state, "Display", f'<h1>Display</h1>{rows}<p class="hint">Screen timeout: 30 seconds</p>')

    def _brightness(self, state: dict[str, Any], saved: bool, error: str | None = None) -> Response:
        display = state["display"]
        controls = (checkbox("adaptive", "Adaptive brightness", display["adaptive_brightness"], switch=True)
                    + '<p class="hint">Adjusts the screen to the light around you. Turn it off to choose a level.</p>'
                    + radios("level", "Brightness level", BRIGHTNESS, display["brightness"]))
        return self._form(state, "Brightness", "/display/brightness", controls, saved, error)

    def _dark_theme(self, state: dict[str, Any], saved: bool) -> Response:
        controls = (checkbox("dark_theme", "Dark theme", state["display"]["dark_theme"], switch=True)
                    + '<p class="hint">Dark theme uses a black background to keep your eyes and battery rested.</p>')
        return self._form(state, "Dark theme", "/display/dark-theme", controls, saved)

    def _accessibility(self, state: dict[str, Any]) -> Response:
        rows = self._rows([("Dark theme", "/display/dark-theme", _on_off(state["display"]["dark_theme"]).capitalize())])
        body = (f'<h1>Accessibility</h1><h2>Color and motion</h2>{rows}'
                '<h2>Screen readers</h2><p class="hint">TalkBack: off</p>')
        return self._page(state, "Accessibility", body)

    def _sound(self, state: dict[str, Any], saved: bool, error: str | None = None) -> Response:
        sound = state["sound"]
        controls = (radios("ringtone", "Phone ringtone", RINGTONES, sound["ringtone"])
                    + checkbox("vibrate", "Vibrate for calls", sound["vibrate"], switch=True))
        return self._form(state, "Sound", "/sound", controls, saved, error)

    def _languages(self, state: dict[str, Any], saved: bool, error: str | None = None) -> Response:
        controls = radios("language", "Phone language", LANGUAGES, state["language"])
        return self._form(state, "Languages", "/languages", controls, saved, error)

    # --- form posts (an unchecked switch is absent from the form: off) ------------

    def _save_wifi(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        state["wifi"]["enabled"] = form.get("wifi") == "on"
        return redirect("/wifi?saved=1")

    def _save_brightness(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        display = state["display"]
        adaptive, level = form.get("adaptive") == "on", form.get("level", "")
        if level not in BRIGHTNESS:
            return self._brightness(state, False, "Choose a brightness level.")
        if adaptive and level != display["brightness"]:
            return self._brightness(state, False, "Turn off Adaptive brightness to choose a level yourself.")
        display["adaptive_brightness"], display["brightness"] = adaptive, level
        return redirect("/display/brightness?saved=1")

    def _save_dark_theme(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        state["display"]["dark_theme"] = form.get("dark_theme") == "on"
        return redirect("/display/dark-theme?saved=1")

    def _save_sound(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        if form.get("ringtone") not in RINGTONES:
            return self._sound(state, False, "Choose a ringtone.")
        state["sound"] = {"ringtone": form["ringtone"], "vibrate": form.get("vibrate") == "on"}
        return redirect("/sound?saved=1")

    def _save_language(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        if form.get("language") not in LANGUAGES:
            return self._languages(state, False, "Choose a language.")
        state["language"] = form["language"]
        return redirect("/languages?saved=1")


# --- checkers: they read the session state, never the screen ----------------------


def check_setting_is(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The setting `setting` (a key of SETTINGS) has the value `value` (case aside)."""
    if problem := missing(params, "setting", "value"):
        return False, problem
    read = SETTINGS.get(params["setting"])
    if read is None:
        return False, f"unknown setting {params['setting']!r}; known: {', '.join(SETTINGS)}"
    actual = read(state)
    if norm(actual) == norm(params["value"]):
        return True, f"{params['setting']} is {actual}"
    return False, f"{params['setting']} is {actual}, not {params['value']}"


def create_app() -> SettingsApp:
    return SettingsApp()

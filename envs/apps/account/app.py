"""Harbor ID: an account app whose tasks start at a sign-in form, a bundled app.

It is the app that types a secret: every task signs in first, and the spec's password
slot is the placeholder `<secret>account_password</secret>`, typed as the value of
`TRAJFORGE_SECRET_ACCOUNT_PASSWORD` (see `envs.secrets`). The demo user is `alice`; the
server knows only the SHA-256 of her password (the README gives it, for trying the app),
so a placeholder typed as itself is refused as a wrong password.

Pages: Sign in (Username, Password, a Sign in button; a wrong password is told and
counted), Account (signed in as whom, links Profile and Security, Sign out), Profile (the
display name, a New display name field and a Save button, a link to Security) and Security (a two-step verification
switch and a Save button). The account pages send a signed-out visitor to Sign in.

Session state (what checkers read; the password is never in it):
    {"signed_in": str | None, "failed_sign_ins": int,
     "display_name": str, "two_step": bool}
"""

from __future__ import annotations

import copy
import hashlib
import hmac
from pathlib import Path
from typing import Any

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, checkbox, document, esc, field, missing, norm, save_form
from trajforge.envs.apps.web import Request, Response, not_found, redirect

USERS = {"alice": "760f33816084301a841bbe42901bfbcd1f4052a624f5c53b42acb32e77851779"}
"""User -> SHA-256 of the password (hex): the server compares digests, never stores what was typed."""

INITIAL_STATE: dict[str, Any] = {"signed_in": None, "failed_sign_ins": 0, "display_name": "Alice Martin",
                                 "two_step": False}


def _password_ok(user: str, password: str) -> bool:
    expected = USERS.get(user)
    typed = hashlib.sha256(password.encode()).hexdigest()
    return expected is not None and hmac.compare_digest(typed, expected)


class AccountApp(BundledApp):
    """The Harbor ID server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("account", Path(__file__).parent)
        self.checkers = {"signed_in": check_signed_in, "two_step_is": check_two_step_is,
                         "display_name_is": check_display_name_is}

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method = request.path, request.method
        if path == "/" and method == "GET":
            return redirect("/account") if state["signed_in"] else self._sign_in(state)
        if path == "/" and method == "POST":
            return self._post_sign_in(state, request.form)
        if not path.startswith("/account"):
            return not_found(f"{method} {path}")
        if not state["signed_in"]:
            return redirect("/")  # an account page needs a signed-in user
        saved = request.query.get("saved") == "1"
        pages = {
            "/account": lambda: self._account(state),
            "/account/profile": lambda: self._profile(state, saved),
            "/account/security": lambda: self._security(state, saved),
        }
        posts = {
            "/account/profile": self._save_profile,
            "/account/security": self._save_security,
            "/account/sign-out": self._sign_out,
        }
        if method == "GET" and path in pages:
            return pages[path]()
        if method == "POST" and path in posts:
            return posts[path](state, request.form)
        return not_found(f"{method} {path}")

    # --- pages -----------------------------------------------------------------

    @staticmethod
    def _page(title: str, body: str, status: int = 200, signed_in: bool = True) -> Response:
        nav = ('<nav aria-label="Main"><a href="/account">Account</a>'
               '<form method="post" action="/account/sign-out"><button type="submit">Sign out</button></form></nav>'
               if signed_in else "")
        return document(title, "Harbor ID", body, nav=nav, status=status)

    def _sign_in(self, state: dict[str, Any], error: str | None = None, user: str = "") -> Response:
        failed = (f'<p class="hint">Failed sign-ins in this session: {state["failed_sign_ins"]}</p>'
                  if state["failed_sign_ins"] else "")
        body = f"""{alert(error)}
<h1>Sign in</h1>
<form method="post" action="/" class="settings">
{field("username", "Username", user)}
<p class="field"><label for="password">Password</label><input type="password" id="password" name="password"
autocomplete="off"></p>
<button type="submit">Sign in</button>
</form>{failed}"""
        return self._page("Sign in", body, 400 if error else 200, signed_in=False)

    def _account(self, state: dict[str, Any]) -> Response:
        two_step = "on" if state["two_step"] else "off"
        body = f"""<h1>Account</h1>
<p class="status">Signed in as <strong>{esc(state["signed_in"])}</strong> ({esc(state["display_name"])})</p>
<ul class="rows"><li><a href="/account/profile">Profile</a><span class="value">{esc(state["display_name"])}</span></li>
<li><a href="/account/security">Security</a><span class="value">Two-step verification {two_step}</span></li></ul>"""
        return self._page("Account", body)

    def _form(self, title: str, action: str, controls: str, saved: bool, error: str | None = None,
              after: str = "") -> Response:
        body = save_form(title, action, controls, saved=saved, error=error, after=after)
        return self._page(title, body, 400 if error else 200)

    def _profile(self, state: dict[str, Any], saved: bool, error: str | None = None) -> Response:
        current = f'<p class="status">Display name: <strong>{esc(state["display_name"])}</strong></p>'
        return self._form("Profile", "/account/profile", current + field("display_name", "New display name"),
                          saved, error, after='<p><a href="/account/security">Security</a></p>')

    def _security(self, state: dict[str, Any], saved: bool) -> Response:
        controls = (checkbox("two_step", "Two-step verification", state["two_step"], switch=True)
                    + '<p class="hint">Asks for a code from your phone after the password.</p>')
        return self._form("Security", "/account/security", controls, saved)

    # --- form posts --------------------------------------------------------------

    def _post_sign_in(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        user = form.get("username", "").strip()
        if not _password_ok(user, form.get("password", "")):
            state["failed_sign_ins"] += 1
            return self._sign_in(state, "Wrong username or password.", user)
        state["signed_in"] = user
        return redirect("/account")

    def _save_profile(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        name = form.get("display_name", "").strip()
        if not name:
            return self._profile(state, False, "Enter a display name.")
        state["display_name"] = name
        return redirect("/account/profile?saved=1")

    def _save_security(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        state["two_step"] = form.get("two_step") == "on"
        return redirect("/account/security?saved=1")

    def _sign_out(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        state["signed_in"] = None
        return redirect("/")


# --- checkers: they read the session state, never the screen ----------------------


def check_signed_in(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The session is signed in as `user`."""
    if problem := missing(params, "user"):
        return False, problem
    if state["signed_in"] == params["user"]:
        return True, f"signed in as {params['user']}"
    who = f"signed in as {state['signed_in']}" if state["signed_in"] else "signed out"
    return False, f"{who}, after {state['failed_sign_ins']} failed sign-ins"


def check_two_step_is(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """Two-step verification is `value` (on or off). The stored setting is judged, signed in or not, as the
    display name is: only a signed-in user can change it, and signing out afterwards does not undo it."""
    if problem := missing(params, "value"):
        return False, problem
    actual = "on" if state["two_step"] else "off"
    return (actual == norm(params["value"])), f"two-step verification is {actual}"


def check_display_name_is(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The display name is `name` (case and spacing aside), signed in or not (see `check_two_step_is`)."""
    if problem := missing(params, "name"):
        return False, problem
    actual = state["display_name"]
    return norm(actual) == norm(params["name"]), f"the display name is {actual!r}"


def create_app() -> AccountApp:
    return AccountApp()

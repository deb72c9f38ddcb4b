"""Postbox: a small mail client, a bundled app.

Pages: the inbox (a "Search mail" box, Compose, the messages), search results, a
message (Reply, Star or Unstar, Archive), the compose form (To, Subject, Message,
Send; a reply opens it with To and Subject filled in), "Message sent", and the Starred,
Sent and Archive folders. Opening a message marks it read. Sending is validated on
the server: a missing or malformed address is refused with a message, not accepted.

Session state (what checkers read):
    {"messages": [{"id", "folder": "inbox" | "archive" | "sent", "sender", "sender_email",
                   "to", "subject", "body", "date", "read", "starred"}],
     "next_id": int}
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, clean, document, esc, field, missing, norm, notice
from trajforge.envs.apps.web import Request, Response, not_found, redirect

ME = ("Alex Morgan", "alex.morgan@example.com")

EMAIL = re.compile(r"[^@\s,;]+@[^@\s,;]+\.[A-Za-z]{2,}")
MAX_SUBJECT = 150
MAX_BODY = 5000


def _message(id_: int, folder: str, sender: str, email: str, subject: str, body: str, date: str,
             read: bool = False, starred: bool = False, to: str = ME[1]) -> dict[str, Any]:
    return {"id": id_, "folder": folder, "sender": sender, "sender_email": email, "to": to, "subject": subject,
            "body": body, "date": date, "read": read, "starred": starred}


INITIAL_STATE: dict[str, Any] = {
    "messages": [
        _message(1, "inbox", "Maya Chen", "maya.chen@example.com", "Team offsite agenda",
                 "Hi Alex, here is the draft agenda for the offsite on the 14th. Could you look over the "
                 "afternoon sessions before Thursday?", "Mon 7 Dec, 09:14"),
        _message(2, "inbox", "Parcelly", "updates@parcelly.example", "Your package has shipped",
                 "Good news: order 58-2231 left our warehouse and should arrive on Wednesday.",
                 "Mon 7 Dec, 08:02"),
        _message(3, "inbox", "Leo Martins", "leo.martins@example.com", "Dinner on Saturday?",
                 "We are thinking of trying the new Lebanese place at 7. Are you in?", "Sun 6 Dec, 19:40"),
        _message(4, "inbox", "Brightside Energy", "billing@brightside.example", "Invoice 4821 is ready",
                 "Your invoice for November is ready: 64.20 EUR, due on 21 December.", "Sun 6 Dec, 07:30",
                 read=True),
        _message(5, "inbox", "Sam Rivera", "sam.rivera@example.com", "Photos from the hike",
                 "Uploaded everything to the shared album. The one at the summit came out great!",
                 "Sat 5 Dec, 21:05"),
        _message(6, "inbox", "Fresh Kitchen", "news@freshkitchen.example", "Five quick weeknight recipes",
                 "This week: lemon orzo, sheet-pan gnocchi, and three more dinners in 20 minutes.",
                 "Fri 4 Dec, 11:00", read=True, starred=True),
        _message(7, "archive", "Postbox", "hello@postbox.example", "Welcome to Postbox",
                 "Your new inbox is ready. Star what matters and archive the rest.", "Mon 2 Nov, 10:00",
                 read=True),
        _message(8, "sent", ME[0], ME[1], "Re: Project timeline",
                 "Thanks, the new dates work for me.", "Thu 3 Dec, 16:22", read=True,
                 to="maya.chen@example.com"),
    ],
    "next_id": 9,
}

FOLDERS = {"inbox": "Inbox", "starred": "Starred", "sent": "Sent", "archive": "Archive"}
"""Folder key -> title; Starred is a view of starred messages in every folder."""

NAV = "<nav aria-label=\"Folders\">" + "".join(
    f'<a href="{"/" if key == "inbox" else f"/folder/{key}"}">{title}</a>' for key, title in FOLDERS.items()
) + "</nav>"


STAR = '<span class="star" role="img" aria-label="Starred">★</span>'


def _reply_subject(subject: str) -> str:
    """A reply's subject: "Re: " once, however long the thread."""
    return subject if subject.startswith("Re: ") else f"Re: {subject}"


def _page(title: str, body: str, status: int = 200) -> Response:
    return document(title, "Postbox", body, nav=NAV, status=status)


def _message_url(message: dict[str, Any]) -> str:
    return "/message?" + urlencode({"id": message["id"]})


def _listing(messages: list[dict[str, Any]], empty: str) -> str:
    """Message rows; the subject is the link, so its accessible name is the subject alone."""
    if not messages:
        return f'<p class="empty">{esc(empty)}</p>'
    rows = "".join(
        f'<li class="{"read" if m["read"] else "unread"}">'
        f'<span class="from">{esc(m["sender"] if m["folder"] != "sent" else "To: " + m["to"])}</span>'
        f'<span class="date">{esc(m["date"])}</span>'
        f'<a href="{esc(_message_url(m))}">{esc(m["subject"])}</a>'
        f'<span class="snippet">{esc(m["body"])}</span>'
        f'{STAR if m["starred"] else ""}</li>'
        for m in messages
    )
    return f'<ul class="messages">{rows}</ul>'


def _search_form(q: str = "") -> str:
    return f"""<form role="search" method="get" action="/search" class="search">
<label for="q">Search mail</label>
<div class="row"><input type="search" id="q" name="q" value="{esc(q)}"><button type="submit">Search</button></div>
</form>"""


class MailApp(BundledApp):
    """The Postbox server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("mail", Path(__file__).parent)
        self.checkers = {
            "message_sent": check_message_sent,
            "reply_sent": check_reply_sent,
            "message_starred": check_message_starred,
            "message_archived": check_message_archived,
        }

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method, query = request.path, request.method, request.query
        if method == "GET":
            if path == "/":
                return self._inbox(state, query.get("archived", ""))
            if path == "/search":
                return self._search(state, query.get("q", ""))
            if path.startswith("/folder/") and path.removeprefix("/folder/") in FOLDERS:
                return self._folder(state, path.removeprefix("/folder/"))
            if path == "/message":
                return self._read(state, query.get("id", ""))
            if path == "/compose":
                return self._compose_form(state, query.get("reply", ""))
            if path == "/sent":
                return self._sent(state, query.get("id", ""))
        elif method == "POST":
            if path == "/compose":
                return self._send(state, request.form)
            if path == "/message/star":
                return self._star(state, request.form)
            if path == "/message/archive":
                return self._archive(state, request.form)
        return not_found(f"{method} {path}")

    # --- pages -----------------------------------------------------------------

    def _inbox(self, state: dict[str, Any], archived: str) -> Response:
        gone = _by_id(state, archived)
        inbox = [m for m in state["messages"] if m["folder"] == "inbox"]
        body = f"""{notice(f"“{gone['subject']}” was archived." if gone else None)}
{_search_form()}
<div class="title-row"><h1>Inbox</h1><a class="button" href="/compose">Compose</a></div>
{_listing(inbox, "Your inbox is empty.")}"""
        return _page("Inbox", body)

    def _search(self, state: dict[str, Any], q: str) -> Response:
        results = ""
        if q.strip():
            words = norm(q).split()
            found = [m for m in state["messages"]
                     if all(w in norm(f"{m['sender']} {m['subject']} {m['body']}") for w in words)]
            results = f"<h2>Results for “{esc(clean(q))}”</h2>{_listing(found, 'No messages match your search.')}"
        return _page("Search", f"<h1>Search</h1>\n{_search_form(q)}\n{results}")

    def _folder(self, state: dict[str, Any], key: str) -> Response:
        if key == "starred":
            found = [m for m in state["messages"] if m["starred"]]
        else:
            found = [m for m in state["messages"] if m["folder"] == key]
        body = f"<h1>{FOLDERS[key]}</h1>{_listing(found, f'No messages in {FOLDERS[key]}.')}"
        return _page(FOLDERS[key], body)

    def _read(self, state: dict[str, Any], id_: str) -> Response:
        m = _by_id(state, id_)
        if m is None:
            return not_found(f"no message {id_!r}")
        m["read"] = True
        hidden = f'<input type="hidden" name="id" value="{m["id"]}">'
        star = (f'<form method="post" action="/message/star">{hidden}'
                f'<input type="hidden" name="starred" value="{"no" if m["starred"] else "yes"}">'
                f'<button type="submit">{"Unstar" if m["starred"] else "Star"}</button></form>')
        actions = [star]
        if m["folder"] != "sent":
            actions.insert(0, f'<a class="button" href="/compose?{urlencode({"reply": m["id"]})}">Reply</a>')
        if m["folder"] == "inbox":
            actions.append(f'<form method="post" action="/message/archive">{hidden}'
                           f'<button type="submit">Archive</button></form>')
        where = "" if m["folder"] == "inbox" else f'<span class="badge">{FOLDERS[m["folder"]]}</span>'
        starred = '<span class="badge starred">★ Starred</span>' if m["starred"] else ""
        body = f"""<article class="message">
<h1>{esc(m["subject"])}</h1>
<p class="meta"><strong>{esc(m["sender"])}</strong> &lt;{esc(m["sender_email"])}&gt;<br>
To: {esc(m["to"])} · {esc(m["date"])}</p>
<p class="badges">{where}{starred}</p>
<p class="text">{esc(m["body"])}</p>
</article>
<div class="actions">{"".join(actions)}</div>"""
        return _page(m["subject"], body)

    def _compose_form(self, state: dict[str, Any], reply: str = "", error: str | None = None,
                      values: dict[str, str] | None = None) -> Response:
        values = dict(values or {})
        original = _by_id(state, reply)
        if original is not None and not values:
            values = {"to": original["sender_email"], "subject": _reply_subject(original["subject"])}
        heading = "Reply" if original is not None else "New message"
        body = f"""<h1>{heading}</h1>
{alert(error)}
<form method="post" action="/compose" class="compose">
{field("to", "To", values.get("to", ""))}
{field("subject", "Subject", values.get("subject", ""))}
{field("body", "Message", values.get("body", ""), multiline=True)}
<button type="submit">Send</button>
</form>"""
        return _page(heading, body, 400 if error else 200)

    def _sent(self, state: dict[str, Any], id_: str) -> Response:
        m = _by_id(state, id_)
        if m is None or m["folder"] != "sent":
            return not_found(f"no sent message {id_!r}")
        body = f"""{notice("Message sent")}
<h1>Message sent</h1>
<p>“{esc(m["subject"])}” was sent to {esc(m["to"])}.</p>
<p><a href="/">Back to Inbox</a></p>"""
        return _page("Message sent", body)

    # --- form posts --------------------------------------------------------------

    def _send(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        values = {k: form.get(k, "") for k in ("to", "subject", "body")}
        to, subject, text = clean(values["to"]), clean(values["subject"]), values["body"].strip()
        error = None
        if not to:
            error = "Enter a recipient."
        elif not EMAIL.fullmatch(to):
            error = f"“{to}” is not an email address."
        elif not subject:
            error = "Enter a subject."
        elif len(subject) > MAX_SUBJECT:
            error = f"The subject is too long ({MAX_SUBJECT} characters at most)."
        elif not text:
            error = "Write a message."
        elif len(text) > MAX_BODY:
            error = f"The message is too long ({MAX_BODY} characters at most)."
        if error:
            return self._compose_form(state, error=error, values=values)
        id_ = state["next_id"]
        state["next_id"] += 1
        state["messages"].append(_message(id_, "sent", ME[0], ME[1], subject, text, "Just now", read=True, to=to))
        return redirect("/sent?" + urlencode({"id": id_}))

    def _star(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        m = _by_id(state, form.get("id", ""))
        if m is None:
            return not_found(f"no message {form.get('id')!r}")
        m["starred"] = form.get("starred") == "yes"
        return redirect(_message_url(m))

    def _archive(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        m = _by_id(state, form.get("id", ""))
        if m is None or m["folder"] != "inbox":
            return not_found(f"no inbox message {form.get('id')!r}")
        m["folder"] = "archive"
        return redirect("/?" + urlencode({"archived": m["id"]}))


def _by_id(state: dict[str, Any], id_: str) -> dict[str, Any] | None:
    return next((m for m in state["messages"] if str(m["id"]) == id_), None)


# --- checkers: they read the session state, never the screen ----------------------


def _received(state: dict[str, Any], subject: str) -> list[dict[str, Any]]:
    """Received messages (inbox or archive) with this subject."""
    return [m for m in state.get("messages", []) if m["folder"] != "sent" and norm(m["subject"]) == norm(subject)]


def _sent_summary(state: dict[str, Any]) -> str:
    sent = [m for m in state.get("messages", []) if m["folder"] == "sent"]
    return "; ".join(f"to {m['to']}: {m['subject']!r} ({m['body']!r})" for m in sent) or "nothing"


def _sent_match(state: dict[str, Any], to: str, subject: str, body: str) -> dict[str, Any] | None:
    return next((m for m in state.get("messages", []) if m["folder"] == "sent" and norm(m["to"]) == norm(to)
                 and norm(m["subject"]) == norm(subject) and norm(m["body"]) == norm(body)), None)


def check_message_sent(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """A sent message goes to `to` with `subject` and `body` (case and spacing aside)."""
    if problem := missing(params, "to", "subject", "body"):
        return False, problem
    if _sent_match(state, params["to"], params["subject"], params["body"]):
        return True, f"sent to {params['to']}: {params['subject']!r}"
    return False, (f"no message to {params['to']} with subject {params['subject']!r} and that text; "
                   f"sent: {_sent_summary(state)}")


def check_reply_sent(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """A reply to the received message `message` (to its sender, subject "Re: ...") says `body`."""
    if problem := missing(params, "message", "body"):
        return False, problem
    originals = _received(state, params["message"])
    if not originals:
        return False, f"no received message {params['message']!r}"
    for original in originals:
        subject = _reply_subject(original["subject"])
        if _sent_match(state, original["sender_email"], subject, params["body"]):
            return True, f"replied to {original['sender_email']}: {subject!r}"
    return False, f"no reply to {params['message']!r} with that text; sent: {_sent_summary(state)}"


def check_message_starred(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The received message `message` is starred."""
    if problem := missing(params, "message"):
        return False, problem
    found = _received(state, params["message"])
    if not found:
        return False, f"no received message {params['message']!r}"
    if any(m["starred"] for m in found):
        return True, f"{params['message']!r} is starred"
    return False, f"{params['message']!r} is not starred"


def check_message_archived(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The received message `message` is in the Archive (not deleted, not left in the inbox)."""
    if problem := missing(params, "message"):
        return False, problem
    found = _received(state, params["message"])
    if not found:
        return False, f"no received message {params['message']!r}"
    if any(m["folder"] == "archive" for m in found):
        return True, f"{params['message']!r} is in the archive"
    return False, f"{params['message']!r} is in the {found[0]['folder']}, not the archive"


def create_app() -> MailApp:
    return MailApp()

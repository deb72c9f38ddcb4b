"""Jotter: a notes app, a bundled app.

Pages: the notes (a "Search notes" box that filters them in place, New note, pinned
notes first, each a card whose title is a link), a note (Pin or Unpin, Edit), and the
new-note and edit forms (Title, Note, and one checkbox per tag). Forms are validated on
the server: a note needs a title, and titles are unique so a task can name its note.
A card moves by dragging its title onto another card of the same list (static/reorder.js
posts the move), so a drag task has a result in the app's state: the notes' order.

Session state (what checkers read):
    {"notes": [{"id", "title", "body", "pinned", "tags": [tag, ...]}], "next_id": int}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, checkbox, clean, document, esc, field, missing, norm, notice, slug
from trajforge.envs.apps.web import Request, Response, not_found, redirect

TAGS = ("Work", "Personal", "Ideas", "Travel", "Recipes")
"""Every tag a note can have; each is a checkbox named after it in the forms."""

MAX_TITLE = 100
MAX_BODY = 5000


def _note(id_: int, title: str, body: str, tags: list[str], pinned: bool = False) -> dict[str, Any]:
    return {"id": id_, "title": title, "body": body, "pinned": pinned, "tags": tags}


INITIAL_STATE: dict[str, Any] = {
    "notes": [
        _note(1, "Grocery list", "Oat milk, eggs, spinach, coffee beans, lemons.", ["Personal"]),
        _note(2, "Meeting notes 3 Dec", "Budget approved. Dana owns the launch checklist; review on Friday.",
              ["Work"]),
        _note(3, "Birthday gift ideas", "Mum: a pottery class. Jonas: the new Le Guin hardback.", ["Personal"]),
        _note(4, "Book recommendations", "The Overstory; Piranesi; A Memory Called Empire.", []),
        _note(5, "Garden plans", "Move the rosemary to the sunny bed and plant garlic before the frost.", []),
        _note(6, "Guest Wi-Fi", "Network Harbor-Guest, password sunflower42.", ["Personal"], pinned=True),
    ],
    "next_id": 7,
}
SEED_IDS = {n["id"] for n in INITIAL_STATE["notes"]}
"""Ids the notes start with: an edit keeps a note's id, so a seed note retitled is not a created note."""


def _page(title: str, body: str, status: int = 200, head: str = "") -> Response:
    return document(title, "Jotter", body, nav='<nav aria-label="Main"><a href="/">All notes</a></nav>',
                    status=status, head=head)


def _note_url(note: dict[str, Any], message: str = "") -> str:
    return "/note?" + urlencode({"id": note["id"], **({"notice": message} if message else {})})


def _tag_chips(tags: list[str]) -> str:
    return "".join(f'<span class="tag">{esc(t)}</span>' for t in tags)


def _cards(notes: list[dict[str, Any]]) -> str:
    """Note cards; the title is the link, so its accessible name is the title alone, and
    the handle a card is dragged by (draggable="true" marks what a drag can move)."""
    cards = "".join(
        f'<li data-id="{n["id"]}"><a href="{esc(_note_url(n))}" draggable="true">{esc(n["title"])}</a>'
        f'<p>{esc(n["body"])}</p>'
        f'<p class="tags">{_tag_chips(n["tags"])}</p></li>'
        for n in notes
    )
    return f'<ul class="cards">{cards}</ul>'


def _tag_field(name: str) -> str:
    return f"tag-{slug(name)}"


class NotesApp(BundledApp):
    """The Jotter server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("notes", Path(__file__).parent)
        self.checkers = {
            "note_created": check_note_created,
            "note_pinned": check_note_pinned,
            "note_tagged": check_note_tagged,
        }

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method, query, form = request.path, request.method, request.query, request.form
        note = _by_id(state, query.get("id", "") if method == "GET" else form.get("id", ""))
        if method == "GET":
            if path == "/":
                return self._list(state, query.get("q", ""))
            if path == "/notes/new":
                return self._form(None, {"title": "", "body": "", "tags": []})
            if note is not None and path == "/note":
                return self._show(note, query.get("notice", ""))
            if note is not None and path == "/note/edit":
                return self._form(note, note)
        elif method == "POST":
            if path == "/notes":
                return self._save(state, None, form)
            if note is not None and path == "/note/edit":
                return self._save(state, note, form)
            if note is not None and path == "/note/pin":
                note["pinned"] = form.get("pinned") == "yes"
                return redirect(_note_url(note))
            onto = _by_id(state, form.get("to", ""))
            if note is not None and onto is not None and path == "/notes/move":
                _move(state["notes"], note, onto)
                return redirect("/")
        return not_found(f"{method} {path} {urlencode(query)}")

    # --- pages -----------------------------------------------------------------

    def _list(self, state: dict[str, Any], q: str) -> Response:
        notes = state["notes"]
        if q.strip():
            words = norm(q).split()
            found = [n for n in notes if all(w in norm(f"{n['title']} {n['body']} {' '.join(n['tags'])}")
                                             for w in words)]
            listing = (f"<h2>Results for “{esc(clean(q))}”</h2>"
                       + (_cards(found) if found else '<p class="empty">No notes match your search.</p>'))
        else:
            pinned = [n for n in notes if n["pinned"]]
            others = [n for n in notes if not n["pinned"]]
            listing = (f"<h2>Pinned</h2>{_cards(pinned)}" if pinned else "") + f"<h2>Others</h2>{_cards(others)}"
        body = f"""<form role="search" method="get" action="/" class="search">
<label for="q">Search notes</label>
<div class="row"><input type="search" id="q" name="q" value="{esc(q)}"><button type="submit">Search</button></div>
</form>
<div class="title-row"><h1>Notes</h1><a class="button" href="/notes/new">New note</a></div>
{listing}
<form id="move" method="post" action="/notes/move" hidden><input type="hidden" name="id"><input type="hidden" name="to"></form>"""
        return _page("Notes", body, head='<script src="/static/reorder.js" defer></script>')

    def _show(self, note: dict[str, Any], message: str) -> Response:
        status = {"saved": "Note saved", "updated": "Changes saved"}.get(message)
        badge = '<span class="pinned">Pinned</span>' if note["pinned"] else ""
        body = f"""{notice(status)}
<article class="note"><h1>{esc(note["title"])}</h1>{badge}
<p class="text">{esc(note["body"])}</p>
<p class="tags">{_tag_chips(note["tags"]) or '<span class="empty">No tags</span>'}</p></article>
<div class="actions"><form method="post" action="/note/pin"><input type="hidden" name="id" value="{note["id"]}">
<input type="hidden" name="pinned" value="{"no" if note["pinned"] else "yes"}">
<button type="submit">{"Unpin" if note["pinned"] else "Pin"}</button></form>
<a class="button" href="/note/edit?{urlencode({"id": note["id"]})}">Edit</a></div>"""
        return _page(note["title"], body)

    def _form(self, note: dict[str, Any] | None, values: dict[str, Any],
              error: str | None = None) -> Response:
        """The new-note form (note None) or the edit form of `note`, filled with `values`."""
        heading = "New note" if note is None else "Edit note"
        action = "/notes" if note is None else "/note/edit"
        hidden = "" if note is None else f'<input type="hidden" name="id" value="{note["id"]}">'
        tags = "".join(checkbox(_tag_field(t), t, t in values["tags"]) for t in TAGS)
        body = f"""<h1>{heading}</h1>
{alert(error)}
<form method="post" action="{action}">{hidden}
{field("title", "Title", values["title"])}
{field("body", "Note", values["body"], multiline=True)}
<fieldset class="tags-field"><legend>Tags</legend>{tags}</fieldset>
<button type="submit">Save</button>
</form>"""
        return _page(heading, body, 400 if error else 200)

    # --- form posts --------------------------------------------------------------

    def _save(self, state: dict[str, Any], note: dict[str, Any] | None, form: dict[str, str]) -> Response:
        values = {"title": clean(form.get("title", "")), "body": form.get("body", "").strip(),
                  "tags": [t for t in TAGS if form.get(_tag_field(t)) == "on"]}
        taken = any(norm(n["title"]) == norm(values["title"]) for n in state["notes"] if n is not note)
        error = None
        if not values["title"]:
            error = "Give the note a title."
        elif len(values["title"]) > MAX_TITLE:
            error = f"The title is too long ({MAX_TITLE} characters at most)."
        elif taken:
            error = f"There is already a note called “{values['title']}”."
        elif len(values["body"]) > MAX_BODY:
            error = f"The note is too long ({MAX_BODY} characters at most)."
        if error:
            return self._form(note, values, error)
        if note is None:
            note = _note(state["next_id"], **values)
            state["next_id"] += 1
            state["notes"].append(note)
            return redirect(_note_url(note, "saved"))
        note.update(values)
        return redirect(_note_url(note, "updated"))


def _move(notes: list[dict[str, Any]], note: dict[str, Any], onto: dict[str, Any]) -> None:
    """`note` takes the place of `onto`; the notes between them shift by one toward where it was."""
    place = notes.index(onto)
    notes.remove(note)
    notes.insert(place, note)


def _by_id(state: dict[str, Any], id_: str) -> dict[str, Any] | None:
    return next((n for n in state["notes"] if str(n["id"]) == id_), None)


# --- checkers: they read the session state, never the screen ----------------------


def _titled(state: dict[str, Any], title: str) -> dict[str, Any] | None:
    return next((n for n in state.get("notes", []) if norm(n["title"]) == norm(title)), None)


def _has_tag(note: dict[str, Any], tag: str) -> bool:
    return norm(tag) in {norm(t) for t in note["tags"]}


def check_note_created(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """A new note (not one of the initial notes, edited) titled `title` says `body` and is tagged `tag`."""
    if problem := missing(params, "title", "body", "tag"):
        return False, problem
    note = _titled(state, params["title"])
    if note is None:
        return False, f"no note titled {params['title']!r}"
    if note["id"] in SEED_IDS:
        return False, f"{params['title']!r} is an initial note, retitled, not a new note"
    if norm(note["body"]) != norm(params["body"]):
        return False, f"{params['title']!r} says {note['body']!r}, not {params['body']!r}"
    if not _has_tag(note, params["tag"]):
        return False, f"{params['title']!r} has tags {note['tags']}, not {params['tag']!r}"
    return True, f"{params['title']!r} exists with that text and tag {params['tag']}"


def check_note_pinned(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The note `note` is pinned."""
    if problem := missing(params, "note"):
        return False, problem
    note = _titled(state, params["note"])
    if note is None:
        return False, f"no note titled {params['note']!r}"
    return note["pinned"], f"{params['note']!r} is {'pinned' if note['pinned'] else 'not pinned'}"


def check_note_tagged(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The note `note` has the tag `tag`."""
    if problem := missing(params, "note", "tag"):
        return False, problem
    note = _titled(state, params["note"])
    if note is None:
        return False, f"no note titled {params['note']!r}"
    if _has_tag(note, params["tag"]):
        return True, f"{params['note']!r} is tagged {params['tag']}"
    return False, f"{params['note']!r} has tags {note['tags']}, not {params['tag']!r}"


def create_app() -> NotesApp:
    return NotesApp()

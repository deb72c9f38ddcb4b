"""Writer: a desktop-style document editor, a bundled app.

Unlike the other bundled apps, most of what Writer can do hides behind an ARIA menu bar
(File, Edit, Format, Tools, Help, with an Export submenu), modal dialogs and a
Preferences dialog with tabs, driven by a small script (`static/writer.js`). That is the
shape of the desktop software of paper 6.2 ("Computer"): its operational pathways are
not in `spec.yaml` and are found on the live page by `query_gen.deep_search`.

Some menu items act on a selection, as in a real editor: Format > Bold and Italic on the
text selected in the document, Edit > Delete document... on the document selected in the
Documents list; without one they say so (role=alert) and do nothing.

Every dialog or tab panel the page shows is reported to the server (`POST /surfaces`),
so a checker can tell that a pathway reached its surface from the state alone.

Session state (what checkers read):
    {"documents": [{"id", "title", "text"}], "next_id": int, "current": id of the open document,
     "preferences": {"orientation", "line_spacing", "autosave", "spellcheck", "theme"},
     "exports": [{"document", "format"}], "shared_with": [email, ...],
     "opened": [name of each dialog or tab panel shown, first time first]}
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, checkbox, clean, document, esc, field, missing, norm, radios, slug
from trajforge.envs.apps.web import Request, Response, not_found, redirect

APP_TITLE = "Writer"
ORIENTATIONS = ("Portrait", "Landscape")
LINE_SPACINGS = ("Single", "1.5 lines", "Double")
THEMES = ("Light", "Dark")
EXPORTS = (("export-pdf", "PDF", "Export as PDF"), ("export-text", "Plain text", "Export as plain text"))
"""(dialog id, file format, dialog title) of File > Export's items."""
MAX_TITLE = 100


@dataclass(frozen=True)
class MenuItem:
    """One menu item: it opens a dialog, runs a command of the script, goes to a page, or opens a submenu."""

    label: str
    dialog: str = ""
    command: str = ""
    href: str = ""
    submenu: tuple[MenuItem, ...] = ()


MENUS: tuple[tuple[str, tuple[MenuItem, ...]], ...] = (
    ("File", (
        MenuItem("New document", href="/documents/new"),
        MenuItem("Open…", dialog="open"),
        MenuItem("Page setup…", dialog="page-setup"),
        MenuItem("Export", submenu=(MenuItem("PDF…", dialog="export-pdf"),
                                    MenuItem("Plain text…", dialog="export-text"))),
    )),
    ("Edit", (
        MenuItem("Find and replace…", dialog="find"),
        MenuItem("Select all", command="select-all"),
        MenuItem("Delete document…", command="delete"),
    )),
    ("Format", (
        MenuItem("Bold", command="bold"),
        MenuItem("Italic", command="italic"),
        MenuItem("Paragraph…", dialog="paragraph"),
    )),
    ("Tools", (
        MenuItem("Word count…", dialog="word-count"),
        MenuItem("Preferences…", dialog="preferences"),
    )),
    ("Help", (
        MenuItem("Keyboard shortcuts", dialog="shortcuts"),
        MenuItem("About Writer", dialog="about"),
    )),
)

PREFERENCE_TABS = ("General", "Editing", "Appearance")


def _doc(id_: int, title: str, text: str) -> dict[str, Any]:
    return {"id": id_, "title": title, "text": text}


INITIAL_STATE: dict[str, Any] = {
    "documents": [
        _doc(1, "Project proposal", "We propose a shared calendar for the three studios. It replaces the paper "
                                    "schedule by March and costs less than the current booking tool."),
        _doc(2, "Meeting notes", "Dana presents the budget. Leo collects the venue quotes by Thursday."),
        _doc(3, "Travel plans", "Lisbon in May: flights booked, hotel near the river, one day in Sintra."),
    ],
    "next_id": 4,
    "current": 1,
    "preferences": {"orientation": "Portrait", "line_spacing": "Single", "autosave": True, "spellcheck": True,
                    "theme": "Light"},
    "exports": [],
    "shared_with": [],
    "opened": [],
}


# --- markup ---------------------------------------------------------------------------


def _menu(label: str, items: tuple[MenuItem, ...], *, top: bool) -> str:
    """A menu button (aria-haspopup) and its menu of items, hidden until the button is clicked."""
    menu_id = f"menu-{slug(label)}"
    entries = "".join(_item(item) for item in items)
    return (f'<div class="menu-wrap{" top" if top else ""}">'
            f'<button type="button" role="menuitem" aria-haspopup="menu" aria-expanded="false" '
            f'aria-controls="{menu_id}">{esc(label)}</button>'
            f'<div role="menu" id="{menu_id}" aria-label="{esc(label)}" class="menu" hidden>{entries}</div></div>')


def _item(item: MenuItem) -> str:
    if item.submenu:
        return _menu(item.label, item.submenu, top=False)
    action = (f'data-dialog="{esc(item.dialog)}"' if item.dialog else
              f'data-command="{esc(item.command)}"' if item.command else f'data-href="{esc(item.href)}"')
    return f'<button type="button" role="menuitem" {action}>{esc(item.label)}</button>'


def _dialog(dialog_id: str, title: str, body: str, buttons: str, *, action: str = "") -> str:
    """A modal dialog (hidden until opened) named by its heading; with `action`, its body is a form posting there."""
    inner = f"{body}<div class=\"buttons\">{buttons}</div>"
    if action:
        inner = f'<form method="post" action="{esc(action)}">{inner}</form>'
    return (f'<div role="dialog" aria-modal="true" aria-labelledby="{dialog_id}-title" id="dialog-{dialog_id}" '
            f'class="dialog" hidden><h2 id="{dialog_id}-title">{esc(title)}</h2>{inner}</div>')


def _close(label: str = "Cancel") -> str:
    return f'<button type="button" data-close>{esc(label)}</button>'


def _submit(label: str) -> str:
    return f'<button type="submit">{esc(label)}</button>'


def _dialogs(state: dict[str, Any], current: dict[str, Any]) -> str:
    prefs = state["preferences"]
    words = len(current["text"].split())
    export = "".join(
        _dialog(dialog_id, title,
                f'<input type="hidden" name="format" value="{esc(fmt)}">'
                f'<p>Export “{esc(current["title"])}” as a {esc(fmt)} file.</p>',
                _submit("Export") + _close(), action="/export")
        for dialog_id, fmt, title in EXPORTS
    )
    tabs = "".join(
        f'<button type="button" role="tab" id="tab-{slug(t)}" aria-controls="panel-{slug(t)}" '
        f'aria-selected="{"true" if i == 0 else "false"}">{esc(t)}</button>'
        for i, t in enumerate(PREFERENCE_TABS)
    )
    panels = {
        "General": checkbox("autosave", "Save automatically", prefs["autosave"]),
        "Editing": checkbox("spellcheck", "Check spelling as you type", prefs["spellcheck"]),
        "Appearance": radios("theme", "Theme", THEMES, prefs["theme"]),
    }
    panel_markup = "".join(
        f'<div role="tabpanel" id="panel-{slug(t)}" aria-labelledby="tab-{slug(t)}"{"" if i == 0 else " hidden"}>'
        f"{panels[t]}</div>"
        for i, t in enumerate(PREFERENCE_TABS)
    )
    shortcuts = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in
                        (("Ctrl+S", "Save"), ("Ctrl+B", "Bold"), ("Ctrl+I", "Italic"), ("Escape", "Close a menu")))
    return "".join((
        _dialog("open", "Open document",
                radios("document", "Documents", [d["title"] for d in state["documents"]], current["title"]),
                _submit("Open") + _close(), action="/open"),
        _dialog("page-setup", "Page setup", radios("orientation", "Orientation", ORIENTATIONS, prefs["orientation"]),
                _submit("Apply") + _close(), action="/page-setup"),
        export,
        _dialog("find", "Find and replace", field("find", "Find") + field("replace", "Replace with"),
                _submit("Replace all") + _close("Close"), action="/replace"),
        _dialog("delete", "Delete document",
                '<input type="hidden" name="id" value=""><p class="confirm">Delete the selected document?</p>',
                _submit("Delete") + _close(), action="/documents/delete"),
        _dialog("paragraph", "Paragraph", radios("line_spacing", "Line spacing", LINE_SPACINGS, prefs["line_spacing"]),
                _submit("Apply") + _close(), action="/paragraph"),
        _dialog("word-count", "Word count",
                f'<p>“{esc(current["title"])}” has {words} words and {len(current["text"])} characters.</p>',
                _close("Close")),
        _dialog("preferences", "Preferences",
                f'<div role="tablist" aria-label="Preference sections" class="tabs">{tabs}</div>{panel_markup}',
                _submit("Save preferences") + _close(), action="/preferences"),
        _dialog("shortcuts", "Keyboard shortcuts", f"<dl>{shortcuts}</dl>", _close("Close")),
        _dialog("about", "About Writer", "<p>Writer 1.0, a document editor bundled with trajforge.</p>",
                _close("Close")),
        _dialog("share", "Share document",
                '<p class="field"><label for="email">Email address</label>'
                '<input type="email" id="email" name="email" required autocomplete="off"></p>',
                _submit("Send invite") + _close(), action="/share"),
    ))


def _menubar() -> str:
    menus = "".join(_menu(label, items, top=True) for label, items in MENUS)
    return f'<div role="menubar" aria-label="Menu bar" class="menubar">{menus}</div>'


def _page(title: str, body: str, status: int = 200, *, menus: bool = True) -> Response:
    """A Writer page; with `menus`, the menu bar and the script that drives it and the dialogs in `body`."""
    if not menus:
        return document(title, APP_TITLE, body, status=status)
    return document(title, APP_TITLE, body + '<script src="/static/writer.js"></script>', nav=_menubar(),
                    status=status)


class WriterApp(BundledApp):
    """The Writer server-side app; see the module docstring for its surfaces and state."""

    def __init__(self) -> None:
        super().__init__("writer", Path(__file__).parent)
        self.checkers = {
            "document_text": check_document_text,
            "document_shared": check_document_shared,
            "surface_opened": check_surface_opened,
        }

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, form = request.path, request.form
        if request.method == "GET":
            if path == "/":
                return self._editor(state)
            if path == "/documents/new":
                return self._new_form("")
        elif request.method == "POST":
            prefs = state["preferences"]
            if path == "/surfaces" and clean(form.get("surface", "")):
                surface = clean(form["surface"])
                if surface not in state["opened"]:
                    state["opened"].append(surface)
                return redirect("/")
            if path == "/documents/new":
                return self._create(state, clean(form.get("title", "")))
            if path == "/save" and (doc := _by_id(state, form.get("id", ""))) is not None:
                doc["text"] = form.get("text", "").strip()
                return redirect("/")
            if path == "/open" and (doc := _titled(state, form.get("document", ""))) is not None:
                state["current"] = doc["id"]
                return redirect("/")
            if path == "/page-setup" and form.get("orientation") in ORIENTATIONS:
                prefs["orientation"] = form["orientation"]
                return redirect("/")
            if path == "/paragraph" and form.get("line_spacing") in LINE_SPACINGS:
                prefs["line_spacing"] = form["line_spacing"]
                return redirect("/")
            if path == "/preferences" and form.get("theme") in THEMES:
                prefs.update(autosave=form.get("autosave") == "on", spellcheck=form.get("spellcheck") == "on",
                             theme=form["theme"])
                return redirect("/")
            if path == "/replace":  # nothing to find replaces nothing, as in any editor
                doc = _current(state)
                if form.get("find"):
                    doc["text"] = doc["text"].replace(form["find"], form.get("replace", ""))
                return redirect("/")
            if path == "/export" and form.get("format") in {fmt for _, fmt, _ in EXPORTS}:
                state["exports"].append({"document": _current(state)["title"], "format": form["format"]})
                return redirect("/")
            if path == "/share" and "@" in form.get("email", ""):
                state["shared_with"].append(clean(form["email"]).lower())
                return redirect("/")
            if path == "/documents/delete" and (doc := _by_id(state, form.get("id", ""))) is not None:
                return self._delete(state, doc)
        return not_found(f"{request.method} {path}")

    # --- pages -----------------------------------------------------------------------

    def _editor(self, state: dict[str, Any], error: str | None = None) -> Response:
        current = _current(state)
        options = "".join(f'<li role="option" aria-selected="false" data-id="{d["id"]}">{esc(d["title"])}</li>'
                          for d in state["documents"])
        body = f"""<div role="toolbar" aria-label="Document" class="toolbar">
<button type="submit" form="editor">Save</button><button type="button" data-dialog="share">Share</button></div>
<p id="message" class="error" role="alert">{esc(error or "")}</p>
<div class="columns">
<ul role="listbox" aria-label="Documents" class="documents">{options}</ul>
<form id="editor" method="post" action="/save" class="editor"><input type="hidden" name="id" value="{current["id"]}">
<h1>{esc(current["title"])}</h1>
<label for="text">Document text</label><textarea id="text" name="text" rows="12">{esc(current["text"])}</textarea>
</form></div>
{_dialogs(state, current)}"""
        return _page(current["title"], body, 400 if error else 200)

    def _new_form(self, title: str, error: str | None = None) -> Response:
        body = f"""<h1>New document</h1>
{alert(error)}
<form method="post" action="/documents/new">
{field("title", "Title", title)}
<div class="buttons"><button type="submit">Create</button><a class="button" href="/">Cancel</a></div>
</form>"""
        return _page("New document", body, 400 if error else 200, menus=False)

    # --- form posts ------------------------------------------------------------------

    def _create(self, state: dict[str, Any], title: str) -> Response:
        error = None
        if not title:
            error = "Give the document a title."
        elif len(title) > MAX_TITLE:
            error = f"The title is too long ({MAX_TITLE} characters at most)."
        elif _titled(state, title) is not None:
            error = f"There is already a document called “{title}”."
        if error:
            return self._new_form(title, error)
        state["documents"].append(_doc(state["next_id"], title, ""))
        state["current"] = state["next_id"]
        state["next_id"] += 1
        return redirect("/")

    def _delete(self, state: dict[str, Any], doc: dict[str, Any]) -> Response:
        if len(state["documents"]) == 1:
            return self._editor(state, "Writer keeps at least one document.")
        state["documents"].remove(doc)
        if state["current"] == doc["id"]:
            state["current"] = state["documents"][0]["id"]
        return redirect("/")


def _by_id(state: dict[str, Any], id_: str) -> dict[str, Any] | None:
    return next((d for d in state["documents"] if str(d["id"]) == id_), None)


def _titled(state: dict[str, Any], title: str) -> dict[str, Any] | None:
    return next((d for d in state["documents"] if norm(d["title"]) == norm(title)), None)


def _current(state: dict[str, Any]) -> dict[str, Any]:
    doc = _by_id(state, str(state["current"]))
    assert doc is not None, "the current document always exists: deleting it opens another"
    return doc


# --- checkers: they read the session state, never the screen ----------------------


def check_document_text(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The document open when the task starts (by its id: the task says "the open document", and another one
    opened or made later is not it) keeps its saved text and has `text` added (case and spacing aside). Text typed
    over the whole document replaced it, not added to it."""
    if problem := missing(params, "text"):
        return False, problem
    start = next(d for d in INITIAL_STATE["documents"] if d["id"] == INITIAL_STATE["current"])
    doc = next((d for d in state.get("documents", []) if d["id"] == start["id"]), None)
    if doc is None:
        return False, f"{start['title']!r}, the document open at the start, was deleted"
    if norm(params["text"]) not in norm(doc["text"]):
        return False, f"{doc['title']!r} does not contain {params['text']!r}; it says {doc['text']!r}"
    if norm(start["text"]) not in norm(doc["text"]):
        return False, f"{doc['title']!r} contains {params['text']!r} but lost its text; it says {doc['text']!r}"
    return True, f"{doc['title']!r} contains {params['text']!r} as well as its own text"


def check_document_shared(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """An invitation to the document went to `email`."""
    if problem := missing(params, "email"):
        return False, problem
    shared = state.get("shared_with", [])
    if norm(params["email"]) in {norm(e) for e in shared}:
        return True, f"shared with {params['email']}"
    return False, f"not shared with {params['email']}; shared with {shared or 'nobody'}"


def check_surface_opened(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The dialog or tab panel named `surface` was shown (the page reports each one it shows)."""
    if problem := missing(params, "surface"):
        return False, problem
    opened = state.get("opened", [])
    if norm(params["surface"]) in {norm(s) for s in opened}:
        return True, f"{params['surface']!r} was opened"
    return False, f"{params['surface']!r} was not opened; opened: {opened or 'nothing'}"


def create_app() -> WriterApp:
    return WriterApp()

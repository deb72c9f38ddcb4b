"""Markup and checker helpers shared by the bundled apps (FreshCart predates them).

The pages are plain server-rendered HTML, so what an agent can do is what the
accessibility tree says: every input has a label (its accessible name), choices are
radio buttons, checkboxes and switches that show in a screenshot (never a <select>,
whose popup does not), errors are role=alert and confirmations role=status. Each app
keeps its own stylesheet, so the apps look different in screenshots. Every page loads
the interaction recorder (see `envs.apps.interaction`), the only script most pages have.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable

from trajforge.envs.apps.interaction import RECORDER_SCRIPT
from trajforge.envs.apps.web import Response, html_response


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def clean(text: str) -> str:
    """What a form field means: surrounding and repeated spaces removed."""
    return " ".join(text.split())


def norm(text: object) -> str:
    """Compare values as a person would: case and spacing do not matter."""
    return clean(str(text)).casefold()


def slug(text: str) -> str:
    """An element id from a label ("Português (Brasil)" -> "portugu-s-brasil")."""
    return re.sub(r"[^a-z0-9]+", "-", text.casefold()).strip("-")


def document(title: str, app_title: str, body: str, *, nav: str = "", status: int = 200,
             body_class: str = "", head: str = "", header: str | None = None) -> Response:
    """A whole page: `<title>` is "title · app_title", the header holds the app's name and `nav`.
    Every page loads the interaction recorder; `head` adds the page's own tags (a script).
    `header` replaces the whole <header> element (FreshCart's, whose stylesheet predates the kit)."""
    cls = f' class="{esc(body_class)}"' if body_class else ""
    if header is None:
        header = f'<header><div class="bar"><span class="brand">{esc(app_title)}</span>{nav}</div></header>'
    return html_response(
        f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · {esc(app_title)}</title>
<link rel="stylesheet" href="/static/style.css">
{RECORDER_SCRIPT}{head}
</head>
<body{cls}>
{header}
<main>
{body}
</main>
</body>
</html>
""",
        status,
    )


def alert(message: str | None) -> str:
    """A validation error, announced at once (role=alert); nothing when there is none."""
    return f'<p class="error" role="alert">{esc(message)}</p>' if message else ""


def notice(message: str | None) -> str:
    """A confirmation such as "Event saved" (role=status); nothing when there is none."""
    return f'<p class="notice" role="status">{esc(message)}</p>' if message else ""


def field(name: str, label: str, value: str = "", *, multiline: bool = False, hint: str = "") -> str:
    """A labelled text box (a textarea when `multiline`); its accessible name is `label`."""
    attrs = f'id="{esc(name)}" name="{esc(name)}"'
    control = (f"<textarea {attrs} rows=\"5\">{esc(value)}</textarea>" if multiline
               else f'<input type="text" {attrs} value="{esc(value)}" autocomplete="off">')
    note = f'<span class="hint">{esc(hint)}</span>' if hint else ""
    return f'<p class="field"><label for="{esc(name)}">{esc(label)}</label>{note}{control}</p>'


def save_form(title: str, action: str, controls: str, *, saved: bool, error: str | None = None,
              intro: str = "", after: str = "") -> str:
    """A page body that is one form of controls and a Save button, which comes back with the notice
    "Saved" (`saved`) or the error (role=alert); `intro` goes under the heading, `after` under the form."""
    return f"""{notice("Saved" if saved else None)}{alert(error)}
<h1>{esc(title)}</h1>{intro}
<form method="post" action="{action}" class="settings">
{controls}
<button type="submit">Save</button>
</form>{after}"""


def radios(name: str, legend: str, options: Iterable[str], chosen: str | None) -> str:
    """A fieldset of radio buttons; each option's text is its accessible name."""
    items = "".join(
        f'<span class="choice"><input type="radio" id="{esc(name)}-{slug(o)}" name="{esc(name)}" value="{esc(o)}"'
        f'{" checked" if o == chosen else ""}><label for="{esc(name)}-{slug(o)}">{esc(o)}</label></span>'
        for o in options
    )
    return f'<fieldset class="choices"><legend>{esc(legend)}</legend>{items}</fieldset>'


def checkbox(name: str, label: str, checked: bool, *, switch: bool = False) -> str:
    """A labelled checkbox posting name=on when checked; `switch` gives it role=switch (an on/off
    setting). Each checkbox needs its own name: the app server keeps one value per form field."""
    role = ' role="switch"' if switch else ""
    return (f'<span class="check"><input type="checkbox"{role} id="{esc(name)}" name="{esc(name)}" value="on"'
            f'{" checked" if checked else ""}><label for="{esc(name)}">{esc(label)}</label></span>')


def missing(params: dict[str, str], *names: str) -> str | None:
    """Which required checker params are absent or empty, said as a reason; None when all are there."""
    absent = [n for n in names if not params.get(n)]
    return f"checker params lack {', '.join(absent)}" if absent else None

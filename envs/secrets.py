"""Secrets a task types (passwords, one-time codes), named by placeholder everywhere but at the keyboard.

A query, a spec's slot value, a reference path or a policy's `type` action holds
`<secret>account_password</secret>` (browser-use's `sensitive_data` form); the value comes
from the environment variable `TRAJFORGE_SECRET_ACCOUNT_PASSWORD` of the process that types,
and only the env's keyboard (and the interface validator's `fill`) ever sees it. So a
secret is never in a setting, a prompt, a step row, a log line or a lineage property: the
data keeps the placeholder, and a password field shows bullets on the screen and in the
accessibility tree. Every worker that types needs the variable, as it needs the browser.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

from PIL import Image, ImageDraw

from trajforge.schemas.config import SECRET_PREFIX as VARIABLE_PREFIX

PLACEHOLDER = re.compile(r"<secret>([A-Za-z][A-Za-z0-9_]*)</secret>")


def variable(name: str) -> str:
    """The environment variable that holds the secret `name`."""
    return VARIABLE_PREFIX + name.upper()


def unset(text: str) -> str | None:
    """Why `text` cannot be typed: the secrets it names whose variable is not set, with the variables to set
    (never a value); None when every one can be typed."""
    names = [name for name in dict.fromkeys(PLACEHOLDER.findall(text)) if variable(name) not in os.environ]
    return "secret " + ", ".join(f"{n!r} is not set ({variable(n)})" for n in names) if names else None


def mask(text: str) -> str:
    """`text` with the value of every secret set in this process replaced by its placeholder: for what an app
    answers or shows outside the screen (a user's app may echo what was typed into it, a form sent by GET puts
    it in the URL). The value is also found URL-encoded, as a query string or a path carries it."""
    for name, value in os.environ.items():
        if name.startswith(VARIABLE_PREFIX) and value:
            placeholder = f"<secret>{name.removeprefix(VARIABLE_PREFIX).lower()}</secret>"
            for form in dict.fromkeys((value, quote_plus(value), quote(value, safe=""))):
                text = text.replace(form, placeholder)
    return text


def cover(png: bytes, boxes: Iterable[tuple[int, int, int, int]]) -> bytes:
    """`png` with each (x, y, width, height) box filled black: where a screenshot shows a secret that was typed
    into a field that is not a password field, or that the page echoes (the tree says where)."""
    image = Image.open(io.BytesIO(png))
    draw = ImageDraw.Draw(image)
    for x, y, w, h in boxes:
        draw.rectangle((x, y, x + w - 1, y + h - 1), fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def reveal(text: str) -> str:
    """`text` with every placeholder replaced by its secret, for the keyboard only; raises KeyError
    naming the variable of an unset one (check `unset` first for an error to record)."""
    def value(match: re.Match[str]) -> str:
        name = variable(match.group(1))
        if name not in os.environ:
            raise KeyError(f"{name} is not set")
        return os.environ[name]

    return PLACEHOLDER.sub(value, text)

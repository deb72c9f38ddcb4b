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
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any
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


def _set() -> list[tuple[str, str]]:
    """(placeholder, value) of every secret set in this process."""
    return [(f"<secret>{name.removeprefix(VARIABLE_PREFIX).lower()}</secret>", value)
            for name, value in os.environ.items() if name.startswith(VARIABLE_PREFIX) and value]


def url_forms(value: str) -> tuple[str, ...]:
    """`value` and the ways a URL carries it, each once: as a browser sends a form by GET (WHATWG's
    application/x-www-form-urlencoded: `*` kept, a space as `+`, `~` as `%7E`), as a page's script builds a query
    (`encodeURIComponent`: `!~*'()` kept) and a path (`%20`), and as Python's `quote_plus` writes it. Python's
    own forms alone missed a secret holding `*` or `~` in a URL the browser wrote."""
    return tuple(dict.fromkeys((
        value,
        quote_plus(value, safe="*").replace("~", "%7E"),
        quote(value, safe="!~*'()"),
        quote(value, safe=""),
        quote_plus(value),
    )))


def mask(text: str) -> str:
    """`text` with the value of every secret set in this process replaced by its placeholder: for what an app
    answers or shows outside the screen (a user's app may echo what was typed into it, a form sent by GET puts
    it in the URL). The value is also found URL-encoded, in each of `url_forms`. The longest form is replaced
    first: a secret inside another (a PIN inside a card code) would otherwise leave the longer one's rest showing,
    in whatever order the environment lists them."""
    forms = sorted(((form, placeholder) for placeholder, value in _set() for form in url_forms(value)),
                   key=lambda pair: len(pair[0]), reverse=True)
    for form, placeholder in forms:
        text = text.replace(form, placeholder)
    return text


def holding(texts: Sequence[str]) -> set[int]:
    """The indices of `texts` that show the value of a secret set in this process, in any of `url_forms`: one
    pass for a page's whole table of strings (`mask` on each would make the forms again for every string)."""
    forms = [form for _, value in _set() for form in url_forms(value)]
    # All the texts searched at once first, since most pages show no secret: a form cannot run across two texts
    # joined by NUL, which no environment variable holds. Text by text, the 800 names and values of a 400-node tree
    # took 0.11 ms of Python, every step of a run with a secret set; at once, 0.03 ms, the forms' making included.
    joined = "\0".join(texts) if forms else ""
    if not any(form in joined for form in forms):
        return set()
    return {i for i, text in enumerate(texts) if text and any(form in text for form in forms)}


def mask_pieces(texts: Sequence[str]) -> tuple[list[str], set[int]]:
    """`texts` with every secret set in this process that runs across two or more of them masked piece by
    piece (each text's piece replaced by the placeholder), and the indices of the texts that held a piece.

    The texts are neighbours in reading order (a tree's text runs, or its fields' values): a page shows a
    secret in pieces where markup breaks it (`481-<b>S3CR3T</b>` is two runs of text) or where it is typed
    a character a box (a one-time code's six fields), and `mask` only finds it whole in one text. A secret
    whole inside one text is left to `mask`. Pieces are joined with nothing between them, so a secret shown
    with spaces added between its pieces is not found."""
    out, pieces, shown = list(texts), set(), _set()
    if not shown or len(out) < 2:
        return out, pieces
    starts = list(accumulate((len(t) for t in out), initial=0))
    joined = "".join(out)
    cuts: dict[int, list[tuple[int, int, str]]] = {}  # text index -> (start, end, placeholder) within it
    for placeholder, value in shown:
        at = joined.find(value)
        while at != -1:
            end = at + len(value)
            first, last = bisect_right(starts, at) - 1, bisect_right(starts, end - 1) - 1
            if first != last:
                for i in (i for i in range(first, last + 1) if starts[i] < starts[i + 1]):  # empty texts hold none
                    cuts.setdefault(i, []).append((max(at, starts[i]) - starts[i], min(end, starts[i + 1]) - starts[i],
                                                   placeholder))
            at = joined.find(value, end)
    for i, spans in cuts.items():
        text = out[i]
        limit = len(text)  # from the right, so offsets stay true; overlapping secrets share one placeholder
        for start, end, placeholder in sorted(spans, reverse=True):
            if start < min(end, limit):
                text, limit = text[:start] + placeholder + text[min(end, limit):], start
        out[i] = text
        pieces.add(i)
    return out, pieces


def mask_json(value: Any) -> Any:
    """A copy of parsed JSON (an app's state, a recorder's reports) with every secret masked: whole in a key or
    a string (`mask`), and in pieces across the strings under the same key (`mask_pieces`), as a
    one-time-code widget's boxes each report their one character under the same key."""
    by_key: dict[str, list[tuple[Any, Any]]] = {}  # key -> (container, slot) of each string under it

    def copy(node: Any, key: str, parent: Any, slot: Any) -> Any:
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for k, child in node.items():
                masked_key = mask(k) if isinstance(k, str) else k
                out[masked_key] = copy(child, str(k), out, masked_key)
            return out
        if isinstance(node, list):
            items: list[Any] = [None] * len(node)
            for i, child in enumerate(node):  # a list's items are under the list's key
                items[i] = copy(child, key, items, i)
            return items
        if isinstance(node, str):
            by_key.setdefault(key, []).append((parent, slot))
            return mask(node)
        return node

    holder = [None]
    holder[0] = copy(value, "", holder, 0)
    for places in by_key.values():
        texts, pieces = mask_pieces([node[slot] for node, slot in places])
        for i in pieces:
            node, slot = places[i]
            node[slot] = texts[i]
    return holder[0]


def cover(png: bytes, boxes: Iterable[tuple[int, int, int, int]]) -> bytes:
    """`png` with each (x, y, width, height) box filled black: where a screenshot shows a secret that was typed
    into a field that is not a password field, or that the page echoes (the tree says where). A box of no width
    or height covers nothing (Pillow refuses the inverted rectangle it would make)."""
    image = Image.open(io.BytesIO(png))
    draw = ImageDraw.Draw(image)
    for x, y, w, h in boxes:
        if w > 0 and h > 0:
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

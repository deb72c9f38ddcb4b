"""Daybook: a week calendar, a bundled app.

Pages: the week (each day a link to its page, with that day's events as links; New
event, Search), a day, search results, an event (Edit, Delete), the new-event and
edit forms (Title, Day, Time and Location; day and time are radio buttons, so every
choice is a visible click target), the delete confirmation, and the week again with a
"deleted" notice. Forms are validated on the server.

Session state (what checkers read):
    {"events": [{"id", "title", "day", "time", "location"}], "next_id": int}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, clean, document, esc, field, missing, norm, notice, radios
from trajforge.envs.apps.web import Request, Response, not_found, redirect

DAYS: dict[str, str] = {
    "Monday": "7 December", "Tuesday": "8 December", "Wednesday": "9 December", "Thursday": "10 December",
    "Friday": "11 December", "Saturday": "12 December", "Sunday": "13 December",
}
"""The week shown, day name -> date. Day names are the links' and radio buttons' names."""

TIMES = ("08:00", "08:30", "09:00", "09:30", "10:00", "11:00", "12:30", "14:00", "15:30", "17:00", "18:30", "19:00")
"""Start times the forms offer (radio buttons)."""

MAX_TEXT = 80


def _event(id_: int, title: str, day: str, time: str, location: str = "") -> dict[str, Any]:
    return {"id": id_, "title": title, "day": day, "time": time, "location": location}


SEED_EVENTS = [
    _event(1, "Project kickoff", "Monday", "10:00", "Room 4B"),
    _event(2, "Lunch with Priya", "Tuesday", "12:30", "Noodle Bar, Market Street"),
    _event(3, "Piano lesson", "Wednesday", "17:00"),
    _event(4, "Car service", "Thursday", "08:30", "Speedy Garage"),
    _event(5, "Book club", "Friday", "19:00", "Library café"),
    _event(6, "Farmers market", "Saturday", "09:30", "Town square"),
]
INITIAL_STATE: dict[str, Any] = {"events": SEED_EVENTS, "next_id": 7}
SEED_IDS = {e["id"] for e in SEED_EVENTS}
"""Ids the week starts with. An edit keeps an event's id and may change its title, so "created" and "deleted"
tell events by id: a renamed event is neither new nor gone."""

NAV = '<nav aria-label="Views"><a href="/">Week</a></nav>'


def _page(title: str, body: str, status: int = 200) -> Response:
    return document(title, "Daybook", body, nav=NAV, status=status)


def _when(event: dict[str, Any]) -> str:
    return f"{event['day']}, {DAYS[event['day']]} · {event['time']}"


def _sorted(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = list(DAYS)
    return sorted(events, key=lambda e: (order.index(e["day"]), e["time"]))


def _event_url(event: dict[str, Any], note: str = "") -> str:
    return "/event?" + urlencode({"id": event["id"], **({"notice": note} if note else {})})


def _listing(events: list[dict[str, Any]], empty: str, show_day: bool = False) -> str:
    """Event rows: time, the title as a link (its accessible name), the place."""
    if not events:
        return f'<p class="empty">{esc(empty)}</p>'
    rows = "".join(
        f'<li><span class="time">{esc(e["time"])}</span><span class="what">'
        f'<a href="{esc(_event_url(e))}">{esc(e["title"])}</a>'
        f'<span class="where">{esc(e["day"] + " · " if show_day else "")}{esc(e["location"])}</span></span></li>'
        for e in _sorted(events)
    )
    return f'<ul class="events">{rows}</ul>'


class CalendarApp(BundledApp):
    """The Daybook server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("calendar", Path(__file__).parent)
        self.checkers = {
            "event_created": check_event_created,
            "event_moved": check_event_moved,
            "event_deleted": check_event_deleted,
        }

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method, query, form = request.path, request.method, request.query, request.form
        event = _by_id(state, query.get("id", "") if method == "GET" else form.get("id", ""))
        if method == "GET":
            if path == "/":
                return self._week(state, query.get("deleted", ""))
            if path == "/day" and query.get("d") in DAYS:
                return self._day(state, query["d"])
            if path == "/search":
                return self._search(state, query.get("q", ""))
            if path == "/events/new":
                return self._form(None, {"day": query.get("day", "")})
            if event is not None:
                if path == "/event":
                    return self._show(event, query.get("notice", ""))
                if path == "/event/edit":
                    return self._form(event, event)
                if path == "/event/delete":
                    return self._confirm_delete(event)
        elif method == "POST":
            if path == "/events":
                return self._save(state, None, form)
            if event is not None:
                if path == "/event/edit":
                    return self._save(state, event, form)
                if path == "/event/delete":
                    state["events"].remove(event)
                    return redirect("/?" + urlencode({"deleted": event["title"]}))
        return not_found(f"{method} {path} {urlencode(query)}")

    # --- pages -----------------------------------------------------------------

    def _week(self, state: dict[str, Any], deleted: str) -> Response:
        days = "".join(
            f'<section class="day"><h2><a href="/day?{urlencode({"d": day})}">{day}</a>'
            f'<span class="date">{date}</span></h2>'
            f'{_listing([e for e in state["events"] if e["day"] == day], "Nothing planned.")}</section>'
            for day, date in DAYS.items()
        )
        body = f"""{notice(f"“{deleted}” was deleted." if deleted else None)}
<div class="title-row"><h1>7 – 13 December 2026</h1>
<p class="links"><a class="button" href="/events/new">New event</a>
<a class="button quiet" href="/search">Search</a></p></div>
{days}"""
        return _page("Week", body)

    def _day(self, state: dict[str, Any], day: str) -> Response:
        body = f"""<h1>{day}, {DAYS[day]}</h1>
{_listing([e for e in state["events"] if e["day"] == day], "Nothing planned.")}
<p class="links"><a class="button" href="/events/new?{urlencode({"day": day})}">New event</a></p>"""
        return _page(day, body)

    def _search(self, state: dict[str, Any], q: str) -> Response:
        results = ""
        if q.strip():
            words = norm(q).split()
            found = [e for e in state["events"] if all(w in norm(f"{e['title']} {e['location']}") for w in words)]
            results = f"<h2>Results for “{esc(clean(q))}”</h2>{_listing(found, 'No events match.', show_day=True)}"
        body = f"""<h1>Search</h1>
<form role="search" method="get" action="/search">
<label for="q">Search events</label>
<div class="row"><input type="search" id="q" name="q" value="{esc(q)}"><button type="submit">Search</button></div>
</form>
{results}"""
        return _page("Search", body)

    def _show(self, event: dict[str, Any], note: str) -> Response:
        message = {"saved": "Event saved", "updated": "Event updated"}.get(note)
        place = f'<p class="where">{esc(event["location"])}</p>' if event["location"] else ""
        body = f"""{notice(message)}
<article class="event"><h1>{esc(event["title"])}</h1>
<p class="when">{esc(_when(event))}</p>{place}</article>
<p class="links"><a class="button" href="/event/edit?{urlencode({"id": event["id"]})}">Edit</a>
<a class="button danger" href="/event/delete?{urlencode({"id": event["id"]})}">Delete</a></p>"""
        return _page(event["title"], body)

    def _form(self, event: dict[str, Any] | None, values: dict[str, Any],
              error: str | None = None) -> Response:
        """The new-event form (event None) or the edit form, filled with `values`."""
        heading = "New event" if event is None else f"Edit “{event['title']}”"
        action = "/events" if event is None else "/event/edit"
        hidden = "" if event is None else f'<input type="hidden" name="id" value="{event["id"]}">'
        body = f"""<h1>{esc(heading)}</h1>
{alert(error)}
<form method="post" action="{action}">{hidden}
{field("title", "Title", values.get("title", ""))}
{radios("day", "Day", DAYS, values.get("day"))}
{radios("time", "Time", TIMES, values.get("time"))}
{field("location", "Location", values.get("location", ""), hint="optional")}
<button type="submit">Save</button>
</form>"""
        return _page(heading, body, 400 if error else 200)

    def _confirm_delete(self, event: dict[str, Any]) -> Response:
        body = f"""<h1>Delete “{esc(event["title"])}”?</h1>
<p>{esc(_when(event))}. This cannot be undone.</p>
<form method="post" action="/event/delete"><input type="hidden" name="id" value="{event["id"]}">
<p class="links"><button type="submit" class="danger">Delete event</button>
<a class="button quiet" href="{esc(_event_url(event))}">Cancel</a></p></form>"""
        return _page("Delete event", body)

    # --- form posts --------------------------------------------------------------

    def _save(self, state: dict[str, Any], event: dict[str, Any] | None, form: dict[str, str]) -> Response:
        values = {"title": clean(form.get("title", "")), "day": form.get("day", ""), "time": form.get("time", ""),
                  "location": clean(form.get("location", ""))}
        error = None
        if not values["title"]:
            error = "Enter a title."
        elif len(values["title"]) > MAX_TEXT or len(values["location"]) > MAX_TEXT:
            error = f"Title and location can have {MAX_TEXT} characters at most."
        elif values["day"] not in DAYS:
            error = "Choose a day."
        elif values["time"] not in TIMES:
            error = "Choose a time."
        if error:
            return self._form(event, values, error)
        if event is None:
            event = _event(state["next_id"], **values)
            state["next_id"] += 1
            state["events"].append(event)
            return redirect(_event_url(event, "saved"))
        event.update(values)
        return redirect(_event_url(event, "updated"))


def _by_id(state: dict[str, Any], id_: str) -> dict[str, Any] | None:
    return next((e for e in state["events"] if str(e["id"]) == id_), None)


# --- checkers: they read the session state, never the screen ----------------------


def _titled(state: dict[str, Any], title: str) -> list[dict[str, Any]]:
    return [e for e in state.get("events", []) if norm(e["title"]) == norm(title)]


def _at(events: list[dict[str, Any]]) -> str:
    return "; ".join(f"{e['day']} {e['time']}" for e in events)


def check_event_created(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """A new event (not one of the initial week, edited) titled `title` is on `day` at `time`."""
    if problem := missing(params, "title", "day", "time"):
        return False, problem
    titled = _titled(state, params["title"])
    found = [e for e in titled if e["id"] not in SEED_IDS]
    if titled and not found:
        return False, f"{params['title']!r} is an event of the initial week, renamed, not a new event"
    if any(norm(e["day"]) == norm(params["day"]) and e["time"] == params["time"] for e in found):
        return True, f"{params['title']!r} is on {params['day']} at {params['time']}"
    if not found:
        return False, f"no event titled {params['title']!r}"
    return False, f"{params['title']!r} is on {_at(found)}, not {params['day']} {params['time']}"


def check_event_moved(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The initial week's event titled `event` (by its id: a new event of that title is a copy, not the event
    moved) is now on `day` at `time`, no other event has its title, and every other event of the week is as it was."""
    if problem := missing(params, "event", "day", "time"):
        return False, problem
    seed = next((e for e in SEED_EVENTS if norm(e["title"]) == norm(params["event"])), None)
    if seed is None:
        return False, f"no event of the initial week is titled {params['event']!r}"
    found = _titled(state, params["event"])
    if len(found) != 1:
        return False, f"expected one event titled {params['event']!r}, found {len(found)} ({_at(found)})"
    event = found[0]
    if event["id"] != seed["id"]:
        return False, f"{params['event']!r} on {_at(found)} is a new event, not the initial week's, moved"
    changed = [e["title"] for e in SEED_EVENTS if e["id"] != seed["id"] and e not in state.get("events", [])]
    if changed:
        return False, f"{params['event']!r} is on {_at(found)}, but {', '.join(map(repr, changed))} changed or went"
    if norm(event["day"]) == norm(params["day"]) and event["time"] == params["time"]:
        return True, f"{params['event']!r} is on {event['day']} at {event['time']}"
    return False, f"{params['event']!r} is on {event['day']} at {event['time']}, not {params['day']} {params['time']}"


def check_event_deleted(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The initial week's event titled `event` is gone (by its id: renamed is not deleted), no event has
    that title, and every other event of the initial week is still there."""
    if problem := missing(params, "event"):
        return False, problem
    target = {e["id"] for e in SEED_EVENTS if norm(e["title"]) == norm(params["event"])}
    if not target:
        return False, f"no event of the initial week is titled {params['event']!r}"
    events = state.get("events", [])
    if kept := [e for e in events if e["id"] in target or norm(e["title"]) == norm(params["event"])]:
        where = "; ".join(f"{e['title']!r} {e['day']} {e['time']}" for e in kept)
        return False, f"{params['event']!r} is still there: {where}"
    ids = {e["id"] for e in events}
    lost = [e["title"] for e in SEED_EVENTS if e["id"] not in ids and e["id"] not in target]
    if lost:
        return False, f"{params['event']!r} is gone, but so are {', '.join(map(repr, lost))}"
    return True, f"{params['event']!r} is deleted and the other events are kept"


def create_app() -> CalendarApp:
    return CalendarApp()

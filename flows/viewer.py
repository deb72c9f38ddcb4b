"""`trajforge view`: a run's (or one episode's) trajectories as a static HTML site.

A person judging the data wants to see what the agent saw and did, not read rows: each
step's screenshot with the action drawn on it (the step critic's own drawing,
`critics.annotate`), the thought, the critics' labels and the verdict's channels. The
site is plain files with relative links (no server, no framework), so the folder can be
zipped, attached to an issue and opened anywhere without the warehouse. Text is escaped
(jinja2 autoescape), and what was typed into a password-like field is masked wherever
the page would show it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import polars as pl

from trajforge.critics.annotate import annotate
from trajforge.llm.workspace import Workspace
from trajforge.schemas.records import Episode, Guidance, Step, StepCritique, Verdict

MASK = "••••••"
_SECRET_FIELD = re.compile(r"pass(word|code|phrase)|secret|\bpin\b|token|api.?key|credential", re.IGNORECASE)
_MASKED_VALUE = re.compile(r"\[focused\][^\n]*: [•●*]{2,}")  # Chromium shows a password field's value as bullets


class ViewError(ValueError):
    """The target is neither a run id with episodes nor an episode id."""


@dataclass
class StepView:
    index: int
    image: str
    action: str
    target: str
    thought: str
    error: str | None
    critiques: list[dict[str, Any]]


@dataclass
class EpisodeView:
    episode: Episode
    page: str
    source: str
    verdict: str
    verdict_reason: str
    channels: list[dict[str, Any]]
    guidance: Guidance | None
    instruction: str
    steps: list[StepView] = field(default_factory=list)
    final_image: str | None = None


def build_viewer(ws: Workspace, target: str | None = None, out: Path | None = None) -> Path:
    """Write the site for `target` (a run id: its episodes; or an episode id; None: the latest run, `latest_run`)
    and return its index.html.

    Default folder: `<warehouse>/views/<target>/`. Rebuilding into the same folder rewrites the pages and
    keeps the images already there (they are named by content)."""
    target = target if target is not None else latest_run(ws)
    episodes = _episodes(ws, target)
    out = Path(out) if out is not None else ws.catalog.warehouse / "views" / _safe(target)
    (out / "img").mkdir(parents=True, exist_ok=True)
    ids = [e.episode_id for e in episodes]
    steps = _rows(ws, "steps", ids)
    # The critics judge again on a rerun and their tables keep every judgement: the newest of each is shown.
    critiques = _rows(ws, "step_critiques", ids, newest=["step_id", "critic"])
    verdicts = {v["episode_id"]: Verdict.model_validate(v) for v in _rows(ws, "verdicts", ids, newest="episode_id")}
    guidance_ids = [e.guidance_id for e in episodes if e.guidance_id]
    guidance = {g["guidance_id"]: Guidance.model_validate(g) for g in _rows(ws, "guidance", guidance_ids, "guidance_id")}
    views = [_episode_view(ws, e, steps, critiques, verdicts.get(e.episode_id), guidance, out) for e in episodes]
    env = jinja2.Environment(loader=jinja2.DictLoader(_TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined)
    for view in views:
        (out / view.page).write_text(env.get_template("episode").render(v=view, style=_STYLE), encoding="utf-8")
    options = {"app": sorted({v.episode.app for v in views}), "verdict": sorted({v.verdict for v in views}),
               "source": sorted({v.source for v in views})}
    index = out / "index.html"
    index.write_text(env.get_template("index").render(target=target, views=views, options=options, style=_STYLE),
                     encoding="utf-8")
    return index


def latest_run(ws: Workspace) -> str:
    """The run that started the newest episode (a run id names its kind, nightly or a stage, before its start
    time, so ids do not sort by time across kinds)."""
    newest = (ws.catalog.scan("episodes").sort("started_at", "episode_id").select("run_id").last().collect()
              if "episodes" in ws.catalog.tables() else pl.DataFrame())
    if newest.height == 0:
        raise ViewError("the warehouse has no episodes yet; `trajforge run nightly` (or `trajforge run rollout`) "
                        "writes them")
    return newest.item()


def _episodes(ws: Workspace, target: str) -> list[Episode]:
    """The run's episodes, or the one episode, oldest first; ViewError names what is accepted otherwise."""
    if "episodes" not in ws.catalog.tables():
        raise ViewError(f"no run or episode {target!r}: the warehouse has no episodes yet (run the rollout first)")
    table = ws.catalog.scan("episodes")
    rows = table.filter((pl.col("run_id") == target) | (pl.col("episode_id") == target)).collect()
    if rows.height == 0:
        runs = table.select("run_id").unique().collect()["run_id"].sort(descending=True).to_list()
        raise ViewError(f"no run or episode {target!r}: give a run id that wrote episodes "
                        f"({', '.join(runs[:5]) or 'none yet'}) or an episode id")
    if (rows["episode_id"] == target).any():
        rows = rows.filter(pl.col("episode_id") == target)  # an id that is both: the episode wins
    return [Episode.model_validate(r) for r in rows.sort("started_at", "episode_id").to_dicts()]


def _rows(ws: Workspace, table: str, ids: list[str], column: str = "episode_id",
          newest: str | list[str] | None = None) -> list[dict[str, Any]]:
    """The latest version's rows whose `column` is one of `ids`; with `newest`, only the last run's row of each
    such key (`Catalog.newest`)."""
    if table not in ws.catalog.tables() or not ids:
        return []
    if newest is not None:
        return ws.catalog.newest(table, newest, where=pl.col(column).is_in(ids)).to_dicts()
    return ws.catalog.scan(table).filter(pl.col(column).is_in(ids)).collect().to_dicts()


def _safe(name: str) -> str:
    """A file name for an id (ids hold ':' and '/' in places); a hash keeps two ids that clean alike apart."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    return clean if clean == name else f"{clean}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _image(png: bytes, out: Path) -> str:
    """Write the PNG once under img/, named by its sha256, and return its path relative to the pages."""
    name = f"img/{hashlib.sha256(png).hexdigest()}.png"
    if not (out / name).exists():
        (out / name).write_bytes(png)
    return name


def _secrets(steps: list[Step]) -> list[str]:
    """What the episode typed into fields that look like passwords, by the field's name or its masked value."""
    found = []
    for s in steps:
        text = json.loads(s.action_json).get("text") if s.action_type == "type" else None
        if not isinstance(text, str) or not text:
            continue
        if _SECRET_FIELD.search(f"{s.target_role} {s.target_name}") or _MASKED_VALUE.search(s.ax_tree_after or ""):
            found.append(text)
    return sorted(found, key=len, reverse=True)  # longest first, so no part of one is left showing


def _masker(secrets: list[str]) -> Any:
    def mask(text: str | None) -> str:
        text = text or ""
        for secret in secrets:
            text = text.replace(secret, MASK)
        return text
    return mask


def _episode_view(ws: Workspace, e: Episode, step_rows: list[dict[str, Any]], critique_rows: list[dict[str, Any]],
                  verdict: Verdict | None, guidance: dict[str, Guidance], out: Path) -> EpisodeView:
    steps = [Step.model_validate(r) for r in step_rows if r["episode_id"] == e.episode_id]
    steps.sort(key=lambda s: s.step_index)
    mask = _masker(_secrets(steps))
    source = e.source or "policy"
    if verdict is not None:
        label, reason = ("success" if verdict.success else "failure"), verdict.reason  # the reason names the rule
        channels = [{"name": name, "answer": c.get("answer") or "no answer", "model": c.get("model_id"),
                     "reason": mask(c.get("reason"))} for name, c in sorted(json.loads(verdict.channels_json).items())]
    elif e.success is not None:
        label, reason, channels = ("success" if e.success else "failure"), "the query's checker on the final state", []
    else:
        label, reason, channels = "not judged", "no verdict row for this episode", []
    by_step: dict[str, list[StepCritique]] = {}
    for r in critique_rows:
        if r["episode_id"] == e.episode_id:
            by_step.setdefault(r["step_id"], []).append(StepCritique.model_validate(r))
    g = guidance.get(e.guidance_id or "")
    view = EpisodeView(e, f"episode-{_safe(e.episode_id)}.html", source, label, mask(reason), channels,
                       g.model_copy(update={"text": mask(g.text)}) if g else None, mask(e.instruction))
    for s in steps:
        args = json.loads(s.action_json)
        if "text" in args:
            args["text"] = mask(args["text"])
        png = ws.blobs.get(s.screenshot_before)
        drawn = annotate(png, {**args, "type": s.action_type}, s.target_box) if s.action_valid else None
        view.steps.append(StepView(
            index=s.step_index,
            image=_image(drawn or png, out),
            action=f"{s.action_type or '(none)'} {json.dumps(args, ensure_ascii=False)}",
            target=" ".join(x for x in (s.target_role, s.target_name) if x),
            thought=mask(s.thought),
            error=mask(s.action_error or s.policy_error) or None,
            critiques=[{"critic": c.critic, "label": c.label or "unparsed", "summary": mask(c.summary),
                        "flags": ", ".join(c.flags or [])} for c in by_step.get(s.step_id, [])],
        ))
    if steps:
        view.final_image = _image(ws.blobs.get(steps[-1].screenshot_after), out)
    return view


_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
.success { color: #0a7a2f; font-weight: 600; } .failure { color: #b00020; font-weight: 600; }
.step { display: flex; gap: 1.5em; border-top: 1px solid #ddd; padding: 1em 0; }
.step img, .final img { max-width: 420px; max-height: 640px; border: 1px solid #aaa; }
.GOOD { color: #0a7a2f; } .HARMFUL { color: #b00020; } .NEUTRAL { color: #8a6d00; }
code { background: #f3f3f3; padding: 1px 4px; white-space: pre-wrap; } .filters select { margin-right: 1em; }
"""

_TEMPLATES = {
    "index": """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trajforge: {{ target }}</title><style>{{ style }}</style></head>
<body>
<h1>Trajectories of {{ target }}</h1>
<p class="filters">
{% for name, values in options.items() %}
<label>{{ name }} <select id="filter-{{ name }}" data-filter="{{ name }}"><option value="">all</option>
{% for value in values %}<option value="{{ value }}">{{ value }}</option>{% endfor %}</select></label>
{% endfor %}
<span id="shown">{{ views|length }} of {{ views|length }} episodes shown</span></p>
<table id="episodes">
<thead><tr><th>episode</th><th>app</th><th>viewport</th><th>instruction</th><th>source</th><th>verdict</th>
<th>steps</th><th>status</th></tr></thead>
<tbody>
{% for v in views %}<tr data-app="{{ v.episode.app }}" data-verdict="{{ v.verdict }}" data-source="{{ v.source }}">
<td><a href="{{ v.page }}">{{ v.episode.episode_id }}</a></td><td>{{ v.episode.app }}</td>
<td>{{ v.episode.viewport }}</td><td>{{ v.instruction }}</td>
<td>{{ v.source }}</td><td class="{{ v.verdict }}">{{ v.verdict }}</td><td>{{ v.episode.num_steps }}</td>
<td>{{ v.episode.status }}</td></tr>
{% endfor %}</tbody></table>
<script>
const selects = document.querySelectorAll("select[data-filter]");
const rows = document.querySelectorAll("#episodes tbody tr");
function apply() {
  let shown = 0;
  for (const row of rows) {
    const keep = [...selects].every(s => !s.value || row.dataset[s.dataset.filter] === s.value);
    row.hidden = !keep;
    shown += keep;
  }
  document.getElementById("shown").textContent = `${shown} of ${rows.length} episodes shown`;
}
selects.forEach(s => s.addEventListener("change", apply));
</script>
</body></html>
""",
    "episode": """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ v.episode.episode_id }}</title><style>{{ style }}</style></head>
<body>
<p><a href="index.html">&larr; all episodes</a></p>
<h1>{{ v.instruction }}</h1>
<p>Episode <code>{{ v.episode.episode_id }}</code> of query <code>{{ v.episode.query_id }}</code> on
<b>{{ v.episode.app }}</b> ({{ v.episode.viewport }}); source {{ v.source }}: policy {{ v.episode.policy }},
model {{ v.episode.model_id }}; {{ v.episode.num_steps }} steps, ended {{ v.episode.status }}
{%- if v.episode.fault %} ({{ v.episode.fault }}){% endif %}.</p>
<h2>Verdict: <span class="{{ v.verdict }}">{{ v.verdict }}</span></h2>
<p>{{ v.verdict_reason }}</p>
{% if v.channels %}<table><tr><th>channel</th><th>answer</th><th>model</th><th>reason</th></tr>
{% for c in v.channels %}<tr><td>{{ c.name }}</td><td class="{{ c.answer }}">{{ c.answer }}</td>
<td>{{ c.model or "" }}</td><td>{{ c.reason }}</td></tr>{% endfor %}</table>{% endif %}
<h2>Guidance</h2>
{% if v.guidance %}<p><code>{{ v.guidance.text }}</code></p><p>{{ v.guidance.hard_reason }}</p>
{% else %}<p>None: the policy was not given guidance.</p>{% endif %}
<h2>Steps</h2>
{% for s in v.steps %}<div class="step" id="step-{{ s.index }}">
<img src="{{ s.image }}" alt="step {{ s.index }} before the action">
<div><h3>Step {{ s.index }}</h3>
<p><b>Action</b> <code>{{ s.action }}</code>{% if s.target %} on {{ s.target }}{% endif %}</p>
{% if s.error %}<p class="failure">{{ s.error }}</p>{% endif %}
<p><b>Thought</b> {{ s.thought }}</p>
{% for c in s.critiques %}<p class="critique"><b>{{ c.critic }}</b>: <span class="{{ c.label }}">{{ c.label }}</span>
{% if c.flags %}[{{ c.flags }}] {% endif %}{{ c.summary }}</p>
{% else %}<p>No step critique.</p>{% endfor %}
</div></div>
{% endfor %}
{% if v.final_image %}<div class="final"><h3>Final screen</h3>
<img src="{{ v.final_image }}" alt="the screen when the episode ended"></div>{% endif %}
</body></html>
""",
}

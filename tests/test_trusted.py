"""The trusted steps the synthesis stages teach (`synth/trusted.py`): which steps are targets, and what a
prediction of one may choose from."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

from PIL import Image

from trajforge.data.catalog import Lineage
from trajforge.llm.workspace import Workspace
from trajforge.rollout.gui_owl import MAX_TARGETS
from trajforge.schemas.config import Settings
from trajforge.schemas.records import Episode, Step, StepCritique, TrainingStep, Verdict
from trajforge.schemas.stage import StageDef, StageOutput
from trajforge.synth.match import match
from trajforge.synth.trusted import TrustedEpisode, load_trusted, prediction_schema, spread, trusted_action
from trajforge.tasks.runner import run_inline


def _step(i: int, kind: str, args: dict, *, name: str | None = None, box: list[float] | None = None,
          tree: str = "", png: str = "a" * 64) -> Step:
    return Step(run_id="made", step_id=f"e:{i}", episode_id="e", step_index=i, screenshot_before=png,
                screenshot_after=png, width=390, height=844, url_before="u", url_after="u", title_before="t",
                title_after="t", ax_tree_before=tree, action_type=kind, action_json=json.dumps(args),
                action_valid=True, target_role="button" if name else None, target_name=name, target_box=box,
                thought="", raw_output="", duration_ms=0)


def _clicks(schema: dict) -> list[dict]:
    return [b["properties"] for b in schema["properties"]["arguments"]["anyOf"]
            if b["properties"]["action"] == {"const": "click"}]


def test_a_named_prediction_can_choose_the_steps_target_after_the_first_max_targets():
    """The call schema names the first MAX_TARGETS elements; a trusted click on a later one (here the second
    "Edit", the 61st element) is still among the choices, MAX_TARGETS consecutive ones around it at a place drawn
    from the step's id, so a prediction can match it and no place (the last) gives it away."""
    names = [f"Item {i}" for i in range(MAX_TARGETS + 40)]
    names[30] = names[60] = "Edit"
    boxes = [[10.0 + 120 * (i % 3), 10.0 + 30 * (i // 3), 60.0, 20.0] for i in range(len(names))]  # on a 390x844 screen
    tree = "main\n" + "\n".join(f'  button "{n}" ({x:.0f},{y:.0f},{w:.0f},{h:.0f})'
                                for n, (x, y, w, h) in zip(names, boxes, strict=True))

    def choices(index: int) -> tuple[Step, list[dict]]:
        x, y, w, h = boxes[index]
        step = _step(0, "click", {"x": x + w / 2, "y": y + h / 2}, name=names[index], box=boxes[index], tree=tree)
        return step, _clicks(prediction_schema("mobile", step, "names"))

    late, clicks = choices(60)
    offered = [c["target"]["const"] for c in clicks]
    start = int(offered[0].removeprefix("Item "))
    assert 20 < start <= 60 and len(offered) == MAX_TARGETS and offered[-1] != "Edit (2)"
    assert offered == [n if n != "Edit" else "Edit (2)" if i == 60 else "Edit" for i, n in enumerate(names)][
        start:start + MAX_TARGETS]  # consecutive, in document order; the first "Edit" too where the window holds it
    hits = [c["target"]["const"] for c in clicks if match(
        {"type": "click", "x": c["coordinate"]["const"][0], "y": c["coordinate"]["const"][1]},
        trusted_action(late), target_box=late.target_box).ok]
    assert hits == ["Edit (2)"]
    # A target among the first MAX_TARGETS leaves the choice as the rollout's: the first MAX_TARGETS.
    _, clicks = choices(3)
    assert [c["target"]["const"] for c in clicks] == names[:MAX_TARGETS]


def made(key: str, run: str = "made") -> Lineage:
    """The lineage of a commit a test makes by hand."""
    return Lineage(stage="test", run_id=run, commit_key=key, config_hash="x", code_version="x")


def made_reference(ws: Workspace, num_steps: int) -> str:
    """Commit a reference episode "e" its checker passed (so its steps are trusted), and a white screenshot for its
    steps; the screenshot's sha256."""
    buffer = io.BytesIO()
    Image.new("RGB", (390, 844), "white").save(buffer, format="PNG")
    when = datetime(2026, 12, 5, tzinfo=UTC)
    ws.catalog.commit_rows("episodes", [Episode(
        run_id="made", episode_id="e", query_id="q", app="notes", instruction="task", policy="reference",
        model_id="none", prompt_version="none", viewport="mobile", status="terminated", num_steps=num_steps,
        final_url="u", final_state_json="{}", started_at=when, finished_at=when, source="reference", success=True)],
        made("episodes"))
    return ws.blobs.put(buffer.getvalue()).sha256


def test_a_click_that_changed_nothing_is_history_not_a_target(tmp_path):
    """A click whose latest step critique carries the pre-filter's no_change flag is NEUTRAL, so its episode is
    accepted, but no synthesis stage is taught it (the export drops it from train_e2e too); a terminate, which
    changes nothing by nature, stays a target, and so does a click a later critique no longer flags."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    png = made_reference(ws, 3)
    steps = [_step(0, "click", {"x": 5, "y": 9}, name="Cart", png=png),
             _step(1, "click", {"x": 5, "y": 9}, name="Cart", png=png),
             _step(2, "terminate", {"status": "success"}, png=png)]
    snapshot = ws.catalog.commit_rows("steps", steps, made("steps"))
    judged = ({"e:0": ["no_change"], "e:1": None}, {"e:0": None, "e:1": ["no_change"], "e:2": ["no_change"]})
    for n, flags in enumerate(judged):
        ws.catalog.commit_rows("step_critiques", [StepCritique(
            run_id=f"critics{n}", critique_id=f"{step}:{n}", step_id=step, episode_id="e", critic="c", model_id="m",
            prompt_version="1", analysis="", summary="", label="NEUTRAL" if flagged else "GOOD", raw_output="",
            flags=flagged) for step, flagged in flags.items()], made(f"critiques{n}", f"critics{n}"))
    inputs = load_trusted(ws, snapshot)
    [unit] = inputs.units
    assert [i for _, i in spread([unit], 10)] == [0, 2] and len(unit.steps) == 3
    assert [unit.imitable(i) for i in range(3)] == [True, False, True] and unit.no_change == {"e:1"}
    assert inputs.stats["trusted steps that changed nothing (pre-filter no_change): history only, not imitated"] == 1


def test_an_episode_the_critics_reject_after_a_stage_used_it_leaves_no_row(tmp_path):
    """A stage of trusted steps (reasoning, pal_ui, ces) did an accepted policy episode; the critics judge it again
    and reject it: rerun on the same steps, the stage takes its rows out (counted as withdrawn) instead of keeping
    them as "not trusted"; accepted once more, it is done again. An episode rejected from the start, which no run
    did, is not counted as withdrawn."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    when = datetime(2026, 12, 5, tzinfo=UTC)
    ws.catalog.commit_rows("episodes", [Episode(
        run_id="made", episode_id=e, query_id="q", app="notes", instruction="task", policy="gui_owl",
        model_id="m", prompt_version="1", viewport="mobile", status="terminated", num_steps=1, final_url="u",
        final_state_json="{}", started_at=when, finished_at=when) for e in ("p", "r")], made("episodes"))
    snapshot = ws.catalog.commit_rows("steps", [
        _step(0, "terminate", {"status": "success"}).model_copy(update={"step_id": f"{e}:0", "episode_id": e})
        for e in ("p", "r")], made("steps"))

    def teach(units: list[TrustedEpisode], ws: Workspace, run_id: str, _: str) -> StageOutput:
        return StageOutput(rows={"train_e2e": [TrainingStep(
            run_id=run_id, sample_id=f"{run_id}:{u.episode_id}", step_id=u.steps[0].step_id, episode_id=u.episode_id,
            query_id=u.query_id, label="GOOD", messages_json="[]", images=[], tag="t") for u in units]})

    stage = StageDef[Workspace, TrustedEpisode](
        name="trusted-demo", key=lambda u: u.episode_id, reads="steps", writes={"train_e2e": "append"},
        sections=("synth",), once=True, replaces=("episode_id", lambda u: u.episode_id), load=load_trusted,
        run=teach, shard_size=lambda s: 50)
    for n, accepted in enumerate((True, False, True)):
        ws.catalog.commit_rows("verdicts", [Verdict(
            run_id=f"critics{n}", verdict_id=f"{e}:{n}", episode_id=e, query_id="q", success=accepted and e == "p",
            consensus="c", channels_json="{}", reason="", config_hash="x") for e in ("p", "r")],
            made(f"verdicts{n}", f"critics{n}"))
        run = ws.ledger.open_run("test", f"judged {n}").run_id
        lineage = ws.catalog.lineage("train_e2e", run_inline(stage, ws, run, snapshot)["train_e2e"])
        rows = ws.catalog.load("train_e2e")
        assert rows["episode_id"].to_list() == (["p"] if accepted else []), n
        withdrawn = {k: v for k, v in lineage.stats.items() if k.startswith("withdrawn")}
        assert withdrawn == ({} if accepted else {"withdrawn: policy episode not accepted by the critics": 1}), n
        assert lineage.stats["not trusted: policy episode not accepted by the critics"] == (1 if accepted else 2)


def test_an_accepted_episode_judged_again_with_a_step_now_harmful_is_done_again_without_it(tmp_path):
    """A stage of trusted steps (reasoning, pal_ui, ces) taught both steps of an accepted episode; the step critic
    then calls its first step HARMFUL, the episode still accepted: rerun on the same steps, the stage does the
    episode again (its key names the steps set apart) and its rows are replaced, the harmful step's gone; judged
    the same once more, nothing is redone."""
    ws = Workspace.open(Settings(warehouse={"path": tmp_path / "wh"}))
    when = datetime(2026, 12, 5, tzinfo=UTC)
    ws.catalog.commit_rows("episodes", [Episode(
        run_id="made", episode_id="e", query_id="q", app="notes", instruction="task", policy="gui_owl",
        model_id="m", prompt_version="1", viewport="mobile", status="terminated", num_steps=2, final_url="u",
        final_state_json="{}", started_at=when, finished_at=when)], made("episodes"))
    snapshot = ws.catalog.commit_rows("steps", [_step(0, "click", {"x": 5, "y": 9}),
                                                _step(1, "terminate", {"status": "success"})], made("steps"))
    ws.catalog.commit_rows("verdicts", [Verdict(
        run_id="critics", verdict_id="e:v", episode_id="e", query_id="q", success=True, consensus="c",
        channels_json="{}", reason="", config_hash="x")], made("verdicts", "critics"))

    def teach(units: list[TrustedEpisode], ws: Workspace, run_id: str, _: str) -> StageOutput:
        return StageOutput(rows={"train_e2e": [TrainingStep(
            run_id=run_id, sample_id=f"{run_id}:{s.step_id}", step_id=s.step_id, episode_id=u.episode_id,
            query_id=u.query_id, label="GOOD", messages_json="[]", images=[], tag="t")
            for u in units for i, s in enumerate(u.steps) if u.imitable(i)]})

    stage = StageDef[Workspace, TrustedEpisode](
        name="trusted-demo", key=lambda u: u.unit_key, reads="steps", writes={"train_e2e": "append"},
        sections=("synth",), once=True, replaces=("episode_id", lambda u: u.episode_id), load=load_trusted,
        run=teach, shard_size=lambda s: 50)
    for n, labels in enumerate((None, "HARMFUL", "HARMFUL")):
        if labels is not None:
            ws.catalog.commit_rows("step_critiques", [StepCritique(
                run_id=f"critics{n}", critique_id=f"e:0:{n}", step_id="e:0", episode_id="e", critic="c",
                model_id="m", prompt_version="1", analysis="", summary="", label=labels, raw_output="", flags=[])],
                made(f"critiques{n}", f"critics{n}"))
        run = ws.ledger.open_run("test", f"judged {n}").run_id
        lineage = ws.catalog.lineage("train_e2e", run_inline(stage, ws, run, snapshot)["train_e2e"])
        rows = ws.catalog.load("train_e2e")
        assert sorted(rows["step_id"]) == (["e:0", "e:1"] if n == 0 else ["e:1"]), n
        assert ("already done by an earlier run with this configuration" in lineage.stats) == (n == 2), n
    from trajforge.synth import ces, pal_ui, reasoning
    judged = load_trusted(ws, snapshot).units[0]
    assert judged.unit_key != "e" and {s.key(judged) for s in (reasoning.STAGE, pal_ui.STAGE, ces.STAGE)} == {
        judged.unit_key}

"""The report's self-evolving loop section (issue 18): which model made a night's rollouts, what trained the next
one, and the newest iteration against the one before on the same queries; drawn from hand-made frames."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import takewhile

import polars as pl

from trajforge.data.catalog import Catalog
from trajforge.schemas.records import Checkpoint, QueryAttempt
from trajforge.synth.report import render_iterations

AT = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
BASE, M1, M2 = "qwen-base", "checkpoints/m1", "checkpoints/m2"
M1_HASH, M2_HASH = "abcdef0123456789" + "0" * 48, "fedcba9876543210" + "1" * 48


def history(rows: list[tuple[str, str, str, int, str, bool]]) -> pl.DataFrame:
    """query_history rows from (run, query, app, iteration, model, success), as the record writes them."""
    return pl.DataFrame([QueryAttempt(run_id=run, episode_id=f"ep{i}", query_id=query, app=app, source="page_graph",
                                      iteration=iteration, policy="model", model_id=model, success=ok,
                                      judged_at=AT).model_dump()
                         for i, (run, query, app, iteration, model, ok) in enumerate(rows)])


def checkpoint(run: str, model: str, digest: str, base: str, trained_on: list[str]) -> dict:
    return Checkpoint(run_id=run, model_id=model, checkpoint_hash=digest, folder=model, served_by="local",
                      base_model_id=base, root_model_id=BASE, trained_on=trained_on, samples=40, steps=30,
                      trainer="python -m trajforge.train.builtin", seconds=12.4, created_at=AT).model_dump()


def no_checkpoints(tmp_path) -> pl.DataFrame:
    """What write_report reads from a warehouse whose train stage never ran (every warehouse before issue 18)."""
    catalog = Catalog(tmp_path / "warehouse", uri=f"sqlite:///{tmp_path / 'catalog.db'}")
    frame = catalog.load("checkpoints")
    assert frame.height == 0 and "checkpoints" not in catalog.tables(), "reading creates no table"
    return frame


def two_iterations() -> pl.DataFrame:
    """Iteration 0 (the base model, nights 0 and 1) and 1 (checkpoint m1, night 2) on two apps.

    shop: s1 1/2 -> 2/2, s2 0/1 -> 0/1, s3 only under 0 (1/1). mail: m1 2/2 -> 1/3, m2 only under 1 (0/1),
    m3 only under 0 (0/2). The one-sided queries would change every per-app figure if they were counted."""
    rows = [("night-0", "s1", "shop", 0, BASE, True), ("night-1", "s1", "shop", 0, BASE, False),
            ("night-1", "s2", "shop", 0, BASE, False), ("night-1", "s3", "shop", 0, BASE, True),
            ("night-1", "m1", "mail", 0, BASE, True), ("night-1", "m1", "mail", 0, BASE, True),
            ("night-1", "m3", "mail", 0, BASE, False), ("night-1", "m3", "mail", 0, BASE, False)]
    rows += [("night-2", "s1", "shop", 1, M1, True), ("night-2", "s1", "shop", 1, M1, True),
             ("night-2", "s2", "shop", 1, M1, False), ("night-2", "m1", "mail", 1, M1, True),
             ("night-2", "m1", "mail", 1, M1, False), ("night-2", "m1", "mail", 1, M1, False),
             ("night-2", "m2", "mail", 1, M1, False)]
    return history(rows)


def cells(markdown: str, start: str) -> list[str]:
    """The cells of the one table row that starts with `start`."""
    (line,) = [line for line in markdown.splitlines() if line.startswith(start)]
    return [c.strip() for c in line.split("|")[1:-1]]


def compared_queries(markdown: str) -> list[str]:
    """The query ids of the per-query comparison, in its order."""
    lines = markdown.splitlines()
    body = lines[[i for i, line in enumerate(lines) if line.startswith("| query | app |")][0] + 2:]
    return [line.split("|")[1].strip() for line in takewhile(lambda line: line.startswith("|"), body)]


def test_each_iteration_names_its_checkpoint_and_the_table_versions_that_trained_it():
    checkpoints = pl.DataFrame([checkpoint("night-1", M1, M1_HASH, BASE, ["train_e2e@111", "train_grounding@222"]),
                                checkpoint("night-2", M2, M2_HASH, M1, ["train_e2e@333"])])
    markdown = "\n".join(render_iterations(two_iterations(), checkpoints, "night-2"))
    assert markdown.count("## ") == 1 + markdown.count("### "), "one section"
    assert cells(markdown, "| 0 |") == ["0", BASE, "-", "-", "2", "8", "4/8 (50%)"]
    assert cells(markdown, "| 1 |") == ["1", M1, f"abcdef012345 from {BASE}", "train_e2e@111, train_grounding@222",
                                        "1", "7", "3/7 (43%)"]
    assert f"- Rollouts: iteration 1, {M1} (checkpoint abcdef012345 from {BASE})." in markdown
    assert (f"- Trained for the next iteration: {M2} (checkpoint fedcba987654 from {M1}) on train_e2e@333: "
            "40 samples, 30 steps, 12 s.") in markdown
    assert M1_HASH[:13] not in markdown, "hashes are shown short"


def test_the_newest_iteration_is_compared_with_the_one_before_on_the_same_queries_only(tmp_path):
    markdown = "\n".join(render_iterations(two_iterations(), no_checkpoints(tmp_path), "night-2"))
    assert "### Iteration 1 against iteration 0 on the same queries" in markdown
    assert "on the 3 queries both attempted" in markdown
    assert "2 queries attempted under iteration 0 only, 1 under iteration 1 only" in markdown
    assert cells(markdown, "| shop |") == ["shop", "1/3 (33%)", "2/3 (67%)", "+33%"]
    assert cells(markdown, "| mail |") == ["mail", "2/2 (100%)", "1/3 (33%)", "-67%"]
    assert cells(markdown, "| all |") == ["all", "3/5 (60%)", "3/6 (50%)", "-10%"]
    assert compared_queries(markdown) == ["m1", "s1", "s2"], "most moved first; one-sided queries not listed"
    assert cells(markdown, "| m1 |") == ["m1", "mail", "2/2 (100%)", "1/3 (33%)", "-67%"]
    assert cells(markdown, "| s1 |") == ["s1", "shop", "1/2 (50%)", "2/2 (100%)", "+50%"]
    assert f"- Rollouts: iteration 1, {M1} (not a trained checkpoint)." in markdown
    assert "- No checkpoint trained this night (loop.train)." in markdown


def test_the_comparison_lists_the_queries_that_moved_most_and_counts_the_rest(tmp_path):
    rows = []
    for q in range(33):  # query q: 0/1 under iteration 0, 1/1 under 1 for q < 5, else 0/1 (no change)
        rows += [("night-1", f"q{q:02d}", "shop", 0, BASE, False), ("night-2", f"q{q:02d}", "shop", 1, M1, q < 5)]
    markdown = "\n".join(render_iterations(history(rows), no_checkpoints(tmp_path), "night-2"))
    listed = compared_queries(markdown)
    assert len(listed) == 30 and listed[:5] == ["q00", "q01", "q02", "q03", "q04"] and "q32" not in listed
    assert "3 more queries of both iterations moved less and are not listed." in markdown
    assert cells(markdown, "| shop |") == ["shop", "0/33 (0%)", "5/33 (15%)", "+15%"]


def test_a_single_iteration_gets_no_comparison(tmp_path):
    one = two_iterations().filter(pl.col("iteration") == 0)
    markdown = "\n".join(render_iterations(one, no_checkpoints(tmp_path), "night-1"))
    assert cells(markdown, "| 0 |") == ["0", BASE, "-", "-", "2", "8", "4/8 (50%)"]
    assert f"- Rollouts: iteration 0, {BASE} (not a trained checkpoint)." in markdown
    assert "against iteration" not in markdown and "| shop |" not in markdown
    # a night of the older iteration after a newer one compares nothing either: nothing came before iteration 0
    markdown = "\n".join(render_iterations(two_iterations(), no_checkpoints(tmp_path), "night-1"))
    assert "against iteration" not in markdown


def test_the_newest_iteration_is_compared_with_the_one_just_before_it(tmp_path):
    rows = [("night-1", "s1", "shop", 0, BASE, False), ("night-2", "s1", "shop", 1, M1, False),
            ("night-2", "s1", "shop", 1, M1, True), ("night-3", "s1", "shop", 2, M2, True)]
    markdown = "\n".join(render_iterations(history(rows), no_checkpoints(tmp_path), "night-3"))
    assert "### Iteration 2 against iteration 1 on the same queries" in markdown
    assert cells(markdown, "| s1 |") == ["s1", "shop", "1/2 (50%)", "1/1 (100%)", "+50%"]

"""The dataset catalog on real SQLite and PostgreSQL catalogs, with real Parquet files."""

from __future__ import annotations

import multiprocessing
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy
from polars.exceptions import PerformanceWarning
from pydantic import Field, create_model

from trajforge.data.catalog import (
    TABLE_PROPERTIES,
    Catalog,
    CatalogError,
    CorruptData,
    Lineage,
    UnknownColumn,
    UnknownRef,
    Withdrawal,
    _Transaction,
)
from trajforge.schemas.records import RECORDS, Query, Record, Step
from trajforge.schemas.tables import RowError, arrow_schema, to_arrow


def query_row(query_id: str, instruction: str | None = None, run_id: str = "run-1") -> dict[str, Any]:
    return {
        "run_id": run_id,
        "query_id": query_id,
        "app": "notes",
        "source": "page_graph",
        "instruction": instruction or f"open note {query_id}",
        "path": ["home", "note"],
        "slots_json": '{"title": "groceries"}',
        "checker": "note_exists",
        "checker_params_json": "{}",
        "max_steps": 8,
        "generator": "template-v1",
        "created_at": datetime(2026, 11, 21, 12, 0, tzinfo=timezone.utc),
    }


def step_row(step_id: str, **extra: Any) -> dict[str, Any]:
    row = {
        "run_id": "run-1",
        "step_id": step_id,
        "episode_id": "ep-1",
        "step_index": 0,
        "screenshot_before": "a" * 64,
        "screenshot_after": "b" * 64,
        "width": 1024,
        "height": 600,
        "url_before": "http://127.0.0.1/notes",
        "url_after": "http://127.0.0.1/notes/1",
        "title_before": "Notes",
        "title_after": "Note 1",
        "ax_tree_before": "main\n  button New note",
        "action_type": "click",
        "action_json": '{"x": 10, "y": 20}',
        "action_valid": True,
        "thought": "open the first note",
        "raw_output": "click(10, 20)",
        "duration_ms": 61.5,
    }
    row.update(extra)
    return row


def lineage(commit_key: str, stage: str = "query_gen", **kw: Any) -> Lineage:
    return Lineage(
        stage=stage,
        run_id=kw.pop("run_id", "run-1"),
        commit_key=commit_key,
        config_hash="cfg-123",
        code_version="abc1234",
        **kw,
    )


def _purge_postgres(url: str, catalog_name: str) -> None:
    """Remove a test catalog's rows from the shared database."""
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            for table in ("iceberg_tables", "iceberg_namespace_properties"):
                conn.execute(sqlalchemy.text(f"DELETE FROM {table} WHERE catalog_name = :n"), {"n": catalog_name})
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    uri = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    name = f"test-{uuid.uuid4().hex}"
    cat = Catalog(tmp_path / "warehouse", uri=uri, name=name)
    yield cat
    cat.close()
    if uri is not None:
        _purge_postgres(uri, name)


def test_commit_and_load(catalog: Catalog) -> None:
    assert catalog.resolve("queries") == ("queries", None)
    empty = catalog.load("queries")
    assert empty.height == 0
    assert empty.schema["created_at"] == pl.Datetime("us", "UTC")
    assert empty.schema["path"] == pl.List(pl.String)

    snapshot = catalog.commit_rows("queries", [query_row(f"q{i}") for i in range(5)], lineage("qg-1"))

    df = catalog.load("queries")
    assert sorted(df["query_id"]) == [f"q{i}" for i in range(5)]
    assert df.filter(pl.col("query_id") == "q0")["path"].to_list() == [["home", "note"]]
    assert catalog.resolve("queries") == ("queries", snapshot)
    assert catalog.resolve("queries@latest") == ("queries", snapshot)
    assert catalog.tables() == ["queries"]


def test_a_commits_transaction_builds_its_metadata_once_per_state(catalog: Catalog) -> None:
    """pyiceberg rebuilds a transaction's metadata (a deep copy of every version) on each read; the catalog's keeps
    it until an update is staged or the table is refreshed, and what it stages still lands."""
    catalog.commit_rows("queries", [query_row("q1")], lineage("run-1:query_gen:queries"))
    tbl = catalog.table("queries")
    tx = _Transaction(tbl)
    first = tx.table_metadata
    assert tx.table_metadata is first
    tx.set_properties(note="staged")
    staged = tx.table_metadata
    assert staged is not first and staged.properties["note"] == "staged"
    tbl.refresh()
    assert tx.table_metadata is not staged and tx.table_metadata.properties["note"] == "staged"
    tx.commit_transaction()
    assert catalog.table("queries").refresh().properties["note"] == "staged"
    assert catalog.load("queries")["query_id"].to_list() == ["q1"]


def test_commit_files_from_shards(catalog: Catalog) -> None:
    folder = catalog.data_dir("steps")
    assert folder.is_dir() and folder.is_relative_to(catalog.warehouse)
    shards = []
    for shard in range(3):
        path = folder / f"shard-{shard}.parquet"
        pq.write_table(to_arrow("steps", [step_row(f"s{shard}-{i}") for i in range(4)]), path)
        shards.append(path)

    snapshot = catalog.commit_files("steps", shards, lineage("rollout-1", stage="rollout", kept={"steps": 12}))

    assert catalog.load("steps").height == 12
    (info,) = catalog.history("steps")
    assert info.snapshot_id == snapshot and info.added_rows == 12 and info.stage == "rollout"


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_data_file_is_named_with_its_table_and_version(catalog: Catalog, damage: str) -> None:
    folder = catalog.data_dir("steps")
    paths = []
    for shard in range(2):
        paths.append(folder / f"shard-{shard}.parquet")
        pq.write_table(to_arrow("steps", [step_row(f"s{shard}-{i}") for i in range(4)]), paths[-1])
    snapshot = catalog.commit_files("steps", paths, lineage("rollout-1", stage="rollout", kept={"steps": 8}))
    if damage == "truncated":  # a copy cut short, a disk that filled
        paths[1].write_bytes(paths[1].read_bytes()[:200])
    else:
        paths[1].unlink()
    with pytest.raises(CorruptData, match=f"steps@{snapshot}: data file {paths[1]} cannot be read"):
        catalog.load("steps")


def test_time_travel(catalog: Catalog) -> None:
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    second = catalog.commit_rows("queries", [query_row("q2"), query_row("q3")], lineage("qg-2"))

    assert catalog.load("queries", first)["query_id"].to_list() == ["q1"]
    assert catalog.load(f"queries@{first}")["query_id"].to_list() == ["q1"]
    assert sorted(catalog.load("queries", second)["query_id"]) == ["q1", "q2", "q3"]
    assert catalog.scan("queries").select(pl.len()).collect().item() == 3


def test_tag_then_resolve(catalog: Catalog) -> None:
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    second = catalog.commit_rows("queries", [query_row("q2")], lineage("qg-2"))

    assert catalog.tag("queries", first, "nightly-2026-11-22") == first
    assert catalog.resolve("queries@nightly-2026-11-22") == ("queries", first)
    assert catalog.load("queries", "nightly-2026-11-22").height == 1

    catalog.tag("queries", "latest", "nightly-2026-11-22")  # moving a tag replaces it
    assert catalog.resolve("queries@nightly-2026-11-22") == ("queries", second)

    with pytest.raises(ValueError, match="ambiguous"):
        catalog.tag("queries", first, "12345")


def test_expire_versions_removes_those_versions_and_refuses_a_tagged_one(catalog: Catalog) -> None:
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    second = catalog.commit_rows("queries", [query_row("q2")], lineage("qg-2"))
    third = catalog.commit_rows("queries", [query_row("q3")], lineage("qg-3"))
    catalog.tag("queries", first, "nightly-2026-11-22")

    catalog.expire_versions("queries", [second])

    assert [v.snapshot_id for v in catalog.history("queries")] == [first, third]
    assert catalog.load("queries", "nightly-2026-11-22")["query_id"].to_list() == ["q1"]
    with pytest.raises(ValueError, match="protected"):
        catalog.expire_versions("queries", [first])
    assert [v.snapshot_id for v in catalog.history("queries")] == [first, third]
    assert sorted(catalog.load("queries")["query_id"]) == ["q1", "q2", "q3"]


def test_resolve_errors_name_the_ref(catalog: Catalog) -> None:
    with pytest.raises(UnknownRef, match="'nosuch@3'.*unknown table 'nosuch'"):
        catalog.resolve("nosuch@3")
    with pytest.raises(UnknownRef, match="'queries@nightly-x'.*no versions yet"):
        catalog.resolve("queries@nightly-x")

    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    with pytest.raises(UnknownRef, match="'queries@123'.*no snapshot 123"):
        catalog.resolve("queries@123")
    with pytest.raises(UnknownRef, match="'queries@nightly-2020-01-01'.*no tag 'nightly-2020-01-01'"):
        catalog.load("queries", "nightly-2020-01-01")
    assert catalog.tables() == ["queries"]  # reads never create tables


def test_history_lists_versions_with_lineage(catalog: Catalog) -> None:
    lin1 = lineage(
        "qg-1",
        inputs={"apps": 7},
        models={"instruction_writer": "smollm2-135m"},
        prompts={"instruction": "v3"},
        kept={"queries": 2},
        dropped={"duplicate": 1, "invalid_path": 4},
    )
    first = catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lin1)
    second = catalog.commit_rows("queries", [query_row("q3")], lineage("qg-2", run_id="run-2"))
    catalog.tag("queries", first, "nightly-2026-11-22")

    history = catalog.history("queries")

    assert [h.snapshot_id for h in history] == [first, second]
    assert [h.added_rows for h in history] == [2, 1]
    assert [h.total_rows for h in history] == [2, 3]
    assert [h.run_id for h in history] == ["run-1", "run-2"]
    assert history[0].tags == ["nightly-2026-11-22"] and history[1].tags == []
    assert history[0].operation == "append" and history[0].stage == "query_gen"
    assert history[0].lineage == lin1
    assert history[0].committed_at <= history[1].committed_at
    assert catalog.lineage("queries", first) == lin1
    assert catalog.lineage("queries").commit_key == "qg-2"  # type: ignore[union-attr]
    assert catalog.history("steps") == []
    # One version's entry alone, as `datasets show` and a dataset card read it.
    assert catalog.info("queries", first) == history[0] and catalog.info("queries", second) == history[1]
    with pytest.raises(LookupError, match="no version 12345"):
        catalog.info("queries", 12345)


def test_overwrite_is_one_version(catalog: Catalog) -> None:
    first = catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lineage("qg-1"))
    catalog.commit_rows("queries", [query_row("q3")], lineage("qg-2"))

    replaced = catalog.commit_rows("queries", [query_row("q9")], lineage("qg-3"), mode="overwrite")

    history = catalog.history("queries")
    assert len(history) == 3
    assert history[-1].snapshot_id == replaced
    assert history[-1].operation == "overwrite"
    assert history[-1].lineage is not None and history[-1].lineage.commit_key == "qg-3"
    assert (history[-1].added_rows, history[-1].total_rows) == (1, 1)
    assert catalog.load("queries")["query_id"].to_list() == ["q9"]
    assert sorted(catalog.load("queries", first)["query_id"]) == ["q1", "q2"]  # old versions stay readable


def test_overwrite_of_an_empty_table(catalog: Catalog) -> None:
    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"), mode="overwrite")
    assert catalog.load("queries")["query_id"].to_list() == ["q1"]


def test_an_overwrite_with_no_files_empties_the_table_in_one_version(catalog: Catalog) -> None:
    """A replaced table (the current query set) can become empty; the old rows stay readable."""
    before = catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"), mode="overwrite")
    after = catalog.commit_files("queries", [], lineage("qg-2"), mode="overwrite")

    assert catalog.load("queries").height == 0
    assert catalog.load("queries", before)["query_id"].to_list() == ["q1"]
    assert [i.snapshot_id for i in catalog.history("queries")] == [before, after]


def test_a_commit_without_rows_is_still_a_version(catalog: Catalog) -> None:
    """A stage that dropped everything still records why, in the version's lineage."""
    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    snapshot = catalog.commit_rows("queries", [], lineage("qg-2", dropped={"invalid_path": 5}))

    assert catalog.load("queries").height == 1
    assert catalog.history("queries")[-1].added_rows == 0
    assert catalog.lineage("queries", snapshot).dropped == {"invalid_path": 5}  # type: ignore[union-attr]


def test_commit_key_is_idempotent(catalog: Catalog) -> None:
    first = catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lineage("qg-1"))

    again = catalog.commit_rows("queries", [query_row("q1"), query_row("q2")], lineage("qg-1"))
    shard = catalog.data_dir("queries") / "other.parquet"
    pq.write_table(to_arrow("queries", [query_row("q3")]), shard)
    files_again = catalog.commit_files("queries", [shard], lineage("qg-1"))

    assert again == first == files_again
    assert len(catalog.history("queries")) == 1
    assert catalog.load("queries").height == 2
    # The same key may be used on another table (one stage run writing two tables).
    catalog.commit_rows("steps", [step_row("s1")], lineage("qg-1"))
    assert catalog.load("steps").height == 1


def test_an_append_that_withdraws_rows_replaces_them_in_one_version(catalog: Catalog) -> None:
    """A unit done again (the export's episode judged again) takes its earlier rows out in the commit that adds its
    new ones: from a file of its own, and from a file it shares with other units, which is rewritten. The old
    version keeps them; history counts the new rows as added and the withdrawn ones as removed, not the rows the
    rewrite carried over; a resumed commit changes nothing."""
    folder = catalog.data_dir("steps")
    shards = {"shared": [("e1", 3), ("e2", 2)], "own": [("e3", 4)]}
    for name, episodes in shards.items():
        rows = [step_row(f"{ep}-{i}", episode_id=ep) for ep, n in episodes for i in range(n)]
        pq.write_table(to_arrow("steps", rows), folder / f"{name}.parquet")
    first = catalog.commit_files("steps", [folder / "shared.parquet", folder / "own.parquet"], lineage("night-1"))
    again = [step_row(f"e1-new-{i}", episode_id="e1", run_id="run-2") for i in range(2)]
    pq.write_table(to_arrow("steps", again), folder / "again.parquet")
    withdraw = Withdrawal("episode_id", frozenset({"e1", "e3", "e9"}))

    second = catalog.commit_files("steps", [folder / "again.parquet"], lineage("rejudged", run_id="run-2"),
                                  withdraw=withdraw)

    now = catalog.load("steps")
    assert sorted(now["step_id"]) == ["e1-new-0", "e1-new-1", "e2-0", "e2-1"]
    assert catalog.load("steps", first).height == 9
    info = catalog.history("steps")[-1]
    assert (info.snapshot_id, info.added_rows, info.removed_rows, info.total_rows) == (second, 2, 7, 4)
    assert catalog.history("steps")[0].removed_rows == 0
    assert catalog.commit_files("steps", [folder / "again.parquet"], lineage("rejudged", run_id="run-2"),
                                withdraw=withdraw) == second
    assert catalog.load("steps").height == 4 and len(catalog.history("steps")) == 2

    nothing = catalog.commit_files("steps", [], lineage("rejudged-none"), withdraw=Withdrawal("episode_id",
                                                                                             frozenset({"e9"})))
    assert catalog.history("steps")[-1].operation == "append" and catalog.load("steps", nothing).height == 4
    with pytest.raises(ValueError, match="overwrite"):
        catalog.commit_files("steps", [], lineage("bad"), mode="overwrite", withdraw=withdraw)


def test_a_withdrawal_leaves_a_file_written_before_its_column_as_it_is(catalog: Catalog) -> None:
    """train_grounding kept `screenshot` only from a later code version: a file written before holds no row the
    withdrawal can name, and stays in the version whole. Reading the column from it crashed the commit (an empty
    read, then an IndexError naming no table or file), on every rerun."""
    folder = catalog.data_dir("train_grounding")

    def sample(sample_id: str, screenshot: str | None) -> dict[str, Any]:
        return {"run_id": "run-1", "sample_id": sample_id, "source_id": sample_id, "messages_json": "[]",
                "images": [], "tag": "grounding", "screenshot": screenshot}

    old = to_arrow("train_grounding", [sample("old-1", None), sample("old-2", None)]).drop_columns(["screenshot"])
    pq.write_table(old, folder / "old.parquet")
    pq.write_table(to_arrow("train_grounding", [sample("s-1", "S"), sample("t-1", "T")]), folder / "new.parquet")
    catalog.commit_files("train_grounding", [folder / "old.parquet"], lineage("before"))
    catalog.commit_files("train_grounding", [folder / "new.parquet"], lineage("after"))
    pq.write_table(to_arrow("train_grounding", [sample("s-2", "S")]), folder / "again.parquet")

    catalog.commit_files("train_grounding", [folder / "again.parquet"], lineage("again", run_id="run-2"),
                         withdraw=Withdrawal("screenshot", frozenset({"S"})))

    assert sorted(catalog.load("train_grounding")["sample_id"]) == ["old-1", "old-2", "s-2", "t-1"]
    assert catalog.history("train_grounding")[-1].removed_rows == 1


def test_a_withdrawal_names_a_data_file_it_cannot_read(catalog: Catalog) -> None:
    folder = catalog.data_dir("steps")
    pq.write_table(to_arrow("steps", [step_row("e1-0", episode_id="e1")]), folder / "e1.parquet")
    first = catalog.commit_files("steps", [folder / "e1.parquet"], lineage("night-1"))
    (folder / "e1.parquet").write_bytes((folder / "e1.parquet").read_bytes()[:100])  # a copy cut short

    with pytest.raises(CorruptData, match=rf"steps@{first}: data file {folder / 'e1.parquet'} cannot be read"):
        catalog.commit_files("steps", [], lineage("rejudged"), withdraw=Withdrawal("episode_id", frozenset({"e1"})))
    assert len(catalog.history("steps")) == 1


def test_diff_names_a_data_file_it_cannot_read(catalog: Catalog) -> None:
    """diff said only polars' "parquet: File out of specification" where load names the table, version and file."""
    first = catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    second = catalog.commit_rows("queries", [query_row("q2")], lineage("qg-2"))
    [path] = [p for p in catalog.data_dir("queries").glob("*.parquet") if p.name.startswith("qg-2")]
    path.write_bytes(path.read_bytes()[:100])

    with pytest.raises(CorruptData, match=rf"queries@{second}: data file {path} cannot be read"):
        catalog.diff("queries", first, second)


def test_row_error_leaves_table_untouched(catalog: Catalog) -> None:
    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    files_before = sorted(catalog.data_dir("queries").iterdir())
    bad = query_row("q3")
    bad["max_steps"] = 0

    with pytest.raises(RowError) as raised:
        catalog.commit_rows("queries", [query_row("q2"), bad], lineage("qg-2"))

    message = str(raised.value)
    assert "'queries'" in message and "row 1" in message and "query_id=q3" in message and "max_steps" in message
    assert len(catalog.history("queries")) == 1
    assert catalog.load("queries").height == 1
    assert sorted(catalog.data_dir("queries").iterdir()) == files_before


@pytest.mark.parametrize(("field", "value"), [("instruction", "open \ud83d"), ("max_steps", 2**64)])
def test_a_value_arrow_refuses_is_named_with_its_table_row_and_field(catalog: Catalog, field: str,
                                                                      value: object) -> None:
    # Half a character (a model's escaped emoji cut off) and an integer past 64 bits pass pydantic; Arrow's own
    # UnicodeEncodeError and OverflowError named no table, row or field.
    bad = query_row("q3")
    bad[field] = value
    with pytest.raises(RowError, match=rf"table 'queries', row 1 \(query_id=q3\): field '{field}'"):
        catalog.commit_rows("queries", [query_row("q2"), bad], lineage("qg-2"))
    assert catalog.history("queries") == []


_QueryWithoutGenerator = create_model("_QueryWithoutGenerator", __base__=Record, **{
    name: (field.annotation, field) for name, field in Query.model_fields.items() if name != "generator"})
_QueryWithoutGenerator.table, _QueryWithoutGenerator.key = Query.table, Query.key
"""queries as a later version of the code might have it: a required field gone."""


class _QueryWithFloatSteps(Query):
    max_steps: float = Field(gt=0)  # type: ignore[assignment]


def test_a_model_that_drops_a_field_or_changes_its_type_is_met_at_its_tables_first_write(
        catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    # A required column the model lost failed every commit (the new files lack it); a column whose type changed
    # was refused by the commit after the stage's every shard had run, naming neither table nor file.
    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    monkeypatch.setitem(RECORDS, "queries", _QueryWithoutGenerator)
    later = Catalog(catalog.warehouse, uri=catalog.uri, name=catalog.iceberg.name)
    row = query_row("q2")
    del row["generator"]
    later.commit_rows("queries", [row], lineage("qg-2"))
    assert later.load("queries").sort("query_id")["generator"].to_list() == [query_row("q1")["generator"], None]
    monkeypatch.setitem(RECORDS, "queries", _QueryWithFloatSteps)
    retyped = Catalog(catalog.warehouse, uri=catalog.uri, name=catalog.iceberg.name)
    with pytest.raises(CatalogError, match=r"table 'queries': _QueryWithFloatSteps changes the type of column\(s\) "
                                           r"max_steps: long -> double"):
        retyped.data_dir("queries")


def test_diff(catalog: Catalog) -> None:
    a = catalog.commit_rows("queries", [query_row("q0"), query_row("q1"), query_row("q2")], lineage("qg-1"))
    rows_b = [query_row("q1", instruction="open the note titled groceries"), query_row("q2"), query_row("q3")]
    b = catalog.commit_rows("queries", rows_b, lineage("qg-2"), mode="overwrite")

    diff = catalog.diff("queries", a, b)

    assert (diff.a, diff.b, diff.key) == (a, b, "query_id")
    assert diff.added["query_id"].to_list() == ["q3"]
    assert diff.removed["query_id"].to_list() == ["q0"]
    assert diff.changed == ["q1"]
    assert (diff.n_added, diff.n_removed, diff.n_changed) == (1, 1, 1)
    assert catalog.diff("queries", b, b).n_changed == 0


def test_diff_reads_and_compares_only_the_columns_asked_for(catalog: Catalog) -> None:
    """A training table's versions hold every night's screenshots: a diff that names its columns reads those and
    the key, and compares only those."""
    a = catalog.commit_rows("steps", [step_row("s1"), step_row("s2")], lineage("r-1", "rollout"))
    rows_b = [step_row("s1", thought="another thought"), step_row("s2", action_type="type"), step_row("s3")]
    b = catalog.commit_rows("steps", rows_b, lineage("r-2", "rollout"), mode="overwrite")

    diff = catalog.diff("steps", a, b, columns=["action_type", "episode_id"])

    assert diff.added.columns == ["step_id", "action_type", "episode_id"]
    assert diff.added["step_id"].to_list() == ["s3"]
    assert diff.changed == ["s2"], "the thought is not compared"
    with pytest.raises(UnknownColumn, match=r"steps has no column named 'app'; its columns: run_id, step_id"):
        catalog.diff("steps", a, b, columns=["step_id", "app"])


def test_diff_of_versions_older_than_a_column_it_names(catalog: Catalog) -> None:
    """A column the table's schema has but both versions predate is no error (a notebook asks every warehouse for
    the same columns); it is not read, as a column only one version has is not compared."""
    narrow = arrow_schema(Step).remove(arrow_schema(Step).get_field_index("target_role"))
    old_table = catalog.iceberg.create_table(
        (catalog.namespace, "steps"), schema=narrow, properties={**TABLE_PROPERTIES, "trajforge.schema_version": "1"}
    )
    versions = []
    for rows in ([step_row("s1")], [step_row("s1"), step_row("s2")]):
        old_table.append(to_arrow("steps", rows).select(narrow.names).cast(narrow))
        versions.append(old_table.current_snapshot().snapshot_id)  # type: ignore[union-attr]

    diff = catalog.diff("steps", *versions, columns=["action_type", "target_role"])

    assert diff.added.columns == ["step_id", "action_type"]
    assert diff.added["step_id"].to_list() == ["s2"]


def test_schema_evolution_adds_optional_columns(catalog: Catalog) -> None:
    """A table built by an older model (without the target_* fields) gains them on next use."""
    added = {"target_role", "target_name"}
    full = arrow_schema(Step)
    narrow = pa.schema([f for f in full if f.name not in added], metadata=full.metadata)
    old_table = catalog.iceberg.create_table(
        (catalog.namespace, "steps"), schema=narrow, properties={**TABLE_PROPERTIES, "trajforge.schema_version": "1"}
    )
    old_rows = to_arrow("steps", [step_row("s-old")]).select(narrow.names).cast(narrow)
    old_table.append(old_rows)
    old_snapshot = old_table.current_snapshot().snapshot_id  # type: ignore[union-attr]

    fresh = Catalog(catalog.warehouse, uri=catalog.uri, name=catalog.iceberg.name)  # no cached table
    try:
        assert not added & set(fresh.load("steps").columns)  # reading does not change the table
        fresh.commit_rows("steps", [step_row("s-new", target_role="button", target_name="New note")], lineage("r-1"))
        latest = fresh.load("steps").sort("step_id")
        assert added <= set(latest.columns)
        assert latest["target_role"].to_list() == ["button", None]
        assert not added & set(fresh.load("steps", old_snapshot).columns)  # old snapshots keep the old schema
    finally:
        fresh.close()


def test_new_required_column_is_refused(catalog: Catalog) -> None:
    full = arrow_schema(Step)
    narrow = full.remove(full.get_field_index("thought"))  # a required field
    catalog.iceberg.create_table((catalog.namespace, "steps"), schema=narrow, properties=TABLE_PROPERTIES)
    with pytest.raises(CatalogError, match="required column.*thought"):
        catalog.table("steps")


def test_scan_does_not_warn(catalog: Catalog) -> None:
    catalog.commit_rows("queries", [query_row("q1")], lineage("qg-1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        assert catalog.load("queries").height == 1


def _commit_worker(warehouse: str, uri: str, name: str, worker: int, commits: int, barrier: Any) -> None:
    cat = Catalog(Path(warehouse), uri=uri, name=name)
    try:
        cat.table("queries")
        barrier.wait(timeout=60)
        for c in range(commits):
            rows = [query_row(f"w{worker}-c{c}-{i}") for i in range(10)]
            cat.commit_rows("queries", rows, lineage(f"w{worker}-c{c}", run_id=f"worker-{worker}"))
    finally:
        cat.close()


@pytest.mark.postgres
def test_concurrent_commits_from_two_processes(postgres_url: str, tmp_path: Path) -> None:
    name = f"test-{uuid.uuid4().hex}"
    warehouse = tmp_path / "warehouse"
    cat = Catalog(warehouse, uri=postgres_url, name=name)
    try:
        cat.table("queries")
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(2)
        commits = 10  # enough that the two writers conflict and retry (they do, every run)
        procs = [
            ctx.Process(target=_commit_worker, args=(str(warehouse), postgres_url, name, w, commits, barrier))
            for w in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=180)
        assert [p.exitcode for p in procs] == [0, 0]

        df = cat.load("queries")
        assert df.height == 2 * commits * 10
        assert df["query_id"].n_unique() == df.height
        history = cat.history("queries")
        assert len(history) == 2 * commits
        assert len({h.lineage.commit_key for h in history if h.lineage}) == 2 * commits
    finally:
        cat.close()
        _purge_postgres(postgres_url, name)


def test_a_look_at_a_version_reads_only_the_columns_and_rows_it_shows(catalog: Catalog) -> None:
    """`datasets show` and notebooks look at the first rows of versions too large to load: the last file, here
    damaged, is not even opened for them."""
    folder = catalog.data_dir("steps")
    shards = []
    for shard in range(3):
        path = folder / f"shard-{shard}.parquet"
        pq.write_table(to_arrow("steps", [step_row(f"s{shard}-{i}") for i in range(4)]), path)
        shards.append(path)
    catalog.commit_files("steps", shards, lineage("rollout-1", stage="rollout"))
    shards[2].write_bytes(shards[2].read_bytes()[:100])

    head = catalog.load("steps", columns=["step_id", "action_type"], limit=3)
    assert head.columns == ["step_id", "action_type"]
    assert head["step_id"].to_list() == ["s0-0", "s0-1", "s0-2"]
    with pytest.raises(CorruptData, match="shard-2.parquet"):
        catalog.load("steps")
    with pytest.raises(UnknownColumn, match=r"steps has no column named 'app'; its columns: run_id, step_id"):
        catalog.load("steps", columns=["step_id", "app"])


def test_newest_gives_each_key_the_row_of_the_run_that_committed_last(tmp_path: Path) -> None:
    """Verdicts accumulate: an episode judged three times has three rows, and a scan reads the newest commit's
    rows first, so "the last row read" was the first verdict. `newest` gives the last one, at a version too."""
    from trajforge.schemas.records import Verdict

    def verdict(run: str, episode: str, success: bool) -> Verdict:
        return Verdict(run_id=run, verdict_id=f"{run}:{episode}", episode_id=episode, query_id="q", success=success,
                       consensus="checker_first", channels_json="{}", reason="r", config_hash="x")

    catalog = Catalog(tmp_path / "wh")
    versions = [catalog.commit_rows("verdicts", [verdict(run, "e1", ok), verdict(run, f"only-{run}", True)],
                                    lineage(f"k-{run}", "critics", run_id=run))
                for run, ok in (("critics-1", True), ("critics-2", False), ("critics-3", True))]
    newest = catalog.newest("verdicts", "episode_id")
    assert newest.height == 4 and newest.filter(pl.col("episode_id") == "e1")["run_id"].to_list() == ["critics-3"]
    at_second = catalog.newest("verdicts", "episode_id", versions[1], where=pl.col("episode_id") == "e1")
    assert at_second.select("run_id", "success").rows() == [("critics-2", False)]

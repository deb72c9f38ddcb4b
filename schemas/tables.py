"""Arrow schemas derived from the record models, and row validation for writes."""

from __future__ import annotations

import types
import typing
from datetime import datetime
from typing import Any, Iterable, Literal

import pyarrow as pa
from pydantic import ValidationError

from trajforge.schemas.records import RECORDS, Record

SCHEMA_VERSION_KEY = "trajforge.schema_version"


class RowError(ValueError):
    """A row that breaks its table's contract; the message names table, row and field."""


_SCALARS: dict[Any, pa.DataType] = {
    str: pa.string(),
    int: pa.int64(),
    float: pa.float64(),
    bool: pa.bool_(),
    bytes: pa.binary(),
    datetime: pa.timestamp("us", tz="UTC"),
}


def _arrow_type(annotation: Any) -> tuple[pa.DataType, bool]:
    """Map a field annotation to (Arrow type, nullable)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {annotation}")
        return _arrow_type(args[0])[0], True
    if origin is Literal:
        return pa.string(), False
    if origin is list:
        (item,) = typing.get_args(annotation)
        return pa.list_(_arrow_type(item)[0]), False
    if annotation in _SCALARS:
        return _SCALARS[annotation], False
    raise TypeError(f"no Arrow type for {annotation}")


def arrow_schema(model: type[Record]) -> pa.Schema:
    """The Arrow schema of a table, its schema version kept in the metadata."""
    fields = []
    for name, info in model.model_fields.items():
        dtype, nullable = _arrow_type(info.annotation)
        fields.append(pa.field(name, dtype, nullable=nullable or not info.is_required()))
    return pa.schema(fields, metadata={SCHEMA_VERSION_KEY: str(model.schema_version)})


def record_model(table: str) -> type[Record]:
    try:
        return RECORDS[table]
    except KeyError:
        raise KeyError(f"unknown table {table!r}; known tables: {', '.join(sorted(RECORDS))}") from None


def to_arrow(table: str, rows: Iterable[dict[str, Any] | Record]) -> pa.Table:
    """Validate rows against the table's model and build an Arrow table.

    Raises RowError naming the table, the row's position and key, and the field.
    """
    model = record_model(table)
    columns: dict[str, list[Any]] = {name: [] for name in model.model_fields}
    for i, row in enumerate(rows):
        if not isinstance(row, model):
            try:
                row = model.model_validate(row)
            except ValidationError as exc:
                key = row.get(model.key, "?") if isinstance(row, dict) else "?"
                problems = "; ".join(
                    f"field {'.'.join(str(p) for p in err['loc'])!r}: {err['msg']}" for err in exc.errors()
                )
                raise RowError(f"table {table!r}, row {i} ({model.key}={key}): {problems}") from None
        for name in columns:
            columns[name].append(getattr(row, name))
    schema = arrow_schema(model)
    try:
        return pa.table(columns, schema=schema)
    except (pa.ArrowException, UnicodeEncodeError, OverflowError) as exc:
        raise _arrow_problem(table, model, schema, columns) or exc from None


def _arrow_problem(table: str, model: type[Record], schema: pa.Schema, columns: dict[str, list[Any]]
                   ) -> RowError | None:
    """The first value Arrow refuses (a string with half a character, an integer past 64 bits) as a RowError
    naming the table, the row's position and key, and the field: what pydantic let through."""
    for field in schema:
        for i, value in enumerate(columns[field.name]):
            try:
                pa.array([value], type=field.type)
            except (pa.ArrowException, UnicodeEncodeError, OverflowError) as exc:
                key = columns[model.key][i] if model.key in columns else "?"
                return RowError(f"table {table!r}, row {i} ({model.key}={key}): field {field.name!r}: {exc}")
    return None

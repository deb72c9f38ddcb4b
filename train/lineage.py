"""A checkpoint's lineage both ways: from a model id, the table versions it was trained on; from a training
table's version, the checkpoints trained on it (`trajforge checkpoints`, or these functions in a notebook)."""

from __future__ import annotations

import polars as pl

from trajforge.data.catalog import Catalog, UnknownRef


def checkpoints(catalog: Catalog) -> pl.DataFrame:
    """Every checkpoint the loop registered, oldest first."""
    return catalog.load("checkpoints").sort("created_at")


def trained_on(catalog: Catalog, model_id: str) -> list[str]:
    """The TABLE@SNAPSHOT versions the checkpoint `model_id` (its id, folder or hash) was trained on."""
    rows = checkpoints(catalog).filter((pl.col("model_id") == model_id) | (pl.col("folder") == model_id)
                                       | pl.col("checkpoint_hash").str.starts_with(model_id))
    if rows.height == 0:
        raise UnknownRef(f"no checkpoint {model_id!r} is registered (trajforge checkpoints lists them)")
    if rows.height > 1 and rows["model_id"].n_unique() > 1:
        raise UnknownRef(f"{model_id!r} names {rows.height} checkpoints; give more of the hash")
    return list(rows.row(-1, named=True)["trained_on"])


def trained_from(catalog: Catalog, ref: str) -> pl.DataFrame:
    """The checkpoints trained on the version `ref` (TABLE@SNAPSHOT, TABLE@TAG or TABLE@latest)."""
    table, snapshot = catalog.resolve(ref)
    if snapshot is None:
        raise UnknownRef(f"{ref}: table {table!r} has no versions yet")
    return checkpoints(catalog).filter(pl.col("trained_on").list.contains(f"{table}@{snapshot}"))

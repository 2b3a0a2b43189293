"""DuckDB relations as Arrow data, and the progress callback of bulk imports: what the store
(``core``) and the Parquet exchange (``exchange``) share, so that neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

import duckdb
import pyarrow as pa

Progress = Callable[[str, int, int], None]
"""progress(table, rows_done, rows_total), called while importing or merging."""


def arrow_table(rel: duckdb.DuckDBPyRelation) -> pa.Table:
    """A relation's rows as a pyarrow Table (DuckDB 2 renamed ``arrow()`` to ``to_arrow_table()``)."""
    fn = getattr(rel, "to_arrow_table", None)
    return fn() if fn is not None else rel.arrow()


def arrow_reader(rel: duckdb.DuckDBPyRelation, batch_size: int = 65536) -> pa.RecordBatchReader:
    fn = getattr(rel, "to_arrow_reader", None)
    return fn(batch_size) if fn is not None else rel.fetch_arrow_reader(batch_size)

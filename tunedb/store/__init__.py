"""DuckDB tuning database: schema, migrations, batched writes, queries, Parquet exchange, merge.

    from tunedb.store import TuningStore
    with TuningStore.open("tunedb.duckdb") as db:
        db.add_devices([device]); db.add_runs([run]); db.add_workloads(ws)
        db.add_candidates(cs); db.add_measurements(ms)
        best = db.top_k(workload_hash, device.id, k=5)
        frame = db.training_frame(kind="fusion")
"""

from tunedb.store.core import BUSY_WAIT_S, Progress, TuningStore
from tunedb.store.errors import StoreError
from tunedb.store.schema import SCHEMA_VERSION, TABLES
from tunedb.store.shared import SharedWriter

__all__ = ["BUSY_WAIT_S", "SCHEMA_VERSION", "TABLES", "Progress", "SharedWriter", "StoreError", "TuningStore"]

"""Stage collector: IOS stage candidates measured on the GPU, stored as rows of kind ``stage``
(the records: ``tunedb.collect.stage_rows``, shared with ``tunedb.compile(..., measure_top=...)``).

A stage is named by what runs, not by where in a graph it runs. Its ``Workload`` is the set of
its members: each member is a step's kind, workload hash and schedule. The workload uses family
``stage``, and its graph_json is scheme ``tunedb.stage/2``: the sorted member texts and each
member's facts (``tunedb.costmodel.stage.member_facts``: FLOPs, bytes, CTAs, launches, all fixed
by the member's sub-graph), which the ``stage`` cost model reads. Its
``Candidate`` (kind ``stage``) is the split into groups: the member indices of each group in
run order, groups sorted, with the stage key of ``tunedb.plan.stages.StageKeys``. The same
stage in another graph, or in the next compile of this one, is therefore the same row. A stage
that fails to build or capture is a row too (status ``runtime_error``, with its one-line
message).

* ``measure_stages(plan, stages)`` (GPU): time each stage with the harness executor
  (``StagedExecutor(plan, stage_streams=W).time_stage``, values never sharing memory).
* ``store_stage_rows(db, plan, rows, device, config)``: one Run with every row.
The library reads the rows back (``tunedb.plan.stage_refine.stored_stage_times``): ``tunedb.compile(...,
schedule="ios", db=DB)`` prices every stored stage at its measured time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tunedb.collect.stage_rows import KIND, SCHEME, member_text, records_of, stage_records, write_stage_rows
from tunedb.costmodel.stage import family_of
from tunedb.records import DeviceInfo
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.store.core import TuningStore

__all__ = ["KIND", "SCHEME", "import_rows", "measure_stages", "member_text", "records_of", "stage_records",
           "store_stage_rows"]
COLLECTOR = "stage"
Groups = Sequence[Sequence[int]]


def measure_stages(plan: Any, stages: Iterable[tuple[Groups, str]], *, copies: int = 5, reps: int = 4,
                   samples: int = 3) -> list[dict[str, Any]]:
    """Time each ``(groups, key)`` stage of ``plan`` (a plan whose values never share memory:
    buffers planned with one time for every step) on this machine's GPU; ``key`` is the stage's
    ``StageKeys`` key. One row per stage, failures included."""
    todo = [(tuple(tuple(g) for g in st), key) for st, key in stages]
    ex = StagedExecutor(plan, stage_streams=max([len(st) for st, _ in todo] + [1]), capture=False)
    rows = []
    try:
        for st, key in todo:
            row: dict[str, Any] = {"groups": [list(g) for g in st], "key": key}
            try:
                row["samples_us"] = [ex.time_stage(st, copies=copies, reps=reps) for _ in range(samples)]
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a failing stage is a row
                row.update(status="runtime_error", message=" ".join(str(e).split())[:300])
            rows.append(row)
    finally:
        ex.close_streams()
    return rows


def store_stage_rows(db: str | Path, plan: Any, rows: Sequence[dict[str, Any]], device: DeviceInfo,
                     config: dict[str, Any], *, copies: int = 5, reps: int = 4) -> dict[str, int]:
    """One Run holding every row (ok or not); returns the counts of rows added."""
    with TuningStore.open(db) as store:
        return write_stage_rows(store, plan.steps, plan.graph.name, rows, device, config, COLLECTOR,
                                copies=copies, reps=reps)


class JsonStep:
    """A plan step known by its JSON (``KernelStep.to_json``): what a stage row needs of it."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d, self.kind = d, d["kind"]
        self.workload_hash = d.get("workload_hash", "")
        self.config_dict = dict(d.get("config", {}))

    def to_json(self) -> dict[str, Any]:
        return self.d


class JsonPlan:
    """A plan's JSON with ``steps`` as ``JsonStep`` and ``graph.name``: enough to store its rows."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.steps = [JsonStep(s) for s in d["steps"]]
        self.graph = SimpleNamespace(name=str(d.get("graph", {}).get("name", "")))


def import_rows(rows_file: str | Path, db: str | Path) -> dict[str, int]:
    """Store every row of a stage bench's rows file (``OUT_rows.json``: per graph its plan and
    measured stages) in ``db``: one Run per graph with its ``case`` (the bench's name) in the
    Run's config, which the stage cost model reads as the model family. The board is the file's
    ``device_info``, else a device known by the file's device name alone."""
    doc = json.loads(Path(rows_file).read_text())
    info = doc.get("device_info") or {"name": doc.get("device") or "unknown", "uuid_hash": "",
                                      "compute_capability": "", "sm_count": 0, "l2_bytes": 0,
                                      "memory_bytes": 0, "driver": "", "cuda_runtime": "", "cupy_version": ""}
    device = DeviceInfo(**info)
    total: dict[str, int] = {}
    for name, case in sorted(doc["cases"].items()):
        plan = JsonPlan(case["plan"])
        rows = [r for r in case["rows"] if not all(plan.steps[i].kind == "layout_view"
                                                   for g in r["groups"] for i in g)]
        counts = store_stage_rows(db, plan, rows, device, {"case": name, "family": family_of(name),
                                                           "source": Path(rows_file).name})
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collectors.stage ROWS.json DB``: store a stage bench's rows in a database."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m collectors.stage ROWS.json DB.duckdb", file=sys.stderr)
        return 2
    try:
        counts = import_rows(args[0], args[1])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: cannot import {args[0]}: {' '.join(str(e).split())[:200]}", file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Stage collector: IOS stage candidates measured on the GPU, stored as rows of kind ``stage``.

A stage is named by what runs, not by where in a graph it runs. Its ``Workload`` is the set of
its members: each member is a step's kind, workload hash and schedule. The workload uses family
``stage``, and its graph_json is scheme ``tunedb.stage/1``: the sorted member texts. Its
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
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunedb._version import __version__
from tunedb.graph.hashing import sha256_hex
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload, canonical_json
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.store.core import TuningStore

KIND = "stage"
COLLECTOR = "stage"
SCHEME = "tunedb.stage/1"
Groups = Sequence[Sequence[int]]


def member_text(step: Any) -> str:
    """The same text ``StageKeys`` hashes for a member."""
    return f"{step.kind}:{step.workload_hash}:{sorted(step.config_dict.items())}"


def stage_records(steps: Sequence[Any], groups: Groups, key: str) -> tuple[Workload, Candidate]:
    texts = [member_text(steps[i]) for g in groups for i in g]
    members = sorted(texts)
    doc = {"scheme": SCHEME, "members": members}
    text = canonical_json(doc)
    w = Workload(sha256_hex(text), "stage", f"stage of {len(texts)} steps", text)
    # each member's place in the sorted list (a repeated member takes its next free place)
    free: dict[str, list[int]] = {}
    for k, t in enumerate(members):
        free.setdefault(t, []).append(k)
    placed = sorted([free[member_text(steps[i])].pop(0) for i in g] for g in groups)
    cfg = {"groups": json.dumps(placed), "width": len(groups), "key": key}
    return w, Candidate(w.hash, KIND, cfg)


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


def records_of(plan: Any, rows: Iterable[dict[str, Any]], device_id: str, run_id: str,
               protocol: Protocol) -> tuple[list[Workload], list[Candidate], list[Measurement]]:
    ws, cs, ms = [], [], []
    for row in rows:
        w, c = stage_records(plan.steps, row["groups"], row["key"])
        ws.append(w)
        cs.append(c)
        ok = row.get("status") == "ok"
        ms.append(Measurement(c.hash, device_id, run_id, "ok" if ok else "runtime_error",
                              tuple(row.get("samples_us", ())) if ok else (),
                              error="" if ok else row.get("message", "failed"),
                              protocol_json=protocol.to_json()))
    return ws, cs, ms


def store_stage_rows(db: str | Path, plan: Any, rows: Sequence[dict[str, Any]], device: DeviceInfo,
                     config: dict[str, Any], *, copies: int = 5, reps: int = 4) -> dict[str, int]:
    """One Run holding every row (ok or not); returns the counts of rows added."""
    protocol = Protocol(warmup=3, samples=max([len(r.get("samples_us", ())) for r in rows] + [1]),
                        flush_l2=False, batch=copies * reps)
    run_id = str(uuid.uuid4())
    ws, cs, ms = records_of(plan, rows, device.id, run_id, protocol)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run = Run(run_id, COLLECTOR, __version__, "", socket.gethostname(),
              canonical_json({**config, "graph": plan.graph.name}), now, now)
    with TuningStore.open(db) as store:
        store.add_devices([device])
        store.add_runs([run])
        return {"workloads": store.add_workloads(ws), "candidates": store.add_candidates(cs),
                "measurements": store.add_measurements(ms)}

"""Stage collector: IOS stage candidates measured on the GPU, stored as rows of kind ``stage``.

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
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tunedb._version import __version__
from tunedb.costmodel.stage import family_of, member_facts
from tunedb.graph.hashing import sha256_hex
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload, canonical_json
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.store.core import TuningStore

KIND = "stage"
COLLECTOR = "stage"
SCHEME = "tunedb.stage/2"  # 2: the members' facts (FLOPs, bytes, CTAs, launches) for the stage model
Groups = Sequence[Sequence[int]]


def member_text(step: Any) -> str:
    """The same text ``StageKeys`` hashes for a member."""
    return f"{step.kind}:{step.workload_hash}:{sorted(step.config_dict.items())}"


def stage_records(steps: Sequence[Any], groups: Groups, key: str) -> tuple[Workload, Candidate]:
    texts = [member_text(steps[i]) for g in groups for i in g]
    members = sorted(texts)
    facts = {member_text(steps[i]): member_facts(steps[i].to_json()) for g in groups for i in g}
    doc = {"scheme": SCHEME, "members": members, "facts": [facts[t] for t in members]}
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

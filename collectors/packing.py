"""Packing collector: every candidate of every packing workload, verified, timed, stored.

Measuring is ``tunedb.runtime.pack.measure_candidates`` (what ``tunedb bench packing`` runs
before its peers): each candidate is built, run once
eagerly and checked against the float64 reference of every member, captured as one CUDA graph,
replayed and checked again, then timed (``samples`` event-timed loops of ``reps`` graph replays;
all samples kept). A candidate that fails to build, capture or check is a row too (status
``runtime_error`` or ``incorrect``, with its one-line message).

Rows go to the tuning store as for fusion: the packing workload as a ``Workload`` (its canonical
hash; ``graph_json`` holds the packing record's JSON, scheme ``tunedb.packing/1``), each candidate
as a ``Candidate`` of kind ``packing`` (config: partition, backends, concurrency, clusters, padding
waste), each timing as a ``Measurement`` of one ``Run``. Two ways in:

* ``python -m collectors.packing collect --db DB --suite standard`` on a GPU;
* ``python -m collectors.packing ingest --db DB sweep.json`` for the JSON that
  ``tunedb bench packing --suite standard --no-peers`` wrote on a GPU machine without the
  store's dependencies (the same ``measure_candidates`` rows as a direct collection).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunedb._version import __version__
from tunedb.kernels.packing import Candidate as PackCandidate
from tunedb.kernels.packing import PackingWorkload, candidate_waste
from tunedb.kernels.packing_suites import interleave, suite
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload, canonical_json
from tunedb.runtime.blas import library
from tunedb.runtime.device import device_info, import_cupy
from tunedb.runtime.pack import make_inputs, measure_candidates, reference
from tunedb.runtime.streams import StreamPool
from tunedb.store.core import TuningStore

KIND = "packing"
COLLECTOR = "packing"


def workload_record(w: PackingWorkload) -> Workload:
    return Workload(w.hash, w.family, w.name, canonical_json(w.to_json()))


def candidate_record(w: PackingWorkload, cand: PackCandidate) -> Candidate:
    backends = "+".join(sorted({c.label for c in cand.clusters}))
    return Candidate(w.hash, KIND, {
        "partition": cand.partition, "backends": backends, "concurrent": cand.concurrent,
        "clusters": canonical_json(cand.to_json()["clusters"]),
        "waste": round(candidate_waste(w, cand), 6)})


def _status(row: dict[str, Any]) -> str:
    return {"ok": "ok", "incorrect": "incorrect"}.get(row.get("status", ""), "runtime_error")


def records_of(results: Iterable[dict[str, Any]], device_id: str, run_id: str, protocol: Protocol
               ) -> tuple[list[Workload], list[Candidate], list[Measurement]]:
    """Store records of ``run_case`` results (tunedb rows only; peers are bench data)."""
    ws, cs, ms = [], [], []
    for res in results:
        w = PackingWorkload.from_json(res["workload"])  # refuses a result whose hash is stale
        ws.append(workload_record(w))
        for row in res["rows"]:
            if row.get("system") != "tunedb":
                continue
            c = candidate_record(w, PackCandidate.from_json(row["candidate"]))
            cs.append(c)
            status = _status(row)
            err = row.get("message", "") or (f"worst error {row.get('error')} x tolerance"
                                             if status == "incorrect" else "")
            ms.append(Measurement(c.hash, device_id, run_id, status,
                                  tuple(row.get("samples_us", ())) if status == "ok" else (),
                                  error=err, protocol_json=protocol.to_json()))
    return ws, cs, ms


def store_results(db: Path, doc: dict[str, Any], device: DeviceInfo, config: dict[str, Any]) -> dict:
    """One Run with every result of ``doc`` (a bench-packing JSON); returns the row counts."""
    protocol = Protocol(warmup=3, samples=int(doc.get("samples", 10)), flush_l2=False,
                        batch=int(doc.get("reps", 10)))
    run_id = str(uuid.uuid4())
    ws, cs, ms = records_of(doc["results"], device.id, run_id, protocol)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run = Run(run_id, COLLECTOR, __version__, str(doc.get("git_commit") or ""), socket.gethostname(),
              canonical_json({**config, "argv": doc.get("argv", []),
                              "cublas_version": doc.get("cublas_version")}),
              doc.get("started_at", now), now)
    with TuningStore.open(db) as store:
        store.add_devices([device])
        store.add_runs([run])
        return {"workloads": store.add_workloads(ws), "candidates": store.add_candidates(cs),
                "measurements": store.add_measurements(ms)}


def ingest(db: Path, sweep: Path) -> dict:
    doc = json.loads(sweep.read_text())
    if doc.get("bench") != "packing" or "device_info" not in doc:
        raise ValueError(f"{sweep} is not a bench-packing JSON with device_info")
    return store_results(db, doc, DeviceInfo(**doc["device_info"]), {"source": "ingest",
                                                                     "file": sweep.name})


def collect(db: Path, suite_name: str, *, reps: int, samples: int, time_s: float,
            log: Any = print) -> dict:
    """Measure ``suite_name`` on this machine's GPU (families interleaved, no new workload after
    ``time_s``) and store it as one Run (see the module docstring)."""
    import time

    cases = interleave(suite(suite_name))
    cp = import_cupy()
    library()
    pool = StreamPool(16)
    doc: dict[str, Any] = {"bench": "packing", "reps": reps, "samples": samples, "results": [],
                           "git_commit": os.environ.get("TUNEDB_GIT_COMMIT", ""),
                           "cublas_version": pool.blas(0).version,
                           "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    t0 = time.monotonic()
    for w in cases:
        if time_s and time.monotonic() - t0 > time_s:
            break
        log(f"{w.name}: {len(w.members)} members")
        inputs = [(cp.asarray(x), cp.asarray(wt)) for x, wt in make_inputs(w, seed=0)]
        rows = measure_candidates(cp, w, inputs, reference(w, inputs), pool, reps=reps,
                                  samples=samples, log=log)
        doc["results"].append({"workload": w.to_json(), "rows": rows})
        del inputs
        cp.get_default_memory_pool().free_all_blocks()
    return store_results(db, doc, device_info(), {"source": "collect", "suite": suite_name,
                                                  "time_s": time_s})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectors.packing")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="measure a packing suite on this GPU")
    c.add_argument("--db", type=Path, required=True)
    c.add_argument("--suite", default="standard")
    c.add_argument("--reps", type=int, default=10)
    c.add_argument("--samples", type=int, default=10)
    c.add_argument("--time-s", type=float, default=600.0)
    i = sub.add_parser("ingest", help="store a bench-packing sweep JSON")
    i.add_argument("--db", type=Path, required=True)
    i.add_argument("sweep", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "ingest":
            counts = ingest(args.db, args.sweep)
        else:
            counts = collect(args.db, args.suite, reps=args.reps, samples=args.samples, time_s=args.time_s)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bench-packing JSON into the tuning store: the rows ``tunedb bench packing`` measured.

``tunedb bench packing`` times tunedb's candidates with ``tunedb.runtime.pack.measure_candidate``,
the protocol the packing collector uses (``collectors/packing.py``). Its tunedb rows are stored as
a collection's would be: the packing workload as a ``Workload`` (canonical hash; ``graph_json``
holds the packing record's JSON, scheme ``tunedb.packing/1``), each candidate as a ``Candidate``
of kind ``packing``, each timing (or failure) as a ``Measurement`` of one ``Run``; the peers'
rows stay bench data (the split-K and chunked candidates are stored since feature schema
``packing/6``).
``python -m collectors.packing_ingest --db DB sweep.json``.
"""

from __future__ import annotations

import argparse
import json
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
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload, canonical_json
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
            pc = PackCandidate.from_json(row["candidate"])
            c = candidate_record(w, pc)
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectors.packing_ingest")
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("sweep", type=Path, help="a bench-packing JSON with device_info")
    args = ap.parse_args(argv)
    try:
        counts = ingest(args.db, args.sweep)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the report reads from the database: the rows of one kind, the data summary, the rows of
the report's device prepared for the cost model, and the anchor cases found among them.

One query fetches every measurement of the kind (all devices, all statuses, without graph
text); graphs are read once per workload and attached as a dictionary column, so a database
with a million measurements does not repeat each graph's JSON on every row.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.costmodel.features import DeviceFacts, featurize_frame
from tunedb.costmodel.fit import clean_frame
from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import Graph, GraphError
from tunedb.kernels.suites import ANCHOR_CASES
from tunedb.records import DeviceInfo


class ReportError(ValueError):
    """The report cannot be made (no data, unknown device, matplotlib missing)."""


NO_FAMILY = "(none)"


@dataclass
class Dataset:
    """The ok measurements of one device, one row per candidate, ready for the cost model."""

    frame: pa.Table  # training-frame columns plus graph_json (dictionary-encoded)
    X: np.ndarray  # float32 features
    y: np.ndarray  # measured latency, µs (median over runs)
    groups: np.ndarray  # workload hash per row
    families: np.ndarray  # family per row (str)
    device_id: str
    device_name: str
    facts: DeviceFacts


def _strings(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(col.to_pylist(), dtype=object).astype(str)


def fetch(store: Any, kind: str) -> tuple[pa.Table, dict[str, str]]:
    """Every measurement of ``kind`` (all statuses, all devices) with a graph_json column, and
    the graph JSON of each of their workloads, by workload hash."""
    frame = store.training_frame(kind=kind, device_id=None, status=None, include_graph=False)
    if frame.num_rows == 0:
        where = f" {store.path}" if store.path is not None else ""
        raise ReportError(f"database{where} has no {kind} measurements; collect some first "
                          f"(tunedb collect)")
    wanted = set(frame["workload_hash"].to_pylist())
    graphs = {w.hash: w.graph_json for w in store.workloads() if w.hash in wanted}
    return with_graphs(frame, graphs), graphs


def pick_device(frame: pa.Table, devices: list[DeviceInfo], wanted: str | None) -> DeviceInfo:
    """The device the model sections cover: ``wanted`` (an id, or a name, case-insensitive),
    else the one with the most ok measurements."""
    ok = frame.filter(pc.equal(frame["status"], "ok"))
    if wanted is not None:
        w = wanted.strip().lower()
        hits = [d for d in devices if d.id.lower() == w or d.name.lower() == w]
        if not hits:
            known = ", ".join(f"{d.name} ({d.id})" for d in devices) or "none"
            raise ReportError(f"no device {wanted!r} in the database; it holds: {known}")
        if len(hits) > 1:
            # Same name on several machines: the one with the most data answers for the name.
            counts = Counter(ok["device_id"].to_pylist())
            hits.sort(key=lambda d: -counts.get(d.id, 0))
        return hits[0]
    counts = Counter(ok["device_id"].to_pylist())
    if not counts:
        statuses = Counter(frame["status"].to_pylist())
        detail = ", ".join(f"{n} {s}" for s, n in statuses.most_common())
        raise ReportError(f"no ok measurements to report on (only {detail})")
    best = max(counts, key=lambda d: (counts[d], d))
    by_id = {d.id: d for d in devices}
    if best not in by_id:
        raise ReportError(f"measurements name device {best}, which the database does not hold")
    return by_id[best]


def main_dtype(graph_json: str) -> str:
    """The dtype of a workload's largest input (its data type, as the families are named)."""
    try:
        g = Graph.from_json(json.loads(graph_json))
    except (ValueError, KeyError, TypeError):
        return "?"
    types = g.type_map
    ins = [types[v] for v in g.inputs if v in types]
    return max(ins, key=lambda t: t.nbytes).dtype if ins else "?"


def summarize(frame: pa.Table, graphs: dict[str, str], devices: list[DeviceInfo]) -> dict[str, Any]:
    """The data summary: rows, workloads, candidates, runs, families, dtypes, devices, statuses."""
    status = _strings(frame["status"])
    wl = _strings(frame["workload_hash"])
    cand = _strings(frame["candidate_hash"])
    fam = np.array([f or NO_FAMILY for f in frame["family"].to_pylist()], dtype=object).astype(str)
    dev = _strings(frame["device_id"])
    ok = status == "ok"
    families: dict[str, dict[str, int]] = {}
    for name in sorted(set(fam.tolist())):
        m = fam == name
        families[name] = {"workloads": len(set(wl[m].tolist())), "candidates": len(set(cand[m].tolist())),
                          "measurements": int(m.sum()), "ok": int((m & ok).sum())}
    dtypes = Counter(main_dtype(graphs[h]) if h in graphs else "?" for h in set(wl.tolist()))
    names = {d.id: d.name for d in devices}
    device_rows = []
    for d in sorted(set(dev.tolist())):
        m = dev == d
        device_rows.append({"id": d, "name": names.get(d, "?"), "measurements": int(m.sum()),
                            "ok": int((m & ok).sum()), "workloads": len(set(wl[m].tolist()))})
    return {
        "measurements": int(frame.num_rows),
        "ok": int(ok.sum()),
        "failed": int((~ok).sum()),
        "workloads": len(set(wl.tolist())),
        "candidates": len(set(cand.tolist())),
        "runs": len(set(frame["run_id"].to_pylist())),
        "statuses": dict(Counter(status.tolist()).most_common()),
        "families": families,
        "dtypes": dict(sorted(dtypes.items())),
        "devices": device_rows,
    }


def with_graphs(t: pa.Table, graphs: dict[str, str]) -> pa.Table:
    """``t`` plus a dictionary-encoded graph_json column (each graph's text stored once)."""
    wl = _strings(t["workload_hash"])
    keys, idx = np.unique(wl, return_inverse=True)
    missing = [k for k in keys if k not in graphs]
    if missing:
        raise ReportError(f"measurements refer to workload {missing[0]}, which has no graph")
    texts = pa.array([graphs[k] for k in keys], type=pa.string())
    codes = pa.array(idx.astype(np.int32))
    return t.append_column("graph_json", pa.DictionaryArray.from_arrays(codes, texts))


def prepare(frame: pa.Table, device: DeviceInfo, facts: DeviceFacts) -> Dataset:
    """The ok rows of ``device`` with a positive latency, one per candidate (as ``tunedb train``
    cleans them), featurised."""
    t = clean_frame(frame.filter(pc.equal(frame["device_id"], device.id)))
    if t.num_rows == 0:
        raise ReportError(f"device {device.name} ({device.id}) has no ok measurements with a latency")
    try:
        X = featurize_frame(t, facts)
    except GraphError:
        raise  # already a one-line message naming the workload problem
    except ValueError as e:
        raise ReportError(f"cannot compute features: {e}") from None
    y = t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64)
    fam = np.array([f or NO_FAMILY for f in t["family"].to_pylist()], dtype=object).astype(str)
    return Dataset(t, X, y, _strings(t["workload_hash"]), fam, device.id, device.name, facts)


def anchor_rows(frame: pa.Table, device_id: str, facts: DeviceFacts) -> list[dict[str, Any]]:
    """The anchor cases measured on ``device_id``: latencies of their ok candidates (median
    over runs), failure count, and the roofline floor (fewest bytes / bandwidth)."""
    on_dev = frame.filter(pc.equal(frame["device_id"], device_id))
    wl = _strings(on_dev["workload_hash"])
    out = []
    for case in ANCHOR_CASES:
        h = graph_hash(case.graph)
        rows = on_dev.filter(pa.array(wl == h))
        if rows.num_rows == 0:
            continue
        ok = clean_frame(rows)
        lat = ok["median_us"].to_numpy(zero_copy_only=False).astype(np.float64)
        floor_us = case.floor_bytes / facts.bandwidth_bytes_per_s * 1e6
        best = float(lat.min()) if len(lat) else None
        out.append({
            "case": case.name, "family": case.family, "workload_hash": h,
            "floor_bytes": int(case.floor_bytes), "floor_us": floor_us,
            "candidates": int(len(lat)),
            "failed": int(pc.sum(pc.not_equal(rows["status"], "ok")).as_py() or 0),
            "best_us": best, "median_us": float(np.median(lat)) if len(lat) else None,
            "floor_fraction": floor_us / best if best else None,
            "latencies_us": [float(v) for v in lat],
            "candidate_hashes": _strings(ok["candidate_hash"]).tolist() if ok.num_rows else [],
        })
    return out

"""``tunedb.compile --measure-top N`` for packs, replayed on stored H200 data, held out.

    python benchmarks/packing_measure_top.py --data data/packing_h200 --top 1 2 3 --out mt.json

For every packing workload of ``--data`` (a Parquet export), the packing model is trained without
it (GroupKFold by workload, the ``by_workload`` split of ``tunedb.costmodel.evaluate``), and the
compile's own per-ready-set step runs on it: ``tunedb.plan.packing.decide`` with a
``PackMeasurer`` on the replay device of the board that measured the workload (what
``tunedb.compile(..., measure_top=N, measure_device="replay:...")`` calls for each ready set:
the model's top N plan candidates and serial measured, the measured best packs when it beats
serial by 5 %). The replay answers with the stored times, so "measured" here is a lookup.

Per N it prints: the share of the workload's stored candidates measured (every candidate the
collector timed, and the plan candidates: serial, streams, grouped), and how often the choice
is the best plan decision (the fastest stored plan candidate where it beats serial by 5 %,
else serial) and within 5 % of it. A last row, ``budget 10 %``, is the pooled replay over all
candidates (``tunedb.costmodel.packing.measure_top_replay``): 10 % of all candidates measured,
every workload's first pick, then further picks where the model's two next are closest;
``10 % of all`` the same with the budget and the share over every candidate the workloads have
(``all_candidates``: the split-K and chunked ones too, measured or not).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tunedb.bench.provenance import provenance
from tunedb.costmodel.evaluate import split_folds
from tunedb.costmodel.packing import (
    FEATURES,
    features,
    fit,
    labels_of,
    load_frame,
    measure_top_replay,
    predict_us,
)
from tunedb.kernels.packing import PackingWorkload
from tunedb.plan.packing import PackMeasurer, decide, pack_records, plan_candidates
from tunedb.runtime.replay import ReplayDevice

MIN_GAIN = 0.05


def held_out_predictors(frame: dict[str, Any], folds: int) -> tuple[dict[str, Any], np.ndarray]:
    """Per workload hash a predictor ``(w, cands) -> µs`` trained without that workload, and the
    held-out µs of every row of ``frame`` (for the pooled replay)."""
    X, y, groups = frame["X"], frame["y"], frame["groups"]
    out: dict[str, Any] = {}
    pred = np.full(len(y), np.nan)
    for tr, te in split_folds(labels_of(frame), "by_workload", folds):
        model = fit(X[tr], y[tr], groups[tr])
        pred[te] = predict_us(model, X[te], groups[te])

        def predict(w: PackingWorkload, cands: Any, model: Any = model) -> np.ndarray:
            rows = np.asarray([[features(w, c)[k] for k in FEATURES] for c in cands], np.float32)
            return predict_us(model, rows)
        for g in np.unique(groups[te]):
            out[str(g)] = predict
    return out, pred


def workloads_of(data: Path) -> tuple[dict[str, PackingWorkload], dict[str, int]]:
    """The stored packing workloads (members in the stored order: candidate hashes match) and
    how many packing candidates each has stored."""
    ws = {r["hash"]: PackingWorkload.from_json(json.loads(r["graph_json"]))
          for r in pq.read_table(data / "workloads.parquet").to_pylist()}
    count: dict[str, int] = defaultdict(int)
    for r in pq.read_table(data / "candidates.parquet").to_pylist():
        if r["kind"] == "packing":
            count[r["workload_hash"]] += 1
    return {h: w for h, w in ws.items() if count[h]}, dict(count)


def one(w: PackingWorkload, predict: Any, device: ReplayDevice, top: int, stored: int
        ) -> dict[str, Any] | None:
    """The compile's decision for ``w`` with ``top`` measured, against the best stored plan
    decision; None when the board has no serial time for ``w`` (nothing to decide against)."""
    cands = plan_candidates(w)
    _, recs = pack_records(w, cands)
    times = {}
    for c, r in zip(cands, recs):
        res = device.lookup(r.hash)
        if res is not None and res.status == "ok":
            times[c.name] = float(np.median(res.samples_us))
    if "whole:serial" not in times:
        return None
    fastest = min(times, key=lambda k: times[k])
    right = fastest if times[fastest] <= times["whole:serial"] * (1 - MIN_GAIN) else "whole:serial"
    measure = PackMeasurer(device)

    def stored_only(w: PackingWorkload, cs: Any) -> np.ndarray:
        # a replay answers only for stored candidates: the others are ranked last, never picked
        return np.where([c.name in times for c in cs], np.asarray(predict(w, cs), float), np.inf)
    got = decide(w, model=stored_only, measure=measure, top=top, min_gain=MIN_GAIN)
    chosen = "whole:serial" if got is None else got[0].name
    return {"workload": w.name, "family": w.family, "stored": stored, "plan": len(cands),
            "measured": measure.requested, "chosen": chosen, "right": right,
            "ratio": times[chosen] / times[right]}


def run(data: Path, tops: list[int], folds: int = 5, only: set[str] | None = None) -> dict[str, Any]:
    frame = load_frame(data)
    predictors, pred = held_out_predictors(frame, folds)
    ws, stored = workloads_of(data)
    boards = sorted({r["device_id"] for r in pq.read_table(data / "measurements.parquet",
                                                            columns=["device_id"]).to_pylist()})
    devices = [ReplayDevice(data, b) for b in boards]
    # each workload replayed on the board that holds the most of its candidates
    rows: dict[int, list[dict[str, Any]]] = {t: [] for t in tops}
    try:
        for h, w in sorted(ws.items(), key=lambda kv: kv[1].name):
            if h not in predictors or (only is not None and w.family not in only):
                continue
            _, recs = pack_records(w, plan_candidates(w))
            dev = max(devices, key=lambda d: sum(r.hash in d for r in recs))
            for t in tops:
                r = one(w, predictors[h], dev, t, stored[h])
                if r is not None:
                    rows[t].append({**r, "board": dev.info.id})
    finally:
        for d in devices:
            d.close()
    table = {}
    for t, rs in rows.items():
        ratio = np.array([r["ratio"] for r in rs])
        table[f"top {t}"] = {
            "workloads": len(rs),
            "measured_share": float(sum(r["measured"] for r in rs) / sum(r["stored"] for r in rs)),
            "measured_share_plan": float(sum(r["measured"] for r in rs) / sum(r["plan"] for r in rs)),
            "reaches_best": float(np.mean(ratio <= 1.0 + 1e-9)),
            "within_5pct": float(np.mean(ratio <= 1.05)),
            "worst_ratio": float(ratio.max()) if len(ratio) else float("nan")}
    keep = np.flatnonzero(np.isfinite(pred))
    if only is not None:
        keep = keep[np.isin(frame["families"][keep], sorted(only))]
    pooled = measure_top_replay(frame["y"][keep], pred[keep], frame["groups"][keep])
    wide = measure_top_replay(frame["y"][keep], pred[keep], frame["groups"][keep], space=frame["space"])
    for name, p in (("budget 10 %", pooled), ("10 % of all", wide)):
        table[name] = {"workloads": int(len(np.unique(frame["groups"][keep]))),
                       "measured_share": p["measured_share"], "measured_share_plan": None,
                       "reaches_best": p["reaches_best"], "within_5pct": p["within_5pct"],
                       "worst_ratio": None}
    return {"table": table, "rows": {str(t): rs for t, rs in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a packing Parquet export")
    ap.add_argument("--top", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--family", nargs="+", default=None, help="only these workload families")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.data / "workloads.parquet").is_file():
        print(f"error: {args.data} is not a packing Parquet export (no workloads.parquet)", file=sys.stderr)
        return 1
    if min(args.top) < 1:
        print(f"error: --top must be >= 1, got {min(args.top)}", file=sys.stderr)
        return 1
    res = run(args.data, args.top, args.folds, set(args.family) if args.family else None)
    print(f"{'measure':12s} {'workloads':>9s} {'measured':>9s} {'of plan':>8s} {'best':>6s} "
          f"{'within 5%':>9s} {'worst':>6s}")
    for name, r in res["table"].items():
        plan = "-" if r["measured_share_plan"] is None else f"{100 * r['measured_share_plan']:.1f}%"
        worst = "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2f}x"
        print(f"{name:12s} {r['workloads']:9d} {100 * r['measured_share']:8.1f}% {plan:>8s} "
              f"{100 * r['reaches_best']:5.1f}% {100 * r['within_5pct']:8.1f}% {worst:>6s}")
    if args.out:
        args.out.write_text(json.dumps({**provenance(argv), **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

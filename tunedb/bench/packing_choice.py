"""tunedb's choice in ``tunedb bench packing`` as a user gets it: the packing model's pick.

The bench times every candidate; what a user's ``pack_plans`` / ``tunedb.compile`` runs is the
one the cost model picks (``tunedb.plan.packing.choose``: the lowest predicted time among all
candidates, serial unless a pack is predicted to gain 5 %), made from the records alone, before
any measurement. ``model_choice`` finds that candidate's measured row in a case's rows (its time
from the same pass as the peers'); ``python -m tunedb.bench.packing_choice --bench JSON --model
DIR`` re-reads a bench JSON with a model and prints, per case, the model's pick beside the best
candidate and the best peer (and ``--hold-out``: a model trained without the case's workload, on
an export, ``--data``). ``db_choice`` is the pick as ``tunedb.plan.packing.pack_plans`` makes it with
a database: an exact hit's measured best first (``export_times``: the export's ok rows of the
workload, boards combined by ``board_labels`` as training combines them; serial unless the best
beats it by 5 %), the model's pick where the database has not measured the workload.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.provenance import provenance
from tunedb.kernels.packing import Candidate, PackingWorkload
from tunedb.plan.packing import choose
from tunedb.records import canonical_json


def model_choice(w: PackingWorkload, rows: Sequence[dict[str, Any]], predict: Any) -> dict[str, Any]:
    """The model's pick for ``w`` and its measured row: ``variant``, ``predicted_us``,
    ``status`` and ``median_us`` (absent when that candidate was not timed or failed its check)."""
    cand, ranking = choose(w, predict)
    key = canonical_json(cand.to_json())
    row = next((r for r in rows if r.get("system") == "tunedb"
                and canonical_json(Candidate.from_json(r["candidate"]).to_json()) == key), None)
    out: dict[str, Any] = {"variant": cand.name, "predicted_us": dict(ranking).get(cand.name),
                           "status": row.get("status") if row else "not timed"}
    if row and row.get("status") == "ok":
        out["median_us"] = row["median_us"]
    return out


def export_times(data: Path) -> Callable[[PackingWorkload], dict[str, float]]:
    """A lookup ``w -> {candidate name: µs}`` of an export's ok packing rows (``board_labels``),
    every candidate when the stored workload lists the members in ``w``'s order, else only the
    whole-set ones (cluster indices name members; the workload hash ignores their order)."""
    import pyarrow.parquet as pq

    from tunedb.costmodel.packing import board_labels

    stored = {r["hash"]: r["graph_json"] for r in pq.read_table(data / "workloads.parquet").to_pylist()}
    cands = {r["hash"]: r for r in pq.read_table(data / "candidates.parquet").to_pylist()
             if r["kind"] == "packing"}
    per: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for r in pq.read_table(data / "measurements.parquet",
                           columns=["candidate_hash", "device_id", "status", "samples_us"]).to_pylist():
        if r["status"] == "ok" and r["candidate_hash"] in cands and r["samples_us"]:
            q = np.percentile(r["samples_us"], (20, 50, 80))
            per.setdefault(r["candidate_hash"], {}).setdefault(r["device_id"], []).append(
                (float(q[0]), float(q[1]), float(q[2])))
    labels = board_labels(per, {ch: cands[ch]["workload_hash"] for ch in per})
    by_w: dict[str, list[tuple[dict, float]]] = {}
    for ch, band in labels.items():
        c = cands[ch]
        by_w.setdefault(c["workload_hash"], []).append((json.loads(c["config_json"]), band[1]))

    def times(w: PackingWorkload) -> dict[str, float]:
        if w.hash not in by_w:
            return {}
        same = PackingWorkload.from_json(json.loads(stored[w.hash])).members == w.members
        out = {}
        for cfg, us in by_w[w.hash]:
            if same or cfg["partition"] == "whole":
                out[Candidate.from_json({"partition": cfg["partition"], "concurrent": cfg["concurrent"],
                                         "clusters": json.loads(cfg["clusters"])}).name] = us
        return out
    return times


def db_choice(w: PackingWorkload, rows: Sequence[dict[str, Any]], times: Callable[..., dict[str, float]],
              predict: Any, min_gain: float = 0.05) -> dict[str, Any]:
    """The pick with a database (module docstring): ``model_choice``'s fields plus ``source``
    (``db`` or ``model``) and, for a hit, the stored ``stored_us``."""
    measured = times(w)
    if "whole:serial" in measured and len(measured) > 1:
        name = min(measured, key=lambda k: measured[k])
        if measured[name] > measured["whole:serial"] * (1 - min_gain):
            name = "whole:serial"
        row = next((r for r in rows if r.get("system") == "tunedb"
                    and Candidate.from_json(r["candidate"]).name == name), None)
        out: dict[str, Any] = {"variant": name, "source": "db", "stored_us": measured[name],
                               "status": row.get("status") if row else "not timed"}
        if row and row.get("status") == "ok":
            out["median_us"] = row["median_us"]
        return out
    return {**model_choice(w, rows, predict), "source": "model"}


def summarize_choice(res: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    """``choice`` with its speedup over the best peer and its ratio to the best candidate."""
    ok = [r for r in res["rows"] if r.get("status") == "ok"]
    peers = [r["median_us"] for r in ok if r["system"] != "tunedb"]
    mine = [r["median_us"] for r in ok if r["system"] == "tunedb"]
    out = dict(choice)
    if "median_us" in choice:
        if peers:
            out["speedup_vs_best_peer"] = min(peers) / choice["median_us"]
        if mine:
            out["over_best_candidate"] = choice["median_us"] / min(mine)
    return out


def held_out_predictor(data: Path, exclude: set[str]) -> Any:
    """A packing model trained on ``data`` (an export) without the workloads ``exclude``."""
    from tunedb.costmodel.packing import FEATURES, features, fit, load_frame, predict_us

    frame = load_frame(data)
    keep = ~np.isin(frame["groups"], sorted(exclude))
    model = fit(frame["X"][keep], frame["y"][keep], frame["groups"][keep])

    def predict(w: PackingWorkload, cands: Sequence[Candidate]) -> np.ndarray:
        X = np.asarray([[f[k] for k in FEATURES] for f in (features(w, c) for c in cands)], np.float32)
        return predict_us(model, X)
    return predict


def main(argv: Sequence[str] | None = None) -> int:
    from tunedb.costmodel.packing import load_predictor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="a tunedb bench packing JSON")
    ap.add_argument("--model", type=Path, default=None, help="a saved packing model folder")
    ap.add_argument("--data", type=Path, default=None, help="with --hold-out: the export to train on")
    ap.add_argument("--hold-out", action="store_true", help="per case, a model trained without it")
    ap.add_argument("--db-data", type=Path, default=None,
                    help="an export: also the pick with it as the database (an exact hit's best)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.bench.read_text())
        results = doc["results"]
        if args.hold_out and args.data is None:
            raise ValueError("--hold-out needs --data")
        predict = None if args.hold_out else load_predictor(args.model or Path("models/nvidia-h200/packing"))
        times = export_times(args.db_data) if args.db_data else None
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 1
    table = []
    db_head = " db pick | µs | x best peer |" if times else ""
    print("| case | model's choice | µs | best candidate | µs | best peer | µs | x best peer |" + db_head)
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|" * bool(times))
    for res in results:
        w = PackingWorkload.from_json(res["workload"])
        pr = held_out_predictor(args.data, {w.hash}) if args.hold_out else predict
        ch = summarize_choice(res, model_choice(w, res["rows"], pr))
        s = res.get("summary", {})
        tb, pe = s.get("tunedb", {}), s.get("peer", {})
        db = summarize_choice(res, db_choice(w, res["rows"], times, pr)) if times else {}
        table.append({"case": res["case"], **ch, **({"db_choice": db} if db else {})})
        print(f"| {res['case']} | {ch['variant']} | {ch.get('median_us', math.nan):.1f} | "
              f"{tb.get('variant', '-')} | {tb.get('median_us', math.nan):.1f} | {pe.get('variant', '-')} | "
              f"{pe.get('median_us', math.nan):.1f} | {ch.get('speedup_vs_best_peer', math.nan):.2f}x |"
              + (f" {db.get('variant', '-')} ({db.get('source', '-')}) | {db.get('median_us', math.nan):.1f}"
                 f" | {db.get('speedup_vs_best_peer', math.nan):.2f}x |" if db else ""))
    if args.out:
        args.out.write_text(json.dumps({**provenance(argv), "bench": str(args.bench.name),
                                        "hold_out": args.hold_out, "cases": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tunedb's choice in ``tunedb bench packing`` as a user gets it: the packing model's pick.

The bench times every candidate; what a user's ``pack_plans`` / ``tunedb.compile`` runs is the
one the cost model picks (``tunedb.plan.packing.choose``: the lowest predicted time among all
candidates, serial unless a pack is predicted to gain 5 %), made from the records alone, before
any measurement. ``model_choice`` finds that candidate's measured row in a case's rows (its time
from the same pass as the peers'); ``python -m tunedb.bench.packing_choice --bench JSON --model
DIR`` re-reads a bench JSON with a model and prints, per case, the model's pick beside the best
candidate and the best peer (and ``--hold-out``: a model trained without the case's workload, on
an export, ``--data``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
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
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.bench.read_text())
        results = doc["results"]
        if args.hold_out and args.data is None:
            raise ValueError("--hold-out needs --data")
        predict = None if args.hold_out else load_predictor(args.model or Path("models/nvidia-h200/packing"))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return 1
    table = []
    print("| case | model's choice | µs | best candidate | µs | best peer | µs | x best peer |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        w = PackingWorkload.from_json(res["workload"])
        pr = held_out_predictor(args.data, {w.hash}) if args.hold_out else predict
        ch = summarize_choice(res, model_choice(w, res["rows"], pr))
        s = res.get("summary", {})
        tb, pe = s.get("tunedb", {}), s.get("peer", {})
        table.append({"case": res["case"], **ch})
        print(f"| {res['case']} | {ch['variant']} | {ch.get('median_us', math.nan):.1f} | "
              f"{tb.get('variant', '-')} | {tb.get('median_us', math.nan):.1f} | {pe.get('variant', '-')} | "
              f"{pe.get('median_us', math.nan):.1f} | {ch.get('speedup_vs_best_peer', math.nan):.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({**provenance(argv), "bench": str(args.bench.name),
                                        "hold_out": args.hold_out, "cases": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole graphs with and without packs, side by side on the GPU in one process.

Each graph is compiled twice, with packing (``pack_model``: a packing model, trained here on
``--data`` or loaded from ``--model``; ``--force BACKEND`` instead packs every ready set with that
backend whatever the model says, to see what the model turned down) and without
(``pack=False``). Both plans run on the same inputs, are checked against the float64 reference,
and only then are timed as CUDA-graph replays (``tunedb.runtime.pack.time_stream``), the two
plans alternating per round. Prints a table and writes JSON.

With ``--db`` a tuning database's packing rows decide a set first (an exact hit: serial and a
faster candidate measured), as ``tunedb.compile(db=...)`` does; ``tunedb bench packing --graph``
measures those sets.

``python -m tunedb.bench.packing_plans --data data/packing_h200 --out bench-packing-plans.json``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.costmodel.packing import FEATURES, features, fit, load_frame, load_predictor, predict_us
from tunedb.graph.reference import run_reference
from tunedb.plan import compile
from tunedb.runtime.device import import_cupy
from tunedb.runtime.executor import PlanExecutor
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.pack import time_stream
from tunedb.runtime.pack_exec import PackExecutor
from tunedb.runtime.tolerance import check_host, tolerance

GRAPHS = ("bert_layer.onnx", "inception_mixed_5b.onnx", "gpt2_block.onnx", "resnet_piece.onnx")


def trained_predictor(data: Path) -> Any:
    frame = load_frame(data)
    model = fit(frame["X"], frame["y"], frame["groups"])

    def predict(w: Any, cands: Sequence[Any]) -> np.ndarray:
        X = np.asarray([[features(w, c)[k] for k in FEATURES] for c in cands], np.float32)
        return predict_us(model, X)
    return predict


def forced(backend: str) -> Any:
    """A predictor under which ``backend`` (whole set, most streams for ``streams``) wins."""
    def predict(w: Any, cands: Sequence[Any]) -> list[float]:
        return [1.0 / (1 + c.clusters[0].streams) if c.partition == "whole" and len(c.clusters) == 1
                and c.clusters[0].backend == backend else 100.0 for c in cands]
    return predict


def _verified_executor(plan: Any, dev: Any, ref_in: Any) -> tuple[Any, float]:
    ex = PackExecutor(plan) if plan.packs else PlanExecutor(plan)
    outs = {k: v.get() for k, v in ex.run(dev).items()}
    g, worst = plan.graph, 0.0
    refs = run_reference(g, ref_in)
    for v in g.outputs:
        ok, err = check_host(np.asarray(outs[v]), refs[v], tolerance(g, g.type_of(v).dtype))
        if not ok:
            raise ValueError(f"{g.name}: output {v!r} off the reference by {err:.3g}")
        worst = max(worst, err)
    return ex, worst


def run_graph(path: Path, predictor: Any, *, reps: int, samples: int, rounds: int = 3,
              db: Path | None = None) -> dict[str, Any]:
    cp = import_cupy()
    db_arg = None if db is None else str(db)
    packed = compile(str(path), device="cuda", pack_model=predictor, db=db_arg)
    plain = compile(str(path), device="cuda", pack=False, db=db_arg)
    row: dict[str, Any] = {"graph": path.name, "packs": [
        {"steps": list(p.steps), "backend": p.label, "source": p.source, "predicted_us": p.predicted_us,
         "serial_us": p.serial_us} for p in packed.packs]}
    dev, ref_in = make_inputs(plain.graph, 0)
    exs = {"unpacked": _verified_executor(plain, dev, ref_in)}
    if packed.packs:
        exs["packed"] = _verified_executor(packed, dev, ref_in)
    times: dict[str, list[float]] = {k: [] for k in exs}
    for _ in range(rounds):  # alternate, so that drift hits both alike
        for k, (ex, _) in exs.items():
            times[k] += time_stream(cp, ex.replay, ex.stream, reps=reps, samples=samples)
    for k, (ex, err) in exs.items():
        row[k] = {"median_us": float(np.median(times[k])), "p20_us": float(np.quantile(times[k], 0.2)),
                  "p80_us": float(np.quantile(times[k], 0.8)), "max_abs_error": err,
                  "launches": ex.launches, "graph_capture": ex.graph_capture,
                  "fallbacks": list(ex.fallbacks)}
    if "packed" in row:
        row["speedup"] = row["unpacked"]["median_us"] / row["packed"]["median_us"]
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    out = [f"{'graph':28s} {'packs':32s} {'unpacked µs':>12s} {'packed µs':>10s} {'speedup':>8s}"]
    for r in rows:
        packs = ", ".join(f"{p['backend']}[{p['source']}]" for p in r["packs"]) or "none chosen"
        un = r["unpacked"]["median_us"]
        pk = r.get("packed", {}).get("median_us")
        out.append(f"{r['graph']:28s} {packs[:32]:32s} {un:12.1f} "
                   f"{'-' if pk is None else f'{pk:.1f}':>10s} {r.get('speedup', 1.0):8.2f}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tunedb.bench.packing_plans",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="a packing Parquet export to train on")
    ap.add_argument("--model", type=Path, default=None, help="a saved packing model folder")
    ap.add_argument("--force", choices=("streams", "grouped"), default=None,
                    help="pack every ready set with this backend, whatever the model says")
    ap.add_argument("--db", type=Path, default=None,
                    help="a tuning database whose packing rows decide first (exact hits)")
    ap.add_argument("--graphs", type=Path, default=Path("data/graphs"))
    ap.add_argument("--graph", action="append", default=None, help="graph file names (default: four)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench-packing-plans.json"))
    args = ap.parse_args(argv)
    if sum(x is not None for x in (args.data, args.model, args.force)) != 1:
        print("error: give exactly one of --data, --model, --force", file=sys.stderr)
        return 2
    try:
        predictor = (forced(args.force) if args.force else load_predictor(args.model) if args.model
                     else trained_predictor(args.data))
        rows: list[dict[str, Any]] = []
        failed: list[dict[str, str]] = []
        for name in args.graph or GRAPHS:
            path = args.graphs / name
            if not path.is_file():
                print(f"skip {name}: no such graph", file=sys.stderr)
                continue
            try:
                rows.append(run_graph(path, predictor, reps=args.reps, samples=args.samples,
                                      db=args.db))
            except (ValueError, RuntimeError) as e:  # one graph's failure is its row, not the run's
                print(f"{name}: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr, flush=True)
                failed.append({"graph": name, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
                continue
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    except (OSError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    print(render(rows))
    args.out.write_text(json.dumps({"bench": "packing_plans", "force": args.force, "rows": rows,
                                         "failed": failed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Llama's two grouped-query plans on the local GPU, side by side: the default (each key/value
head repeated by a copy kernel) and ``fold_grouped_kv`` (grouped GEMMs, no repeat).

    python benchmarks/bench_llama_gqa.py OUT.json [MODEL.onnx ...]   # default: llama_small b1

Per file and variant, in one process on the same inputs (the zoo benchmark's weights and
seed): the plan's kernels and predicted time, the executor's launches and graph capture, the
outputs against the float64 reference (the zoo benchmark's ``verify``, exp term included), and
only then the throughput time of the CUDA-graph replay (``throughput_us``). The variants run in
alternating order, twice, so a drift of the clocks shows as a spread instead of a winner.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tunedb.bench.fusion import _one_line
from tunedb.bench.peers import throughput_us
from tunedb.bench.plan import INPUT_SEED, collect_entries, load_entry, verify
from tunedb.bench.provenance import provenance
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.rewrite import fold_matmul_scales
from tunedb.plan.rewrite_gqa import fold_grouped_kv
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.tolerance import reference_and_exp_span

ZOO = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
DEFAULT_FILES = (ZOO / "llama_small_dynamo_fp32.onnx", ZOO / "llama_small_dynamo_bf16.onnx")
VARIANTS = ("default", "fold_grouped_kv")


def _plan(graph: Any, variant: str) -> Any:
    g = fold_grouped_kv(fold_matmul_scales(graph)) if variant == "fold_grouped_kv" else graph
    return compile_plan(g, device="cuda")


def plan_only(path: Path) -> dict:
    """The CPU part alone (a dry run): each variant's kernels and predicted time."""
    graph, _ = load_entry(collect_entries([path], anchors=False)[0])
    return {"name": path.stem, "variants": {
        v: {"kernels": (p := _plan(graph, v)).kernels, "predicted_us": p.totals()["predicted_us"], "us": [],
            "error": None} for v in VARIANTS}}


def _timer(lock: Path | None) -> Any:
    """``throughput_us``, under bench_zoo_plan's GPU lock when ``lock`` is given (a zoo run
    beside this one then never times at the same moment)."""
    if lock is None:
        return throughput_us
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_zoo_plan import gpu_lock

    def timed(run: Any, sync: Any, target_s: float) -> float:
        with gpu_lock(lock):
            return throughput_us(run, sync, target_s=target_s)
    return timed


def run_file(path: Path, rounds: int = 2, lock: Path | None = None) -> dict:
    import cupy

    from tunedb.runtime.executor import PlanExecutor

    graph, _ = load_entry(collect_entries([path], anchors=False)[0])
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    rec: dict[str, Any] = {"name": path.stem, "variants": {}}
    built = {}
    for v in VARIANTS:
        r: dict[str, Any] = {"us": [], "error": None}
        rec["variants"][v] = r
        try:
            t0 = time.perf_counter()
            plan = _plan(graph, v)
            ex = PlanExecutor(plan)
            totals = plan.totals()
            r.update(kernels=plan.kernels, predicted_us=totals["predicted_us"], launches=ex.launches,
                     graph_capture=ex.graph_capture, capture_error=ex.capture_error,
                     build_s=round(time.perf_counter() - t0, 2))
            got = {k: cupy.asnumpy(x) for k, x in ex.run(dev).items()}
            r["verify"] = verify(graph, got, refs, exp_span=span)
            if r["verify"]["ok"]:
                built[v] = ex
        except Exception as e:  # noqa: BLE001 - recorded, the other variant still runs
            r["error"] = _one_line(e)
    timer = _timer(lock)
    for k in range(rounds):
        for v in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
            if v in built:
                ex = built[v]
                rec["variants"][v]["us"].append(timer(ex.replay, ex.synchronize, target_s=0.1))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--plan-only", action="store_true", help="plan on the CPU only (a dry run)")
    p.add_argument("--gpu-lock", type=Path, help="hold bench_zoo_plan.py's lock file while timing")
    a = p.parse_intermixed_args(argv)
    device = "CPU (plan only)"
    if not a.plan_only:
        from tunedb.runtime.device import device_info

        device = device_info().name
    result: dict[str, Any] = {"benchmark": "llama_gqa", "device": device, **provenance(argv),
                              "entries": []}
    print("| model | variant | kernels | predicted µs | launches | capture | verified (rel) | µs (rounds) |")
    print("|---|---|---|---|---|---|---|---|")
    for path in a.models or DEFAULT_FILES:
        rec = plan_only(path) if a.plan_only else run_file(path, lock=a.gpu_lock)
        result["entries"].append(rec)
        a.out.write_text(json.dumps(result, indent=1))
        for v, r in rec["variants"].items():
            ver = r.get("verify") or {}
            rel = ver.get("rel_err")
            ok = (("ok" if ver.get("ok") else "FAIL") + (f" ({rel:.2g})" if rel is not None else "")
                  if ver else "—")
            us = ", ".join(f"{x:.1f}" for x in r["us"]) or (r["error"] or "not timed")
            print(f"| {rec['name']} | {v} | {r.get('kernels')} | {r.get('predicted_us', 0):.0f} | "
                  f"{r.get('launches')} | "
                  f"{'on' if r.get('graph_capture') else 'off'} | {ok} | {us} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

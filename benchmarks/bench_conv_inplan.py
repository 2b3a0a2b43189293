"""What each step of a CNN plan costs inside the captured plan, against alone, under cuDNN
policies: where a plan's time goes when its convolutions change implementation.

    python benchmarks/bench_conv_inplan.py OUT.json MODEL.onnx [--policies off,auto:find,auto:graph]

A policy is ``CONV_CUDNN[:OPTION...]`` (``tunedb.runtime.conv_cudnn``; options: an
``ALGO_PICK``, ``own``: a workspace per convolution, ``nchw`` / ``nhwc``: every cuDNN conv in
that layout, ``chain``: channels-last kept between them, ``tunedb.runtime.conv_chain``; no
layout: the defaults).
Per policy the plan is compiled as the zoo compiles it, verified against the float64
reference, then timed: the whole plan by replays of the executor's CUDA graph (the zoo table's
protocol, ``throughput_us``); the same launches captured again here, twice back to back
(``full``, three times: before, between and after the steps); and per step, its launches alone
(a graph of ``--reps`` repetitions on the plan's own buffers, inputs in L2 where they fit) and
the plan WITHOUT that step (``in_plan`` = full - without: what the step adds where it sits, its
neighbours' L2 state included). cuDNN's candidates per convolution (Find's times, the graph
re-timing where asked, the pick) come along.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv_steps import _graph_us, gpu_lock  # noqa: E402

from tunedb.bench.fusion import _one_line  # noqa: E402
from tunedb.bench.provenance import provenance  # noqa: E402
from tunedb.runtime import conv_chain, conv_cudnn  # noqa: E402

SWITCHES = ("CONV_CUDNN", "ALGO_PICK", "SHARED_WORKSPACE", "LAYOUT")
PICKS = ("find", "graph", "heuristic")
LAYOUTS = {"nchw": ("nchw", "off"), "nhwc": ("nhwc", "off"), "chain": ("auto", "on")}  # LAYOUT, CHAIN


def set_policy(policy: str) -> tuple:
    """Set ``conv_cudnn``'s and ``conv_chain``'s switches from ``MODE[:OPTION...]``: MODE off /
    auto / always; options a pick (find / graph / heuristic), ``own`` (a workspace per
    convolution), a layout: ``nchw`` or ``nhwc`` (every cuDNN conv so, no chain) or ``chain``
    (channels-last kept between them, ``conv_chain`` on); without one the defaults ("auto":
    the chain where few transposes remain). Returns the switches' values before."""
    before = tuple(getattr(conv_cudnn, k) for k in SWITCHES) + (conv_chain.CHAIN,)
    mode, *opts = policy.split(":")
    picks = [o for o in opts if o in PICKS]
    layouts = [o for o in opts if o in LAYOUTS]
    if mode not in ("off", "auto", "always") or len(picks) > 1 or len(layouts) > 1 \
            or len(set(opts)) != len(opts) or any(o not in (*PICKS, *LAYOUTS, "own") for o in opts):
        raise ValueError(f"bad policy {policy!r}: MODE[:OPTION...], MODE off/auto/always, "
                         "OPTION find/graph/heuristic/own/nchw/nhwc/chain")
    conv_cudnn.CONV_CUDNN, conv_cudnn.SHARED_WORKSPACE = mode, "own" not in opts
    conv_cudnn.ALGO_PICK = picks[0] if picks else before[1]
    conv_cudnn.LAYOUT, conv_chain.CHAIN = LAYOUTS.get(layouts[0] if layouts else "", ("auto", "auto"))
    return before


def restore(before: tuple) -> None:
    for k, v in zip(SWITCHES, before):
        setattr(conv_cudnn, k, v)
    conv_chain.CHAIN = before[len(SWITCHES)]


def time_policy(graph: Any, dev: dict, refs: Any, span: Any, reps: int, target_s: float,
                lock: Path | None = None, steps_too: bool = True) -> dict:
    """One policy's plan: verified, whole µs, and (``steps_too``) each step alone and in the
    plan; the timings hold ``lock``'s file lock (other processes' timings wait)."""
    import cupy as cp

    from tunedb.bench.peers import throughput_us
    from tunedb.bench.plan import verify
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.executor import PlanExecutor

    class StepExecutor(PlanExecutor):
        def _build(self, k: int, step: Any) -> None:  # records which launches each step adds
            ranges = self.__dict__.setdefault("step_ranges", [])
            n0, c0 = len(self._launch_fns), self._cudnn_convs()
            super()._build(k, step)
            ranges.append((n0, len(self._launch_fns), self._cudnn_convs() > c0))

        def _cudnn_convs(self) -> int:
            ops = getattr(self, "ops", None)
            return len(ops.dnn.found) if ops is not None and ops.dnn is not None else 0

    t0 = time.perf_counter()
    plan = compile_plan(graph, device="cuda")
    ex = StepExecutor(plan)
    rec: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1), "launches": ex.launches,
                           "graph_capture": ex.graph_capture}
    got = {k: cp.asnumpy(v) for k, v in ex.run(dev).items()}
    rec["verify"] = verify(graph, got, refs, exp_span=span)
    found = list(ex.ops.dnn.found) if ex.ops.dnn is not None else []
    rec["cudnn"] = found
    rec["cudnn_skipped"] = list(ex.ops.dnn_skipped) + ([ex.ops.dnn_error] if ex.ops.dnn_error else [])
    if not rec["verify"]["ok"]:
        return rec
    with gpu_lock(lock):
        rec["whole_us"] = round(throughput_us(ex.replay, ex.synchronize, target_s=target_s), 1)
        if steps_too:
            rec.update(_steps(cp, ex, plan, reps))
    del ex
    gc.collect()
    return rec


def _steps(cp: Any, ex: Any, plan: Any, reps: int) -> dict:
    """Each step alone and its cost inside the plan (the whole without it), by path."""
    fns = ex._launch_fns
    rec: dict[str, Any] = {}
    full = [_graph_us(cp, ex.stream, fns, 2)]
    steps = []
    for k, (s, path, (a, b, dnn)) in enumerate(zip(plan.steps, ex.paths, ex.step_ranges)):
        # what ran: the plan's name for a conv cuDNN skipped is the policy's, not the im2col it took
        path = "conv (cudnn)" if dnn else "conv (cudnn skipped)" if path.startswith("conv (cudnn") else path
        row: dict[str, Any] = {"k": k, "ops": "+".join(s.ops), "path": path, "launches": b - a}
        if b > a:
            try:
                row["alone_us"] = round(_graph_us(cp, ex.stream, fns[a:b], reps), 2)
                row["without_us"] = round(_graph_us(cp, ex.stream, fns[:a] + fns[b:], 2), 2)
                if dnn and b - a > 1:  # channels-last: the transposes and the convolution apart
                    row["parts_us"] = [round(_graph_us(cp, ex.stream, [f], reps), 2) for f in fns[a:b]]
            except Exception as e:  # noqa: BLE001 - a step that does not capture alone
                row["error"] = _one_line(e)
        steps.append(row)
        if k == len(plan.steps) // 2:
            full.append(_graph_us(cp, ex.stream, fns, 2))
    full.append(_graph_us(cp, ex.stream, fns, 2))
    ref = statistics.median(full)
    for row in steps:
        if "without_us" in row:
            row["in_plan_us"] = round(ref - row["without_us"], 2)
    rec.update(full_us=[round(f, 1) for f in full], steps=steps,
               alone_sum_us=round(sum(r.get("alone_us", 0.0) for r in steps), 1),
               in_plan_sum_us=round(sum(r.get("in_plan_us", 0.0) for r in steps), 1))
    by_path: dict[str, list[float]] = {}
    for r in steps:
        if "alone_us" in r:
            p = by_path.setdefault(r["path"], [0, 0.0, 0.0])
            p[0] += 1
            p[1] += r["alone_us"]
            p[2] += r.get("in_plan_us", 0.0)
    rec["by_path"] = {k: {"n": v[0], "alone_us": round(v[1], 1), "in_plan_us": round(v[2], 1)}
                      for k, v in by_path.items()}
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("model", type=Path)
    p.add_argument("--policies", default="off,auto:find,auto:graph")
    p.add_argument("--reps", type=int, default=20, help="repetitions of a step alone per graph")
    p.add_argument("--target-s", type=float, default=0.05)
    p.add_argument("--whole-only", action="store_true", help="the whole plan only, no step timings")
    p.add_argument("--lock", type=Path, default=None, help="hold this file's lock while timing")
    args = p.parse_args(argv)
    if not args.model.is_file():
        print(f"error: {args.model} is not a file", file=sys.stderr)
        return 2
    policies = args.policies.split(",")
    for pol in policies:
        try:
            restore(set_policy(pol))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from tunedb.bench.plan import INPUT_SEED, collect_entries, load_entry
    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.tolerance import reference_and_exp_span

    graph, _ = load_entry(collect_entries([args.model])[0])
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    result: dict[str, Any] = {"benchmark": "conv_inplan", **provenance(), "model": args.model.name,
                              "reps": args.reps, "policies": {}}
    for pol in policies:
        before = set_policy(pol)
        try:
            rec = time_policy(graph, dev, refs, span, args.reps, args.target_s, args.lock,
                              not args.whole_only)
        except Exception as e:  # noqa: BLE001 - a failing policy is a result
            rec = {"error": _one_line(e)}
        finally:
            restore(before)
        result["policies"][pol] = rec
        args.out.write_text(json.dumps(result, indent=1))
        picks = [c.get("pick") for c in rec.get("cudnn", [])]
        print(f"{pol}: whole {rec.get('whole_us', '-')} full {rec.get('full_us', '-')} alone-sum "
              f"{rec.get('alone_sum_us', '-')} in-plan-sum {rec.get('in_plan_sum_us', '-')} verify "
              f"{rec.get('verify', {}).get('ok', '-')} picks {picks} {rec.get('error', '')}", flush=True)
        for path, v in rec.get("by_path", {}).items():
            print(f"   {path:40s} n={v['n']:3d} alone {v['alone_us']:8.1f} in-plan {v['in_plan_us']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

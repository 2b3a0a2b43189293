"""The convolutions of a CNN plan, one by one, on the local GPU: tunedb's two im2col forms
(per-sample batched GEMM, and batch-merged: one GEMM over all samples) next to torch's
``conv2d`` (cuDNN, NCHW and channels-last), each verified against torch's float32 convolution of
the same values first; then, with ``--whole``, the whole plan under each form policy.

    python benchmarks/bench_conv.py OUT.json MODEL.onnx [--whole] [--reps R]
    python benchmarks/bench_conv.py OUT.json MODEL.onnx --plan-only      # CPU: the conv table

Per convolution: its shapes, how often the plan has it, the form ``auto`` picks, and per form
the µs per convolution (a CUDA graph of R back-to-back repetitions, median of 5 replays; the
parts timed alike: im2col, GEMM, the merged form's copy). Repetitions reuse the same buffers,
so the L2 cache holds what fits, for tunedb and torch alike. ``--whole``: the plan compiled and
run under ``never`` (per-sample GEMMs), ``auto`` (``executor_conv.merges_batch``) and
``auto-im2col`` (the same but 1x1 convolutions never merged), each verified against the
float64 reference, timed by replays of its CUDA graph (the zoo table's protocol,
``throughput_us``).
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

import numpy as np

from tunedb.bench.fusion import _one_line
from tunedb.bench.provenance import provenance
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ops import check_node
from tunedb.runtime import conv_cudnn, executor_conv

# CONV_BATCH_MERGE values (per-sample GEMMs, batch merged), "+tiled": with the tiled im2col kernel,
# "+cudnn": conv_cudnn.CONV_CUDNN "auto" (its rule), "+cudnn-all": "always" (every im2col conv)
FORMS = ("never", "always", "never+tiled", "always+tiled", "never+cudnn-all")
FLAGS = ("tiled", "cudnn", "cudnn-all")


DEFAULTS = (executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN)


def reset_policy() -> None:
    """The switches as the modules set them."""
    executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN = DEFAULTS


def set_policy(policy: str) -> None:
    """``executor_conv``'s and ``conv_cudnn``'s switches from ``MERGE[+FLAG...]``."""
    merge, *flags = policy.split("+")
    executor_conv.CONV_BATCH_MERGE = merge
    executor_conv.IM2COL_KERNEL = "tiled" if "tiled" in flags else "rows"
    conv_cudnn.CONV_CUDNN = "always" if "cudnn-all" in flags else "auto" if "cudnn" in flags else "off"


def conv_cases(plan: Any) -> list[dict]:
    """The plan's distinct conv2d steps (no bias: the planner moves it into the next kernel):
    shapes, attributes, dtype, how many steps share them, and the form under each policy."""
    cases: dict[tuple, dict] = {}
    for s in plan.steps:
        if s.kind != "conv2d":
            continue
        node = s.graph.nodes[0]
        types = s.graph.type_map
        x, w = types[node.inputs[0]], types[node.inputs[1]]
        a = check_node(node, [types[v] for v in node.inputs])[1]
        attrs = {k: tuple(a[k]) if isinstance(a[k], (list, tuple)) else a[k]
                 for k in ("strides", "pads", "dilations", "groups")}
        key = (x.shape, w.shape, tuple(sorted(attrs.items())), x.dtype, len(node.inputs))
        if key in cases:
            cases[key]["count"] += 1
            continue
        isz = 2 if x.dtype in ("bfloat16", "float16") else 4
        forms = {}
        for policy in ("never", "auto", "always"):
            executor_conv.CONV_BATCH_MERGE = policy
            forms[policy] = executor_conv.conv_form(x.shape, w.shape, a, isz)
        executor_conv.CONV_BATCH_MERGE = "auto"
        out = types[node.outputs[0]].shape
        cases[key] = {"x": list(x.shape), "w": list(w.shape), "out": list(out), "dtype": x.dtype,
                      "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()},
                      "bias": len(node.inputs) == 3, "count": 1, "form_auto": forms["auto"],
                      "gflop": 2 * int(np.prod(out)) * int(np.prod(w.shape[1:])) / 1e9,
                      "forms": {"never": forms["never"], "always": forms["always"]}}
    return list(cases.values())


def _graph_us(cp: Any, stream: Any, launches: list, reps: int) -> float:
    """µs per repetition of ``launches`` captured ``reps`` times as one CUDA graph (median of 5)."""
    gc.disable()  # a finalizer freeing device memory would break the capture
    try:
        with stream:
            stream.begin_capture()
            try:
                for _ in range(reps):
                    for f in launches:
                        f()
            finally:
                graph = stream.end_capture()
    finally:
        gc.enable()
    with stream:
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(5):
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record(stream)
            graph.launch(stream)
            t1.record(stream)
            t1.synchronize()
            times.append(cp.cuda.get_elapsed_time(t0, t1) * 1e3 / reps)
    return statistics.median(times)


# The flat im2col kernel tunedb ran before (one element per thread, five 64-bit div/mods each),
# timed against the row kernel on the same convolution, their columns compared bit for bit.
OLD_IM2COL = r"""
extern "C" __global__ void old_im2col(const unsigned short* __restrict__ x, unsigned short* __restrict__ cols,
    long long total, long long C, long long H, long long W, long long OH, long long OW,
    long long KH, long long KW, long long SH, long long SW, long long PT, long long PL,
    long long DH, long long DW) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    long long ow = i % OW, t = i / OW;
    long long oh = t % OH; t /= OH;
    long long kw = t % KW; t /= KW;
    long long kh = t % KH; t /= KH;
    long long c = t % C, n = t / C;
    long long ih = oh * SH - PT + kh * DH, iw = ow * SW - PL + kw * DW;
    cols[i] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? x[((n * C + c) * H + ih) * W + iw] : 0;
  }
}
"""


def im2col_old_new(cp: Any, kernels: Any, x: Any, case: dict, reps: int) -> dict:
    """µs of the old flat and the new row im2col kernels (16-bit data) on one convolution."""
    n, c, h, wd = case["x"]
    _, _, kh, kw = case["w"]
    oh, ow = case["out"][2:]
    a = case["attrs"]
    total = n * c * kh * kw * oh * ow
    args = (total, c, h, wd, oh, ow, kh, kw, *a["strides"], a["pads"][0], a["pads"][1], *a["dilations"])
    old, new = cp.full(total, 0xFFFF, cp.uint16), cp.zeros(total, cp.uint16)
    fn = cp.RawKernel(OLD_IM2COL, "old_im2col")
    grid = (max(1, min(kernels.max_blocks, -(-total // 256))),)
    full = tuple(np.int64(v) for v in args)

    def run_old() -> None:
        fn(grid, (256,), (x, old) + full)
    run_new = kernels.launch_rows("tdbx_im2col_u16", total // (oh * ow), oh * ow, (x, new) + args)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run_old()
        run_new()
    stream.synchronize()
    if not bool((old == new).all()):
        return {"error": "old and new im2col columns differ"}
    return {"old_us": _graph_us(cp, stream, [run_old], reps),
            "new_us": _graph_us(cp, stream, [run_new], reps)}


def _torch_us(torch: Any, fn: Any, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / reps)
    return statistics.median(times)


def _rel(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def gpu_case(case: dict, reps: int) -> dict:
    """One convolution: tunedb's forms (and their parts) and torch's, verified first."""
    import cupy as cp
    import torch
    import torch.nn.functional as F

    from tunedb.runtime.blas import Blas
    from tunedb.runtime.executor_ops import ComputeOps, KernelSet

    bf16 = case["dtype"] == "bfloat16"
    tdt = torch.bfloat16 if bf16 else torch.float32
    a = case["attrs"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fan_in = int(np.prod(case["w"][1:]))
    xt = torch.randn(case["x"], device="cuda", generator=gen).to(tdt)
    wt = (torch.randn(case["w"], device="cuda", generator=gen) / fan_in ** 0.5).to(tdt)
    torch.cuda.synchronize()  # the executor's stream reads these next
    pt, pl, pb, pr = a["pads"]
    if (pt, pl) != (pb, pr):
        return {"error": "asymmetric padding: not timed"}
    kw = {"stride": tuple(a["strides"]), "padding": (pt, pl), "dilation": tuple(a["dilations"]),
          "groups": a["groups"]}
    # float32 stays float32 (no TF32), cuDNN picks its fastest algorithm (tried before capture)
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, True
    want = F.conv2d(xt.float(), wt.float(), **kw)
    res: dict[str, Any] = {}
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    b = GraphBuilder("conv")
    xi, wi = b.input("x", case["x"], case["dtype"]), b.input("w", case["w"], case["dtype"])
    g = b.build([b.conv2d(xi, wi, strides=a["strides"], pads=a["pads"], dilations=a["dilations"],
                          groups=a["groups"])])
    node = g.nodes[0]
    attrs = check_node(node, [g.type_of(v) for v in node.inputs])[1]
    store = (lambda t: cp.asarray(t.view(torch.int16)).view(cp.uint16)) if bf16 else cp.asarray
    x, w = store(xt), store(wt)
    for form in FORMS:
        set_policy(form)
        stream = cp.cuda.Stream(non_blocking=True)
        blas = Blas(cp, stream)
        need = {"n": 1}

        def scratch(nbytes: int, need: dict = need) -> Any:
            need["n"] = max(need["n"], nbytes)
            return lambda: need["buf"]
        ops = ComputeOps(cp, KernelSet(cp, sm), scratch, blas)
        out = cp.zeros(case["out"], dtype=x.dtype)
        try:
            launches, kernels, path = ops.build(node, attrs, [x, w], [out])
            need["buf"] = cp.empty(need["n"], dtype=cp.uint8)
            with stream:
                for f in launches:
                    f()
            stream.synchronize()
            got = torch.as_tensor(out.view(cp.int16) if bf16 else out, device="cuda")
            err = _rel(got.view(torch.bfloat16) if bf16 else got, want)
            r = {"path": path, "kernels": kernels, "rel_err": err, "ok": err < (1e-2 if bf16 else 1e-5)}
            if ops.dnn is not None:  # cuDNN's algorithm, workspace bytes and its own time (ms)
                r["cudnn_algo"] = ops.dnn.chosen
            if r["ok"]:
                r["us"] = _graph_us(cp, stream, launches, reps)
                r["parts_us"] = [_graph_us(cp, stream, [f], reps) for f in launches]
        except Exception as e:  # noqa: BLE001 - a failing form is a result
            r = {"error": _one_line(e)}
        finally:
            reset_policy()
        res[form] = r
        del ops, blas
    if bf16 and res["never"].get("path") == "im2col + cublas":
        try:
            res["im2col_kernels"] = im2col_old_new(cp, KernelSet(cp, sm), x, case, reps)
        except Exception as e:  # noqa: BLE001
            res["im2col_kernels"] = {"error": _one_line(e)}
    for name, fmt in (("torch_nchw", torch.contiguous_format), ("torch_nhwc", torch.channels_last)):
        xs, ws = xt.contiguous(memory_format=fmt), wt.contiguous(memory_format=fmt)
        try:
            got = F.conv2d(xs, ws, **kw)
            err = _rel(got, want)
            r = {"rel_err": err, "ok": err < (1e-2 if bf16 else 1e-5)}
            if r["ok"]:
                r["us"] = _torch_us(torch, lambda xs=xs, ws=ws: F.conv2d(xs, ws, **kw), reps)
        except Exception as e:  # noqa: BLE001
            r = {"error": _one_line(e)}
        res[name] = r
    return res


def whole(model: Path, policies: tuple[str, ...], target_s: float) -> dict:
    """The whole plan under each policy: verified against the float64 reference, then timed."""
    from tunedb.bench.peers import throughput_us
    from tunedb.bench.plan import INPUT_SEED, collect_entries, load_entry, reference_and_exp_span, verify
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    graph, _ = load_entry(collect_entries([model])[0])
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    out: dict[str, Any] = {}
    for policy in policies:
        set_policy(policy)
        try:
            plan = compile_plan(graph, device="cuda")
            ex = PlanExecutor(plan)
            import cupy as cp

            got = {k: cp.asnumpy(v) for k, v in ex.run(dev).items()}
            r = {"launches": ex.launches, "graph_capture": ex.graph_capture,
                 "merged_convs": sum("batch merged" in p for p in ex.paths),
                 "cudnn_convs": len(ex.ops.dnn.chosen) if ex.ops.dnn is not None else 0,
                 "verify": verify(graph, got, refs, exp_span=span)}
            if r["verify"]["ok"]:
                r["us"] = throughput_us(ex.replay, ex.synchronize, target_s=target_s)
            del ex
        except Exception as e:  # noqa: BLE001
            r = {"error": _one_line(e)}
        finally:
            reset_policy()
        out[policy] = r
        print(f"  whole {model.name} [{policy}]: {r.get('us', r.get('error', 'not verified'))}", flush=True)
    return out


def table(rec: dict) -> str:
    head = ("| x | w | stride | n | auto | per-sample µs (im2col, gemm) | merged µs (im2col, gemm, copy) "
            "| cuDNN NCHW | cuDNN NHWC | im2col old -> new |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]

    def old_new(r: dict | None) -> str:
        if not r:
            return "-"
        return f"{r['old_us']:.1f} -> {r['new_us']:.1f}" if "old_us" in r else r.get("error", "?")[:40]
    for c in rec["convs"]:
        g = c.get("gpu", {})

        def cell(r: dict | None) -> str:
            if not r:
                return "-"
            if "us" not in r:
                return r.get("error", f"FAIL rel {r.get('rel_err', 0):.2g}")[:40]
            parts = ", ".join(f"{p:.1f}" for p in r.get("parts_us", []))
            return f"{r['us']:.1f}" + (f" ({parts})" if parts else "")
        rows.append(f"| {c['x']} | {c['w']} | {c['attrs']['strides'][0]} | {c['count']} | {c['form_auto']} "
                    f"| {cell(g.get('never'))} | {cell(g.get('always'))} | {cell(g.get('torch_nchw'))} "
                    f"| {cell(g.get('torch_nhwc'))} | {old_new(g.get('im2col_kernels'))} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("model", type=Path)
    p.add_argument("--plan-only", action="store_true", help="the conv table from the plan, no GPU")
    p.add_argument("--whole", action="store_true", help="also the whole plan under each policy")
    p.add_argument("--policies", default="never,auto,auto-im2col",
                   help="CONV_BATCH_MERGE values the whole plan runs under (with --whole); "
                        "suffixes: '+tiled' (the tiled im2col kernel), '+cudnn' / '+cudnn-all' "
                        "(conv_cudnn.CONV_CUDNN auto / always)")
    p.add_argument("--no-convs", action="store_true", help="skip the per-convolution table")
    p.add_argument("--reps", type=int, default=20, help="repetitions per captured graph")
    p.add_argument("--target-s", type=float, default=0.05)
    args = p.parse_args(argv)
    known = ("never", "auto", "auto-unaligned", "auto-im2col", "always")
    bad = [x for x in args.policies.split(",") if x.split("+")[0] not in known
           or any(f not in FLAGS for f in x.split("+")[1:])]
    if bad:
        print(f"error: unknown policy {bad[0]!r}; expected one of {', '.join(known)}", file=sys.stderr)
        return 2
    if not args.model.is_file():
        print(f"error: {args.model} is not a file", file=sys.stderr)
        return 2
    from tunedb.plan.driver import compile as compile_plan

    t0 = time.perf_counter()
    convs = [] if args.no_convs else conv_cases(
        compile_plan(str(args.model), device="generic" if args.plan_only else "cuda"))
    rec: dict[str, Any] = {"benchmark": "bench_conv", "model": str(args.model), "reps": args.reps,
                           "provenance": provenance(), "convs": convs}

    def save() -> None:  # after every piece: a run cut short by a time limit keeps what it had
        rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
        args.out.write_text(json.dumps(rec, indent=1))

    if not args.plan_only and args.whole:
        rec["whole"] = whole(args.model, tuple(args.policies.split(",")), args.target_s)
        save()
    if not args.plan_only and not args.no_convs:
        # the convolutions whose form changed first: a run cut by a time limit keeps those
        for c in sorted(rec["convs"], key=lambda c: c["form_auto"] != "im2col merged"):
            c["gpu"] = gpu_case(c, args.reps)
            save()
            print(f"  conv {c['x']} {c['w']}: " + ", ".join(
                f"{k} {v['us']:.1f}" if "us" in v else f"{k} {v}" for k, v in c["gpu"].items()), flush=True)
    save()
    print(table(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())

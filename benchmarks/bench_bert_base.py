"""BERT-base (12 layers, batch 1, sequence 128) end to end on the local GPU, every time taken
after its outputs were checked, and every item timed the same way: in interleaved rounds
(issue 24's must-show: bf16 <= 450 µs; the torch.compile backend no slower than the ONNX path).

    python benchmarks/bench_bert_base.py OUT.json [--dtypes bfloat16,float32] [--rounds 5]
        [--target-s 0.05] [--peers torch_eager,torch_compile,torch_compile_ro]
        [--backends gelu,default] [--variants default,epilogue,gelu] [--budget-s 480]
    python benchmarks/bench_bert_base.py OUT.json --plan-only   # CPU: the plans' kernel counts

Per dtype, in one process:

1. tunedb's plans of ``data/graphs/zoo/bert_base_dynamo_<dtype>.onnx``: ``default``,
   ``epilogue`` (``gemm_epilogue``: the QKV bias in cuBLASLt's bias epilogue) and ``gelu`` (also
   ``gelu_epilogue``: the FFN-up bias and GELU in cuBLASLt's GELU_BIAS; bfloat16 only), each
   verified against the float64 reference (``tunedb.bench.plan.verify``).
2. ``fresh`` rounds over the plans: a round times each item once (``throughput_us``: back-to-back
   calls, median of 5 batches), in an order rotated by one every round; after each round the
   GPU's SM clock, temperature, power and clock-event reasons (nvidia-smi).
3. The ``transformers`` module under the ``--peers`` and ``torch.compile(backend=tunedb_backend)``
   (``--backends``: ``gelu`` plans with both epilogues on cuBLASLt, ``default`` without), each
   checked against eager; and ``default_rebuilt``: a second executor of the default plan,
   built now (the same plan, its buffers placed after everything else).
4. ``after`` rounds over all of them.

Per item and phase: median, min and max over the rounds and spread = (max - min) / median. Why
this protocol: the first call of this benchmark (bcaadf4, parts run one after another) timed the
same bf16 default plan at 421 µs first and at 471 µs two minutes later in the same process.
Last, ``gelu_probe`` records which GELU cuBLASLt's ``GELU_BIAS`` computes. TF32 off. OUT.json
is rewritten after every step, so a cut call keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tunedb.bench.fusion import _one_line  # noqa: E402
from tunedb.bench.provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "data" / "graphs" / "zoo"
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
# plan name -> compile options; the executor runs cuBLASLt where the plan has epilogues
VARIANTS = {"default": {}, "epilogue": {"gemm_epilogue": True},
            "gelu": {"gemm_epilogue": True, "gelu_epilogue": True}}
PEER_MODES = {"torch_eager": None, "torch_compile": "default", "torch_compile_ro": "reduce-overhead"}
BACKENDS = {"gelu": {"gemm_epilogue": True, "gelu_epilogue": True, "cublaslt": True}, "default": {}}
# rough seconds on an H200 host, to skip what would not finish within --budget-s
COST_S = {"torch_eager": 3, "torch_compile": 16, "torch_compile_ro": 10, "backend": 15}
Timed = tuple[Callable[[], Any], Callable[[], None]]


def gpu_state() -> dict:
    """SM / memory clock (MHz), temperature (C), power (W) and the active clock-event reasons
    (a bit mask: thermal or power capping, idle...) of the first GPU, from nvidia-smi."""
    fields = ["clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active"]
    for q in (fields, fields[:-1]):
        try:
            cmd = ["nvidia-smi", f"--query-gpu={','.join(q)}", "--format=csv,noheader,nounits"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": _one_line(e)}
        if out.returncode == 0 and out.stdout.strip():
            return dict(zip(("sm_mhz", "mem_mhz", "temp_c", "power_w", "reasons"),
                            (v.strip() for v in out.stdout.splitlines()[0].split(","))))
    return {"error": (out.stderr or out.stdout).strip()[:200]}


def stats(samples: list[float]) -> dict:
    med = statistics.median(samples)
    return {"median": round(med, 1), "min": round(min(samples), 1), "max": round(max(samples), 1),
            "spread": round((max(samples) - min(samples)) / med, 4)}


def rounds(items: dict[str, Timed], n: int, target_s: float) -> dict:
    """``n`` rounds; each times every item once, the order rotated by one per round, so no item
    always runs first or right after the same neighbour."""
    from tunedb.bench.peers import interleaved_rounds

    gpu: list = []
    us, errors = interleaved_rounds(items, n, target_s, after_round=lambda: gpu.append(gpu_state()))
    return {"us": us, "stats": {k: stats(v) for k, v in us.items() if v}, "gpu": gpu, "errors": errors}


def _executor(plan: Any, graph: Any, dev: Any, refs: Any, span: float, cublaslt: bool, r: dict) -> Any:
    """A PlanExecutor of ``plan``, its facts in ``r``; returned only if its outputs verified."""
    import cupy

    from tunedb.bench.plan import verify
    from tunedb.runtime.executor import PlanExecutor

    ex = PlanExecutor(plan, cublaslt=cublaslt)
    epi = [s.config_dict.get("epilogue") for s in plan.steps]
    r.update(kernels=plan.kernels, launches=ex.launches, graph_capture=ex.graph_capture,
             capture_error=ex.capture_error, cublaslt=ex.lt is not None, cublaslt_error=ex.lt_error,
             fallbacks=ex.fallbacks, epilogues={e: epi.count(e) for e in ("bias", "gelu_bias")})
    got = {k: cupy.asnumpy(v) for k, v in ex.run(dev).items()}
    r["verify"] = verify(graph, got, refs, exp_span=span)
    return ex if r["verify"]["ok"] else None


def torch_items(dtype: str, peers: list[str], backends: list[str], rec: dict, left: Callable[[], float]
                ) -> dict[str, Timed]:
    """The module under each peer and each backend, checked against eager (facts in ``rec``);
    the ones that matched, as timed items."""
    import torch
    from bench_torch_backend import _build

    from tunedb.frontends.torch_backend import TOLERANCE, TunedbGraph, tunedb_backend

    model, args = _build("bert_base", dtype)
    want = model(*args).float()
    scale = float(want.abs().max()) or 1.0
    atol, rtol = TOLERANCE[dtype]
    sync = torch.cuda.synchronize
    items: dict[str, Timed] = {}
    todo = [(p, None) for p in peers] + [(f"backend_{b}", b) for b in backends]
    # No reset between them: the rounds call every compiled function again, and dynamo keeps one
    # cache entry per backend (guarded), where a reset would make each recompile.
    torch._dynamo.reset()
    for name, backend in todo:
        r: dict[str, Any] = {}
        rec[name] = r
        if COST_S["backend" if backend else name] > left():
            r["skipped"] = "budget"
            continue
        try:
            graphs: list[TunedbGraph] = []
            if backend is not None:
                def wrapped(gm: Any, ex: Any, b: str = backend, made: list = graphs) -> Any:
                    made.append(functools.partial(tunedb_backend, **BACKENDS[b])(gm, ex))
                    return made[-1]
                fn = torch.compile(model, backend=wrapped)
            else:
                mode = PEER_MODES[name]
                fn = model if mode is None else torch.compile(model, mode=mode)
            t0 = time.perf_counter()
            got = fn(*args).float().clone()
            sync()
            r["compile_s"] = round(time.perf_counter() - t0, 2)
            if graphs:
                r.update(fx_graphs=len(graphs),
                         kernels=[g.plan.kernels if g.plan is not None else None for g in graphs],
                         fallbacks=[g.fallback for g in graphs if g.fallback],
                         executor_fallbacks=[f for g in graphs if g.executor for f in g.executor.fallbacks])
            r["max_rel_err"] = float((got - want).abs().max()) / scale
            r["equal_within_tolerance"] = bool(torch.allclose(got, want, atol=atol * scale, rtol=rtol))
            if r["equal_within_tolerance"]:
                items[name] = (lambda fn=fn: fn(*args), sync)
        except Exception as e:  # noqa: BLE001 - a failing peer is a result
            r["error"] = _one_line(e)
        print(f"{dtype} {name}: {json.dumps(r)[:300]}", flush=True)
    return items


def session(dtype: str, a: argparse.Namespace, save: Callable[[], None], rec: dict, deadline: float) -> None:
    import torch

    from tunedb.bench.plan import collect_entries, load_entry
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.plan.gelu_epilogue import GELU_EPILOGUE_DTYPES
    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.tolerance import reference_and_exp_span

    def left() -> float:
        return deadline - time.perf_counter()

    graph, _ = load_entry(collect_entries([ZOO / f"bert_base_dynamo_{SHORT[dtype]}.onnx"], anchors=False)[0])
    dev, ref_in = make_inputs(graph, 0)
    refs, span = reference_and_exp_span(graph, ref_in)
    rec.update(plans={}, peers={}, phases={})
    plans, execs = {}, {}
    for name, opts in VARIANTS.items():
        if (name == "gelu" and dtype not in GELU_EPILOGUE_DTYPES) or name not in a.variants:
            continue
        r: dict[str, Any] = {}
        rec["plans"][name] = r
        try:
            t0 = time.perf_counter()
            plans[name] = compile_plan(graph, device="cuda", **opts)
            r["plan_s"] = round(time.perf_counter() - t0, 2)
            ex = _executor(plans[name], graph, dev, refs, span, bool(opts), r)
            if ex is not None:
                execs[name] = ex
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            r["error"] = _one_line(e)
        print(f"{dtype} plan {name}: {json.dumps(r)[:300]}", flush=True)
        save()
    items: dict[str, Timed] = {k: (ex.replay, ex.synchronize) for k, ex in execs.items()}
    rec["phases"]["fresh"] = rounds(items, a.rounds, a.target_s)
    save()
    with torch.no_grad():
        items.update(torch_items(dtype, a.peers, a.backends, rec["peers"], left))
        save()
        if "default" in plans:
            r = rec["plans"]["default_rebuilt"] = {}
            try:
                ex = _executor(plans["default"], graph, dev, refs, span, False, r)
                if ex is not None:
                    execs["default_rebuilt"] = ex
                    items["default_rebuilt"] = (ex.replay, ex.synchronize)
            except Exception as e:  # noqa: BLE001
                r["error"] = _one_line(e)
        rec["phases"]["after"] = rounds(items, a.rounds, a.target_s)
    save()


def gelu_probe() -> dict:
    """Which GELU cuBLASLt's ``GELU_BIAS`` epilogue computes: its fp32 result on a small GEMM
    against erf-GELU and the tanh approximation of ``x @ w + b`` (float64), as max abs errors.
    BERT's GELU is the erf form; a GELU epilogue for it needs this answer first."""
    import math

    import cupy as cp
    import numpy as np

    from tunedb.runtime.executor_lt import EPILOGUE_GELU_BIAS, BlasLt

    rng = np.random.default_rng(0)
    M, K, N = 64, 64, 96
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / math.sqrt(K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    lt = BlasLt(cp, stream)
    out = cp.zeros((M, N), cp.float32)
    xd, wd, bd = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    run = lt.gemm_bias(xd, wd, bd, out, trans_b=False, dtype="float32", epilogue=EPILOGUE_GELU_BIAS)
    if run is None:
        return {"error": "cuBLASLt has no algorithm for the GELU_BIAS epilogue"}
    with stream:
        run()
    stream.synchronize()
    h = x.astype(np.float64) @ w.astype(np.float64) + b
    forms = {"erf": 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2))),
             "tanh": 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))}
    got = cp.asnumpy(out).astype(np.float64)
    err = {k: float(np.abs(got - v).max()) for k, v in forms.items()}
    return {"max_abs_err": err, "form": min(err, key=err.get),
            "erf_vs_tanh": float(np.abs(forms["erf"] - forms["tanh"]).max())}


def plan_only(dtypes: list[str]) -> dict:
    from tunedb.plan.driver import compile as compile_plan

    out: dict[str, Any] = {}
    for dt in dtypes:
        path = ZOO / f"bert_base_dynamo_{SHORT[dt]}.onnx"
        for name, opts in VARIANTS.items():
            plan = compile_plan(str(path), device=None, **opts)
            epi = [s.config_dict.get("epilogue") for s in plan.steps]
            out[SHORT[dt] if name == "default" else f"{SHORT[dt]}_{name}"] = {
                "kernels": plan.kernels,
                "output_views": sum(s.config_dict.get("view") == "output" for s in plan.steps),
                "bias_epilogues": epi.count("bias"), "gelu_epilogues": epi.count("gelu_bias"),
                "layout_copies": sum(s.kind == "layout" for s in plan.steps)}
    return out


def summary_lines(result: dict) -> list[str]:
    """One line per dtype, phase and item: the median µs over the rounds [min-max] and spread;
    items that failed verification or were skipped are not timed, so not listed."""
    lines = ["dtype | phase | item | median µs | min-max | spread"]
    for short, sess in result.get("sessions", {}).items():
        for phase, ph in sess.get("phases", {}).items():
            for item, s in ph.get("stats", {}).items():
                lines.append(f"{short} | {phase} | {item} | {s['median']:.0f} | "
                             f"{s['min']:.0f}-{s['max']:.0f} | {100 * s['spread']:.1f} %")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--budget-s", type=float, default=480.0, help="no peer starts that would end later")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-s", type=float, default=0.05, help="seconds per timed batch")
    p.add_argument("--peers", default=",".join(PEER_MODES))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--variants", default=",".join(VARIANTS), help="tunedb plans to build and time")
    p.add_argument("--plan-only", action="store_true", help="plan on the CPU and count kernels only")
    a = p.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    a.peers = [x for x in a.peers.split(",") if x]
    a.backends = [x for x in a.backends.split(",") if x]
    a.variants = [x for x in a.variants.split(",") if x]
    for what, got, known in (("dtype", dtypes, SHORT), ("peer", a.peers, PEER_MODES),
                             ("backend", a.backends, BACKENDS), ("variant", a.variants, VARIANTS)):
        bad = [d for d in got if d not in known]
        if bad:
            print(f"error: unknown {what}(s) {', '.join(bad)}; expected some of {', '.join(known)}",
                  file=sys.stderr)
            return 2
    if a.rounds < 1:
        print(f"error: --rounds must be at least 1, got {a.rounds}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "bert_base", "batch": 1, "sequence": 128, **provenance(argv)}
    if a.plan_only:
        result["plans"] = plan_only(dtypes)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["plans"], indent=1))
        return 0
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, sessions={},
                  rounds=a.rounds, target_s=a.target_s)
    start = time.perf_counter()

    def save() -> None:
        a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    for dt in dtypes:
        rec: dict[str, Any] = {}
        result["sessions"][SHORT[dt]] = rec
        try:
            session(dt, a, save, rec, start + a.budget_s)
        except Exception as e:  # noqa: BLE001 - a failing session is a result
            rec["error"] = _one_line(e)
        save()
    try:  # last (a ctypes slip could take the process down): which GELU cuBLASLt's epilogue is
        result["gelu_epilogue"] = gelu_probe()
    except Exception as e:  # noqa: BLE001
        result["gelu_epilogue"] = {"error": _one_line(e)}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    for line in summary_lines(result):
        print(line)
    save()
    print(f"done in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BERT-base (12 layers, batch 1, sequence 128) end to end on the local GPU in one call, fp32 and
bf16, every time taken after its outputs were checked (issue 24's must-show: bf16 <= 450 µs).

    python benchmarks/bench_bert_base.py OUT.json [--budget-s 480] [--dtypes bfloat16,float32]
    python benchmarks/bench_bert_base.py OUT.json --plan-only   # CPU: the plans' kernel counts

Parts, run in ``ORDER`` (what the must-show needs first; the budget skips a part that would not
finish; OUT.json is rewritten after every part, so a cut call keeps what it measured):

0. ``onnx_default``: tunedb's default plan alone, verified against the reference and timed.
1. ``onnx``: tunedb's ONNX path on ``data/graphs/zoo/bert_base_dynamo_<dtype>.onnx``
   (``tunedb.bench.plan.run_entry``: the default plan verified against the float64 reference
   and, in fp32, onnxruntime; then torch.compile reduce-overhead on the same translated graph).
2. ``onnx_epilogue``: the default plan, then the same graph planned with ``gemm_epilogue=True``
   and run with cuBLASLt's bias epilogue (``PlanExecutor(cublaslt=True)``), both verified
   against the reference and timed back to back (saved after each).
3. ``module``: the ``transformers`` module itself (as ``export_zoo`` builds it) under torch
   eager, torch.compile and torch.compile reduce-overhead, each checked against eager within
   the backend's tolerance: the issue's peers (559 / 2105 µs on the H200).
4. ``backend`` and ``backend_epilogue``: ``torch.compile(module, backend=tunedb_backend)``
   (``bench_torch_backend.one``), without and with ``gemm_epilogue`` + ``TUNEDB_CUBLASLT=1``.

Last, ``gelu_probe`` records which GELU cuBLASLt's ``GELU_BIAS`` epilogue computes (erf or
tanh), the fact a GELU epilogue for BERT needs. Throughput mode
(``tunedb.bench.peers.throughput_us``), TF32 off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tunedb.bench.fusion import _one_line  # noqa: E402
from tunedb.bench.provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "data" / "graphs" / "zoo"
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
# Rough seconds each part needs on an H200 host (planning BERT-base is ~15-30 s on one core).
COST_S = {"onnx": 90, "onnx_default": 50, "onnx_epilogue": 80, "module": 100, "backend": 50,
          "backend_epilogue": 50}
# What the must-show needs first: tunedb's default plans and the module's peers, bf16 then fp32;
# then what runs cuBLASLt through ctypes, which could take the process down if it is wrong.
ORDER = (("bfloat16", "onnx_default"), ("bfloat16", "module"), ("float32", "onnx_default"),
         ("float32", "module"), ("bfloat16", "onnx_epilogue"), ("bfloat16", "backend"),
         ("bfloat16", "backend_epilogue"), ("float32", "onnx_epilogue"), ("bfloat16", "onnx"),
         ("float32", "onnx"), ("float32", "backend"), ("float32", "backend_epilogue"))


def onnx_path(path: Path) -> dict:
    from tunedb.bench.peers import Frameworks
    from tunedb.bench.plan import collect_entries, run_entry

    entry = collect_entries([path], anchors=False)[0]
    return run_entry(entry, Frameworks(), ("torch_compile_ro",), None, None,
                     say=lambda s: print(s, flush=True))


def onnx_epilogue(path: Path, rec: dict, save: Any, epilogue: bool = True) -> dict:
    """The default plan and the gemm-epilogue plan on cuBLASLt, verified, timed back to back;
    ``rec`` is saved after the first, so a crash in cuBLASLt keeps the default's time."""
    import cupy

    from tunedb.bench.peers import throughput_us
    from tunedb.bench.plan import collect_entries, load_entry, verify
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.tolerance import reference_and_exp_span

    graph, _ = load_entry(collect_entries([path], anchors=False)[0])
    dev, ref_in = make_inputs(graph, 0)
    refs, span = reference_and_exp_span(graph, ref_in)
    for name, epi in (("default", False), ("epilogue_cublaslt", True))[:2 if epilogue else 1]:
        r: dict[str, Any] = {}
        rec[name] = r
        try:
            t0 = time.perf_counter()
            plan = compile_plan(graph, device="cuda", gemm_epilogue=epi)
            r["plan_s"] = round(time.perf_counter() - t0, 2)
            ex = PlanExecutor(plan, cublaslt=epi)
            r.update(kernels=plan.kernels, launches=ex.launches, graph_capture=ex.graph_capture,
                     capture_error=ex.capture_error, cublaslt=ex.lt is not None, cublaslt_error=ex.lt_error,
                     fallbacks=ex.fallbacks, bias_epilogues=sum(s.config_dict.get("epilogue") == "bias"
                                                                for s in plan.steps))
            got = {k: cupy.asnumpy(v) for k, v in ex.run(dev).items()}
            r["verify"] = verify(graph, got, refs, exp_span=span)
            if r["verify"]["ok"]:
                r["us"] = throughput_us(ex.replay, ex.synchronize)
            del ex
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            r["error"] = _one_line(e)
        print(f"{path.name} {name}: {json.dumps(r)[:400]}", flush=True)
        save()
    return rec


def module_peers(dtype: str) -> dict:
    """The transformers module under eager, torch.compile and reduce-overhead."""
    import torch
    from bench_torch_backend import _build

    from tunedb.bench.peers import throughput_us
    from tunedb.frontends.torch_backend import TOLERANCE

    model, args = _build("bert_base", dtype)
    rec: dict[str, Any] = {}
    with torch.no_grad():
        want = model(*args).float()
        scale = float(want.abs().max()) or 1.0
        atol, rtol = TOLERANCE[dtype]
        for name, mode in (("torch_eager", None), ("torch_compile", "default"),
                           ("torch_compile_ro", "reduce-overhead")):
            r: dict[str, Any] = {}
            rec[name] = r
            try:
                torch._dynamo.reset()
                fn = model if mode is None else torch.compile(model, mode=mode)
                t0 = time.perf_counter()
                got = fn(*args).float().clone()
                torch.cuda.synchronize()
                r["compile_s"] = round(time.perf_counter() - t0, 2)
                r["max_rel_err"] = float((got - want).abs().max()) / scale
                r["equal_within_tolerance"] = bool(torch.allclose(got, want, atol=atol * scale, rtol=rtol))
                if r["equal_within_tolerance"]:
                    r["us"] = throughput_us(lambda fn=fn: fn(*args), torch.cuda.synchronize)
            except Exception as e:  # noqa: BLE001
                r["error"] = _one_line(e)
            print(f"module {dtype} {name}: {json.dumps(r)}", flush=True)
    return rec


def backend(dtype: str, epilogue: bool, lock: Path) -> dict:
    import functools

    import bench_torch_backend

    from tunedb.frontends import torch_backend

    if not epilogue:
        return bench_torch_backend.one("bert_base", dtype, lock, 0.1)
    os.environ["TUNEDB_CUBLASLT"] = "1"
    saved = torch_backend.tunedb_backend
    # bench_torch_backend.one imports the backend by name: hand it the epilogue-planning one
    torch_backend.tunedb_backend = functools.partial(saved, gemm_epilogue=True)
    try:
        return bench_torch_backend.one("bert_base", dtype, lock, 0.1)
    finally:
        torch_backend.tunedb_backend = saved
        os.environ.pop("TUNEDB_CUBLASLT", None)


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
        for epi in (False, True):
            plan = compile_plan(str(path), device=None, gemm_epilogue=epi)
            out[f"{SHORT[dt]}{'_epilogue' if epi else ''}"] = {
                "kernels": plan.kernels,
                "output_views": sum(s.config_dict.get("view") == "output" for s in plan.steps),
                "bias_epilogues": sum(s.config_dict.get("epilogue") == "bias" for s in plan.steps),
                "layout_copies": sum(s.kind == "layout" for s in plan.steps)}
    return out


def summary_lines(result: dict) -> list[str]:
    """One line per dtype: verified µs of each tunedb variant and peer (``-``: not measured)."""
    def us(rec: Any) -> str:
        return f"{rec['us']:.0f}" if isinstance(rec, dict) and rec.get("us") else "-"

    lines = ["dtype | tunedb | tunedb+epilogue | eager | compile | reduce-overhead | backend | "
             "backend+epilogue (µs)"]
    parts = result.get("parts", {})
    for short in SHORT.values():
        onnx = {**parts.get(f"{short}/onnx_default", {}), **parts.get(f"{short}/onnx_epilogue", {})}
        mod = parts.get(f"{short}/module", {})
        back = [parts.get(f"{short}/{b}", {}) for b in ("backend", "backend_epilogue")]
        cells = [us(onnx.get("default")), us(onnx.get("epilogue_cublaslt")), us(mod.get("torch_eager")),
                 us(mod.get("torch_compile")), us(mod.get("torch_compile_ro"))]
        cells += [f"{b['backend_us']:.0f}" if b.get("backend_us") and b.get("equal_within_tolerance") else "-"
                  for b in back]
        lines.append(f"{short} | " + " | ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--budget-s", type=float, default=480.0, help="no part starts that would end later")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--plan-only", action="store_true", help="plan on the CPU and count kernels only")
    p.add_argument("--gpu-lock", type=Path, default=Path(tempfile.gettempdir()) / "tunedb-gpu.lock")
    a = p.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in SHORT]
    if bad:
        print(f"error: unknown dtype(s) {', '.join(bad)}; expected some of {', '.join(SHORT)}",
              file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "bert_base", "batch": 1, "sequence": 128, **provenance()}
    if a.plan_only:
        result["plans"] = plan_only(dtypes)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["plans"], indent=1))
        return 0
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.pop("TUNEDB_CUBLASLT", None)
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, parts={}, skipped=[])
    start = time.perf_counter()

    def save() -> None:
        a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    parts = {"onnx": lambda dt, rec: onnx_path(ZOO / f"bert_base_dynamo_{SHORT[dt]}.onnx"),
             "onnx_default": lambda dt, rec: onnx_epilogue(ZOO / f"bert_base_dynamo_{SHORT[dt]}.onnx",
                                                           rec, save, epilogue=False),
             "onnx_epilogue": lambda dt, rec: onnx_epilogue(ZOO / f"bert_base_dynamo_{SHORT[dt]}.onnx",
                                                            rec, save),
             "module": lambda dt, rec: module_peers(dt),
             "backend": lambda dt, rec: backend(dt, False, a.gpu_lock),
             "backend_epilogue": lambda dt, rec: backend(dt, True, a.gpu_lock)}
    for dt, name in ORDER:
        if dt not in dtypes:
            continue
        key = f"{SHORT[dt]}/{name}"
        if time.perf_counter() - start + COST_S[name] > a.budget_s:
            result["skipped"].append(key)
            continue
        t0 = time.perf_counter()
        rec: dict[str, Any] = {}
        result["parts"][key] = rec
        try:
            rec.update(parts[name](dt, rec))
        except Exception as e:  # noqa: BLE001 - a failing part is a result
            rec["error"] = _one_line(e)
        rec["part_s"] = round(time.perf_counter() - t0, 1)
        save()
    try:  # last (a ctypes slip could take the process down): which GELU cuBLASLt's epilogue is
        result["gelu_epilogue"] = gelu_probe()
    except Exception as e:  # noqa: BLE001
        result["gelu_epilogue"] = {"error": _one_line(e)}
    print(f"cuBLASLt GELU_BIAS epilogue: {json.dumps(result['gelu_epilogue'])}", flush=True)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    for line in summary_lines(result):
        print(line)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"done in {result['wall_s']} s; skipped: {', '.join(result['skipped']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 21 on one GPU: the generated steps of generalization-suite workloads timed under the
kernel choices the planner makes by rule, next to the alternatives, so a rule rests on numbers.

    python benchmarks/step_variants.py OUT.json NAME [NAME ...] [--target-s 0.1]
    python benchmarks/step_variants.py OUT.json NAME [NAME ...] --plan-only   # CPU: variants only
    python benchmarks/step_variants.py OUT.json NAME:window NAME:rows ...      # those steps only
    python benchmarks/step_variants.py OUT.json NAME:space --chunks 4          # a row step's space

For each workload (``data/graphs/generalization/NAME.onnx``) the CPU plan's generated steps: a
window step (depthwise conv / pool) with strips of 1, 2 and 4 outputs a thread
(``gen_window.strip_width`` picks one), strips of 2 with e5983d8's branch around each kernel row
(``strip2_rowbranch``: what the row predicate replaced), and as "plane" kernels (a block an
input plane in shared memory, its threads strips of 1 or 4 outputs from it; stride-1
convolutions also strips of 8, and 4 or 8 with the weights in registers: ``plane4w``,
``plane8w``); where the plan has several steps and the generator takes the whole workload
(EfficientNet's SiLU, conv, SiLU and squeeze-excitation mean), the whole as one plane kernel
(strips of 1 and 4), the plan's other steps timed as planned for the sum; a row step (norms)
with its planned schedule and the first legal schedule, in the fallback rules' order, of
``block_per_row`` and of ``split_row`` at splits 2, 4 and 8, and the planned schedule at its
other legal block sizes (``planned_b512``) and with fast math (``planned_fast``). Each variant
runs on the step's own inputs (``make_inputs``), is checked against the float64 reference of its
subgraph (``compare_outputs``: a failing variant is recorded, never timed), then timed with the
plan protocol's ``throughput_us``, all variants of a step back to back in one process. Prints
one line per variant; writes ``OUT.json``.

``NAME:space``: a row step under every legal schedule of its space, one per (mapping, split, row
cache, vector width, block), the fast-math twin where there is one, without the cache-hint twins,
and cluster kernels with their row cache in registers also at two blocks an SM (``_mb2``:
``__launch_bounds__(block, 2)``) (``space_variants``); ``--chunks K`` prepares each such
workload as K jobs (K processes compile at once). Float outputs are checked on the GPU there
(the same rule as ``compare_outputs``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.plan import Entry, load_entry
from tunedb.bench.provenance import provenance
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.codegen import KernelPlan, KernelSpec, generate
from tunedb.kernels.gen_window import has_window_op, match_window, window_kernel, window_stride
from tunedb.kernels.schedule import Schedule, schedule_space
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.fallback import fallback_order
from tunedb.records import sha256_hex

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "data" / "graphs" / "generalization"
STRIPS = (1, 2, 4)
ROW_CHOICES = (("block_per_row", 1), ("split_row", 2), ("split_row", 4), ("split_row", 8))
SM_COUNT = 132


def row_branch(source: str, in_h: int) -> str:
    """``source`` (a strip kernel of strips of 2 or more) as e5983d8 generated it: a branch
    around each kernel row, where the row's bounds now join each column's test."""
    new = f"const bool rin = ih >= 0 && ih < {in_h};"
    if new not in source:
        raise ValueError("not a strip kernel with a row predicate")
    return source.replace(new, f"if (ih < 0 || ih >= {in_h}) continue;\n  const bool rin = true;")


def _window_variants(sub: Graph) -> tuple[dict[str, KernelPlan], str]:
    """A window step's kernels by label, and the label of the one the planner's rules pick
    (``planned`` when it is none of the others)."""
    m = match_window(sub)
    kernels = {}
    try:
        for s in STRIPS:
            kernels[f"strip{s}"] = window_kernel(sub, SM_COUNT, strip=s, layout="strip")
    except UnsupportedFusion:  # a plane mean needs the plane
        pass
    k = kernels.get("strip2")
    if k is not None and f"const bool rin = ih >= 0 && ih < {m.in_shape[2]};" in k.source:
        src = row_branch(k.source, m.in_shape[2]).replace(k.name, k.name + "_rb")  # the fix's A/B
        kernels["strip2_rowbranch"] = replace(k, name=k.name + "_rb", source=src)
    try:
        for s in (1, 4):
            kernels[f"plane{s}"] = window_kernel(sub, SM_COUNT, strip=s, layout="plane")
        if window_stride(sub, m) == 1 and m.node.op == "conv2d":  # wider strips, weights in registers
            kernels["plane8"] = window_kernel(sub, SM_COUNT, strip=8, layout="plane")
            kernels["plane4w"] = window_kernel(sub, SM_COUNT, strip=4, layout="plane", hoist=True)
            kernels["plane8w"] = window_kernel(sub, SM_COUNT, strip=8, layout="plane", hoist=True)
    except UnsupportedFusion:  # a plane too large for shared memory, or a resample
        pass
    seen: set[str] = set()  # a resample's strips are all one kernel: listed once
    kernels = {k: w for k, w in kernels.items() if not (w.source in seen or seen.add(w.source))}
    planned = window_kernel(sub, SM_COUNT)
    chosen = next((lbl for lbl, w in kernels.items() if w.source == planned.source), "planned")
    if chosen == "planned":
        kernels["planned"] = planned
    out = {k: KernelPlan((KernelSpec(w.name, w.source, w.grid, w.block, w.shared_bytes, w.args),),
                         (), sha256_hex(w.source), w.R, w.C, "window") for k, w in kernels.items()}
    return out, chosen


def _row_variants(sub: Graph, config: dict, others: bool = True) -> tuple[dict[str, KernelPlan], str]:
    """The planned kernel, and (``others``, row patterns) the alternatives of ``ROW_CHOICES``."""
    try:
        a = analyze(sub)
    except UnsupportedFusion:  # rows of a transposed input (gen_trows): the planned kernel alone
        return {"planned": generate(sub, Schedule.from_config(config), SM_COUNT)}, "planned"
    out = {"planned": generate(a, Schedule.from_config(config), SM_COUNT)}
    if not others or a.pattern not in ("row_reduce", "multi"):
        return out, "planned"
    legal = schedule_space(a, SM_COUNT)[0]
    order = fallback_order(a, legal, np.ones(len(legal)), np.ones(len(legal)), SM_COUNT)
    for mapping, split in ROW_CHOICES:
        hit = next((legal[i] for i in order
                    if legal[i].mapping == mapping and (mapping != "split_row" or legal[i].split == split)),
                   None)
        kp = generate(a, hit, SM_COUNT) if hit is not None else None
        if kp is not None and all(kp.source_hash != p.source_hash for p in out.values()):
            out[f"{mapping}" + (f"_s{split}" if mapping == "split_row" else "")] = kp
    # the planned schedule at the other legal block sizes, and with fast math (GroupNorm's SiLU)
    plan_s = Schedule.from_config(config)
    for s in legal:
        same = replace(s, block=plan_s.block, fast_math=plan_s.fast_math, stitch=plan_s.stitch) == plan_s
        if same and (s.block != plan_s.block) != (s.fast_math != plan_s.fast_math):
            kp = generate(a, s, SM_COUNT)
            if all(kp.source_hash != p.source_hash for p in out.values()):
                out[f"planned_b{s.block}" if s.block != plan_s.block else "planned_fast"] = kp
    return out, "planned"


def space_variants(sub: Graph, config: dict, chunk: tuple[int, int] = (0, 1)) -> dict[str, KernelPlan]:
    """The planned kernel (chunk 0) and one kernel per (mapping, split, row cache, vec, block) of
    the step's legal schedules, the fast-math twin where the space has one; every K-th of them
    from ``chunk = (i, K)``."""
    a = analyze(sub)
    legal = [s for s in schedule_space(a, SM_COUNT)[0] if not s.stream and not s.evict_last]
    picked: dict[tuple, Schedule] = {}
    for s in legal:
        key = (s.mapping, s.split, s.row_cache, s.vec, s.block)
        if key not in picked or (s.fast_math and not picked[key].fast_math):
            picked[key] = s
    i, k = chunk
    out = {"planned": generate(a, Schedule.from_config(config), SM_COUNT)} if i == 0 else {}
    for s in list(picked.values())[i::k]:
        out[s.label()] = generate(a, s, SM_COUNT)
        if s.mapping == "split_row" and s.row_cache == "registers" and s.block <= 512:
            out[s.label() + "_mb2"] = min_blocks(out[s.label()], 2)
    return out


def min_blocks(kp: KernelPlan, n: int) -> KernelPlan:
    """``kp`` with ``__launch_bounds__(block, n)``: nvcc keeps registers to what lets n blocks of
    the kernel share an SM (a cluster kernel's row cache took 150-200 registers, one block an SM)."""
    ks = []
    for k in kp.kernels:
        b = k.block[0]
        src = k.source.replace(f"__launch_bounds__({b})", f"__launch_bounds__({b}, {n})")
        ks.append(replace(k, name=f"{k.name}_mb{n}", source=src.replace(k.name, f"{k.name}_mb{n}")))
    return replace(kp, kernels=tuple(ks), source_hash=sha256_hex("".join(k.source for k in ks)))


def step_variants(name: str, steps: str = "all", chunk: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
    """The generated steps of workload ``name`` with their variants (plans not yet run);
    ``steps``: window (alternatives for window steps, the other steps as planned), rows (row
    steps and their alternatives), space (row steps under their legal schedules: ``chunk``) or
    all."""
    path = SUITE / f"{name}.onnx"
    graph, _ = load_entry(Entry(name, str(path.relative_to(ROOT)), path=path))
    plan = compile_plan(graph)
    out = []
    for i, st in enumerate(plan.steps):
        if st.kind != "fused":
            continue
        sub = Graph.from_json(json.loads(st.subgraph))
        window = has_window_op(sub)
        if steps in ("rows", "space") and window:
            continue
        if steps == "space":
            try:
                rows = analyze(sub).pattern in ("row_reduce", "multi")
            except UnsupportedFusion:  # rows of a transposed input (gen_trows): no space
                rows = False
            if rows:
                out.append({"workload": name, "step": i, "ops": list(st.ops), "chosen": "planned",
                            "config": st.config_dict, "graph": sub,
                            "variants": space_variants(sub, st.config_dict, chunk)})
            continue
        variants, chosen = (_window_variants(sub) if window else
                            _row_variants(sub, st.config_dict, others=steps != "window"))
        if steps == "rows" and len(variants) == 1:  # not a row step
            continue
        if variants:
            out.append({"workload": name, "step": i, "ops": list(st.ops), "chosen": chosen,
                        "config": st.config_dict, "graph": sub, "variants": variants})
    if steps != "rows" and len(plan.steps) > 1 and has_window_op(graph):
        try:  # the whole workload as one plane kernel, beside the plan's steps
            ws = {f"plane{s}": window_kernel(graph, SM_COUNT, strip=s, layout="plane") for s in (1, 4)}
        except UnsupportedFusion:
            return out
        kps = {k: KernelPlan((KernelSpec(w.name, w.source, w.grid, w.block, w.shared_bytes, w.args),),
                             (), sha256_hex(w.source), w.R, w.C, "window") for k, w in ws.items()}
        out.append({"workload": name, "step": "whole", "ops": [n.op for n in graph.nodes],
                    "chosen": "", "config": {}, "graph": graph, "variants": kps})
    return out


def _wire(kp: KernelPlan) -> dict:
    from tunedb.runtime.cuda import plan_to_wire

    w = plan_to_wire(kp)
    for s in w["scratch"]:  # the plan says which scratch needs zeros
        s["zero"] = s["name"] in kp.zeroed
    return w | {"source_hash": kp.source_hash[:16]}


def prepare(name: str, steps: str, tmp: str, chunk: tuple[int, int] = (0, 1)) -> list[dict]:
    """In a worker process: plan ``name``, draw each step's inputs and its float64 reference
    (``.npz`` in ``tmp``, no pickles); the steps as JSON-ready dicts."""
    from tunedb.runtime.inputs import make_inputs, reference_outputs
    from tunedb.runtime.measure import precompile

    out = []
    for st in step_variants(name, steps, chunk):
        g: Graph = st["graph"]
        dev, ref = make_inputs(g, 0)
        npz = Path(tmp) / f"{name}_{st['step']}_{chunk[0]}.npz"
        np.savez(npz, **{f"in:{k}": v for k, v in dev.items()},
                 **{f"ref:{k}": v for k, v in reference_outputs(g, ref).items()})
        for p in st["variants"].values():  # on a GPU host: fill CuPy's disk cache of kernels
            precompile([{"source": k.source} for k in p.kernels])
        out.append({**{k: v for k, v in st.items() if k not in ("graph", "variants")},
                    "graph": g.to_json(), "npz": str(npz), "gpu_check": steps == "space",
                    "variants": {k: _wire(p) for k, p in st["variants"].items()}})
    return out


def gpu_check(cp: Any, g: Graph, refs: dict[str, np.ndarray]) -> Any:
    """``compare_outputs`` on the GPU for float32/float16 outputs (a 268 MB output takes seconds
    on the host): a function of the output buffers giving ``(worst output, error over bound)``;
    None when an output has another dtype."""
    from tunedb.runtime.tolerance import element_bounds, element_errors, tolerance

    if any(g.type_of(v).dtype not in ("float32", "float16") for v in g.outputs):
        return None
    bounds = {}
    for v in g.outputs:
        r = cp.asarray(refs[v], dtype=cp.float64).reshape(g.type_of(v).shape)
        abs_tol, rtol = tolerance(g, g.type_of(v).dtype).bounds(refs[v])
        bounds[v] = (r, element_bounds(cp, r, abs_tol, rtol))

    def check(bufs: dict[str, Any]) -> tuple[str, float]:
        worst = ("", 0.0)
        for v, (r, bound) in bounds.items():
            err = element_errors(cp, bufs[v].astype(cp.float64), r)
            ratio = float(cp.where(err == 0.0, 0.0, err / bound).max()) if err.size else 0.0
            if ratio > worst[1] or not worst[0]:
                worst = (v, ratio)
        return worst

    return check


def run_step(cp: Any, step: dict, target_s: float) -> dict[str, dict]:
    """Verify, then time, every variant of ``step`` on the local GPU."""
    from tunedb.bench.peers import throughput_us
    from tunedb.runtime.inputs import poison_value, storage_dtype
    from tunedb.runtime.launch import kernel_function, launcher, scratch_zeroed
    from tunedb.runtime.tolerance import compare_outputs

    g = Graph.from_json(step["graph"])
    with np.load(step["npz"], allow_pickle=False) as z:
        bufs = {k[3:]: cp.asarray(z[k]) for k in z.files if k.startswith("in:")}
        refs = {k[4:]: z[k] for k in z.files if k.startswith("ref:")}
    on_gpu = gpu_check(cp, g, refs) if step.get("gpu_check") else None
    for v in g.outputs:
        t = g.type_of(v)
        bufs[v] = cp.empty(t.shape, storage_dtype(t.dtype))
    modules: dict = {}
    res: dict[str, dict] = {}
    for label, kp in step["variants"].items():
        rec: dict[str, Any] = {"source_hash": kp["source_hash"],
                               "grid": [k["grid"] for k in kp["kernels"]]}
        try:
            sz = scratch_zeroed(kp)
            scratch = {n: cp.zeros(nb // 4 + 1, cp.float32) for n, nb, _ in sz}
            zero = [scratch[n] for n, _, z in sz if z]
            funcs = [kernel_function(cp, modules, k) for k in kp["kernels"]]
            run = launcher(funcs, kp["kernels"], {**bufs, **scratch}, zero)
            for v in g.outputs:  # unwritten elements fail the check
                bufs[v].fill(poison_value(g.type_of(v).dtype))
            run()
            cp.cuda.runtime.deviceSynchronize()
            worst, err = (on_gpu(bufs) if on_gpu is not None else
                          compare_outputs(g, {v: cp.asnumpy(bufs[v]) for v in g.outputs}, refs))
            rec["err_over_tol"] = float(err)
            if not err <= 1.0:
                rec["error"] = f"output {worst} off by {err:.3g}x tolerance"
            else:
                rec["us"] = throughput_us(run, cp.cuda.runtime.deviceSynchronize, target_s=target_s)
        except Exception as e:  # noqa: BLE001 - one failing variant is a result
            rec["error"] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        res[label] = rec
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--steps", choices=("window", "rows", "all"), default="all")
    ap.add_argument("--target-s", type=float, default=0.05, help="seconds per timed batch")
    ap.add_argument("--workers", type=int, default=2, help="processes preparing plans and inputs")
    ap.add_argument("--limit", type=float, default=0.0, help="no new workload after S seconds")
    ap.add_argument("--plan-only", action="store_true", help="prepare the variants, run nothing")
    ap.add_argument("--chunks", type=int, default=1, help="jobs per NAME:space workload")
    args = ap.parse_args()
    picks = [(n.partition(":")[0], n.partition(":")[2] or args.steps) for n in args.names]
    bad = [n for n, st in picks if st not in ("window", "rows", "all", "space")]
    if bad:
        sys.exit(f"step_variants: steps of {', '.join(bad)}: expected :window, :rows, :space or :all")
    unknown = [n for n, _ in picks if not (SUITE / f"{n}.onnx").is_file()]
    if unknown:
        sys.exit(f"step_variants: no such workload in {SUITE.relative_to(ROOT)}: {', '.join(unknown)}")
    cp = None
    if not args.plan_only:
        from tunedb.runtime.device import import_cupy

        cp = import_cupy()
    t0 = time.monotonic()
    rows: list[dict] = []
    result = {"benchmark": "step_variants", **provenance(), "target_s": args.target_s,
              "complete": False, "rows": rows}
    # a SIGTERM (timeout) ends the run through the finally below: the workers go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"step_variants: terminated after {len(rows)} steps"))
    tmp = tempfile.mkdtemp(prefix="tunedb-variants-")
    pool = mp.get_context("spawn").Pool(max(1, args.workers))
    try:
        chunks = max(1, args.chunks)
        jobs = [(n, pool.apply_async(prepare, (n, st, tmp, (i, chunks if st == "space" else 1))))
                for n, st in picks for i in range(chunks if st == "space" else 1)]
        for name, job in jobs:
            left = args.limit - (time.monotonic() - t0) if args.limit else None
            try:
                steps = job.get(timeout=None if left is None else max(left, 0.01))
            except mp.TimeoutError:
                print(f"time limit {args.limit:g}s: {name} and after skipped", flush=True)
                break
            except Exception as e:  # noqa: BLE001 - a workload that does not plan is a result
                rows.append({"workload": name, "error": str(e).splitlines()[0][:300]})
                print(f"{name}: {rows[-1]['error']}", flush=True)
                continue
            for st in steps:
                try:
                    res = run_step(cp, st, args.target_s) if cp is not None else {
                        k: {"source_hash": p["source_hash"]} for k, p in st["variants"].items()}
                except Exception as e:  # noqa: BLE001 - a step that cannot run is a result
                    res = {"all": {"error": str(e).splitlines()[0][:300] if str(e) else type(e).__name__}}
                Path(st.pop("npz")).unlink(missing_ok=True)
                rows.append({k: v for k, v in st.items() if k not in ("graph", "variants")}
                            | {"variants": res})
                for label, r in res.items():
                    mark = "*" if label == st["chosen"] else " "
                    val = f"{r['us']:8.2f} us" if "us" in r else r.get("error", "not run")
                    print(f"{name} step {st['step']} {'+'.join(st['ops'])[:32]:32s} {mark}{label:14s} {val}",
                          flush=True)
            args.out.write_text(json.dumps(result, indent=1, default=str))
        else:
            result["complete"] = True
    finally:
        pool.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"done {len(rows)} steps, {result['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()

"""Buffer placement: how much the time of one compiled kernel moves with where its buffers lie.

    python benchmarks/placement.py BENCH_JSON OUT_DIR [--cases a,b] [--placements 6]
    (on a GPU; BENCH_JSON is a ``tunedb bench fusion`` result: each case's best schedule is
    taken from it; writes OUT_DIR/placement.json and prints a table)

For each case and placement p, both systems get freshly allocated inputs (copies of the case's
values) and outputs, after a pad allocation of a different size for each p (the first has none):
tunedb's best schedule, compiled once, through CuPy's pool; torch.compile's function, compiled
once, on torch tensors (its outputs come from torch's caching allocator). Each placement's output
is verified against the float64 reference before it is timed; L2 is filled with an unrelated
buffer before every timing; two rounds alternate the systems' order. The spread of one system
over placements is what a single-placement comparison of two systems cannot resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from tunedb.bench.provenance import provenance

MIB = 1 << 20


def pad_sizes(placements: int, seed: int = 0) -> list[int]:
    """Bytes of the pad allocated before placement p: 0 for the first, then distinct sizes of
    1-768 MiB plus an odd number of 4 KiB pages (so the buffers do not keep one alignment)."""
    import random

    rng = random.Random(seed)
    out = [0]
    while len(out) < placements:
        size = rng.randint(1, 768) * MIB + rng.randrange(1, 512, 2) * 4096
        if size not in out:
            out.append(size)
    return out[:placements]


def spread(us: list[float]) -> dict[str, float]:
    """min, median, max of per-placement times (µs) and (max - min) / min in %."""
    if not us:
        raise ValueError("no timings")
    lo, hi = min(us), max(us)
    return {"min": lo, "median": statistics.median(us), "max": hi, "spread_pct": 100.0 * (hi - lo) / lo}


def _verify(wl: Any, outs: dict[str, Any]) -> tuple[bool, float]:
    for name, buf in outs.items():
        wl.cp.copyto(wl.outputs[name], buf.reshape(wl.outputs[name].shape))
    ok, err, _ = wl.verify()
    return ok, err


def run_case(state: dict, torch: Any, case: Any, config: dict, placements: int, seed: int) -> dict:
    from tunedb.bench.fusion import plan_launch, scrub_l2
    from tunedb.bench.peers import _straight_line, throughput_us, torch_function
    from tunedb.kernels.codegen import generate
    from tunedb.kernels.schedule import Schedule
    from tunedb.records import sha256_hex
    from tunedb.runtime.cuda import plan_to_wire
    from tunedb.runtime.measure import WorkloadBuffers

    cp, stream, g = state["cp"], state["stream"], case.graph
    wl = WorkloadBuffers(cp, g, sha256_hex(case.name))
    wire = plan_to_wire(generate(g, Schedule.from_config(config)))
    traced = None
    rows = []
    for p, pad in enumerate(pad_sizes(placements, seed)):
        cpad = cp.empty(max(pad, 1), dtype=cp.uint8)
        ins = {n: wl.inputs[n].copy() for n in g.inputs}
        outs = {n: cp.empty_like(wl.outputs[n]) for n in g.outputs}
        launch, _ = plan_launch(state, wire, {**ins, **outs})  # compiled once, then fetched
        launch()
        stream.synchronize()
        ok_t, err_t = _verify(wl, outs)
        tpad = torch.empty(max(pad, 1), dtype=torch.uint8, device="cuda")
        tins = [torch.as_tensor(wl.inputs[n], device="cuda").clone() for n in g.inputs]
        if traced is None:  # traced and compiled once; later placements reuse the kernels
            traced = torch.compile(_straight_line(torch, torch_function(g, "cuda"), tins), dynamic=False)
        res = traced(*tins)
        torch.cuda.synchronize()
        ok_c, err_c = _verify(wl, {n: cp.asarray(r.contiguous()) for n, r in zip(g.outputs, res)})
        ptrs = {"tunedb": [int(ins[g.inputs[0]].data.ptr), int(outs[g.outputs[0]].data.ptr)],
                "torch_compile": [int(tins[0].data_ptr()), int(res[0].data_ptr())]}
        del res
        arms = {"tunedb": (launch, stream.synchronize, ok_t, err_t),
                "torch_compile": ((lambda f=traced, xs=tins: f(*xs)), torch.cuda.synchronize, ok_c, err_c)}
        times: dict[str, list[float]] = {k: [] for k in arms}
        for order in (("tunedb", "torch_compile"), ("torch_compile", "tunedb")):
            for k in order:
                run, sync, ok, _ = arms[k]
                if ok:
                    scrub_l2(state)
                    stream.synchronize()  # the peer times on its own stream
                    times[k].append(throughput_us(run, sync, target_s=0.08))
        for k, (_, _, ok, err) in arms.items():
            rows.append({"placement": p, "pad_bytes": pad, "system": k, "verified": bool(ok),
                         "max_abs_err": float(err), "us": min(times[k]) if times[k] else None,
                         "rounds_us": times[k], "in_ptr": hex(ptrs[k][0]), "out_ptr": hex(ptrs[k][1])})
        del cpad, ins, outs, launch, tpad, tins, arms
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    wl.free()
    summary = {}
    for k in ("tunedb", "torch_compile"):
        us = [r["us"] for r in rows if r["system"] == k and r["us"] is not None]
        summary[k] = spread(us) if us else None  # None: no placement verified
    return {"case": case.name, "config": config, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/placement.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="a `tunedb bench fusion` result (each case's best schedule)")
    ap.add_argument("out_dir", help="folder for placement.json")
    ap.add_argument("--cases", default="rmsnorm_8192x4096,transpose_add_8192x4096,bias_gelu_8192x4096",
                    help="comma-separated anchor cases")
    ap.add_argument("--placements", type=int, default=6, help="buffer placements per case (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the pad sizes")
    a = ap.parse_args(argv)
    if a.placements < 2:
        ap.error("--placements must be at least 2")
    from tunedb.kernels.suites import suite

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        with open(a.bench_json) as f:
            bench = json.load(f)
        configs = {c["case"]: (c.get("tunedb") or {}).get("config") for c in bench["cases"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"{type(e).__name__}: {e}"
        return fail(f"{a.bench_json} is not a readable `tunedb bench fusion` result ({why})")
    cases = {c.name: c for c in suite("anchors")}
    wanted = [c for c in a.cases.split(",") if c]
    unknown = [c for c in wanted if c not in cases]
    if unknown:
        return fail(f"not an anchor case: {', '.join(unknown)} (anchors: {', '.join(cases)})")
    missing = [c for c in wanted if not configs.get(c)]
    if missing:
        return fail(f"no tunedb schedule for {', '.join(missing)} in {a.bench_json}")
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        from tunedb.runtime.measure import gpu_init

        state: dict = {}
        gpu_init(state)
    except Exception as e:  # noqa: BLE001 - no GPU, no torch, no CuPy: one line, nothing written
        return fail(f"this study needs a CUDA GPU with CuPy and torch: {type(e).__name__}: {e}")
    result = {"benchmark": "placement", **provenance(), "bench_json": os.path.basename(a.bench_json),
              "placements": a.placements, "seed": a.seed, "cases": []}
    print(f"{'case':26s} {'system':14s} {'min':>7s} {'median':>7s} {'max':>7s} {'spread':>7s}")
    for name in wanted:
        rec = run_case(state, torch, cases[name], configs[name], a.placements, a.seed)
        result["cases"].append(rec)
        for k, s in rec["summary"].items():
            if s is None:
                print(f"{name:26s} {k:14s} no verified placement", flush=True)
                continue
            print(f"{name:26s} {k:14s} {s['min']:7.2f} {s['median']:7.2f} {s['max']:7.2f} "
                  f"{s['spread_pct']:6.2f}%", flush=True)
        os.makedirs(a.out_dir, exist_ok=True)
        with open(os.path.join(a.out_dir, "placement.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

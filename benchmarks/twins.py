"""A/B of a boolean schedule knob: each anchor's best schedules with the knob off and on.

    python benchmarks/twins.py OUT_DIR BENCH_JSON [KNOB]     (on a GPU; writes twins_KNOB.json)

BENCH_JSON is a ``tunedb bench fusion`` result: its finalists (up to two distinct schedules per
case, with the knob off) are the schedules compared. Each twin is verified against the float64
reference, then timed in interleaved rounds (off, on, off, on, ...) under both protocols of the
bench: the search's quick samples and the finalists' throughput mode, so board drift between the
two arms cancels. L2 is filled with an unrelated buffer before every timing (``scrub_l2``):
without it, a streaming twin timed right after its plain twin found its own rows in L2 and
measured up to 3 % faster than it is. KNOB defaults to ``stream``.

Measured on an H200 (data/bench/twins_stream_h200.json, the 12 anchors): the best evict-first
twin is 1.1-9.6 % slower than the best plain schedule on 9 anchors (re-read rows up to 25 %),
equal on the 128-wide softmax and 2.8 % faster on softmax_xent (4-byte outputs per 16 KB row).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields, replace
from typing import Any

from tunedb.bench.provenance import provenance
from tunedb.kernels.schedule import Schedule

ROUNDS = 3
PER_CASE = 2


def twin_jobs(bench: dict, knob: str = "stream", per_case: int = PER_CASE) -> list[tuple[str, Schedule]]:
    """(case, schedule) pairs to time: per case the ``per_case`` fastest distinct finalists with
    the knob off, each followed by its twin with the knob on (where the twin is legal is left to
    the caller's check)."""
    known = {f.name for f in fields(Schedule)}
    if knob not in known or not isinstance(getattr(Schedule("elementwise"), knob), bool):
        raise ValueError(f"{knob!r} is not a boolean schedule knob")
    jobs: list[tuple[str, Schedule]] = []
    for case in bench.get("cases", []):
        fins = sorted((f for f in (case.get("tunedb") or {}).get("finalists", []) if f.get("us")),
                      key=lambda f: f["us"])
        seen: list[Schedule] = []
        for f in fins:
            s = replace(Schedule.from_config(f["config"]), **{knob: False})
            if s in seen:
                continue
            seen.append(s)
            jobs += [(case["case"], s), (case["case"], replace(s, **{knob: True}))]
            if len(seen) == per_case:
                break
    return jobs


def run(out_dir: str, bench_path: str, knob: str = "stream") -> list[dict[str, Any]]:
    import numpy as np

    from tunedb.bench.fusion import QUICK_PROTOCOL, scrub_l2, verified_launch
    from tunedb.bench.host import spawn_pool
    from tunedb.bench.peers import throughput_us
    from tunedb.kernels.analysis import analyze
    from tunedb.kernels.codegen import generate
    from tunedb.kernels.schedule import check
    from tunedb.kernels.suites import suite
    from tunedb.records import Protocol, sha256_hex
    from tunedb.runtime.cuda import plan_to_wire
    from tunedb.runtime.measure import WorkloadBuffers, gpu_init, precompile, time_plan

    cases = {c.name: c for c in suite("anchors")}
    jobs = [(c, s) for c, s in twin_jobs(json.load(open(bench_path)), knob)
            if c in cases and not check(analyze(cases[c].graph), s)]
    wires = [plan_to_wire(generate(cases[c].graph, s)) for c, s in jobs]
    pool = spawn_pool(max(1, (os.cpu_count() or 2) - 2))
    if pool is not None:
        list(pool.map(precompile, [w["kernels"] for w in wires]))
        pool.shutdown()
    state: dict = {}
    gpu_init(state)
    stream = state["stream"]
    results: list[dict[str, Any]] = []
    for name in dict.fromkeys(c for c, _ in jobs):
        wl = WorkloadBuffers(state["cp"], cases[name].graph, sha256_hex(name))
        runs = []
        for (c, s), w in zip(jobs, wires):
            if c != name:
                continue
            r: dict[str, Any] = {"case": name, "schedule": s.label(), knob: getattr(s, knob),
                                 "quick_us": [], "throughput_us": []}
            results.append(r)
            try:
                launch, r["registers"], ok, err, out = verified_launch(state, w, wl)
            except Exception as e:  # noqa: BLE001 - a failing twin is a result, not a crash
                r["error"] = " ".join(str(e).split())[:300]
                continue
            r["verified"] = bool(ok)
            if ok:
                runs.append((r, launch))
            else:
                r["error"] = f"max abs error {err:.3g} in {out}"
        for _ in range(ROUNDS):
            for r, launch in runs:
                scrub_l2(state)
                quick, _ = time_plan(state, launch, Protocol(**QUICK_PROTOCOL))
                r["quick_us"].append(float(np.median(quick)))
                scrub_l2(state)
                r["throughput_us"].append(throughput_us(launch, stream.synchronize, target_s=0.08))
        for r, _ in runs:
            print(f"{name:30s} {r['schedule']:62s} quick {min(r['quick_us']):7.2f} "
                  f"throughput {min(r['throughput_us']):7.2f}", flush=True)
        wl.free()
        with open(os.path.join(out_dir, f"twins_{knob}.json"), "w") as fh:
            json.dump({**provenance(), "knob": knob, "bench": os.path.basename(bench_path), "rounds": ROUNDS,
                       "quick_protocol": QUICK_PROTOCOL, "results": results}, fh, indent=1)
    return results


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python benchmarks/twins.py OUT_DIR BENCH_JSON [KNOB]")
    run(*sys.argv[1:])

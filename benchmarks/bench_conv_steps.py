"""Every step of a whole-model plan timed alone, beside the whole plan, on the local GPU: where a
plan's time goes, and (run once per source tree) which steps changed between two commits.

    python benchmarks/bench_conv_steps.py OUT.json MODEL.onnx [MODEL.onnx ...] [--lock FILE]
    python benchmarks/bench_conv_steps.py OUT.json MODEL.onnx --plan-only   # CPU: steps, paths

The plan is compiled as the zoo compiles it (no database, no cost model), verified against the
float64 reference, then timed: the whole plan by replays of its CUDA graph (the zoo table's
protocol, ``throughput_us``) and each step alone by a CUDA graph of ``--reps`` back-to-back
repetitions of its launches on the plan's own buffers (median of 5 replays, µs per step). A
step's inputs stay in L2 where they fit, so steps are comparable with each other's earlier
timings, not a split of the whole. With ``--lock`` every timing holds that file's lock, so
several processes (one per source tree) may compile at once and time one at a time. Only the
executor's public attributes and its ``_build`` / ``_launch_fns`` are used, so the script runs
against older trees put first on ``PYTHONPATH``; the record names the tree it imported.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def gpu_lock(path: Path | None) -> Iterator[None]:
    """The GPU alone while timing (no-op without a lock file)."""
    if path is None:
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it (no machine paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def step_source_digest(step: Any, sm_count: int) -> str:
    """sha256 (10 hex) of a generated step's kernel sources: which steps two trees build alike."""
    from tunedb.kernels.codegen import generate
    from tunedb.kernels.schedule import Schedule

    try:
        kp = generate(step.graph, Schedule.from_config(step.config_dict), sm_count=sm_count)
    except Exception as e:  # noqa: BLE001 - the executor then runs it op by op
        return f"error: {str(e)[:60]}"
    return hashlib.sha256("\n".join(k.source for k in kp.kernels).encode()).hexdigest()[:10]


def plan_steps(plan: Any, sm_count: int = 132) -> list[dict]:
    """Each step's kind, ops, first input's type, executor path and (generated) source digest."""
    from tunedb.runtime.executor import step_path

    rows = []
    for k, s in enumerate(plan.steps):
        path = step_path(s)
        rows.append({"k": k, "ops": "+".join(s.ops), "path": path,
                     "x": str(s.graph.type_of(s.graph.inputs[0])) if s.graph.inputs else "",
                     "src": step_source_digest(s, sm_count) if path == "generated" else ""})
    return rows


def _graph_us(cp: Any, stream: Any, fns: list, reps: int) -> float:
    """µs per repetition: a CUDA graph of ``reps`` runs of ``fns`` on ``stream``, median of 5."""
    pool = cp.cuda.MemoryPool()
    gc.disable()  # a finalizer freeing device memory would break the capture
    try:
        with stream, cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                for _ in range(reps):
                    for fn in fns:
                        fn()
            finally:
                graph = stream.end_capture()
    finally:
        gc.enable()
    graph.launch(stream)
    stream.synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(5):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps)
    return statistics.median(times)


def time_model(model: Path, reps: int, target_s: float, lock: Path | None,
               variants: bool = False) -> dict:
    """The plan of ``model``: verified, whole-plan µs, and µs of every step alone (``variants``:
    and of each window step's other kernels)."""
    import cupy as cp

    from tunedb.bench.peers import throughput_us
    from tunedb.bench.plan import INPUT_SEED, collect_entries, load_entry, verify
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.tolerance import reference_and_exp_span

    class StepExecutor(PlanExecutor):
        def _build(self, k: int, step: Any) -> None:  # records which launches each step adds
            ranges = self.__dict__.setdefault("step_ranges", [])
            n0 = len(self._launch_fns)
            super()._build(k, step)
            ranges.append((n0, len(self._launch_fns)))

    rec: dict[str, Any] = {"model": model.name}
    graph, _ = load_entry(collect_entries([model])[0])
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    t0 = time.perf_counter()
    plan = compile_plan(graph, device="cuda")
    ex = StepExecutor(plan)
    rec["compile_s"] = round(time.perf_counter() - t0, 1)
    rec.update(launches=ex.launches, graph_capture=ex.graph_capture, fallbacks=ex.fallbacks)
    got = {k: cp.asnumpy(v) for k, v in ex.run(dev).items()}
    rec["verify"] = verify(graph, got, refs, exp_span=span)
    steps = plan_steps(plan, ex.sm_count)
    for row, path, (a, b) in zip(steps, ex.paths, ex.step_ranges):
        row.update(exec_path=path, launches=b - a)
    if not rec["verify"]["ok"]:
        rec["steps"] = steps
        return rec
    with gpu_lock(lock):
        rec["whole_us"] = throughput_us(ex.replay, ex.synchronize, target_s=target_s)
        for row, (a, b) in zip(steps, ex.step_ranges):
            if b > a:
                try:
                    row["us"] = round(_graph_us(cp, ex.stream, ex._launch_fns[a:b], reps), 2)
                except Exception as e:  # noqa: BLE001 - a step that does not capture alone
                    row["error"] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        rec["whole_again_us"] = throughput_us(ex.replay, ex.synchronize, target_s=target_s)
    rec["steps_sum_us"] = round(sum(r.get("us", 0.0) for r in steps), 1)
    rec["steps"] = steps
    if variants:
        for row, step, (a, b) in zip(steps, plan.steps, ex.step_ranges):
            if row["path"] == "generated":
                row.update(window_variants(cp, ex, step, ex._launch_fns[a:b], reps, lock))
    return rec


def _floats(cp: Any, a: Any, dtype: str) -> Any:
    """Stored values as float32 (bfloat16 bits widened)."""
    if dtype == "bfloat16":
        return (a.astype(cp.uint32) << 16).view(cp.float32)
    return a.astype(cp.float32)


def window_variants(cp: Any, ex: Any, step: Any, planned: list, reps: int, lock: Path | None) -> dict:
    """A window step's other kernels (``benchmarks/step_variants.py``'s strips of 1/2/4, the row
    branch, planes), each on the step's own buffers, checked against the planned kernel's
    outputs (float32 rtol 1e-3, bfloat16 1.6e-2), then timed like the steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_variants import _window_variants

    from tunedb.kernels.gen_window import has_window_op
    from tunedb.runtime.launch import kernel_function, launcher

    sub = step.graph
    if not has_window_op(sub):
        return {}
    try:
        kps, chosen = _window_variants(sub)
    except Exception as e:  # noqa: BLE001 - no variants: a result
        return {"variants_error": str(e)[:120]}
    named = {**{s: ex.env[v] for s, v in zip(sub.inputs, step.inputs)},
             **{s: ex.env[v] for s, v in zip(sub.outputs, step.outputs)}}
    dtypes = {s: sub.type_of(s).dtype for s in sub.outputs}
    for fn in planned:
        fn()
    ex.stream.synchronize()
    want = {s: _floats(cp, named[s], dtypes[s]).copy() for s in sub.outputs}
    modules: dict = {}
    out: dict[str, Any] = {}
    runs = {}
    for label, kp in kps.items():
        try:
            funcs = [kernel_function(cp, modules, k) for k in kp.kernels]
            runs[label] = launcher(funcs, kp.kernels, named, (), ex.stream)
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": str(e).splitlines()[0][:120]}
    with gpu_lock(lock):
        for label, run in runs.items():
            r: dict[str, Any] = {}
            try:
                for s in sub.outputs:
                    named[s].fill(0)
                run()
                ex.stream.synchronize()
                rtol, atol = (1.6e-2, 1e-3) if "bfloat16" in dtypes.values() else (1e-3, 1e-5)
                bad = [s for s in sub.outputs if not bool(cp.allclose(
                    _floats(cp, named[s], dtypes[s]), want[s], rtol=rtol, atol=atol))]
                if bad:
                    r["error"] = f"differs from the planned kernel on {bad[0]}"
                else:
                    r["us"] = round(_graph_us(cp, ex.stream, [run], reps), 2)
            except Exception as e:  # noqa: BLE001
                r["error"] = str(e).splitlines()[0][:120]
            out[label] = r
        for fn in planned:  # the planned outputs back in place
            fn()
        ex.stream.synchronize()
    return {"chosen": chosen, "variants": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("models", type=Path, nargs="+")
    p.add_argument("--plan-only", action="store_true", help="steps and paths from the plan, no GPU")
    p.add_argument("--reps", type=int, default=20, help="repetitions of a step per captured graph")
    p.add_argument("--target-s", type=float, default=0.05)
    p.add_argument("--variants", action="store_true",
                   help="also each window step's other kernels (benchmarks/step_variants.py)")
    p.add_argument("--lock", type=Path, default=None, help="hold this file's lock while timing")
    args = p.parse_args(argv)
    for m in args.models:
        if not m.is_file():
            print(f"error: {m} is not a file", file=sys.stderr)
            return 2
    import tunedb
    from tunedb.bench.provenance import provenance

    result: dict[str, Any] = {"benchmark": "conv_steps", **provenance(), "reps": args.reps,
                              "tunedb": _shown(Path(tunedb.__file__).parent), "models": []}
    for m in args.models:
        try:
            if args.plan_only:
                from tunedb.bench.plan import collect_entries, load_entry
                from tunedb.plan.driver import compile as compile_plan

                graph, _ = load_entry(collect_entries([m])[0])
                rec = {"model": m.name, "steps": plan_steps(compile_plan(graph, device="generic"))}
            else:
                rec = time_model(m, args.reps, args.target_s, args.lock, args.variants)
        except Exception as e:  # noqa: BLE001 - a failing model is a result
            rec = {"model": m.name, "error": str(e).splitlines()[0][:300] if str(e) else type(e).__name__}
        result["models"].append(rec)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"{m.name}: whole {rec.get('whole_us', '-')} µs, steps {rec.get('steps_sum_us', '-')} µs, "
              f"verify {rec.get('verify', {}).get('ok', '-')}, {rec.get('error', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

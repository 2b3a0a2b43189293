"""Whole-plan times of zoo models on the local GPU next to torch eager, torch.compile,
torch.compile reduce-overhead and jax.jit (``tunedb.bench.plan.run_entry``: the plan verified
against the float64 reference and onnxruntime, the peers translated from the same graph, same
inputs).

    python benchmarks/bench_zoo_plan.py OUT.json [--time-limit S] [--workers N] MODEL.onnx ...
    python benchmarks/bench_zoo_plan.py OUT.json --plan-only --workers N MODEL.onnx ...  # CPU

With ``--workers 1`` the models run one after another (``run_bench``). With N > 1 they run in N
processes at once: importing, the float64 reference, planning, building executors and the peers'
compilations (TorchInductor, XLA) overlap on the host's cores, while every timing holds one lock,
so no two timings share the GPU. Each worker keeps TorchInductor to one compile thread, which
leaves cores free for the process that is timing (eager and torch.compile default are launch
bound at batch 1 and would slow down on a crowded host). A model that has not finished when
``--time-limit`` runs out is recorded as not finished, with the phases it had reached.
``--plan-only`` imports and plans on the CPU (no GPU, no peers): the kernel counts alone.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunedb.bench.fusion import _one_line, write_json
from tunedb.bench.plan import (
    INPUTS,
    PEERS,
    PROTOCOL,
    Entry,
    collect_entries,
    load_entry,
    op_by_op_count,
    run_bench,
    run_entry,
    summarize,
    summary_lines,
)
from tunedb.bench.provenance import provenance


@contextmanager
def gpu_lock(path: Path) -> Iterator[None]:
    """Hold the GPU alone while timing: an exclusive ``flock`` on ``path``, shared by every
    process that names the same file (the workers here, ``bench_torch_backend.py`` beside)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def locked_timer(lock_path: Path, target_s: float) -> Callable[..., float]:
    """``throughput_us`` under ``gpu_lock``, ``target_s`` seconds per timed batch."""
    from tunedb.bench.peers import throughput_us

    def timer(run: Callable[[], Any], sync: Callable[[], None]) -> float:
        with gpu_lock(lock_path):
            return throughput_us(run, sync, target_s=target_s)
    return timer


def _plan_only(entry: Entry) -> dict:
    """Import and plan on the CPU: the graph's op-by-op count and the plan's kernels."""
    from tunedb.plan.driver import compile as compile_plan

    rec: dict[str, Any] = {"name": entry.name, "source": entry.source, "batch": entry.batch}
    t0 = time.perf_counter()
    try:
        graph, _ = load_entry(entry)
        plan = compile_plan(graph)
    except Exception as e:  # noqa: BLE001 - a failing model is a result
        rec["error"] = _one_line(e)
        return rec
    rec["graph"] = {"nodes": len(graph.nodes), "op_by_op": op_by_op_count(graph)}
    rec["plan"] = {"kernels": plan.kernels, "by_kind": plan.totals()["by_kind"],
                   "plan_s": round(time.perf_counter() - t0, 2)}
    return rec


def _worker(entries: list[Entry], todo: Any, done: Any, lock: Path, peers: tuple[str, ...],
            target_s: float, plan_only: bool) -> None:
    # One Inductor compile thread per worker: N workers, not N x cores, compete for the host.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    fw = None
    if not plan_only:
        from tunedb.bench.peers import Frameworks

        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        fw = Frameworks() if peers else None
        if fw is not None and fw.torch is not None:
            fw.torch.backends.cuda.matmul.allow_tf32 = False
            fw.torch.backends.cudnn.allow_tf32 = False
        if fw is not None and fw.jax is not None:
            fw.jax.config.update("jax_default_matmul_precision", "highest")
    timer = locked_timer(lock, target_s)
    while True:
        try:
            i = todo.get_nowait()
        except queue.Empty:
            return
        done.put((i, "started", None))
        t0 = time.monotonic()
        if plan_only:
            rec = _plan_only(entries[i])
        else:
            try:
                rec = run_entry(entries[i], fw, peers, None, None,
                                lambda s, i=i: done.put((i, "progress", s)), timer=timer)
            except Exception as e:  # noqa: BLE001 - one broken graph must not end the worker
                rec = {"name": entries[i].name, "source": entries[i].source,
                       "error": f"failed: {_one_line(e)}", "tunedb": {"us": None}, "peers": {}}
        rec["elapsed_s"] = round(time.monotonic() - t0, 1)
        done.put((i, "done", rec))


def run_parallel(entries: list[Entry], out: Path | None, workers: int, peers: tuple[str, ...],
                 time_limit_s: float, lock: Path, target_s: float = 0.1, plan_only: bool = False,
                 say: Callable[[str], None] = print) -> dict:
    """Every entry in ``workers`` processes (module docstring); the result dict of
    ``run_bench``'s shape, written to ``out`` after each finished entry."""
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "plan", "protocol": PROTOCOL + f"; {workers} worker processes, timings "
        f"one at a time (a lock), {target_s:g} s per timed batch", "inputs": INPUTS,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "peers": [] if plan_only else list(peers), "workers": workers, "plan_only": plan_only,
        "entries": [], "complete": False, "stopped": "", "notes": [], **provenance()}
    if not plan_only:
        from dataclasses import asdict

        from tunedb.bench.fusion import _versions
        from tunedb.runtime.device import clocks, device_info

        info = device_info()
        result.update(device={"id": info.id, **asdict(info)}, env=_versions(),
                      clocks_before=clocks(), tf32={"cupy": False, "torch": False, "jax": "highest"})
        say(f"device {info.name} ({info.sm_count} SMs), driver {info.driver}, CUDA {info.cuda_runtime}")
    ctx = mp.get_context("spawn")  # CUDA contexts do not survive fork
    todo, done = ctx.Queue(), ctx.Queue()
    for i in range(len(entries)):
        todo.put(i)
    procs = [ctx.Process(target=_worker, args=(entries, todo, done, lock, peers, target_s, plan_only),
                         daemon=True) for _ in range(max(1, min(workers, len(entries))))]
    for p in procs:
        p.start()
    recs: dict[int, dict] = {}
    phase: dict[int, str] = {}

    def save() -> None:
        result["entries"] = [recs[i] for i in sorted(recs)]
        result.update(summary=summarize(result), elapsed_s=round(time.monotonic() - t0, 1))
        if out is not None:
            write_json(result, out)

    while len(recs) < len(entries):
        left = time_limit_s - (time.monotonic() - t0) if time_limit_s > 0 else 5.0
        if left <= 0:
            break
        try:
            i, what, payload = done.get(timeout=min(left, 5.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        if what == "done":
            recs[i] = payload
            tb = (payload.get("tunedb") or {}).get("us")
            say(f"[{len(recs)}/{len(entries)}] {payload['name']}: "
                + (f"tunedb {tb:.1f} us" if tb else f"kernels {(payload.get('plan') or {}).get('kernels')}")
                + f" ({payload.get('elapsed_s')} s)")
            save()
        else:
            phase[i] = payload or what
            if what == "progress":
                say(payload)
    missing = [i for i in range(len(entries)) if i not in recs]
    for i in missing:
        e = entries[i]
        why = (f"not finished in the {time_limit_s:g} s time limit" if i in phase
               else f"not started in the {time_limit_s:g} s time limit")
        recs[i] = {"name": e.name, "source": e.source, "batch": e.batch, "error": why,
                   "reached": phase.get(i, ""), "tunedb": {"us": None, "error": why}, "peers": {}}
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
    result["complete"] = not missing
    if missing:
        result["stopped"] = f"time limit {time_limit_s:g}s: {len(missing)} graph(s) not finished"
    if not plan_only:
        from tunedb.runtime.device import clocks

        result["clocks_after"] = clocks()
    save()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="with --workers 1: no new model starts after S s; else: stop at S s")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--target-s", type=float, default=0.1,
                   help="seconds per timed batch (5 batches, the median) with --workers > 1")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--plan-only", action="store_true", help="import and plan on the CPU only")
    p.add_argument("--gpu-lock", type=Path, default=Path(tempfile.gettempdir()) / "tunedb-gpu.lock",
                   help="lock file every timing process holds while it times")
    a = p.parse_args(argv)
    peers = tuple(x for x in a.peers.split(",") if x)
    bad = [x for x in peers if x not in PEERS]
    if bad:
        print(f"error: unknown peer(s) {', '.join(bad)}; expected some of {', '.join(PEERS)}",
              file=sys.stderr)
        return 2
    entries = collect_entries(a.models, anchors=False)
    if a.workers > 1 or a.plan_only:
        result = run_parallel(entries, a.out, a.workers, peers, a.time_limit, a.gpu_lock, a.target_s,
                              a.plan_only, say=lambda s: print(s, flush=True))
    else:
        result = run_bench(entries, a.out, peers=peers, time_limit_s=a.time_limit,
                           progress=lambda s: print(s, flush=True))
    for line in summary_lines(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

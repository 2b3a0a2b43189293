"""``tunedb bench fusion``: tunedb's fused kernels next to torch eager, torch.compile and JAX/XLA.

Per case (the 12 ANCHORS.md cases by default), in one process on one GPU: (1) tunedb's
candidates: the top-K measured ones of the workload on this device from the tuning database,
else every legal schedule of ``schedule_space`` (generated and compiled ahead in a process pool,
verified, ranked by a quick CUDA-event timing, the best K kept); (2) each finalist verified on
random inputs against the float64 reference (the collector's check) and timed in throughput
mode (``peers.throughput_us``: back-to-back launches, wall clock around them with a sync, median
of 5 batches after 3 warm-ups), the best reported; (3) the peers on the same input values:
torch eager, torch.compile (dynamic=False), jax.jit, each checked against the reference
(relative L2 error) and timed the same way; (4) the floor: fewest bytes (each input read once,
each output written once) / the copy bandwidth (1 GiB device-to-device copy, read + write).
A failing peer is recorded as null with its error; the JSON is rewritten after every case.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.host import HostPrep, spawn_pool, submit_or_none
from tunedb.bench.peers import Frameworks, copy_tbps, outputs_float64, peer_call, throughput_us
from tunedb.bench.provenance import provenance
from tunedb.graph.ir import Graph
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import Schedule, schedule_space
from tunedb.records import Protocol, Workload
from tunedb.runtime.cuda import plan_to_wire
from tunedb.runtime.device import clocks, import_cupy
from tunedb.runtime.inputs import bf16_to_f32, storage_dtype
from tunedb.runtime.measure import (
    WorkloadBuffers,
    build_launch,
    context_ok,
    get_function,
    gpu_init,
    precompile,
    time_plan,
)
from tunedb.store import TuningStore

PEERS = ("torch_eager", "torch_compile", "jax")
SYSTEMS = ("tunedb",) + PEERS
COPY_BYTES = 1 << 30
PROTOCOL = ("throughput: back-to-back iterations, synchronize, wall time / iterations, "
            "median of 5 batches after 3 warm-ups; L2 filled with an unrelated buffer before "
            "every system is timed")


class BenchError(ValueError):
    """A benchmark cannot start (unknown suite, missing database...); one-line message."""


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:limit]


def _finite(x: Any) -> float | None:
    """JSON has no NaN/inf: non-finite numbers (and non-numbers) are stored as null."""
    v = float(x) if isinstance(x, (int, float, np.floating, np.integer)) else math.nan
    return v if math.isfinite(v) else None


# -- CPU-side pieces ------------------------------------------------------------------------------
def floor_us(nbytes: int, copy_tbps: float) -> float:
    """Time to move ``nbytes`` at the measured copy bandwidth (TB/s counting read + write)."""
    if copy_tbps <= 0:
        raise ValueError(f"copy bandwidth must be positive, got {copy_tbps}")
    return nbytes / (copy_tbps * 1e12) * 1e6


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64 (absolute norm when the reference is all zeros)."""
    o = np.asarray(out, dtype=np.float64).reshape(-1)
    r = np.asarray(ref, dtype=np.float64).reshape(-1)
    if o.shape != r.shape:
        raise ValueError(f"output has {o.size} elements, reference {r.size}")
    num = float(np.linalg.norm(o - r))
    den = float(np.linalg.norm(r))
    return num / den if den > 0 else num


def geomean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def time_of(case: dict, system: str) -> float | None:
    entry = case.get(system) if system == "tunedb" else case.get("peers", {}).get(system)
    return _finite(entry.get("us")) if isinstance(entry, dict) else None


def summarize(result: dict) -> dict:
    """Geomeans over the finished cases: fraction of the floor per system (floor / time), and
    tunedb's speedup over torch.compile and JAX (over cases where both have a time)."""
    cases = [c for c in result.get("cases", []) if _finite(c.get("floor_us"))]
    out: dict[str, Any] = {"cases": len(result.get("cases", [])), "fraction_of_floor": {}, "timed": {}}
    for s in SYSTEMS:
        fr = [c["floor_us"] / t for c in cases if (t := time_of(c, s))]
        out["fraction_of_floor"][s] = _finite(geomean(fr))
        out["timed"][s] = len(fr)
    for peer, key in (("torch_compile", "vs_torch_compile"), ("jax", "vs_jax"),
                      ("torch_eager", "vs_torch_eager")):
        sp = [p / t for c in result.get("cases", [])
              if (t := time_of(c, "tunedb")) and (p := time_of(c, peer))]
        out[f"speedup_{key}"] = _finite(geomean(sp))
        out[f"min_speedup_{key}"] = _finite(min(sp)) if sp else None
    out["slower_than_torch_compile"] = [
        c["case"] for c in result.get("cases", [])
        if (t := time_of(c, "tunedb")) and (p := time_of(c, "torch_compile")) and t > p]
    return out


def write_json(result: dict, path: Path) -> None:
    """Write atomically (a kill mid-write never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False))
    os.replace(tmp, path)


def db_candidates(db: Path, device: Any, hashes: list[str], k: int) -> dict[str, list[dict]]:
    """Top-``k`` measured candidate configs per workload hash on this device, or on stored
    boards of the same model (best first); ``device``: a DeviceInfo."""
    out: dict[str, list[dict]] = {}
    with TuningStore.open(db, read_only=True) as store:
        ids = store.same_model_ids(device)
        for h in hashes:
            rows = store.top_k(h, ids, k)
            out[h] = [{"config": c.config_dict, "db_source_hash": c.source_hash, "db_us": t,
                       "source": "db"} for c, t in rows if c.kind == "fusion"]
    return out


def prepare(graph_json: dict, config: dict, sm_count: int, compile_now: bool = True) -> dict:
    """Pool task: generate the plan of one schedule and compile it (fills CuPy's disk cache, so
    the in-process compile is a hit). Never raises: ``{"wire", "label", "source_hash"}`` or
    ``{"error"}``."""
    label, what = "?", "bad config"
    try:
        s = Schedule.from_config(config)
        label, what = s.label(), "codegen"
        plan = generate(Graph.from_json(graph_json), s, sm_count=sm_count)
        wire = plan_to_wire(plan)
    except Exception as e:  # noqa: BLE001
        return {"label": label, "error": f"{what}: {_one_line(e)}", "status": "compile_error"}
    zeroed = getattr(plan, "zeroed", None)
    if zeroed is not None:  # only these scratch buffers need a memset before each launch
        for sc in wire["scratch"]:
            sc["zero"] = sc["name"] in set(zeroed)
    res = {"label": label, "wire": wire, "source_hash": plan.source_hash}
    if compile_now:
        done = precompile(wire["kernels"])
        if not done.get("ok"):
            res.update(error=str(done.get("error", "compile error")), status="compile_error")
    return res


# -- GPU side -------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    import importlib

    out = {"python": platform.python_version()}
    for mod in ("tunedb", "numpy", "cupy", "torch", "jax", "jaxlib"):
        try:
            out[mod] = str(importlib.import_module(mod).__version__)
        except Exception as e:  # noqa: BLE001
            out[mod] = "missing: " + _one_line(e, 120)
    return out


def _check(outs: list[np.ndarray], graph: Graph, refs: dict[str, np.ndarray]) -> float | None:
    if len(outs) != len(graph.outputs):
        raise ValueError(f"{len(outs)} outputs, graph has {len(graph.outputs)}")
    return _finite(max(rel_l2(o, refs[n]) for o, n in zip(outs, graph.outputs)))


def _peer(fw: Any, kind: str, graph: Graph, dev: dict[str, np.ndarray], refs: dict[str, np.ndarray],
          scrub: Callable[[], None] | None = None) -> dict:
    """One peer on the case's input values: ``{"us", "rel_err", "error"}``; never raises.
    ``scrub`` runs (and finishes) just before the timing, as before tunedb's plans."""
    res: dict[str, Any] = {"us": None, "rel_err": None, "error": None}
    try:
        run, sync = peer_call(fw, kind, graph, dev)
        outs = run()
        sync()
        res["rel_err"] = _check(outputs_float64(outs), graph, refs)
        del outs
        if scrub is not None:
            scrub()
        res["us"] = _finite(throughput_us(run, sync))
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
        res.update(us=None, error=_one_line(e))
    return res


class ContextLost(RuntimeError):
    """A kernel left a sticky CUDA error (illegal address...): nothing more can run here."""


# The search ranks candidates by samples of 4 back-to-back launches (a CUDA graph), the way the
# finalists' throughput mode runs them: the L2 write-back one launch leaves behind then slows the
# next one inside the sample, as it does back to back.
QUICK_PROTOCOL = {"warmup": 2, "samples": 5, "flush_l2": False, "batch": 4}


def plan_launch(state: dict, wire: dict, buffers: dict[str, Any]) -> tuple[Callable[[], None], int]:
    """Compile (or fetch) a wire plan's kernels and bind them to ``buffers`` (inputs and outputs
    by name) and fresh scratch: (launch, registers)."""
    cp = state["cp"]
    funcs = [get_function(state, k) for k in wire["kernels"]]
    scratch = {s["name"]: cp.empty(max(1, int(s["nbytes"])), dtype=cp.uint8) for s in wire["scratch"]}
    launch = build_launch(cp, state["stream"], funcs, wire, {**buffers, **scratch})
    return launch, max(int(f.num_regs) for f in funcs)


def verified_launch(state: dict, wire: dict, bufs: WorkloadBuffers
                    ) -> tuple[Callable[[], None], int, bool, float, str]:
    """``plan_launch`` on the workload's buffers, launched once into poisoned outputs and
    verified: (launch, registers, ok, max abs error, worst output)."""
    launch, registers = plan_launch(state, wire, {**bufs.inputs, **bufs.outputs})
    bufs.poison()
    launch()
    state["stream"].synchronize()
    return (launch, registers, *bufs.verify())


def scrub_l2(state: dict) -> None:
    """Fill L2 with lines of an unrelated buffer (normal priority, as other kernels of a program
    leave them) before a plan is timed. Evict-first accesses (``stream`` plans) cannot displace
    normal lines, so whatever the previous work left in L2 stays there for thousands of
    launches. On the H200 one compiled rmsnorm streaming plan ran 66.4 µs after its plain twin
    (67.2 µs) had left the case's own rows there, and 69.4 µs after the verify step's temporaries
    (docs/investigations.md, L2 history). Plans with normal accesses are not affected."""
    flush = state["flush"]
    flush.data.memset_async(0, flush.nbytes, state["stream"])


def finalists_of(good: list[tuple[float, int, dict, dict]], top: int) -> list[tuple[float, int, dict, dict]]:
    """The ``top`` best of the search by quick µs, ties in search order: timed in throughput
    mode. (Each finalist's ``stream`` twin used to join them, on an A/B that L2 history had
    skewed: see ``scrub_l2``.)"""
    return sorted(good, key=lambda g: g[:2])[:top]


class CaseSearch:
    """tunedb's side of each case: candidate plans generated and compiled ahead in a process
    pool (in case order), then per case verified, quick-timed (CUDA events), and the best
    ``top`` timed in throughput mode. Kernels run in this process (no worker): a sticky CUDA
    error raises ``ContextLost``."""

    def __init__(self, state: dict, sm_count: int, top: int = 3, search_s: float = 30.0,
                 max_search: int = 0, workers: int | None = None) -> None:
        self.state, self.cp, self.stream = state, state["cp"], state["stream"]
        self.sm_count, self.top = sm_count, max(1, top)
        self.search_s, self.max_search = search_s, max_search
        self.jobs: dict[str, list[tuple[dict, Any]]] = {}
        self.space: dict[str, dict] = {}
        # Leave cores for this process and the reference workers: host-side launch rates count.
        self.pool = spawn_pool(max(1, (os.cpu_count() or 2) - 4) if workers is None else workers)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def settle(self) -> int:
        """Wait for every queued compile, then stop the pool (returns the number waited for):
        throughput timing is host-bound for kernels under ~100 µs when the launching process
        competes with compile workers for the CPU, so nothing may compile while anything is timed."""
        n = 0
        for jobs in self.jobs.values():
            for _, fut in jobs:
                if fut is not None:
                    n += 1
                    try:
                        fut.result(timeout=600)
                    except Exception:  # noqa: BLE001 - _tune regenerates it in-process
                        pass
        self.close()
        self.pool = None
        return n

    def _search_metas(self, workload_hash: str, graph: Graph) -> list[dict]:
        try:
            legal, pruned = schedule_space(graph, sm_count=self.sm_count)
        except Exception as e:  # noqa: BLE001 - UnsupportedFusion, or a generator bug
            self.space[workload_hash] = {"error": f"no schedule space: {_one_line(e)}"}
            return []
        self.space[workload_hash] = {"legal": len(legal), "pruned": len(pruned)}
        metas = [{"config": s.to_config(), "source": "search"} for s in legal]
        return metas[:self.max_search] if self.max_search > 0 else metas

    def _queue(self, graph: Graph, metas: list[dict]) -> list[tuple[dict, Any]]:
        gj = graph.to_json()
        return [(m, submit_or_none(self, prepare, gj, m["config"], self.sm_count, True)) for m in metas]

    def submit(self, workload_hash: str, graph: Graph, db_cands: list[dict]) -> None:
        """Queue the candidates of one case: the database's top-K, else the schedule space."""
        metas = list(db_cands) or self._search_metas(workload_hash, graph)
        self.jobs[workload_hash] = self._queue(graph, metas)

    def _verified(self, wire: dict, bufs: _Buffers) -> tuple[Callable[[], None], int, bool, float, str]:
        return verified_launch(self.state, wire, bufs)

    def _failed(self, e: dict, ex: BaseException) -> None:
        e.update(status="runtime_error", error=_one_line(ex))
        if not context_ok(self.cp):
            raise ContextLost(f"candidate {e['label']}: {e['error']}") from None

    def run_case(self, workload_hash: str, graph: Graph, dev: dict[str, np.ndarray],
                 refs: dict[str, np.ndarray]) -> dict:
        """tunedb's entry of one case, on the host input arrays ``dev`` (float64 ``refs``)."""
        bufs = _Buffers(self.cp, graph, dev, refs)
        try:
            jobs = self.jobs.pop(workload_hash, [])
            entry = self._tune(jobs, graph, bufs, refs)
            if entry["us"] is None and jobs and jobs[0][0].get("source") == "db":
                # Every stored candidate failed here (generator changed?): search instead.
                db_error = entry["error"]
                jobs = self._queue(graph, self._search_metas(workload_hash, graph))
                entry = self._tune(jobs, graph, bufs, refs)
                entry["db_error"] = db_error
        finally:
            bufs.free()
        entry["space"] = self.space.get(workload_hash, {})
        if entry["us"] is None and entry["error"] == "no candidates":
            entry["error"] = entry["space"].get("error") or "no candidates"
        return entry

    def _tune(self, jobs: list[tuple[dict, Any]], graph: Graph, bufs: _Buffers, refs: dict) -> dict:
        tried: list[dict] = []
        good: list[tuple[float, int, dict, dict]] = []
        t0, skipped = time.monotonic(), 0
        for meta, fut in jobs:
            if good and time.monotonic() - t0 > self.search_s:
                skipped += 1
                if fut is not None:
                    fut.cancel()
                continue
            try:
                prep = fut.result(timeout=600) if fut is not None else None
            except Exception:  # noqa: BLE001 - the pool died: generate here, compile on launch
                prep = None
            prep = prep or prepare(graph.to_json(), meta["config"], self.sm_count, compile_now=False)
            e: dict[str, Any] = {"label": prep["label"], "source": meta["source"], "status": "ok",
                                 "quick_us": None, "error": prep.get("error")}
            tried.append(e)
            if e["error"]:
                e["status"] = prep["status"]
                continue
            try:
                launch, _, ok, err, name = self._verified(prep["wire"], bufs)
                if not ok:
                    e.update(status="incorrect", error=f"max abs error {err:.6g} in output {name!r}")
                    continue
                scrub_l2(self.state)
                samples, _ = time_plan(self.state, launch, Protocol(**QUICK_PROTOCOL))
                e["quick_us"] = _finite(float(np.median(samples)))
                good.append((e["quick_us"] or math.inf, len(good), e, {**meta, **prep}))
            except Exception as ex:  # noqa: BLE001 - CUDA errors become statuses
                self._failed(e, ex)
        best: dict | None = None
        finalists = []
        for _, _, e, prep in finalists_of(good, self.top):
            try:
                launch, regs, ok, err, _ = self._verified(prep["wire"], bufs)
                rel = _check([bufs.download(n) for n in graph.outputs], graph, refs)
                scrub_l2(self.state)
                us = _finite(throughput_us(launch, self.stream.synchronize)) if ok else None
            except Exception as ex:  # noqa: BLE001
                self._failed(e, ex)
                continue
            f = {"schedule": e["label"], "config": prep["config"], "source": e["source"],
                 "source_hash": prep["source_hash"], "us": us, "quick_us": e["quick_us"], "verified": ok,
                 "rel_err": rel, "max_abs_err": _finite(err), "registers": regs,
                 "kernels": len(prep["wire"]["kernels"])}
            if prep.get("db_us") is not None:
                f["db_us"] = prep["db_us"]  # the stored median (L2 flushed): another protocol
                f["db_source_match"] = prep["source_hash"] == prep.get("db_source_hash")
            finalists.append(f)
            if us is not None and (best is None or us < best["us"]):
                best = f
        statuses: dict[str, int] = {}
        for e in tried:
            statuses[e["status"]] = statuses.get(e["status"], 0) + 1
        entry: dict[str, Any] = {"us": None, "schedule": None, "error": None if best else "no candidates"}
        if best is not None:
            entry.update(best)
        elif tried:
            first = next((e["error"] for e in tried if e["error"]), "")
            by = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
            entry["error"] = f"no candidate verified ({by})" + (f"; first error: {first}" if first else "")
        entry.update(candidates=len(jobs), tried=len(tried), skipped=skipped, statuses=statuses,
                     finalists=finalists,
                     attempts=[[e["label"], e["status"], e["quick_us"], e["error"]] for e in tried])
        return entry


class _Buffers(WorkloadBuffers):
    """The collector's workload buffers (poison, verify, free), filled from the caller's host
    arrays: the peers get the very same input values, and the float64 reference runs once."""

    def __init__(self, cp: Any, graph: Graph, dev: dict[str, np.ndarray],
                 refs: dict[str, np.ndarray]) -> None:
        self.cp, self.graph, self.hash = cp, graph, ""
        self.inputs = {k: cp.asarray(v) for k, v in dev.items()}
        self.pristine = {k: v.copy() for k, v in self.inputs.items()}
        self.refs = {k: cp.asarray(np.asarray(v, dtype=np.float32)) for k, v in refs.items()}
        self.outputs = {}
        for name in graph.outputs:
            t = graph.type_of(name)
            self.outputs[name] = cp.empty(t.shape, dtype=storage_dtype(t.dtype))
        self.set_checks(refs)

    def download(self, name: str) -> np.ndarray:
        a = self.cp.asnumpy(self.outputs[name])
        return bf16_to_f32(a) if self.checks[name][0] == "bfloat16" else a


def run_bench(cases: list[Any], out: Path | None, db: Path | None = None, top: int = 3,
              time_limit_s: float = 0.0, search_s: float = 30.0, max_search: int = 0,
              workers: int | None = None, progress: Callable[[str], None] | None = None,
              on_case: Callable[[int, int, dict], None] | None = None, suite: str = "") -> dict:
    """Run the benchmark on the local GPU (raises ``NoGPUError`` without one); returns the result
    dict (also written to ``out`` after every case). ``time_limit_s`` > 0 skips the cases not
    started by then; ``search_s`` caps the schedule search per case; ``max_search`` > 0 caps the
    schedules tried per case. ``progress`` gets setup lines, ``on_case`` each finished case."""
    say = progress or (lambda _line: None)
    cp = import_cupy()  # NoGPUError first, before anything else is touched
    # JAX must not grab 75 % of GPU memory: CuPy and torch share the device with it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    t0 = time.monotonic()
    workloads = [Workload.from_graph(c.graph, c.family, c.name) for c in cases]
    result: dict[str, Any] = {"benchmark": "fusion", "suite": suite, "protocol": PROTOCOL, "top_k": top,
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "cases": [], "complete": False, "stopped": "", "notes": [],
                              **provenance()}

    def save() -> None:
        result.update(summary=summarize(result), elapsed_s=round(time.monotonic() - t0, 1))
        if out is not None:
            write_json(result, out)

    def note(line: str) -> None:
        result["notes"].append(line)
        say(line)

    host = HostPrep([(w.hash, c.graph) for w, c in zip(workloads, cases)])  # starts computing now
    search = None
    try:
        state: dict[str, Any] = {}
        hello = gpu_init(state)
        info = state["info"]
        result.update(device={"id": info.id, **asdict(info)}, env=_versions(),
                      clocks_before=hello.get("clocks", {}))
        say(f"device {info.name} ({info.sm_count} SMs), driver {info.driver}, CUDA {info.cuda_runtime}")
        result["copy_TBps"] = bw = _finite(copy_tbps(cp, state["stream"].synchronize, COPY_BYTES)) or 0.0
        say(f"copy bandwidth {bw:.2f} TB/s (read + write, 1 GiB device-to-device)")
        fw = Frameworks()
        for err in fw.errors.values():
            note(err)
        from_db: dict[str, list[dict]] = {}
        if db is not None:
            try:
                from_db = db_candidates(db, info, [w.hash for w in workloads], top)
            except Exception as e:  # noqa: BLE001 - a bad database falls back to the search
                note(f"database {db} not used: {_one_line(e)}")
        search = CaseSearch(state, info.sm_count, top=top, search_s=search_s, max_search=max_search,
                            workers=workers)
        for case, wl in zip(cases, workloads):  # compile everything ahead, in case order
            search.submit(wl.hash, case.graph, from_db.get(wl.hash) or [])
        # Nothing runs beside the timing loops: a busy host slows the peers' launches most.
        n = search.settle()
        host.settle()
        say(f"compiled {n} candidate(s) and prepared {len(cases)} case(s) before timing "
            f"({time.monotonic() - t0:.0f} s)")

        def scrub() -> None:
            scrub_l2(state)
            state["stream"].synchronize()  # the peers time on their own streams

        for i, (case, wl) in enumerate(zip(cases, workloads), 1):
            if time_limit_s > 0 and time.monotonic() - t0 > time_limit_s:
                result["stopped"] = f"time limit {time_limit_s:g}s: skipped {len(cases) - i + 1} case(s)"
                say(result["stopped"])
                break
            tc = time.monotonic()
            g = case.graph
            rec = {"case": case.name, "family": case.family, "workload_hash": wl.hash,
                   "inputs": {n: str(g.type_of(n)) for n in g.inputs},
                   "outputs": {n: str(g.type_of(n)) for n in g.outputs}, "floor_bytes": g.floor_bytes(),
                   "floor_us": _finite(floor_us(g.floor_bytes(), bw)) if bw > 0 else None, "peers": {}}
            dev = refs = None
            try:
                dev, refs = host.get(i - 1)
                rec["tunedb"] = search.run_case(wl.hash, g, dev, refs)
            except ContextLost as e:
                rec["tunedb"] = {"us": None, "error": str(e)}
                result["cases"].append(rec)
                result["stopped"] = f"CUDA context lost: {e}"
                say(result["stopped"])
                break
            except Exception as e:  # noqa: BLE001 - one broken case must not end the run
                rec["tunedb"] = {"us": None, "error": f"case failed: {_one_line(e)}"}
            for p in PEERS:
                rec["peers"][p] = (_peer(fw, p, g, dev, refs, scrub) if dev is not None else
                                   {"us": None, "rel_err": None, "error": rec["tunedb"]["error"]})
            del dev, refs
            _free(cp, fw)
            rec["elapsed_s"] = round(time.monotonic() - tc, 1)
            result["cases"].append(rec)
            save()
            if on_case is not None:
                on_case(i, len(cases), rec)
        else:
            result["complete"] = True
    finally:
        if search is not None:
            search.close()
        host.close()
    result["clocks_after"] = clocks()
    save()
    return result


def _free(cp: Any, fw: Any) -> None:
    import gc

    gc.collect()  # the peers' closures hold device arrays
    cp.get_default_memory_pool().free_all_blocks()
    try:
        if fw.torch is not None:
            fw.torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - only memory hygiene
        pass

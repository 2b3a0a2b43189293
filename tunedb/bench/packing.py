"""``tunedb bench packing``: independent GEMMs launched together, tunedb's backends beside torch.

For each case (``tunedb.kernels.packing_suites``) one process times, on the same inputs:

* every tunedb candidate (``tunedb.kernels.packing.candidates``, and ``splitk_candidates`` and
  ``chunk_candidates`` unless ``--no-extra``), each replayed as one CUDA graph;
* torch eager loop (one ``matmul`` per member); the same loop captured as a CUDA graph; the members
  spread over k streams forked and joined inside a CUDA graph (k = 4, 8, 16: the best k is the
  peer); one padded ``bmm`` over stacks padded to the largest member (all members of one dtype
  and layout, padding up to 20 GiB), eagerly and in a CUDA graph; ``torch.func.vmap`` of ``mm``
  over the stacked weights of each group of equal shapes (the tenants case), eagerly and in a
  CUDA graph.

Every system's outputs are checked against a float64 reference of every member before it is
timed; a failed check is reported, never timed. Times are medians of ``samples`` event-timed loops
of ``reps`` launches. tunedb's number is its best candidate (all candidates are in the JSON).
With ``--duel N`` the two fastest of each side are then timed again in N interleaved rounds
(``tunedb.bench.packing_duel``): the same clocks for both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.packing_choice import db_choice, export_times, model_choice, summarize_choice
from tunedb.bench.packing_duel import duel
from tunedb.bench.packing_jax import jax_rows
from tunedb.bench.provenance import provenance
from tunedb.kernels.packing import BACKENDS, PackingWorkload, padded_shape, uniform
from tunedb.kernels.packing_suites import bench_cases, interleave, suite
from tunedb.runtime.blas import library
from tunedb.runtime.device import NoGPUError, device_info, import_cupy
from tunedb.runtime.pack import make_inputs, measure_candidates, measure_row, reference, worst_error
from tunedb.runtime.streams import StreamPool

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
PAD_LIMIT_BYTES = 20 << 30


def _torch_from(torch: Any, a: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()




def time_torch(torch: Any, fn: Callable[[], None], *, reps: int, samples: int) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return out


class TorchCase:
    """torch tensors of one case and the peers' launch functions (each writes ``outs``)."""

    def __init__(self, torch: Any, cp: Any, w: PackingWorkload,
                 inputs: Sequence[tuple[np.ndarray, np.ndarray]]):
        self.torch, self.cp, self.w = torch, cp, w
        self.ops = []
        for mb, (x, wt) in zip(w.members, inputs):
            tx, tw = _torch_from(torch, x, mb.dtype), _torch_from(torch, wt, mb.dtype)
            tw = tw if mb.layout == "nn" else tw.transpose(-1, -2)
            out = torch.zeros((mb.batch, mb.m, mb.n), dtype=tx.dtype, device="cuda")
            if mb.batch == 1:
                self.ops.append((tx[0], tw[0], out[0], out))
            else:
                self.ops.append((tx, tw, out, out))

    def outputs(self) -> list[Any]:
        """float64 CuPy views of the outputs (after torch's queue has drained)."""
        wide = [o[3].double() for o in self.ops]
        self.torch.cuda.synchronize()
        return [self.cp.asarray(t) for t in wide]

    def clear(self) -> None:
        for o in self.ops:
            o[3].zero_()

    def loop(self, which: Sequence[int] | None = None) -> None:
        torch = self.torch
        for i in range(len(self.ops)) if which is None else which:
            x, wt, out, _ = self.ops[i]
            torch.matmul(x, wt, out=out)

    def graph(self, fn: Callable[[], None]) -> Callable[[], None]:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay

    def streams(self, k: int) -> Callable[[], None]:
        torch = self.torch
        ss = [torch.cuda.Stream() for _ in range(k)]
        parts = [list(range(j, len(self.ops), k)) for j in range(k)]

        def fn() -> None:
            cur = torch.cuda.current_stream()
            for s, p in zip(ss, parts):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    self.loop(p)
            for s in ss:
                cur.wait_stream(s)
        return self.graph(fn)

    def padded_bmm(self) -> Callable[[], None] | None:
        torch, ms = self.torch, self.w.members
        if not uniform(ms):
            return None
        M, N, K = padded_shape(ms)
        P = sum(m.batch for m in ms)
        isz = self.ops[0][0].element_size()
        if P * (M * K + K * N + M * N) * isz > PAD_LIMIT_BYTES:
            return None
        dt = self.ops[0][0].dtype
        X = torch.zeros((P, M, K), dtype=dt, device="cuda")
        W = torch.zeros((P, K, N), dtype=dt, device="cuda")
        O = torch.zeros((P, M, N), dtype=dt, device="cuda")
        p, views = 0, []
        for mb, (x, wt, _, out) in zip(ms, self.ops):
            b = mb.batch
            X[p:p + b, :mb.m, :mb.k] = x.reshape(b, mb.m, mb.k)
            W[p:p + b, :mb.k, :mb.n] = wt.reshape(b, mb.k, mb.n)
            views.append((O[p:p + b, :mb.m, :mb.n], out))
            p += b
        self._keep_pad = (X, W, O, views)

        def fn() -> None:
            torch.bmm(X, W, out=O)
        self._pad_views = views
        return fn

    def copy_padded_out(self) -> None:
        for src, dst in self._pad_views:
            dst.copy_(src)

    def vmap_groups(self) -> Callable[[], None]:
        """One ``vmap(mm)`` per group of equal member shapes over stacked operands (as
        ``torch.func.stack_module_state`` stacks tenants' weights); results copied out once for
        the check, not in the timed function."""
        torch = self.torch
        groups: dict[tuple, list[int]] = {}
        for i, mb in enumerate(self.w.members):
            groups.setdefault(mb.key, []).append(i)
        vm = torch.func.vmap(torch.matmul)
        stacks = []
        for idx in groups.values():
            X = torch.stack([self.ops[i][0] for i in idx])
            W = torch.stack([self.ops[i][1] for i in idx])
            stacks.append((idx, X, W, [None]))

        def fn() -> None:
            for st in stacks:
                st[3][0] = vm(st[1], st[2])
        self._vm_stacks = stacks
        return fn

    def copy_vmap_out(self) -> None:
        for idx, _, _, res in self._vm_stacks:
            for j, i in enumerate(idx):
                self.ops[i][3].copy_(res[0][j].reshape(self.ops[i][3].shape))


def graph_cases(path: Path) -> list[PackingWorkload]:
    """The packing workloads ``tunedb.compile`` looks up for ``path``'s ready sets (planned on
    the CPU with a predictor that records each set and never packs)."""
    from tunedb.plan import compile

    seen: list[PackingWorkload] = []

    def record(w: PackingWorkload, cands: Sequence[Any]) -> list[float]:
        seen.append(w)
        return [1.0 if c.name == "whole:serial" else 2.0 for c in cands]
    compile(str(path), device=None, pack_model=record)
    return seen


def run_case(w: PackingWorkload, *, cp: Any, torch: Any, pool: StreamPool, reps: int, samples: int,
             peers: bool = True, log: Callable[[str], None] = print, jax_peers: bool = False,
             extra: bool = True, duel_rounds: int = 0, model: Any = None, times: Any = None
             ) -> dict[str, Any]:
    host = make_inputs(w, seed=0)
    inputs = [(cp.asarray(x), cp.asarray(wt)) for x, wt in host]  # once per case, for all candidates
    refs = reference(w, inputs)
    rows = measure_candidates(cp, w, inputs, refs, pool, reps=reps, samples=samples, log=log,
                              extra=extra)

    def add(*args: Any, **kw: Any) -> None:
        rows.append(measure_row(*args, log=log, **kw))

    if peers:
        _torch_rows(w, torch, cp, host, refs, add, reps, samples)
        if jax_peers:
            jax_rows(w, host, refs, add, reps, samples)
    res = {"case": w.name, "family": w.family, "hash": w.hash, "members": len(w.members),
           "problems": w.problems, "flops": w.flops, "bytes": w.bytes(), "workload": w.to_json(),
           "rows": rows, "summary": summarize(rows)}
    if model is not None:  # what a user's plan runs: the model's pick, timed in the same pass
        res["model_choice"] = summarize_choice(res, model_choice(w, rows, model))
    if times is not None:  # with a database: an exact hit's measured best, else the model's pick
        res["db_choice"] = summarize_choice(res, db_choice(w, rows, times, model))
    if peers and duel_rounds > 0:
        tc = TorchCase(torch, cp, w, host)
        try:
            res["duel"] = duel(w, rows, cp=cp, torch=torch, pool=pool, inputs=inputs, refs=refs,
                               tc=tc, time_torch=time_torch, reps=reps, rounds=duel_rounds, log=log,
                               choice=res.get("model_choice", {}).get("variant", ""),
                               also=[res.get("db_choice", {}).get("variant", "")])
        except Exception as e:  # noqa: BLE001 - the first pass's rows stand without the duel
            res["duel"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        tc.__dict__.clear()
        torch.cuda.empty_cache()
    return res


def _torch_rows(w: PackingWorkload, torch: Any, cp: Any, inputs: Any, refs: Any,
                add: Callable[..., None], reps: int, samples: int) -> None:
    def ttime(fn: Callable[[], None]) -> list[float]:
        return time_torch(torch, fn, reps=reps, samples=samples)

    tc = TorchCase(torch, cp, w, inputs)

    def peer(variant: str, build: Callable[[], Any], after: Callable[[], None] | None = None) -> None:
        """Build (inside the row's error handling), check against the reference, then time."""
        held: dict[str, Any] = {}

        def verify() -> float:
            fn = held["fn"] = build()
            if fn is None:
                raise RuntimeError("not applicable")
            tc.clear()
            fn()
            if after:
                after()
            return worst_error(w, tc.outputs(), refs)
        add("torch", variant, verify, lambda: held["fn"](), ttime)

    peer("eager loop", lambda: tc.loop)
    peer("graph loop", lambda: tc.graph(tc.loop))
    for k in (4, 8, 16):
        if k <= len(w.members):
            peer(f"streams{k} graph", lambda k=k: tc.streams(k))
    if uniform(w.members):
        peer("padded bmm", tc.padded_bmm, tc.copy_padded_out)
        peer("padded bmm graph", lambda: tc.graph(tc.padded_bmm()), tc.copy_padded_out)
    peer("vmap by shape", tc.vmap_groups, tc.copy_vmap_out)
    peer("vmap by shape graph", lambda: tc.graph(tc.vmap_groups()), tc.copy_vmap_out)
    tc.__dict__.clear()  # drop the padded stacks and every tensor now, not at the next collection
    torch.cuda.empty_cache()


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tunedb's best candidate, the best peer (torch or JAX) and the speedups over each peer."""
    ok = [r for r in rows if r.get("status") == "ok"]
    best = {}
    # tunedb_model_set: the best of the candidates the cost model knows (no split-K or chunks)
    base = [r for r in ok if r["system"] == "tunedb"
            and all(c["backend"] in BACKENDS for c in r["candidate"]["clusters"])]
    for side, mine in (("tunedb", [r for r in ok if r["system"] == "tunedb"]),
                       ("peer", [r for r in ok if r["system"] != "tunedb"]), ("tunedb_model_set", base)):
        if mine:
            best[side] = min(mine, key=lambda r: r["median_us"])
    out: dict[str, Any] = {k: {"variant": v["variant"], "median_us": v["median_us"]} for k, v in best.items()}
    if "tunedb" in best:
        t = best["tunedb"]["median_us"]
        for r in ok:
            if r["system"] != "tunedb":
                out.setdefault("speedup", {})[r["variant"]] = r["median_us"] / t
        if "peer" in best:
            out["speedup_vs_best_peer"] = best["peer"]["median_us"] / t
    return out


def render(results: Sequence[dict[str, Any]]) -> str:
    head = ["case", "tunedb best", "us", "eager", "graph", "streams best", "pad bmm", "vmap best",
            "jax best", "x best peer", "duel x", "model's pick", "us", "x best peer", "duel x",
            "db pick", "us", "x best peer", "duel x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        ok = {r["variant"]: r["median_us"] for r in res["rows"] if r["system"] != "tunedb"
              and r.get("status") == "ok"}
        s = res["summary"]
        tb, mc, dc = s.get("tunedb", {}), res.get("model_choice", {}), res.get("db_choice", {})
        duel_of = res.get("duel", {}).get("choices_over_best_peer", {})

        def best_of(prefix: str, ok: dict = ok) -> str:
            v = [t for n, t in ok.items() if n.startswith(prefix)]
            return f"{min(v):.1f}" if v else "-"
        lines.append("| " + " | ".join([
            res["case"], tb.get("variant", "-"), f"{tb.get('median_us', math.nan):.1f}",
            best_of("eager"), best_of("graph loop"), best_of("streams"), best_of("padded"),
            best_of("vmap"), best_of("jax"), f"{s.get('speedup_vs_best_peer', math.nan):.2f}x",
            f"{res.get('duel', {}).get('speedup_vs_best_peer', math.nan):.2f}x",
            mc.get("variant", "-"), f"{mc.get('median_us', math.nan):.1f}",
            f"{mc.get('speedup_vs_best_peer', math.nan):.2f}x",
            f"{res.get('duel', {}).get('choice_over_best_peer', math.nan):.2f}x",
            f"{dc.get('variant', '-')} ({dc.get('source', '-')})", f"{dc.get('median_us', math.nan):.1f}",
            f"{dc.get('speedup_vs_best_peer', math.nan):.2f}x",
            f"{duel_of.get(dc.get('variant', ''), math.nan):.2f}x"]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tunedb bench packing", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="bench", help="bench (the issue's cases), quick or standard")
    ap.add_argument("--case", action="append", default=None,
                    help="only cases whose name has this, in the order given")
    ap.add_argument("--graph", type=Path, action="append", default=None,
                    help="instead of a suite: the ready sets tunedb.compile considers packing in "
                         "this graph (ONNX), with the hashes its database lookup uses")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("bench-packing.json"))
    ap.add_argument("--time-limit", type=float, default=240.0, help="no new case after this (s)")
    ap.add_argument("--no-peers", action="store_true", help="tunedb's candidates only")
    ap.add_argument("--jax", action="store_true", help="JAX peers too (vmap/jit; needs JAX)")
    ap.add_argument("--duel", type=int, default=0, metavar="ROUNDS",
                    help="then tunedb's 2 fastest and the 2 fastest torch peers again, interleaved")
    ap.add_argument("--no-extra", action="store_true",
                    help="without the split-K and chunked candidates (the packing/5 model's set)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a packing model folder: report its pick (what a user's plan runs) per case")
    ap.add_argument("--db-data", type=Path, default=None,
                    help="an export as the database: also the pick an exact hit makes (else the model's)")
    args = ap.parse_args(argv)
    model = None
    if args.model is not None:
        from tunedb.costmodel.packing import load_predictor
        try:
            model = load_predictor(args.model)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    times = None
    if args.db_data is not None:
        try:
            times = export_times(args.db_data)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --db-data {args.db_data}: {' '.join(str(e).split())[:200]}", file=sys.stderr)
            return 2
    try:
        if args.graph:
            cases = [w for g in args.graph for w in graph_cases(g)]
        else:
            cases = bench_cases() if args.suite == "bench" else suite(args.suite)
    except (ValueError, OSError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    if args.case:  # in the order of the first --case each matches (what a time limit keeps)
        rank = {c.name: min(i for i, s in enumerate(args.case) if s in c.name)
                for c in cases if any(s in c.name for s in args.case)}
        cases = sorted((c for c in cases if c.name in rank), key=lambda c: rank[c.name])
    else:
        cases = interleave(cases)

    if args.jax:  # JAX would otherwise take most of the GPU's memory at import
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:  # CuPy (and through it cuBLAS) before torch loads its own copy
        cp = import_cupy()
    except NoGPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lib = library()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    pool = StreamPool(16)
    ver = pool.blas(0).version
    doc: dict[str, Any] = {"bench": "packing", **provenance(argv), "device": torch.cuda.get_device_name(),
                           "cublas_version": ver, "torch": torch.__version__, "cupy": cp.__version__,
                           "grouped_gemm": hasattr(lib, "cublasGemmGroupedBatchedEx"),
                           "reps": args.reps, "samples": args.samples,
                           "device_info": asdict(device_info()),
                           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                           "results": []}
    t0 = time.monotonic()
    for w in cases:
        if args.time_limit and time.monotonic() - t0 > args.time_limit:
            doc.setdefault("skipped", []).append(w.name)
            continue
        print(f"{w.name}: {len(w.members)} members", flush=True)
        doc["results"].append(run_case(w, cp=cp, torch=torch, pool=pool, reps=args.reps,
                                       samples=args.samples, peers=not args.no_peers,
                                       jax_peers=args.jax, extra=not args.no_extra,
                                       duel_rounds=args.duel, model=model, times=times))
        cp.get_default_memory_pool().free_all_blocks()
        args.out.write_text(json.dumps(doc, indent=1))
    print(render(doc["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

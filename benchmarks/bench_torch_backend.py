"""``torch.compile(model, backend=tunedb_backend)`` on BERT-base and ResNet-50 on the local GPU,
verified against eager, and timed against the backend's own plans replayed as tunedb's ONNX
path times them, in interleaved rounds (issue 24: the backend no slower than the ONNX path).

    python benchmarks/bench_torch_backend.py OUT.json [--cases bert_base:bfloat16,...]
        [--rounds 5] [--target-s 0.05] [--budget-s 80] [--eager] [--items plan_replay,...]
        [--spin-us 150]
    python benchmarks/bench_torch_backend.py --table OUT.json   # the markdown table of a run

Models as the zoo builds them (``export_zoo.MODELS``: library default configs, random weights,
batch 1, BERT at sequence 128), TF32 off; bfloat16 BERT with both cuBLASLt epilogues (the
options of the 444 µs plan). Per case: the compile time, the FX graphs Dynamo handed over and
how many run as tunedb plans, whether the example inputs were bound by pointer, the largest
difference from eager relative to the output's largest magnitude, and in ``--rounds`` rounds
(each times every item once by ``throughput_us``, the order rotated by one per round):

- ``plan_replay``: the plans' CUDA graphs replayed back to back on the executor's stream (what
  the ONNX path's tables time: inputs in place, outputs left in the plan's buffers);
- ``plan_replay_caller``: the same graphs launched on the caller's stream (mostly the legacy
  default stream): what a launch there costs by itself;
- ``backend_<bound|copy>_<stream|plan|caller>_<slot|clone>``: the compiled module end to end.
  ``bound``: called with the tensors it was compiled on (read by pointer, no input copy),
  ``copy``: with equal tensors elsewhere (copied in); ``stream``: the plan on its own stream
  with two waits, ``plan``: the same with the copies on the plan's stream too, ``caller``: the
  graph launched on the caller's stream; ``slot``: outputs
  written into a free output slot and handed out as they are, ``clone``: copied out
  (``torch_handoff``);
- ``eager`` (``--eager``): the module itself.

- ``runs_bound_<mode>_<slot|clone>``: the hand-off (``Handoff.run``) called directly, without
  Dynamo's guards and frame;
- ``bound_replay[_caller|_waits]``, ``plan_replay_caller_spin``, ``onnx_run``, ``onnx_plan_run``: see
  ``_replays_and_user_calls`` (the last two: the ONNX path as a user calls it).

``host_us`` per item: the host's time per call (``host_us``), to tell a GPU-bound loop from a
host-bound one.

Each case is skipped when its rough cost would pass ``--budget-s``; OUT.json is rewritten after
every step, so a cut run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tunedb.bench.fusion import _one_line  # noqa: E402
from tunedb.bench.provenance import provenance  # noqa: E402

CASES = ("bert_base:bfloat16", "resnet50:bfloat16", "resnet50:float32", "bert_base:float32")
OPTIONS = {("bert_base", "bfloat16"): {"gemm_epilogue": True, "gelu_epilogue": True, "cublaslt": True}}
COST_S = {"bert_base": 30, "resnet50": 20}  # rough compile + rounds on an H200 host
SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def _build(name: str, dtype: str) -> tuple[Any, tuple]:
    import torch
    from export_zoo import MODELS, _FirstOutput

    torch.manual_seed(0)
    model, args, names, _ = MODELS[name]()
    model = _FirstOutput(model, names if "input_ids" in names else None).eval()
    low = getattr(torch, dtype)
    model = model.to(low).cuda()
    args = tuple((a.to(low) if a.is_floating_point() else a).cuda() for a in args)
    return model, args


def rounds(items: dict[str, tuple[Callable[[], Any], Callable[[], None]]], n: int,
           target_s: float) -> dict:
    """``n`` rounds, each timing every item once, the order rotated by one per round: per item
    the µs of each round and their median, min and max."""
    from tunedb.bench.peers import interleaved_rounds

    us, errors = interleaved_rounds(items, n, target_s)
    stats = {k: {"median": round(statistics.median(v), 1), "min": min(v), "max": max(v)}
             for k, v in us.items() if v}
    return {"us": us, "stats": stats, "errors": errors}


def host_us(run: Callable[[], Any], sync: Callable[[], None], calls: int = 20) -> float:
    """The host's µs per call while the GPU is still busy with earlier ones: ``calls`` calls
    enqueued after a synchronization, timed before the closing one (what a call costs the
    Python side; above the GPU's time per call, the loop would be host-bound)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    t1 = time.perf_counter()
    sync()
    return round((t1 - t0) / calls * 1e6, 1)


def one(name: str, dtype: str, a: argparse.Namespace, rec: dict) -> None:
    import cupy as cp
    import torch

    from tunedb.frontends.torch_backend import TOLERANCE, TunedbGraph, tunedb_backend

    options = OPTIONS.get((name, dtype), {})
    rec["options"] = options
    model, args = _build(name, dtype)
    graphs: list[TunedbGraph] = []
    with torch.no_grad():
        want = model(*args).float()

        def backend(gm: Any, example_inputs: Any) -> Any:
            graphs.append(tunedb_backend(gm, example_inputs, **options))
            return graphs[-1]

        torch._dynamo.reset()
        fast = torch.compile(model, backend=backend)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fast(*args).float()
        torch.cuda.synchronize()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        rec["warnings"] = [str(w.message)[:300] for w in caught if "tunedb" in str(w.message)]
        rec["fx_graphs"] = len(graphs)
        rec["planned"] = sum(g.executor is not None for g in graphs)
        rec["kernels"] = [g.plan.kernels if g.plan is not None else None for g in graphs]
        rec["fallbacks"] = [g.fallback for g in graphs if g.fallback]
        # the exporter's optimizer's graph did not import, so the graph as exported was planned
        rec["optimize_errors"] = [g.optimize_error for g in graphs if g.optimize_error]
        rec["inputs_bound"] = [bool(g.runs and g.runs.inputs_bound) for g in graphs]
        rec["output_slots"] = [g.runs.slots if g.runs else 0 for g in graphs]
        rec["bind_errors"] = [e for g in graphs if g.runs for e in g.runs.errors]
        scale = float(want.abs().max()) or 1.0
        atol, rtol = TOLERANCE[dtype]

        def check(got: Any, key: str) -> bool:
            rec[f"max_rel_err_{key}"] = float((got - want).abs().max()) / scale
            ok = bool(torch.allclose(got, want, atol=atol * scale, rtol=rtol))
            rec[f"equal_within_tolerance_{key}"] = ok
            return ok

        ok = check(got, "bound")
        other = tuple(t.clone() for t in args)  # equal values, other addresses: copied in
        ok = check(fast(*other).float(), "copy") and ok
        sync = torch.cuda.synchronize
        items: dict[str, Any] = {}
        ex = [g.executor for g in graphs if g.executor is not None]
        if ok and ex and len(ex) == len(graphs):
            def replay() -> None:
                for e in ex:
                    e.replay()

            def replay_caller() -> None:
                s = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
                for e in ex:
                    e._graph.launch(s)

            def backend_call(inputs: tuple, mode: str, slots: bool) -> Callable[[], Any]:
                def call() -> Any:
                    for g in graphs:
                        g.runs.mode, g.runs.use_slots = mode, slots
                    return fast(*inputs)
                return call

            items["plan_replay"] = (replay, lambda: [e.synchronize() for e in ex])
            if all(e.graph_capture for e in ex):
                items["plan_replay_caller"] = (replay_caller, sync)
            for kind, inputs in (("bound", args), ("copy", other)):
                for mode in ("stream", "plan", "caller"):
                    for out in ("slot", "clone"):
                        call = backend_call(inputs, mode, out == "slot")
                        items[f"backend_{kind}_{mode}_{out}"] = (call, sync)
            if len(graphs) == 1:  # the hand-off without Dynamo: its Python and guards left out
                (g0,) = graphs
                user = list(g0.runs._held) or [t.clone() for t in args]  # the bound tensors
                for mode in ("stream", "plan", "caller"):
                    for out in ("slot", "clone"):
                        def direct(mode: str = mode, slots: bool = out == "slot") -> Any:
                            g0.runs.mode, g0.runs.use_slots = mode, slots
                            return g0.runs.run(user)
                        items[f"runs_bound_{mode}_{out}"] = (direct, sync)
                try:
                    items.update(_replays_and_user_calls(g0, user, a.spin_us, sync))
                except Exception as e:  # noqa: BLE001 - the other items still run
                    rec["split_items_error"] = _one_line(e)
            if a.eager:
                items["eager"] = (lambda: model(*args), sync)
            if a.items:  # an entry "model:item" applies to that model only
                wanted = {k.split(":")[-1] for k in a.items if ":" not in k or k.split(":")[0] == name}
                items = {k: v for k, v in items.items() if k in wanted}
            before = [dict(g.runs.calls) for g in graphs]
            rec["rounds"] = rounds(items, a.rounds, a.target_s)
            rec["host_us"] = {k: host_us(*items[k]) for k in items if k != "eager"}
            rec["calls"] = [{f"inputs_{'bound' if b else 'copied'}_outputs_{'slot' if s else 'copied'}":
                             n - old.get((b, s), 0) for (b, s), n in g.runs.calls.items()}
                            for g, old in zip(graphs, before)]
            # after the rounds: every variant's output still equals eager, kept ones too
            kept = []
            for mode in ("stream", "plan", "caller"):
                for out in ("slot", "clone"):
                    for kind, inputs in (("bound", args), ("copy", other)):
                        y = backend_call(inputs, mode, out == "slot")()
                        kept.append(y)
                        check(y.float(), f"{kind}_{mode}_{out}_after")
            for i, y in enumerate(kept):
                check(y.float(), f"kept_{i}")
            for g in graphs:
                g.runs.mode, g.runs.use_slots = "stream", True


def _replays_and_user_calls(g: Any, user: list, spin_us: float, sync: Callable[[], None]
                            ) -> dict[str, tuple[Callable[[], Any], Callable[[], None]]]:
    """Items that split the hand-off's cost, and the ONNX path as a user calls it:

    - ``bound_replay`` / ``bound_replay_caller``: the graph bound to the example inputs and
      output slot 0 replayed back to back on the plan's / the caller's stream (the GPU work of
      a bound call, with no hand-off); ``bound_replay_waits``: on the plan's stream between
      the stream mode's two waits (the caller's stream's event waited on by the plan's, and
      back), without the hand-off's Python;
    - ``plan_replay_caller_spin``: ``plan_replay_caller`` with ``spin_us`` of host busy-wait per
      call (does a host this slow, the backend's, slow a graph loop on the caller's stream?);
    - ``onnx_run``: ``PlanExecutor.run`` on the caller's torch tensors (what ``Plan.run`` does
      before its copy to the host: inputs checked and copied in, bf16 outputs widened to fp32,
      CuPy arrays ordered on the caller's stream);
    - ``onnx_plan_run``: ``Plan.run`` itself (NumPy outputs: a copy to the host and a wait each
      call). Its executor is the backend's (the same plan), put in ``Plan.run``'s cache.
    """
    import weakref

    import cupy as cp
    import torch

    from tunedb.runtime import executor as executor_mod

    ex, runs = g.executor, g.runs
    items: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {}
    bound = runs._graphs.get((True, 0))
    if bound is not None:
        items["bound_replay"] = (lambda: bound.launch(ex.stream), ex.synchronize)

        def bound_caller() -> None:
            bound.launch(cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        items["bound_replay_caller"] = (bound_caller, sync)
        ev_in, ev_out = torch.cuda.Event(), torch.cuda.Event()

        def bound_waits() -> None:  # the stream mode's two waits, nothing else
            caller = torch.cuda.current_stream()
            ev_in.record(caller)
            runs._plan_stream.wait_event(ev_in)
            bound.launch(ex.stream)
            ev_out.record(runs._plan_stream)
            caller.wait_event(ev_out)
        items["bound_replay_waits"] = (bound_waits, sync)
    if ex.graph_capture:
        def spin() -> None:
            ex._graph.launch(cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
            end = time.perf_counter() + spin_us * 1e-6
            while time.perf_counter() < end:
                pass
        items["plan_replay_caller_spin"] = (spin, sync)
    feeds = dict(zip(runs.names, user))
    items["onnx_run"] = (lambda: ex.run(feeds), sync)
    executor_mod._CACHE[id(g.plan)] = (weakref.ref(g.plan), ex)
    items["onnx_plan_run"] = (lambda: g.plan.run(feeds), sync)
    return items


def table_lines(result: dict) -> list[str]:
    """Markdown: per case and item the median µs over the rounds [min-max] and the difference
    from ``plan_replay`` (the ONNX path's timing of the same plans), then the checks."""
    lines = ["| case | item | median µs | min-max | vs plan replay | host µs / call |",
             "|---|---|---|---|---|---|"]
    for case, rec in result.get("runs", {}).items():
        st = rec.get("rounds", {}).get("stats", {})
        base = st.get("plan_replay", {}).get("median")
        host = rec.get("host_us", {})
        for item, s in st.items():
            vs = f"{s['median'] - base:+.1f} µs" if base and item != "plan_replay" else ""
            lines.append(f"| {case} | {item} | {s['median']:.1f} | {s['min']:.1f}-{s['max']:.1f} | {vs} "
                         f"| {host.get(item, '')} |")
        for item, err in rec.get("rounds", {}).get("errors", {}).items():
            lines.append(f"| {case} | {item} | {err[:120]} | | | |")
        if not st:
            lines.append(f"| {case} | {rec.get('skipped') or rec.get('error', 'not timed')} | | | | |")
    lines.append("")
    for case, rec in result.get("runs", {}).items():
        eq = {k.removeprefix("equal_within_tolerance_"): v for k, v in rec.items()
              if k.startswith("equal_within_tolerance_")}
        err = max((v for k, v in rec.items() if k.startswith("max_rel_err_")), default=None)
        lines.append(f"- {case}: FX graphs {rec.get('fx_graphs')} (planned {rec.get('planned')}), "
                     f"kernels {rec.get('kernels')}, inputs bound {rec.get('inputs_bound')}, output "
                     f"slots {rec.get('output_slots')}, calls {rec.get('calls')}, bind errors "
                     f"{rec.get('bind_errors')}, all equal to eager: {all(eq.values()) if eq else None} "
                     f"({len(eq)} checks), largest rel. diff {err}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--table"] and len(args) == 2:
        for line in table_lines(json.loads(Path(args[1]).read_text())):
            print(line)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cases", default=",".join(CASES), help="model:dtype, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-s", type=float, default=0.05, help="seconds per timed batch")
    p.add_argument("--budget-s", type=float, default=600.0, help="no case starts that would end later")
    p.add_argument("--eager", action="store_true", help="time the module eagerly too")
    p.add_argument("--items", default="",
                   help="only these timed items (comma-separated; model:item for one model)")
    p.add_argument("--spin-us", type=float, default=150.0,
                   help="host busy-wait per call of plan_replay_caller_spin")
    a = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",") if c]
    a.items = [k for k in a.items.split(",") if k]
    bad = [":".join(c) for c in cases if len(c) != 2 or c[0] not in COST_S or c[1] not in SHORT]
    if bad or a.rounds < 1:
        print(f"error: bad --cases {', '.join(bad)} (model:dtype with model in {', '.join(COST_S)}, "
              f"dtype in {', '.join(SHORT)}) or --rounds < 1", file=sys.stderr)
        return 2
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    import onnxscript

    result: dict[str, Any] = {"benchmark": "torch_backend", "torch": torch.__version__,
                              "onnxscript": onnxscript.__version__,
                              "device": torch.cuda.get_device_name(), "rounds": a.rounds,
                              "target_s": a.target_s, "runs": {}, **provenance(argv)}
    for name, dtype in cases:
        rec: dict[str, Any] = {}
        result["runs"][f"{name}_{SHORT[dtype]}"] = rec
        if time.perf_counter() - start + COST_S[name] > a.budget_s:
            rec["skipped"] = "budget"
            continue
        t0 = time.perf_counter()
        try:
            one(name, dtype, a, rec)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            rec["error"] = _one_line(e)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        st = rec.get("rounds", {}).get("stats", {})
        print(f"{name} {dtype}: " + ", ".join(f"{k} {v['median']:.1f}" for k, v in st.items())
              + f" | {json.dumps({k: v for k, v in rec.items() if k != 'rounds'})[:600]}", flush=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

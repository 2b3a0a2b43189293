"""``tunedb bench plan``: whole compiled plans on the GPU next to their peers.

Per graph (an ONNX model, a tunedb graph JSON, or one of the 12 fusion anchor subgraphs), in one
process on one GPU: (1) compile the plan (``tunedb.compile``: database hits, cost model, roofline)
and build its executor (``PlanExecutor``: every kernel compiled once, buffers once, one CUDA
graph); (2) run it on fresh random inputs and verify the outputs against the float64 reference
interpreter (the collector's tolerance) and, for ONNX models, against onnxruntime on the CPU
(weights and inputs drawn as a freshly initialised network has them: ``make_inputs``' roles,
``weighted_model`` for an ONNX model's stripped weights); (3) time it in throughput mode
(``peers.throughput_us`` on graph replays) next to torch eager, torch.compile (default mode,
dynamic=False), torch.compile mode="reduce-overhead" (CUDA graphs) and jax.jit, all translated from
the SAME tunedb Graph on the same input values, each checked against the reference. TF32 is off
everywhere (torch ``allow_tf32 = False``, JAX ``highest`` matmul precision, CuPy without
``CUPY_TF32``). Each graph also reports the plan's kernel count next to the op-by-op count (its
non-view nodes). One failing graph or peer is recorded with its error; the JSON is rewritten after
every graph.

The summary separates the two claims a run makes: over the memory-bound subgraphs (graphs
without a matmul, gemm, convolution or pooling: the fusion anchors, the exported fusion-suite
subgraphs, LayerNorm backward) the geomean speedup of tunedb over JAX and over torch.compile;
over the whole models, each one's kernel-count reduction versus running it op by op.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import BenchError, _finite, _one_line, _versions, geomean, rel_l2, write_json
from tunedb.bench.peers import Frameworks, outputs_float64, peer_call, throughput_us
from tunedb.bench.provenance import provenance
from tunedb.graph.ir import Graph
from tunedb.graph.ops import COMPUTE_OPS, infer_graph
from tunedb.kernels.suites import ANCHOR_CASES
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.driver import load_graph
from tunedb.plan.subgraph import is_view
from tunedb.runtime.device import clocks, device_info, import_cupy
from tunedb.runtime.executor import PlanExecutor
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.measure import context_ok
from tunedb.runtime.tolerance import check_host, reference_and_exp_span, tolerance

PEERS = ("torch_eager", "torch_compile", "torch_compile_ro", "jax")
PEER_LABELS = {"torch_eager": "torch eager", "torch_compile": "torch.compile",
               "torch_compile_ro": "compile reduce-overhead", "jax": "jax.jit"}
PROTOCOL = ("throughput: back-to-back runs (tunedb: CUDA graph replays of the whole plan), "
            "synchronize, wall time / runs, median of 5 batches after 3 warm-ups; inputs on the device")
INPUT_SEED = 20240531  # the verification inputs (the executor's own warm-up uses seed 0)
INPUTS = ("by role (make_inputs): conv/matmul weights normal(0, 1/sqrt(fan_in)), norm scales "
          "~1, shifts ~0, variances > 0, data standard normal; ONNX stripped weights alike")
ORT_SLACK = 4.0        # onnxruntime computes in float32 as well: tolerance x this


def _shown(path: Path) -> str:
    """The path as results record it: relative to the working directory when under it, so a
    result file names the repository's files and not the machine's folders."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@dataclass
class Entry:
    """One graph to benchmark: a model file, or a graph given directly (anchors)."""

    name: str
    source: str
    path: Path | None = None
    graph: Graph | None = None
    bindings: dict[str, int] = field(default_factory=dict)
    batch: int | None = None
    error: str = ""  # set when the entry cannot run (a static model at another --batch)


def _onnx_inputs(path: Path) -> list[Any]:
    from tunedb.graph.onnx_import import load_model, stripped_names

    model = load_model(path)
    weights = set(stripped_names(model)) | {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in weights]


def batch_bindings(path: Path, batch: int) -> dict[str, int]:
    """Bindings that run ``path`` at ``batch``: every symbolic leading dim of its data inputs.
    A model with static shapes only runs at its own batch (else ``BenchError``)."""
    if path.suffix != ".onnx":
        raise BenchError(f"--batch needs an ONNX model with a symbolic batch dim; {path.name} is not one")
    out: dict[str, int] = {}
    static = None
    for vi in _onnx_inputs(path):
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].dim_param:
            out[dims[0].dim_param] = batch
        elif dims and static is None:
            static = int(dims[0].dim_value)
    if not out and static != batch:
        raise BenchError(f"{path.name} has a static batch of {static}; --batch {batch} needs a model "
                         "with a symbolic batch dim")
    return out


def collect_entries(models: Sequence[Path], graphs_dir: Path | None = None, anchors: bool = True,
                    batches: Sequence[int] = (), bindings: dict[str, int] | None = None) -> list[Entry]:
    """The graphs of one run: ``models``, then every ``*.onnx`` / ``*.json`` in ``graphs_dir``
    (sorted), then (with ``graphs_dir`` and ``anchors``, or a model named ``anchors``) the 12
    fusion anchor subgraphs. ``batches`` repeats each ONNX model at those batch sizes."""
    want_anchors = graphs_dir is not None and anchors
    paths = []
    for m in models:
        if str(m) == "anchors" and not Path(m).exists():
            want_anchors = True
        else:
            paths.append(Path(m))
    explicit = set(paths)
    if graphs_dir is not None:
        if not graphs_dir.is_dir():
            raise BenchError(f"--graphs {graphs_dir} is not a directory")
        # A folder's manifest.json (data/graphs/zoo, generalization) describes it; it is no graph.
        found = sorted(p for p in graphs_dir.iterdir()
                       if p.suffix in (".onnx", ".json") and p.is_file() and p.name != "manifest.json")
        if not found:
            raise BenchError(f"--graphs {graphs_dir} holds no .onnx or .json graph")
        paths += [p for p in found if p not in paths]
    out: list[Entry] = []
    for p in paths:
        if not p.is_file():
            raise BenchError(f"no such model file: {p}")
        if p.suffix not in (".onnx", ".json"):
            raise BenchError(f"{p} is neither an ONNX model (.onnx) nor a tunedb graph JSON (.json)")
        for b in (batches or [None]):
            bind = dict(bindings or {})
            name, error = p.stem, ""
            if b is not None:
                name = f"{p.stem} b{b}"
                try:
                    bind.update(batch_bindings(p, b))
                except BenchError as e:
                    if p in explicit:
                        raise
                    error = str(e)  # a graph of the folder: recorded, the others still run
            out.append(Entry(name, _shown(p), path=p, bindings=bind, batch=b, error=error))
    if want_anchors:
        out += [Entry(c.name, "anchor", graph=c.graph) for c in ANCHOR_CASES]
    if not out:
        raise BenchError("nothing to run: give MODEL files or --graphs DIR")
    return out


def load_entry(entry: Entry) -> tuple[Graph, Any]:
    """The entry's graph (stripped weights filled with their seeded values) and, for ONNX, the
    filled ``ModelProto`` onnxruntime runs."""
    if entry.graph is not None:
        return infer_graph(entry.graph), None
    assert entry.path is not None
    if entry.path.suffix == ".json":
        return load_graph(str(entry.path)), None
    model = weighted_model(entry.path, entry.bindings)
    from tunedb.graph.onnx_import import import_onnx

    return import_onnx(model, entry.bindings or None), model


WEIGHT_SEED = 0  # the stripped weights' values (the inputs have their own seed)


def weighted_model(path: Path, bindings: dict[str, int] | None = None) -> Any:
    """The ONNX model with its stripped weights embedded again, drawn as a freshly initialised
    network has them (``make_inputs``' roles: convolution and matmul weights normal(0,
    1/sqrt(fan_in)), norm scales near 1, shifts near 0, variances positive): each layer keeps
    its activations' scale, where uniform noise grows them by ~sqrt(fan_in) a layer."""
    from tunedb.graph.onnx_import import fill_model, import_onnx, load_model, stripped_names

    model = load_model(path)
    names = set(stripped_names(model))
    if not names:
        return fill_model(model)
    bare = import_onnx(model, bindings or None)  # stripped weights are graph inputs here
    _, values = make_inputs(bare, WEIGHT_SEED)
    return fill_model(model, values={k: v for k, v in values.items() if k in names})


def op_by_op_count(graph: Graph) -> int:
    """Kernels an op-by-op executor launches: every node that is not a free view."""
    types = graph.type_map
    return sum(1 for n in graph.nodes if not is_view(n, types))


def is_memory_bound(graph: Graph) -> bool:
    """A graph of memory-intensive ops only (no matmul, gemm, convolution or windowed pooling)."""
    return not any(n.op in COMPUTE_OPS for n in graph.nodes)


def verify(graph: Graph, outs: dict[str, np.ndarray], refs: dict[str, np.ndarray],
           slack: float = 1.0, exp_span: float = 0.0) -> dict:
    """Outputs against reference arrays with the collector's tolerance (times ``slack``;
    ``exp_span``: the reference's exp-argument span, see ``tolerance``)."""
    res: dict[str, Any] = {"ok": True, "max_abs_err": 0.0, "rel_err": 0.0, "worst_output": None}
    for v in graph.outputs:
        t = graph.type_of(v)
        ok, err = check_host(outs[v], refs[v], tolerance(graph, t.dtype, exp_span).scaled(slack))
        rel = rel_l2(outs[v], refs[v])
        if not ok:
            res["ok"] = False
        if not ok or err > res["max_abs_err"]:
            res["worst_output"] = v
        res["max_abs_err"] = max(res["max_abs_err"], err)
        res["rel_err"] = max(res["rel_err"], rel)
    res["max_abs_err"], res["rel_err"] = _finite(res["max_abs_err"]), _finite(res["rel_err"])
    return res


def onnxruntime_outputs(model: Any, graph: Graph, dev: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime (CPU) on the same input values, mapped to the graph's outputs by position."""
    import onnxruntime as ort

    if any(graph.type_of(v).dtype == "bfloat16" for v in graph.inputs):
        raise BenchError("onnxruntime check skipped: bfloat16 inputs")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    missing = [n for n in names if n not in dev]
    if missing:
        raise BenchError(f"onnxruntime wants input(s) the graph does not have: {', '.join(missing)}")
    res = sess.run(None, {n: dev[n] for n in names})
    if len(res) != len(graph.outputs):
        raise BenchError(f"onnxruntime gives {len(res)} outputs, the graph {len(graph.outputs)}")
    return {v: np.asarray(r) for v, r in zip(graph.outputs, res)}


# -- one graph on the GPU -------------------------------------------------------------------------
def _peer(fw: Any, kind: str, graph: Graph, dev: dict, refs: dict,
          timer: Callable[..., float] = throughput_us) -> dict:
    res: dict[str, Any] = {"us": None, "rel_err": None, "error": None}
    try:
        run, sync = peer_call(fw, kind, graph, dev)
        outs = outputs_float64(run())  # copied out at once: reduce-overhead reuses the memory
        sync()
        res["rel_err"] = _finite(max(rel_l2(o, refs[v]) for o, v in zip(outs, graph.outputs)))
        del outs
        res["us"] = _finite(timer(run, sync))
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
        res.update(us=None, error=_one_line(e))
    return res


def run_entry(entry: Entry, fw: Any, peers: Sequence[str], db: Any, cost_model: Any,
              say: Callable[[str], None], timer: Callable[..., float] = throughput_us) -> dict:
    """Everything for one graph; never raises (failures become ``error`` fields). ``timer``
    times a ``(run, sync)`` pair (a parallel driver passes one that holds the GPU alone)."""
    rec: dict[str, Any] = {"name": entry.name, "source": entry.source, "batch": entry.batch,
                           "bindings": entry.bindings, "tunedb": {"us": None, "error": None}, "peers": {}}
    if entry.error:
        rec["error"] = rec["tunedb"]["error"] = entry.error
        return rec
    try:
        graph, model = load_entry(entry)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"import failed: {_one_line(e)}"
        return rec
    rec["graph"] = {"nodes": len(graph.nodes), "op_by_op": op_by_op_count(graph),
                    "memory_bound": is_memory_bound(graph),
                    "inputs": {v: str(graph.type_of(v)) for v in graph.inputs},
                    "outputs": {v: str(graph.type_of(v)) for v in graph.outputs}}
    try:
        dev, ref_in = make_inputs(graph, INPUT_SEED)
        refs, span = reference_and_exp_span(graph, ref_in)
        rec["graph"]["exp_span"] = span
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"reference failed: {_one_line(e)}"
        return rec
    ex = None
    try:
        t0 = time.perf_counter()
        plan = compile_plan(graph, db=db, cost_model=cost_model, device="cuda")
        totals = plan.totals()
        rec["plan"] = {"steps": totals["steps"], "kernels": plan.kernels,
                       "predicted_us": totals["predicted_us"], "by_kind": totals["by_kind"],
                       "cost_sources": totals["cost_sources"],
                       "plan_s": round(time.perf_counter() - t0, 3)}
        ex = PlanExecutor(plan)
        rec["plan"].update(ex.summary())
        say(f"{entry.name}: {plan.kernels} kernel(s) planned ({rec['graph']['op_by_op']} op by op), "
            f"{ex.launches} launch(es), graph capture {'on' if ex.graph_capture else 'off'}"
            + (f" ({ex.capture_error})" if ex.capture_error else ""))
        got = _host(ex.run(dev))
        rec["verify"] = {"reference": verify(graph, got, refs, exp_span=span)}
        if model is not None:
            try:
                ort_out = onnxruntime_outputs(model, graph, dev)
                rec["verify"]["onnxruntime"] = verify(graph, got, ort_out, ORT_SLACK, span)
                rec["verify"]["onnxruntime_vs_reference"] = verify(graph, ort_out, refs, ORT_SLACK,
                                                                    span)
            except Exception as e:  # noqa: BLE001
                rec["verify"]["onnxruntime"] = {"ok": None, "error": _one_line(e)}
        rec["tunedb"]["us"] = _finite(timer(ex.replay, ex.synchronize))
    except Exception as e:  # noqa: BLE001 - recorded; the peers still run
        rec["tunedb"]["error"] = _one_line(e)
    finally:
        del ex
        _free(fw)
    for p in peers:  # the same input values (bfloat16 as its bits, as the executor took them)
        rec["peers"][p] = _peer(fw, p, graph, dev, refs, timer)
        _free(fw)
    t = rec["tunedb"]["us"]
    rec["speedup"] = {p: _finite(rec["peers"][p]["us"] / t) if t and rec["peers"][p]["us"] else None
                      for p in peers}
    return rec


def _host(outs: dict[str, Any]) -> dict[str, np.ndarray]:
    import cupy

    return {k: cupy.asnumpy(v) for k, v in outs.items()}


def _free(fw: Any) -> None:
    gc.collect()  # closures of the peers and executors hold device arrays
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 - memory hygiene only
        pass
    try:
        if fw is not None and fw.torch is not None:
            fw.torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _tf32_off(fw: Any) -> dict[str, Any]:
    """Peers in true float32, like the executor's cuBLAS GEMMs."""
    state: dict[str, Any] = {"cupy": os.environ.get("CUPY_TF32", "0") not in ("", "0")}
    if fw.torch is not None:
        fw.torch.backends.cuda.matmul.allow_tf32 = False
        fw.torch.backends.cudnn.allow_tf32 = False
        state["torch"] = False
    if fw.jax is not None:
        try:
            fw.jax.config.update("jax_default_matmul_precision", "highest")
            state["jax"] = "highest"
        except Exception as e:  # noqa: BLE001
            state["jax"] = f"default ({_one_line(e, 120)})"
    return state


# The targets for the memory-bound subgraphs: geomean speedup over each peer.
MEMORY_BOUND_TARGETS = {"jax": 1.5, "torch_compile": 1.1}


def _memory_bound(e: dict) -> bool:
    mb = (e.get("graph") or {}).get("memory_bound")
    return bool(mb) if mb is not None else e.get("source") == "anchor"  # results without the flag


def summarize(result: dict) -> dict:
    """Verified count and geomean speedups of tunedb over each peer (graphs where both ran);
    ``memory_bound``: the geomean speedups over the memory-bound subgraphs alone;
    ``models``: per whole model, its op-by-op count, plan kernels and their ratio."""
    entries = result.get("entries", [])
    out: dict[str, Any] = {"graphs": len(entries), "timed": 0, "verified": 0, "failed": []}
    for e in entries:
        ok = ((e.get("verify") or {}).get("reference") or {}).get("ok")
        out["verified"] += bool(ok)
        out["timed"] += bool(e.get("tunedb", {}).get("us"))
        if not ok or not e.get("tunedb", {}).get("us"):
            out["failed"].append(e.get("name"))
    for p in PEERS:
        sp = [s for e in entries if (s := (e.get("speedup") or {}).get(p))]
        out[f"speedup_vs_{p}"] = _finite(geomean(sp))
        out[f"min_speedup_vs_{p}"] = _finite(min(sp)) if sp else None
    mem = [e for e in entries if _memory_bound(e)]
    mb: dict[str, Any] = {"graphs": [e.get("name") for e in mem]}
    for p in PEERS:
        # Only verified plans count: a fast wrong kernel is no speedup.
        sp = [s for e in mem if (s := (e.get("speedup") or {}).get(p))
              and ((e.get("verify") or {}).get("reference") or {}).get("ok")]
        mb[f"speedup_vs_{p}"] = _finite(geomean(sp))
        mb[f"min_speedup_vs_{p}"] = _finite(min(sp)) if sp else None
        mb[f"n_vs_{p}"] = len(sp)
    out["memory_bound"] = mb
    models = []
    for e in entries:
        ops, kernels = (e.get("graph") or {}).get("op_by_op"), (e.get("plan") or {}).get("kernels")
        if _memory_bound(e) or not ops or not kernels:
            continue
        models.append({"name": e.get("name"), "op_by_op": ops, "kernels": kernels,
                       "launches": (e.get("plan") or {}).get("launches"),
                       "reduction": _finite(ops / kernels)})
    out["models"] = models
    return out


def summary_lines(result: dict) -> list[str]:
    """The memory-bound geomeans and each model's kernel-count reduction, as text lines."""
    s = result.get("summary") or summarize(result)
    peers = [p for p in ("jax", "torch_compile") if p in result.get("peers", PEERS)]
    mb = s.get("memory_bound") or {}
    lines = []
    if mb.get("graphs"):
        parts = []
        for p in peers:
            target = MEMORY_BOUND_TARGETS.get(p)
            parts.append(f"{fmt(mb.get(f'speedup_vs_{p}'), 2)}x over {PEER_LABELS[p]} "
                         f"(min {fmt(mb.get(f'min_speedup_vs_{p}'), 2)}x, {mb.get(f'n_vs_{p}', 0)} graphs"
                         + (f", target {target:g}x" if target else "") + ")")
        lines.append(f"memory-bound subgraphs ({len(mb['graphs'])}): geomean "
                     + ("; ".join(parts) if parts else "no JAX / torch.compile peer in this run"))
    for m in s.get("models") or []:
        lines.append(f"{m['name']}: {m['op_by_op']} ops op by op -> {m['kernels']} kernels "
                     f"({fmt(m.get('reduction'), 2)}x fewer)")
    return lines


def run_bench(entries: list[Entry], out: Path | None, db: Any = None, cost_model: Any = None,
              peers: Sequence[str] = PEERS, time_limit_s: float = 0.0,
              progress: Callable[[str], None] | None = None,
              on_entry: Callable[[int, int, dict], None] | None = None) -> dict:
    """Run every entry on the local GPU (``NoGPUError`` without one); returns the result dict,
    also written to ``out`` after every graph. ``time_limit_s`` > 0: no new graph starts after."""
    say = progress or (lambda _line: None)
    cp = import_cupy()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise BenchError(f"unknown peer(s) {', '.join(bad)}; expected some of {', '.join(PEERS)}")
    t0 = time.monotonic()
    info = device_info()
    result: dict[str, Any] = {
        "benchmark": "plan", "protocol": PROTOCOL, "inputs": INPUTS,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"id": info.id, **asdict(info)}, "env": _versions(), "clocks_before": clocks(),
        "peers": list(peers), "entries": [], "complete": False, "stopped": "", "notes": [],
        **provenance()}
    say(f"device {info.name} ({info.sm_count} SMs), driver {info.driver}, CUDA {info.cuda_runtime}")
    fw = Frameworks() if peers else None
    if fw is not None:
        for err in fw.errors.values():
            result["notes"].append(err)
            say(err)
        result["tf32"] = _tf32_off(fw)

    def save() -> None:
        result.update(summary=summarize(result), elapsed_s=round(time.monotonic() - t0, 1))
        if out is not None:
            write_json(result, out)

    for i, entry in enumerate(entries, 1):
        if time_limit_s > 0 and time.monotonic() - t0 > time_limit_s:
            result["stopped"] = f"time limit {time_limit_s:g}s: skipped {len(entries) - i + 1} graph(s)"
            say(result["stopped"])
            break
        te = time.monotonic()
        try:
            rec = run_entry(entry, fw, peers, db, cost_model, say)
        except Exception as e:  # noqa: BLE001 - one broken graph must not end the run
            rec = {"name": entry.name, "source": entry.source, "error": f"failed: {_one_line(e)}",
                   "tunedb": {"us": None, "error": _one_line(e)}, "peers": {}}
        rec["elapsed_s"] = round(time.monotonic() - te, 1)
        result["entries"].append(rec)
        save()
        if on_entry is not None:
            on_entry(i, len(entries), rec)
        if not context_ok(cp):
            result["stopped"] = f"CUDA context lost after {entry.name}: nothing more can run here"
            say(result["stopped"])
            break
    else:
        result["complete"] = True
    result["clocks_after"] = clocks()
    save()
    return result


def fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"

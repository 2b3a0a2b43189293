"""Host-side (NumPy, no GPU) parts of the measurement protocol: verification inputs, the float64
reference, poison values and tolerances. Kept apart from ``measure`` so they are tested on CPU."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from tunedb.graph.ir import FLOAT_DTYPES, Graph, Node

# Base tolerances by dtype: (atol, rtol, machine epsilon). Kernels compute in float32 and round
# once on store, so rtol sits a few ulps above the storage dtype's epsilon.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (1e-5, 1e-4, 1.19e-7),
    "float16": (1e-3, 1e-2, 9.77e-4),
    "bfloat16": (8e-3, 2e-2, 7.81e-3),
}
# bfloat16 NaN (quiet) as raw bits: the poison for bf16 outputs.
BF16_NAN_BITS = 0x7FC0
BOOL_POISON = 0xFF


def storage_dtype(dtype: str) -> np.dtype:
    """How a graph dtype is held in device memory: bfloat16 as its uint16 bits."""
    if dtype == "bfloat16":
        return np.dtype(np.uint16)
    if dtype == "bool":
        return np.dtype(np.bool_)
    return np.dtype(dtype)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float values to bfloat16 (nearest even) and return the raw uint16 bits."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    bits = f.view(np.uint32)
    # uint32 arithmetic (in place, no 64-bit temporaries): only NaN bit patterns can wrap
    # around, and those are overwritten below.
    lsb = bits >> 16
    lsb &= 1
    lsb += 0x7FFF
    lsb += bits
    lsb >>= 16
    out = lsb.astype(np.uint16)
    out[np.isnan(f)] = BF16_NAN_BITS
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def index_bounds(graph: Graph) -> dict[str, int]:
    """Exclusive upper bound for every graph input used as gather indices (indices in range)."""
    bounds: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("gather", "gather_elements") and len(node.inputs) >= 2:
            shape = graph.type_of(node.inputs[0]).shape
            axis = int(node.attr("axis", 0) or 0)
            axis = axis + len(shape) if axis < 0 else axis
            dim = shape[axis] if 0 <= axis < len(shape) else 1
            idx = node.inputs[1]
            bounds[idx] = min(bounds.get(idx, dim), dim) if idx in bounds else dim
    return bounds


def workload_seed(workload_hash: str) -> int:
    """Deterministic per workload, so a re-run verifies on the same data."""
    return int(workload_hash[:12], 16) if workload_hash else 0


def make_inputs(graph: Graph, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Fresh random inputs: ``(device_arrays, reference_arrays)``.

    Floats are standard normal drawn in float64 and rounded to the dtype (never zeros); bfloat16
    goes to the device as uint16 bits and to the reference as float32 holding the rounded values.
    Integer inputs feeding a gather are indices in range; other integers are 0 or 1: outside
    indexing they are masks (BERT's attention mask is scaled by -3.4e38 after ``1 - mask``, which
    any other value overflows in float32 but not in the float64 reference).
    """
    rng = np.random.default_rng(seed)
    bounds = index_bounds(graph)
    dev: dict[str, np.ndarray] = {}
    ref: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        t = graph.type_of(name)
        shape = t.shape
        if t.dtype in FLOAT_DTYPES:
            x = rng.standard_normal(shape)
            if t.dtype == "bfloat16":
                bits = bf16_bits(x.astype(np.float32))
                dev[name], ref[name] = bits, bf16_to_f32(bits).reshape(shape)
            else:
                a = x.astype(t.dtype)
                dev[name], ref[name] = a, a
        elif t.dtype == "bool":
            a = rng.random(shape) < 0.5
            dev[name], ref[name] = a, a
        else:
            high = max(1, bounds.get(name, 2))
            a = rng.integers(0, high, size=shape).astype(t.dtype)
            dev[name], ref[name] = a, a
        dev[name] = np.ascontiguousarray(dev[name])
    return dev, ref


def reference_outputs(graph: Graph, ref_inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 oracle's outputs as float32 (what is uploaded for the on-GPU comparison)."""
    from tunedb.graph.reference import run_reference

    outs = run_reference(graph, ref_inputs)
    result = {}
    for name in graph.outputs:
        a = np.asarray(outs[name])
        result[name] = np.ascontiguousarray(a.astype(np.float32) if a.dtype != np.float32 else a)
    return result


def _prod(xs: list[int] | tuple[int, ...]) -> int:
    return int(math.prod(int(x) for x in xs)) if xs else 1


def accumulated_terms(graph: Graph, node: Node) -> int:
    """Terms one output element of ``node`` accumulates (1 for ops that accumulate nothing)."""
    try:
        shape = graph.type_of(node.inputs[0]).shape if node.inputs else ()
    except ValueError:
        return 1
    if node.op.startswith("reduce_"):
        axes = node.attr("axes")
        if axes is None or axes == ():
            return _prod(shape)
        return _prod([shape[a] for a in axes if -len(shape) <= a < len(shape)])
    if node.op == "argmax":
        ax = int(node.attr("axis", 0) or 0)
        return shape[ax] if shape and -len(shape) <= ax < len(shape) else 1
    if node.op in ("matmul", "gemm") and shape:
        return shape[0] if node.op == "gemm" and node.attr("trans_a") else shape[-1]
    if node.op == "conv2d" and len(node.inputs) > 1:
        return _prod(graph.type_of(node.inputs[1]).shape[1:])
    if node.op in ("avg_pool2d", "max_pool2d"):
        return _prod(node.attr("kernel", (1, 1)))
    if node.op in ("global_avg_pool", "global_max_pool") and len(shape) > 2:
        return _prod(shape[2:])
    return 1


def reduction_length(graph: Graph) -> int:
    """The longest chain of accumulated terms any node performs (widens the absolute tolerance)."""
    return max((accumulated_terms(graph, n) for n in graph.nodes), default=1)


def tolerance(graph: Graph, out_dtype: str) -> tuple[float, float]:
    """``(atol, rtol)`` for one output: by the lowest-precision float dtype in the graph (or the
    output's), atol widened by sqrt(reduction length) * eps, and by n * eps for a sum of n terms:
    its partial sums grow like sqrt(n), so float32 accumulation errs by about eps * n where the
    total itself may be near 0 (onnxruntime's column sums over 65,536 rows err by 0.8 * n * eps).
    Integer/bool outputs must match."""
    if out_dtype not in FLOAT_DTYPES:
        return 0.0, 0.0
    dtypes = {t.dtype for _, t in graph.types if t.dtype in FLOAT_DTYPES} | {out_dtype}
    worst = max(dtypes, key=lambda d: TOLERANCES[d][2])
    atol, rtol, eps = TOLERANCES[worst]
    return atol + (math.sqrt(reduction_length(graph)) + sum_length(graph)) * eps, rtol


def sum_length(graph: Graph) -> int:
    """Terms of the longest ``reduce_sum`` (0 without one); means divide their error by n."""
    return max((accumulated_terms(graph, n) for n in graph.nodes if n.op == "reduce_sum"), default=0)


def poison_value(dtype: str) -> float | int:
    """Raw value written to outputs before the verify launch so unwritten elements fail."""
    if dtype in ("float32", "float16"):
        return float("nan")
    if dtype == "bfloat16":
        return BF16_NAN_BITS
    if dtype == "bool":
        return BOOL_POISON  # written through a uint8 view: neither 0 nor 1
    return int(np.iinfo(np.dtype(dtype)).min)


def check_host(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> tuple[bool, float]:
    """The comparison rule of the GPU check, on the host: ``(ok, max abs error)``. NaN fails
    unless the reference is NaN at that element; equal values (incl. infinities) pass."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(o - r)
        same = (o == r) | (np.isnan(o) & np.isnan(r))
        err = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
        bad = err > atol + rtol * np.abs(np.where(np.isfinite(r), r, 0.0))
    return (not bool(bad.any())), (float(err.max()) if err.size else 0.0)


# -- ahead-of-time preparation (a CPU process pool, see ``CudaDevice``) --------------------------
def prepare_workload(graph_json: dict, workload_hash: str, out_dir: str) -> dict:
    """Pool task: the workload's device inputs and float32 references as ``.npy`` files in
    ``out_dir``. Returns a JSON manifest ``{"dir", "inputs": {name: file}, "refs": {name: file},
    "seconds"}``, or ``{"error": one line}`` when the graph cannot be evaluated."""
    t0 = time.perf_counter()
    try:
        graph = Graph.from_json(graph_json)
        dev, ref = make_inputs(graph, workload_seed(workload_hash))
        refs = reference_outputs(graph, ref)
        del ref
        os.makedirs(out_dir, exist_ok=True)
        manifest: dict = {"dir": out_dir, "inputs": {}, "refs": {}}
        # Files are named by position: value names may hold characters no file name can.
        for kind, arrays in (("inputs", dev), ("refs", refs)):
            for i, (name, a) in enumerate(arrays.items()):
                fname = f"{kind}{i}.npy"
                np.save(os.path.join(out_dir, fname), np.ascontiguousarray(a), allow_pickle=False)
                manifest[kind][name] = fname
    except Exception as e:  # noqa: BLE001 - the worker reports it for every candidate
        text = " ".join(str(e).split())
        return {"error": f"{type(e).__name__}: {text}"[:1500], "seconds": time.perf_counter() - t0}
    manifest["seconds"] = time.perf_counter() - t0
    return manifest


def load_prepared(manifest: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(device inputs, references)`` written by ``prepare_workload`` (no pickles are loaded)."""
    d = str(manifest["dir"])
    dev = {k: np.load(os.path.join(d, f), allow_pickle=False) for k, f in manifest["inputs"].items()}
    refs = {k: np.load(os.path.join(d, f), allow_pickle=False) for k, f in manifest["refs"].items()}
    return dev, refs

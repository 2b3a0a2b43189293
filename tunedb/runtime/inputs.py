"""Host-side (NumPy, no GPU) parts of the measurement protocol: verification inputs, the float64
reference and poison values (the tolerances are ``tunedb.runtime.tolerance``). Kept apart from
``measure`` so they are tested on CPU."""

from __future__ import annotations

import os
import time

import numpy as np

from tunedb.graph.ir import FLOAT_DTYPES, Graph, Node
from tunedb.graph.reference import run_reference

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


# Ops that pass a value on unchanged in content (the weight behind a transposed view is the weight).
_VIEW_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "transpose", "expand", "identity", "cast"))
# Ops whose input must be positive for a real model (a variance under a root, a divisor).
_POSITIVE_OPS = frozenset(("sqrt", "rsqrt", "log", "reciprocal"))


def _uses(graph: Graph) -> dict[str, list[tuple[Node, int]]]:
    uses: dict[str, list[tuple[Node, int]]] = {}
    for node in graph.nodes:
        for slot, v in enumerate(node.inputs):
            uses.setdefault(v, []).append((node, slot))
    return uses


def _reach(value: str, uses: dict[str, list[tuple[Node, int]]]) -> list[tuple[Node, int, str]]:
    """The uses of ``value`` and of its views: ``(node, slot, value as the node reads it)``."""
    out, todo, seen = [], [value], {value}
    while todo:
        v = todo.pop()
        for node, slot in uses.get(v, ()):
            if node.op in _VIEW_OPS and slot == 0:
                for o in node.outputs:
                    if o not in seen:
                        seen.add(o)
                        todo.append(o)
            else:
                out.append((node, slot, v))
    return out


def _positive(graph: Graph, uses: dict, reached: list[tuple[Node, int, str]]) -> bool:
    """Read under a root, a log or as a divisor, directly or after adding a constant (var + eps)."""
    consts = set(graph.constant_map)
    for node, slot, _ in reached:
        if node.op in _POSITIVE_OPS or (node.op == "div" and slot == 1):
            return True
        if node.op == "add" and any(v in consts for i, v in enumerate(node.inputs) if i != slot):
            if any(n.op in _POSITIVE_OPS or (n.op == "div" and s == 1)
                   for o in node.outputs for n, s, _ in _reach(o, uses)):
                return True
    return False


def input_roles(graph: Graph) -> dict[str, tuple[str, int]]:
    """What each float graph input is to the model, read from how the graph uses it:
    ``("weight", fan_in)`` (a convolution's filter, a matmul's or gemm's right operand, through
    views), ``("positive", 0)`` (under a root or a log, a divisor: a running variance),
    ``("shift", 0)`` (a convolution's or gemm's bias; a smaller-than-data input added or
    subtracted: a norm's shift, a running mean), ``("scale", 0)`` (a smaller-than-data input
    multiplied: a norm's scale) or ``("data", 0)``."""
    uses = _uses(graph)
    floats = [v for v in graph.inputs if graph.type_of(v).dtype in FLOAT_DTYPES]
    biggest = max((graph.type_of(v).numel for v in floats), default=0)
    roles: dict[str, tuple[str, int]] = {}
    for v in floats:
        reached = _reach(v, uses)
        role: tuple[str, int] = ("data", 0)
        for node, slot, seen in reached:
            shape = graph.type_of(seen).shape
            if node.op == "conv2d" and slot == 1:
                role = ("weight", _prod(shape[1:]))
            elif node.op == "matmul" and slot == 1 and shape:
                role = ("weight", shape[-2] if len(shape) >= 2 else shape[0])
            elif node.op == "gemm" and slot == 1 and len(shape) == 2:
                role = ("weight", shape[1] if node.attr("trans_b") else shape[0])
            if role[0] == "weight":
                break
        if role[0] == "data" and _positive(graph, uses, reached):
            role = ("positive", 0)
        if role[0] == "data" and any(n.op in ("conv2d", "gemm") and s == 2 for n, s, _ in reached):
            role = ("shift", 0)
        if role[0] == "data" and graph.type_of(v).numel < biggest and reached:
            ops = {n.op for n, _, _ in reached}
            if ops <= {"mul"}:
                role = ("scale", 0)
            elif ops <= {"add", "sub"}:
                role = ("shift", 0)
        roles[v] = role
    return roles


def _prod(xs: tuple[int, ...] | list[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def draw_float(rng: np.random.Generator, role: tuple[str, int], shape: tuple[int, ...]) -> np.ndarray:
    """float64 values for an input of this role, as a freshly initialised network has them:
    weights normal(0, 1/sqrt(fan_in)) (so each layer keeps its activations' scale), scales
    near 1, shifts near 0, variances positive near 1, data standard normal."""
    kind, fan_in = role
    x = rng.standard_normal(shape)
    if kind == "weight":
        return x / np.sqrt(max(1, fan_in))
    if kind == "scale":
        return 1.0 + 0.1 * x
    if kind == "shift":
        return 0.1 * x
    if kind == "positive":
        return np.exp(0.25 * x)
    return x


def make_inputs(graph: Graph, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Fresh random inputs: ``(device_arrays, reference_arrays)``.

    Floats are drawn in float64 by their role in the graph (``input_roles``, ``draw_float``:
    weights at their fan-in scale, norm scales near 1, shifts near 0, variances positive, data
    standard normal, never zeros) and rounded to the dtype. Uniform noise on every input made a
    correct ResNet-18 plan overflow to 1e19: each convolution multiplied the activations' scale
    by about sqrt(fan_in). bfloat16 goes to the device as uint16 bits and to the reference as
    float32 holding the rounded values. Integer inputs feeding a gather are indices in range;
    other integers are 0 or 1: outside indexing they are masks (BERT's attention mask is scaled
    by -3.4e38 after ``1 - mask``, which any other value overflows in float32 but not in the
    float64 reference).
    """
    rng = np.random.default_rng(seed)
    bounds = index_bounds(graph)
    roles = input_roles(graph)
    dev: dict[str, np.ndarray] = {}
    ref: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        t = graph.type_of(name)
        shape = t.shape
        if t.dtype in FLOAT_DTYPES:
            x = draw_float(rng, roles.get(name, ("data", 0)), shape)
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
    outs = run_reference(graph, ref_inputs)
    result = {}
    for name in graph.outputs:
        a = np.asarray(outs[name])
        result[name] = np.ascontiguousarray(a.astype(np.float32) if a.dtype != np.float32 else a)
    return result


def poison_value(dtype: str) -> float | int:
    """Raw value written to outputs before the verify launch so unwritten elements fail."""
    if dtype in ("float32", "float16"):
        return float("nan")
    if dtype == "bfloat16":
        return BF16_NAN_BITS
    if dtype == "bool":
        return BOOL_POISON  # written through a uint8 view: neither 0 nor 1
    return int(np.iinfo(np.dtype(dtype)).min)


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

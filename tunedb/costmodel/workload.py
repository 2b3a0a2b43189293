"""Per-workload facts for the cost model: traffic, arithmetic, reductions and the 2-D domain.

A fused memory-bound kernel is viewed as a 2-D domain [R, C]: R rows of C contiguous elements.
The fused-kernel generator's own analysis (``tunedb.kernels.analysis``) gives the domain, the
pattern (elementwise, row_reduce, col_reduce, transpose, multi), reduction levels and what a row
cache must hold; graphs outside the generator still get a domain from the dominant reduction or
the largest tensor, with the generator-only facts missing (NaN). Everything here depends on the
graph alone, so it is computed once per workload (cached by workload hash).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.ir import DTYPE_BYTES, Graph, GraphError, TensorType
from tunedb.graph.ops import COMPUTE_OPS, LAYOUT_OPS, OTHER_REDUCTIONS, REDUCTIONS, reduction_axes
from tunedb.kernels.analysis import COL, FULL, ROW, TRANS, analyze
from tunedb.kernels.passes import cache_values
from tunedb.kernels.schedule import full_bytes

# Ops whose per-element cost is dominated by the special-function unit (MUFU) or a long
# instruction sequence; counted separately from plain arithmetic.
TRANSCENDENTAL: frozenset[str] = frozenset((
    "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "erf", "gelu", "pow"))
# Rough instruction counts per element; only the order of magnitude matters to the model.
_OP_FLOPS: dict[str, float] = {"div": 4.0, "mod": 4.0, "gelu": 8.0, "pow": 4.0, "erf": 6.0,
                               "sigmoid": 3.0, "tanh": 3.0, "leaky_relu": 2.0, "clip": 2.0}

# "unsupported": outside the fused-kernel generator (its analysis raised).
PATTERNS: tuple[str, ...] = ("elementwise", "row_reduce", "col_reduce", "transpose", "multi", "unsupported")

WORKLOAD_FEATURES: tuple[str, ...] = (
    "n_nodes", "n_inputs", "n_outputs", "n_constants",
    "bytes_in", "bytes_out", "floor_bytes", "unfused_bytes",
    "flops", "transcendental_ops", "n_transcendental_nodes",
    "n_reductions", "n_row_reductions", "n_col_reductions",
    "max_reduction_len", "max_row_reduction_len", "max_col_reduction_len", "reduced_elements",
    "rows", "row_len", "domain_elements", "dtype_bytes", "min_dtype_bytes",
    "main_bytes", "n_broadcast_inputs", "n_transposes", "n_layout_ops", "matmul_flops",
    "reduction_passes",
    *(f"pattern_{p}" for p in PATTERNS),
    "row_levels", "col_levels", "n_transposed_inputs", "n_full_values", "n_row_values", "n_col_values",
    "vec_elem_bytes", "n_cache_boundary", "n_cache_inputs", "full_in_bytes", "has_post_col_outputs",
)

_CACHE_SIZE = 4096
_cache: OrderedDict[str, np.ndarray] = OrderedDict()


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape)) if shape else 1


def _is_row_reduction(axes: tuple[int, ...], rank: int) -> bool:
    """A reduction that includes the contiguous last axis: threads of a row read coalesced."""
    return rank > 0 and (rank - 1) in axes


def kernel_facts(graph: Graph) -> dict[str, float]:
    """Facts from the fused-kernel generator's analysis; pattern 'unsupported' and NaN for the
    rest when the generator cannot take the graph."""
    nan = float("nan")
    out: dict[str, float] = {f"pattern_{p}": 0.0 for p in PATTERNS}
    try:
        a = analyze(graph)
        boundary, inputs = cache_values(a, "boundary"), cache_values(a, "inputs")
    except (ImportError, ValueError, KeyError):  # UnsupportedFusion and GraphError are ValueErrors
        out["pattern_unsupported"] = 1.0
        return out | {k: nan for k in ("R", "C", "row_levels", "col_levels", "n_transposed_inputs",
                                       "n_full_values", "n_row_values", "n_col_values", "vec_elem_bytes",
                                       "n_cache_boundary", "n_cache_inputs", "full_in_bytes",
                                       "has_post_col_outputs")}
    cls, dep, types = a.cls, a.dep, graph.type_map
    out[f"pattern_{a.pattern}"] = 1.0
    counts = {k: float(sum(1 for c in cls.values() if c == k)) for k in (FULL, ROW, COL)}
    full_in = sum(types[v].nbytes for v in graph.inputs if cls.get(a.resolve(v)) in (FULL, TRANS))
    post = any(cls.get(a.resolve(v)) == FULL and dep.get(a.resolve(v), 0) > 0 for v in graph.outputs)
    return out | {
        "R": float(a.R), "C": float(a.C),
        "row_levels": float(a.row_levels), "col_levels": float(a.col_levels),
        "n_transposed_inputs": float(len(a.transposed_inputs)), "n_full_values": counts[FULL],
        "n_row_values": counts[ROW], "n_col_values": counts[COL], "vec_elem_bytes": float(full_bytes(a)),
        "n_cache_boundary": float(len(boundary)), "n_cache_inputs": float(len(inputs)),
        "full_in_bytes": float(full_in), "has_post_col_outputs": float(post and a.col_levels > 0),
    }


def analyze_graph(graph: Graph) -> dict[str, float]:
    """The workload's features by name (see WORKLOAD_FEATURES)."""
    types = graph.type_map
    consts = graph.constant_map
    used = {v for n in graph.nodes for v in n.inputs} | set(graph.outputs)

    def t(v: str) -> TensorType:
        try:
            return types[v]
        except KeyError:
            raise GraphError(f"value {v!r} has no type in graph {graph.name or '<unnamed>'}") from None

    ins = [t(v) for v in graph.inputs] + [c.type for k, c in consts.items() if k in used]
    outs = [t(v) for v in graph.outputs]
    bytes_in = float(sum(x.nbytes for x in ins))
    bytes_out = float(sum(x.nbytes for x in outs))
    all_types = list(types.values()) or [TensorType((), "float32")]
    main = max(all_types, key=lambda x: (x.numel, DTYPE_BYTES[x.dtype]))

    flops = trans = unfused = matmul = 0.0
    n_trans = n_transpose = n_layout = 0
    red: list[tuple[int, bool, TensorType, tuple[int, ...]]] = []  # (length, is_row, type, axes)
    for node in graph.nodes:
        in_t = [t(v) for v in node.inputs if v]
        out_t = [t(v) for v in node.outputs]
        unfused += sum(x.nbytes for x in in_t) + sum(x.nbytes for x in out_t)
        out_n = float(sum(x.numel for x in out_t))
        op = node.op
        if op in REDUCTIONS or op in OTHER_REDUCTIONS:
            axes = reduction_axes(node, in_t[0])
            length = _numel(tuple(in_t[0].shape[a] for a in axes))
            red.append((length, _is_row_reduction(axes, in_t[0].rank), in_t[0], axes))
            flops += float(in_t[0].numel)
        elif op in COMPUTE_OPS:
            if op in ("matmul", "gemm") and len(in_t) >= 2 and in_t[0].rank >= 1:
                k = in_t[0].shape[-1] if not (op == "gemm" and node.attr("trans_a")) else in_t[0].shape[0]
                matmul += 2.0 * out_n * k
            else:
                flops += out_n
        elif op in LAYOUT_OPS:
            n_layout += 1
            n_transpose += op == "transpose"
        else:
            flops += out_n * _OP_FLOPS.get(op, 1.0)
            if op in TRANSCENDENTAL:
                n_trans += 1
                trans += out_n

    # The 2-D domain: the dominant reduction's view if there is one, else the main tensor's.
    if red:
        length, is_row, rt, axes = max(red, key=lambda r: (r[2].numel, r[0]))
        if is_row:
            row_len = length
            rows = max(rt.numel // max(length, 1), 1)
        else:
            # Column reduction: rows are the reduced extent, C is what each output keeps.
            rows = length
            row_len = max(rt.numel // max(length, 1), 1)
        dom_dtype = rt.dtype
    else:
        row_len = main.shape[-1] if main.shape else 1
        rows = max(main.numel // max(row_len, 1), 1)
        dom_dtype = main.dtype
    float_sizes = [DTYPE_BYTES[x.dtype] for x in ins if x.dtype in ("float32", "float16", "bfloat16")]
    main_in = max((x.nbytes for x in ins), default=0)
    row_lens = [r[0] for r in red if r[1]]
    col_lens = [r[0] for r in red if not r[1]]
    kf = kernel_facts(graph)
    if np.isfinite(kf["R"]):  # the generator's domain is the one the kernel really uses
        rows, row_len = int(kf["R"]), int(kf["C"])
    else:
        kf["full_in_bytes"] = float(main_in)
    kf.pop("R"), kf.pop("C")
    return kf | {
        "n_nodes": float(len(graph.nodes)),
        "n_inputs": float(len(graph.inputs)),
        "n_outputs": float(len(graph.outputs)),
        "n_constants": float(len(consts)),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "floor_bytes": bytes_in + bytes_out,
        "unfused_bytes": float(unfused),
        "flops": flops,
        "transcendental_ops": trans,
        "n_transcendental_nodes": float(n_trans),
        "n_reductions": float(len(red)),
        "n_row_reductions": float(len(row_lens)),
        "n_col_reductions": float(len(col_lens)),
        "max_reduction_len": float(max((r[0] for r in red), default=0)),
        "max_row_reduction_len": float(max(row_lens, default=0)),
        "max_col_reduction_len": float(max(col_lens, default=0)),
        "reduced_elements": float(sum(r[2].numel for r in red)),
        "rows": float(rows),
        "row_len": float(row_len),
        "domain_elements": float(rows) * float(row_len),
        "dtype_bytes": float(DTYPE_BYTES[dom_dtype]),
        "min_dtype_bytes": float(min(float_sizes, default=DTYPE_BYTES[dom_dtype])),
        "main_bytes": float(main_in),
        "n_broadcast_inputs": float(sum(1 for x in ins if x.numel < main.numel)),
        "n_transposes": float(n_transpose),
        "n_layout_ops": float(n_layout),
        "matmul_flops": matmul,
        # Every reduction over a domain-sized tensor is one more pass over the input unless the
        # row is cached on chip (softmax: max, then sum, then the write pass).
        "reduction_passes": float(sum(1 for r in red if r[2].numel >= main.numel)),
    }


def _graph_of(graph: Graph | Mapping[str, Any] | str) -> Graph:
    if isinstance(graph, Graph):
        return graph
    try:
        d = json.loads(graph) if isinstance(graph, str) else graph
        return Graph.from_json(d)
    except (ValueError, KeyError, TypeError) as e:
        raise GraphError(f"cannot read workload graph JSON: {e}") from None


def workload_vector(graph: Graph | Mapping[str, Any] | str, key: str | None = None) -> np.ndarray:
    """WORKLOAD_FEATURES of one workload as float64, cached under ``key`` (the workload hash)."""
    if key is not None and key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    facts = analyze_graph(_graph_of(graph))
    vec = np.array([facts[n] for n in WORKLOAD_FEATURES], dtype=np.float64)
    vec.setflags(write=False)
    if key is not None:
        _cache[key] = vec
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return vec

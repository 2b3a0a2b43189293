"""The one tolerance table of the verification protocol (GPU measurement, CPU emulation, plan
benchmarks, the cuBLAS self-check and the tests all compare through it).

An element passes when ``|out - ref| <= atol * S + rtol * |ref|``, where ``S`` is the output's
scale: the RMS of the reference's finite values. An absolute tolerance in units of the output's
own scale lets a correct kernel with a large dynamic range pass (an optimizer step dividing by a
near-zero root: a float32 rounding of a large intermediate shows up as an absolute error on the
small elements) while a wrong kernel (an index off by one, an element left unwritten, the wrong
reduction axis) errs by about the typical element and still fails. NaN fails unless the
reference is NaN there; equal values (infinities included) pass; integer and bool outputs must
match exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tunedb.graph.ir import FLOAT_DTYPES, Graph, Node
from tunedb.graph.reference import run_reference

# dtype -> (atol in units of the output's scale, rtol, machine epsilon). Kernels compute in
# float32 and round once on store, so rtol sits a few ulps above the storage dtype's epsilon.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (1e-5, 1e-4, 1.19e-7),
    "float16": (1e-3, 1e-2, 9.77e-4),
    "bfloat16": (8e-3, 2e-2, 7.81e-3),
}


@dataclass(frozen=True)
class Tolerance:
    """``atol`` (times the output's scale) and ``rtol`` of one output; both 0: exact."""

    atol: float
    rtol: float

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def scaled(self, factor: float) -> Tolerance:
        return replace(self, atol=self.atol * factor, rtol=self.rtol * factor)

    def bounds(self, ref: Any) -> tuple[float, float]:
        """``(absolute tolerance, rtol)`` for this reference array (NumPy): atol times its scale."""
        return (0.0 if self.exact else self.atol * output_scale(ref)), self.rtol


def output_scale(ref: Any) -> float:
    """RMS of the finite values of ``ref`` (1.0 when it has none, or all are zero)."""
    r = np.asarray(ref, dtype=np.float64)
    finite = r[np.isfinite(r)]
    if not finite.size:
        return 1.0
    rms = float(np.sqrt(np.mean(np.square(finite))))
    return rms if rms > 0.0 and math.isfinite(rms) else 1.0


def _prod(xs: Any) -> int:
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


def sum_length(graph: Graph) -> int:
    """Terms of the longest ``reduce_sum`` (0 without one); means divide their error by n."""
    return max((accumulated_terms(graph, n) for n in graph.nodes if n.op == "reduce_sum"), default=0)


def dtype_tolerance(dtype: str, terms: int = 1, sum_terms: int = 0) -> Tolerance:
    """The table's entry for ``dtype``, atol widened by ``sqrt(n) * eps`` for the longest chain
    of ``n`` accumulated terms (``terms``, or ``sum_terms`` of a plain sum): partial sums grow
    like the output's scale, each addition rounds, and the roundings add up like a random walk,
    so float32 accumulation errs by about eps * n in absolute terms where the output's scale is
    sqrt(n) (onnxruntime's column sums over 65,536 rows err by 0.8 * n * eps)."""
    atol, rtol, eps = TOLERANCES[dtype]
    return Tolerance(atol + math.sqrt(max(1, terms, sum_terms)) * eps, rtol)


def tolerance(graph: Graph, out_dtype: str, exp_span: float = 0.0) -> Tolerance:
    """The tolerance of one output of ``graph``: by the lowest-precision float dtype in the graph
    (or the output's), widened by the graph's longest accumulation and by ``eps * exp_span``
    (``exp_span``: ``exp_argument_span`` of the reference's values; 0 without them).
    Integer/bool outputs: exact."""
    if out_dtype not in FLOAT_DTYPES:
        return Tolerance(0.0, 0.0)
    dtypes = {t.dtype for _, t in graph.types if t.dtype in FLOAT_DTYPES} | {out_dtype}
    worst = max(dtypes, key=lambda d: TOLERANCES[d][2])
    tol = dtype_tolerance(worst, reduction_length(graph), sum_length(graph))
    if worst not in EXP_TERM_DTYPES:
        return tol
    return replace(tol, atol=tol.atol + TOLERANCES[worst][2] * max(0.0, exp_span))


# -- exp's arguments: rounding amplified by the arguments' magnitude -------------------------
# exp turns an absolute error of its argument into the same relative error of its result. A
# softmax's argument x - max(x) is computed from logits of magnitude |x|, so it is rounded to
# about eps * (|x| + |max|) absolute where it matters (exp not negligible: argument > -20), and
# the weights err by that much relative; the error reaches a normalised output unchanged. T5's
# unscaled logits reach 25-35 (BERT's 1/sqrt(d)-scaled ones 3-6). Each exp adds its own error (one
# per attention layer, carried by the residual stream), so the term sums the magnitudes. onnxruntime
# on T5-small fp32 errs at 3.3x the bound without it (docs/frontends.md).
# Only where the worst dtype is 32 or 64 bits: with bf16's epsilon the summed term reaches the
# output's own scale (BERT-base: 1.04 of its RMS, T5: 3.8), a check that could no longer fail.
EXP_TERM_DTYPES = frozenset({"float32", "float64"})
NEGLIGIBLE_EXP_ARG = -20.0  # exp(-20) = 2e-9: such elements add nothing a rounding could show
# A mask's fill (float32's lowest, -3.4e38) is no logit: a fully masked row subtracts the same
# value from itself, exactly, so magnitudes this large are left out.
MASK_SENTINEL = 1e30


def exp_arguments(graph: Graph) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per ``exp`` node of ``graph``: its argument and the values whose magnitudes its rounding
    follows. A softmax's ``exp(x - max(x))``: the row max twice (at the elements that matter x
    is within 20 of it, so ``|x| + |max|`` is ``2 |max|`` there; keeping only the max keeps the
    reference's extra memory to one value a row). Another ``sub``: its two inputs. Else the
    argument itself."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    out = {}
    for n in graph.nodes:
        if n.op != "exp" or not n.inputs:
            continue
        a = n.inputs[0]
        p = producer.get(a)
        if p is not None and p.op == "sub" and len(p.inputs) == 2:
            x, m = p.inputs
            q = producer.get(m)
            row_max = q is not None and q.op == "reduce_max" and q.inputs[:1] == (x,)
            out[a] = (m, m) if row_max else (x, m)
        else:
            out[a] = (a,)
    return tuple(out.items())


def exp_argument_span(values: Mapping[str, Any], args: Sequence[tuple[str, Sequence[str]]]) -> float:
    """Sum over ``exp_arguments`` of the largest ``sum |operand|``: where the argument is in
    ``values``, only where it is above ``NEGLIGIBLE_EXP_ARG``. NaN, infinities and mask fills
    are skipped, and so is an entry whose operands ``values`` lacks."""
    total = 0.0
    for arg, operands in args:
        if any(o not in values for o in operands):
            continue
        mag = sum(np.abs(np.asarray(values[o], dtype=np.float64)) for o in operands)
        keep = np.isfinite(mag) & (mag < MASK_SENTINEL)
        if arg in values and arg not in operands:
            a = np.asarray(values[arg], dtype=np.float64)
            shape = np.broadcast_shapes(np.shape(mag), a.shape)
            mag = np.broadcast_to(mag, shape)
            keep = np.broadcast_to(keep, shape) & (a > NEGLIGIBLE_EXP_ARG) & np.isfinite(a)
        if np.any(keep):
            total += float(np.asarray(mag)[keep].max())
    return total


def reference_and_exp_span(graph: Graph, inputs: Mapping[str, np.ndarray]
                           ) -> tuple[dict[str, np.ndarray], float]:
    """The float64 reference's outputs of ``graph`` and the ``exp_span`` for its tolerance: one
    reference run that also keeps the values ``exp_arguments`` names (a softmax's row max; an
    argument only where it is not a softmax's)."""
    args = exp_arguments(graph)
    consts = dict(graph.constants)
    given = set(graph.inputs) | set(consts) | set(graph.outputs)
    need = [v for a, ops in args for v in (ops if len(set(ops)) == 1 else (a, *ops))]
    extra = tuple(dict.fromkeys(v for v in need if v not in given))
    values = run_reference(replace(graph, outputs=graph.outputs + extra), inputs)
    values.update({v: inputs[v] for v in graph.inputs if v in inputs})
    values.update({v: c.array for v, c in consts.items()})
    return {v: values[v] for v in graph.outputs}, exp_argument_span(values, args)


def element_errors(xp: Any, out: Any, ref: Any) -> Any:
    """Per-element ``|out - ref|`` for the check (``xp``: numpy or cupy, float arrays): 0 where
    the two are equal (infinities included) or both NaN, inf where only one is NaN."""
    diff = xp.abs(out - ref)
    same = (out == ref) | (xp.isnan(out) & xp.isnan(ref))
    return xp.where(same, 0.0, xp.where(xp.isnan(diff), xp.inf, diff))


def element_bounds(xp: Any, ref: Any, abs_tol: float, rtol: float) -> Any:
    return abs_tol + rtol * xp.abs(xp.where(xp.isfinite(ref), ref, 0.0))


def check_host(out: Any, ref: Any, tol: Tolerance) -> tuple[bool, float]:
    """The comparison rule on the host: ``(ok, max abs error)``."""
    ratio, err = error_ratio(out, ref, tol)
    return ratio <= 1.0, err


def error_ratio(out: Any, ref: Any, tol: Tolerance) -> tuple[float, float]:
    """``(worst error / its bound, max abs error)``; the output passes when the ratio is <= 1."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64).reshape(o.shape)
    abs_tol, rtol = tol.bounds(r)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        err = element_errors(np, o, r)
        bound = element_bounds(np, r, abs_tol, rtol)
        ratio = np.where(err == 0.0, 0.0, err / bound)
    if not err.size:
        return 0.0, 0.0
    return float(ratio.max()), float(err.max())


def host_values(a: np.ndarray, dtype: str) -> np.ndarray:
    """An output as stored (bfloat16 as uint16 bits, bool as bytes) widened to float64."""
    a = np.asarray(a)
    if dtype == "bfloat16" and a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def compare_outputs(graph: Graph, outs: dict[str, np.ndarray], refs: dict[str, Any],
                    exp_span: float = 0.0) -> tuple[str, float]:
    """The worst output of ``graph`` and its error over its bound (> 1 fails): ``outs`` as
    stored by a kernel, ``refs`` the float64 reference's (``exp_span``: see ``tolerance``)."""
    worst = ("", 0.0)
    for v in graph.outputs:
        dtype = graph.type_of(v).dtype
        ratio, _ = error_ratio(host_values(outs[v], dtype), refs[v],
                               tolerance(graph, dtype, exp_span))
        if ratio > worst[1] or not worst[0]:
            worst = (v, ratio)
    return worst

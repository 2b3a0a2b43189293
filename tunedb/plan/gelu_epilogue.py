"""Plan pass: a transformer's FFN-up GEMM, its bias and its GELU as one cuBLASLt launch.

As planned, ``GELU(x @ W + b)`` is two kernels: the GEMM (cuBLAS) and a fused kernel that adds
the bias and computes the GELU (the erf form exporters write: ``h * 0.5 * (1 + erf(h/sqrt2))``).
cuBLASLt's ``GELU_BIAS`` epilogue does both in the GEMM, but its GELU is the tanh approximation
(found on the H200, ``benchmarks/bench_bert_base.py``'s probe). The two forms differ by at most
``GELU_TANH_MAX_ABS_ERR`` = 4.74e-4 (at x = 2.70), absolutely, over all x. The pass merges the two
steps only where that is at most a tenth of the output dtype's tolerance (``TOLERANCES``' atol, in
units of the output's scale, ``tunedb.runtime.tolerance``): bfloat16 (atol 8e-3), not float16
(1e-3: the difference is half an fp16 rounding step at 2.7) nor float32.

The merged step is a ``gemm`` step of both groups' nodes (its sub-graph still the exact erf
GELU, the cut of those nodes) with config ``epilogue: gelu_bias, gelu: tanh``: the plan records
that the runtime approximates. The executor runs it as one cuBLASLt call where cuBLASLt is on
(``TUNEDB_CUBLASLT=1`` or ``PlanExecutor(cublaslt=True)``), else op by op (the erf, exactly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tunedb.plan.record import KernelStep
from tunedb.plan.subgraph import GraphIndex
from tunedb.records import canonical_json
from tunedb.runtime.executor_lt import GELU_BIAS, GELU_TANH_MAX_ABS_ERR, bias_gelu_parts
from tunedb.runtime.tolerance import TOLERANCES

GELU_EPILOGUE_DTYPES = frozenset(d for d, (atol, _, _) in TOLERANCES.items()
                                 if GELU_TANH_MAX_ABS_ERR <= atol / 10)


def fold_gelu_epilogues(index: GraphIndex, steps: Sequence[KernelStep],
                        workload_hash: Callable[[tuple[int, ...]], str]) -> list[KernelStep]:
    """``steps`` with each single-node matmul/gemm step and the fused step that is exactly its
    bias and GELU (``bias_gelu_parts``; nothing else reads the GEMM's output) merged into one
    ``gelu_bias`` gemm step, where the output's dtype is in ``GELU_EPILOGUE_DTYPES``."""
    out: list[KernelStep | None] = list(steps)
    made_by = {v: i for i, s in enumerate(steps) for v in s.outputs}
    for fi, f in enumerate(steps):
        if f.kind != "fused":
            continue
        feeds = {made_by[v] for v in f.inputs if v in made_by}
        if len(feeds) != 1:
            continue
        pi = feeds.pop()
        p = out[pi]
        if p is None or p.kind not in ("matmul", "gemm") or len(p.nodes) != 1:
            continue
        nodes = tuple(sorted(p.nodes + f.nodes))
        cut = index.cut(nodes)
        parts = bias_gelu_parts(cut.graph)
        if parts is None or cut.graph.type_of(parts.out).dtype not in GELU_EPILOGUE_DTYPES:
            continue
        out[pi] = dataclasses.replace(
            p, kind="gemm", inputs=cut.inputs, outputs=cut.outputs, nodes=nodes,
            ops=tuple(index.nodes[j].op for j in nodes), subgraph=canonical_json(cut.graph.to_json()),
            workload_hash=workload_hash(nodes), config={"epilogue": GELU_BIAS, "gelu": "tanh"}, stitch=(),
            launches=1, measured_us=None,
            note=f"bias and GELU in cuBLASLt's GELU_BIAS epilogue (tanh form, within "
                 f"{GELU_TANH_MAX_ABS_ERR:g} of erf)")
        out[fi] = None
    return [s for s in out if s is not None]

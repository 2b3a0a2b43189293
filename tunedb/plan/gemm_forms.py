"""Which cuBLAS call each matmul step of a plan becomes, worked out from the plan alone.

The executor hands every matmul's operands, views included, to ``tunedb.runtime.blas``:
``plan_matmul`` turns their shapes and strides into strided-batched calls, and where the batch
spans two levels that no one stride steps through (attention heads at batch > 1: per sample
``S*H*D``, per head ``D``) ``pointer_batch`` makes the calls one ``cublasGemmBatchedEx`` whose
pointer array is built once, when the executor builds its launches. Here the same layouts are
computed without arrays (``tunedb.plan.views``), so ``explain`` can say what will run.
"""

from __future__ import annotations

from typing import Any

from tunedb.plan.views import Layout, contiguous, inverse_perm, reshaped, transpose_perm, view_layouts
from tunedb.runtime.blas import plan_matmul, pointer_batch
from tunedb.runtime.executor_views import is_concat_view, is_output_view


def _output_view_source(step: Any) -> Layout | None:
    """The layout of an output-view step's input inside its (contiguous) output: the chain of
    reshapes undone, then the transpose."""
    sub = step.graph
    types = sub.type_map
    lay = contiguous(types[sub.outputs[0]].shape)
    for n in reversed(sub.nodes):
        src = types[n.inputs[0]].shape
        if n.op == "transpose":
            inv = inverse_perm(transpose_perm(n, len(src)))
            lay = Layout(tuple(src), tuple(lay.strides[j] for j in inv), lay.offset)
        else:
            r = reshaped(lay, src)
            if r is None:
                return None
            lay = r
    return lay


def gemm_forms(plan: Any) -> dict[int, str]:
    """Step index -> ``gemm`` (one call), ``strided×B`` (one strided-batched call of B
    matrices), ``pointer×N`` (one cublasGemmBatchedEx of N matrices), ``loop×C`` (C calls) or
    ``staged`` (an operand copied first: no cuBLAS view), for every matmul step."""
    types = plan.graph.type_map
    lay: dict[str, Layout] = {}
    for s in plan.steps:
        if is_output_view(s):
            src = _output_view_source(s)
            if src is not None:
                lay[s.inputs[0]] = src
    out: dict[int, str] = {}
    for k, s in enumerate(plan.steps):
        if s.kind == "layout_view" and not is_output_view(s) and not is_concat_view(s):
            sub = s.graph
            local = {i: lay.get(v) or contiguous(types[v].shape) for i, v in zip(sub.inputs, s.inputs)}
            for n in sub.nodes:
                outs = view_layouts(n, local[n.inputs[0]], [sub.type_map[o].shape for o in n.outputs])
                if outs is None:
                    break
                local.update(zip(n.outputs, outs))
            lay.update({v: local[i] for i, v in zip(sub.outputs, s.outputs) if i in local})
        elif s.kind == "matmul":
            geom = []
            for v in (s.inputs[0], s.inputs[1], s.outputs[0]):
                a = lay.get(v) or contiguous(types[v].shape)
                geom += [a.shape, a.strides]
            out[k] = _form(plan_matmul(*geom))
    return out


def _form(calls: list | None) -> str:
    if calls is None:
        return "staged"
    if len(calls) == 1:
        return "gemm" if calls[0].batch == 1 else f"strided×{calls[0].batch}"
    merged = pointer_batch(calls)
    return f"pointer×{len(merged[1])}" if merged is not None else f"loop×{len(calls)}"


def forms_text(forms: dict[int, str]) -> str:
    """``gemm 24, pointer×96 24, strided×12 24`` (form: how many steps)."""
    counts: dict[str, int] = {}
    for f in forms.values():
        counts[f] = counts.get(f, 0) + 1
    return ", ".join(f"{f} {n}" for f, n in sorted(counts.items())) or "-"

"""Strided views: layout ops that need no kernel because cuBLAS reads their output in place.

Attention reshapes the rows of a projection into heads and transposes them (``[B, S, H*D] ->
[B, H, S, D]``, keys once more to ``[B, H, D, S]``); GPT-2 first splits the fused QKV projection
into three column blocks. Copying each of those costs a full read and write of a 12 MiB tensor
at batch 32, yet the only reader is a batched matmul, and cuBLAS takes any operand whose
matrices have a unit stride on one axis (a leading dimension on the other) and whose batch of
matrices is a list of pointers. So a transpose, slice or split whose every use, through
reshape-like views, is a matmul operand is planned as a view: no kernel, no buffer.

Layouts are (shape, element strides, element offset) computed without arrays; the executor
builds the same views on the device and checks that they share their source's bytes.

The other way round, an *output view*: attention's heads go back to rows after the PV matmul
(``[B, H, S, D] -> [B, S, H, D]``), a transpose copy per layer. cuBLAS can write the matmul's
output in the rows layout directly (``ldc = H*D``, a per-head stride of ``D``), so a transpose
whose input a matmul writes and nothing else reads is a view too: the transpose's output owns
the buffer, and the matmul's output is the strided view of it (``output_view_nodes``).

A *concat view* (``concat_view_nodes``, ``compile(concat_views=True)``): a concat along an axis
with only unit dimensions before it (channels at batch 1) puts each input in a contiguous slice
of its output, so every producer can write its slice in place, whatever its kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tunedb.graph.ir import Node
from tunedb.graph.ops import slice_bounds
from tunedb.runtime.blas import OP_N, as_transposed

STRIDED_OPS = frozenset(("transpose", "slice", "split"))
RESHAPE_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))
# Dtypes whose matmuls the executor runs on cuBLAS (tunedb.runtime.executor.COMPUTE_DIRECT).
OUTPUT_VIEW_DTYPES = frozenset(("float32", "float16", "bfloat16"))
# A concat input's slice starts on this many bytes: generated kernels load and store vectors.
CONCAT_SLICE_ALIGN = 16


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    offset: int = 0           # elements from the source buffer's first element


def contiguous(shape: Sequence[int]) -> Layout:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(1, int(d))
    return Layout(tuple(int(d) for d in shape), tuple(reversed(strides)))


def reshaped(lay: Layout, shape: Sequence[int]) -> Layout | None:
    """``lay`` under ``shape`` without a copy (NumPy's no-copy reshape rule), else None."""
    shape = tuple(int(d) for d in shape)
    old = [(d, s) for d, s in zip(lay.shape, lay.strides) if d != 1]
    new = [d for d in shape if d != 1]
    out: list[int] = []
    i = j = 0
    while i < len(old) and j < len(new):
        i2, j2 = i + 1, j + 1
        po, pn = old[i][0], new[j]
        while po != pn:  # grow the smaller side until both blocks hold the same elements
            if po < pn:
                if i2 == len(old):
                    return None
                po *= old[i2][0]
                i2 += 1
            else:
                if j2 == len(new):
                    return None
                pn *= new[j2]
                j2 += 1
        for k in range(i, i2 - 1):  # the old dims of the block must step as one
            if old[k][1] != old[k + 1][1] * old[k + 1][0]:
                return None
        stride = old[i2 - 1][1]
        block = []
        for d in reversed(new[j:j2]):
            block.append(stride)
            stride *= d
        out += reversed(block)
        i, j = i2, j2
    if i != len(old) or j != len(new):
        return None
    it = iter(out)
    strides = tuple(next(it) if d != 1 else 1 for d in shape)
    return Layout(shape, strides, lay.offset)


def view_layouts(node: Node, lay: Layout, out_shapes: Sequence[Sequence[int]]) -> list[Layout] | None:
    """The layouts of ``node``'s outputs as views of an input laid out as ``lay``; None when one
    of them needs a copy (or a negative stride)."""
    op, a = node.op, dict(node.attrs)
    if op in RESHAPE_OPS:
        r = reshaped(lay, out_shapes[0])
        return None if r is None else [r]
    if op == "transpose":
        perm = a.get("perm") or tuple(reversed(range(len(lay.shape))))
        return [Layout(tuple(lay.shape[p] for p in perm), tuple(lay.strides[p] for p in perm), lay.offset)]
    if op == "slice":
        if any(st <= 0 for st in a["steps"]):
            return None
        shape, strides, off = list(lay.shape), list(lay.strides), lay.offset
        bounds = slice_bounds([lay.shape[i] for i in a["axes"]], a["starts"], a["ends"], a["steps"])
        for ax, (s, _e, _n), st in zip(a["axes"], bounds, a["steps"]):
            off += s * strides[ax]
            strides[ax] *= st
        shape = [int(d) for d in out_shapes[0]]
        return [Layout(tuple(shape), tuple(strides), off)]
    if op == "split":
        axis, out, start = a["axis"], [], 0
        for s in a["sizes"]:
            shape = list(lay.shape)
            shape[axis] = s
            out.append(Layout(tuple(shape), lay.strides, lay.offset + start * lay.strides[axis]))
            start += s
        return out
    return None


def _matmul_operand(lay: Layout) -> bool:
    """Whether cuBLAS reads ``lay`` in place: a matrix with a unit stride on one axis, batches
    at any non-negative strides (a pointer per matrix)."""
    if len(lay.shape) < 2:
        return False
    r, c = lay.shape[-2:]
    return as_transposed(r, c, lay.strides[-2], lay.strides[-1]) is not None and min(lay.strides) >= 0


def _matmul_output(lay: Layout) -> bool:
    """Whether cuBLAS writes ``lay`` in place: a row-major matrix (unit column stride, rows at
    least a row apart), batches at non-negative strides."""
    if len(lay.shape) < 2:
        return False
    r, c = lay.shape[-2:]
    t = as_transposed(r, c, lay.strides[-2], lay.strides[-1])
    return t is not None and t[0] == OP_N and min(lay.strides) >= 0


def inverse_perm(perm: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def transpose_perm(node: Node, rank: int) -> tuple[int, ...]:
    return tuple(node.attr("perm") or reversed(range(rank)))


def output_view_nodes(nodes: Sequence[Node], types: dict, consumers: dict[str, list[int]],
                      outputs: set[str], dtypes: frozenset[str] = OUTPUT_VIEW_DTYPES) -> set[int]:
    """Indices of the transposes whose input a matmul writes as a strided view of the
    transpose's output (module docstring): the input is a ``matmul`` output of a cuBLAS dtype,
    the transpose is its one reader, and neither value is a graph output."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
    found: set[int] = set()
    for i, n in enumerate(nodes):
        if n.op != "transpose" or len(n.inputs) != 1 or n.outputs[0] in outputs:
            continue
        x = n.inputs[0]
        p = producer.get(x)
        if p is None or nodes[p].op != "matmul" or x in outputs or consumers.get(x) != [i]:
            continue
        if types[x].dtype not in dtypes:
            continue
        perm = transpose_perm(n, len(types[x].shape))
        out = contiguous(types[n.outputs[0]].shape)
        inv = inverse_perm(perm)
        lay = Layout(types[x].shape, tuple(out.strides[j] for j in inv))
        if _matmul_output(lay):
            found.add(i)
    return found


def strided_view_nodes(nodes: Sequence[Node], types: dict, consumers: dict[str, list[int]],
                       outputs: set[str]) -> set[int]:
    """Indices of the transpose/slice/split nodes that can be strided views (module docstring)."""
    found: set[int] = set()
    lay_of: dict[str, Layout] = {}  # outputs of approved views (and reshapes of them)

    def uses_ok(v: str, lay: Layout, depth: int = 0) -> bool:
        if v in outputs or depth > 16:
            return False
        for c in consumers.get(v, ()):
            n = nodes[c]
            if n.op == "matmul" and v in n.inputs[:2]:
                if not _matmul_operand(lay):
                    return False
                continue
            if n.op not in RESHAPE_OPS and n.op not in STRIDED_OPS:
                return False
            outs = view_layouts(n, lay, [types[o].shape for o in n.outputs])
            if outs is None or not all(uses_ok(o, lo, depth + 1) for o, lo in zip(n.outputs, outs)):
                return False
        return bool(consumers.get(v))

    for i, n in enumerate(nodes):  # topological order: a view's source layout is known first
        if not n.inputs or (n.op not in STRIDED_OPS and n.op not in RESHAPE_OPS):
            continue
        src = lay_of.get(n.inputs[0])
        if n.op in RESHAPE_OPS:
            if src is not None:
                r = reshaped(src, types[n.outputs[0]].shape)
                if r is not None:
                    lay_of[n.outputs[0]] = r
            continue
        lay = src or contiguous(types[n.inputs[0]].shape)
        outs = view_layouts(n, lay, [types[o].shape for o in n.outputs])
        if outs is not None and all(uses_ok(o, lo) for o, lo in zip(n.outputs, outs)):
            found.add(i)
            lay_of.update(zip(n.outputs, outs))
    return found


def concat_view_nodes(nodes: Sequence[Node], types: dict, outputs: set[str], views: set[int]) -> set[int]:
    """Indices of the concats whose inputs their producers can write in place (module docstring):
    the axis has only unit dimensions before it; every input is written by a node that is no
    view (``views``, reshape-like, strided, concat), of the concat's dtype, is no graph output,
    appears once and in no other such concat; every slice starts ``CONCAT_SLICE_ALIGN``-aligned.
    Other readers of an input read its slice, a contiguous array like any other."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
    no_write = RESHAPE_OPS | STRIDED_OPS | {"concat"}
    taken: set[str] = set()
    found: set[int] = set()
    for i, n in enumerate(nodes):
        if n.op != "concat" or len(n.outputs) != 1:
            continue
        out = types[n.outputs[0]]
        axis = int(n.attr("axis")) % len(out.shape)
        if any(d != 1 for d in out.shape[:axis]) or len(set(n.inputs)) != len(n.inputs):
            continue
        ok, start = True, 0
        for v in n.inputs:
            p = producer.get(v)
            ok = ok and p is not None and p not in views and nodes[p].op not in no_write
            ok = ok and v not in outputs and v not in taken and types[v].dtype == out.dtype
            ok = ok and start % CONCAT_SLICE_ALIGN == 0
            start += types[v].nbytes
        if ok:
            found.add(i)
            taken.update(n.inputs)
    return found

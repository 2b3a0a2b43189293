"""Output views: a matmul that writes its result straight into the layout a later view step
reads, so that the transpose between them needs no copy kernel.

Attention's heads go back to rows after the PV matmul (``[B, H, S, D] -> [B, S, H, D]``, then a
reshape to ``[B, S, H*D]``). The planner (``tunedb.plan.views.output_view_nodes``) marks such a
``layout_view`` step with ``config = {"view": "output"}``: its one output owns the buffer, and its
one input, the matmul's output, is a strided view of that buffer (for the heads: row stride
``H*D``, head stride ``D``), which cuBLAS writes with ``ldc = H*D`` and a per-head batch stride.

The step's sub-graph is a chain: a transpose of the step's input, then reshape-like ops. Its
input is got back from its output by undoing the chain (reshapes to their input shapes, which
a contiguous array always takes as a view, then the inverse permutation). Everything here works
on NumPy and CuPy arrays alike, so the CPU tests run the executor's own rule.

A concat view (``config = {"view": "concat"}``) is simpler: each input is a contiguous slice of
the concat's output, and the buffer plan puts it there (``tunedb.plan.buffers``), so its producer
writes the slice with no change and the step itself does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

OUTPUT_VIEW = "output"
CHAIN_OPS = frozenset(("reshape", "squeeze", "unsqueeze", "identity"))


def is_output_view(step: Any) -> bool:
    return step.kind == "layout_view" and step.config_dict.get("view") == OUTPUT_VIEW


def check_output_view(step: Any) -> None:
    """Raise ``ValueError`` unless ``step``'s sub-graph is a transpose of its one input followed
    by reshape-like ops, with the chain's last value as its one output."""
    sub = step.graph
    if len(sub.inputs) != 1 or len(sub.outputs) != 1 or not sub.nodes:
        raise ValueError(f"output view step {'+'.join(step.ops)}: needs one input and one output")
    cur = sub.inputs[0]
    for i, n in enumerate(sub.nodes):
        if n.inputs[:1] != (cur,) or len(n.outputs) != 1:
            raise ValueError(f"output view step {'+'.join(step.ops)}: not a chain")
        if (i == 0) != (n.op == "transpose") or (i > 0 and n.op not in CHAIN_OPS):
            raise ValueError(f"output view step {'+'.join(step.ops)}: expected a transpose, then "
                             f"reshapes, got {n.op} at position {i}")
        cur = n.outputs[0]
    if cur != sub.outputs[0]:
        raise ValueError(f"output view step {'+'.join(step.ops)}: its output is not the chain's end")


def output_view_steps(steps: Sequence[Any]) -> dict[str, int]:
    """The input value of every output-view step -> that step's index (each checked)."""
    out: dict[str, int] = {}
    for k, s in enumerate(steps):
        if is_output_view(s):
            check_output_view(s)
            out[s.inputs[0]] = k
    return out


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def input_view(step: Any, owner: Any) -> Any:
    """The step's input as a view of ``owner`` (its output's array, C-contiguous): the chain
    undone. The caller checks that the result shares ``owner``'s memory."""
    sub = step.graph
    types = sub.type_map
    a = owner
    for n in reversed(sub.nodes):
        src = types[n.inputs[0]].shape
        if n.op == "transpose":
            perm = n.attr("perm") or tuple(reversed(range(len(src))))
            a = a.transpose(_inverse(perm))
        else:
            a = a.reshape(src)
    return a


# -- concat views: producers write their slices of the concat's output ---------------------------
CONCAT_VIEW = "concat"


def is_concat_view(step: Any) -> bool:
    return step.kind == "layout_view" and step.config_dict.get("view") == CONCAT_VIEW


def check_concat_view(step: Any) -> None:
    """Raise ``ValueError`` unless ``step``'s sub-graph is one concat of its inputs, in order,
    along an axis with only unit dimensions before it (each input a contiguous slice)."""
    sub = step.graph
    name = "+".join(step.ops)
    if len(sub.nodes) != 1 or sub.nodes[0].op != "concat" or len(sub.outputs) != 1:
        raise ValueError(f"concat view step {name}: needs exactly one concat")
    node = sub.nodes[0]
    if tuple(node.inputs) != tuple(sub.inputs) or node.outputs[0] != sub.outputs[0]:
        raise ValueError(f"concat view step {name}: its inputs are not the concat's, in order")
    shape = sub.type_map[node.outputs[0]].shape
    axis = int(node.attr("axis")) % len(shape)
    if any(d != 1 for d in shape[:axis]):
        raise ValueError(f"concat view step {name}: its inputs are not contiguous slices (axis {axis})")


def concat_slices(step: Any) -> dict[str, int]:
    """Each input value of a (checked) concat-view step -> its byte offset in the step's output."""
    check_concat_view(step)
    types, out, start = step.graph.type_map, {}, 0
    for s, v in zip(step.graph.inputs, step.inputs):
        out[v] = start
        start += types[s].nbytes
    return out


def _address(a: Any) -> int:
    """A NumPy or CuPy array's first byte."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]


def check_concat_written(step: Any, env: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless every input of the concat-view ``step`` is in ``env`` as the
    slice of its output (``env[step.outputs[0]]``) at its offset: its producer wrote it there."""
    out = env[step.outputs[0]]
    for v, off in concat_slices(step).items():
        a = env.get(v)
        if a is None or _address(a) != _address(out) + off or a.nbytes + off > out.nbytes:
            raise ValueError(f"concat view {step.outputs[0]!r}: {v!r} was not written at byte {off} of it")

"""The executors' input side (no GPU needed): ``ExecutorError``, and ``prepare_inputs``, which
checks a run's inputs against the plan's graph and brings host arrays into stored form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.ir import Graph
from tunedb.runtime.executor_ops import storage_dtype
from tunedb.runtime.inputs import bf16_bits, index_bounds


class ExecutorError(ValueError):
    """A plan cannot run here, or its inputs do not fit its graph (one-line message)."""


def _is_device_array(a: Any) -> bool:
    return hasattr(a, "__cuda_array_interface__")


def _dtype_shape(a: Any) -> tuple[np.dtype | None, tuple[int, ...]]:
    """(dtype, shape) of a host or device array; dtype None for bfloat16 (no NumPy dtype)."""
    if str(getattr(a, "dtype", "")) == "bfloat16":
        return None, tuple(int(d) for d in a.shape)
    try:
        return np.dtype(a.dtype), tuple(int(d) for d in a.shape)
    except TypeError:  # e.g. a torch tensor: its dtype is no NumPy dtype; the interface says
        cai = a.__cuda_array_interface__
        return np.dtype(cai["typestr"]), tuple(int(d) for d in cai["shape"])


def _torch_bf16_bits(t: Any) -> Any:
    """A torch bfloat16 tensor as its uint16 bits on its device: torch hands bfloat16 neither to
    NumPy nor through ``__cuda_array_interface__``."""
    import torch  # the caller passed a torch tensor, so torch is there

    bits = t.detach().view(torch.int16)
    if bits.is_cuda:
        import cupy as cp  # a CUDA tensor for the executor, which runs on CuPy

        return cp.asarray(bits).view(cp.uint16)
    return bits.contiguous().numpy().view(np.uint16)


def _describe(a: Any) -> str:
    return f"{getattr(a, 'dtype', type(a).__name__)}[{','.join(map(str, getattr(a, 'shape', ())))}]"


def prepare_inputs(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``inputs`` against the graph and bring host arrays into stored form (bfloat16 as
    uint16 bits). Device arrays (``__cuda_array_interface__``) are checked, not moved. bfloat16
    inputs may be uint16 bits, float32 values (rounded to nearest even) or torch bfloat16 tensors
    (their bits); every other dtype must match exactly. Host gather indices are checked to be in
    range."""
    missing = [v for v in graph.inputs if v not in inputs]
    extra = sorted(set(inputs) - set(graph.inputs))
    name = graph.name or "<unnamed>"
    if missing:
        raise ExecutorError(f"plan {name}: missing input(s) {', '.join(map(repr, missing))}")
    if extra:
        raise ExecutorError(f"plan {name}: unknown input(s) {', '.join(map(repr, extra))}; "
                            f"inputs are {', '.join(map(repr, graph.inputs))}")
    bounds = index_bounds(graph)
    out: dict[str, Any] = {}
    for v in graph.inputs:
        t = graph.type_of(v)
        a = given = inputs[v]
        if str(getattr(a, "dtype", "")) == "torch.bfloat16" and t.dtype == "bfloat16":
            a = _torch_bf16_bits(a)
        if not _is_device_array(a):
            a = np.asarray(a)
        dt, shape = _dtype_shape(a)
        want = storage_dtype(t.dtype)
        ok_dtype = dt == want or (t.dtype == "bfloat16" and (dt is None or dt == np.float32))
        if shape != t.shape or not ok_dtype:
            hint = " (bfloat16 takes float32 values, uint16 bits or torch bfloat16)" \
                if t.dtype == "bfloat16" else ""
            raise ExecutorError(f"input {v!r}: expected {t}, got {_describe(given)}{hint}")
        if isinstance(a, np.ndarray):
            if t.dtype == "bfloat16" and dt is None:
                a = a.view(np.uint16)
            elif t.dtype == "bfloat16" and dt == np.float32:
                a = bf16_bits(a).reshape(t.shape)
            if v in bounds and a.size:
                n = bounds[v]
                lo, hi = int(a.min()), int(a.max())
                if lo < -n or hi >= n:
                    raise ExecutorError(f"input {v!r}: gather index out of range [{-n}, {n}) "
                                        f"(min {lo}, max {hi})")
            a = np.ascontiguousarray(a)
        out[v] = a
    return out


BIND_ALIGN = 256  # what the executor's own buffers have (``ALIGN``): vector loads may assume it


def bindable(graph: Graph, v: str, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...],
             ptr: int) -> str:
    """Why a device array (stored ``dtype`` as NumPy's, ``shape``, byte ``strides``, address
    ``ptr``) cannot stand in for the buffer of graph input or output ``v``, by pointer; "" when
    it can: the stored dtype and shape exactly, C-contiguous, ``BIND_ALIGN``-aligned."""
    if v not in graph.inputs and v not in graph.outputs:
        return f"{v!r} is neither an input nor an output of the plan"
    role = "input" if v in graph.inputs else "output"
    t = graph.type_of(v)
    want = storage_dtype(t.dtype)
    if np.dtype(dtype) != want or tuple(shape) != tuple(t.shape):
        dims = ",".join(map(str, shape))
        return f"{role} {v!r}: expected {want}[{','.join(map(str, t.shape))}], got {np.dtype(dtype)}[{dims}]"
    step, contiguous = want.itemsize, []
    for d in reversed(t.shape):
        contiguous.append(step)
        step *= d
    live = [s for s, d in zip(strides, shape) if d > 1]  # a size-1 dimension's stride is moot
    if live != [s for s, d in zip(reversed(contiguous), shape) if d > 1]:
        return f"{role} {v!r}: strides {tuple(strides)} are not C-contiguous"
    if ptr % BIND_ALIGN:
        return f"{role} {v!r}: address not {BIND_ALIGN}-byte aligned"
    return ""

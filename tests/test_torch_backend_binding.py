"""The torch.compile backend's binding by pointer, on the CPU: which device arrays may stand in
for a plan input's or output's buffer (``bindable``), when a call's tensors are the bound ones
(``same_memory``) and when an output slot is held (``storage_refs``). The GPU side (bound
graphs against the copying one and eager) is in ``test_torch_backend.py``."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.graph.ir import Graph, Node, TensorType
from tunedb.runtime.executor_inputs import BIND_ALIGN, bindable

GRAPH = Graph(("ids", "x"), ("y",), (Node("neg", ("x",), ("y",)),),
              {"ids": TensorType((1, 128), "int64"), "x": TensorType((2, 1, 8), "bfloat16"),
               "y": TensorType((2, 1, 8), "bfloat16")})


def test_bindable_takes_the_stored_form_exactly() -> None:
    ok = bindable(GRAPH, "ids", np.int64, (1, 128), (1024, 8), 4 * BIND_ALIGN)
    assert ok == ""
    # bfloat16 is stored as uint16 bits; the size-1 dimension's stride does not matter
    assert bindable(GRAPH, "x", np.uint16, (2, 1, 8), (16, 999, 2), BIND_ALIGN) == ""
    assert "expected uint16[2,1,8], got float32[2,1,8]" in bindable(
        GRAPH, "x", np.float32, (2, 1, 8), (32, 32, 4), 0)
    assert "got int32[1,128]" in bindable(GRAPH, "ids", np.int32, (1, 128), (512, 4), 0)
    assert "got int64[128,1]" in bindable(GRAPH, "ids", np.int64, (128, 1), (8, 8), 0)
    assert bindable(GRAPH, "y", np.uint16, (2, 1, 8), (16, 16, 2), 0) == ""  # an output, too
    assert "neither an input nor an output" in bindable(GRAPH, "z", np.uint16, (2, 1, 8), (16, 16, 2), 0)
    assert "output 'y': expected uint16" in bindable(GRAPH, "y", np.float32, (2, 1, 8), (32, 32, 4), 0)


def test_bindable_refuses_strided_and_unaligned_memory() -> None:
    # a transposed view: the right shape, the wrong strides
    assert "not C-contiguous" in bindable(GRAPH, "x", np.uint16, (2, 1, 8), (2, 2, 4), 0)
    assert "not C-contiguous" in bindable(GRAPH, "ids", np.int64, (1, 128), (1024, 16), 0)
    why = bindable(GRAPH, "ids", np.int64, (1, 128), (1024, 8), BIND_ALIGN + 8)
    assert f"not {BIND_ALIGN}-byte aligned" in why


def test_same_memory_is_the_bound_tensor_as_bound() -> None:
    torch = pytest.importorskip("torch")
    from tunedb.frontends.torch_handoff import same_memory

    held = [torch.arange(128).reshape(1, 128), torch.zeros(2, 8, dtype=torch.bfloat16)]
    ptrs = [t.data_ptr() for t in held]
    assert same_memory(held, list(held), ptrs)
    held[0][0, 3] = 7  # written in place: still the bound memory, the graph reads the new value
    assert same_memory(held, [held[0], held[1]], ptrs)
    assert not same_memory(held, [held[0].clone(), held[1]], ptrs)  # equal values, other memory
    assert not same_memory(held, [held[0].view(128, 1), held[1]], ptrs)  # same address, other shape
    assert not same_memory(held, [held[0], held[1].t()], ptrs)  # same address, other strides
    assert not same_memory(held, [held[0], held[1].view(torch.int16)], ptrs)  # other dtype
    with pytest.raises(ValueError):  # a call with another number of inputs is a bug, not a miss
        same_memory(held, [held[0]], ptrs)


def test_storage_refs_sees_every_tensor_on_a_slot() -> None:
    """A slot is free when its storage's count is back at its base: any tensor or view of a
    handed-out output holds it (what ``Handoff`` hands out is ``slot.detach()``)."""
    torch = pytest.importorskip("torch")
    from tunedb.frontends.torch_handoff import storage_refs

    slot = torch.empty(4, 8, dtype=torch.bfloat16)
    base = storage_refs(slot)
    y = slot.detach()
    assert storage_refs(slot) > base
    row = y[1]
    del y
    assert storage_refs(slot) > base  # a view of the output still reads the slot
    del row
    assert storage_refs(slot) == base
    kept = [slot.detach().view(torch.int16)]
    assert storage_refs(slot) > base
    kept.clear()
    assert storage_refs(slot) == base


def test_a_torch_bfloat16_tensor_goes_in_as_its_bits() -> None:
    """Torch gives bfloat16 neither to NumPy nor through ``__cuda_array_interface__``: the
    executor takes the tensor's bits (the GPU path views the CUDA tensor the same way)."""
    torch = pytest.importorskip("torch")
    from tunedb.runtime.executor_inputs import ExecutorError, prepare_inputs

    x = torch.randn(2, 1, 8).to(torch.bfloat16)
    ids = np.zeros((1, 128), np.int64)
    got = prepare_inputs(GRAPH, {"ids": ids, "x": x})["x"]
    assert got.dtype == np.uint16 and got.shape == (2, 1, 8)
    np.testing.assert_array_equal(got, x.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(ExecutorError, match=r"expected bfloat16\[2,1,8\], got torch.bfloat16\[2,8\]"):
        prepare_inputs(GRAPH, {"ids": ids, "x": x[:, 0]})

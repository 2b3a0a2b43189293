"""The one launch path's host side: arguments bound with exact widths, buffers by name, the
scratch that needs zeros, from a KernelPlan and from its wire form alike (CuPy not needed)."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels import generate, schedule_space
from tunedb.runtime.cuda import plan_to_wire
from tunedb.runtime.launch import kernel_arg, launcher, scratch_zeroed


def _plan():
    b = GraphBuilder("colsum")
    g = b.build([b.reduce_sum(b.input("x", (256, 64)), axes=(0,))])
    legal, _ = schedule_space(g, sm_count=8)
    s = next(s for s in legal if generate(g, s, sm_count=8).scratch)  # a plan with scratch
    return generate(g, s, sm_count=8)


def test_wire_scalars_keep_their_width() -> None:
    assert kernel_arg({"type": "int64", "value": 7}).dtype == np.int64
    assert kernel_arg({"type": "int32", "value": 7}).dtype == np.int32
    assert kernel_arg({"type": "float32", "value": 0.5}).dtype == np.float32
    assert kernel_arg(np.int64(3)) == 3 and kernel_arg("x") == "x"


def test_kernel_plan_and_wire_form_bind_the_same_calls() -> None:
    plan = _plan()
    wire = plan_to_wire(plan)
    names = {a for k in plan.kernels for a in k.args if isinstance(a, str)}
    buffers = {n: f"<{n}>" for n in names}
    got: dict[str, list] = {"plan": [], "wire": []}

    def fn_for(which: str):
        return lambda grid, block, args, shared_mem, stream: got[which].append(
            (grid, block, tuple(a if isinstance(a, str) else (a.dtype.name, int(a)) for a in args),
             shared_mem, stream))

    launcher([fn_for("plan")] * len(plan.kernels), plan.kernels, buffers, stream="s")()
    launcher([fn_for("wire")] * len(wire["kernels"]), wire["kernels"], buffers, stream="s")()
    assert got["plan"] == got["wire"] and len(got["plan"]) == len(plan.kernels)
    assert all(call[4] == "s" for call in got["plan"])  # the given stream, never the ambient one
    zeroed = {n for n, _, z in scratch_zeroed(plan) if z}
    assert zeroed == set(plan.zeroed)
    assert {n for n, _, _ in scratch_zeroed(wire)} == {n for n, _ in plan.scratch}


def test_an_argument_naming_no_buffer_is_one_line() -> None:
    plan = _plan()
    with pytest.raises(KeyError, match="names no buffer"):
        launcher([print] * len(plan.kernels), plan.kernels, {})

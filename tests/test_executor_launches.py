"""The planner's launch count of a compute step (``compute_launches``) against what the executor's
builders enqueue (``ComputeOps.build``), on the CPU: NumPy arrays stand in for the device arrays,
and the three GPU-only pieces (NVRTC kernels, cuBLAS, cuBLASLt) for launches that are built but
never run. A plan that counted a convolution as one kernel while its im2col and bias kernels ran
too made every CNN plan report fewer kernels than the executor launched (Inception-v3: 164
against 312), and the launch overhead of the difference was missing from its prediction."""

from __future__ import annotations

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ops import check_node
from tunedb.runtime.executor_ops import ComputeOps, KernelSet, compute_launches, storage_dtype


@pytest.fixture(autouse=True)
def no_cudnn(monkeypatch):
    # builders without a device: no cuDNN here (its counts: tests/test_conv_forms.py)
    from tunedb.runtime import conv_cudnn

    monkeypatch.setattr(conv_cudnn, "CONV_CUDNN", "off")


class _Module:
    def get_function(self, name: str):
        return lambda *args: None


class _Blas:
    def gemm(self, *args, **kwargs):
        return lambda: None


class _Lt:
    def gemm_bias(self, *args, **kwargs):
        return lambda: None


def _ops(lt: bool) -> ComputeOps:
    kernels = KernelSet.__new__(KernelSet)  # no NVRTC here: launches are built, never run
    kernels.cp, kernels.max_blocks, kernels.module = np, 32, _Module()
    return ComputeOps(np, kernels, lambda nbytes: (lambda: np.empty(nbytes, np.uint8)), _Blas(),
                      _Lt() if lt else None)


def _built(graph, lt: bool) -> int:
    node, types = graph.nodes[0], graph.type_map
    a = check_node(node, [types[v] for v in node.inputs])[1]
    arrays = [np.zeros(types[v].shape, storage_dtype(types[v].dtype)) for v in (*node.inputs, *node.outputs)]
    launches, kernels, _ = _ops(lt).build(node, a, arrays[:len(node.inputs)], arrays[len(node.inputs):])
    assert len(launches) == kernels
    return kernels


def _conv(k: int, stride: int, groups: int, bias: bool, dtype: str = "float32"):
    b = GraphBuilder("conv")
    x = b.input("x", (1, 8, 9, 9), dtype)
    w = b.input("w", (8, 8 // groups, k, k), dtype)
    ins = (x, w, b.input("b", (8,), dtype)) if bias else (x, w)
    p = k // 2
    return b.build([b.conv2d(*ins, strides=(stride, stride), pads=(p,) * 4, dilations=(1, 1), groups=groups)])


def _gemm(c_shape: tuple[int, ...] | None, beta: float = 1.0, alpha: float = 1.0, rows: int = 6):
    b = GraphBuilder("gemm")
    ins = [b.input("a", (rows, 5)), b.input("w", (5, 7))]
    if c_shape is not None:
        ins.append(b.input("c", c_shape))
    return b.build([b.gemm(*ins, alpha=alpha, beta=beta)])


CASES = {
    "1x1": (_conv(1, 1, 1, False), 1), "1x1 bias": (_conv(1, 1, 1, True), 2),
    "1x1 stride 2 (im2col)": (_conv(1, 2, 1, False), 2), "3x3 bias": (_conv(3, 1, 1, True), 3),
    "3x3 bias bf16": (_conv(3, 1, 1, True, "bfloat16"), 3), "grouped 3x3": (_conv(3, 1, 2, False), 2),
    "depthwise bias": (_conv(3, 1, 8, True), 1), "gemm": (_gemm(None), 1),
    "gemm beta 0": (_gemm((7,), beta=0.0), 1), "gemm alpha 0.5": (_gemm((7,), alpha=0.5), 2),
    # as many rows as columns: a [7, 1] C has a bias vector's size but adds along the rows
    "gemm column C": (_gemm((7, 1), rows=7), 2), "gemm matrix C": (_gemm((6, 7)), 2),
}


@pytest.mark.parametrize("case", CASES)
def test_the_planned_launches_are_what_the_executor_builds(case):
    graph, without_lt = CASES[case]
    node, types = graph.nodes[0], graph.type_map
    assert compute_launches(node, types, cublaslt=False) == _built(graph, lt=False) == without_lt
    assert compute_launches(node, types, cublaslt=True) == _built(graph, lt=True)


@pytest.mark.parametrize("c_shape", [(7,), (1, 7)])
def test_a_bias_vector_is_one_launch_with_cublaslt_and_two_without(c_shape):
    graph = _gemm(c_shape)
    node, types = graph.nodes[0], graph.type_map
    assert compute_launches(node, types) == _built(graph, lt=True) == 1
    assert compute_launches(node, types, cublaslt=False) == _built(graph, lt=False) == 2


def test_a_cnn_plan_counts_the_convolutions_kernels():
    from test_concat_views import _fire_modules

    from tunedb.plan import compile

    plan = compile(_fire_modules(), device=None)
    convs = [s for s in plan.steps if s.kind == "conv2d"]
    assert convs and all(s.launches == compute_launches(s.graph.nodes[0], s.graph.type_map) for s in convs)
    assert sorted(s.launches for s in convs) == [2, 2, 2, 2, 3, 3]  # 1x1 + bias; 3x3: im2col, GEMM, bias

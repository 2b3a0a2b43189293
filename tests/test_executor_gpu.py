"""The plan executor on a real GPU (skipped without CuPy + a CUDA device): every shipped graph and
a few fusion subgraphs against the float64 reference, one CUDA graph per plan, and a plan saved
as JSON that a fresh process loads and runs to the same outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from plan_checks import check_outputs

from tunedb.graph.builder import GraphBuilder
from tunedb.runtime.inputs import make_inputs

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "data" / "graphs"
SHIPPED = sorted(p.name for p in GRAPHS.glob("*.onnx"))


def _assert_whole(ex, plan) -> None:
    """No fallback, and exactly the plan's kernels launched (the plan counts a gemm's bias
    epilogue as cuBLASLt's one launch: without cuBLASLt it is two)."""
    no_lt = 0 if ex.lt is not None else sum(s.config_dict.get("epilogue") == "bias" for s in plan.steps)
    assert not ex.fallbacks, ex.fallbacks
    assert ex.launches == plan.kernels + no_lt, (ex.launches, plan.kernels, no_lt)


def _run_checked(ex, plan, seed: int = 0, whole: bool = False) -> None:
    """Run ``plan`` on ``ex`` once, check it against the reference, and that it was captured as one
    CUDA graph; ``whole``: ``_assert_whole`` too."""
    dev, ref_in = make_inputs(plan.graph, seed)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error
    if whole:
        _assert_whole(ex, plan)


def _compile(model):
    from tunedb.plan import compile

    return compile(model, device="cuda")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_graph_plan_matches_the_reference(name):
    from tunedb.runtime.executor import executor_for

    plan = _compile(str(GRAPHS / name))
    dev, ref_in = make_inputs(plan.graph, 11)
    outs = plan.run(dev)
    check_outputs(plan, outs, ref_in)
    ex = executor_for(plan)  # the one Plan.run built (cached by plan identity)
    assert ex.graph_capture, ex.capture_error
    _assert_whole(ex, plan)
    again = plan.run(dev)  # the cached executor: same inputs, same outputs
    for v in outs:
        assert np.array_equal(outs[v], again[v])


@pytest.mark.parametrize("name", sorted(p.name for p in (GRAPHS / "dynamic").glob("*.onnx")))
def test_dynamic_batch_graph_plans_match_the_reference(name):
    from tunedb.plan import compile

    plan = compile(str(GRAPHS / "dynamic" / name), device="cuda", bindings={"batch": 3})
    assert plan.graph.type_of(plan.graph.inputs[0]).shape[0] == 3
    dev, ref_in = make_inputs(plan.graph, 5)
    check_outputs(plan, plan.run(dev), ref_in)


def _fusion_cases():
    from tunedb.kernels import suites

    spec = [("norm", "add_layernorm", 96, 768, "float32"),
            ("softmax", "scale_mask_softmax", 64, 1000, "float16"),
            ("bias_act", "gelu_tanh", 128, 1024, "bfloat16"),
            ("col_reduce", "col_center", 300, 257, "float32"),
            ("xent", "softmax_xent", 64, 512, "float32"),
            ("permute", "transpose_add", 96, 160, "bfloat16")]
    return [suites.case(*s).graph for s in spec]


@pytest.mark.parametrize("graph", _fusion_cases(), ids=lambda g: g.name)
def test_fusion_subgraph_plan_matches_the_reference(graph):
    from tunedb.runtime.executor import PlanExecutor

    plan = _compile(graph)
    ex = PlanExecutor(plan)
    assert ex.graph_capture, ex.capture_error
    dev, ref_in = make_inputs(plan.graph, 2)
    outs = {k: v.get() for k, v in ex.run(dev).items()}
    check_outputs(plan, outs, ref_in)


def test_op_by_op_steps_and_layout_copies_run_too():
    """bfloat16 GEMM (cuBLAS on the bits), argmax (no direct kernel), pad / slice / concat copies, gather."""
    from tunedb.runtime.executor import PlanExecutor

    b = GraphBuilder("mixed")
    x = b.input("x", (16, 24), "bfloat16")
    w = b.input("w", (24, 8), "bfloat16")
    idx = b.input("idx", (5,), "int64")
    y = b.matmul(x, w)
    p = b.pad(y, pads=(1, 0, 2, 3), value=0.5)
    s = b.slice(x, starts=(15, 2), ends=(0, 20), axes=(0, 1), steps=(-2, 3))
    c = b.concat(s, b.gather(s, idx, axis=0), axis=0)
    plan = _compile(b.build([p, b.argmax(x, axis=1), c]))
    _run_checked(PlanExecutor(plan), plan, seed=4)


def test_eager_and_graph_replay_agree_and_bad_inputs_are_one_line():
    from tunedb.runtime.executor import ExecutorError, PlanExecutor

    plan = _compile(str(GRAPHS / "resnet_piece.onnx"))
    dev, _ = make_inputs(plan.graph, 3)
    a = PlanExecutor(plan).run(dev)
    eager = PlanExecutor(plan, capture=False)
    assert not eager.graph_capture and eager.capture_error == "capture disabled"
    b = eager.run(dev)
    for v in a:
        np.testing.assert_allclose(a[v].get(), b[v].get(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutorError, match=r"input 'pixels': expected float32\[1,3,224,224\]") as e:
        eager.run({"pixels": np.zeros((1, 3, 224, 225), np.float32)})
    assert "\n" not in str(e.value)


def test_a_plan_leaves_the_callers_current_stream_alone():
    """A caller that made its stream current with ``use()`` still has it after building and
    running a plan, captured or eager (``with stream:`` inside would have left the null stream
    current: CuPy's stream stack does not record ``use()``)."""
    import cupy as cp

    from tunedb.runtime.executor import PlanExecutor

    plan = _compile(str(GRAPHS / "resnet_piece.onnx"))
    dev, _ = make_inputs(plan.graph, 3)
    mine = cp.cuda.Stream(non_blocking=True)
    mine.use()
    try:
        for capture in (True, False):
            PlanExecutor(plan, capture=capture).run(dev)
            assert cp.cuda.get_current_stream() == mine
    finally:
        cp.cuda.Stream.null.use()


def test_plan_json_replays_in_a_fresh_process(tmp_path):
    plan = _compile(str(GRAPHS / "gpt2_block.onnx"))
    dev, _ = make_inputs(plan.graph, 9)
    here = plan.run(dev)
    (tmp_path / "plan.json").write_text(plan.dumps())
    names = list(plan.graph.inputs)
    for i, v in enumerate(names):
        np.save(tmp_path / f"in{i}.npy", dev[v], allow_pickle=False)
    code = f"""
import json, numpy as np, pathlib
from tunedb.plan.record import Plan
d = pathlib.Path({str(tmp_path)!r})
plan = Plan.from_json((d / "plan.json").read_text())
names = {json.dumps(names)}
outs = plan.run({{v: np.load(d / f"in{{i}}.npy", allow_pickle=False) for i, v in enumerate(names)}})
for j, v in enumerate(plan.graph.outputs):
    np.save(d / f"out{{j}}.npy", outs[v], allow_pickle=False)
"""
    path = [str(ROOT)] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for j, v in enumerate(plan.graph.outputs):
        there = np.load(tmp_path / f"out{j}.npy", allow_pickle=False)
        assert np.array_equal(there, here[v]), f"output {v!r} differs between processes"


def test_cublas_selfcheck_passes():
    """The ctypes cuBLAS path (every dtype, batched, broadcast, 1-D) eager and inside one
    captured CUDA graph, against float64 CuPy matmuls."""
    from tunedb.runtime import selfcheck

    assert selfcheck.main() == 0


def test_a_small_attention_plan_runs_as_one_cuda_graph():
    """Matmuls, a gemm with bias and a fused softmax through ``PlanExecutor`` (the self-check's
    plan, which the runtime cannot build itself): verified and captured whole."""
    from tunedb.runtime.executor import PlanExecutor

    b = GraphBuilder("selfcheck_attention")
    x = b.input("x", (2, 64, 96))
    w = b.input("w", (96, 96))
    h = b.matmul(x, w)
    s = b.softmax(b.matmul(h, b.transpose(h, perm=(0, 2, 1))), axis=-1)
    g = b.gemm(b.input("a2", (64, 96)), w, b.input("c", (96,)), trans_b=True, alpha=0.5, beta=1.0)
    plan = _compile(b.build([s, g]))
    _run_checked(PlanExecutor(plan), plan)


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint16"])
def test_strided_copy_kernel_matches_cupy(dtype):
    import cupy as cp

    from tunedb.runtime.copykernel import strided_copy

    rng = np.random.default_rng(9)
    base = cp.asarray(rng.standard_normal((3, 5, 7, 8)).astype(np.float32)).astype(dtype)
    cases = [base.transpose(0, 2, 1, 3), base[:, 1:4], base[..., 2:6], base.transpose(2, 0, 1, 3)[1:],
             # the last axis moves: tiled transposes (2-D, batched, NCHW -> NHWC, a sliced batch)
             base.transpose(0, 1, 3, 2), base[1, 2].T, base.transpose(0, 2, 3, 1),
             base.transpose(0, 1, 3, 2)[:, 1:4], base.reshape(15, 56).T,
             base[:, :, 1:6].transpose(0, 1, 3, 2),  # unit stride on a sliced axis
             cp.broadcast_to(base[0, 0, 0, :, None], (8, 5)),  # a broadcast along the last axis
             base[..., ::2].transpose(0, 1, 3, 2)]  # no unit stride at all: CuPy's own copy
    for src in cases:
        out = cp.empty(src.shape, dtype=src.dtype)
        strided_copy(cp, src, out)()
        assert cp.array_equal(out, cp.ascontiguousarray(src)), (src.shape, src.strides)


def test_heads_read_in_place_by_one_pointer_batched_gemm():
    import cupy as cp

    from tunedb.runtime.blas import Blas

    B, S, H, D = 3, 17, 4, 8
    rng = np.random.default_rng(10)
    qkv = cp.asarray(rng.standard_normal((B, S, 3 * H * D)).astype(np.float32))
    q, k = (qkv[..., i * H * D:(i + 1) * H * D].reshape(B, S, H, D) for i in range(2))
    qh, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)  # [B, H, S, D], [B, H, D, S]
    out = cp.empty((B, H, S, S), dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    blas = Blas(cp, s)
    with s:
        blas.gemm(qh, kt, out)()
    s.synchronize()
    want = np.matmul(cp.asnumpy(qh).astype(np.float64), cp.asnumpy(kt).astype(np.float64))
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pv_writes_the_rows_layout_through_an_output_view(dtype):
    """Attention with the heads back to rows after PV: no copy kernel, PV's GEMM writes the rows
    (ldc = H*D, a per-head stride), verified against the reference and captured whole."""
    from test_zoo_attention_plan import _attention

    from tunedb.runtime.executor import PlanExecutor

    plan = _compile(_attention(dtype, rows=True))
    assert "layout" not in [s.kind for s in plan.steps]
    assert any(s.config_dict.get("view") == "output" for s in plan.steps)
    _run_checked(PlanExecutor(plan), plan, whole=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_at_batch_3_run_as_pointer_batched_gemms_in_one_cuda_graph(dtype):
    """The exporters' batch > 1 attention (keys through [B*H, S, D]): no copy kernel, QK^T and
    PV one cublasGemmBatchedEx each over B*H matrices, captured whole, against the reference."""
    from test_attention_batch import _attention_b

    from tunedb.plan.gemm_forms import gemm_forms
    from tunedb.runtime.executor import PlanExecutor

    plan = _compile(_attention_b(3, dtype))
    assert "layout" not in [s.kind for s in plan.steps]
    assert sum(f.startswith("pointer") for f in gemm_forms(plan).values()) == 2
    _run_checked(PlanExecutor(plan), plan, whole=True)


def test_bert_base_batch8_two_layers_run_like_batch1():
    """BERT-base at batch 8, two layers: the kernels of batch 1, verified on the device."""
    from test_attention_batch import _first_layers

    from tunedb.plan.driver import load_graph
    from tunedb.runtime.executor import PlanExecutor

    g = _first_layers(load_graph(str(GRAPHS / "zoo_b8" / "bert_base_dynamo_fp32_b8.onnx")), 2)
    plan = _compile(g)
    assert [s.ops for s in plan.steps if s.kind == "layout"] == [("gather",)] * 2
    _run_checked(PlanExecutor(plan), plan, seed=5, whole=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cublaslt", [True, False])
def test_gemm_bias_epilogue_runs_verified_with_and_without_cublaslt(dtype, cublaslt):
    """``compile(gemm_epilogue=True)``: the QKV bias as the gemm's bias. With cuBLASLt one launch
    (its bias epilogue), without it the copy of the bias and cuBLAS with beta = 1."""
    from test_zoo_attention_plan import _attention

    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor

    plan = compile(_attention(dtype, rows=True), device="cuda", gemm_epilogue=True)
    gemms = [s for s in plan.steps if s.config_dict.get("epilogue") == "bias"]
    assert len(gemms) == 1
    ex = PlanExecutor(plan, cublaslt=cublaslt)
    assert (ex.lt is not None) == cublaslt, ex.lt_error
    dev, ref_in = make_inputs(plan.graph, 0)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error
    assert ex.launches == plan.kernels + (0 if cublaslt else len(gemms))


def test_cublaslt_gelu_epilogue_is_one_of_the_two_gelus():
    """cuBLASLt's GELU_BIAS epilogue matches erf-GELU or its tanh approximation (fp32), and the
    two differ by more than the GEMM's error, so the probe's answer means something."""
    from bench_scripts import load_script

    probe = load_script("bench_bert_base").gelu_probe()
    assert "error" not in probe, probe
    assert probe["max_abs_err"][probe["form"]] < 2e-5, probe
    assert probe["erf_vs_tanh"] > 10 * probe["max_abs_err"][probe["form"]], probe


@pytest.mark.parametrize("model", ["fire", "inception_mixed_5b.onnx", "ios/squeezenet1_1_b1.onnx",
                                   "ios/inception_v3_b1.onnx"])
def test_concat_views_write_each_branch_into_its_slice(model):
    """``compile(concat_views=True)``: every producer writes its slice of the concat's buffer and
    no concat kernel is left; verified against the reference and captured whole."""
    from test_concat_views import _fire_modules

    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.executor_views import is_concat_view

    plan = compile(_fire_modules() if model == "fire" else str(GRAPHS / model), device="cuda",
                   concat_views=True)
    assert any(map(is_concat_view, plan.steps))
    assert all("concat" not in s.ops for s in plan.steps if not is_concat_view(s))
    _run_checked(PlanExecutor(plan), plan, whole=True)


@pytest.mark.parametrize("model", ["fire", "ios/inception_v3_b1.onnx"])
def test_concat_views_in_a_stage_plan_run_on_streams(model):
    """The IOS plan with concat views and the bias lever (each concat was a copy kernel of its
    own): the branches' steps write their slices concurrently."""
    from test_concat_views import _fire_modules

    from tunedb.plan import compile
    from tunedb.runtime.executor_views import is_concat_view
    from tunedb.runtime.stage_exec import StagedExecutor

    plan = compile(_fire_modules() if model == "fire" else str(GRAPHS / model), device="cuda",
                   schedule="ios", concat_views=True, bias_epilogue=True)
    assert any(map(is_concat_view, plan.steps)) and any(len(st) > 1 for st in plan.stages)
    ex = StagedExecutor(plan)
    _run_checked(ex, plan)
    assert not ex.fallbacks

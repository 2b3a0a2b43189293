"""The cuDNN convolution path (``tunedb.runtime.conv_cudnn``): which convolutions the policy sends
there, that a missing library is one clear error, and on the GPU that cuDNN's convolutions give
the reference inside captured plans."""

from __future__ import annotations

import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.runtime import conv_cudnn
from tunedb.runtime.conv_cudnn import CudnnError, conv_params, cudnn_wanted


def _attrs(k: int, stride: int = 1, pads: tuple | None = None) -> dict:
    return {"strides": (stride, stride), "pads": pads or (k // 2,) * 4, "dilations": (1, 1), "groups": 1}


SWITCHES = ("CONV_CUDNN", "ALGO_PICK", "SHARED_WORKSPACE", "LAYOUT")


@pytest.fixture
def cudnn_policy():
    before = {k: getattr(conv_cudnn, k) for k in SWITCHES}

    def set_(value: str, pick: str | None = None, shared: bool = True, layout: str = "nchw") -> None:
        conv_cudnn.CONV_CUDNN, conv_cudnn.SHARED_WORKSPACE = value, shared
        conv_cudnn.ALGO_PICK, conv_cudnn.LAYOUT = pick or before["ALGO_PICK"], layout
    yield set_
    for k, v in before.items():
        setattr(conv_cudnn, k, v)


def test_auto_by_default_and_the_environment_sets_it(cudnn_policy):
    import os
    import subprocess
    import sys

    code = "from tunedb.runtime import conv_cudnn; print(conv_cudnn.CONV_CUDNN)"
    env = {k: v for k, v in os.environ.items() if k != "TUNEDB_CONV_CUDNN"}
    for given, want in ((None, "auto"), ("off", "off")):
        e = env if given is None else {**env, "TUNEDB_CONV_CUDNN": given}
        got = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert got.stdout.strip() == want
    cudnn_policy("off")
    assert not cudnn_wanted((8, 64, 56, 56), (64, 64, 3, 3), (8, 64, 56, 56), _attrs(3), 2)


@pytest.mark.parametrize("x,w,out,a,itemsize,want", [
    # bf16 b8: every ungrouped conv of ResNet-50 and EfficientNet-B0 (in-plan, cuDNN NCHW with
    # graph-timed algorithms beat im2col + GEMM and the per-sample 1x1 GEMMs overall) ...
    ((8, 64, 56, 56), (64, 64, 3, 3), (8, 64, 56, 56), _attrs(3), 2, True),
    ((8, 256, 28, 28), (256, 256, 3, 3), (8, 256, 14, 14), _attrs(3, 2), 2, True),
    ((8, 512, 7, 7), (512, 512, 3, 3), (8, 512, 7, 7), _attrs(3), 2, True),
    ((8, 1024, 14, 14), (2048, 1024, 1, 1), (8, 2048, 7, 7), _attrs(1, 2), 2, True),
    ((8, 1152, 7, 7), (320, 1152, 1, 1), (8, 320, 7, 7), _attrs(1), 2, True),
    ((8, 3, 224, 224), (32, 3, 3, 3), (8, 32, 112, 112), _attrs(3, 2), 2, True),   # EfficientNet's stem
    # ... but ResNet-50's 7x7 stem on 3 channels, the squeeze-excitation convs on [N, C, 1, 1]
    ((8, 3, 224, 224), (64, 3, 7, 7), (8, 64, 112, 112), _attrs(7, 2), 2, False),
    ((8, 672, 1, 1), (28, 672, 1, 1), (8, 28, 1, 1), _attrs(1), 2, False),
    # float32 stays on the SIMT GEMMs; asymmetric pads have no cuDNN descriptor
    ((8, 64, 56, 56), (64, 64, 3, 3), (8, 64, 56, 56), _attrs(3), 4, False),
    ((8, 64, 56, 56), (64, 64, 3, 3), (8, 64, 55, 55), _attrs(3, 1, (0, 0, 1, 1)), 2, False),
])
def test_auto_takes_every_16_bit_conv_but_the_stem_and_excitation(cudnn_policy, x, w, out, a, itemsize, want):
    cudnn_policy("auto")
    assert cudnn_wanted(x, w, out, a, itemsize) is want


def test_always_takes_every_symmetric_conv_and_pads_map_to_the_descriptor(cudnn_policy):
    cudnn_policy("always")
    assert cudnn_wanted((8, 3, 224, 224), (64, 3, 7, 7), (8, 64, 112, 112), _attrs(7, 2), 4)
    assert not cudnn_wanted((1, 8, 9, 9), (8, 8, 2, 2), (1, 8, 9, 9), _attrs(2, 1, (0, 0, 1, 1)), 2)
    assert conv_params((8, 64, 56, 56), (64, 64, 3, 3), {**_attrs(3, 2), "dilations": (2, 2)}) \
        == (1, 1, 2, 2, 2, 2, 1)
    assert conv_params((1, 8, 9, 9), (8, 8, 2, 2), _attrs(2, 1, (0, 1, 1, 1))) is None


def test_a_missing_library_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(conv_cudnn, "_LIB", [])
    monkeypatch.setattr(conv_cudnn, "_candidates", lambda: ["/nonexistent/libcudnn.so.9"])
    with pytest.raises(CudnnError, match="cannot load cuDNN") as e:
        conv_cudnn.library()
    assert "\n" not in str(e.value)


def test_the_library_search_looks_in_the_nvidia_wheels_folder(monkeypatch, tmp_path):
    lib = tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    monkeypatch.setenv("TUNEDB_CUDNN", "/opt/x/libcudnn.so.9")
    found = conv_cudnn._candidates()
    assert found[:2] == ["/opt/x/libcudnn.so.9", str(lib)]


# -- the GPU --------------------------------------------------------------------------------------
def _net(dtype: str):
    b = GraphBuilder(f"cudnn_{dtype}")
    y = b.input("x", (4, 16, 14, 14), dtype)
    w1, b1 = b.input("w1", (32, 16, 3, 3), dtype), b.input("b1", (32,), dtype)
    y = b.relu(b.conv2d(y, w1, b1, strides=(1, 1), pads=(1,) * 4, dilations=(1, 1), groups=1))
    w2 = b.input("w2", (24, 32, 3, 3), dtype)
    y = b.conv2d(y, w2, strides=(2, 2), pads=(1,) * 4, dilations=(1, 1), groups=1)
    return b.build([y])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cudnn_convolutions_match_the_reference_captured(cudnn_policy, dtype):
    from plan_checks import check_outputs

    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    try:
        conv_cudnn.library()
    except CudnnError as e:
        pytest.skip(str(e))
    cudnn_policy("always")
    plan = compile(_net(dtype), device="cuda")
    ex = PlanExecutor(plan)
    assert ex.ops.dnn is not None and len(ex.ops.dnn.chosen) == 2
    dev, ref_in = make_inputs(plan.graph, 5)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error


@pytest.mark.gpu
@pytest.mark.parametrize("pick,shared,layout", [("graph", True, "nchw"), ("heuristic", True, "nchw"),
                                               ("find", False, "nchw"), ("graph", True, "nhwc")])
def test_each_algorithm_pick_workspace_and_layout_match_the_reference(cudnn_policy, pick, shared, layout):
    from plan_checks import check_outputs

    from tunedb.plan import compile
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    try:
        conv_cudnn.library()
    except CudnnError as e:
        pytest.skip(str(e))
    cudnn_policy("always", pick, shared, layout)
    plan = compile(_net("bfloat16"), device="cuda")
    ex = PlanExecutor(plan)
    found = ex.ops.dnn.found
    assert len(found) == 2 and all(f["pick"] in [c["algo"] for c in f["find"]] for f in found)
    if pick == "graph":  # every candidate re-timed, the fastest taken
        for f in found:
            assert all(c["graph_us"] > 0 for c in f["find"])
            assert f["pick"] == min(f["find"], key=lambda c: c["graph_us"])["algo"]
    dev, ref_in = make_inputs(plan.graph, 5)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error


@pytest.mark.gpu
def test_channels_last_chain_matches_the_reference_captured(cudnn_policy, monkeypatch):
    from plan_checks import check_outputs

    from tunedb.plan import compile
    from tunedb.runtime import conv_chain
    from tunedb.runtime.executor import PlanExecutor
    from tunedb.runtime.inputs import make_inputs

    try:
        conv_cudnn.library()
    except CudnnError as e:
        pytest.skip(str(e))
    cudnn_policy("always", "graph", True, "nhwc")
    monkeypatch.setattr(conv_chain, "CHAIN", "on")
    b = GraphBuilder("chain")
    x = b.input("x", (4, 16, 14, 14), "bfloat16")
    w1, w2 = b.input("w1", (16, 16, 3, 3), "bfloat16"), b.input("w2", (16, 16, 3, 3), "bfloat16")
    w3 = b.input("w3", (24, 16, 1, 1), "bfloat16")
    kw = {"strides": (1, 1), "dilations": (1, 1), "groups": 1}
    r1 = b.relu(b.conv2d(x, w1, pads=(1,) * 4, **kw))
    r2 = b.relu(b.add(b.conv2d(r1, w2, pads=(1,) * 4, **kw), r1))
    plan = compile(b.build([b.conv2d(r2, w3, pads=(0,) * 4, **kw)]), device="cuda")
    ex = PlanExecutor(plan)
    assert len(ex.ops.dnn.found) == 3 and ex.ops.conv_io  # some activations stayed NHWC
    dev, ref_in = make_inputs(plan.graph, 7)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)
    assert ex.graph_capture, ex.capture_error


def _bench(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_in_plan_bench_parses_policies_and_restores_the_switches(cudnn_policy):
    bench = _bench("bench_conv_inplan")
    from tunedb.runtime import conv_chain

    before = tuple(getattr(conv_cudnn, k) for k in SWITCHES) + (conv_chain.CHAIN,)
    assert bench.set_policy("auto:graph:own") == before
    assert tuple(getattr(conv_cudnn, k) for k in SWITCHES) + (conv_chain.CHAIN,) \
        == ("auto", "graph", False, "auto", "auto")
    bench.set_policy("always:nhwc:own")  # the pick stays
    assert tuple(getattr(conv_cudnn, k) for k in SWITCHES) + (conv_chain.CHAIN,) \
        == ("always", "graph", False, "nhwc", "off")
    bench.set_policy("off:find:chain")
    assert (conv_cudnn.ALGO_PICK, conv_cudnn.LAYOUT, conv_chain.CHAIN) == ("find", "auto", "on")
    bench.restore(before)
    assert tuple(getattr(conv_cudnn, k) for k in SWITCHES) + (conv_chain.CHAIN,) == before
    for bad in ("sometimes", "auto:fastest", "auto:graph:find", "off:own:own", "auto:nchw:chain"):
        with pytest.raises(ValueError, match="bad policy"):
            bench.set_policy(bad)
        bench.restore(before)


def test_the_in_plan_bench_refuses_a_bad_policy_before_any_work(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    argv = [str(tmp_path / "o.json"), str(model), "--policies", "auto:x"]
    assert _bench("bench_conv_inplan").main(argv) == 2
    assert "bad policy 'auto:x'" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_the_conv_bench_sets_and_restores_the_switches():
    import importlib.util
    from pathlib import Path

    from tunedb.runtime import executor_conv

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_conv.py"
    spec = importlib.util.spec_from_file_location("bench_conv_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = (executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN)
    try:
        bench.set_policy("never+tiled+cudnn")
        assert (executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN) \
            == ("never", "tiled", "auto")
        bench.set_policy("always+cudnn-all")
        assert (executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN) == ("rows", "always")
        bench.reset_policy()
        assert (executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN) == before
    finally:
        executor_conv.CONV_BATCH_MERGE, executor_conv.IM2COL_KERNEL, conv_cudnn.CONV_CUDNN = before

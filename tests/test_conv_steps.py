"""``benchmarks/bench_conv_steps.py`` on the CPU: the plan's steps with their executor paths and
generated-source digests (what tells two source trees' plans apart), and its refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tunedb.graph.builder import GraphBuilder

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_conv_steps.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_conv_steps_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _block(dtype: str = "float32"):
    b = GraphBuilder("dw_block")
    x = b.input("x", (2, 8, 12, 12), dtype)
    y = b.conv2d(x, b.input("w1", (16, 8, 1, 1), dtype), strides=(1, 1), pads=(0,) * 4,
                 dilations=(1, 1), groups=1)
    y = b.relu(y)
    y = b.relu(b.conv2d(y, b.input("w2", (16, 1, 3, 3), dtype), strides=(1, 1), pads=(1,) * 4,
                        dilations=(1, 1), groups=16))
    return b.build([y])


def test_plan_steps_name_paths_and_digest_generated_sources(bench):
    from tunedb.plan.driver import compile as compile_plan

    plan = compile_plan(_block(), device="generic")
    rows = bench.plan_steps(plan)
    assert [r["k"] for r in rows] == list(range(len(plan.steps)))
    assert any(r["path"].startswith("conv 1x1") for r in rows)
    gen = [r for r in rows if r["path"] == "generated"]
    assert gen and all(len(r["src"]) == 10 for r in gen)
    assert all(r["src"] == "" for r in rows if r["path"] != "generated")
    assert [r["src"] for r in bench.plan_steps(plan)] == [r["src"] for r in rows]  # deterministic


def test_plan_only_writes_the_steps_and_a_missing_model_is_refused(bench, tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert bench.main([str(out), str(tmp_path / "missing.onnx"), "--plan-only"]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert not out.exists()


def test_compare_puts_the_se_convs_first_in_the_stored_call(capsys):
    spec = importlib.util.spec_from_file_location("bench_conv_compare_under_test",
                                                  BENCH.parent / "bench_conv_compare.py")
    cmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)
    runs = BENCH.parent.parent / "data" / "bench" / "conv_steps_b8_h200.json"
    assert cmp.main([str(runs), "e5983d8", "head", "--top", "3"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("mobilenet_v3_dynamo_fp32_b8"):]
    assert "whole 565 -> 960" in block and "by path: conv 1x1 (cublas) +296.6" in block
    # a fused pair shows as one replaced pair of steps
    assert "sigmoid+mul|conv2d+sigmoid+mul => sigmoid+mul+conv2d" in out
    assert cmp.main([str(runs), "e5983d8", "nope"]) == 2
    assert "no model run by both" in capsys.readouterr().err

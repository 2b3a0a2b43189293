"""The CPU side of ``benchmarks/bench_bert_base.py`` (the GPU call for issue 24's BERT-base
must-show): its plan-only mode counts the kernels of both plans, the summary reads a result, and
a bad dtype is a one-line error."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script

bench = load_script("bench_bert_base")


@pytest.mark.slow
def test_plan_only_counts_both_plans(tmp_path):
    out = tmp_path / "bert.json"
    assert bench.main([str(out), "--plan-only", "--dtypes", "bfloat16"]) == 0
    plans = json.loads(out.read_text())["plans"]
    # 136 and 124 kernels at b7236bd; the fusion search may lower both
    assert plans["bf16"]["output_views"] == 12 and plans["bf16"]["layout_copies"] == 2
    assert plans["bf16"]["bias_epilogues"] == 0 and plans["bf16_epilogue"]["bias_epilogues"] == 12
    assert plans["bf16_epilogue"]["kernels"] == plans["bf16"]["kernels"] - 12


def test_summary_shows_verified_times_only():
    result = {"parts": {
        "bf16/onnx_epilogue": {"default": {"us": 470.4}, "epilogue_cublaslt": {"error": "x"}},
        "bf16/module": {"torch_eager": {"us": 6960.0}, "torch_compile_ro": {"us": 559.2}},
        "bf16/backend": {"backend_us": 500.0, "equal_within_tolerance": False}}}
    lines = bench.summary_lines(result)
    assert lines[1] == "bf16 | 470 | - | 6960 | - | 559 | - | -"
    assert lines[2] == "fp32 | - | - | - | - | - | - | -"


def test_unknown_dtype_is_one_line(tmp_path, capsys):
    assert bench.main([str(tmp_path / "x.json"), "--dtypes", "float64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown dtype(s) float64") and "\n" not in err

"""The CPU side of ``benchmarks/bench_bert_base.py`` (the GPU call for issue 24's BERT-base
must-show): its plan-only mode counts the kernels of the three plans, the rounds interleave
their items, the summary reads a result, and bad arguments are one-line errors."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script

bench = load_script("bench_bert_base")


@pytest.mark.slow
def test_plan_only_counts_the_three_plans(tmp_path):
    out = tmp_path / "bert.json"
    assert bench.main([str(out), "--plan-only", "--dtypes", "bfloat16"]) == 0
    plans = json.loads(out.read_text())["plans"]
    # 136, 124 and 112 kernels at a791bf7; the fusion search may lower all three
    assert plans["bf16"]["output_views"] == 12 and plans["bf16"]["layout_copies"] == 2
    assert plans["bf16"]["bias_epilogues"] == 0 and plans["bf16_epilogue"]["bias_epilogues"] == 12
    assert plans["bf16_epilogue"]["kernels"] == plans["bf16"]["kernels"] - 12
    assert plans["bf16_gelu"]["gelu_epilogues"] == 12 and plans["bf16_gelu"]["bias_epilogues"] == 12
    assert plans["bf16_gelu"]["kernels"] == plans["bf16_epilogue"]["kernels"] - 12


def test_rounds_rotate_the_order_and_time_every_item_each_round():
    calls: list[str] = []
    items = {k: (lambda k=k: calls.append(k), lambda: None) for k in ("a", "b", "c")}
    res = bench.rounds(items, 3, target_s=0.001)
    firsts = []
    for name in items:  # throughput_us calls an item many times in a row: collapse the runs
        assert len(res["us"][name]) == 3 and all(t > 0 for t in res["us"][name])
    for i, k in enumerate(calls):
        if i == 0 or calls[i - 1] != k:
            firsts.append(k)
    assert firsts == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    s = res["stats"]["a"]
    assert s["min"] <= s["median"] <= s["max"] and s["spread"] >= 0
    assert len(res["gpu"]) == 3  # one GPU state (or why none could be read) per round


def test_summary_lists_each_phase_and_item_with_its_spread():
    result = {"sessions": {"bf16": {"phases": {
        "fresh": {"stats": {"default": {"median": 421.3, "min": 420.0, "max": 430.0, "spread": 0.0237}}},
        "after": {"stats": {"gelu": {"median": 440.2, "min": 439.0, "max": 445.0, "spread": 0.0136}}}}}}}
    lines = bench.summary_lines(result)
    assert lines[1:] == ["bf16 | fresh | default | 421 | 420-430 | 2.4 %",
                         "bf16 | after | gelu | 440 | 439-445 | 1.4 %"]


@pytest.mark.parametrize("args, start", [
    (["--dtypes", "float64"], "error: unknown dtype(s) float64"),
    (["--peers", "jax"], "error: unknown peer(s) jax"),
    (["--rounds", "0"], "error: --rounds must be at least 1"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, start):
    assert bench.main([str(tmp_path / "x.json"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(start) and "\n" not in err
    assert not (tmp_path / "x.json").exists()


def test_an_item_that_fails_leaves_the_rounds_and_the_others_go_on():
    def broken() -> None:
        raise RuntimeError("device lost")

    res = bench.rounds({"ok": (lambda: None, lambda: None), "bad": (broken, lambda: None)}, 2, 0.001)
    assert len(res["us"]["ok"]) == 2 and "bad" not in res["stats"]
    assert res["errors"] == {"bad": "RuntimeError: device lost"}
    assert bench.rounds({}, 3, 0.001)["stats"] == {}

"""The zoo benchmark's parallel driver (CPU: --plan-only) and its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_zoo_plan  # noqa: E402
import zoo_table  # noqa: E402

ZOO = ROOT / "data" / "graphs" / "zoo"


@pytest.mark.slow  # two worker processes import tunedb and plan a model each
def test_plan_only_workers_plan_every_model(tmp_path):
    out = tmp_path / "zoo.json"
    files = [ZOO / "distilbert_dynamo_bf16.onnx", ZOO / "mobilenet_v3_dynamo_fp32.onnx"]
    assert bench_zoo_plan.main([str(out), "--plan-only", "--workers", "2",
                                "--gpu-lock", str(tmp_path / "lock"), *map(str, files)]) == 0
    res = json.loads(out.read_text())
    assert res["complete"] and [e["name"] for e in res["entries"]] == [f.stem for f in files]
    for e in res["entries"]:
        assert 0 < e["plan"]["kernels"] < e["graph"]["op_by_op"], e


def test_unfinished_models_are_recorded_not_dropped(tmp_path):
    entries = bench_zoo_plan.collect_entries([ZOO / "bert_base_dynamo_bf16.onnx"], anchors=False)
    res = bench_zoo_plan.run_parallel(entries, tmp_path / "z.json", 1, (), time_limit_s=0.01,
                                      lock=tmp_path / "lock", plan_only=True, say=lambda s: None)
    assert not res["complete"] and "time limit" in res["stopped"]
    assert res["entries"][0]["error"].startswith("not ")


def test_table_has_a_row_per_entry_with_the_best_peer_ratio():
    result = {"entries": [
        {"name": "bert_base_dynamo_bf16_b8", "tunedb": {"us": 100.0}, "plan": {"kernels": 148},
         "graph": {"op_by_op": 664}, "verify": {"reference": {"ok": True}},
         "peers": {"torch_eager": {"us": 900.0}, "torch_compile_ro": {"us": 150.0}}},
        {"name": "resnet50_dynamo_fp32", "tunedb": {"us": None}, "error": "not finished",
         "peers": {}}]}
    lines = zoo_table.zoo_lines(result)
    assert len(lines) == 4
    assert "| bert_base | 8 | bf16 | **100** | 148 (664) | ref ok |" in lines[2]
    assert lines[2].endswith("| 1.50x |")
    assert "not finished" in lines[3]

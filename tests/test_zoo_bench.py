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


def test_failed_rows_show_their_error_beside_the_peers_and_leave_the_geomean():
    peers = {"torch_eager": {"us": 400.0, "rel_err": 0.15}, "jax": {"us": 200.0, "rel_err": 0.12}}
    result = {"entries": [
        {"name": "t5_encoder_dynamo_bf16", "tunedb": {"us": 100.0}, "peers": peers,
         "verify": {"reference": {"ok": False, "rel_err": 0.1197}}},
        {"name": "vit_dynamo_bf16", "tunedb": {"us": 100.0}, "peers": peers,
         "verify": {"reference": {"ok": True, "rel_err": 0.004}}},
        {"name": "gpt2_dynamo_bf16", "tunedb": {"us": 400.0}, "peers": peers,
         "verify": {"reference": {"ok": True, "rel_err": 0.004}}}]}
    lines = zoo_table.zoo_lines(result)
    assert "| ref FAIL (rel 0.12; peers 0.12-0.15) |" in next(x for x in lines if "t5_encoder" in x)
    # the two verified rows only: best peer 2.0x and 0.5x, geomean 1.00x; eager 4x and 1x
    assert zoo_table.geomean_line(result) == ("Geometric mean over the 2 verified rows: "
                                              "torch_eager 2.00x, jax 1.00x, best 1.00x")


def test_merged_parts_keep_the_finished_entry():
    first = {"entries": [{"name": "a", "tunedb": {"us": 5.0}}, {"name": "b", "tunedb": {"us": None}}]}
    second = {"entries": [{"name": "a", "tunedb": {"us": None}, "error": "not finished"},
                          {"name": "b", "tunedb": {"us": 7.0}}, {"name": "c", "tunedb": {"us": 1.0}}]}
    merged = {e["name"]: e["tunedb"]["us"] for e in zoo_table.merge_results([first, second])["entries"]}
    assert merged == {"a": 5.0, "b": 7.0, "c": 1.0}


def test_fill_script_parts_cover_the_52_h200_rows():
    import subprocess

    files = []
    for part in (1, 2, 3):
        res = subprocess.run(["bash", str(ROOT / "benchmarks" / "zoo_h200_fill.sh"), str(part)],
                             cwd=ROOT, env={"LIST": "1", "PATH": "/usr/bin:/bin", "OUT": "."},
                             capture_output=True, text=True, check=True)
        files += res.stdout.split()
    assert len(files) == len(set(files)) == 52  # 13 models x fp32/bf16 x batch 1/8
    assert all((ROOT / f).is_file() for f in files)
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "zoo_h200_fill.sh"), "4"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_status_table_has_the_52_rows_and_the_extra_fp16_files():
    manifest = json.loads((ZOO / "manifest.json").read_text())
    files = {m["file"]: {"import": {"ok": True, "nodes": 10}, "plan": {"ok": True, "kernels": 3}}
             for m in manifest if "error" not in m}
    files["gpt2_ts_fp32.onnx"] = {"import": {"ok": False, "error": "OnnxImportError: boom"}}
    lines = zoo_table.status_lines({"manifest": manifest, "files": files})
    rows = [line for line in lines[2:] if "(extra)" not in line]
    assert len(rows) == 52 and len(lines) - 2 - len(rows) == 5  # 5 TorchScript fp16 files
    assert "| gpt2 | torchscript | fp32 | FAIL: OnnxImportError: boom |" in lines[2 + 8]
    assert "| bert_base | torchscript (eager attention) | bf16 | ok, 10 nodes | ok, 3 kernels |" in lines[3]


def test_table_points_a_handoff_result_to_its_own_table_and_refuses_other_json(tmp_path, capsys):
    zoo = ROOT / "data" / "bench" / "zoo_h200_part2.json"
    handoff = ROOT / "data" / "bench" / "torch_backend_handoff_h200.json"
    assert zoo_table.main([str(zoo), str(handoff)]) == 0
    out, err = capsys.readouterr()
    assert "| bert_base | 8 | bf16 |" in out
    assert "bench_torch_backend.py --table" in err and str(handoff) in err
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    assert zoo_table.main([str(zoo), str(other)]) == 2
    assert "neither a zoo nor a backend" in capsys.readouterr().err

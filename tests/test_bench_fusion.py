"""``tunedb bench fusion`` on CPU: floor bytes, the summary / table / JSON of a result, database
candidates from a real DuckDB file, candidate preparation, the no-GPU error; the torch / JAX
translators only where those frameworks are installed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from tunedb.bench.fusion import (
    BenchError,
    db_candidates,
    floor_us,
    geomean,
    prepare,
    rel_l2,
    summarize,
    write_json,
)
from tunedb.bench.tables import fusion_progress_line as progress_line
from tunedb.bench.tables import fusion_summary_line as summary_line
from tunedb.bench.tables import fusion_table as render_table
from tunedb.bench.tables import load_cases
from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.schedule import Schedule, schedule_space
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload
from tunedb.store import TuningStore


def _softmax(R: int = 8, C: int = 64):
    b = GraphBuilder(f"softmax_{R}x{C}")
    return b.build([b.softmax(b.add(b.mul(b.input("x", (R, C)), 0.125), b.input("m", (C,))))])


# -- floor -----------------------------------------------------------------------------------------
def test_floor_bytes_counts_each_input_and_output_once():
    b = GraphBuilder("two_out")
    x = b.input("x", (8, 16), "bfloat16")
    s = b.input("s", (16,), "float32")
    idx = b.input("i", (8,), "int64")
    y = b.mul(b.cast(x, to="float32"), s)
    g = b.build([y, y, b.reduce_sum(y, axes=(1,))])
    # inputs: 8*16*2 + 16*4 + 8*8 (the unused index input is still read); outputs: y once + 8 floats
    assert g.floor_bytes() == 256 + 64 + 64 + 8 * 16 * 4 + 8 * 4
    assert idx in g.inputs


def test_anchor_floors_match_the_anchor_table():
    cases = {c.name: c for c in load_cases("anchors")}
    assert len(cases) == 12
    M, N = 8192, 4096
    assert cases["bias_gelu_8192x4096"].graph.floor_bytes() == 4 * (2 * M * N + N)
    assert cases["add_layernorm_8192x4096"].graph.floor_bytes() == 4 * (3 * M * N + 2 * N)
    assert cases["transpose_add_8192x4096"].graph.floor_bytes() == 4 * 3 * M * N
    # At the anchors' 4.21 TB/s the 128 MiB-in, 128 MiB-out cases sit at 63.8 µs.
    assert floor_us(cases["col_center_8192x4096"].graph.floor_bytes(), 4.21) == pytest.approx(63.76, abs=0.01)
    for c in cases.values():
        assert c.graph.floor_bytes() == c.floor_bytes  # the suite's own count agrees


def test_floor_us_and_rel_l2_and_geomean():
    assert floor_us(4_000_000, 4.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive"):
        floor_us(10, 0.0)
    ref = np.array([3.0, 4.0])
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(np.array([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert rel_l2(np.array([0.5, 0.0]), np.zeros(2)) == pytest.approx(0.5)  # absolute for zero refs
    with pytest.raises(ValueError, match="elements"):
        rel_l2(np.zeros(3), ref)
    assert geomean([2.0, 8.0, None, float("nan"), 0.0]) == pytest.approx(4.0)
    assert geomean([None]) is None


# -- result formatting ----------------------------------------------------------------------------
def _case(name, floor, tdb, eager, comp, jax, sched="warp_per_row_b256_v4"):
    t = {"us": tdb, "schedule": sched if tdb else None, "error": None if tdb else "no candidate verified"}
    peer = {"us": None, "rel_err": None, "error": "jax unavailable"}
    return {"case": name, "floor_us": floor, "tunedb": t, "elapsed_s": 3.0,
            "peers": {"torch_eager": {"us": eager, "rel_err": 1e-7, "error": None},
                      "torch_compile": {"us": comp, "rel_err": 1e-7, "error": None},
                      "jax": {"us": jax, "rel_err": 1e-7, "error": None} if jax else peer}}


def _result():
    return {"device": {"name": "NVIDIA H200"}, "copy_TBps": 4.21, "stopped": "",
            "cases": [_case("a", 60.0, 64.0, 800.0, 80.0, 96.0),
                      _case("b", 30.0, 40.0, 300.0, 30.0, None),
                      _case("c", 50.0, None, 500.0, 100.0, 100.0)]}


def test_summarize_geomeans_and_slow_cases():
    s = summarize(_result())
    assert s["cases"] == 3
    assert s["timed"] == {"tunedb": 2, "torch_eager": 3, "torch_compile": 3, "jax": 2}
    fr = s["fraction_of_floor"]
    assert fr["tunedb"] == pytest.approx(math.sqrt(60 / 64 * 30 / 40))
    assert fr["torch_compile"] == pytest.approx((60 / 80 * 30 / 30 * 50 / 100) ** (1 / 3))
    assert fr["jax"] == pytest.approx(math.sqrt(60 / 96 * 50 / 100))
    assert s["speedup_vs_torch_compile"] == pytest.approx(math.sqrt(80 / 64 * 30 / 40))
    assert s["min_speedup_vs_torch_compile"] == pytest.approx(0.75)
    assert s["speedup_vs_jax"] == pytest.approx(96 / 64)  # only case a has both
    assert s["slower_than_torch_compile"] == ["b"]
    assert summarize({"cases": []})["fraction_of_floor"]["tunedb"] is None


def test_table_summary_and_progress_lines():
    res = _result()
    console = Console(record=True, width=220)
    console.print(render_table(res))
    text = console.export_text()
    for want in ("NVIDIA H200", "4.21 TB/s", "warp_per_row_b256_v4", "error: no candidate verified",
                 "geomean fraction of floor", "0.938", "1.25", "1.50", "800.0", "—"):
        assert want in text, want
    line = summary_line(res)
    assert "3 case(s)" in line and "slower than torch.compile: b" in line
    assert f"{math.sqrt(80 / 64 * 30 / 40):.2f}x torch.compile (min 0.75x)" in line
    p = progress_line(2, 3, res["cases"][1])
    assert p.startswith("[2/3] b: floor 30.0, tunedb 40.0 (warp_per_row_b256_v4)")
    assert "jax failed" in p and "torch_compile 30.0" in p
    assert "tunedb failed (no candidate verified)" in progress_line(3, 3, res["cases"][2])


def test_write_json_is_valid_json_and_rejects_nan(tmp_path):
    res = _result()
    res["summary"] = summarize(res)
    out = tmp_path / "deep" / "bench.json"
    write_json(res, out)
    assert json.loads(out.read_text()) == res
    assert not list(out.parent.glob("*.tmp"))
    res["copy_TBps"] = float("nan")
    with pytest.raises(ValueError):
        write_json(res, out)
    assert json.loads(out.read_text())["copy_TBps"] == 4.21  # the last good file survives


# -- candidates ------------------------------------------------------------------------------------
DEV = DeviceInfo("NVIDIA H200", "abc", "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")
OTHER = DeviceInfo("NVIDIA A100", "def", "8.0", 108, 40 << 20, 80 << 30, "13.0", "13.0", "14.2.0")
TWIN = DeviceInfo("NVIDIA H200", "fed", "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")


def test_db_candidates_top_k_on_this_device_model_only(tmp_path):
    g = _softmax()
    w = Workload.from_graph(g, "softmax", g.name)
    legal, _ = schedule_space(g)
    cands = [Candidate(w.hash, "fusion", s.to_config(), f"src{i}") for i, s in enumerate(legal[:4])]
    run = Run("r1", "fusion", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00+00:00")
    ms = [Measurement(cands[0].hash, DEV.id, "r1", "ok", (30.0, 31.0, 32.0)),
          Measurement(cands[1].hash, DEV.id, "r1", "ok", (10.0, 11.0, 12.0)),
          Measurement(cands[2].hash, DEV.id, "r1", "incorrect", (), "max abs error 1"),
          Measurement(cands[3].hash, OTHER.id, "r1", "ok", (1.0,))]
    path = tmp_path / "t.duckdb"
    with TuningStore.open(path) as db:
        db.add_devices([DEV, OTHER, TWIN])
        db.add_runs([run])
        db.add_workloads([w])
        db.add_candidates(cands)
        db.add_measurements(ms)
    got = db_candidates(path, DEV, [w.hash, "0" * 64], k=3)
    assert [c["config"] for c in got[w.hash]] == [cands[1].config_dict, cands[0].config_dict]
    assert [c["db_us"] for c in got[w.hash]] == [11.0, 31.0]
    assert got[w.hash][0]["db_source_hash"] == "src1" and got[w.hash][0]["source"] == "db"
    assert got["0" * 64] == []
    assert Schedule.from_config(got[w.hash][0]["config"]) == legal[1]
    # another board of the same model (new device id) still gets these measurements; a board
    # that was never stored gets them too, through its model
    for board in (TWIN, DeviceInfo("NVIDIA H200", "new", "9.0", 132, 60 << 20, 141 << 30,
                                   "13.0", "13.0", "14.2.0")):
        again = db_candidates(path, board, [w.hash], k=3)
        assert [c["db_us"] for c in again[w.hash]] == [11.0, 31.0]
    assert db_candidates(path, OTHER, [w.hash], k=3)[w.hash][0]["db_us"] == 1.0


def test_prepare_generates_a_launchable_wire_plan():
    g = _softmax(8, 64)
    legal, pruned = schedule_space(g)
    res = prepare(g.to_json(), legal[0].to_config(), 132, compile_now=False)
    assert "error" not in res, res.get("error")
    assert res["label"] == legal[0].label() and len(res["source_hash"]) == 64
    for k in res["wire"]["kernels"]:
        assert k["args"][:2] == ["x", "m"]
        assert k["args"][-2:] == [{"type": "int64", "value": 8}, {"type": "int64", "value": 64}]
        assert 'extern "C"' in k["source"] and k["name"] in k["source"]
    bad = prepare(g.to_json(), {"mapping": "nope"}, 132, compile_now=False)
    assert bad["status"] == "compile_error" and "bad config" in bad["error"]
    wrong = prepare(g.to_json(), pruned[0][0].to_config(), 132, compile_now=False)
    assert wrong["status"] == "compile_error" and wrong["error"].startswith("codegen:")


def test_load_cases_errors():
    assert len(load_cases("quick")) >= 10
    with pytest.raises(BenchError, match="unknown suite 'nope'"):
        load_cases("nope")


# -- the command -----------------------------------------------------------------------------------
@pytest.mark.nogpu
def test_cli_without_gpu_is_one_line_error(tmp_path):
    from tunedb.cli import app

    out = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", "fusion", "--out", str(out), "--db", str(tmp_path / "x.duckdb")])
    assert r.exit_code == 1
    assert r.output.strip().startswith("error: no CUDA device")
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "x.duckdb").exists()


def test_cli_help_lists_the_options():
    from tunedb.cli import app

    r = CliRunner().invoke(app, ["bench", "fusion", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for opt in ("--db", "--suite", "--top", "--out", "--json", "--time-limit"):
        assert opt in r.output


# -- translators (only where the frameworks are installed; on CPU here) ------------------------------
def _small_anchors(dtype):
    from tunedb.kernels import suites

    spec = [("bias_act", "gelu_tanh"), ("norm", "add_layernorm"), ("softmax", "scale_mask_softmax"),
            ("norm", "rmsnorm"), ("permute", "transpose_add"), ("col_reduce", "col_center"),
            ("eltwise_chain", "eltwise_chain8"), ("xent", "softmax_xent"), ("gated", "swiglu")]
    return [suites.case(fam, var, 24, 40, dtype).graph for fam, var in spec]


def _peer_errors(kind, graphs):
    from tunedb.bench.peers import Frameworks, outputs_float64, peer_call
    from tunedb.graph.reference import run_reference
    from tunedb.runtime.inputs import make_inputs

    fw = Frameworks(gpu=False)
    errs = []
    for g in graphs:
        dev, ref_in = make_inputs(g, 3)
        refs = run_reference(g, ref_in)
        run, sync = peer_call(fw, kind, g, dev, device="cpu")
        outs = outputs_float64(run())
        sync()
        assert len(outs) == len(g.outputs)
        errs.append(max(rel_l2(o, refs[n]) for o, n in zip(outs, g.outputs)))
    return errs


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_jax_translator_matches_reference(dtype, tol):
    pytest.importorskip("jax")
    assert max(_peer_errors("jax", _small_anchors(dtype))) < tol


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_torch_translator_matches_reference(dtype, tol):
    pytest.importorskip("torch")
    assert max(_peer_errors("torch_eager", _small_anchors(dtype))) < tol


def test_torch_compile_translator_matches_reference():
    pytest.importorskip("torch")
    graphs = _small_anchors("float32")
    assert max(_peer_errors("torch_compile", [graphs[1], graphs[-2]])) < 1e-6


def test_finalists_are_the_fastest_in_quick_samples_ties_in_search_order():
    from tunedb.bench.fusion import finalists_of

    def g(us, i, label):
        return (us, i, {"label": label}, {"config": {"mapping": "elementwise"}})

    good = [g(10.5, 0, "a"), g(10.0, 1, "b"), g(11.0, 2, "c"), g(10.0, 3, "d"), g(9.0, 4, "e_cs")]
    assert [x[2]["label"] for x in finalists_of(good, 3)] == ["e_cs", "b", "d"]
    assert [x[2]["label"] for x in finalists_of(good[:1], 3)] == ["a"]

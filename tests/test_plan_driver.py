"""tunedb.compile end to end: BERT-12 planning time, DB hits, cost models, ONNX, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import tunedb
from tunedb.cli import app
from tunedb.graph.builder import GraphBuilder
from tunedb.plan import Plan, PlanError, compile
from tunedb.plan.examples import bert_encoder
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload
from tunedb.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]
H200 = DeviceInfo("NVIDIA H200", "uuid-plan", "9.0", 132, 60 * 2**20, 141 * 2**30, "580.159", "13.0", "14.2")
runner = CliRunner()


def test_bert12_plans_fast():
    g = bert_encoder(layers=12, batch=1, seq=128)
    t0 = time.perf_counter()
    p = tunedb.compile(g, device="generic")
    dt = time.perf_counter() - t0
    print(f"\nBERT-base 12 layers, batch 1, seq 128: planned {len(g.nodes)} ops in {dt:.3f} s "
          f"-> {p.kernels} launches, predicted {p.predicted_us:.1f} us")
    assert dt < 10.0  # the target is < 2 s on two cores; 10 s keeps a loaded CI machine green
    p.check()
    kinds = [s.kind for s in p.steps]
    assert kinds.count("matmul") == 12 * 8
    # Per layer: QKV bias (packed), scale+mask+softmax, bias+residual+layernorm, bias+GELU,
    # bias+residual+layernorm.
    assert kinds.count("fused") == 12 * 5
    softmax = [s for s in p.steps if "reduce_max" in s.ops]
    assert len(softmax) == 12 and all(s.kind == "fused" and len(s.ops) == 7 for s in softmax)
    assert len({s.workload_hash for s in softmax}) == 1  # same workload in every layer


def small_graph():
    b = GraphBuilder("small")
    x, w, bias = b.input("x", (32, 64)), b.input("w", (64, 128)), b.input("b", (128,))
    return b.build([b.softmax(b.add(b.matmul(x, w), bias))])


def store_measurement(db: Path, graph, config: dict, samples: tuple[float, ...]) -> str:
    wl = Workload.from_graph(graph, "softmax", "bias_softmax")
    cand = Candidate(wl.hash, "fusion", config, "src")
    run = Run("r1", "fusion", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00Z")
    with TuningStore.open(db) as store:
        store.add_devices([H200])
        store.add_runs([run])
        store.add_workloads([wl])
        store.add_candidates([cand])
        store.add_measurements([Measurement(cand.hash, H200.id, run.id, "ok", samples)])
    return wl.hash


def test_exact_db_hit_is_used(tmp_path):
    g = small_graph()
    first = compile(g, device="generic")
    fused = next(s for s in first.steps if s.kind == "fused")
    db = tmp_path / "t.duckdb"
    # The step's sub-graph hashes like the workload a collector stores.
    assert store_measurement(db, fused.graph, fused.config_dict, (3.0, 2.5, 3.5)) == fused.workload_hash
    p = compile(g, db=db, device=H200.id)
    k = next(i for i, s in enumerate(p.steps) if s.kind == "fused")
    step = p.steps[k]
    assert step.cost_source == "db" and step.predicted_us == pytest.approx(3.0)
    assert step.ops == fused.ops and step.config_dict == fused.config_dict
    assert H200.id in p.device and dict(p.search)["db_hits"] >= 1
    # "cuda" on a machine without a GPU falls back to the database's only device.
    with TuningStore.open(db, read_only=True) as store:
        assert compile(g, db=store).steps[k].cost_source == "db"
    with pytest.raises(PlanError, match="unknown device"):
        compile(g, db=db, device="no-such-gpu")


def test_a_slow_measurement_makes_the_search_split_the_group(tmp_path):
    g = small_graph()
    fused = next(s for s in compile(g, device="generic").steps if s.kind == "fused")
    db = tmp_path / "t.duckdb"
    store_measurement(db, fused.graph, fused.config_dict, (500.0,))
    p = compile(g, db=db, device=H200.id)
    p.check()
    assert fused.ops not in [s.ops for s in p.steps]
    assert sum(s.kind == "fused" for s in p.steps) >= 2


def test_measuring_the_top_schedules_on_a_replay_device(tmp_path):
    from tunedb.kernels.schedule import schedule_space

    g = small_graph()
    fused = next(s for s in compile(g, device="generic").steps if s.kind == "fused")
    configs = [s.to_config() for s in schedule_space(fused.graph)[0]]
    wl = Workload.from_graph(fused.graph, "softmax", "bias_softmax")
    times = {Candidate(wl.hash, "fusion", c).hash: 3.0 + (i * 7919 % 13) / 4 for i, c in enumerate(configs)}
    run = Run("r1", "fusion", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00Z")
    db = tmp_path / "replay.duckdb"
    with TuningStore.open(db) as store:
        store.add_devices([H200])
        store.add_runs([run])
        store.add_workloads([wl])
        store.add_candidates([Candidate(wl.hash, "fusion", c, "src") for c in configs])
        store.add_measurements([Measurement(h, H200.id, run.id, "ok", (t,)) for h, t in times.items()])
    p = compile(g, device="generic", measure_top=8, measure_device=f"replay:{db}")
    step = next(s for s in p.steps if s.kind == "fused")
    chosen = times[Candidate(wl.hash, "fusion", step.config_dict).hash]
    assert step.measured_us == chosen
    assert chosen <= times[Candidate(wl.hash, "fusion", fused.config_dict).hash]  # the first-ranked one
    assert "meas" in p.explain()


def make_cost_model_dir(path: Path) -> Path:
    import xgboost as xgb

    from tunedb.costmodel.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, DeviceFacts
    from tunedb.costmodel.model import CostModel
    from tunedb.costmodel.registry import save_model

    rng = np.random.default_rng(0)
    X = rng.random((200, len(FEATURE_NAMES))).astype(np.float32)
    y = X[:, FEATURE_NAMES.index("block")] + rng.random(200) * 0.1
    booster = xgb.train({"max_depth": 3, "nthread": 1}, xgb.DMatrix(X, label=y), num_boost_round=5)
    card = {"objective": "reg:squarederror", "calibration": [1.0, 0.0], "device": DeviceFacts().to_json(),
            "feature_schema_version": FEATURE_SCHEMA_VERSION, "feature_names": list(FEATURE_NAMES)}
    return save_model(CostModel(booster, card), path)


def test_cost_model_directory_prices_fused_steps(tmp_path):
    model_dir = make_cost_model_dir(tmp_path / "m")
    p = compile(small_graph(), cost_model=model_dir, device="generic")
    p.check()
    fused = [s for s in p.steps if s.kind == "fused"]
    assert fused and all(s.cost_source == "model" for s in fused)
    assert dict(p.search)["cost_model"] == "CostModel"
    assert [s.cost_source for s in p.steps if s.kind == "matmul"] == ["roofline"]


def test_measuring_needs_a_gpu():
    import tunedb.runtime.cuda  # noqa: F401 - imports without CuPy
    from tunedb.runtime.device import NoGPUError
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed; measuring would try the GPU")
    except ImportError:
        pass
    with pytest.raises(NoGPUError):
        compile(small_graph(), measure_top=2)


def small_onnx(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "B"),
             numpy_helper.from_array(np.ones(32, np.float32), "G"),
             numpy_helper.from_array(np.zeros(32, np.float32), "Beta")]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["h3"]),
             helper.make_node("LayerNormalization", ["h3", "G", "Beta"], ["h4"], axis=-1, epsilon=1e-5),
             helper.make_node("Softmax", ["h4"], ["Y"], axis=-1)]
    io = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [4, 32]) for v in ("X", "Y")]
    graph = helper.make_graph(nodes, "small_onnx", io[:1], io[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_compile_onnx_model_proto_and_path(tmp_path):
    path = small_onnx(tmp_path / "small.onnx")
    p = compile(str(path), device="generic")
    q = compile(onnx.load(path), device="generic")
    assert [s.ops for s in p.steps] == [s.ops for s in q.steps]
    assert [s.kind for s in p.steps] == ["matmul", "fused"]  # bias, relu, layernorm, softmax: one kernel
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    y = p.run({"X": x}, backend="reference")["Y"]
    assert y.shape == (4, 32) and np.allclose(y.sum(axis=-1), 1.0)


def invoke(*args: str, tmp_path: Path):
    return runner.invoke(app, list(args), env={"TUNEDB_DB": None, "XDG_DATA_HOME": str(tmp_path / "xdg")})


def test_cli_plan_prints_the_explanation_and_json(tmp_path):
    path = small_onnx(tmp_path / "small.onnx")
    res = invoke("plan", str(path), "--device", "generic", tmp_path=tmp_path)
    assert res.exit_code == 0, res.output
    assert "kernel launches" in res.output and "matmul" in res.output and "fused" in res.output
    res = invoke("plan", str(path), "--device", "generic", "--json", tmp_path=tmp_path)
    assert res.exit_code == 0, res.output
    plan = Plan.from_json(res.output)
    assert [s.kind for s in plan.steps] == ["matmul", "fused"]
    assert json.loads(res.output)["totals"]["kernels"] == 2


def test_cli_plan_errors_are_one_line(tmp_path):
    res = invoke("plan", str(tmp_path / "missing.onnx"), tmp_path=tmp_path)
    assert res.exit_code == 1 and "no such model file" in res.output
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    res = invoke("plan", str(bad), "--device", "generic", tmp_path=tmp_path)
    assert res.exit_code == 1 and res.output.startswith("error:") and "Traceback" not in res.output
    res = invoke("plan", str(small_onnx(tmp_path / "s.onnx")), "--bind", "oops", tmp_path=tmp_path)
    assert res.exit_code == 2 and "NAME=INT" in res.output  # a usage error


def test_import_tunedb_stays_light():
    code = ("import sys, tunedb; assert callable(tunedb.compile); "
            "print(sorted(m for m in sys.modules if m.startswith(('tunedb.', 'xgboost', 'duckdb', 'onnx')) "
            "and m != 'tunedb._version'))")  # the version string is all that loads
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_plan_reports_a_bad_cost_model_and_missing_gpu(tmp_path):
    path = small_onnx(tmp_path / "small.onnx")
    (tmp_path / "nomodel").mkdir()
    res = invoke("plan", str(path), "--device", "generic", "--model", str(tmp_path / "nomodel"),
                 tmp_path=tmp_path)
    assert res.exit_code == 1 and res.output.startswith("error:") and "model" in res.output
    try:
        import cupy  # noqa: F401
    except ImportError:
        res = invoke("plan", str(path), "--measure-top", "2", tmp_path=tmp_path)
        assert res.exit_code == 1 and "no CUDA device" in res.output

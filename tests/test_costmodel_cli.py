"""`tunedb train` end to end: a real DuckDB store filled with synthetic fusion measurements,
typer's CliRunner, the model files it writes and the row it records in the models table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tunedb.cli import app
from tunedb.costmodel.evaluate import SPLITS
from tunedb.costmodel.metrics import METRIC_KEYS
from tunedb.costmodel.registry import load_model
from tunedb.costmodel.synthetic import synthetic_frame
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload
from tunedb.store import TuningStore

H200 = DeviceInfo("NVIDIA H200", "uuid-a", "9.0", 132, 60 * 2**20, 141 * 2**30, "580.159", "13.0", "14.2")
A100 = DeviceInfo("NVIDIA A100", "uuid-b", "8.0", 108, 40 * 2**20, 80 * 2**30, "550.54", "12.4", "13.3")
runner = CliRunner()


def invoke(*args: str):
    # wide enough that rich prints every metric column's header in full
    return runner.invoke(app, list(args), env={"TUNEDB_DB": None, "XDG_DATA_HOME": None, "COLUMNS": "200"})


def fill_from_frame(store: TuningStore, frame: pa.Table, device: DeviceInfo, run_id: str = "run-1") -> None:
    """Store a synthetic frame as workloads, candidates and measurements (10 samples whose
    median is the frame's latency; failed rows as compile errors)."""
    rows = frame.to_pylist()
    store.add_devices([device])
    store.add_runs([Run(run_id, "fusion", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00Z")])
    store.add_workloads({r["workload_hash"]: Workload(r["workload_hash"], r["family"], r["workload_name"],
                                                      r["graph_json"]) for r in rows}.values())
    cands = [Candidate(r["workload_hash"], "fusion", json.loads(r["config_json"])) for r in rows]
    store.add_candidates(cands)
    ms = []
    for r, c in zip(rows, cands):
        if r["status"] != "ok":
            ms.append(Measurement(c.hash, device.id, run_id, "compile_error", error="ptxas error"))
            continue
        lat = r["median_us"]
        samples = tuple(lat * (1 + 0.001 * (j - 4.5)) for j in range(10))
        ms.append(Measurement(c.hash, device.id, run_id, "ok", samples, registers=r["registers"],
                              shared_bytes=r["shared_bytes"], local_bytes=r["local_bytes"]))
    store.add_measurements(ms)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("db") / "t.duckdb"
    frame = synthetic_frame(n_workloads=40, candidates_per_workload=20, seed=11,
                            families=("softmax", "norm", "col_reduce", "bias_act"))
    with TuningStore.open(path) as store:
        fill_from_frame(store, frame, H200)
    return path


@pytest.mark.slow
def test_train_json_reports_held_out_metrics_and_saves_the_model(db, tmp_path):
    out = tmp_path / "models"
    res = invoke("train", "--db", str(db), "--out", str(out), "--folds", "3", "--json")
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)
    for split in SPLITS:  # every metric under every split
        for key in METRIC_KEYS:
            assert isinstance(m[split][key], float), (split, key)
        assert m[split]["folds"] == 3
    for key in METRIC_KEYS:
        assert m[key] == m["by_workload"][key]
        for base in ("roofline", "random"):
            assert isinstance(m["baselines"][base][key], float)
    assert m["pairwise_accuracy"] > m["baselines"]["random"]["pairwise_accuracy"]
    assert m["folds"] == 3 and m["workloads"] == 40 and m["device_name"] == "NVIDIA H200"
    assert set(m["leave_family_out"]["families"]) == {"softmax", "norm", "col_reduce", "bias_act"}
    where = Path(m["model_dir"])
    assert where == out / "nvidia-h200" / "fusion"
    model = load_model(where)
    assert model.card["metrics"]["pairwise_accuracy"] == m["pairwise_accuracy"]
    with TuningStore.open(db, read_only=True) as store:
        frame = store.training_frame()
        rows = store.models()
    assert [r["id"] for r in rows] == [m["model_id"]]
    assert rows[0]["path"] == str(where) and rows[0]["device"] == "NVIDIA H200"
    assert json.loads(rows[0]["card_json"])["data"]["rows"] == m["rows"] == frame.num_rows
    pred = model.predict(frame)
    assert pred.shape == (frame.num_rows,) and np.all(np.isfinite(pred))


def test_train_prints_a_table(db, tmp_path):
    res = invoke("train", "--db", str(db), "--out", str(tmp_path), "--folds", "2", "--no-lofo",
                 "--objective", "reg:squarederror")
    assert res.exit_code == 0, res.output
    assert "pairwise" in res.stdout and "roofline" in res.stdout and "random" in res.stdout
    assert "reg:squarederror" in res.stdout and "leave_op_out" not in res.stdout
    assert f"model saved to {tmp_path / 'nvidia-h200' / 'fusion'}" in res.stdout


def test_errors_are_one_line(tmp_path, db):
    empty = tmp_path / "empty.duckdb"
    with TuningStore.open(empty):
        pass
    res = invoke("train", "--db", str(empty), "--out", str(tmp_path))
    assert res.exit_code == 1 and res.stderr.startswith("error: no ok measurements")
    assert res.stderr.count("\n") == 1
    res = invoke("train", "--db", str(db), "--out", str(tmp_path), "--objective", "rank:magic")
    assert res.exit_code == 1 and "unknown objective 'rank:magic'" in res.stderr
    two = tmp_path / "two.duckdb"
    with TuningStore.open(two) as store:
        fill_from_frame(store, synthetic_frame(4, 5, seed=1, families=("softmax",)), H200)
        fill_from_frame(store, synthetic_frame(2, 5, seed=2, families=("norm",)), A100, run_id="run-2")
    res = invoke("train", "--db", str(two), "--out", str(tmp_path))
    assert res.exit_code == 1 and "choose one with --device-id" in res.stderr
    res = invoke("train", "--db", str(two), "--out", str(tmp_path), "--device-id", "NVIDIA B200")
    assert res.exit_code == 1 and "matches 0 of the device models" in res.stderr
    res = invoke("train", "--db", str(two), "--out", str(tmp_path), "--device-id", "NVIDIA A100", "--json")
    assert res.exit_code == 1 and "at least 3 workloads to train and hold some out, got 2" in res.stderr


def test_train_picks_one_device_by_name(tmp_path):
    two = tmp_path / "two.duckdb"
    with TuningStore.open(two) as store:
        fill_from_frame(store, synthetic_frame(12, 8, seed=1, families=("softmax", "norm")), H200)
        fill_from_frame(store, synthetic_frame(12, 8, seed=2, families=("norm", "bias_act")), A100,
                        run_id="run-2")
    res = invoke("train", "--db", str(two), "--out", str(tmp_path), "--device-id", "NVIDIA A100",
                 "--folds", "2", "--json")
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)
    assert m["device_name"] == "NVIDIA A100" and m["workloads"] == 12
    assert Path(m["model_dir"]) == tmp_path / "nvidia-a100" / "fusion"
    assert load_model(m["model_dir"]).device.sm_count == 108


def test_device_id_picks_every_board_of_one_model(tmp_path):
    """A name or any board's id picks the model; all its boards train together, the other
    model's board is left out."""
    second = DeviceInfo(*[("uuid-c" if f == "uuid_hash" else getattr(H200, f))
                          for f in DeviceInfo.__dataclass_fields__])
    three = tmp_path / "three.duckdb"
    with TuningStore.open(three) as store:
        frame = synthetic_frame(8, 6, seed=3, families=("softmax", "norm"))
        fill_from_frame(store, frame, H200)
        fill_from_frame(store, frame, second, run_id="run-2")
        fill_from_frame(store, synthetic_frame(4, 5, seed=4, families=("norm",)), A100, run_id="run-3")
    res = invoke("train", "--db", str(three), "--out", str(tmp_path))
    assert res.exit_code == 1 and "2 device models" in res.stderr and res.stderr.count("\n") == 1
    for pick in ("NVIDIA H200", second.id):
        res = invoke("train", "--db", str(three), "--out", str(tmp_path), "--device-id", pick,
                     "--folds", "2", "--no-lofo", "--json")
        assert res.exit_code == 0, res.output
        m = json.loads(res.stdout)
        assert m["boards"] == 2 and m["workloads"] == 8 and m["rows"] == 2 * m["candidates"]
    res = invoke("train", "--db", str(three), "--out", str(tmp_path), "--device-id", "NVIDIA H200",
                 "--boards", "mean")
    assert res.exit_code == 1 and "--boards must be one of each, median" in res.stderr

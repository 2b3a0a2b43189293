"""`tunedb train --kind packing`: held out by workload and by scenario with the fusion kind's
metric keys, saved to the registry, recorded in the database, and usable by `tunedb.compile`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_packing_driver import attention
from typer.testing import CliRunner

from collectors.packing_ingest import ingest
from tunedb.cli import app
from tunedb.costmodel.metrics import METRIC_KEYS
from tunedb.costmodel.packing import FEATURE_SCHEMA, load_predictor
from tunedb.kernels.packing import candidates
from tunedb.plan.packing import graph_workloads
from tunedb.store.core import TuningStore

BENCH = Path(__file__).resolve().parent.parent / "data" / "bench" / "packing_h200.json"
runner = CliRunner()


@pytest.mark.slow
def test_train_packing_kind(tmp_path):
    db = tmp_path / "p.duckdb"
    ingest(db, BENCH)
    out = tmp_path / "models"
    res = runner.invoke(app, ["train", "--db", str(db), "--kind", "packing", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout[res.stdout.index("{"):])
    doc = json.loads(BENCH.read_text())
    assert m["workloads"] == len(doc["results"]) and m["folds"] == 5
    for split in ("by_workload", "leave_family_out"):
        assert set(METRIC_KEYS) <= set(m[split]) and 0.0 <= m[split]["model_within_5pct"] <= 1.0
        assert m[split]["workloads"] == m["workloads"]  # every workload held out once
    assert set(m["baselines"]) == {"rule", "random"}
    folder = Path(m["model_dir"])
    assert folder == (out / "nvidia-h200" / "packing").resolve()
    card = json.loads((folder / "card.json").read_text())
    assert card["kind"] == "packing" and card["feature_schema"] == FEATURE_SCHEMA
    with TuningStore.open(db) as store:
        assert [r["kind"] for r in store.models()] == ["packing"]
    predict = load_predictor(folder)  # what tunedb.compile(pack_model=...) loads
    (w,) = graph_workloads(attention(), "qkv")
    us = predict(w, candidates(w))
    assert len(us) == len(candidates(w)) and (us > 0).all()


def test_train_packing_without_packing_data_fails_in_one_line(tmp_path):
    db = tmp_path / "empty.duckdb"
    TuningStore.open(db).close()
    res = runner.invoke(app, ["train", "--db", str(db), "--kind", "packing", "--out", str(tmp_path / "m")])
    assert res.exit_code != 0
    assert "device models" in res.output and len(res.output.strip().splitlines()) == 1

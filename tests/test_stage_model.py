"""Cost-model kind ``stage``: features from the members, held-out scores, card and refusal.

The rows come from the stage bench's own bookkeeping (``refine`` with the oracle) on two small
graph families, timed by a synthetic stage-time function, written in the bench's rows format."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_stage_refine import _truth
from tunedb.bench.stages import refine
from tunedb.costmodel import stage as stage_model
from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph
from tunedb.plan.driver import compile as compile_plan


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    cases = {}
    graphs = {"nasnet_a_b1": (nasnet_a_graph(1, channels=8, size=8, cells=1), "block"),
              "randwire_b1": (randwire_graph(1, channels=8, size=8, nodes=12), "full")}
    for name, (g, oracle) in graphs.items():
        plan = compile_plan(g, device=None, cost_model=False, horizontal=False)
        out = refine(plan, lambda msg: None, time.perf_counter() + 120, oracle,
                     time_stage=_truth(plan.steps, 1))
        cases[name] = {"plan": plan.to_json(), "rows": out["all_rows"][:600]}
    path = tmp_path_factory.mktemp("stage") / "rows.json"
    path.write_text(json.dumps({"device": "synthetic", "cases": cases}))
    return path


@pytest.mark.slow
def test_stage_model_learns_held_out_stages_and_saves_a_card(rows_file, tmp_path):
    frame = stage_model.load_frame(rows_file)
    assert frame["X"].shape == (len(frame["y"]), len(stage_model.FEATURES))
    assert set(frame["families"]) == {"nasnet_a", "randwire"}
    wide = frame["X"][:, stage_model.FEATURES.index("groups")] > 1
    assert wide.any() and (~wide).any()
    scores = stage_model.evaluate(frame, folds=3)
    assert {"by_workload", "by_family", "rule_longest_group", "rule_sum_of_groups"} <= set(scores)
    # the synthetic times are the members' weights overlapped in part: the model must learn that
    # better than either fixed rule on held-out stages
    best_rule = min(scores["rule_longest_group"]["mape"], scores["rule_sum_of_groups"]["mape"])
    assert scores["by_workload"]["mape"] < best_rule
    booster = stage_model.fit(frame["X"], frame["y"])
    out = stage_model.save(booster, tmp_path / "m", frame, scores, "synthetic")
    card = json.loads((out / "card.json").read_text())
    assert card["kind"] == "stage" and card["feature_schema"] == stage_model.FEATURE_SCHEMA
    booster = stage_model.load_booster(out)
    pred = stage_model.predict_us(booster, frame["X"])
    assert np.all(np.isfinite(pred)) and np.all(pred > 0)
    card["kind"] = "packing"
    (out / "card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="expected stage"):
        stage_model.load_booster(out)


def test_stage_model_refuses_a_rows_file_without_rows(tmp_path):
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps({"cases": {}}))
    with pytest.raises(ValueError, match="no measured stage rows"):
        stage_model.load_frame(bad)


@pytest.mark.slow
def test_stage_rows_in_a_database_train_the_stage_kind_from_the_cli(rows_file, tmp_path):
    from typer.testing import CliRunner

    from collectors.stage import main as collector_main
    from tunedb.cli import app
    from tunedb.store import TuningStore

    db = tmp_path / "stage.duckdb"
    assert collector_main([str(rows_file), str(db)]) == 0
    with TuningStore.open(db, read_only=True) as store:
        assert len(store.devices()) == 1
        stored = store.con.execute("SELECT count(*) FROM candidates WHERE kind = 'stage'").fetchone()[0]
    assert stored > 0
    assert collector_main([str(tmp_path / "missing.json"), str(db)]) == 1
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--kind", "stage", "--db", str(db), "--out", str(tmp_path / "m"),
                              "--folds", "3", "--json"], env={"TUNEDB_DB": None, "XDG_DATA_HOME": None})
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["rows"] == stored  # one row per stage candidate
    assert set(out["by_family"]["families"]) == {"nasnet_a", "randwire"}
    rules = min(out["rule_longest_group"]["mape"], out["rule_sum_of_groups"]["mape"])
    assert out["by_workload"]["mape"] < rules
    card = json.loads((Path(out["model_dir"]) / "card.json").read_text())
    assert card["kind"] == "stage" and card["device"] == "synthetic"
    stage_model.load_booster(Path(out["model_dir"]))
    with TuningStore.open(db, read_only=True) as store:
        assert store.con.execute("SELECT count(*) FROM models WHERE kind = 'stage'").fetchone()[0] == 1

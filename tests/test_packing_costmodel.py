"""Cost model kind packing: features from records, trained and judged on held-out workloads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tunedb.costmodel.packing import (
    FEATURE_SCHEMA,
    FEATURES,
    evaluate,
    features,
    fit,
    load_frame,
    main,
    predict_us,
    save,
)
from tunedb.kernels.packing import candidates
from tunedb.kernels.packing_suites import bench_cases

DATA = Path(__file__).resolve().parent.parent / "data" / "packing_h200"


def test_features_follow_the_candidate():
    w = next(c for c in bench_cases() if c.family == "lora")
    rows = {c.name: features(w, c) for c in candidates(w)}
    assert all(tuple(r) == FEATURES for r in rows.values())
    assert rows["whole:serial"]["launches"] == len(w.members)
    assert rows["whole:padded"]["launches"] == 1
    assert rows["whole:padded"]["waste"] > 0.8 and rows["whole:serial"]["waste"] == 0.0
    assert rows["whole:streams8"]["lanes"] == 8
    # the workload's own features are the same for every candidate
    assert len({r["log_flops"] for r in rows.values()}) == 1


@pytest.mark.slow
def test_held_out_choice_beats_the_fixed_rule_on_shipped_data(tmp_path):
    frame = load_frame(DATA)
    assert len(np.unique(frame["groups"])) == 180 and frame["X"].shape[1] == len(FEATURES)
    res = evaluate(frame, folds=3, splits=("by_workload",))
    bw = res["by_workload"]
    assert bw["workloads"] == 180
    # measured on workloads the model never saw: better than one fixed rule for everything
    assert bw["model_geomean_ratio"] < bw["rule_geomean_ratio"]
    out = save(fit(frame["X"], frame["y"]), tmp_path / "m", frame, res)
    card = json.loads((out / "card.json").read_text())
    assert card["kind"] == "packing" and card["feature_schema"] == FEATURE_SCHEMA
    import xgboost as xgb

    b = xgb.Booster()
    b.load_model(str(out / "model.json"))
    assert np.all(predict_us(b, frame["X"][:5]) > 0)


def test_missing_data_is_one_line(tmp_path, capsys):
    assert main(["--data", str(tmp_path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1

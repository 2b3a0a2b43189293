"""Cost-model kind ``stage``: features from the members, held-out scores, card and refusal.

The rows come from the stage bench's own bookkeeping (``refine`` with the oracle) on two small
graph families, timed by a synthetic stage-time function, written in the bench's rows format."""

from __future__ import annotations

import json
import time

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
        cases[name] = {"plan": plan.to_json(), "rows": out["all_rows"][:1500]}
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


def test_stage_model_cli_refuses_a_bad_rows_file(tmp_path, capsys):
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps({"cases": {}}))
    assert stage_model.main(["--rows", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no measured stage rows" in err and "\n" not in err

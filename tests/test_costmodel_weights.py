"""Per-row training weights: a secondary dataset's rows can count less (``train_booster``'s
``weight``, ``Labels.weight`` in the held-out splits)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tunedb.costmodel.evaluate import Labels, evaluate_split
from tunedb.costmodel.features import featurize_frame
from tunedb.costmodel.fit import clean_frame
from tunedb.costmodel.metrics import pairwise_accuracy
from tunedb.costmodel.synthetic import synthetic_frame
from tunedb.costmodel.train import TrainError, TrainParams, predict_us, train_booster

FAST = TrainParams(num_boost_round=60, max_depth=5, eta=0.3, bag=1, objective="reg:squarederror")


@pytest.fixture(scope="module")
def data():
    frame = clean_frame(synthetic_frame(n_workloads=40, candidates_per_workload=24, seed=11))
    X = featurize_frame(frame)
    y = frame["median_us"].to_numpy().astype(np.float64)
    g = np.asarray(frame["workload_hash"].to_pylist())
    # The second half of the workloads is a "secondary dataset" whose order is reversed within
    # each workload: learnt at full weight it teaches the opposite of the primary half.
    names = np.unique(g)
    secondary = np.isin(g, names[len(names) // 2:])
    flipped = y.copy()
    for w in names[len(names) // 2:]:
        rows = np.flatnonzero(g == w)
        flipped[rows] = y[rows].max() * y[rows].min() / y[rows]
    return X, flipped, g, secondary


def test_zero_weight_rows_do_not_teach(data):
    X, y, g, secondary = data
    primary = ~secondary
    acc = {}
    for w in (0.0, 1.0):
        r = train_booster(X, y, g, FAST, weight=np.where(secondary, w, 1.0))
        pred = predict_us(r.booster, X[primary], r.objective, r.calibration, r.calibration_floor)
        acc[w] = pairwise_accuracy(np.log(y[primary]), np.log(pred), g[primary])
    assert acc[0.0] > 0.8
    assert acc[0.0] > acc[1.0] + 0.05


def test_held_out_splits_pass_the_weights_to_training(data):
    X, y, g, secondary = data
    scores = {}
    for w in (0.0, 1.0):
        labels = Labels.of(g, weight=np.where(secondary, w, 1.0))
        ev = evaluate_split(X, y, labels, "by_workload", replace(FAST, seed=1), folds=3)
        rows = np.flatnonzero(~secondary)
        scores[w] = pairwise_accuracy(np.log(y[rows]), np.log(ev["pred"][rows]), g[rows])
    assert scores[0.0] > scores[1.0] + 0.05
    assert len(Labels.of(g, weight=np.ones(len(g))).take(np.arange(5)).weight) == 5


@pytest.mark.parametrize("bad", [np.ones(3), np.full(1, -1.0), np.full(1, np.nan)])
def test_bad_weights_are_refused(data, bad):
    X, y, g, _ = data
    weight = bad if len(bad) == 3 else np.full(len(y), bad[0])
    with pytest.raises(TrainError, match="weight"):
        train_booster(X, y, g, FAST, weight=weight)

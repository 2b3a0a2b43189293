"""benchmarks/costmodel_diagnose.py: which rows a learning-curve fold trains on, with and without
a base dataset kept whole (``--grow-from``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _diagnose():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling costmodel_variants
    try:
        spec = importlib.util.spec_from_file_location("costmodel_diagnose", BENCH / "costmodel_diagnose.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


# 20 workloads of 4 rows each; the first 8 workloads are the base dataset.
WORKLOAD = np.repeat(np.arange(20), 4)
BASE = WORKLOAD < 8
TRAIN = np.flatnonzero(WORKLOAD % 5 != 0)  # a fold: workloads 0, 5, 10, 15 held out


def test_a_fraction_keeps_whole_workloads_at_random() -> None:
    rows = _diagnose().training_rows
    assert np.array_equal(rows(TRAIN, WORKLOAD, 1.0, 0), TRAIN)
    half = rows(TRAIN, WORKLOAD, 0.5, 0)
    kept = np.unique(WORKLOAD[half])
    assert len(kept) == 8 and set(kept) <= set(WORKLOAD[TRAIN])
    assert all((WORKLOAD[half] == w).sum() == 4 for w in kept)  # whole workloads
    assert not np.array_equal(half, rows(TRAIN, WORKLOAD, 0.5, 1))  # another draw, other workloads
    assert len(np.unique(WORKLOAD[rows(TRAIN, WORKLOAD, 0.0, 0)])) == 3  # never fewer than 3


def test_grow_from_keeps_the_base_and_draws_from_the_rest() -> None:
    rows = _diagnose().training_rows
    base_train = TRAIN[BASE[TRAIN]]
    assert np.array_equal(rows(TRAIN, WORKLOAD, 0.0, 0, BASE), base_train)  # the base alone
    for seed in range(3):
        half = rows(TRAIN, WORKLOAD, 0.5, seed, BASE)
        assert set(base_train) <= set(half)
        new = np.unique(WORKLOAD[np.setdiff1d(half, base_train)])
        assert len(new) == 5 and (new >= 8).all()  # half of the 10 training workloads past the base
    assert np.array_equal(rows(TRAIN, WORKLOAD, 1.0, 0, BASE), TRAIN)

"""The noise ceiling from re-measurements (tunedb.costmodel.ceiling) and the top-weighted
regression's row weights (and their workload balance), on hand-made frames with known answers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tunedb.costmodel.ceiling import consensus_ceiling, measurement_sets, remeasurement_ceiling
from tunedb.costmodel.errors import CostModelError
from tunedb.costmodel.train import top_weights

# Two workloads of four candidates; latencies far apart (every pair decisive).
BASE = np.array([10.0, 20.0, 40.0, 80.0, 5.0, 6.0, 7.5, 9.0])
CANDS = [f"c{i}" for i in range(8)]
WLS = ["w0"] * 4 + ["w1"] * 4


def frame(sets: dict[tuple[str, str], np.ndarray], status: str = "ok") -> pa.Table:
    rows: dict[str, list] = {k: [] for k in ("candidate_hash", "workload_hash", "device_id", "run_id",
                                             "median_us", "p20_us", "p80_us", "status")}
    for (dev, run), lat in sets.items():
        for c, w, v in zip(CANDS, WLS, lat):
            for k, x in zip(rows, (c, w, dev, run, float(v), float(v) * 0.999, float(v) * 1.001, status)):
                rows[k].append(x)
    return pa.table(rows)


def test_an_identical_remeasurement_scores_one_and_a_swap_costs_one_pair():
    same = remeasurement_ceiling(frame({("a", "r1"): BASE, ("b", "r2"): BASE}), min_candidates=4)
    assert len(same) == 2 and {r["same_board"] for r in same} == {False}
    for r in same:
        assert r["candidates"] == 8 and r["workloads"] == 2
        assert r["top1_score"] == r["pairwise_accuracy"] == r["decisive_pair_accuracy"] == 1.0
    # The re-measurement swaps the two fastest candidates of w0: one of its six pairs flips, and
    # the reference's first pick (c0) now measures 20 against a best of 10.
    swapped = BASE.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    r = remeasurement_ceiling(frame({("a", "r1"): BASE, ("a", "r2"): swapped}), min_candidates=4)[0]
    assert r["same_board"]
    assert r["pairwise_accuracy"] == pytest.approx((5 / 6 + 1) / 2)
    assert r["top1_score"] == pytest.approx((10 / 20 + 1) / 2)
    assert r["top1_within_2pct"] == 0.5


def test_sets_sharing_too_few_candidates_are_skipped_and_bad_frames_refused():
    t = frame({("a", "r1"): BASE, ("b", "r2"): BASE})
    assert remeasurement_ceiling(t, min_candidates=9) == []
    assert remeasurement_ceiling(frame({("a", "r1"): BASE}, status="ok"), min_candidates=1) == []
    failed = pa.concat_tables([frame({("a", "r1"): BASE}), frame({("b", "r2"): BASE}, status="timeout")])
    assert list(measurement_sets(failed)) == [("a", "r1")]
    with pytest.raises(CostModelError, match="lacks column"):
        measurement_sets(t.drop_columns(["p20_us"]))


def test_consensus_of_two_references_beats_one_and_extrapolates():
    rng = np.random.default_rng(0)
    noisy = {(d, "r"): BASE * np.exp(rng.normal(0, 0.15, 8)) for d in ("a", "b", "c")}
    out = consensus_ceiling(frame(noisy), min_candidates=8)
    assert len(out) == 3  # each set once as the labels, the other two as references
    for r in out:
        for k, v in r["exact_estimate"].items():
            assert v == pytest.approx(min(1.0, 2 * r["two_references"][k] - r["one_reference"][k]))
        assert 0.0 <= r["two_references"]["pairwise_accuracy"] <= 1.0


def test_top_weights_favour_each_workloads_fastest_candidates():
    label = np.log(np.array([10.0, 11.0, 20.0, 1.0, 1.05]))
    groups = np.array([0, 0, 0, 1, 1])
    w = top_weights(label + np.array([3.0, 3.0, 3.0, -2.0, -2.0]), groups, 0.1)  # offsets cancel
    assert w[0] == pytest.approx(1.1) and w[3] == pytest.approx(1.1)
    assert w[1] == pytest.approx(0.1 + np.exp(-1.0), rel=1e-5)  # 10 % slower than its best
    assert w[2] == pytest.approx(0.1, abs=1e-4)  # twice as slow: the floor weight
    assert top_weights(label, groups, 0.0) is None


def test_workload_balance_evens_out_big_and_small_workloads():
    from tunedb.costmodel.train import TrainError, TrainParams, row_weights

    groups = np.array([0] * 8 + [1] * 2)
    label = np.zeros(10)  # every candidate as fast as its best: top weight 1.1 each
    off = row_weights(label, groups, TrainParams(workload_balance=0.0))
    assert off == pytest.approx(np.full(10, 1.1))
    equal = row_weights(label, groups, TrainParams(top_weight=0.0, workload_balance=1.0))
    assert equal.mean() == pytest.approx(1.0)  # rescaled: the mean weight is kept
    assert equal[:8].sum() == pytest.approx(equal[8:].sum())  # each workload weighs the same
    half = row_weights(label, groups, TrainParams(workload_balance=0.5))
    assert half[:8].sum() / half[8:].sum() == pytest.approx(2.0)  # sqrt(8 / 2)
    assert row_weights(label, groups, TrainParams(top_weight=0.0)) is None
    with pytest.raises(TrainError, match="workload_balance must be in"):
        TrainParams(workload_balance=1.5)


def test_split_samples_of_a_quiet_board_rank_like_its_medians():
    from tunedb.costmodel.ceiling import split_sample_ceiling

    rng = np.random.default_rng(0)
    # two workloads; candidates 5 % apart with 0.3 % sample noise: every decisive pair survives
    true = [10.0 * 1.05 ** k for k in range(6)] * 2
    samples = [list(t * (1 + 0.003 * rng.standard_normal(10))) for t in true]
    workloads = ["a"] * 6 + ["b"] * 6
    for how in ("halves", "alternate"):
        r = split_sample_ceiling(samples, workloads, how)
        assert r["candidates"] == 12 and r["workloads"] == 2
        assert r["top1_score"] == r["top1_within_2pct"] == r["decisive_pair_accuracy"] == 1.0
    # noise as large as the gaps: the re-measurement no longer orders every pair alike
    noisy = [list(t * (1 + 0.08 * rng.standard_normal(10))) for t in true]
    assert split_sample_ceiling(noisy, workloads)["pairwise_accuracy"] < 1.0
    assert split_sample_ceiling([[1.0, 2.0, 3.0], [1.0] * 4], ["a", "a"])["candidates"] == 0  # 3 samples
    assert split_sample_ceiling(samples[:1], ["a"])["candidates"] == 0  # no pair in its workload
    with pytest.raises(CostModelError, match="unknown sample split"):
        split_sample_ceiling(samples, workloads, "random")

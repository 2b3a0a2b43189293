"""Cost-model metrics (TenSet definitions) on hand-made cases with known answers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tunedb.costmodel.metrics import (
    METRIC_KEYS,
    all_metrics,
    decisive_pairs,
    mape,
    pairwise_accuracy,
    spearman,
    top1_within,
    top_k_score,
)

# Two workloads: latencies 1..4 and 10, 20, 30.
Y = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0])
G = np.array([0, 0, 0, 0, 1, 1, 1])


def _pairwise_reference(y, p, g):
    correct = total = 0.0
    for i, j in itertools.combinations(range(len(y)), 2):
        if g[i] != g[j] or y[i] == y[j]:
            continue
        total += 1
        if p[i] == p[j]:
            correct += 0.5
        elif (p[i] < p[j]) == (y[i] < y[j]):
            correct += 1
    return correct / total


def test_perfect_ranking_is_one_and_reversed_is_zero():
    assert pairwise_accuracy(Y, Y, G) == 1.0
    assert pairwise_accuracy(Y, 3 * Y + 7, G) == 1.0  # any increasing map ranks the same
    assert pairwise_accuracy(Y, -Y, G) == 0.0
    assert pairwise_accuracy(Y, -Y, G, per_workload=True) == 0.0
    assert spearman(Y, Y, G) == pytest.approx(1.0)
    assert spearman(Y, -Y, G) == pytest.approx(-1.0)
    assert top_k_score(Y, Y, G, k=1) == 1.0


def test_pairs_only_within_a_workload():
    # Globally the prediction is perfectly wrong across workloads, but right inside each one.
    pred = np.array([101.0, 102.0, 103.0, 104.0, 1.0, 2.0, 3.0])
    assert pairwise_accuracy(Y, pred, G) == 1.0
    assert spearman(Y, pred) < 0.0 < spearman(Y, pred, G)


def test_label_ties_are_excluded_and_prediction_ties_count_half():
    y = np.array([1.0, 1.0, 2.0])
    g = np.zeros(3)
    # Pairs with distinct labels: (0,2), (1,2). The first tie in prediction, the second right.
    assert pairwise_accuracy(y, np.array([5.0, 1.0, 5.0]), g) == pytest.approx(0.75)
    assert pairwise_accuracy(y, np.zeros(3), g) == 0.5
    assert math.isnan(pairwise_accuracy(np.ones(3), np.arange(3.0), g))


def test_pairwise_matches_brute_force_and_pooled_vs_per_workload():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 6, 300).astype(float)
    p = y + rng.normal(0, 2, 300)
    g = rng.integers(0, 7, 300)
    assert pairwise_accuracy(y, p, g) == pytest.approx(_pairwise_reference(y, p, g))
    # Pooled weights workloads by their pairs; the per-workload mean weights them equally.
    y2 = np.array([1.0, 2.0, 1.0, 2.0, 3.0, 4.0])
    g2 = np.array([0, 0, 1, 1, 1, 1])
    p2 = np.array([2.0, 1.0, 1.0, 2.0, 3.0, 4.0])  # workload 0 wrong (1 pair), 1 right (6 pairs)
    assert pairwise_accuracy(y2, p2, g2) == pytest.approx(6 / 7)
    assert pairwise_accuracy(y2, p2, g2, per_workload=True) == pytest.approx(0.5)


def test_pairwise_blocks_large_workloads_exactly(monkeypatch):
    import tunedb.costmodel.metrics as m

    rng = np.random.default_rng(0)
    y, p = rng.random(500), rng.random(500)
    g = np.zeros(500)
    whole = pairwise_accuracy(y, p, g)
    monkeypatch.setattr(m, "_PAIR_BLOCK", 1000)  # two rows per block
    assert pairwise_accuracy(y, p, g) == whole


def test_top_k_score_formula():
    # Reversed prediction: top-1 picks the slowest. Workload 0: 1/4, workload 1: 10/30.
    assert top_k_score(Y, -Y, G, k=1) == pytest.approx((1 / 4 + 10 / 30) / 2)
    # Top-2 of the reversed order: best among {4, 3} and {30, 20}.
    assert top_k_score(Y, -Y, G, k=2) == pytest.approx((1 / 3 + 10 / 20) / 2)
    # k at least the workload size always finds the best.
    assert top_k_score(Y, -Y, G, k=5) == 1.0
    # A prediction that is right about the best only.
    pred = np.array([0.0, 9.0, 8.0, 7.0, 0.0, 9.0, 8.0])
    assert top_k_score(Y, pred, G, k=1) == 1.0
    assert pairwise_accuracy(Y, pred, G) < 1.0
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_score(Y, Y, G, k=0)


def test_top_k_breaks_prediction_ties_at_random_not_by_row_order():
    # A constant predictor must not score 1.0 just because the best row comes first.
    y = np.tile(np.array([1.0, 2.0, 4.0, 8.0]), 200)
    g = np.repeat(np.arange(200), 4)
    score = top_k_score(y, np.zeros_like(y), g, k=1, seed=1)
    expected = np.mean([1 / 1, 1 / 2, 1 / 4, 1 / 8])
    assert score == pytest.approx(expected, abs=0.06)
    assert top_k_score(y, np.zeros_like(y), g, k=1, seed=1) == score  # seeded


def test_single_candidate_workloads_do_not_count_for_top_k():
    y = np.array([5.0, 1.0, 2.0])
    g = np.array([0, 1, 1])
    assert top_k_score(y, np.array([0.0, 2.0, 1.0]), g, k=1) == pytest.approx(0.5)


def test_mape_and_spearman_values():
    assert mape(np.array([10.0, 20.0]), np.array([11.0, 15.0])) == pytest.approx((0.1 + 0.25) / 2)
    assert mape(np.array([10.0]), np.array([10.0])) == 0.0
    # Spearman with ties equals the Pearson correlation of average ranks.
    y = np.array([1.0, 2.0, 2.0, 3.0, 5.0])
    p = np.array([1.0, 3.0, 2.0, 2.0, 9.0])
    ry = np.array([1, 2.5, 2.5, 4, 5])
    rp = np.array([1, 4, 2.5, 2.5, 5])
    assert spearman(y, p) == pytest.approx(np.corrcoef(ry, rp)[0, 1])
    # A workload whose prediction is constant contributes 0 to the per-workload mean.
    g = np.array([0, 0, 1, 1])
    assert spearman(np.array([1.0, 2, 1, 2]), np.array([1.0, 2, 5, 5]), g) == pytest.approx(0.5)


def test_all_metrics_keys_and_length_check():
    m = all_metrics(Y, Y, G)
    assert set(METRIC_KEYS) <= set(m)
    assert m["mape"] == 0.0 and m["top5_score"] == 1.0 and m["top1_within_2pct"] == 1.0
    assert m["decisive_pair_accuracy"] == 1.0 and m["pairwise_accuracy_pooled"] == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        pairwise_accuracy(Y, Y[:3], G)


def test_pairwise_accuracy_key_is_the_mean_over_workloads():
    # Workload 0 wrong on its one pair, workload 1 right on all six: mean 0.5, pooled 6/7.
    y = np.array([1.0, 2.0, 1.0, 2.0, 3.0, 4.0])
    g = np.array([0, 0, 1, 1, 1, 1])
    m = all_metrics(y, np.array([2.0, 1.0, 1.0, 2.0, 3.0, 4.0]), g)
    assert m["pairwise_accuracy"] == pytest.approx(0.5)
    assert m["pairwise_accuracy_pooled"] == pytest.approx(6 / 7)


def test_decisive_pairs_need_a_two_percent_gap_beyond_both_bands():
    y = np.array([10.0, 10.1, 20.0, 5.0, 6.0, 6.05])
    lo = np.array([9.9, 10.0, 19.0, 4.9, 5.0, 6.0])
    hi = np.array([10.1, 10.2, 21.0, 5.1, 5.8, 6.1])
    g = np.array([0, 0, 0, 1, 1, 1])
    # Workload 0: (10, 10.1) is 1 % apart, not decisive; (10, 20) and (10.1, 20) are (gap 10 >
    # bands 0.2 and 2). Workload 1: (5, 6) is 20 % apart but 6's band is 0.8 < 1, decisive;
    # (6, 6.05) under 2 %; (5, 6.05) decisive. So 4 decisive pairs of 6 distinct.
    pred = np.array([2.0, 1.0, 3.0, 1.0, 2.0, 3.0])  # wrong on (10, 10.1) only
    r = decisive_pairs(y, pred, g, lo, hi)
    assert r == {"accuracy": 1.0, "accuracy_pooled": 1.0, "share": 4 / 6, "pairs": 4}
    # Wrong on (10, 20) alone: workload 0 scores 1/2, workload 1 scores 1; mean 0.75, pooled 3/4.
    r = decisive_pairs(y, np.array([3.0, 1.0, 2.0, 1.0, 2.0, 3.0]), g, lo, hi)
    assert r["accuracy"] == pytest.approx(0.75) and r["accuracy_pooled"] == pytest.approx(0.75)
    # A wide band makes a far pair indecisive: 6's band now spans more than the gap to 5.
    wide = hi.copy()
    wide[4] = 7.5
    assert decisive_pairs(y, pred, g, lo, wide)["pairs"] == 3
    # Without spreads only the 2 % gap decides.
    assert decisive_pairs(y, pred, g)["pairs"] == 4
    with pytest.raises(ValueError, match="spreads differ in length"):
        decisive_pairs(y, pred, g, lo[:2], hi[:2])


def test_top1_within_counts_workloads_whose_pick_is_near_the_best():
    y = np.array([1.0, 1.01, 2.0, 10.0, 11.0])
    g = np.array([0, 0, 0, 1, 1])
    # Workload 0 picks 1.01 (1 % off the best: within 2 %); workload 1 picks 11 (10 % off).
    pred = np.array([2.0, 1.0, 3.0, 2.0, 1.0])
    assert top1_within(y, pred, g) == 0.5
    assert top1_within(y, pred, g, tolerance=0.0) == 0.0
    assert top1_within(y, pred, g, tolerance=0.2) == 1.0

"""Ranking and regression metrics for cost models, grouped by workload (TenSet definitions).

Conventions: ``y`` is the measured latency and ``pred`` the model's predicted cost; lower is better
for both (a ranking model's score is passed negated). ``groups`` holds one integer or string per
row naming its workload; candidates are only ever compared within their own workload.
Everything is NumPy and vectorised over rows; the only Python loop is over workloads for the
pairwise count, whose cost is quadratic in the candidates of one workload anyway.
"""

from __future__ import annotations

import numpy as np

# The headline metrics, in table order.
METRIC_KEYS: tuple[str, ...] = ("pairwise_accuracy", "top1_score", "top5_score", "mape", "spearman")

# Above this many candidates in one workload the pairwise count is done in row blocks so that the
# n-by-n comparison never holds more than about this many booleans at once.
_PAIR_BLOCK = 4_000_000


def _group_codes(groups: np.ndarray) -> np.ndarray:
    _, codes = np.unique(np.asarray(groups), return_inverse=True)
    return codes.reshape(-1).astype(np.int64)


def _check(y: np.ndarray, pred: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, ...]:
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    if not (len(y) == len(pred) == len(g)):
        raise ValueError(f"metric inputs differ in length: y {len(y)}, pred {len(pred)}, groups {len(g)}")
    return y, pred, _group_codes(g)


def _group_slices(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row order that sorts by group (stable), plus each group's [start, end) in that order."""
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes)
    ends = np.cumsum(counts)
    return order, ends - counts, ends


def _pair_counts(y: np.ndarray, p: np.ndarray, lo: np.ndarray | None = None,
                 hi: np.ndarray | None = None) -> tuple[float, int, int]:
    """(correct, counted, distinct) over pairs with distinct labels; a tie in the prediction
    counts half. With spreads ``lo``/``hi`` only the pairs whose [lo, hi] do not overlap are
    counted; ``distinct`` is every pair with distinct labels either way."""
    n = len(y)
    correct = 0.0
    counted = distinct = 0
    step = max(1, _PAIR_BLOCK // max(n, 1))
    for a in range(0, n, step):
        dy = np.sign(y[a:a + step, None] - y[None, :])
        dp = np.sign(p[a:a + step, None] - p[None, :])
        valid = dy != 0
        distinct += int(valid.sum())
        if lo is not None and hi is not None:
            valid &= (hi[a:a + step, None] < lo[None, :]) | (hi[None, :] < lo[a:a + step, None])
        counted += int(valid.sum())
        correct += float((dy == dp)[valid].sum()) + 0.5 * float((dp == 0)[valid].sum())
    # Every unordered pair was seen twice (i, j) and (j, i), with the same outcome.
    return correct / 2.0, counted // 2, distinct // 2


def pairwise_accuracy(y: np.ndarray, pred: np.ndarray, groups: np.ndarray,
                      per_workload: bool = False) -> float:
    """Fraction of same-workload candidate pairs (label ties excluded) that the prediction orders
    like the measurement. Pooled over all pairs, or the mean of per-workload accuracies."""
    y, pred, codes = _check(y, pred, groups)
    order, starts, ends = _group_slices(codes)
    ys, ps = y[order], pred[order]
    accs: list[float] = []
    correct = 0.0
    total = 0
    for s, e in zip(starts, ends):
        if e - s < 2:
            continue
        c, t, _ = _pair_counts(ys[s:e], ps[s:e])
        correct += c
        total += t
        if t:
            accs.append(c / t)
    if per_workload:
        return float(np.mean(accs)) if accs else float("nan")
    return correct / total if total else float("nan")


def resolved_pairwise(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray) -> dict[str, float | int | None]:
    """Pairwise accuracy over the pairs the measurements resolve: same-workload pairs whose
    [lo, hi] spreads (e.g. the 20th-80th percentile of their samples) do not overlap. ``share``:
    their fraction of all pairs with distinct labels. The rest differ by less than the run-to-run
    spread, so even an exact model of the true latency orders them right only by chance."""
    y, pred, codes = _check(y, pred, groups)
    lo = np.asarray(lo, dtype=np.float64).reshape(-1)
    hi = np.asarray(hi, dtype=np.float64).reshape(-1)
    if not (len(lo) == len(hi) == len(y)):
        raise ValueError(f"spreads differ in length from the labels: {len(lo)}, {len(hi)} vs {len(y)}")
    order, starts, ends = _group_slices(codes)
    ys, ps, ls, hs = y[order], pred[order], lo[order], hi[order]
    correct, resolved, total = 0.0, 0, 0
    for s, e in zip(starts, ends):
        c, r, t = _pair_counts(ys[s:e], ps[s:e], ls[s:e], hs[s:e])
        correct, resolved, total = correct + c, resolved + r, total + t
    return {"accuracy": correct / resolved if resolved else None,
            "share": resolved / total if total else None, "pairs": resolved}


def top_k_score(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, k: int = 1, seed: int = 0) -> float:
    """Mean over workloads (with >= 2 candidates) of best latency / best latency among the model's
    k lowest predictions. Ties in the prediction are broken by a seeded random order so that a
    predictor which cannot tell candidates apart is not rewarded by the data's row order."""
    if k < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    y, pred, codes = _check(y, pred, groups)
    if len(y) == 0:
        return float("nan")
    tiebreak = np.random.default_rng(seed).random(len(y))
    order = np.lexsort((tiebreak, pred, codes))
    ys, cs = y[order], codes[order]
    counts = np.bincount(cs)
    starts = np.cumsum(counts) - counts
    rank = np.arange(len(ys)) - starts[cs]
    best = np.full(len(counts), np.inf)
    np.minimum.at(best, cs, ys)
    chosen = np.full(len(counts), np.inf)
    sel = rank < k
    np.minimum.at(chosen, cs[sel], ys[sel])
    keep = counts >= 2
    return float(np.mean(best[keep] / chosen[keep])) if keep.any() else float("nan")


def mape(y: np.ndarray, pred: np.ndarray) -> float:
    """Mean absolute percentage error as a fraction (0.1 = 10 %), over rows with y > 0."""
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    ok = y > 0
    return float(np.mean(np.abs(pred[ok] - y[ok]) / y[ok])) if ok.any() else float("nan")


def _ranks(v: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Rank of each value within its group (0-based), ties given their average rank."""
    order = np.lexsort((v, codes))
    vs, cs = v[order], codes[order]
    counts = np.bincount(cs, minlength=int(codes.max()) + 1 if len(codes) else 0)
    starts = np.cumsum(counts) - counts
    pos = (np.arange(len(vs)) - starts[cs]).astype(np.float64)
    new_run = np.ones(len(vs), dtype=bool)
    new_run[1:] = (vs[1:] != vs[:-1]) | (cs[1:] != cs[:-1])
    run = np.cumsum(new_run) - 1
    avg = np.bincount(run, weights=pos) / np.bincount(run)
    out = np.empty(len(v))
    out[order] = avg[run]
    return out


def spearman(y: np.ndarray, pred: np.ndarray, groups: np.ndarray | None = None) -> float:
    """Spearman rank correlation. With ``groups``: computed per workload (those with >= 2 distinct
    labels and predictions) and averaged; without: one global correlation over all rows."""
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    codes = np.zeros(len(y), dtype=np.int64) if groups is None else _check(y, pred, groups)[2]
    if len(y) < 2:
        return float("nan")
    ry, rp = _ranks(y, codes), _ranks(pred, codes)
    n = np.bincount(codes).astype(np.float64)
    my = np.bincount(codes, weights=ry) / n
    mp = np.bincount(codes, weights=rp) / n
    dy, dp = ry - my[codes], rp - mp[codes]
    cov = np.bincount(codes, weights=dy * dp)
    vy = np.bincount(codes, weights=dy * dy)
    vp = np.bincount(codes, weights=dp * dp)
    # A workload whose prediction is constant has no defined correlation; it counts as 0 (no
    # information) rather than being dropped, so a constant predictor cannot look good.
    ok = (n >= 2) & (vy > 0)
    if not ok.any():
        return float("nan")
    rho = np.where(vp[ok] > 0, cov[ok] / np.sqrt(vy[ok] * np.where(vp[ok] > 0, vp[ok], 1.0)), 0.0)
    return float(np.mean(rho))


def all_metrics(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, seed: int = 0,
                with_mape: bool = True) -> dict[str, float]:
    """The standard metric table row. ``with_mape=False`` for predictors that give no latency."""
    return {
        "pairwise_accuracy": pairwise_accuracy(y, pred, groups),
        "pairwise_accuracy_per_workload": pairwise_accuracy(y, pred, groups, per_workload=True),
        "top1_score": top_k_score(y, pred, groups, k=1, seed=seed),
        "top5_score": top_k_score(y, pred, groups, k=5, seed=seed),
        "mape": mape(y, pred) if with_mape else float("nan"),
        "spearman": spearman(y, pred, groups),
        "spearman_global": spearman(y, pred),
    }

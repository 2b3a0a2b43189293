"""Ranking and regression metrics for cost models, grouped by workload (TenSet definitions).

Conventions: ``y`` is the measured latency and ``pred`` the model's predicted cost; lower is better
for both (a ranking model's score is passed negated). ``groups`` holds one integer or string per
row naming its workload; candidates are only ever compared within their own workload.
Everything is NumPy and vectorised over rows; the only Python loop is over workloads for the
pairwise count, whose cost is quadratic in the candidates of one workload anyway.

Averages are over workloads unless a key says ``_pooled``: pooled pair counts are dominated by
the few workloads with the most candidates (on the H200 data softmax alone holds a third of them).
"""

from __future__ import annotations

import numpy as np

# The headline metrics, in table order (``score`` returns them, and a few counts besides).
METRIC_KEYS: tuple[str, ...] = (
    "top1_score", "top1_within_2pct", "decisive_pair_accuracy", "pairwise_accuracy",
    "pairwise_accuracy_pooled", "top5_score", "spearman", "mape")
# Column heads for tables of those metrics.
METRIC_SHORT_NAMES: dict[str, str] = {
    "top1_score": "top1", "top1_within_2pct": "top1<2%", "decisive_pair_accuracy": "decisive",
    "pairwise_accuracy": "pairwise", "pairwise_accuracy_pooled": "pw pooled", "top5_score": "top5",
    "spearman": "spearman", "mape": "MAPE"}
# A pair is decisive when its medians differ by more than this fraction (and, with spreads, by
# more than both candidates' p20-p80 bands); ``top1_within_2pct`` uses the same tolerance.
DECISIVE_GAP = 0.02

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


def _pair_counts(y: np.ndarray, p: np.ndarray, band: np.ndarray | None = None,
                 min_gap: float = 0.0) -> tuple[float, int, int]:
    """(correct, counted, distinct) over pairs with distinct labels; a tie in the prediction
    counts half. With ``min_gap`` > 0 only pairs whose labels differ by more than that fraction
    of the smaller are counted, and with ``band`` (per-row spread, e.g. p80 - p20) only pairs
    whose gap also exceeds both rows' bands; ``distinct`` is every pair with distinct labels."""
    n = len(y)
    correct = 0.0
    counted = distinct = 0
    step = max(1, _PAIR_BLOCK // max(n, 1))
    for a in range(0, n, step):
        diff = y[a:a + step, None] - y[None, :]
        dy = np.sign(diff)
        dp = np.sign(p[a:a + step, None] - p[None, :])
        valid = dy != 0
        distinct += int(valid.sum())
        if min_gap > 0:
            gap = np.abs(diff)
            valid &= gap > min_gap * np.minimum(y[a:a + step, None], y[None, :])
            if band is not None:
                valid &= (gap > band[a:a + step, None]) & (gap > band[None, :])
        counted += int(valid.sum())
        correct += float((dy == dp)[valid].sum()) + 0.5 * float((dp == 0)[valid].sum())
    # Every unordered pair was seen twice (i, j) and (j, i), with the same outcome.
    return correct / 2.0, counted // 2, distinct // 2


def _per_workload_pairs(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, band: np.ndarray | None,
                        min_gap: float) -> tuple[list[float], float, int, int]:
    """Per-workload accuracies (workloads with a counted pair), pooled correct, counted, distinct."""
    y, pred, codes = _check(y, pred, groups)
    order, starts, ends = _group_slices(codes)
    ys, ps = y[order], pred[order]
    bs = None if band is None else band[order]
    accs: list[float] = []
    correct, counted, distinct = 0.0, 0, 0
    for s, e in zip(starts, ends):
        if e - s < 2:
            continue
        c, t, d = _pair_counts(ys[s:e], ps[s:e], None if bs is None else bs[s:e], min_gap)
        correct, counted, distinct = correct + c, counted + t, distinct + d
        if t:
            accs.append(c / t)
    return accs, correct, counted, distinct


def pairwise_accuracy(y: np.ndarray, pred: np.ndarray, groups: np.ndarray,
                      per_workload: bool = False) -> float:
    """Fraction of same-workload candidate pairs (label ties excluded) that the prediction orders
    like the measurement. Pooled over all pairs, or the mean of per-workload accuracies."""
    accs, correct, total, _ = _per_workload_pairs(y, pred, groups, None, 0.0)
    if per_workload:
        return float(np.mean(accs)) if accs else float("nan")
    return correct / total if total else float("nan")


def _band(lo: np.ndarray | None, hi: np.ndarray | None, n: int) -> np.ndarray | None:
    if lo is None or hi is None:
        return None
    band = np.asarray(hi, dtype=np.float64).reshape(-1) - np.asarray(lo, dtype=np.float64).reshape(-1)
    if len(band) != n:
        raise ValueError(f"spreads differ in length from the labels: {len(band)} vs {n}")
    return band


def decisive_pairs(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, lo: np.ndarray | None = None,
                   hi: np.ndarray | None = None,
                   min_gap: float = DECISIVE_GAP) -> dict[str, float | int | None]:
    """Pairwise accuracy over the decisive pairs: same-workload pairs whose measured medians differ
    by more than ``min_gap`` (relative) and, given spreads [lo, hi] (the p20 and p80 of the
    samples), by more than both candidates' bands. ``accuracy``: mean over workloads with a
    decisive pair; ``accuracy_pooled``; ``share``: decisive pairs / pairs with distinct labels.
    The other pairs sit within the run-to-run noise, where a re-measurement often flips them."""
    band = _band(lo, hi, len(np.asarray(y).reshape(-1)))
    accs, correct, counted, distinct = _per_workload_pairs(y, pred, groups, band, min_gap)
    return {"accuracy": float(np.mean(accs)) if accs else None,
            "accuracy_pooled": correct / counted if counted else None,
            "share": counted / distinct if distinct else None, "pairs": counted}


def _top_k_choice(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, k: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per workload with >= 2 candidates: (best latency, best latency among the k lowest
    predictions). Prediction ties are broken by a seeded random order."""
    if k < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    y, pred, codes = _check(y, pred, groups)
    if len(y) == 0:
        return np.zeros(0), np.zeros(0)
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
    return best[keep], chosen[keep]


def top_k_score(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, k: int = 1, seed: int = 0) -> float:
    """Mean over workloads (with >= 2 candidates) of best latency / best latency among the model's
    k lowest predictions. Ties in the prediction are broken by a seeded random order so that a
    predictor which cannot tell candidates apart is not rewarded by the data's row order."""
    best, chosen = _top_k_choice(y, pred, groups, k, seed)
    return float(np.mean(best / chosen)) if len(best) else float("nan")


def top1_within(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, tolerance: float = DECISIVE_GAP,
                seed: int = 0) -> float:
    """Fraction of workloads (with >= 2 candidates) whose predicted-best candidate runs within
    ``tolerance`` of the measured best (chosen <= best * (1 + tolerance))."""
    best, chosen = _top_k_choice(y, pred, groups, 1, seed)
    return float(np.mean(chosen <= best * (1.0 + tolerance))) if len(best) else float("nan")


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
                with_mape: bool = True, lo: np.ndarray | None = None,
                hi: np.ndarray | None = None) -> dict[str, float]:
    """The standard metric table row (METRIC_KEYS, then ``decisive_pair_share`` and
    ``spearman_global``). ``lo``/``hi``: per-row p20/p80 of the samples; without them a pair is
    decisive on the 2 % gap alone. ``with_mape=False`` for predictors that give no latency."""
    decisive = decisive_pairs(y, pred, groups, lo, hi)
    return {
        "top1_score": top_k_score(y, pred, groups, k=1, seed=seed),
        "top1_within_2pct": top1_within(y, pred, groups, seed=seed),
        "decisive_pair_accuracy": _nan_if_none(decisive["accuracy"]),
        "pairwise_accuracy": pairwise_accuracy(y, pred, groups, per_workload=True),
        "pairwise_accuracy_pooled": pairwise_accuracy(y, pred, groups),
        "top5_score": top_k_score(y, pred, groups, k=5, seed=seed),
        "spearman": spearman(y, pred, groups),
        "mape": mape(y, pred) if with_mape else float("nan"),
        "decisive_pair_share": _nan_if_none(decisive["share"]),
        "spearman_global": spearman(y, pred),
    }


def _nan_if_none(v: float | int | None) -> float:
    return float("nan") if v is None else float(v)

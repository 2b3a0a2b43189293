"""The noise ceiling: what an exact model could score against a re-measurement.

A held-out metric is judged against a measurement, and a measurement is noisy: the median of 10
samples moves by about half a percent from one run to the next, and many candidates of one
workload sit closer than that. The score of an exact model is therefore below 1; this module
estimates it from stored re-measurements of the same candidates. Each measurement set (one board
and run) takes its turn as the "model": its medians are the prediction, another set's medians
(and its p20/p80 spreads) the labels, over the candidates both measured, compared within
workloads, with the metrics of ``metrics.all_metrics``.

The prediction carries noise of its own, so this is a lower estimate of the ceiling; two boards
(or two measuring protocols) add their systematic differences on top of the run-to-run noise,
so a same-board re-measurement gives the tighter one. ``consensus_ceiling`` narrows the gap:
on the candidates every set measured, it predicts one set by the geometric mean of one, then two,
other sets; the prediction's noise variance halves, and the score extrapolated to no noise at all
(2 x two-set score - one-set score, first order in the variance) estimates the exact model's.
"""

from __future__ import annotations

from itertools import permutations
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.costmodel.errors import CostModelError
from tunedb.costmodel.metrics import METRIC_KEYS, all_metrics

NEEDED = ("candidate_hash", "workload_hash", "device_id", "run_id", "median_us", "p20_us", "p80_us")


def measurement_sets(frame: pa.Table) -> dict[tuple[str, str], dict[str, np.ndarray | list[str]]]:
    """Ok measurements grouped by (device id, run id): candidate and workload hashes, median,
    p20 and p80 of each."""
    missing = [c for c in NEEDED if c not in frame.column_names]
    if missing:
        raise CostModelError(f"measurement frame lacks column(s) {', '.join(missing)}")
    keep = pc.greater(pc.fill_null(frame["median_us"], 0.0), 0.0)
    if "status" in frame.column_names:
        keep = pc.and_(keep, pc.equal(pc.fill_null(frame["status"], ""), "ok"))
    t = frame.filter(keep)
    cols = {c: t[c].to_pylist() for c in ("candidate_hash", "workload_hash", "device_id", "run_id")}
    nums = {c: t[c].to_numpy(zero_copy_only=False).astype(np.float64)
            for c in ("median_us", "p20_us", "p80_us")}
    rows: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(cols["device_id"], cols["run_id"])):
        rows.setdefault(key, []).append(i)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, idx in sorted(rows.items()):
        ix = np.asarray(idx)
        out[key] = {"candidate": [cols["candidate_hash"][i] for i in idx],
                    "workload": [cols["workload_hash"][i] for i in idx],
                    **{c: v[ix] for c, v in nums.items()}}
    return out


def score_remeasurement(reference: dict[str, Any], remeasured: dict[str, Any],
                        seed: int = 0) -> dict[str, Any]:
    """Metrics of ``reference``'s medians as the prediction of ``remeasured``'s, on the
    candidates both sets hold, in workloads where they share at least two candidates."""
    where = {c: i for i, c in enumerate(reference["candidate"])}
    pairs = [(where[c], j) for j, c in enumerate(remeasured["candidate"]) if c in where]
    if not pairs:
        return {"candidates": 0, "workloads": 0}
    ri, mi = (np.asarray(v) for v in zip(*pairs))
    workload = np.asarray(remeasured["workload"], dtype=object)[mi]
    names, counts = np.unique(workload, return_counts=True)
    shared = np.isin(workload, names[counts >= 2])
    ri, mi, workload = ri[shared], mi[shared], workload[shared]
    if len(mi) == 0:
        return {"candidates": 0, "workloads": 0}
    y = remeasured["median_us"][mi]
    pred = reference["median_us"][ri]
    m = all_metrics(y, pred, workload, seed=seed, lo=remeasured["p20_us"][mi], hi=remeasured["p80_us"][mi])
    drift = np.abs(pred / y - 1.0)
    return {"candidates": int(len(mi)), "workloads": int(len(np.unique(workload))),
            **{k: m[k] for k in METRIC_KEYS}, "decisive_pair_share": m["decisive_pair_share"],
            "median_abs_drift": float(np.median(drift))}


def remeasurement_ceiling(frame: pa.Table, min_candidates: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """Every ordered pair of measurement sets (board, run) that share at least
    ``min_candidates`` candidates: which sets, whether they are one board, and
    ``score_remeasurement``'s metrics. Sorted by shared candidates, most first."""
    sets = measurement_sets(frame)
    out = []
    for (a, b) in permutations(sets, 2):
        common = len(set(sets[a]["candidate"]) & set(sets[b]["candidate"]))
        if common < min_candidates:
            continue
        r = score_remeasurement(sets[a], sets[b], seed)
        if r["candidates"] < min_candidates:
            continue
        out.append({"reference": {"device_id": a[0], "run_id": a[1]},
                    "remeasured": {"device_id": b[0], "run_id": b[1]},
                    "same_board": a[0] == b[0], **r})
    out.sort(key=lambda r: (-r["candidates"], r["reference"]["device_id"], r["remeasured"]["device_id"]))
    return out


def _log_mean(sets: list[dict[str, Any]], candidates: list[str]) -> np.ndarray:
    """Geometric mean of the sets' medians of ``candidates`` (each set holds them all)."""
    logs = []
    for s in sets:
        where = {c: i for i, c in enumerate(s["candidate"])}
        logs.append(np.log(s["median_us"][[where[c] for c in candidates]]))
    return np.exp(np.mean(logs, axis=0))


def _consensus_entry(sets: dict[tuple[str, str], dict[str, Any]], target: tuple[str, str],
                     refs: tuple[tuple[str, str], tuple[str, str]], common: set[str],
                     seed: int) -> dict[str, Any]:
    t = sets[target]
    rows = [j for j, c in enumerate(t["candidate"]) if c in common]
    sub = {k: [v[j] for j in rows] if isinstance(v, list) else v[rows] for k, v in t.items()}
    cands = sub["candidate"]

    def scored(using: list[tuple[str, str]]) -> dict[str, Any]:
        prediction = {"candidate": cands, "median_us": _log_mean([sets[r] for r in using], cands)}
        return score_remeasurement(prediction, sub, seed)

    keys = [k for k in METRIC_KEYS if k != "mape"]
    one = [scored([r]) for r in refs]
    two = scored(list(refs))
    mean_one = {k: float(np.mean([o[k] for o in one])) for k in keys}
    return {"remeasured": {"device_id": target[0], "run_id": target[1]},
            "references": [{"device_id": r[0], "run_id": r[1]} for r in refs],
            "candidates": two["candidates"], "workloads": two["workloads"],
            "one_reference": mean_one, "two_references": {k: two[k] for k in keys},
            "exact_estimate": {k: min(1.0, 2 * two[k] - mean_one[k]) for k in keys}}


def consensus_ceiling(frame: pa.Table, min_candidates: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """For each set with two others that share at least ``min_candidates`` candidates with it
    (the three-way intersection): the metrics of one other set as the prediction (mean over the
    two), of the geometric mean of both, and their extrapolation to an exact prediction."""
    sets = measurement_sets(frame)
    members = {k: set(v["candidate"]) for k, v in sets.items()}
    out = []
    for target in sets:
        others = [k for k in sets if k != target]
        for i, a in enumerate(others):
            for b in others[i + 1:]:
                common = members[target] & members[a] & members[b]
                if len(common) >= min_candidates:
                    entry = _consensus_entry(sets, target, (a, b), common, seed)
                    if entry["candidates"] >= min_candidates:
                        out.append(entry)
    return out


def split_sample_ceiling(samples: list[list[float]], workloads: list[str], how: str = "halves",
                         seed: int = 0) -> dict[str, Any]:
    """One measurement set's samples split in two: the first part's medians as the prediction of
    the second part's (with its p20/p80 spreads for decisive pairs). ``halves``: samples 1..n/2
    against the rest (a re-measurement moments later); ``alternate``: odd against even. Each
    part has half the samples, so its median is noisier than the full one (a lower estimate);
    the parts share the board, run and warm state (an upper one). Rows with fewer than 4
    samples, and workloads left with fewer than two candidates, are left out."""
    if how not in ("halves", "alternate"):
        raise CostModelError(f"unknown sample split {how!r}; expected halves or alternate")
    keep = [i for i, s in enumerate(samples) if s is not None and len(s) >= 4]
    names, counts = np.unique(np.asarray([workloads[i] for i in keep], dtype=object), return_counts=True)
    paired = set(names[counts >= 2].tolist())
    keep = [i for i in keep if workloads[i] in paired]
    parts = []
    for i in keep:
        s = np.asarray(samples[i], dtype=np.float64)
        a, b = (s[: len(s) // 2], s[len(s) // 2:]) if how == "halves" else (s[0::2], s[1::2])
        parts.append((np.median(a), np.median(b), np.percentile(b, 20), np.percentile(b, 80)))
    if not parts:
        return {"candidates": 0, "workloads": 0}
    pred, y, lo, hi = (np.asarray(v) for v in zip(*parts))
    workload = np.asarray([workloads[i] for i in keep], dtype=object)
    m = all_metrics(y, pred, workload, seed=seed, lo=lo, hi=hi)
    return {"candidates": len(keep), "workloads": int(len(np.unique(workload))), "split": how,
            **{k: m[k] for k in METRIC_KEYS}, "decisive_pair_share": m["decisive_pair_share"]}

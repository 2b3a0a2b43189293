"""Variants of the packing cost model, held out on the four splits (docs/packing.md, "Variants").

    python benchmarks/packing_variants.py --data data/packing_h200 --variants rank 'rank#' --out v.json

Every variant is trained and scored on the same folds through ``evaluate_fits`` (the four splits
of ``tunedb.costmodel.evaluate``, 5 GroupKFold folds each, the fusion kind's metric keys), with
the packing choice scores and the pooled 10 % measure-top replay added as
``tunedb.costmodel.packing.evaluate`` adds them. A variant is one or more components, each a
booster giving a score per candidate (lower: faster); the shipped regression (log µs, base
features) gives the times, handed out in the variant's order within each workload, as
``predict_us`` does. Several components combine by the mean of their within-workload ranks, or
(``mean:`` variants) by the mean of their raw scores.

Feature sets beyond the shipped ``FEATURES`` (suffix of a component's name): ``+`` spread of n,
k and FLOPs, estimates over serial's, launch share, batched problem tiles and count, log wasted
FLOPs. ``#`` (B read transposed, partition, largest batched problem, most streams: the kind's
``layout_features``), ``&`` (``splitk_features``) and ``^`` (both) were added to the shipped
features in schema ``packing/4``, so they now name the shipped set. Since ``packing/4`` the
shipped ranker is ``rank_fine8`` (30 grades, 8 pairs per row), so ``rank`` and ``rank_fine8``
name the same component; the docs' tables before it were scored with ``packing/3``.
Prints one markdown row per variant (by workload / op / shape / family) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import xgboost as xgb

from tunedb.bench.provenance import provenance
from tunedb.costmodel import packing as P
from tunedb.costmodel.evaluate import SPLITS, evaluate_fits
from tunedb.kernels.packing import Candidate, Cluster, PackingWorkload, padded_shape

VARIANTS: dict[str, list[str]] = {
    "rank": ["rank"], "reg": ["reg"], "reglr": ["reglr"], "reglr_tw": ["reglr_tw"],
    "rank_ndcg": ["rank_ndcg"], "rank_pw_top": ["rank_pw_top"], "rank_np8": ["rank_np8"],
    "rank_fine8": ["rank_fine8"], "rank_s1": ["rank_s1"], "rank_s2": ["rank_s2"],
    "mean:rank_s012": ["rank", "rank_s1", "rank_s2"], "rank+": ["rank+"], "rank#": ["rank#"],
    "rank_s1#": ["rank_s1#"], "rank_s2#": ["rank_s2#"], "mean:rank_s012#": ["rank#", "rank_s1#", "rank_s2#"],
    "rank&": ["rank&"], "rank^": ["rank^"], "rank_fine8^": ["rank_fine8^"], "knn": ["knn"],
    "rank_fine8_s1^": ["rank_fine8_s1^"], "rank_fine8_s2^": ["rank_fine8_s2^"],
    "mean:rank_fine8_s012^": ["rank_fine8^", "rank_fine8_s1^", "rank_fine8_s2^"],
    "rank|reglr": ["rank", "reglr"], "rank+|rank|reglr": ["rank+", "rank", "reglr"],
    # two stages: the shipped ranker's top 2, re-ordered by a ranker of near-best rows only
    "two:rank|rank_near1.3": ["rank", "rank_near1.3"], "two:rank|rank_near1.15": ["rank", "rank_near1.15"],
}
TWO_STAGE_TOP = 2


# -- features beyond the shipped ones -------------------------------------------------------------
def extra_plus(w: PackingWorkload, c: Candidate, base: dict[str, float]) -> dict[str, float]:
    ms = w.members
    n, k = (np.array([getattr(x, a) for x in ms], float) for a in "nk")
    fl = np.array([x.flops for x in ms], float)
    serial = P.candidate_features(w, Candidate("whole", (Cluster(tuple(range(len(ms))), "serial"),)))
    tiles, probs = [], []
    for cl in c.clusters:
        mem = [ms[i] for i in cl.members]
        if cl.backend in ("padded", "padded_t", "pointer"):
            M, N, _ = padded_shape(mem)
            tiles.append(P._tiles(M, N))
            probs.append(sum(x.batch for x in mem))
    return {"n_cv": n.std() / n.mean(), "k_cv": k.std() / k.mean(), "flops_cv": fl.std() / fl.mean(),
            "rel_wave": base["est_wave_us"] / serial["est_wave_us"],
            "rel_lanes": base["est_lanes_us"] / serial["est_lanes_us"],
            "launch_share": base["launches"] * P.LAUNCH_US / (base["est_sum_us"] + 1e-9),
            "batched_problem_tiles": float(np.mean(tiles)) if tiles else 0.0,
            "batched_problems": float(np.mean(probs)) if probs else 0.0,
            "log_waste_flops": math.log2(1 + base["waste"] * w.flops)}


def records(data: Path) -> tuple[dict[str, PackingWorkload], dict[tuple[str, str], Candidate]]:
    """The export's packing workloads, and its candidates by (workload hash, candidate name)."""
    ws = {r["hash"]: PackingWorkload.from_json(json.loads(r["graph_json"]))
          for r in pq.read_table(data / "workloads.parquet").to_pylist()}
    cands = {}
    for r in pq.read_table(data / "candidates.parquet").to_pylist():
        if r["kind"] == "packing":
            cfg = json.loads(r["config_json"])
            c = Candidate.from_json({"partition": cfg["partition"], "concurrent": cfg["concurrent"],
                                     "clusters": json.loads(cfg["clusters"])})
            cands[(r["workload_hash"], c.name)] = c
    return ws, cands


def feature_sets(frame: dict[str, Any], ws: dict[str, PackingWorkload],
                 cands: dict[tuple[str, str], Candidate]) -> dict[str, tuple[np.ndarray, list[str]]]:
    plus = [extra_plus(ws[g], cands[(g, name)], P.features(ws[g], cands[(g, name)]))
            for g, name in zip(frame["groups"], frame["names"])]
    X, F = frame["X"], list(P.FEATURES)
    Xp, Fp = np.asarray([list(r.values()) for r in plus], np.float32), list(plus[0])
    # since packing/4 the shipped features hold # (layout_features) and & (splitk_features)
    return {"": (X, F), "+": (np.hstack([X, Xp]), F + Fp), "#": (X, F), "&": (X, F), "^": (X, F)}


# -- components -----------------------------------------------------------------------------------
class Components:
    """Boosters trained on a fold's rows, cached by (component, fold rows) across variants."""

    def __init__(self, frame: dict[str, Any], sets: dict[str, tuple[np.ndarray, list[str]]],
                 ws: dict[str, PackingWorkload]) -> None:
        self.frame, self.sets, self.cache = frame, sets, {}
        y, g = frame["y"], frame["groups"]
        best = {h: y[g == h].min() for h in np.unique(g)}
        self.ratio = y / np.array([best[h] for h in g])
        self.wvec = {h: np.array(list(P.workload_features(ws[h]).values()), float) for h in np.unique(g)}

    def scores(self, name: str, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        key = (name, tr.tobytes(), te.tobytes())
        if key not in self.cache:
            self.cache[key] = self._train(name, tr, te)
        return self.cache[key]

    def _train(self, name: str, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        y, groups = self.frame["y"], self.frame["groups"]
        suffix = name[-1] if name[-1] in "+#&^" else ""
        base = name[:-1] if suffix else name
        X, F = self.sets[suffix]
        if base == "knn":
            X, F = self.sets["#"]
            X = np.hstack([X, self._knn(tr, np.arange(len(y)))])
            F = F + ["knn_lr", "knn1_lr", "knn_n"]
            base = "rank"
        if base.startswith("reg"):
            label = np.log(y) if base == "reg" else np.log(self.ratio)
            weight = 0.1 + np.exp(-(self.ratio[tr] - 1) / 0.1) if base == "reglr_tw" else None
            b = xgb.train(P.PARAMS, xgb.DMatrix(X[tr], label=label[tr], weight=weight, feature_names=F),
                          P.ROUNDS if base == "reg" else 300)
            return b.predict(xgb.DMatrix(X[te], feature_names=F))
        if base.startswith("rank_near"):  # only each workload's rows within this ratio of its best
            tr = tr[self.ratio[tr] <= float(base[len("rank_near"):])]
            base = "rank"
        order = tr[np.argsort(groups[tr], kind="stable")]
        _, qid = np.unique(groups[order], return_inverse=True)
        rel = P.relevance(y[order], groups[order])
        params = dict(P.RANK_PARAMS)
        if base.startswith("rank_fine8_s"):  # rank_fine8 with another seed
            params["seed"] = int(base[len("rank_fine8_s"):])
            base = "rank_fine8"
        if base.startswith("rank_s"):
            params["seed"] = int(base[len("rank_s"):])
        elif base == "rank_ndcg":
            params.update(objective="rank:ndcg", lambdarank_pair_method="topk",
                          lambdarank_num_pair_per_sample=3, ndcg_exp_gain=True)
        elif base == "rank_pw_top":
            params.update(lambdarank_pair_method="topk", lambdarank_num_pair_per_sample=5)
        elif base in ("rank_np8", "rank_fine8"):
            params.update(lambdarank_num_pair_per_sample=8)
            if base == "rank_fine8":
                rel = np.maximum(0, 30 - np.floor(60 * (self.ratio[order] - 1) + 1e-9))
        elif base != "rank":
            raise ValueError(f"unknown component {name!r}")
        d = xgb.DMatrix(X[order], label=rel, qid=qid, feature_names=F)
        return -xgb.train(params, d, P.RANK_ROUNDS).predict(xgb.DMatrix(X[te], feature_names=F))

    def _knn(self, tr: np.ndarray, rows: np.ndarray, k: int = 3) -> np.ndarray:
        """Per row: the mean and the nearest log ratio to best of the same candidate in the k
        nearest training workloads (standardised workload features; never its own workload)."""
        groups, names = self.frame["groups"], self.frame["names"]
        trw = np.unique(groups[tr])
        M = np.array([self.wvec[h] for h in trw])
        mu, sd = M.mean(0), M.std(0) + 1e-9
        Z = (M - mu) / sd
        seen: dict[str, dict[str, float]] = {}
        for i in tr:
            seen.setdefault(names[i], {})[groups[i]] = float(np.log(self.ratio[i]))
        near: dict[str, list[str]] = {}
        out = np.zeros((len(rows), 3), np.float32)
        for j, i in enumerate(rows):
            g = groups[i]
            if g not in near:
                d = np.sqrt((((self.wvec[g] - mu) / sd - Z) ** 2).sum(1))
                d[trw == g] = np.inf
                near[g] = [trw[o] for o in np.argsort(d) if np.isfinite(d[o])]
            have = seen.get(names[i], {})
            vals = [have[h] for h in near[g] if h in have][:k]
            out[j] = (np.mean(vals), vals[0], len(vals)) if vals else (1.0, 1.0, 0)
        return out


def _within_ranks(score: np.ndarray, groups: np.ndarray) -> np.ndarray:
    out = np.empty(len(score))
    for h in np.unique(groups):
        i = np.flatnonzero(groups == h)
        out[i] = np.argsort(np.argsort(score[i], kind="stable"), kind="stable") / max(1, len(i) - 1)
    return out


def _two_stage(first: np.ndarray, second: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``first``'s order, its top ``TWO_STAGE_TOP`` of each workload re-ordered by ``second``."""
    out = _within_ranks(first, groups) + 1.0
    for h in np.unique(groups):
        i = np.flatnonzero(groups == h)
        top = i[np.argsort(first[i], kind="stable")][:TWO_STAGE_TOP]
        out[top] = np.argsort(np.argsort(second[top], kind="stable"), kind="stable") / len(top)
    return out


def variant_fit(comps: Components, name: str) -> Callable[[np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    parts, groups = VARIANTS[name], comps.frame["groups"]

    def fit(tr: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        def predict(te: np.ndarray) -> np.ndarray:
            raw = [comps.scores(c, tr, te) for c in parts]
            g = groups[te]
            if len(raw) == 1:
                score = raw[0]
            elif name.startswith("two:"):
                score = _two_stage(raw[0], raw[1], g)
            elif name.startswith("mean:"):
                score = np.mean(raw, axis=0)
            else:
                score = np.mean([_within_ranks(r, g) for r in raw], axis=0)
            us = np.exp(comps.scores("reg", tr, te))
            out = np.empty(len(te))
            for h in np.unique(g):
                i = np.flatnonzero(g == h)
                out[i[np.argsort(score[i], kind="stable")]] = np.sort(us[i])
            return out
        return predict
    return fit


def score_variant(comps: Components, name: str, folds: int) -> dict[str, Any]:
    frame = comps.frame
    y, groups, names = frame["y"], frame["groups"], frame["names"]
    ev = evaluate_fits(variant_fit(comps, name), y, P.labels_of(frame), folds=folds, with_mape=False)
    out = {}
    for split, m in ev.items():
        pred = m.pop("pred")
        m.pop("families", None)
        rows = np.flatnonzero(np.isfinite(pred))
        out[split] = {**m, **P._summary(P._score(y, pred, groups, names, rows)),
                      "measure_top_10pct": P.measure_top_replay(y[rows], pred[rows], groups[rows])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data/packing_h200"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        frame = P.load_frame(args.data)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.data}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    ws, cands = records(args.data)
    comps = Components(frame, feature_sets(frame, ws, cands), ws)
    results = {}
    print("| variant | choice within 5 % (%) | top-1 score | decisive pairs | measure-top best (%) |")
    print("|---|---|---|---|---|")
    for name in args.variants:
        t0 = time.process_time()
        r = score_variant(comps, name, args.folds)
        results[name] = {**r, "cpu_s": time.process_time() - t0}
        rs = [r[s] for s in SPLITS]

        def col(key: str, scale: float = 1.0, fmt: str = ".3f", rs: list = rs) -> str:
            return " / ".join(f"{scale * x[key]:{fmt}}" for x in rs)
        best = " / ".join(f"{100 * x['measure_top_10pct']['reaches_best']:.1f}" for x in rs)
        print(f"| `{name}` | {col('model_within_5pct', 100, '.1f')} | {col('top1_score')} | "
              f"{col('decisive_pair_accuracy')} | {best} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({**provenance(argv), "data": str(args.data), "variants": results},
                                       indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

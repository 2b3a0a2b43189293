"""Cost model kind ``packing``: predicts the time of a packing candidate from its members.

Features (``FEATURES``, schema ``FEATURE_SCHEMA``) come from the workload record and the candidate
alone, so the model ranks candidates before any is measured: member counts, FLOPs and bytes, the
spread of m/n/k, waves and tail of 128x128 tiles on the H200's 132 SMs, the sum and the max of the
members' single-op roofline times, and per candidate its backends' shares, clusters, concurrency,
launches, padding waste, waves rounded up per launch, a split-K-aware wave time, the share of
members whose B is read transposed, its partition, largest batched problem, most streams, the
bytes it moves, and its estimates over the best of the workload's candidates. Two XGBoost
models: a regression on log(µs) and a pairwise ranker of each workload's candidates; a
workload's predictions are the regression's times in the ranker's order (``predict_us``).

Held-out evaluation (``evaluate``): the fusion kind's four splits (``evaluate_fits``: by
workload, op = scenario, shape, family) with its metric keys; per held-out workload also: is the
model's first choice within 5 % of the best measured candidate, and does measuring the model's
top 10 % reach the best, next to the fixed rule "one padded batched call if the workload allows
it, else streams8". The one entry point is ``tunedb train --kind packing`` (``train_on_store``).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from tunedb._version import __version__
from tunedb.costmodel.errors import TrainError
from tunedb.costmodel.evaluate import SPLITS, Labels, evaluate_fits
from tunedb.costmodel.metrics import all_metrics
from tunedb.costmodel.packing_features import (  # noqa: F401 - the kind's public names
    FEATURE_SCHEMA,
    FEATURES,
    LAUNCH_US,
    REL_KEYS,
    _tiles,
    candidate_features,
    features,
    launch_tiles,
    layout_features,
    moved_bytes,
    splitk_features,
    traffic_features,
    workload_features,
)
from tunedb.kernels.packing import Candidate, PackingWorkload, all_candidates
from tunedb.records import canonical_json, sha256_hex
from tunedb.store import BUSY_WAIT_S, TuningStore

# -- data ------------------------------------------------------------------------------------------
Band = tuple[float, float, float]  # p20, median, p80 of one candidate's samples, µs
MIN_COMMON = 3  # candidates a board must share with a workload's reference board to be scaled to it


def board_labels(times: dict[str, dict[str, list[Band]]], workload_of: dict[str, str],
                 min_common: int = MIN_COMMON) -> dict[str, Band]:
    """One label per candidate, judged on one basis per workload. ``times``: candidate ->
    board -> the bands of its runs there. A board's runs of a candidate count once (their
    median); per workload the board that measured the most of its candidates is the reference,
    another board's times are divided by its median ratio to the reference over the candidates
    both measured; a board sharing fewer than ``min_common`` with the reference is then scaled,
    the same way, to the labels of the boards already joined, where it shares ``min_common``
    with them (boards that anchored on another board's rows), else left out of that workload,
    so a board that measured a few candidates cannot shift them against the rest; a
    candidate's label is then the median over its boards."""
    # workload -> board -> candidate -> log band
    by_w: dict[str, dict[str, dict[str, np.ndarray]]] = defaultdict(lambda: defaultdict(dict))
    for ch, boards in times.items():
        for b, runs in boards.items():
            by_w[workload_of[ch]][b][ch] = np.log(np.median(np.asarray(runs, float), axis=0))
    out: dict[str, Band] = {}
    for _, boards in sorted(by_w.items()):
        ref = max(sorted(boards), key=lambda b: len(boards[b]))
        logs: dict[str, list[np.ndarray]] = defaultdict(list)
        left = []
        for b, cands in sorted(boards.items()):
            common = sorted(set(cands) & set(boards[ref]))
            if b != ref and len(common) < min_common:
                left.append(b)
                continue
            shift = 0.0 if b == ref else float(np.median([cands[c][1] - boards[ref][c][1] for c in common]))
            for c, band in cands.items():
                logs[c].append(band - shift)
        while left:  # chained: to the joined boards' labels, the board sharing most first
            joined = {c: float(np.median([v[1] for v in bands])) for c, bands in logs.items()}
            b = max(left, key=lambda x: (len(set(boards[x]) & set(joined)), x))
            common = sorted(set(boards[b]) & set(joined))
            if len(common) < min_common:
                break
            left.remove(b)
            shift = float(np.median([boards[b][c][1] - joined[c] for c in common]))
            for c, band in boards[b].items():
                logs[c].append(band - shift)
        for c, bands in logs.items():
            q = np.exp(np.median(np.asarray(bands), axis=0))
            out[c] = (float(q[0]), float(q[1]), float(q[2]))
    return out


def load_frame(data: Path, device_ids: Sequence[str] | None = None) -> dict[str, Any]:
    """Rows of a packing export (``tunedb db export`` folder): features, label µs
    (``board_labels``: one basis per workload across boards), p20-p80 band, workload hash and
    family per candidate with an ok measurement; with ``device_ids``, those boards only."""
    import pyarrow.parquet as pq

    ws = {r["hash"]: r for r in pq.read_table(data / "workloads.parquet").to_pylist()}
    cands = {r["hash"]: r for r in pq.read_table(data / "candidates.parquet").to_pylist()
             if r["kind"] == "packing"}
    times: dict[str, dict[str, list[Band]]] = defaultdict(lambda: defaultdict(list))
    for r in pq.read_table(data / "measurements.parquet").to_pylist():
        if r["status"] == "ok" and r["candidate_hash"] in cands and r["samples_us"] \
                and (device_ids is None or r["device_id"] in device_ids):
            q = np.percentile(r["samples_us"], (20, 50, 80))
            times[r["candidate_hash"]][r["device_id"]].append((float(q[0]), float(q[1]), float(q[2])))
    labels = board_labels(times, {ch: cands[ch]["workload_hash"] for ch in times})
    parsed: dict[str, PackingWorkload] = {}
    X, y, groups, fams, names, spread = [], [], [], [], [], []
    for ch, q in sorted(labels.items()):
        c = cands[ch]
        wh = c["workload_hash"]
        if wh not in parsed:
            parsed[wh] = PackingWorkload.from_json(json.loads(ws[wh]["graph_json"]))
        w = parsed[wh]
        cfg = json.loads(c["config_json"])
        cand = Candidate.from_json({"partition": cfg["partition"], "concurrent": cfg["concurrent"],
                                    "clusters": json.loads(cfg["clusters"])})
        f = features(w, cand)
        X.append([f[k] for k in FEATURES])
        y.append(q[1])
        spread.append((q[0], q[2]))
        groups.append(wh)
        fams.append(w.family)
        names.append(cand.name)
    if not X:
        raise ValueError(f"no ok packing measurements in {data}")
    lo, hi = np.asarray(spread).T
    return {"X": np.asarray(X, np.float32), "y": np.asarray(y), "groups": np.asarray(groups),
            "families": np.asarray(fams), "names": np.asarray(names),
            "workload_names": np.asarray([ws[g]["name"] for g in groups]), "lo": lo, "hi": hi,
            "space": {h: len(all_candidates(w)) for h, w in parsed.items()}}


# -- model -----------------------------------------------------------------------------------------
PARAMS = {"objective": "reg:squarederror", "max_depth": 6, "eta": 0.15, "subsample": 0.8,
          "colsample_bytree": 0.8, "min_child_weight": 2.0, "nthread": 1, "seed": 0}
# One thread: on ~3k rows a second thread costs more in spinning than it saves.
ROUNDS = 150
# The ranker orders the candidates of one workload, trained on graded relevance (30 for the
# best, one grade less per 1.7 % slower, 0 from 50 % slower; 8 pairs per row): held out it
# picks within 5 % of the best more often than the regression's order (docs/packing.md).
RANK_PARAMS = {**PARAMS, "objective": "rank:pairwise", "lambdarank_num_pair_per_sample": 8}
RANK_ROUNDS = 300
GRADES, PER_UNIT = 30, 60  # relevance: 30 for the best, one grade less per 1/60 (1.7 %) slower


def relevance(y_us: np.ndarray, groups: np.ndarray) -> np.ndarray:
    best: dict[Any, float] = {}
    for g, t in zip(groups, y_us):
        best[g] = min(best.get(g, math.inf), float(t))
    ratio = np.array([t / best[g] for g, t in zip(groups, y_us)])
    return np.maximum(0, GRADES - np.floor(PER_UNIT * (ratio - 1) + 1e-9))


class PackingModel:
    """A regression on log µs (the scale: does packing pay?) and, when trained with workload
    groups, a ranker (the order of one workload's candidates). ``predict_us`` of one workload's
    rows gives the regression's times, sorted, to the candidates in the ranker's order."""

    def __init__(self, reg: Any, rank: Any = None) -> None:
        self.reg, self.rank = reg, rank


def fit(X: np.ndarray, y_us: np.ndarray, groups: np.ndarray | None = None) -> PackingModel:
    import xgboost as xgb

    names = list(FEATURES)
    reg = xgb.train(PARAMS, xgb.DMatrix(X, label=np.log(y_us), feature_names=names), ROUNDS)
    if groups is None:
        return PackingModel(reg)
    order = np.argsort(groups, kind="stable")  # a ranker wants each query's rows together
    _, qid = np.unique(groups[order], return_inverse=True)
    d = xgb.DMatrix(X[order], label=relevance(y_us[order], groups[order]), qid=qid, feature_names=names)
    return PackingModel(reg, xgb.train(RANK_PARAMS, d, RANK_ROUNDS))


def predict_us(model: Any, X: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """µs per row; ``groups`` (workload per row; default: all rows one workload) for a ranker."""
    import xgboost as xgb

    d = xgb.DMatrix(X, feature_names=list(FEATURES))
    reg = model.reg if isinstance(model, PackingModel) else model
    us = np.exp(reg.predict(d))
    if not isinstance(model, PackingModel) or model.rank is None:
        return us
    score = model.rank.predict(d)
    groups = np.zeros(len(us)) if groups is None else np.asarray(groups)
    out = np.empty(len(us))
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        out[idx[np.argsort(-score[idx], kind="stable")]] = np.sort(us[idx])
    return out


def rule_choice(names: Sequence[str]) -> int:
    """The fixed rule: one padded batched call if offered, else 8 streams, else the first."""
    for want in ("whole:padded", "whole:streams8"):
        if want in names:
            return list(names).index(want)
    return 0


def _score(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, names: np.ndarray,
           test: np.ndarray) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for g in np.unique(groups[test]):
        idx = test[groups[test] == g]
        best = y[idx].min()
        order = idx[np.argsort(pred[idx], kind="stable")]
        top = max(1, math.ceil(0.1 * len(idx)))
        out["model_ratio"].append(y[order[0]] / best)
        out["top10_ratio"].append(y[order[:top]].min() / best)
        out["top10_share"].append(top / len(idx))
        out["rule_ratio"].append(y[idx[rule_choice(names[idx])]] / best)
    return out


def _summary(r: dict[str, list[float]]) -> dict[str, float]:
    mr, tr, rr = (np.asarray(r[k]) for k in ("model_ratio", "top10_ratio", "rule_ratio"))
    return {"workloads": len(mr), "model_within_5pct": float(np.mean(mr <= 1.05)),
            "model_geomean_ratio": float(np.exp(np.log(mr).mean())),
            "model_worst_ratio": float(mr.max()),
            "top10_reaches_best": float(np.mean(tr <= 1.0 + 1e-9)),
            "top10_within_5pct": float(np.mean(tr <= 1.05)),
            "measured_share": float(np.mean(r["top10_share"])),
            "rule_within_5pct": float(np.mean(rr <= 1.05)),
            "rule_geomean_ratio": float(np.exp(np.log(rr).mean()))}


def measure_top_replay(y: np.ndarray, pred: np.ndarray, groups: np.ndarray, share: float = 0.10,
                       space: dict[str, int] | None = None) -> dict[str, float]:
    """``--measure-top`` replayed from stored times: measure at most ``share`` of all candidates,
    every workload's first pick, then further picks (each workload's next in the model's order)
    to the workloads whose two next predictions are closest, round by round, until the budget is
    spent; the best measured candidate is the choice. Returns the share of workloads whose choice
    is the best measured candidate, and within 5 % of it, and the share of candidates measured.
    ``space`` (workload -> its candidate count, ``all_candidates``): the budget and the share are
    of the candidates each workload has, not only of those stored."""
    idx_of = {g: np.flatnonzero(groups == g) for g in np.unique(groups)}
    order = {g: idx[np.argsort(pred[idx], kind="stable")] for g, idx in idx_of.items()}
    total = len(y) if space is None else sum(max(space[str(g)], len(idx)) for g, idx in idx_of.items())
    budget = int(share * total)
    taken = dict.fromkeys(order, 1)
    spent = len(order)
    while spent < budget:
        open_ = [g for g in order if taken[g] < len(order[g])]
        if not open_:
            break
        # the next pick predicted closest to the first: the likeliest to be the faster one
        closest = sorted(open_, key=lambda g: float(pred[order[g][taken[g]]] / pred[order[g][0]]))
        for g in closest[:budget - spent]:
            taken[g] += 1
            spent += 1
    ratios = np.array([y[order[g][:taken[g]]].min() / y[idx_of[g]].min() for g in order])
    return {"reaches_best": float(np.mean(ratios <= 1.0 + 1e-9)),
            "within_5pct": float(np.mean(ratios <= 1.05)), "measured_share": spent / total}


def labels_of(frame: dict[str, Any]) -> Labels:
    """The four splits' labels: op = the scenario part of a workload's name (``bert_ffn_up``,
    ``replicas_r8``), shape = its member shapes or tenants' sequence lengths, family = the
    scenario family; decisive pairs judged by each candidate's p20-p80 band."""
    parts = [str(n).rsplit("_", 2) for n in frame["workload_names"]]
    return Labels.of(frame["groups"], op=[p[0] for p in parts], shape=[p[-2] for p in parts],
                     family=frame["families"], lo=frame.get("lo"), hi=frame.get("hi"))


def evaluate(frame: dict[str, Any], folds: int = 5, seed: int = 0, splits: Sequence[str] = SPLITS,
             keep_predictions: bool = False) -> dict[str, Any]:
    """Held-out scores on ``splits`` (``evaluate_fits``: the fusion kind's metric keys), each with
    the packing choice scores (``_summary``) and the replayed ``--measure-top`` of 10 %;
    ``keep_predictions``: each split's held-out µs per row too (``predicted_us``)."""
    X, y, groups, names = (frame[k] for k in ("X", "y", "groups", "names"))

    def fit_fold(tr: np.ndarray) -> Any:
        model = fit(X[tr], y[tr], groups[tr])
        return lambda te: predict_us(model, X[te], groups[te])

    ev = evaluate_fits(fit_fold, y, labels_of(frame), splits=splits, folds=folds, seed=seed)
    res: dict[str, Any] = {}
    for split, m in ev.items():
        if not m:
            continue
        pred = m.pop("pred")
        rows = np.flatnonzero(np.isfinite(pred))
        res[split] = {**m, **_summary(_score(y, pred, groups, names, rows)),
                      "measure_top_10pct": measure_top_replay(y[rows], pred[rows], groups[rows]),
                      # 10 % of every candidate the workloads have (all_candidates), stored or not
                      "measure_top_10pct_space": measure_top_replay(y[rows], pred[rows], groups[rows],
                                                                    space=frame.get("space"))}
        if keep_predictions:
            res[split]["predicted_us"] = pred
    return res


def save(model: Any, out_dir: Path, frame: dict[str, Any], scores: dict[str, Any],
         device_name: str = "") -> Path:
    """Model files (XGBoost UBJSON: ``model.ubj`` the regression, ``rank.ubj`` the ranker) and the
    card: kind, feature schema and names, objectives, the data it learnt from, held-out scores."""
    import xgboost as xgb

    model = model if isinstance(model, PackingModel) else PackingModel(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.reg.save_model(str(out_dir / "model.ubj"))
    if model.rank is not None:
        model.rank.save_model(str(out_dir / "rank.ubj"))
    rows = zip(frame["groups"], frame["names"], frame["y"])
    digest = sha256_hex(canonical_json(sorted([str(g), str(n), round(float(t), 3)] for g, n, t in rows)))
    graded = f"{GRADES} - floor({PER_UNIT} * (us / best - 1))"
    card = {"kind": "packing", "feature_schema": FEATURE_SCHEMA, "features": list(FEATURES),
            "device_name": device_name, "target": "log_us", "params": PARAMS, "rounds": ROUNDS,
            "ranker": None if model.rank is None else {"params": RANK_PARAMS, "rounds": RANK_ROUNDS,
                                                       "relevance": graded},
            "rows": int(len(frame["y"])), "workloads": int(len(np.unique(frame["groups"]))),
            "data": {"hash": digest, "families": sorted({str(f) for f in frame["families"]})},
            "held_out": scores, "metrics": scores.get("by_workload", {}),
            "tunedb_version": __version__, "xgboost_version": xgb.__version__,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out_dir / "card.json").write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")
    return out_dir


def load_predictor(path: Path) -> Any:
    """A saved packing model (``save``'s folder, or its card) as ``predict(w, cands) -> µs``;
    a card of another kind or feature schema is refused (``ValueError``)."""
    import xgboost as xgb

    path = Path(path)
    folder = path.parent if path.name == "card.json" else path
    try:
        card = json.loads((folder / "card.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"packing model {folder}: no readable card.json ({e})") from None
    if card.get("kind") != "packing" or card.get("feature_schema") != FEATURE_SCHEMA:
        raise ValueError(f"packing model {folder}: card says kind {card.get('kind')!r}, schema "
                         f"{card.get('feature_schema')!r}; expected packing, {FEATURE_SCHEMA}")
    boosters = []
    for name in ("model.ubj", "rank.ubj"):
        if (folder / name).is_file():
            b = xgb.Booster()
            b.load_model(str(folder / name))
            boosters.append(b)
    if not boosters or not (folder / "model.ubj").is_file():
        raise ValueError(f"packing model {folder}: no model.ubj")
    model = PackingModel(*boosters)

    def predict(w: PackingWorkload, cands: Sequence[Candidate]) -> np.ndarray:
        X = np.asarray([[f[k] for k in FEATURES] for f in (features(w, c) for c in cands)], np.float32)
        return predict_us(model, X)
    return predict


def _device_ids(data: Path, devices: Sequence[Any], device_id: str | None) -> tuple[list[str], str]:
    """Boards of the one GPU model (name, compute capability, SMs) whose packing measurements to
    learn: ``device_id`` (a board id or device name), else the only model with data."""
    import pyarrow.parquet as pq

    cands = {r["hash"] for r in pq.read_table(data / "candidates.parquet").to_pylist()
             if r["kind"] == "packing"}
    with_data = {r["device_id"] for r in pq.read_table(data / "measurements.parquet").to_pylist()
                 if r["candidate_hash"] in cands and r["status"] == "ok"}
    models: dict[tuple, list[Any]] = defaultdict(list)
    for d in devices:
        models[(d.name, d.compute_capability, d.sm_count)].append(d)
    if device_id is not None:
        keys = [k for k, ds in models.items() if any(device_id in (d.id, d.name) for d in ds)]
    else:
        keys = [k for k, ds in models.items() if any(d.id in with_data for d in ds)]
    if len(keys) != 1:
        what = f"--device-id {device_id!r} matches" if device_id else "packing measurements come from"
        raise TrainError(f"{what} {len(keys)} device models; name one with --device-id")
    return [d.id for d in models[keys[0]]], keys[0][0]


def _choice_baselines(y: np.ndarray, groups: np.ndarray, names: np.ndarray, seed: int) -> dict[str, Any]:
    rule = np.ones(len(y))
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        rule[idx[rule_choice(names[idx])]] = 0.0
    rng = np.random.default_rng(seed)
    return {"rule": all_metrics(y, rule, groups, seed=seed, with_mape=False),
            "random": all_metrics(y, rng.random(len(y)), groups, seed=seed, with_mape=False)}


def train_on_store(db: Path, *, out_root: Path, device_id: str | None = None, folds: int = 5,
                   lofo: bool = True, seed: int = 0, progress: Any = None) -> dict[str, Any]:
    """``tunedb train --kind packing``: the database's packing measurements of one GPU model,
    held out on the fusion kind's four splits (``folds`` folds each; without ``lofo`` by workload
    only) and scored with its metric keys plus the packing choice scores; saved to
    ``OUT/<device>/packing/`` (model.ubj, rank.ubj, card.json) and recorded in the database."""
    from tunedb.costmodel.registry import model_dir

    say = progress or (lambda _msg: None)
    with TuningStore.open(db, read_only=True, wait_s=BUSY_WAIT_S) as store, \
            tempfile.TemporaryDirectory() as tmp:
        store.export_parquet(tmp)
        ids, name = _device_ids(Path(tmp), store.devices(), device_id)
        try:
            frame = load_frame(Path(tmp), ids)
        except ValueError as e:
            raise TrainError(str(e).replace(tmp, str(db))) from None
    say(f"{len(frame['y'])} rows, {len(np.unique(frame['groups']))} workloads; held-out evaluation")
    y, groups = frame["y"], frame["groups"]
    splits = SPLITS if lofo else ("by_workload",)
    metrics = evaluate(frame, folds=folds, seed=seed, splits=splits)
    say("fitting on every row")
    where = save(fit(frame["X"], y, groups), model_dir(out_root, name, "packing"), frame, metrics, name)
    card_json = canonical_json(json.loads((where / "card.json").read_text()))
    model_id = sha256_hex(card_json)[:16]
    with TuningStore.open(db, wait_s=BUSY_WAIT_S) as store:
        store.add_model(model_id, "packing", name, str(where.resolve()), card_json)
    base = _choice_baselines(y, groups, frame["names"], seed)
    return {**metrics["by_workload"], **metrics, "baselines": base, "objective": PARAMS["objective"],
            "folds": folds, "rows": int(len(y)),
            "workloads": int(len(np.unique(groups))), "boards": ids, "model_dir": str(where.resolve()),
            "model_id": model_id, "device_name": name}


"""One call from a training frame to a saved, evaluated model (what ``tunedb train`` runs).

frame -> clean (ok rows, one row per candidate and board) -> features -> train (objective
chosen on a held-out split) -> the four held-out splits of ``evaluate`` (by workload, leave op,
shape and family out) with the chosen objective -> card -> ``<out>/<device>/<kind>/``.

Op and shape labels come from the frame's ``op`` and ``shape`` columns when it has them (a kind
whose workload names do not follow the suite's ``<op>_<RxC>_<dtype>`` form can supply its own),
else from ``workload_name``.

A frame may hold several boards of one device model (name, compute capability, SM count: the
store's ``same_model_ids``), never two models. Folds stay by workload; held-out metrics compare
candidates of one workload measured on one board (pairs never cross boards). ``boards="each"``
trains on every (candidate, board) row; ``"median"`` on one row per candidate, the median over
its boards (the held-out scoring is the same per-board rows either way).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.costmodel.evaluate import (
    SPLITS,
    Labels,
    baseline_predictions,
    evaluate_splits,
    merge_rows,
)
from tunedb.costmodel.features import DeviceFacts, featurize_frame
from tunedb.costmodel.metrics import METRIC_KEYS
from tunedb.costmodel.model import CostModel, CostModelError
from tunedb.costmodel.registry import data_snapshot_hash, make_card, model_dir, save_model
from tunedb.costmodel.train import TrainParams, group_codes, train_booster

REQUIRED_COLUMNS = ("workload_hash", "candidate_hash", "config_json", "device_id", "median_us")


def clean_frame(frame: pa.Table) -> pa.Table:
    """Rows with status ok and a positive latency, one per (candidate, device): a candidate
    measured in several runs gets the median of its runs' medians."""
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.column_names]
    if missing:
        raise CostModelError(f"training frame lacks column(s) {', '.join(missing)}")
    keep = pc.and_(pc.is_valid(frame["median_us"]), pc.greater(pc.fill_null(frame["median_us"], 0.0), 0.0))
    if "status" in frame.column_names:
        keep = pc.and_(keep, pc.equal(pc.fill_null(frame["status"], ""), "ok"))
    t = frame.filter(keep)
    if t.num_rows == 0:
        return t
    key = pc.binary_join_element_wise(t["candidate_hash"], t["device_id"], "|")
    codes = key.combine_chunks().dictionary_encode().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    if len(np.unique(codes)) == len(codes):
        return t
    lat = t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64)
    order = np.lexsort((lat, codes))
    counts = np.bincount(codes)
    starts = np.cumsum(counts) - counts
    lo = order[starts + (counts - 1) // 2]
    hi = order[starts + counts // 2]
    med = (lat[lo] + lat[hi]) / 2.0
    first = order[starts]
    out = t.take(pa.array(first))
    i = out.column_names.index("median_us")
    return out.set_column(i, "median_us", pa.array(med, type=pa.float64()))


BOARD_ROWS = ("each", "median")


def _model_key(d: Any) -> tuple[str, str, int]:
    return (str(d.name), str(d.compute_capability), int(d.sm_count))


def device_facts_for(frame: pa.Table, devices: list[Any] | None = None) -> DeviceFacts:
    """DeviceFacts of the one device model a frame holds, from its boards' DeviceInfo when
    given (name, compute capability, SM count must agree), else from the device_name column.
    Refuses a frame that mixes device models."""
    ids = sorted(set(frame["device_id"].to_pylist()))
    if not ids:
        raise CostModelError("training frame holds no device")
    known = {getattr(d, "id", None): d for d in devices or []}
    infos = [known[i] for i in ids if i in known]
    if infos:
        models = sorted({_model_key(d) for d in infos})
        if len(models) > 1:
            raise CostModelError("training frame mixes device models (" + "; ".join(
                f"{n} cc {cc} {sm} SMs" for n, cc, sm in models) + "); train one model per device model")
        return DeviceFacts.from_device_info(infos[0])
    names = sorted({n for n in frame["device_name"].to_pylist() if n}) \
        if "device_name" in frame.column_names else []
    if len(names) > 1:
        raise CostModelError(f"training frame mixes device models ({'; '.join(names)}); "
                             "train one model per device model")
    return DeviceFacts(name=names[0]) if names else DeviceFacts()


def grid_pair_accuracy(frame: pa.Table, y: np.ndarray, pred: np.ndarray, pairs: np.ndarray) -> dict[str, Any]:
    """Accuracy on pairs of candidates that differ only in the schedule's ``grid`` (wave vs
    full), of one workload measured on one board (``pairs`` labels the rows compared together):
    the one choice the v2 schema added. A prediction tie counts half, label ties are left out."""
    keys: dict[tuple[Any, str], list[int]] = {}
    for i, (p, cfg) in enumerate(zip(pairs.tolist(), frame["config_json"].to_pylist())):
        c = json.loads(cfg)
        grid = c.pop("grid", "wave")
        keys.setdefault((p, json.dumps(c, sort_keys=True)), []).append(i if grid == "full" else -1 - i)
    both = [(~min(v), max(v)) for v in keys.values() if len(v) == 2 and min(v) < 0 <= max(v)]
    if not both:
        return {"pairs": 0, "accuracy": None}
    wave, full = (np.array(x, dtype=np.int64) for x in zip(*both))
    dy, dp = np.sign(y[full] - y[wave]), np.sign(pred[full] - pred[wave])
    ok = dy != 0
    acc = (float(np.sum(dy[ok] == dp[ok])) + 0.5 * float(np.sum(dp[ok] == 0))) / max(1, int(ok.sum()))
    return {"pairs": int(ok.sum()), "accuracy": acc if ok.any() else None,
            "full_faster": float(np.mean(dy[ok] < 0)) if ok.any() else None}


def _jsonable(v: Any) -> Any:
    """NaN/inf -> None and NumPy scalars -> Python, so the metrics are strict JSON."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def frame_labels(t: pa.Table, pairs: np.ndarray | None = None, merge: np.ndarray | None = None) -> Labels:
    """The evaluation labels of a cleaned frame: workload, op, shape, family, p20/p80 spreads."""
    def col(name: str) -> list[Any] | None:
        return t[name].to_pylist() if name in t.column_names else None

    def floats(name: str) -> np.ndarray | None:
        return t[name].to_numpy(zero_copy_only=False).astype(np.float64) if name in t.column_names else None

    names = col("workload_name") or t["workload_hash"].to_pylist()
    return Labels.of(t["workload_hash"], names=names, op=col("op"), shape=col("shape"),
                     family=col("family"), compare=pairs, lo=floats("p20_us"), hi=floats("p80_us"),
                     merge=merge)


def split_metrics(ev: dict[str, Any]) -> dict[str, Any]:
    """A split's result as the card keeps it: METRIC_KEYS, with_measured, counts (no ``pred``)."""
    return {k: v for k, v in ev.items() if k != "pred"}


def fit_frame(frame: pa.Table, *, kind: str = "fusion", out_root: str | Path | None = None,
              device: DeviceFacts | None = None, params: TrainParams | None = None, folds: int = 5,
              lofo: bool = True, progress: Callable[[str], None] | None = None,
              graphs: Mapping[str, Any] | None = None, devices: list[Any] | None = None,
              boards: str = "each") -> tuple[CostModel, dict[str, Any], Path | None]:
    """Train, evaluate on held-out workloads and (with ``out_root``) save. Returns the model,
    the metrics (the card's ``metrics``: one entry per split of ``evaluate.SPLITS``, the
    by_workload headline copied to the top level, baselines) and the model directory.
    ``lofo=False`` evaluates by_workload only (the leave-op/shape/family-out splits cost three
    more cross-validations). ``graphs`` (workload hash -> graph JSON) stands in for a frame
    without the graph_json column; ``devices`` (DeviceInfo of the frame's boards) lets the check
    that they are one device model use compute capability and SM count; ``boards``: see the
    module's docstring."""
    params = params or TrainParams()
    if boards not in BOARD_ROWS:
        raise CostModelError(f"boards must be one of {', '.join(BOARD_ROWS)}, got {boards!r}")
    splits = SPLITS if lofo else ("by_workload",)
    say = progress or (lambda _msg: None)
    t = clean_frame(frame)
    if t.num_rows == 0:
        raise CostModelError(f"no ok measurements of kind {kind!r} to train on")
    checked = device_facts_for(t, devices)  # refuses mixed device models even when given facts
    dev = device or checked
    say(f"features for {t.num_rows:,} candidates")
    if graphs is None and "graph_json" not in t.column_names:
        raise CostModelError("training frame has no graph_json column and no graphs were given")
    try:
        X = featurize_frame(t, dev, graphs)
    except ValueError as e:
        raise CostModelError(str(e)) from None
    y = t["median_us"].to_numpy(zero_copy_only=False).astype(np.float64)
    groups = group_codes(t["workload_hash"])
    families = np.asarray(t["family"].to_pylist() if "family" in t.column_names else ["?"] * t.num_rows)
    n_workloads = len(np.unique(groups))
    if n_workloads < 3:
        raise CostModelError(f"need measurements of at least 3 workloads to train and hold some out, "
                             f"got {n_workloads}")
    board_ids = t["device_id"].to_pylist()
    several = len(set(board_ids)) > 1
    # One board: the labels below would equal the workload's, so they are left out (same path,
    # same numbers as a one-board model always had).
    pairs = group_codes(pc.binary_join_element_wise(t["workload_hash"], t["device_id"], "|")) \
        if several else None
    merge = group_codes(t["candidate_hash"]) if several and boards == "median" else None
    labels = frame_labels(t, pairs, merge)

    say("training")
    if merge is not None:
        rows, y_fit = merge_rows(np.arange(len(y)), merge, y)
        result = train_booster(X[rows], y_fit, groups[rows], params)
    else:
        result = train_booster(X, y, groups, params, query=pairs)
    pinned = replace(params, objective=result.objective)
    ev = evaluate_splits(X, y, labels, pinned, splits=splits, folds=folds, seed=params.seed, progress=say)
    cv = ev["by_workload"]
    metrics: dict[str, Any] = {k: cv[k] for k in (*METRIC_KEYS, "decisive_pair_share", "spearman_global")}
    metrics.update({s: split_metrics(ev[s]) for s in splits})
    metrics.update(baselines=ev["baselines"], objective=result.objective, folds=cv["folds"], rows=int(len(y)),
                   workloads=n_workloads, measured_facts=cv["measured_facts"],
                   objectives_tried=result.tried, boards=len(set(board_ids)), board_rows=boards,
                   spreads=labels.lo is not None,
                   candidates=int(len(np.unique(group_codes(t["candidate_hash"])))))
    metrics["grid_pairs"] = {"model": grid_pair_accuracy(t, y, cv["pred"], labels.cmp),
                             "roofline": grid_pair_accuracy(t, y, baseline_predictions(X)["roofline"],
                                                            labels.cmp)}
    metrics = _jsonable(metrics)

    per_board: dict[str, int] = {}
    for b in board_ids:
        per_board[b] = per_board.get(b, 0) + 1
    snapshot = {"hash": data_snapshot_hash(t), "rows": int(t.num_rows), "workloads": n_workloads,
                "families": sorted(set(families.tolist()))}
    if several:
        snapshot["boards"] = dict(sorted(per_board.items()))
        snapshot["board_rows"] = boards
    model = CostModel(result.booster, make_card(result, params, dev, kind, snapshot, metrics))
    where = None
    if out_root is not None:
        where = save_model(model, model_dir(out_root, dev.name, kind))
        say(f"saved to {where}")
    return model, metrics, where

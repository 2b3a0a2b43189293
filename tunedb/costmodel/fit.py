"""One call from a training frame to a saved, evaluated model (what ``tunedb train`` runs).

frame -> clean (ok rows, one row per candidate and device) -> features -> train (objective
chosen on a held-out split) -> GroupKFold and leave-one-family-out with the chosen objective ->
card -> ``<out>/<device>/<kind>/``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunedb.costmodel.evaluate import cross_validate, leave_one_family_out, summary
from tunedb.costmodel.features import DeviceFacts, featurize_frame
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


def device_facts_for(frame: pa.Table, devices: list[Any] | None = None) -> DeviceFacts:
    """DeviceFacts of the one device a frame holds (its DeviceInfo when given, for SM count)."""
    ids = sorted(set(frame["device_id"].to_pylist()))
    if len(ids) != 1:
        raise CostModelError(f"training frame holds {len(ids)} devices ({', '.join(ids[:4])}); "
                             "train one model per device")
    for d in devices or []:
        if getattr(d, "id", None) == ids[0]:
            return DeviceFacts.from_device_info(d)
    names = frame["device_name"].to_pylist() if "device_name" in frame.column_names else []
    return DeviceFacts(name=names[0]) if names and names[0] else DeviceFacts()


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


def fit_frame(frame: pa.Table, *, kind: str = "fusion", out_root: str | Path | None = None,
              device: DeviceFacts | None = None, params: TrainParams | None = None, folds: int = 5,
              lofo: bool = True, progress: Callable[[str], None] | None = None,
              graphs: Mapping[str, Any] | None = None) -> tuple[CostModel, dict[str, Any], Path | None]:
    """Train, evaluate on held-out workloads and (with ``out_root``) save. Returns the model,
    the metrics (the card's ``metrics``) and the model directory. ``graphs`` (workload hash ->
    graph JSON) stands in for a frame without the graph_json column."""
    params = params or TrainParams()
    say = progress or (lambda _msg: None)
    t = clean_frame(frame)
    if t.num_rows == 0:
        raise CostModelError(f"no ok measurements of kind {kind!r} to train on")
    dev = device or device_facts_for(t)
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

    say("training")
    result = train_booster(X, y, groups, params)
    pinned = replace(params, objective=result.objective)
    say(f"cross-validation ({folds} folds by workload)")
    cv = cross_validate(X, y, groups, pinned, folds=folds, seed=params.seed)
    metrics: dict[str, Any] = summary(cv)
    metrics.update(objective=result.objective, folds=cv["folds"], rows=int(len(y)), workloads=n_workloads,
                   measured_facts=cv["measured_facts"], with_measured=cv.get("with_measured", {}),
                   pairwise_accuracy_per_workload=cv["pairwise_accuracy_per_workload"],
                   spearman_global=cv["spearman_global"], objectives_tried=result.tried)
    if lofo and len(set(families.tolist())) > 1:
        say("leave-one-family-out")
        lo = leave_one_family_out(X, y, groups, families, pinned, seed=params.seed)
        metrics["leave_one_family_out"] = {"families": lo["families"], **summary(lo["pooled"])}
    else:
        metrics["leave_one_family_out"] = {}
    metrics = _jsonable(metrics)

    snapshot = {"hash": data_snapshot_hash(t), "rows": int(t.num_rows), "workloads": n_workloads,
                "families": sorted(set(families.tolist()))}
    model = CostModel(result.booster, make_card(result, params, dev, kind, snapshot, metrics))
    where = None
    if out_root is not None:
        where = save_model(model, model_dir(out_root, dev.name, kind))
        say(f"saved to {where}")
    return model, metrics, where

"""Cost model kind ``stage``: the latency of an IOS stage (groups of steps run concurrently)
from its members.

Data: the stage rows the stage bench writes (``python -m tunedb.bench.stages OUT.json --refine``
-> ``OUT_rows.json``): per graph, the plan its step indices refer to (the plan's JSON) and one row
per measured stage (its groups of step indices and µs). Nothing here imports the planner: the
members' facts come from each step's JSON (kind, launches, predicted µs, its sub-graph).

Features (``FEATURES``, schema ``FEATURE_SCHEMA``), per stage: the number of groups, steps and
kernel launches; the members' own times (each group alone, measured when the rows hold that
group as a stage of its own, else the planner's prediction plus launches): the longest group,
the sum, their ratio; FLOPs, bytes, CTAs and waves on the 132 SMs (cuBLAS/conv: one 128x128
output tile per CTA; other kernels: 1024 elements per CTA), the largest member's waves, and the
share of the stage's time in compute-bound members. Target: log(µs), XGBoost.

Held-out evaluation: by workload (5 folds of whole stages) and by model family (each graph held
out in turn), against the two rules a planner would use without a model: the longest group alone
(perfect overlap) and the sum of the groups (no overlap).
``tunedb train --kind stage --db DB`` (after ``python -m collectors.stage ROWS.json DB``) prints
the scores and saves ``model.ubj`` + ``card.json`` (kind ``stage``, the feature schema, the data's hash).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunedb._version import __version__
from tunedb.costmodel.errors import TrainError
from tunedb.costmodel.registry import model_dir
from tunedb.graph.ir import Graph
from tunedb.records import canonical_json, sha256_hex
from tunedb.store import BUSY_WAIT_S, TuningStore

FEATURE_SCHEMA = "stage/1"
SMS, GEMM_TILE, ELEMS_PER_CTA = 132, 128 * 128, 1024
COMPUTE = ("conv2d", "matmul", "gemm")
LAUNCH_US = 2.5
PEAK_FLOPS, PEAK_BYTES = 60e12, 4.0e12
FEATURES = ("groups", "steps", "launches", "longest_alone_us", "sum_alone_us", "overlap_bound",
            "measured_alone_share", "log_flops", "log_bytes", "ctas", "waves", "max_member_waves",
            "compute_share", "roofline_us", "views")
PARAMS = {"objective": "reg:squarederror", "max_depth": 5, "eta": 0.15, "subsample": 0.8,
          "colsample_bytree": 0.9, "min_child_weight": 2.0, "nthread": 2, "seed": 0}
ROUNDS = 150
MODEL_FILE = "model.ubj"  # XGBoost's own binary JSON, as the registry's other kinds


def _flops(g: Graph) -> float:
    t = g.type_map
    total = 0.0
    for n in g.nodes:
        if n.op == "conv2d":
            o = t[n.outputs[0]].shape
            w = t[n.inputs[1]].shape
            total += 2.0 * math.prod(o) * math.prod(w[1:])
        elif n.op in ("matmul", "gemm"):
            a = t[n.inputs[0]].shape
            k = a[-2] if n.op == "gemm" and n.attr("trans_a") else a[-1]
            total += 2.0 * t[n.outputs[0]].numel * k
        else:
            total += float(sum(t[v].numel for v in n.outputs))
    return total


def member_facts(step: Mapping[str, Any]) -> dict[str, float]:
    """What the features need of one step, from its JSON (``KernelStep.to_json``): FLOPs, bytes,
    CTAs, compute-bound or not, launches, and a roofline time (launches included). All of it
    follows from the step's sub-graph, so a stored stage carries it (``collectors.stage``)."""
    kind = step["kind"]
    launches = int(step.get("launches", 1))
    if kind == "layout_view":
        return {"us": 0.0, "flops": 0.0, "bytes": 0.0, "ctas": 0.0, "compute": 0.0, "launches": 0}
    sub = step["subgraph"]
    if isinstance(sub, str):  # the JSON form: a candidates file repeats each step thousands of times
        return dict(_facts_of_text(kind, launches, sub))
    return _facts(kind, launches, Graph.from_json(sub))


@functools.lru_cache(maxsize=4096)
def _facts_of_text(kind: str, launches: int, sub: str) -> tuple[tuple[str, float], ...]:
    return tuple(_facts(kind, launches, Graph.from_json(json.loads(sub))).items())


def _facts(kind: str, launches: int, g: Graph) -> dict[str, float]:
    out = float(sum(g.type_of(v).numel for v in g.outputs))
    nbytes = float(g.floor_bytes())
    flops = _flops(g)
    single = kind in COMPUTE and len(g.nodes) == 1
    ctas = math.ceil(out / GEMM_TILE) if single else math.ceil(out / ELEMS_PER_CTA)
    compute = float(single and flops / max(nbytes, 1.0) > PEAK_FLOPS / PEAK_BYTES)
    us = LAUNCH_US * launches + 1e6 * max(flops / PEAK_FLOPS if single else 0.0, nbytes / PEAK_BYTES)
    return {"us": round(us, 4), "flops": flops, "bytes": nbytes, "ctas": float(ctas), "compute": compute,
            "launches": launches}


def stage_features(facts: Sequence[Mapping[str, float]], groups: Sequence[Sequence[int]],
                   group_alone_us: Sequence[float | None] | None = None) -> dict[str, float]:
    """Features of one stage: ``facts`` per member (``member_facts``), ``groups`` of indices into
    them, ``group_alone_us``: each group's measured µs as a stage of its own, or None (then the
    roofline sum of its members)."""
    alone = list(group_alone_us) if group_alone_us is not None else [None] * len(groups)
    times = [a if a is not None else sum(facts[i]["us"] for i in g) for a, g in zip(alone, groups)]
    measured = sum(1 for a in alone if a is not None)
    members = [facts[i] for g in groups for i in g]
    flops = sum(m["flops"] for m in members)
    nbytes = sum(m["bytes"] for m in members)
    ctas = sum(m["ctas"] for m in members)
    member_us = sum(m["us"] for m in members) or 1.0
    return {"groups": len(groups), "steps": len(members), "launches": sum(m["launches"] for m in members),
            "longest_alone_us": max(times), "sum_alone_us": sum(times),
            "overlap_bound": max(times) / max(sum(times), 1e-9),
            "measured_alone_share": measured / len(groups),
            "log_flops": math.log2(flops + 1), "log_bytes": math.log2(nbytes + 1), "ctas": ctas,
            "waves": ctas / SMS, "max_member_waves": max([m["ctas"] for m in members] + [0]) / SMS,
            "compute_share": sum(m["us"] * m["compute"] for m in members) / member_us,
            "roofline_us": 1e6 * max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES),
            "views": sum(1 for m in members if m["launches"] == 0)}


def _frame(rows: list[tuple[list[float], float, str, str]], where: str, data_hash: str) -> dict[str, Any]:
    if not rows:
        raise ValueError(f"{where}: no measured stage rows")
    Xa = np.asarray([r[0] for r in rows], np.float64)
    cols = {k: i for i, k in enumerate(FEATURES)}
    return {"X": Xa, "y": np.asarray([r[1] for r in rows]), "groups": np.asarray([r[2] for r in rows]),
            "families": np.asarray([r[3] for r in rows]),
            "rule_max": Xa[:, cols["longest_alone_us"]], "rule_sum": Xa[:, cols["sum_alone_us"]],
            "data_hash": data_hash}


def family_of(case: str) -> str:
    """The model family of a bench case name: ``inception_v3_b1`` -> ``inception_v3``."""
    return case.rsplit("_b", 1)[0]


def load_frame(rows_file: Path) -> dict[str, Any]:
    """Rows of every graph of a stage-rows file as arrays: X, y (µs), groups (the stage's
    workload: its members), families (graph), rule_max / rule_sum (µs of the two rules)."""
    try:
        raw = Path(rows_file).read_bytes()
        doc = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read stage rows {rows_file}: {e}") from None
    rows = []
    for name, case in sorted(doc.get("cases", {}).items()):
        facts = [member_facts(s) for s in case["plan"]["steps"]]
        ok = [r for r in case["rows"] if r.get("status") == "ok" and r.get("samples_us")]
        alone = {tuple(r["groups"][0]): float(np.median(r["samples_us"]))
                 for r in ok if len(r["groups"]) == 1}
        steps = case["plan"]["steps"]
        for r in ok:
            f = stage_features(facts, r["groups"], [alone.get(tuple(g)) for g in r["groups"]])
            # the workload of a stage is its set of members, whatever their grouping
            members = sorted(f"{steps[i]['kind']}:{steps[i]['workload_hash']}"
                             for g in r["groups"] for i in g)
            us = float(np.median(r["samples_us"]))
            rows.append(([f[k] for k in FEATURES], us, "|".join(members), family_of(name)))
    return _frame(rows, str(rows_file), hashlib.sha256(raw).hexdigest()[:16])


def load_store_frame(data: Path, device_ids: Sequence[str] | None = None) -> dict[str, Any]:
    """The same arrays from a database export (``tunedb db export`` folder): stage workloads
    (``collectors.stage``, scheme ``tunedb.stage/2``: sorted member texts and their facts), their
    candidates (the grouping) and ok measurements, the family from the Run's ``case``."""
    import pyarrow.parquet as pq

    def table(name: str) -> list[dict[str, Any]]:
        return pq.read_table(data / f"{name}.parquet").to_pylist()

    ws = {r["hash"]: json.loads(r["graph_json"]) for r in table("workloads") if r["family"] == "stage"}
    cands = {r["hash"]: r for r in table("candidates") if r["kind"] == "stage" and r["workload_hash"] in ws}
    runs = {r["id"]: json.loads(r["config_json"] or "{}") for r in table("runs")}
    times: dict[str, list[float]] = {}
    fam: dict[str, str] = {}
    for r in table("measurements"):
        if r["status"] == "ok" and r["candidate_hash"] in cands and r["samples_us"] \
                and (device_ids is None or r["device_id"] in device_ids):
            times.setdefault(r["candidate_hash"], []).append(float(np.median(r["samples_us"])))
            cfg = runs.get(r["run_id"], {})
            fam.setdefault(r["candidate_hash"], family_of(str(cfg.get("case") or cfg.get("graph") or "?")))
    parsed = {}
    for ch in times:
        doc = ws[cands[ch]["workload_hash"]]
        groups = json.loads(json.loads(cands[ch]["config_json"])["groups"])
        parsed[ch] = (doc, groups, float(np.median(times[ch])))
    # a group's time alone: the stage of one group with the same members
    alone = {tuple(doc["members"]): us for doc, groups, us in parsed.values() if len(groups) == 1}
    rows = []
    for ch, (doc, groups, us) in sorted(parsed.items()):
        members = doc["members"]
        group_alone = [alone.get(tuple(sorted(members[i] for i in g))) for g in groups]
        f = stage_features(doc["facts"], groups, group_alone)
        rows.append(([f[k] for k in FEATURES], us, cands[ch]["workload_hash"], fam[ch]))
    digest = hashlib.sha256(json.dumps(sorted((ch, p[2]) for ch, p in parsed.items())).encode()).hexdigest()
    return _frame(rows, str(data), digest[:16])


def fit(X: np.ndarray, y_us: np.ndarray) -> Any:
    import xgboost as xgb

    return xgb.train(PARAMS, xgb.DMatrix(X, label=np.log(y_us), feature_names=list(FEATURES)), ROUNDS)


def predict_us(booster: Any, X: np.ndarray) -> np.ndarray:
    import xgboost as xgb

    return np.exp(booster.predict(xgb.DMatrix(X, feature_names=list(FEATURES))))


def _errors(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    rel = np.abs(pred - y) / y
    ry, rp = np.argsort(np.argsort(y)), np.argsort(np.argsort(pred))
    spearman = float(np.corrcoef(ry, rp)[0, 1]) if len(y) > 2 else float("nan")
    return {"rows": int(len(y)), "mape": float(rel.mean()), "median_ape": float(np.median(rel)),
            "within_10pct": float(np.mean(rel <= 0.10)), "spearman": spearman}


def evaluate(frame: Mapping[str, Any], folds: int = 5, seed: int = 0) -> dict[str, Any]:
    """Held-out errors by workload (folds of whole stages) and by model family (each graph held
    out), next to the two rules."""
    X, y, keys, fams = (frame[k] for k in ("X", "y", "groups", "families"))
    uniq = np.unique(keys)
    rng = np.random.default_rng(seed)
    fold_of = dict(zip(rng.permutation(uniq), np.arange(len(uniq)) % folds))
    out: dict[str, Any] = {"rule_longest_group": _errors(y, frame["rule_max"]),
                           "rule_sum_of_groups": _errors(y, frame["rule_sum"])}
    splits = {"by_workload": np.array([fold_of[k] for k in keys])}
    if len(np.unique(fams)) > 1:
        splits["by_family"] = fams
    for split, labels in splits.items():
        pred = np.empty(len(y))
        per: dict[str, Any] = {}
        for lab in np.unique(labels):
            test, train = np.flatnonzero(labels == lab), np.flatnonzero(labels != lab)
            pred[test] = predict_us(fit(X[train], y[train]), X[test])
            if split == "by_family":
                per[str(lab)] = _errors(y[test], pred[test])
        out[split] = {**_errors(y, pred), **({"families": per} if per else {})}
    return out


def save(booster: Any, out_dir: Path, frame: Mapping[str, Any], scores: Mapping[str, Any],
         device: str = "") -> Path:
    import xgboost as xgb

    out_dir.mkdir(parents=True, exist_ok=True)
    booster.save_model(str(out_dir / MODEL_FILE))
    card = {"kind": "stage", "feature_schema": FEATURE_SCHEMA, "features": list(FEATURES),
            "tunedb_version": __version__, "xgboost_version": xgb.__version__,
            "target": "log_us", "params": PARAMS, "rounds": ROUNDS, "rows": int(len(frame["y"])),
            "workloads": int(len(np.unique(frame["groups"]))),
            "families": sorted(set(frame["families"].tolist())),
            "data_hash": frame["data_hash"], "device": device, "held_out": scores}
    (out_dir / "card.json").write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")
    return out_dir


def load_booster(folder: Path) -> Any:
    """A saved stage model; a card of another kind or feature schema is refused (ValueError)."""
    import xgboost as xgb

    try:
        card = json.loads((Path(folder) / "card.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"stage model {folder}: no readable card.json ({e})") from None
    if card.get("kind") != "stage" or card.get("feature_schema") != FEATURE_SCHEMA:
        raise ValueError(f"stage model {folder}: card says kind {card.get('kind')!r}, schema "
                         f"{card.get('feature_schema')!r}; expected stage, {FEATURE_SCHEMA}")
    booster = xgb.Booster()
    booster.load_model(str(Path(folder) / MODEL_FILE))
    return booster


def train_on_store(db: Path, *, out_root: Path, device_id: str | None = None, folds: int = 5,
                   seed: int = 0, progress: Any = None) -> dict[str, Any]:
    """``tunedb train --kind stage``: the database's stage measurements of one GPU model (all
    its boards), held out by workload and by model family, saved to ``OUT/<device>/stage/``
    (model.ubj, card.json) and recorded in the database's models table."""

    say = progress or (lambda _msg: None)
    with TuningStore.open(db, read_only=True, wait_s=BUSY_WAIT_S) as store, \
            tempfile.TemporaryDirectory() as tmp:
        store.export_parquet(tmp)
        models: dict[tuple, list[Any]] = defaultdict(list)
        for d in store.devices():
            if device_id is None or device_id in (d.id, d.name):
                models[(d.name, d.compute_capability, d.sm_count)].append(d)
        frames = {}
        for key, ds in models.items():
            try:
                frames[key] = load_store_frame(Path(tmp), [d.id for d in ds])
            except ValueError:
                continue  # no stage rows on this GPU model
        if len(frames) != 1:
            what = f"--device-id {device_id!r} matches" if device_id else "stage measurements come from"
            raise TrainError(f"{what} {len(frames)} GPU models with stage rows; name one with --device-id")
        (name, _, _), frame = next(iter(frames.items()))
    say(f"{len(frame['y'])} stage rows, {len(np.unique(frame['groups']))} workloads; held-out evaluation")
    scores = evaluate(frame, folds=folds, seed=seed)
    say("fitting on every row")
    where = save(fit(frame["X"], frame["y"]), model_dir(out_root, name, "stage"), frame, scores, name)
    card_json = canonical_json(json.loads((where / "card.json").read_text()))
    model_id = sha256_hex(card_json)[:16]
    with TuningStore.open(db, wait_s=BUSY_WAIT_S) as store:
        store.add_model(model_id, "stage", name, str(where.resolve()), card_json)
    return {**scores, "rows": int(len(frame["y"])), "workloads": int(len(np.unique(frame["groups"]))),
            "model_dir": str(where.resolve()), "model_id": model_id, "device_name": name}

"""``evaluate_fits``: the four held-out splits and their metrics for any model kind (a fold
fitter in, held-out metrics out), on hand-made labels and on the stored packing data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tunedb.costmodel.evaluate import SPLITS, Labels, evaluate_fits, evaluate_splits, out_of_fold
from tunedb.costmodel.metrics import METRIC_KEYS

PACKING = Path(__file__).resolve().parents[1] / "data" / "packing_h200"


def _toy(n_ops: int = 4, n_shapes: int = 3, per: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [(o, s, c) for o in range(n_ops) for s in range(n_shapes) for c in range(per)]
    op = np.array([f"op{o}" for o, _, _ in rows], dtype=object)
    shape = np.array([f"{8 * (s + 1)}x{16 * (s + 1)}" for _, s, _ in rows], dtype=object)
    family = np.array([f"fam{o % 2}" for o, _, _ in rows], dtype=object)
    workload = np.array([f"{o}|{s}" for o, s, _ in rows], dtype=object)
    y = rng.lognormal(3.0, 0.5, len(rows))
    return y, Labels.of(workload, op=op, shape=shape, family=family)


def test_each_split_holds_its_label_out_and_an_exact_model_scores_one() -> None:
    y, labels = _toy()
    seen: dict[str, list[tuple[set, set]]] = {}

    def fit(tr: np.ndarray):
        def predict(te: np.ndarray) -> np.ndarray:
            for split, field in (("op", labels.op), ("shape", labels.shape), ("family", labels.family)):
                seen.setdefault(split, []).append((set(field[tr]), set(field[te])))
            return y[te]  # an exact model
        return predict

    ev = evaluate_fits(fit, y, labels, folds=3)
    assert set(ev) == set(SPLITS)
    for split in SPLITS:
        m = ev[split]
        assert m["rows"] == len(y) and m["workloads"] == 12
        assert m["top1_score"] == m["top5_score"] == m["pairwise_accuracy"] == m["spearman"] == 1.0
        assert m["mape"] == 0.0 and np.isfinite(m["pred"]).all()
    # leave_op_out never trains on an op it scores; by_workload does (its folds cut workloads).
    fold_of = {"leave_op_out": "op", "leave_shape_out": "shape", "leave_family_out": "family"}
    n_folds = {s: ev[s]["folds"] for s in SPLITS}
    assert n_folds == {"by_workload": 3, "leave_op_out": 3, "leave_shape_out": 3, "leave_family_out": 2}
    start = n_folds["by_workload"]
    for split in ("leave_op_out", "leave_shape_out", "leave_family_out"):
        for tr, te in seen[fold_of[split]][start:start + n_folds[split]]:
            assert not tr & te
        start += n_folds[split]
    assert set(ev["leave_family_out"]["families"]) == {"fam0", "fam1"}


def test_a_reversed_model_scores_zero_and_a_score_needs_no_mape() -> None:
    y, labels = _toy()
    ev = evaluate_fits(lambda tr: (lambda te: -y[te]), y, labels, splits=("by_workload",), folds=3,
                       with_mape=False)
    m = ev["by_workload"]
    assert m["pairwise_accuracy"] == 0.0 and m["spearman"] == -1.0 and np.isnan(m["mape"])
    assert m["top1_score"] < 1.0


def test_labels_missing_for_a_split_leave_it_empty() -> None:
    y, labels = _toy()
    bare = Labels.of(labels.workload)
    ev = evaluate_fits(lambda tr: (lambda te: y[te]), y, bare, folds=3)
    assert ev["leave_op_out"] == ev["leave_shape_out"] == ev["leave_family_out"] == {}
    assert ev["by_workload"]["top1_score"] == 1.0


def test_too_few_workloads_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 3 workloads"):
        evaluate_fits(lambda tr: (lambda te: te), np.ones(4), Labels.of(np.array([0, 0, 1, 1])))


def test_out_of_fold_pools_each_output_and_refuses_a_short_fold() -> None:
    parts = [(np.array([2, 3]), np.array([0, 1])), (np.array([0, 1]), np.array([2, 3]))]
    seen: list[int] = []

    def predict(i: int, tr: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append(i)
        return te * 10.0, tr.astype(float)

    pred, other = out_of_fold(5, parts, predict, outputs=2, workers=2)
    assert sorted(seen) == [0, 1]
    assert pred[:4].tolist() == [0.0, 10.0, 20.0, 30.0] and np.isnan(pred[4])  # row 4 never held out
    assert other[:4].tolist() == [2.0, 3.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="gave 1 predictions, expected 2"):
        out_of_fold(5, parts, lambda i, tr, te: (te,), outputs=2)


def test_fusion_and_any_kind_share_folds_and_scores() -> None:
    """The fusion kind's ``evaluate_splits`` and the any-kind ``evaluate_fits`` run one fold
    loop: the same booster per fold gives the same held-out numbers on every split."""
    from tunedb.costmodel.evaluate import _fold_params, _predict_us, hide_measured
    from tunedb.costmodel.features import featurize_frame
    from tunedb.costmodel.fit import clean_frame
    from tunedb.costmodel.synthetic import synthetic_frame
    from tunedb.costmodel.train import TrainParams, train_booster

    t = clean_frame(synthetic_frame(n_workloads=12, candidates_per_workload=8, seed=3))
    X, y = featurize_frame(t), t["median_us"].to_numpy()
    labels = Labels.of(t["workload_hash"], names=t["workload_name"].to_pylist(),
                       family=t["family"].to_pylist(), lo=t["p20_us"].to_numpy(), hi=t["p80_us"].to_numpy())
    params = TrainParams(objective="reg:squarederror", bag=1, num_boost_round=8, max_depth=3, nthread=1)
    fusion = evaluate_splits(X, y, labels, params, folds=3)
    calls = iter(range(10 ** 6))

    def fit(tr: np.ndarray):
        # Fold i of each split trains with seed + i, as the fusion kind's loop does.
        r = train_booster(X[tr], y[tr], labels.workload[tr], _fold_params(params, next(calls)))
        return lambda te: _predict_us(r, hide_measured(X[te]))

    for split in SPLITS:
        calls = iter(range(10 ** 6))
        anyk = evaluate_fits(fit, y, labels, splits=(split,), folds=3)[split]
        assert fusion[split]["folds"] == anyk["folds"] >= 2
        np.testing.assert_allclose(fusion[split]["pred"], anyk["pred"], rtol=1e-6)
        for k in METRIC_KEYS:
            np.testing.assert_allclose(fusion[split][k], anyk[k], rtol=1e-9)
    assert set(fusion["leave_family_out"]["families"]) == set(labels.family.tolist())


@pytest.mark.slow  # 12 small packing models
def test_packing_kind_scores_on_the_four_splits() -> None:
    import pyarrow.parquet as pq
    import xgboost as xgb

    from tunedb.costmodel import packing

    frame = packing.load_frame(PACKING)
    names = {r["hash"]: r["name"] for r in pq.read_table(PACKING / "workloads.parquet").to_pylist()}
    # Packing names: <scenario>_<member shapes or tenants' sequence lengths>_<dtype>.
    parts = [names[g].rsplit("_", 2) for g in frame["groups"]]
    labels = Labels.of(frame["groups"], op=[p[0] for p in parts], shape=[p[1] for p in parts],
                       family=frame["families"])
    X, y = frame["X"], frame["y"]

    def fit(tr: np.ndarray):
        # The packing kind's settings, fewer rounds on one thread (the test's budget).
        booster = xgb.train({**packing.PARAMS, "nthread": 1}, xgb.DMatrix(X[tr], label=np.log(y[tr])), 40)
        return lambda te: np.exp(booster.predict(xgb.DMatrix(X[te])))

    ev = evaluate_fits(fit, y, labels, folds=3)
    for split in SPLITS:
        assert ev[split]["workloads"] == len(set(frame["groups"].tolist()))
        assert all(np.isfinite(ev[split][k]) for k in METRIC_KEYS)
        assert ev[split]["pairwise_accuracy"] > 0.6  # far above random (0.5)
    # Unseen scenarios are harder than unseen workloads of known ones.
    assert ev["leave_family_out"]["top1_score"] <= ev["by_workload"]["top1_score"] + 0.01


@pytest.mark.slow  # 4 packing models of 150 rounds
def test_variants_script_scores_the_packing_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "costmodel_variants.py"
    spec = importlib.util.spec_from_file_location("costmodel_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "packing.json"
    assert mod.main(["--kind", "packing", "--export", str(PACKING), "--folds", "2",
                     "--splits", "by_workload", "leave_family_out", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]["packing"]
    assert doc["kind"] == "packing" and set(res) >= {"by_workload", "leave_family_out", "cpu_s"}
    assert res["by_workload"]["folds"] == 2 and 0.5 < res["by_workload"]["top1_score"] <= 1.0
    assert "leave_family_out" in capsys.readouterr().out


@pytest.mark.slow  # two folds of one booster on 42k rows
def test_variants_script_trains_on_both_boards_and_scores_a_subset(tmp_path: Path) -> None:
    import importlib.util
    import json

    data = Path(__file__).resolve().parents[1] / "data"
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "costmodel_variants.py"
    spec = importlib.util.spec_from_file_location("costmodel_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "v3.json"
    assert mod.main(["--export", str(data / "fusion_h200_v3"), "--all-boards", "--score-on",
                     str(data / "fusion_h200_v2"), "--variants", "top_weighted", "--bag", "1",
                     "--folds", "2", "--splits", "by_workload", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]["top_weighted"]
    # v3 holds two boards; its v2 subset is scored apart from the whole
    assert doc["rows"] == 42_375 and len(doc["board"].split(",")) == 2
    whole, subset = res["by_workload"], res["score_on"]["by_workload"]
    assert whole["workloads"] == 704 and whole["top1_score"] != subset["top1_score"]
    assert 0.9 < subset["top1_score"] <= 1.0 and 0.8 < subset["pairwise_accuracy"] < 1.0


def _variants_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "costmodel_variants.py"
    spec = importlib.util.spec_from_file_location("costmodel_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_blends_average_in_log_space_and_z_keeps_the_regressions_scale() -> None:
    mod = _variants_module()
    groups = np.array([0, 0, 0, 1, 1, 1])
    reg = np.log(np.array([10.0, 20.0, 40.0, 1.0, 2.0, 3.0]))
    rank = np.array([5.0, 3.0, 1.0, -1.0, 0.0, 1.0])  # another order and an arbitrary offset
    np.testing.assert_allclose(mod.blend_log_us([reg, rank], "cal", groups), (reg + rank) / 2)
    z = mod.blend_log_us([reg, rank], "z", groups)
    for g in (0, 1):  # per workload: the regression's mean and spread, the members' mean order
        i = groups == g
        np.testing.assert_allclose(z[i].mean(), reg[i].mean())
        assert z[i].std() <= reg[i].std() + 1e-12
    # workload 0: the two orders cancel to a tie; workload 1: both agree, so the order stays
    np.testing.assert_allclose(z[:3], reg[:3].mean())
    assert (np.diff(z[3:]) > 0).all()


def test_blend_results_score_each_blend_on_the_same_folds() -> None:
    from tunedb.costmodel.features import featurize_frame
    from tunedb.costmodel.fit import clean_frame
    from tunedb.costmodel.synthetic import synthetic_frame

    mod = _variants_module()
    t = clean_frame(synthetic_frame(n_workloads=12, candidates_per_workload=8, seed=4))
    X, y = featurize_frame(t), t["median_us"].to_numpy()
    labels = Labels.of(t["workload_hash"], names=t["workload_name"].to_pylist(),
                       family=t["family"].to_pylist())
    res = mod.blend_results(X, y, labels, ["blend_rp_cal", "blend_rp_z"], bag=1, threads=1,
                            splits=["by_workload"], folds=2)
    for name in ("blend_rp_cal", "blend_rp_z"):
        m = res[name]["by_workload"]
        assert m["folds"] == 2 and m["rows"] == len(y)
        assert all(np.isfinite(m[k]) for k in METRIC_KEYS)
        assert res[name]["params"]["members"] == ["top_weighted", "rank_pairwise"]
    # same members, same folds: the two averages differ only in how they combine them
    assert res["blend_rp_cal"]["by_workload"]["mape"] != res["blend_rp_z"]["by_workload"]["mape"]

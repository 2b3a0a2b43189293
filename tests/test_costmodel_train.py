"""XGBoost training, held-out evaluation and the model registry, on synthetic fusion data with a
learnable latency function (real graphs, real schedule spaces, real XGBoost, real files)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import xgboost as xgb

from tunedb.costmodel.evaluate import (
    SPLITS,
    Labels,
    cross_validate,
    evaluate_splits,
    hide_measured,
    op_and_shape,
    split_folds,
    summary,
)
from tunedb.costmodel.features import (
    FEATURE_NAMES,
    FEATURE_SCHEMA_VERSION,
    WORKLOAD_LEVEL_FEATURES,
    feature_index,
    featurize_frame,
)
from tunedb.costmodel.fit import clean_frame, fit_frame
from tunedb.costmodel.metrics import METRIC_KEYS, mape, pairwise_accuracy
from tunedb.costmodel.model import CostModel, CostModelError
from tunedb.costmodel.registry import (
    CARD_FILE,
    MODEL_FILE,
    data_snapshot_hash,
    find_model,
    list_models,
    load_model,
    model_dir,
    save_model,
    slug,
)
from tunedb.costmodel.synthetic import synthetic_frame
from tunedb.costmodel.train import (
    LARGE_DATA,
    TrainError,
    TrainParams,
    _near_best,
    _relevance,
    average_boosters,
    combine_boosters,
    predict_margin,
    predict_us,
    split_by_group,
    train_booster,
)

FAST = TrainParams(num_boost_round=150, max_depth=6, eta=0.2)


@pytest.fixture(scope="module")
def frame() -> pa.Table:
    return clean_frame(synthetic_frame(n_workloads=70, candidates_per_workload=30, seed=5))


@pytest.fixture(scope="module")
def data(frame):
    X = featurize_frame(frame)
    y = frame["median_us"].to_numpy()
    g = np.asarray(frame["workload_hash"].to_pylist())
    fam = np.asarray(frame["family"].to_pylist())
    return X, y, g, fam


@pytest.fixture(scope="module")
def fitted(frame, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    model, metrics, where = fit_frame(frame, out_root=root, params=FAST, folds=3, lofo=True)
    return model, metrics, where, root


def test_split_keeps_workloads_whole(data):
    _, _, g, _ = data
    tr, va = split_by_group(g, 0.25, seed=0)
    assert len(tr) + len(va) == len(g)
    assert not set(g[tr]) & set(g[va])
    with pytest.raises(TrainError, match="at least 2 workloads"):
        split_by_group(np.zeros(10), 0.2, 0)


def test_model_beats_roofline_and_random_on_held_out_workloads(data):
    X, y, g, _ = data
    cv = cross_validate(X, y, g, TrainParams(**{**FAST.to_json(), "objective": "reg:squarederror"}), folds=3)
    m, roof, rand = cv, cv["baselines"]["roofline"], cv["baselines"]["random"]
    assert cv["folds"] == 3 and cv["rows"] == len(y) and cv["measured_facts"] == "hidden"
    assert m["pairwise_accuracy"] > roof["pairwise_accuracy"] + 0.1
    assert m["pairwise_accuracy"] > rand["pairwise_accuracy"] + 0.1
    assert m["top1_score"] > max(roof["top1_score"], rand["top1_score"])
    assert m["spearman"] > max(roof["spearman"], rand["spearman"]) + 0.2
    assert m["mape"] < rand["mape"]
    assert 0.4 < rand["pairwise_accuracy"] < 0.6
    s = summary(cv)
    assert set(s) == {*METRIC_KEYS, "baselines"}


@pytest.mark.slow
def test_train_tries_ranking_and_keeps_the_better(data):
    X, y, g, _ = data
    r = train_booster(X, y, g, FAST)
    assert set(r.tried) == {"reg:squarederror", "rank:pairwise"}
    reg, rank = (r.tried[o]["pairwise_accuracy"] for o in ("reg:squarederror", "rank:pairwise"))
    # Ranking is kept only when it is clearly better on the held-out split.
    assert r.objective == ("rank:pairwise" if rank > reg + FAST.rank_margin else "reg:squarederror")
    eager = train_booster(X, y, g, TrainParams(**{**FAST.to_json(), "rank_margin": -1.0}))
    assert eager.objective == "rank:pairwise" and eager.calibration[0] > 0
    ranked = train_booster(X, y, g, TrainParams(**{**FAST.to_json(), "objective": "rank:ndcg"}))
    assert ranked.objective == "rank:ndcg" and ranked.calibration[0] > 0
    # A ranking model still answers in microseconds through its calibration, which brings in the
    # workload's scale (floor time) without changing the order inside a workload.
    assert ranked.calibration_floor > 0
    card = {"objective": "rank:ndcg", "calibration": list(ranked.calibration),
            "calibration_floor": ranked.calibration_floor}
    us = CostModel(ranked.booster, card).predict(X)
    assert np.all(us > 0) and mape(y, us) < 0.4
    flat = CostModel(ranked.booster, {**card, "calibration_floor": 0.0}).predict(X)
    assert pairwise_accuracy(y, us, g) == pairwise_accuracy(y, flat, g)


def test_big_data_compares_objectives_on_a_workload_subsample(data):
    X, y, g, _ = data
    r = train_booster(X, y, g, TrainParams(**{**FAST.to_json(), "select_rows": 300}))
    assert set(r.tried) == {"reg:squarederror", "rank:pairwise"}
    assert all(v["train_rows"] < r.n_train / 2 for v in r.tried.values())
    # The winner is then trained on every training row.
    assert r.n_train + r.n_valid == len(y) and r.n_train > 1000
    # The model is the bag of early-stopped members, each cut at its best round.
    assert len(r.best_iterations) == FAST.bag and r.best_iterations[0] == r.best_iteration
    assert r.booster.num_boosted_rounds() == sum(i + 1 for i in r.best_iterations)


def test_average_boosters_predicts_the_mean_margin():
    rng = np.random.default_rng(0)
    X = rng.random((400, 6)).astype(np.float32)
    y = 3 * X[:, 0] - X[:, 1] ** 2 + 0.1 * rng.random(400)
    members = [xgb.train({"max_depth": 4, "eta": 0.3, "subsample": 0.7, "seed": s}, xgb.DMatrix(X, label=y),
                         num_boost_round=8 + s) for s in range(3)]
    mean = np.mean([predict_margin(b, X) for b in members], axis=0)
    merged = average_boosters(members)
    assert merged.num_boosted_rounds() == 8 + 9 + 10
    assert np.allclose(predict_margin(merged, X), mean, atol=1e-5)
    assert not np.allclose(predict_margin(members[0], X), mean, atol=1e-3)
    again = xgb.Booster()
    again.load_model(bytearray(merged.save_raw(raw_format="ubj")))
    assert np.array_equal(predict_margin(again, X), predict_margin(merged, X))
    assert average_boosters(members[:1]) is members[0]


def test_floor_relative_target_and_bag_of_one(data):
    X, y, g, _ = data
    reg = TrainParams(**{**FAST.to_json(), "objective": "reg:squarederror"})
    floor = train_booster(X, y, g, reg)
    # log(us) = margin + log(floor_us + 2.5): the calibration adds the workload's scale back.
    assert floor.calibration == (1.0, 0.0) and floor.calibration_floor == 1.0
    plain = train_booster(X, y, g, TrainParams(**{**reg.to_json(), "target": "log_us", "bag": 1}))
    assert plain.calibration_floor == 0.0 and len(plain.best_iterations) == 1
    assert plain.booster.num_boosted_rounds() == plain.best_iteration + 1
    Xh = hide_measured(X)
    for r in (floor, plain):
        us = predict_us(r.booster, Xh, r.objective, r.calibration, r.calibration_floor)
        assert mape(y, us) < 0.5 and pairwise_accuracy(y, us, g) > 0.7
    with pytest.raises(TrainError, match="unknown target"):
        TrainParams(target="latency")
    with pytest.raises(TrainError, match="must be at least 1"):
        TrainParams(bag=0)


def test_default_settings_and_the_member_round_cap(data):
    # Small data: depth 8 at eta 0.2, members of up to 200 rounds (at 100 every member of the
    # H200 card stopped at the cap; depth 10 at eta 0.1 with 300 rounds ranked held-out H200
    # workloads 0.006 better for a 7x larger model file and 4.5x the training time;
    # docs/costmodel.md); big data keeps cheaper settings for the 1M-row time budget.
    p = TrainParams()
    small = p.xgb_params("reg:squarederror", 40_000)
    assert (small["max_depth"], small["eta"], p.bag_rounds) == (8, 0.2, 200)
    big = p.xgb_params("reg:squarederror", LARGE_DATA)
    assert big["max_depth"] < small["max_depth"] and big["eta"] > small["eta"] and big["subsample"] <= 0.5
    # Every bag member stops at bag_rounds even when its validation error still falls.
    X, y, g, _ = data
    capped = TrainParams(**{**FAST.to_json(), "objective": "reg:squarederror", "bag": 3, "bag_rounds": 4,
                            "eta": 0.05})
    r = train_booster(X, y, g, capped)
    assert len(r.best_iterations) == 3 and all(i == 3 for i in r.best_iterations)
    assert r.booster.num_boosted_rounds() == 12


def test_near_best_members_learn_the_fast_end_and_join_the_bag(data):
    X, y, g, _ = data
    base = TrainParams(**{**FAST.to_json(), "objective": "reg:squarederror", "bag": 2, "bag_rounds": 20})
    r = train_booster(X, y, g, replace(base, near_best_members=2, near_best_gap=0.3))
    assert len(r.best_iterations) == 4  # two members on every row, two on the near-best rows
    assert r.calibration == (1.0, 0.0) and r.calibration_floor == 1.0
    # The near-best rows: within 30 % of their workload's best, every workload keeps its best.
    log_y = np.log(y)
    codes = np.unique(g, return_inverse=True)[1]
    near = _near_best(log_y, codes, 0.3)
    best = np.full(codes.max() + 1, np.inf)
    np.minimum.at(best, codes, y)
    assert np.all(y[near] <= best[codes[near]] * 1.3 + 1e-9)
    assert set(codes[near]) == set(codes) and len(near) < len(y)
    us = predict_us(r.booster, hide_measured(X), r.objective, r.calibration, r.calibration_floor)
    assert mape(y, us) < 0.5 and pairwise_accuracy(y, us, g) > 0.7
    with pytest.raises(TrainError, match="near_best_members"):
        TrainParams(near_best_members=-1)
    with pytest.raises(TrainError, match="near_best_gap"):
        TrainParams(near_best_gap=0.0)


def test_combine_boosters_sums_the_mean_margin_of_each_group():
    rng = np.random.default_rng(1)
    X = rng.random((300, 5)).astype(np.float32)
    y = 2 * X[:, 0] + X[:, 2] ** 2
    train = [xgb.train({"max_depth": 3, "eta": 0.3, "subsample": 0.7, "seed": s}, xgb.DMatrix(X, label=y),
                       num_boost_round=5 + s) for s in range(4)]
    merged = combine_boosters([train[:3], train[3:]])
    want = np.mean([predict_margin(b, X) for b in train[:3]], axis=0) + predict_margin(train[3], X)
    assert merged.num_boosted_rounds() == 5 + 6 + 7 + 8
    assert np.allclose(predict_margin(merged, X), want, atol=1e-5)


def test_target_over_best_adds_a_level_from_workload_facts_only(data):
    X, y, g, _ = data
    p = TrainParams(**{**FAST.to_json(), "objective": "reg:squarederror", "bag": 2, "bag_rounds": 30,
                       "target": "log_over_best", "level_members": 2})
    r = train_booster(X, y, g, p)
    assert r.calibration == (1.0, 0.0) and r.calibration_floor == 1.0
    assert len(r.best_iterations) == 2 and len(r.level_iterations) == 2
    n_bag = sum(i + 1 for i in r.best_iterations)
    assert r.booster.num_boosted_rounds() == n_bag + sum(i + 1 for i in r.level_iterations)
    # The level trees (last) split on workload facts alone: they add one value per workload.
    doc = json.loads(bytes(r.booster.save_raw(raw_format="json")))
    trees = doc["learner"]["gradient_booster"]["model"]["trees"]
    level = {f for t in trees[n_bag:]
             for f, child in zip(t["split_indices"], t["left_children"]) if child != -1}
    assert level and level <= {feature_index(n) for n in WORKLOAD_LEVEL_FEATURES}
    us = predict_us(r.booster, hide_measured(X), r.objective, r.calibration, r.calibration_floor)
    assert mape(y, us) < 0.5 and pairwise_accuracy(y, us, g) > 0.7
    with pytest.raises(TrainError, match="level_members"):
        TrainParams(level_members=0)


def test_binned_ranking_labels_tie_candidates_within_a_step():
    log_us = np.log([10.0, 10.1, 10.5, 12.0, 5.0, 5.05, 9.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1])
    rel = _relevance(log_us, groups, 0.02)
    # 10 and 10.1 (1 % apart) share a label, 10.5 is two steps down, 12 further; per workload.
    assert rel[0] == rel[1] > rel[2] > rel[3] == 0 and rel[4] == rel[5] > rel[6] == 0
    plain = _relevance(log_us, groups)
    assert plain[0] > plain[1] and plain[4] > plain[5]  # continuous labels: every pair trains
    with pytest.raises(TrainError, match="rank_bin"):
        TrainParams(rank_bin=-0.1)


def test_train_rejects_bad_input(data):
    X, y, g, _ = data
    with pytest.raises(TrainError, match="finite and positive"):
        train_booster(X[:10], np.r_[y[:9], -1.0], g[:10])
    with pytest.raises(TrainError, match="do not match"):
        train_booster(X[:10], y[:9], g[:10])
    with pytest.raises(TrainError, match="unknown objective"):
        TrainParams(objective="reg:nonsense")
    with pytest.raises(TrainError, match="cpu or cuda"):
        TrainParams(device="tpu")


def test_op_and_shape_come_from_suite_workload_names():
    ops, shapes = op_and_shape(["add_layernorm_8192x128_f16", "eltwise_chain8_235x1975_bf16",
                                "softmax_64x4099", "my graph"])
    assert ops.tolist() == ["add_layernorm", "eltwise_chain8", "softmax", "my graph"]
    assert shapes.tolist() == ["8192x128", "235x1975", "64x4099", "my graph"]


def test_each_split_holds_its_label_out_of_training(frame):
    labels = Labels.of(frame["workload_hash"], names=frame["workload_name"].to_pylist(),
                       family=frame["family"].to_pylist())
    for split, key in (("by_workload", "workload"), ("leave_op_out", "op"),
                       ("leave_shape_out", "shape"), ("leave_family_out", "family")):
        folds = split_folds(labels, split, 3)
        assert len(folds) == 3, split
        held = np.concatenate([te for _, te in folds])
        assert sorted(held.tolist()) == list(range(frame.num_rows)), split  # every row once
        for tr, te in folds:
            v = getattr(labels, key)
            assert not set(v[tr].tolist()) & set(v[te].tolist()), split
    assert split_folds(Labels.of(np.arange(6) // 2), "leave_op_out", 3) == []  # no op labels
    with pytest.raises(TrainError, match="unknown split"):
        split_folds(labels, "leave_dtype_out", 3)


def test_evaluate_splits_scores_every_split_and_each_family(frame, data):
    X, y, g, fam = data
    keep = np.isin(fam, ["softmax", "norm", "col_reduce"])
    t = frame.filter(pa.array(keep))
    labels = Labels.of(t["workload_hash"], names=t["workload_name"].to_pylist(),
                       family=t["family"].to_pylist(), lo=t["p20_us"].to_numpy(), hi=t["p80_us"].to_numpy())
    ev = evaluate_splits(X[keep], y[keep], labels, replace(FAST, bag=1), folds=3)
    assert set(ev) == {*SPLITS, "baselines"}
    for split in SPLITS:
        assert set(METRIC_KEYS) <= set(ev[split]) and ev[split]["rows"] == keep.sum(), split
        assert np.isfinite(ev[split]["pred"]).all(), split
        # A model that never saw the op (shape, family) still orders better than chance.
        assert ev[split]["pairwise_accuracy"] > ev["baselines"]["random"]["pairwise_accuracy"], split
    fams = ev["leave_family_out"]["families"]
    assert set(fams) == {"softmax", "norm", "col_reduce"}
    assert sum(v["rows"] for v in fams.values()) == keep.sum()


@pytest.mark.slow  # the module's fitted model (15 s of training) is built for these three
def test_fit_saves_card_and_booster(fitted, frame):
    model, metrics, where, root = fitted
    assert where == model_dir(root, "NVIDIA H200", "fusion") == root / "nvidia-h200" / "fusion"
    assert (where / MODEL_FILE).is_file() and (where / CARD_FILE).is_file()
    card = json.loads((where / CARD_FILE).read_text())
    assert card["feature_schema_version"] == FEATURE_SCHEMA_VERSION
    assert card["feature_names"] == list(FEATURE_NAMES)
    assert card["device_name"] == "NVIDIA H200" and card["kind"] == "fusion"
    assert card["data"]["rows"] == frame.num_rows and card["data"]["hash"] == data_snapshot_hash(frame)
    assert card["objective"] in ("reg:squarederror", "rank:pairwise")
    assert card["hyperparameters"]["max_depth"] == 6 and card["created_at"] and card["tunedb_version"]
    for split in SPLITS:
        for key in METRIC_KEYS:
            assert 0 <= card["metrics"][split][key] <= 1.5, (split, key)
        assert card["metrics"][split]["folds"] == 3
    for key in METRIC_KEYS:  # the headline is the by_workload split
        assert card["metrics"][key] == card["metrics"]["by_workload"][key]
    assert set(card["metrics"]["baselines"]) == {"roofline", "random"}
    assert len(card["metrics"]["leave_family_out"]["families"]) == 10
    assert list_models(root) == [where]


@pytest.mark.slow
def test_save_load_round_trip_gives_identical_predictions(fitted, frame, data, tmp_path):
    model, _, where, root = fitted
    X = data[0]
    loaded = load_model(where)
    assert loaded.card == model.card
    assert np.array_equal(loaded.predict(X), model.predict(X))
    assert np.array_equal(loaded.predict(frame.slice(0, 50)), model.predict(X[:50]))
    assert np.array_equal(find_model(root, "NVIDIA H200").predict(X[:7]), model.predict(X[:7]))
    assert np.array_equal(load_model(where / CARD_FILE).predict(X[:3]), model.predict(X[:3]))
    # Predictions are latencies of the right magnitude, also with compile facts hidden.
    y = data[1]
    ratio = loaded.predict(hide_measured(X)) / y
    assert 0.5 < np.median(ratio) < 2.0
    again = save_model(loaded, tmp_path / "copy")
    assert np.array_equal(load_model(again).predict(X), model.predict(X))


@pytest.mark.slow
def test_load_refuses_other_feature_schema(fitted, tmp_path):
    model, _, _, _ = fitted
    old = CostModel(model.booster, {**model.card, "feature_schema_version": FEATURE_SCHEMA_VERSION - 1})
    d = save_model(old, tmp_path / "old")
    with pytest.raises(CostModelError, match=f"trained with feature schema v{FEATURE_SCHEMA_VERSION - 1}, "
                                             f"this tunedb uses v{FEATURE_SCHEMA_VERSION}; retrain"):
        load_model(d)
    renamed = list(FEATURE_NAMES)
    renamed[3] = "something_else"
    d2 = save_model(CostModel(model.booster, {**model.card, "feature_names": renamed}), tmp_path / "renamed")
    with pytest.raises(CostModelError, match="other feature names.*'something_else'"):
        load_model(d2)


@pytest.mark.slow
def test_load_errors_are_one_line(fitted, tmp_path):
    model, _, where, _ = fitted
    with pytest.raises(CostModelError, match="no model card"):
        load_model(tmp_path / "nothing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / CARD_FILE).write_text("{oops")
    with pytest.raises(CostModelError, match="cannot read model card"):
        load_model(bad)
    nobooster = save_model(model, tmp_path / "nb")
    (nobooster / MODEL_FILE).unlink()
    with pytest.raises(CostModelError, match="no booster beside it"):
        load_model(nobooster)
    corrupt = save_model(model, tmp_path / "corrupt")
    (corrupt / MODEL_FILE).write_bytes(b"not a model")
    with pytest.raises(CostModelError, match="cannot read booster") as e:
        load_model(corrupt)
    assert "\n" not in str(e.value)
    with pytest.raises(CostModelError, match="shape"):
        model.predict(np.zeros((2, 3)))
    with pytest.raises(CostModelError, match="lacks column"):
        model.predict(pa.table({"x": [1]}))
    assert slug("NVIDIA H200 (SXM) ") == "nvidia-h200-sxm"
    with pytest.raises(CostModelError):
        slug("!!")


def test_clean_frame_keeps_ok_rows_once_per_candidate():
    t = pa.table({
        "workload_hash": ["w"] * 5, "graph_json": ["{}"] * 5, "config_json": ["{}"] * 5,
        "candidate_hash": ["a", "a", "a", "b", "c"], "device_id": ["d"] * 5,
        "status": ["ok", "ok", "ok", "ok", "timeout"],
        "median_us": pa.array([3.0, 1.0, 2.0, None, 5.0]),
    })
    out = clean_frame(t)
    assert out.num_rows == 1 and out["median_us"].to_pylist() == [2.0]
    with pytest.raises(CostModelError, match="lacks column"):
        clean_frame(t.drop(["device_id"]))
    # The snapshot hash does not depend on row order.
    f = clean_frame(synthetic_frame(6, 5, seed=2))
    assert data_snapshot_hash(f) == data_snapshot_hash(f.take(pa.array(np.arange(f.num_rows)[::-1])))
    assert data_snapshot_hash(f) != data_snapshot_hash(f.slice(1))


def test_monotone_regression_never_gets_faster_with_more_traffic(data):
    from tunedb.costmodel.train import MONOTONE, predict_us

    X, y, g, _ = data
    params = replace(FAST, objective="reg:squarederror", bag=1, num_boost_round=40, monotone=True)
    assert TrainParams.from_json(params.to_json()).monotone  # recorded on the card
    res = train_booster(X, y, g, params)
    rows = X[:50].copy()
    for name, sign in MONOTONE.items():
        j = FEATURE_NAMES.index(name)
        lo, hi = rows.copy(), rows.copy()
        lo[:, j] = np.quantile(X[:, j], 0.1)
        hi[:, j] = np.quantile(X[:, j], 0.9)
        p_lo, p_hi = (predict_us(res.booster, r, res.objective, res.calibration, res.calibration_floor)
                      for r in (lo, hi))
        # floor_us (the calibration base) is not among them, so only the trees move the latency
        assert np.all(sign * (p_hi - p_lo) >= -1e-6 * p_lo), name
    # ranking objectives take no constraints (their margins are per-workload orders)
    assert "monotone_constraints" not in params.xgb_params("rank:pairwise", 100)

"""Cost model kind packing: features from records, trained and judged on held-out workloads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tunedb.costmodel.packing import (
    FEATURE_SCHEMA,
    FEATURES,
    evaluate,
    features,
    fit,
    load_frame,
    predict_us,
    save,
)
from tunedb.kernels.packing import candidates
from tunedb.kernels.packing_suites import bench_cases

DATA = Path(__file__).resolve().parent.parent / "data" / "packing_h200"


def test_features_follow_the_candidate():
    w = next(c for c in bench_cases() if c.family == "lora")
    rows = {c.name: features(w, c) for c in candidates(w)}
    assert all(tuple(r) == FEATURES for r in rows.values())
    assert rows["whole:serial"]["launches"] == len(w.members)
    assert rows["whole:padded"]["launches"] == 1
    assert rows["whole:padded"]["waste"] > 0.8 and rows["whole:serial"]["waste"] == 0.0
    assert rows["whole:streams8"]["lanes"] == 8
    # the workload's own features are the same for every candidate
    assert len({r["log_flops"] for r in rows.values()}) == 1


@pytest.mark.slow
def test_held_out_choice_beats_the_fixed_rule_on_shipped_data(tmp_path):
    frame = load_frame(DATA)
    n = len(np.unique(frame["groups"]))
    assert n >= 200 and frame["X"].shape[1] == len(FEATURES)
    res = evaluate(frame, folds=3, splits=("by_workload",))
    bw = res["by_workload"]
    assert bw["workloads"] == n
    # measured on workloads the model never saw: better than one fixed rule for everything
    assert bw["model_geomean_ratio"] < bw["rule_geomean_ratio"]
    out = save(fit(frame["X"], frame["y"], frame["groups"]), tmp_path / "m", frame, res)
    card = json.loads((out / "card.json").read_text())
    assert card["kind"] == "packing" and card["feature_schema"] == FEATURE_SCHEMA
    import xgboost as xgb

    b = xgb.Booster()
    b.load_model(str(out / "model.ubj"))
    assert np.all(predict_us(b, frame["X"][:5]) > 0)


def test_train_cli_is_the_one_entry_point_and_fails_in_one_line(tmp_path):
    """`tunedb train --kind packing` trains the kind (the module has no main of its own); a
    database whose packing rows all failed gets a one-line error and keeps its rows."""
    import uuid

    from typer.testing import CliRunner

    import tunedb.costmodel.packing as packing
    from collectors.packing_ingest import store_results
    from tunedb.cli import app
    from tunedb.records import DeviceInfo
    from tunedb.store.core import TuningStore

    assert not hasattr(packing, "main")
    w = next(c for c in bench_cases() if c.family == "lora")
    rows = [{"system": "tunedb", "status": "error", "candidate": c.to_json(), "error": "out of memory"}
            for c in candidates(w)[:3]]
    db = tmp_path / "failed.duckdb"
    dev = DeviceInfo("NVIDIA H200", "b0", "9.0", 132, 60 << 20, 141 << 30, "13.0", "13.0", "14.2.0")
    store_results(db, {"results": [{"workload": w.to_json(), "rows": rows}], "samples": 5}, dev,
                  {"test": str(uuid.uuid4())})
    out = str(tmp_path / "m")
    res = CliRunner().invoke(app, ["train", "--db", str(db), "--kind", "packing", "--out", out])
    assert res.exit_code != 0 and len(res.output.strip().splitlines()) == 1, res.output
    with TuningStore.open(db) as store:
        assert len(store.measurements()) == 3 and store.models() == []


def test_ranker_orders_and_regression_scales_one_workloads_candidates(tmp_path):
    from tunedb.costmodel.packing import GRADES, PackingModel, load_predictor, relevance

    rng = np.random.default_rng(0)
    ws = [w for w in bench_cases() if w.family in ("replicas", "moe")]
    X, y, g = [], [], []
    for w in ws:  # a synthetic truth: time grows with launches and waste
        for c in candidates(w):
            f = features(w, c)
            X.append([f[k] for k in FEATURES])
            y.append(f["launches"] * 3.0 + 50 * f["waste"] + rng.uniform(0, 0.1))
            g.append(w.hash)
    X, y, g = np.asarray(X, np.float32), np.asarray(y), np.asarray(g)
    rel = relevance(y, g)
    assert rel.max() == GRADES and rel.min() >= 0
    assert all(rel[g == h][np.argmin(y[g == h])] == GRADES for h in set(g))
    model = fit(X, y, g)
    assert isinstance(model, PackingModel) and model.rank is not None
    pred = predict_us(model, X, g)
    for h in set(g):  # per workload: the regression's own times, in the ranker's order
        idx = np.flatnonzero(g == h)
        assert np.allclose(np.sort(pred[idx]), np.sort(predict_us(model.reg, X[idx])))
    out = save(model, tmp_path / "m", {"X": X, "y": y, "groups": g, "families": g, "names": g}, {},
               "NVIDIA H200")
    assert {p.name for p in out.iterdir()} == {"model.ubj", "rank.ubj", "card.json"}
    predict = load_predictor(out)
    w = ws[0]
    idx = np.flatnonzero(g == w.hash)
    assert np.allclose(predict(w, candidates(w)), pred[idx])
    card = json.loads((out / "card.json").read_text())
    card["feature_schema"] = "packing/1"
    (out / "card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="schema 'packing/1'"):
        load_predictor(out)


def test_measure_top_replay_spends_at_most_the_budget_beyond_first_picks():
    from tunedb.costmodel.packing import measure_top_replay

    y = np.array([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4)
    g = np.repeat(np.arange(4), 10)
    exact = measure_top_replay(y, y.copy(), g)
    assert exact == {"reaches_best": 1.0, "within_5pct": 1.0, "measured_share": 0.1}
    wrong = measure_top_replay(y, -y, g)  # the model's first pick is the slowest everywhere
    assert wrong["reaches_best"] == 0.0 and wrong["measured_share"] == 0.1
    # a budget above one per workload goes to the closest calls first
    pred = y.copy()
    pred[g == 2] = [1.01, 1.0, 3, 4, 5, 6, 7, 8, 9, 10]  # a close call: its second pick is measured
    half = measure_top_replay(y, pred, g, share=0.125)
    assert half["reaches_best"] == 1.0 and half["measured_share"] == 0.125
    # over a candidate space of 20 per workload (10 stored): 10 % is two picks each
    space = {k: 20 for k in range(4)}
    wide = measure_top_replay(y, pred, g, space={str(k): v for k, v in space.items()})
    assert wide["measured_share"] == 8 / 80 and wide["reaches_best"] == 1.0
    second = y.copy()
    second[g == 1] = [2.0, 1, 3, 4, 5, 6, 7, 8, 9, 10]  # the best is the model's second pick
    assert measure_top_replay(y, second, g)["reaches_best"] == 0.75
    assert measure_top_replay(y, second, g, space={str(k): 20 for k in range(4)})["reaches_best"] == 1.0


def test_layout_and_split_k_features_follow_the_candidate():
    """B read transposed flips with padded_t; split-K only for single GEMMs whose tiles do not
    fill the SMs; both are features of the shipped schema."""
    from tunedb.costmodel.packing import layout_features, splitk_features
    from tunedb.kernels.packing import Member, PackingWorkload

    nt = PackingWorkload("qkv", "t", tuple(Member(128, 768, 768, layout="nt") for _ in range(3)))
    by_name = {c.name: c for c in candidates(nt)}
    assert layout_features(nt, by_name["whole:padded"])["trans_b_share"] == 1.0
    assert layout_features(nt, by_name["whole:padded_t"])["trans_b_share"] == 0.0
    assert layout_features(nt, by_name["whole:padded"])["part_whole"] == 1.0
    small = PackingWorkload("r2", "t", (Member(256, 128, 1152), Member(256, 128, 1152)))
    by_name = {c.name: c for c in candidates(small)}
    assert splitk_features(small, by_name["whole:serial"])["mean_split"] == 4  # 2 tiles, k 1152: 4 ways
    assert splitk_features(small, by_name["whole:padded"])["mean_split"] == 1
    serial = features(small, by_name["whole:serial"])
    assert serial["est_splitk_us"] < serial["est_wave_us"]
    assert {"trans_b_share", "est_splitk_us"} <= set(FEATURES)


def test_traffic_and_relative_features_see_what_padding_reads():
    """A LoRA-like set of uneven m: the padded stack reads the activations padded to the largest
    m, concat reads them once; relative estimates are 0 for the workload's best estimate."""
    from tunedb.costmodel.packing import REL_KEYS, moved_bytes, traffic_features
    from tunedb.kernels.packing import Member, PackingWorkload

    ms = tuple(Member(m, 16, 4096, dtype="bfloat16") for m in (380, 210, 120, 40))
    w = PackingWorkload("lora", "t", ms)
    by_name = {c.name: c for c in candidates(w)}
    assert moved_bytes(ms, "padded") == 2 * 4 * (380 * 4096 + 4096 * 16 + 380 * 16)
    assert moved_bytes(ms, "concat") == 2 * (750 * 4096 + 4096 * 64 + 750 * 64)
    assert moved_bytes(ms, "serial") == sum(x.bytes() for x in ms)
    pad, cat = (traffic_features(w, by_name[n]) for n in ("whole:padded", "k:concat"))
    assert pad["est_moved_us"] > cat["est_moved_us"] and pad["moved_over_bytes"] > 1.5
    from tunedb.kernels.packing import all_candidates

    rel = [features(w, c) for c in all_candidates(w)]  # packing/6: over every kind of candidate
    for k in REL_KEYS:
        assert min(r[f"rel_{k}"] for r in rel) == 0.0
        assert all(r[f"rel_{k}"] >= 0.0 for r in rel)


def test_board_labels_judge_a_workload_on_one_board_basis():
    """Two boards 10 % apart: the one that measured part of a workload is scaled to the one that
    measured most of it (the reference) on the candidates both measured, so a candidate only the
    slower board measured keeps its place among the rest; a board's repeated runs count once; a
    board sharing too few candidates with the reference is scaled to the boards already joined
    where it shares enough with them, else left out of that workload."""
    from tunedb.costmodel.packing import board_labels

    def band(us: float) -> tuple[float, float, float]:
        return (0.99 * us, us, 1.01 * us)

    truth = {"a": 10.0, "b": 11.0, "c": 12.0, "d": 9.8}
    times = {c: {"part": [band(t)]} for c, t in truth.items() if c != "d"}
    for c in ("a", "b", "c", "d"):  # 10 % slower, and d only here
        times.setdefault(c, {})["full"] = [band(1.1 * truth[c])]
    times["a"]["part"].append(band(10.2))  # two runs on one board: their median, once
    times["e"] = {"lone": [band(5.0)]}  # sharing nothing with w1's reference
    times["f"], times["g"] = {"part": [band(7.0)]}, {"part": [band(8.0)]}
    of = {c: "w0" for c in "abcd"} | {"e": "w1", "f": "w1", "g": "w1"}
    labels = board_labels(times, of)
    # d, 2 % faster than a on the slower board, stays faster (a median over boards: 6 % slower)
    a = labels["a"][1]
    assert labels["d"][1] / a == pytest.approx(9.8 / (10.1 * 10) ** 0.5)
    assert labels["b"][1] / a == pytest.approx(11 / (10.1 * 10) ** 0.5)
    assert labels["c"][1] / labels["b"][1] == pytest.approx(12 / 11)
    assert labels["b"][0] < labels["b"][1] < labels["b"][2]
    assert "e" not in labels and labels["f"][1] == pytest.approx(7.0)
    # one board alone: its own times
    assert board_labels({"x": {"b": [band(3.0), band(5.0), band(4.0)]}}, {"x": "w"})["x"][1] == 4.0
    # chained: "late" shares only a with the reference ("full", 6 candidates) but a, x, y with
    # "part", which joined: scaled to the joined labels (20 % slow), its own i keeps its place
    chain = {c: {k: list(v) for k, v in b.items()} for c, b in times.items() if c in "abcd"}
    chain |= {"h": {"full": [band(14.3)]}, "j": {"full": [band(15.4)]},
              "x": {"part": [band(9.5)]}, "y": {"part": [band(10.5)]}}
    for c, t in (("a", 10.0), ("x", 9.5), ("y", 10.5), ("i", 9.0)):
        chain.setdefault(c, {})["late"] = [band(1.2 * t)]
    got = board_labels(chain, dict.fromkeys(chain, "w0"))
    assert got["i"][1] / got["x"][1] == pytest.approx(9.0 / 9.5, rel=0.01)
    # needing 4 in common: part (a, b, c with full) is out, and late with it
    assert set(board_labels(chain, dict.fromkeys(chain, "w0"), min_common=4)) == set(chain) - set("ixy")


def test_splitk_and_chunks_features_carry_their_parameters():
    """packing/6: the split-K and chunked candidates' slices, rows, partials and launches enter
    the features, and two candidates that differ only there differ in them."""
    from tunedb.costmodel.packing import FEATURE_SCHEMA, launch_tiles, moved_bytes
    from tunedb.costmodel.packing_features import partial_bytes
    from tunedb.kernels.packing import Cluster, Member, PackingWorkload, all_candidates

    assert FEATURE_SCHEMA == "packing/6"
    ms = tuple(Member(256, 128, 1152) for _ in range(20))
    w = PackingWorkload("r20", "replicas", ms)
    assert launch_tiles(ms, "splitk", split=3) == [(40 * 3, 384)]
    assert launch_tiles(ms, "padded") == [(40, 1152)]
    assert partial_bytes(ms, Cluster(tuple(range(20)), "splitk", split=3)) == 2 * 4 * 3 * 20 * 256 * 128
    assert moved_bytes(ms, "splitk", 3) == moved_bytes(ms, "padded") + 2 * 4 * 3 * 20 * 256 * 128
    by = {c.name: features(w, c) for c in all_candidates(w)}
    s3, s8, pad = by["whole:splitk3"], by["whole:splitk8"], by["whole:padded"]
    assert s3["share_splitk"] == 1.0 and s3["split_max"] == 3 and s3["launches"] == 2
    assert s3["est_wave_us"] < pad["est_wave_us"] and s3 != s8
    tenants = PackingWorkload("bert", "t", tuple(Member(m, 768, 768, dtype="bfloat16", layout="nt")
                                               for m in (16, 48, 128, 384)))
    ch = {c.name: features(tenants, c) for c in all_candidates(tenants)}
    c64, c128 = ch["whole:chunks64"], ch["whole:chunks128"]
    assert c64["share_chunks"] == 1.0 and c64["log_chunk_rows"] == 6.0 and c128["log_chunk_rows"] == 7.0
    # chunks pad each member to whole chunks; padded pads all to 384 rows
    assert c64["waste"] < c128["waste"] < ch["whole:padded"]["waste"]
    assert moved_bytes(tenants.members, "chunks", rows=64) < moved_bytes(tenants.members, "padded")

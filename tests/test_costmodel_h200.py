"""The cost model on the shipped H200 fusion measurements (the Parquet export under data/) and
the shipped model (models/nvidia-h200/fusion).

Held-out evaluation (5-fold GroupKFold by workload) must stay within a small margin of what the
shipped training reached (the held-out metrics on the shipped model's card, read here, not copied)
and beat both baselines on every metric. Issue 22's targets (by workload: top-1 >= 0.975, decisive
pairs >= 0.95, top-1 within 2 % on >= 70 % of workloads) are recorded as an expected failure until
a model reaches them. They are below the noise ceiling: the first dataset's board re-measuring
the same 21,939 candidates scores 0.991-0.994 / 0.987-0.992 / 0.90 against this one, and this
board's own samples split in two 0.993-0.995 / 0.996-0.997 / 0.85-0.92
(benchmarks/noise_ceiling.py --split-samples, docs/costmodel-metrics.md).
The data is data/fusion_h200_v2 (one board, every candidate of a workload timed the same way);
set TUNEDB_H200_EXPORT to evaluate another export directory (its H200 with the most
measurements). The model in models/ is trained on data/fusion_h200_v2 (tests/test_costmodel_boards.py
covers training on several boards, with the first dataset's shards).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tunedb.costmodel.features import DeviceFacts
from tunedb.costmodel.fit import clean_frame, fit_frame
from tunedb.costmodel.registry import data_snapshot_hash, load_model
from tunedb.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "models" / "nvidia-h200" / "fusion"


def _exports() -> list[Path]:
    given = os.environ.get("TUNEDB_H200_EXPORT")
    export = Path(given) if given else ROOT / "data" / "fusion_h200_v2"
    manifests = [export / "manifest.json"]
    out = []
    for m in manifests:
        try:
            manifest = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        if manifest.get("counts", {}).get("measurements", 0) > 0:
            out.append(m.parent)
    return out


EXPORTS = _exports()
needs_data = pytest.mark.skipif(not EXPORTS, reason="no shipped Parquet export with measurements under data/")


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    with TuningStore.open(tmp_path_factory.mktemp("h200") / "h200.duckdb") as store:
        for d in EXPORTS:
            store.import_parquet(d)
        devices = [d for d in store.devices() if "H200" in d.name]
        if not devices:
            pytest.skip("the shipped exports hold no H200 measurements")
        # One model per board: the board with the most measurements (other boards' shards may
        # sit in the same export).
        frames = [(store.training_frame(kind="fusion", device_id=d.id), d) for d in devices]
        frame, device = max(frames, key=lambda fd: fd[0].num_rows)
    if frame.num_rows == 0:
        pytest.skip("no ok fusion measurements on the H200")
    return frame, DeviceFacts.from_device_info(device)


SHIPPED_DATA = [ROOT / "data" / "fusion_h200_v2"]


@pytest.fixture(scope="module")
def shipped_frame(tmp_path_factory):
    """Every H200 board's measurements in the shards the shipped model is trained on."""
    if not all((d / "manifest.json").is_file() for d in SHIPPED_DATA):
        pytest.skip("the shipped model's shards are not under data/")
    with TuningStore.open(tmp_path_factory.mktemp("shipped") / "shipped.duckdb") as store:
        for d in SHIPPED_DATA:
            store.import_parquet(d)
        return store.training_frame(kind="fusion")


@pytest.fixture(scope="module")
def held_out(h200):
    frame, facts = h200
    return fit_frame(frame, device=facts, folds=5, lofo=False)[1]


@needs_data
def test_shipped_model_matches_the_shipped_data(shipped_frame):
    frame = shipped_frame
    if not SHIPPED_MODEL.is_dir():
        pytest.skip("no shipped H200 model")
    model = load_model(SHIPPED_MODEL)
    clean = clean_frame(frame)
    assert model.card["data"]["hash"] == data_snapshot_hash(clean), \
        "models/nvidia-h200/fusion was trained on other data; retrain with 'tunedb train'"
    boards = {b: clean["device_id"].to_pylist().count(b) for b in set(clean["device_id"].to_pylist())}
    # the card names its boards when it learned from several; one board is the row count
    assert model.card["data"].get("boards", boards) == boards
    assert model.card["data"]["rows"] == sum(boards.values())
    # The data holds schedules that differ only in grid (wave vs full); held out, the model
    # orders them better than a coin (the roofline cannot tell them apart).
    grid = model.card["metrics"]["grid_pairs"]
    assert grid["model"]["pairs"] > 10_000 and grid["model"]["accuracy"] > grid["roofline"]["accuracy"] + 0.1
    us = model.predict(clean)
    assert np.all(np.isfinite(us)) and np.all(us > 0)
    assert model.card["metrics"]["pairwise_accuracy"] > model.card["metrics"]["baselines"]["random"][
        "pairwise_accuracy"] + 0.3


# How far a retraining may fall below the card's held-out metrics (seeds and library versions
# move them by about 0.002; a lost feature or a broken split costs more than these margins).
CARD_MARGIN = {"pairwise_accuracy": 0.012, "top1_score": 0.01, "top5_score": 0.005, "spearman": 0.03}


@pytest.mark.slow
@needs_data
def test_h200_held_out_metrics_beat_baselines(held_out):
    m = held_out
    if not SHIPPED_MODEL.is_dir():
        pytest.skip("no shipped H200 model")
    card = json.loads((SHIPPED_MODEL / "card.json").read_text())["metrics"]
    for key, margin in CARD_MARGIN.items():
        assert m[key] >= card[key] - margin, (key, m[key], card[key])
    assert m["mape"] <= card["mape"] * 1.25, (m["mape"], card["mape"])
    # most pairs lie further apart than their run-to-run spread, and those the model orders better
    d = m["by_workload"]
    assert 0.8 < d["decisive_pair_share"] < 1.0, d
    assert d["decisive_pair_accuracy"] >= m["pairwise_accuracy"] + 0.01, d
    if "by_workload" in card:  # a card with the split metrics
        # The pick within 2 % moves in steps of one workload (0.0023) and is the most sensitive to
        # the build: the shipped card comes from the xgboost-cpu wheel CI installs (0.552); the
        # xgboost wheel of the same version 3.2.0 scores 0.584 on the same recipe and data.
        for key, margin in (("decisive_pair_accuracy", 0.02), ("top1_within_2pct", 0.02)):
            assert d[key] >= card["by_workload"][key] - margin, (key, d[key], card["by_workload"][key])
    for base in ("roofline", "random"):
        b = m["baselines"][base]
        assert m["pairwise_accuracy"] > b["pairwise_accuracy"] + 0.3
        assert m["top1_score"] > b["top1_score"] + 0.2
        assert m["top5_score"] > b["top5_score"] + 0.05
        assert m["spearman"] > b["spearman"] + 0.5
        assert m["mape"] < b["mape"] / 2


@pytest.mark.slow
@needs_data
@pytest.mark.xfail(reason="issue 22's targets not reached: by workload the shipped model scores top-1 0.967 "
                   "(>= 0.975), decisive pairs 0.922 (>= 0.95), pick within 2 % 0.552 (>= 0.70); retrained "
                   "with fusion_h200_breadth (448 more workloads, every schedule measured) and scored on "
                   "the same workloads 0.965 / 0.915 / 0.533 (members of 100 rounds), 0.967 / 0.925 / 0.584 "
                   "(300 rounds): new off-grid workloads did not give the grid's learning curve "
                   "(docs/costmodel-metrics.md); noise ceiling 0.99 / 0.99 / 0.85-0.99",
                   strict=False)
def test_h200_held_out_metrics_meet_project_targets(held_out):
    m = held_out["by_workload"]
    assert m["top1_score"] >= 0.975
    assert m["decisive_pair_accuracy"] >= 0.95
    assert m["top1_within_2pct"] >= 0.70

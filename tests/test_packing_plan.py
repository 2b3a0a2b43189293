"""Packing opportunities inside real graphs and across tenants; the choice must pay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.onnx_import import import_onnx
from tunedb.kernels.packing import Member
from tunedb.plan.packing import choose, graph_workloads, pack_tenants

GRAPHS = Path(__file__).resolve().parent.parent / "data" / "graphs"


def test_bert_qkv_and_inception_branches_are_found():
    (qkv,) = graph_workloads(import_onnx(GRAPHS / "bert_layer.onnx"), "bert")
    assert [(m.m, m.n, m.k) for m in qkv.members] == [(128, 768, 768)] * 3
    assert len({m.weight for m in qkv.members}) == 3  # three weights, none shared
    first, second = graph_workloads(import_onnx(GRAPHS / "inception_mixed_5b.onnx"), "incep")
    assert sorted(m.n for m in first.members) == [32, 48, 64, 64]  # the four 1x1 branch convs
    assert {m.kind for m in first.members} == {"conv"} and {m.k for m in first.members} == {192}
    assert sorted((m.n, m.k) for m in second.members) == [(64, 1200), (96, 576)]  # 5x5 and 3x3
    assert graph_workloads(import_onnx(GRAPHS / "gpt2_block.onnx"), "gpt2") == []  # QKV fused


def test_pack_tenants_keeps_weights_per_tenant():
    layer = [Member(64, 128, 256, weight="w1", label="fc"), Member(64, 128, 256, weight="w2")]
    w = pack_tenants([layer, layer], "two")
    assert len(w.members) == 4 and len({m.weight for m in w.members}) == 4
    assert w.members[2].label == "t1.fc"


def test_choice_without_a_model_is_the_rule():
    w = pack_tenants([[Member(64, 128, 256)]] * 4, "four")
    cand, ranking = choose(w)
    assert cand.name == "whole:padded" and ranking == [("whole:padded", None)]


def test_choice_keeps_serial_unless_packing_pays():
    w = pack_tenants([[Member(64, 128, 256)]] * 4, "four")

    def flat(w, cands):  # every candidate 2 % faster than serial at best: not worth it
        return [100.0 if c.name == "whole:serial" else 98.0 for c in cands]
    assert choose(w, flat)[0].name == "whole:serial"

    def pays(w, cands):
        return [100.0 if c.name == "whole:serial" else 50.0 + i for i, c in enumerate(cands)]
    cand, ranking = choose(w, pays)
    assert cand.name != "whole:serial" and ranking[0][0] == cand.name


@pytest.mark.slow
def test_trained_model_packs_bert_qkv():
    from tunedb.costmodel.packing import FEATURES, features, fit, load_frame, predict_us

    frame = load_frame(GRAPHS.parent / "packing_h200")
    booster = fit(frame["X"], frame["y"])

    def model(w, cands):
        X = np.asarray([[features(w, c)[k] for k in FEATURES] for c in cands], np.float32)
        return predict_us(booster, X)
    (qkv,) = graph_workloads(import_onnx(GRAPHS / "bert_layer.onnx"), "bert")
    cand, ranking = choose(qkv, model)
    assert cand.name != "whole:serial"  # three 128x768x768 GEMMs: measured, batching pays
    assert len(ranking) == len(set(n for n, _ in ranking))

"""The roofline fallback's schedule choice (plans without a cost model), judged on the shipped H200
measurements: every legal schedule of 435 workloads timed."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tunedb.costmodel.features import DeviceFacts
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import analyze
from tunedb.kernels.schedule import schedule_space
from tunedb.plan import compile
from tunedb.plan.cost import _feature_roofline
from tunedb.plan.fallback import fallback_order
from tunedb.records import canonical_json

DATA = Path(__file__).resolve().parents[1] / "data" / "fusion_h200_v2"


def _order(graph: Graph, legal) -> list[int]:
    a = analyze(graph)
    # featurize caches a workload's features by its hash: each graph needs its own
    est, waves = _feature_roofline(a.graph, [s.to_config() for s in legal], graph_hash(graph), DeviceFacts())
    return fallback_order(a, legal, est, waves)


def _first(graph: Graph):
    legal = schedule_space(graph)[0]
    return legal[_order(graph, legal)[0]]


def _rows(C: int, dtype: str = "float32") -> Graph:
    b = GraphBuilder(f"softmax_{C}")
    return b.build([b.softmax(b.input("x", (4096, C), dtype), axis=-1)])


def test_rules_pick_the_mapping_a_pattern_needs():
    b = GraphBuilder("transpose_relu")
    t = b.build([b.relu(b.transpose(b.input("x", (4096, 2048)), perm=(1, 0)))])
    assert _first(t).mapping == "transpose_tiled"           # not the uncoalesced elementwise read
    assert _first(_rows(128)).mapping == "warp_per_row"     # 512-byte rows
    assert _first(_rows(4096)).mapping == "block_per_row"   # 16 KB rows
    first = _first(_rows(4096, "float16"))
    assert first.vec * 2 == 16 and first.grid == "full"     # 16-byte accesses, a block per row
    b = GraphBuilder("col_mean")
    tall = b.build([b.reduce_mean(b.input("x", (65536, 768)), axes=(0,))])
    first = _first(tall)
    # 768 columns in one sweep would be a handful of blocks: the pick splits the rows
    assert first.mapping.startswith("col_") and (first.split > 1 or first.mapping == "col_cluster")


@pytest.fixture(scope="module")
def shipped():
    wl = pq.read_table(DATA / "workloads.parquet").to_pylist()
    ok = {m["candidate_hash"]: m["median_us"]
          for m in pq.read_table(DATA / "measurements.parquet").to_pylist() if m["status"] == "ok"}
    measured: dict[str, dict[str, float]] = defaultdict(dict)
    for c in pq.read_table(DATA / "candidates.parquet").to_pylist():
        if c["hash"] in ok:
            measured[c["workload_hash"]][canonical_json(json.loads(c["config_json"]))] = ok[c["hash"]]
    return wl, measured


@pytest.mark.slow
def test_fallback_picks_near_the_best_on_the_shipped_data(shipped):
    wl, measured = shipped
    ratios, space_order = [], []
    for w in wl:
        times = measured[w["hash"]]
        g = Graph.from_json(json.loads(w["graph_json"]))
        legal = [s for s in schedule_space(g)[0] if canonical_json(s.to_config()) in times]
        t = np.array([times[canonical_json(s.to_config())] for s in legal])
        ratios.append(t[_order(g, legal)[0]] / t.min())
        space_order.append(t[0] / t.min())
    geomean = math.exp(np.mean(np.log(ratios)))
    print(f"\nroofline fallback over {len(ratios)} workloads: first pick {geomean:.3f}x the best "
          f"(geomean), space order {math.exp(np.mean(np.log(space_order))):.3f}x")
    assert len(ratios) == 435 and geomean <= 1.2 and np.median(ratios) <= 1.1  # 1.175, 1.082


def test_plan_without_a_model_uses_the_fallback():
    b = GraphBuilder("transpose_relu")
    g = b.build([b.relu(b.transpose(b.input("x", (4096, 2048)), perm=(1, 0)))])
    p = compile(g, device="generic", cost_model=False)
    (step,) = p.steps
    assert step.cost_source == "roofline" and dict(step.config)["mapping"] == "transpose_tiled"


def test_batched_transpose_and_its_consumer_are_one_kernel():
    # attention-style [B, M, N] -> [B, N, M] and NCHW -> NHWC, each added to a full-size input
    for shape, perm in (((4, 48, 80), (0, 2, 1)), ((2, 16, 7, 9), (0, 2, 3, 1))):
        b = GraphBuilder("bt")
        t = b.transpose(b.input("x", shape), perm=perm)
        g = b.build([b.relu(b.add(t, b.input("z", tuple(shape[p] for p in perm))))])
        for model in (False, None):
            p = compile(g, device="generic", cost_model=model)
            assert [s.kind for s in p.steps] == ["fused"], (shape, model, [s.kind for s in p.steps])

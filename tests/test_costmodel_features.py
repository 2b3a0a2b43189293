"""Cost-model features on real fusion graphs and real schedule spaces."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from tunedb.costmodel import workload as wl_mod
from tunedb.costmodel.features import (
    FEATURE_NAMES,
    FEATURE_SCHEMA_VERSION,
    MEASURED_FEATURES,
    UNKNOWN,
    DeviceFacts,
    feature_index,
    featurize,
    featurize_candidates,
    featurize_frame,
)
from tunedb.costmodel.workload import WORKLOAD_FEATURES, analyze_graph
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.hashing import graph_hash
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import schedule_space
from tunedb.kernels.suites import case


def col(X: np.ndarray, name: str) -> np.ndarray:
    return X[:, feature_index(name)]


@pytest.fixture(scope="module")
def softmax():
    return case("softmax", "softmax", 1024, 4096, "float32").graph


@pytest.fixture(scope="module")
def workloads():
    specs = [("bias_act", "gelu_tanh", 512, 768, "bfloat16"),
             ("norm", "add_layernorm", 300, 1000, "float32"),
             ("col_reduce", "col_center", 2048, 512, "float16"),
             ("permute", "transpose_add", 96, 160, "float32"),
             ("norm_backward", "layernorm_backward", 64, 768, "float32")]
    return [case(*s).graph for s in specs]


def _rows(graphs):
    gs, hs, cfgs = [], [], []
    for g in graphs:
        h = graph_hash(g)
        for s in schedule_space(g)[0]:
            gs.append(g)
            hs.append(h)
            cfgs.append(s.to_config())
    return gs, hs, cfgs


def test_schema_is_versioned_and_names_unique():
    assert isinstance(FEATURE_SCHEMA_VERSION, int) and FEATURE_SCHEMA_VERSION >= 1
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert set(MEASURED_FEATURES) <= set(FEATURE_NAMES)
    assert FEATURE_NAMES[:len(WORKLOAD_FEATURES)] == WORKLOAD_FEATURES
    for name in ("floor_bytes", "flops", "transcendental_ops", "n_reductions", "rows", "row_len", "vec",
                 "block", "grid", "waves", "occupancy", "roofline_us", "kernels", "log2_roofline_us"):
        assert name in FEATURE_NAMES
    with pytest.raises(ValueError, match="unknown feature"):
        feature_index("no_such_feature")


def test_shape_finite_and_deterministic(workloads):
    gs, hs, cfgs = _rows(workloads)
    X = featurize(gs, hs, cfgs)
    assert X.dtype == np.float32 and X.shape == (len(cfgs), len(FEATURE_NAMES))
    assert np.isfinite(X).all()  # dense: XGBoost's fast path
    assert (X[:, [feature_index(n) for n in MEASURED_FEATURES]] == UNKNOWN).all()
    wl_mod._cache.clear()
    X2 = featurize([json.dumps(g.to_json()) for g in gs], hs, [json.dumps(c) for c in cfgs])
    assert X2.tobytes() == X.tobytes()
    # Row by row gives the same as the batch (the vectorised path has no cross-row effects).
    for r in (0, len(cfgs) // 2, len(cfgs) - 1):
        one = featurize([gs[r]], [hs[r]], [cfgs[r]])
        assert one.tobytes() == X[r:r + 1].tobytes()


def test_workload_facts(softmax):
    f = analyze_graph(softmax)
    assert f["rows"] == 1024 and f["row_len"] == 4096
    assert f["pattern_row_reduce"] == 1.0 and f["row_levels"] == 2.0
    assert f["n_reductions"] == 2 and f["n_row_reductions"] == 2 and f["n_col_reductions"] == 0
    assert f["max_reduction_len"] == 4096
    assert f["floor_bytes"] == 2 * 1024 * 4096 * 4
    assert f["transcendental_ops"] == 1024 * 4096  # one exp per element
    cr = analyze_graph(case("col_reduce", "col_center", 2048, 512, "float32").graph)
    assert cr["pattern_col_reduce"] == 1.0 and cr["n_col_reductions"] == 1
    assert cr["max_col_reduction_len"] == 2048


def test_graph_outside_the_generator_still_featurises():
    b = GraphBuilder("mm")
    x = b.input("x", (64, 128), "float32")
    w = b.input("w", (128, 32), "float32")
    g = b.build([b.relu(b.matmul(x, w))])
    f = analyze_graph(g)
    assert f["pattern_unsupported"] == 1.0 and np.isnan(f["row_levels"])
    assert f["matmul_flops"] == 2 * 64 * 32 * 128
    X = featurize_candidates(g, [{"mapping": "elementwise", "block": 128}])
    assert X.shape == (1, len(FEATURE_NAMES))
    assert np.isfinite(col(X, "roofline_us")).all()


def test_features_follow_the_schedule(softmax):
    base = {"mapping": "warp_per_row", "block": 256, "vec": 4, "row_cache": "registers"}
    X = featurize_candidates(softmax, [base, {**base, "vec": 2}, {**base, "row_cache": "reread"},
                                       {**base, "mapping": "block_per_row"}])
    assert list(col(X, "vec")) == [4, 2, 4, 4]
    assert list(col(X, "threads_per_row")) == [32, 32, 32, 256]
    assert col(X, "rows_per_block")[0] == 8
    assert col(X, "row_iters")[0] == 4096 / (32 * 4)
    # Re-reading the row for each of softmax's two later passes moves the input twice more.
    floor = col(X, "floor_bytes")[0]
    assert col(X, "est_bytes")[0] == floor
    assert col(X, "est_bytes")[2] == pytest.approx(floor + 2 * 1024 * 4096 * 4)
    assert col(X, "roofline_us")[2] > col(X, "roofline_us")[0]
    assert col(X, "mapping_block_per_row")[3] == 1 and col(X, "mapping_warp_per_row")[3] == 0
    assert col(X, "cache_regs")[0] > 0 and col(X, "cache_regs")[2] == 0


def test_split_column_reduction_is_two_launches():
    g = case("col_reduce", "bias_grad", 4096, 512, "float32").graph
    cfg = {"mapping": "col_tiled", "block": 256, "vec": 4, "group": 16}
    X = featurize_candidates(g, [cfg, {**cfg, "split": 8}])
    assert list(col(X, "kernels")) == [1, 2]
    assert col(X, "grid")[1] == 8 * col(X, "grid")[0]
    dev = DeviceFacts()
    assert col(X, "roofline_us")[1] - col(X, "roofline_us")[0] >= dev.launch_us


def test_launch_grid_is_the_generators(workloads):
    """The first kernel's grid, for every legal schedule (wave and full grids) of real workloads."""
    graphs = workloads + [case("softmax", "softmax", 8192, 4096, "float16").graph,
                          case("bias_act", "gelu", 1000, 3001, "float32").graph]
    n = 0
    for g in graphs:
        legal = schedule_space(g)[0]
        X = featurize_candidates(g, [s.to_config() for s in legal])
        for s, x in zip(legal, X):
            k = generate(g, s).kernels[0]
            assert x[feature_index("grid")] == k.grid[0] * k.grid[1] * k.grid[2], s.label()
            n += 1
    assert n > 500


def test_full_grid_has_no_grid_stride_trips():
    g = case("bias_act", "gelu", 8192, 4096, "float32").graph
    wave = {"mapping": "elementwise", "block": 256, "vec": 4, "unroll": 2}
    X = featurize_candidates(g, [wave, {**wave, "grid": "full"}])
    assert list(col(X, "grid_full")) == [0, 1]
    assert col(X, "grid")[0] == 132 * 2048 // 256 and col(X, "stride_iters")[0] > 1
    assert col(X, "grid")[1] == 8192 * 4096 / (4 * 256 * 2) and col(X, "stride_iters")[1] == 1
    assert col(X, "waves")[1] > 4 * col(X, "waves")[0]


def test_device_facts_change_waves(softmax):
    cfg = [{"mapping": "warp_per_row", "block": 128, "vec": 4}]
    small = featurize_candidates(softmax, cfg, DeviceFacts(name="small", sm_count=10))
    big = featurize_candidates(softmax, cfg, DeviceFacts(name="big", sm_count=132))
    assert col(small, "waves")[0] > col(big, "waves")[0]
    d = DeviceFacts(name="x", sm_count=7)
    assert DeviceFacts.from_json(d.to_json() | {"unknown": 1}) == d


def test_measured_resources_and_frames(workloads):
    gs, hs, cfgs = _rows(workloads[:2])
    n = len(cfgs)
    regs = [None if i % 3 == 0 else (-1 if i % 3 == 1 else 40) for i in range(n)]
    X = featurize(gs, hs, cfgs, registers=regs, shared_bytes=[0] * n, local_bytes=[0] * n)
    r = col(X, "regs_measured")
    assert r[0] == UNKNOWN and r[1] == UNKNOWN and r[2] == 40
    occ = col(X, "occupancy_measured")
    assert 0 < occ[2] <= 1 and occ[0] == UNKNOWN
    # A frame (dictionary-encoded graphs, chunked columns, nullable ints) gives the same matrix.
    uniq = {h: json.dumps(g.to_json()) for g, h in zip(gs, hs)}
    keys = list(uniq)
    idx = pa.array([keys.index(h) for h in hs], type=pa.int32())
    frame = pa.table({
        "workload_hash": pa.chunked_array([hs[: n // 2], hs[n // 2:]]),
        "graph_json": pa.DictionaryArray.from_arrays(idx, pa.array([uniq[k] for k in keys])),
        "config_json": [json.dumps(c) for c in cfgs],
        "registers": pa.array([None if v is None or v < 0 else v for v in regs], type=pa.int32()),
        "shared_bytes": pa.array([0] * n, type=pa.int64()),
        "local_bytes": pa.array([0] * n, type=pa.int64()),
    })
    assert featurize_frame(frame).tobytes() == X.tobytes()
    # Without the repeated graph_json column, graphs come once per workload.
    slim = frame.drop(["graph_json"])
    assert featurize_frame(slim, graphs=uniq).tobytes() == X.tobytes()
    wl_mod._cache.clear()
    with pytest.raises(ValueError, match="no graph given for workload"):
        featurize_frame(slim, graphs={keys[0]: uniq[keys[0]]})


def test_workloads_are_analysed_once(workloads):
    gs, hs, cfgs = _rows(workloads[:1])
    wl_mod._cache.clear()
    featurize(gs * 50, hs * 50, cfgs * 50)
    assert list(wl_mod._cache) == [hs[0]]


def test_bad_inputs_say_what_is_wrong(softmax):
    h = graph_hash(softmax)
    with pytest.raises(ValueError, match="cannot read candidate config JSON"):
        featurize([softmax], [h], ["{not json"])
    with pytest.raises(ValueError, match="must be a JSON object"):
        featurize([softmax], [h], ["[1, 2]"])
    with pytest.raises(ValueError, match="2 graphs for 1 workload"):
        featurize([softmax, softmax], [h], ["{}"])
    with pytest.raises(ValueError, match="no graph given"):
        featurize({}, [h], ["{}"])
    with pytest.raises(ValueError, match="lacks column"):
        featurize_frame(pa.table({"workload_hash": [h]}))
    wl_mod._cache.clear()
    with pytest.raises(ValueError, match="cannot read workload graph JSON"):
        featurize(["{}"], ["x" * 64], ["{}"])
    assert featurize([], [], []).shape == (0, len(FEATURE_NAMES))


def test_row_prefetch_differs_from_its_register_twin_only_in_its_column(softmax):
    base = {"mapping": "block_per_row", "block": 512, "vec": 2, "row_cache": "registers"}
    X = featurize_candidates(softmax, [base, {**base, "row_cache": "prefetch"},
                                       {**base, "row_cache": "smem"}])
    col = FEATURE_NAMES.index("row_prefetch")
    differ = np.flatnonzero(X[0] != X[1])
    assert differ.tolist() == [col] and X[1, col] == 1.0 and X[0, col] == 0.0
    assert not np.array_equal(X[0], X[2])


def test_unfeaturised_knobs_featurise_as_the_plain_twin_and_rank_once(softmax):
    from tunedb.costmodel.features import featurised_form
    from tunedb.plan.cost import ranked_configs

    base = {"mapping": "block_per_row", "block": 512, "vec": 2, "grid": "full"}
    twin = {**base, "stream": True}
    other = {**base, "vec": 4}
    X = featurize_candidates(softmax, [base, twin, other])
    assert np.array_equal(X[0], X[1]) and not np.array_equal(X[0], X[2])
    assert featurised_form(base) == featurised_form(twin) != featurised_form(other)
    # twins keep one place (the first of the space); distinct configs with equal estimates keep both
    ranked = ranked_configs(np.array([5.0, 5.0, 5.0, 4.0]), [base, twin, other, {**other, "block": 256}])
    assert [c for _, c in ranked] == [{**other, "block": 256}, base, other]

"""Host side of the GPU collection's look-ahead: inputs/references prepared as .npy files, the
faster bfloat16 rounding, and the float64 oracle's buffer reuse (CPU only)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.records import Workload
from tunedb.runtime.cuda import _caller_workload
from tunedb.runtime.inputs import (
    BF16_NAN_BITS,
    bf16_bits,
    load_prepared,
    make_inputs,
    prepare_workload,
    reference_outputs,
    workload_seed,
)


def _workload() -> Workload:
    b = GraphBuilder("prep")
    x = b.input("x", (6, 40), "bfloat16")
    keep = b.input("keep", (6, 40), "bool")
    r = b.input("r", (6, 40), "float32")
    y = b.where(keep, b.mul(b.cast(x, to="float32"), r), r)
    return Workload.from_graph(b.build([y, b.reduce_sum(y, axes=(1,), keepdims=True)]), "t", "prep")


def test_prepared_files_hold_exactly_what_the_worker_would_compute(tmp_path) -> None:
    w = _workload()
    man = prepare_workload(json.loads(w.graph_json), w.hash, str(tmp_path / "w0"))
    assert "error" not in man and man["seconds"] >= 0
    assert json.loads(json.dumps(man)) == man  # travels to the worker as JSON
    dev, refs = load_prepared(man)
    g = w.graph
    want_dev, ref_in = make_inputs(g, workload_seed(w.hash))
    want_refs = reference_outputs(g, ref_in)
    assert set(dev) == set(g.inputs) and set(refs) == set(g.outputs)
    for k, a in want_dev.items():
        assert dev[k].dtype == a.dtype and np.array_equal(dev[k], a)
    for k, a in want_refs.items():
        assert refs[k].dtype == np.float32 and np.array_equal(refs[k], a, equal_nan=True)
    assert dev["x"].dtype == np.uint16 and dev["keep"].dtype == np.bool_


def test_prepare_reports_a_bad_graph_as_one_line(tmp_path) -> None:
    man = prepare_workload({"nodes": "not a graph"}, "ab" * 32, str(tmp_path / "bad"))
    assert set(man) == {"error", "seconds"} and "\n" not in man["error"]


def test_bf16_rounding_matches_the_64_bit_formula_everywhere() -> None:
    rng = np.random.default_rng(1)
    raw = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
                          np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,
                                    0x3F808000, 0x3F818000, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32)])
    f = raw.view(np.float32)
    wide = raw.astype(np.uint64)
    want = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    want[np.isnan(f)] = BF16_NAN_BITS
    got = bf16_bits(f)
    assert np.array_equal(got, want)
    assert np.array_equal(f.view(np.uint32), raw)  # the input is not modified


def test_oracle_buffer_reuse_keeps_inputs_and_live_views_intact() -> None:
    b = GraphBuilder("reuse")
    x = b.input("x", (4, 6), "float32")
    e = b.exp(x)
    v = b.reshape(e, shape=(6, 4))          # a view of e, alive after e's last use
    z = b.neg(e)                            # e dies here: its buffer must not be reused
    s = b.sub(v, b.reshape(z, shape=(6, 4)))
    p = b.op("pow", b.mul(s, s), b.constant(np.array(2.0, np.float32)))
    g = b.build([p, b.tanh(b.sub(p, s))])
    xin = np.random.default_rng(2).standard_normal((4, 6))  # float64: passed through uncopied
    before = xin.copy()
    out = run_reference(g, {"x": xin})
    assert np.array_equal(xin, before)
    ee = np.exp(before)
    ss = ee.reshape(6, 4) - (-ee).reshape(6, 4)
    pp = np.power(ss * ss, 2.0)
    assert np.array_equal(out[g.outputs[0]], pp)
    assert np.array_equal(out[g.outputs[1]], np.tanh(pp - ss))


def test_prefetch_finds_the_collectors_workload_in_its_caller() -> None:
    w = _workload()

    def prefetch() -> Workload | None:
        return _caller_workload()

    def producer() -> Workload | None:
        job = SimpleNamespace(workload=w)  # what ``Collector._prepare`` holds
        assert job is not None
        return prefetch()

    assert producer() is w
    assert prefetch() is None


def test_non_index_integer_inputs_are_masks_that_stay_finite_in_float32() -> None:
    from tunedb.runtime.inputs import make_inputs

    b = GraphBuilder("masked")
    x = b.input("x", (4, 64), "float32")
    m = b.input("mask", (4, 64), "int64")
    # BERT's additive mask: (1 - mask) * float32 min, added to the scores
    bias = b.mul(b.sub(1.0, b.cast(m, to="float32")), -3.4e38)
    g = b.build([b.add(x, bias)])
    dev, ref = make_inputs(g, 5)
    assert set(np.unique(dev["mask"])) == {0, 1}
    out = run_reference(g, ref)[g.outputs[0]]
    assert np.isfinite(out.astype(np.float32)).all()

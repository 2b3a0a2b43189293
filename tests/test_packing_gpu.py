"""Every packing backend on the GPU, checked against the float64 reference (eager and replayed)."""

from __future__ import annotations

import pytest

from tunedb.kernels.packing import BACKENDS, Member, PackingWorkload, candidates
from tunedb.runtime.pack import PackedRun, make_inputs, reference, time_stream, worst_error

pytestmark = pytest.mark.gpu


def _workloads() -> list[PackingWorkload]:
    mixed = (Member(48, 64, 96), Member(17, 64, 96), Member(48, 64, 96, batch=3),
             Member(33, 40, 24, layout="nt"), Member(9, 40, 24, layout="nt", weight="w"),
             Member(20, 40, 24, layout="nt", weight="w"))
    return [PackingWorkload("mixed32", "test", mixed),
            PackingWorkload("mixed_bf16", "test", tuple(Member(**{**m.to_json(), "dtype": "bfloat16"})
                                                         for m in mixed))]


@pytest.mark.parametrize("w", _workloads(), ids=lambda w: w.name)
def test_every_candidate_matches_the_reference(w):
    import cupy as cp

    from tunedb.runtime.streams import StreamPool

    pool = StreamPool(8)
    inputs = make_inputs(w, seed=3)
    refs = reference(w, inputs)
    seen = set()
    for cand in candidates(w, stream_counts=(2, 4)):
        run = PackedRun(cp, w, cand, inputs, pool)
        run.run()
        assert worst_error(w, run.outputs(), refs) <= 1.0, cand.name
        run.clear_outputs()
        assert worst_error(w, run.outputs(), refs) > 1.0  # cleared outputs fail
        run.capture()
        run.replay()
        assert worst_error(w, run.outputs(), refs) <= 1.0, f"{cand.name} replayed"
        assert min(time_stream(cp, run.replay, run.main, reps=2, samples=2)) > 0
        seen |= {c.backend for c in cand.clusters}
    assert seen == set(BACKENDS)
    pool.close()


def test_measure_candidates_rows_are_checked_and_timed():
    import cupy as cp

    from tunedb.runtime.pack import measure_candidates
    from tunedb.runtime.streams import StreamPool

    w = _workloads()[1]
    inputs = [(cp.asarray(x), cp.asarray(wt)) for x, wt in make_inputs(w, seed=0)]
    rows = measure_candidates(cp, w, inputs, reference(w, inputs), StreamPool(16), reps=2, samples=3,
                              log=lambda s: None)
    assert len(rows) == len(candidates(w))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["error"] <= 1.0 and len(r["samples_us"]) == 3 and r["launches"] >= 1


def test_the_packing_collector_measures_through_the_engine(tmp_path):
    from collectors.packing import PackingCollector
    from tunedb.store.core import TuningStore

    coll = PackingCollector()
    dev = coll.open_device("cuda")
    try:
        with TuningStore.open(tmp_path / "p.duckdb") as store:
            s = coll.run(store, dev, "quick", budget=24)
            assert s.measured == 24 and s.ok == 24, s.statuses
            again = coll.run(store, dev, "quick", budget=24)  # resumes: nothing measured twice
            assert again.already >= 24
            ms = store.measurements()
            assert all(len(m.samples_us) == dev.protocol.samples for m in ms if m.status == "ok")
    finally:
        dev.close()

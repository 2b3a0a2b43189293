"""The CPU emulator as a device (``emu``): it verifies like the GPU (the protocol's inputs,
poisoned outputs, the one tolerance) and never times. Collections store only its failures,
under its own device identity; the planner keeps the best-ranked schedule that verified."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest

from tunedb.collect import Collector, Job
from tunedb.graph.builder import GraphBuilder
from tunedb.kernels import generate
from tunedb.records import Workload
from tunedb.runtime import open_device
from tunedb.runtime.cuda import plan_to_wire
from tunedb.runtime.emu import EMU_INFO, EmuDevice, generable_schedules
from tunedb.runtime.results import MeasureRequest
from tunedb.store import TuningStore

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found"), pytest.mark.slow]


def _softmax():
    b = GraphBuilder("softmax_64x96")
    return b.build([b.softmax(b.input("x", (64, 96)))])


def _schedules(g, n: int = 2) -> list:
    """The ``n`` schedules of distinct mappings with the fewest threads (quick to emulate)."""
    best: dict[str, Any] = {}
    for s in generable_schedules(g, sm_count=EMU_INFO.sm_count):
        if not s.fast_math and (s.mapping not in best or s.block < best[s.mapping].block):
            best[s.mapping] = s
    return sorted(best.values(), key=lambda s: s.block)[:n]


def _wire(g, s) -> dict:
    return plan_to_wire(generate(g, s, sm_count=EMU_INFO.sm_count))


def _half_rows(wire: dict) -> dict:
    """A launch bug: the row count (the first scalar argument) halved, so the kernels' row loops
    stop half way and the last rows are never written."""
    bad = copy.deepcopy(wire)
    for k in bad["kernels"]:
        first = next(a for a in k["args"] if isinstance(a, dict))
        first["value"] //= 2
    return bad


def test_emu_device_verifies_and_reports_failures_without_timings(tmp_path) -> None:
    g = _softmax()
    w = Workload.from_graph(g, "softmax", g.name)
    good = [_wire(g, s) for s in _schedules(g)]
    assert good
    broken = copy.deepcopy(good[0])
    broken["kernels"][0]["source"] += "\n#error not C++\n"
    reqs = [MeasureRequest(f"ok{i}", p) for i, p in enumerate(good)]
    reqs += [MeasureRequest("half", _half_rows(good[0])),
             MeasureRequest("gen", error="code generation failed"), MeasureRequest("gxx", broken)]
    dev = open_device("emu")
    assert isinstance(dev, EmuDevice) and dev.info == EMU_INFO and dev.kind == "emu"
    dev.workdir = str(tmp_path)
    try:
        got = dict(dev.measure(w, reqs))
    finally:
        dev.close()
    assert all(got[i] is None for i in range(len(good)))  # verified: not measured
    assert dev.verified == {r.candidate_hash for r in reqs[:len(good)]}
    half, gen, gxx = (got[len(good) + j] for j in range(3))
    assert half.status == "incorrect" and "tolerance" in half.error
    assert gen.status == "compile_error" and gxx.status == "compile_error" and "g++" in gxx.error
    assert all(not r.samples_us for r in (half, gen, gxx))
    assert dev.stats()["verified"] == len(good) and dev.stats()["incorrect"] == 1


class _EmuCollector(Collector):
    """One softmax workload: two generated schedules and a launch bug."""

    name = "emu_toy"
    kind = "fusion"

    def jobs(self, suite: str):
        g = _softmax()
        scheds = _schedules(g)
        specs = [({"sched": s.label()}, _wire(g, s)) for s in scheds]
        specs.append(({"sched": "half rows"}, _half_rows(specs[0][1])))
        yield Job(Workload.from_graph(g, "softmax", g.name), specs)

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        return "", spec


def test_a_collection_on_emu_stores_failures_only_under_the_emulator(tmp_path) -> None:
    dev = EmuDevice(workdir=str(tmp_path))
    try:
        with TuningStore.open(tmp_path / "t.duckdb") as store:
            summary = _EmuCollector().run(store, dev, "toy")
            rows = store.measurements()
            devices = store.devices()
    finally:
        dev.close()
    assert summary.missing == 2 and summary.measured == 1  # two verified (not timed), one bug
    assert [d.id for d in devices] == [EMU_INFO.id]
    assert [(m.status, m.samples_us, m.device_id) for m in rows] == [("incorrect", (), EMU_INFO.id)]


def test_the_planner_keeps_the_best_ranked_schedule_that_verified() -> None:
    from tunedb.plan import compile

    g = _softmax()
    plan = compile(g, measure_top=2, measure_device="emu", cost_model=False)
    fused = [s for s in plan.steps if s.kind == "fused"]
    assert fused and all("verified in emulation" in s.note for s in fused)
    assert all(s.measured_us is None for s in fused)

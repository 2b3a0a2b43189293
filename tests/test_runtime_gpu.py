"""The measurement protocol on a real GPU (skipped without CuPy + a CUDA device)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.records import Protocol, Workload
from tunedb.runtime.results import MeasureRequest

pytestmark = pytest.mark.gpu

R, C = 256, 1024

GOOD = r"""
extern "C" __global__ void bias_relu(const float* x, const float* b, float* y, int n, int c) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i] + b[i % c]; y[i] = v > 0.f ? v : 0.f; }
}
"""
WRONG = GOOD.replace("v > 0.f ? v : 0.f", "v")                      # forgets the relu
PARTIAL = GOOD.replace("if (i < n)", "if (i < n - 7)")               # leaves poisoned elements
BROKEN = GOOD.replace("float v", "flot v")                           # does not compile
ILLEGAL = GOOD.replace("y[i] = v > 0.f ? v : 0.f;", "((float*)0x10)[i] = v;")  # illegal address
# Spins on a volatile *global* load (b[0] is a normal sample, never 12345): a volatile local
# (`volatile int spin = 1; while (spin) {}`) lives in registers/local memory, where the compiler
# may drop the volatile and then delete the side-effect-free loop (C++ forward progress), so the
# kernel finished and verified "ok" instead of hanging.
HANG = GOOD.replace("if (i < n)", "while (*(const volatile float*)b != 12345.0f) {} if (i < n)")


def _workload() -> Workload:
    b = GraphBuilder("bias_relu")
    x = b.input("x", (R, C))
    bias = b.input("b", (C,))
    g = b.build([b.relu(b.add(x, bias))])
    return Workload.from_graph(g, "eltwise", "bias_relu")


def _wire(w: Workload, source: str, block: int = 256) -> MeasureRequest:
    out = w.graph.outputs[0]
    kernel = {"name": "bias_relu", "source": source, "grid": [(R * C + block - 1) // block],
              "block": [block], "shared_bytes": 0,
              "args": ["x", "b", out, {"type": "int32", "value": R * C}, {"type": "int32", "value": C}]}
    return MeasureRequest(f"{block}-{source}", {"kernels": [kernel], "scratch": []})


@pytest.fixture(scope="module")
def device():
    pytest.importorskip("cupy")
    from tunedb.runtime.cuda import CudaDevice

    dev = CudaDevice(workers=2, timeout_s=20, protocol=Protocol(warmup=2, samples=10))
    yield dev
    dev.close()


def test_device_info(device) -> None:
    info = device.info
    assert info.sm_count > 0 and info.l2_bytes > 0 and info.memory_bytes > 0
    assert "." in info.compute_capability and info.cupy_version


def test_ok_incorrect_and_compile_error(device) -> None:
    w = _workload()
    wires = [_wire(w, GOOD), _wire(w, GOOD, 128), _wire(w, WRONG), _wire(w, PARTIAL), _wire(w, BROKEN)]
    device.prefetch(wires)
    res = [r for _, r in device.measure(w, wires)]
    assert [r.status for r in res] == ["ok", "ok", "incorrect", "incorrect", "compile_error"]
    for r in res[:2]:
        assert len(r.samples_us) == 10 and all(s > 0 for s in r.samples_us)
        assert r.registers > 0 and r.local_bytes == 0
        assert Protocol(**json.loads(r.protocol_json)).batch >= 1
    assert "max abs error" in res[2].error and "inf" in res[3].error


def test_illegal_address_and_hang_do_not_stop_the_collection(device) -> None:
    w = _workload()
    device.worker.timeout_s = 10
    wires = [_wire(w, ILLEGAL), _wire(w, GOOD), _wire(w, HANG), _wire(w, GOOD)]
    res = [r for _, r in device.measure(w, wires)]
    assert [r.status for r in res] == ["runtime_error", "ok", "timeout", "ok"]


def test_quick_suite_candidates_verify(device, tmp_path) -> None:
    from collectors.fusion import FusionCollector
    from tunedb.store import TuningStore

    coll = FusionCollector()
    with TuningStore.open(tmp_path / "gpu.duckdb") as db:
        s = coll.run(db, device, "quick", budget=40)
        rows = db.measurements(device_id=device.info.id)
    assert s.measured == 40 == len(rows)
    bad = [(m.status, m.error) for m in rows if m.status != "ok"]
    assert s.ok >= 36, bad[:5]


def test_prepared_workload_is_loaded_and_stats_say_where_time_went(device) -> None:
    b = GraphBuilder("bias_relu_prep")
    x = b.input("x", (R, C))
    bias = b.input("b", (C,))
    g = b.build([b.relu(b.add(x, bias))])
    w = Workload.from_graph(g, "eltwise", "bias_relu_prep")
    wires = [_wire(w, GOOD), _wire(w, GOOD, 512)]
    before = device.stats()
    device.prefetch(wires, workload=w)
    res = [r for _, r in device.measure(w, wires)]
    assert [r.status for r in res] == ["ok", "ok"]
    assert all(r.phases["verify_s"] > 0 and r.phases["time_s"] > 0 for r in res)
    assert "setup_s" in res[0].phases
    st = device.stats()
    assert st["candidates"] == before["candidates"] + 2
    assert st["workloads"] == before["workloads"] + 1
    assert st["timing_s"] > before["timing_s"] and st["verify_s"] > before["verify_s"]
    if st["prep_pool"]:
        assert res[0].phases["setup_local"] is False  # inputs came from the prep pool
        assert st["setup_local"] == before["setup_local"]


def test_graph_batches_replay_their_kernels_whichever_stream_is_current() -> None:
    """A batch graph must hold its launches even when another stream is current (kernels go to
    the current stream): otherwise they run once during capture and the replay does nothing."""
    cp = pytest.importorskip("cupy")
    from tunedb.runtime.measure import _graph_runner

    inc = cp.RawKernel(r'extern "C" __global__ void inc(int* c) { atomicAdd(c, 1); }', "inc")
    counter = cp.zeros(1, dtype=cp.int32)
    stream, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with other:
        run = _graph_runner(cp, stream, lambda: inc((1,), (1,), (counter,)), 5)
        assert run is not None
        stream.synchronize()
        other.synchronize()
        counter.fill(0)
        cp.cuda.Device().synchronize()
        run()
        run()
        stream.synchronize()
    assert int(counter.get()[0]) == 10


SPIN = r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
"""


def test_timings_after_a_graph_batch_still_wait_for_their_kernels() -> None:
    """After a batch graph the worker's stream must still be the current one, and a plan's
    launches must go to it: launches that escaped to the null stream ran beside the events and
    synchronisations on the worker's stream, so single-launch samples read near zero and quick
    timings after a throughput run read 1.9x (their kernels shared the GPU with leftovers)."""
    pytest.importorskip("cupy")
    from tunedb.runtime.measure import build_launch, get_function, gpu_init, time_plan

    state: dict = {}
    gpu_init(state)
    cp, stream = state["cp"], state["stream"]
    kernel = {"name": "spin", "source": SPIN, "grid": [1], "block": [1], "shared_bytes": 0,
              "args": [{"type": "int64", "value": 200_000}]}  # 200 µs
    item = {"kernels": [kernel], "scratch": []}
    launch = build_launch(cp, stream, [get_function(state, kernel)], item, {})
    batched, proto = time_plan(state, launch, Protocol(warmup=1, samples=3, flush_l2=False, batch=4))
    assert proto.batch == 4 and min(batched) >= 190.0
    assert cp.cuda.get_current_stream() == stream
    single, proto = time_plan(state, launch, Protocol(warmup=1, samples=3, flush_l2=True, batch=1))
    assert proto.batch == 1 and min(single) >= 190.0
    # a kernel launched on the ambient stream (as CuPy ops are) lands on the worker's stream too
    ambient = cp.RawKernel(SPIN, "spin")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    ambient((1,), (1,), (np.int64(200_000),))
    end.record(stream)
    end.synchronize()
    assert cp.cuda.get_elapsed_time(start, end) * 1000.0 >= 190.0

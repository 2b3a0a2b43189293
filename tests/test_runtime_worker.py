"""Crash isolation of the measurement worker (CPU-only fake task) and the host side of the protocol."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.runtime.cuda import plan_to_wire
from tunedb.runtime.device import parse_clocks
from tunedb.runtime.inputs import BF16_NAN_BITS, bf16_bits, bf16_to_f32, make_inputs
from tunedb.runtime.tolerance import Tolerance, check_host, reduction_length, tolerance
from tunedb.runtime.worker import Worker, WorkerError

TASK = "tunedb.runtime.worker:selftest_task"
INIT = "tunedb.runtime.worker:selftest_init"


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_crash_hang_and_exception_each_fail_one_item_and_the_next_still_runs() -> None:
    items = [{"action": "ok", "value": 1}, {"action": "exit", "value": 7}, {"action": "ok", "value": 2},
             {"action": "sleep"}, {"action": "ok", "value": 3}, {"action": "raise", "value": "bad"},
             {"action": "ok", "value": 4}]
    with Worker(TASK, INIT, timeout_s=1.5) as w:
        first_pid = w.start()["pid"]
        out = list(w.run({"name": "ctx"}, items))
    assert [i for i, _ in out] == list(range(len(items)))
    res = [r for _, r in out]
    assert [r["status"] for r in res] == ["ok", "runtime_error", "ok", "timeout", "ok", "runtime_error", "ok"]
    assert "exit code 7" in res[1]["error"]
    assert "bad" in res[5]["error"]
    assert [r["value"] for r in res if r["status"] == "ok"] == [1, 2, 3, 4]
    assert res[0]["pid"] == first_pid and res[2]["pid"] != first_pid  # restarted after the crash
    assert res[2]["context"] == "ctx"
    assert w.restarts == 3


def test_state_survives_between_batches_and_restart_request_is_honoured() -> None:
    with Worker(TASK, INIT, timeout_s=30) as w:
        a = [r for _, r in w.run({}, [{"value": 1}, {"value": 2}])]
        b = [r for _, r in w.run({}, [{"action": "restart", "value": 3}, {"value": 4}])]
    assert [r["seen"] for r in a] == [1, 2]
    assert b[0]["seen"] == 3 and b[0]["pid"] == a[0]["pid"]
    assert b[1]["seen"] == 1 and b[1]["pid"] != a[0]["pid"]  # fresh process after "_restart"


def test_failing_init_is_a_start_error() -> None:
    w = Worker(TASK, "tunedb.runtime.worker:no_such_init", timeout_s=5)
    with pytest.raises(WorkerError, match="no_such_init"):
        w.start()
    w.close()


def test_task_must_be_module_level() -> None:
    with pytest.raises(ValueError, match="module-level"):
        Worker(lambda s, c, i: iter(()))


def test_import_runtime_and_collectors_without_cupy() -> None:
    code = ("import sys; import tunedb.runtime, tunedb.runtime.measure, tunedb.runtime.cuda, "
            "collectors.fusion, tunedb.cli.collect; assert 'cupy' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_inputs_are_random_rounded_and_indices_in_range() -> None:
    b = GraphBuilder("g")
    x = b.input("x", (64, 32), "bfloat16")
    h = b.input("h", (16, 8), "float16")
    idx = b.input("idx", (10,), "int64")
    g = b.build([b.gather(x, idx, axis=0), b.exp(h)])
    dev, ref = make_inputs(g, seed=5)
    assert dev["x"].dtype == np.uint16 and ref["x"].dtype == np.float32
    assert np.array_equal(bf16_to_f32(dev["x"]).reshape(64, 32), ref["x"])
    assert np.count_nonzero(ref["x"]) > 0.99 * ref["x"].size and ref["x"].std() > 0.5
    assert dev["h"].dtype == np.float16
    assert dev["idx"].min() >= 0 and dev["idx"].max() < 64
    again, _ = make_inputs(g, seed=5)
    other, _ = make_inputs(g, seed=6)
    assert np.array_equal(again["x"], dev["x"]) and not np.array_equal(other["x"], dev["x"])


def test_bf16_rounding_is_nearest_even() -> None:
    vals = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.nan], dtype=np.float32)
    bits = bf16_bits(vals)
    assert bits[0] == 0x3F80 and bits[1] == 0x3F80 and bits[2] == 0x3F82  # ties go to even
    assert bits[4] == BF16_NAN_BITS
    assert bf16_to_f32(bits)[3] == -2.5


def test_tolerances_by_dtype_and_reduction_length() -> None:
    def softmax_graph(dtype: str, n: int):
        b = GraphBuilder("s")
        x = b.input("x", (4, n), dtype)
        return b.build([b.softmax(x)])

    small, big = softmax_graph("float32", 16), softmax_graph("float32", 4096)
    assert reduction_length(small) == 16 and reduction_length(big) == 4096
    assert tolerance(big, "float32").atol > tolerance(small, "float32").atol
    assert tolerance(softmax_graph("bfloat16", 16), "bfloat16").rtol > tolerance(small, "float32").rtol
    assert tolerance(small, "int64").exact


def test_column_sums_widen_atol_by_their_length_and_catch_a_wrong_sum() -> None:
    from tunedb.graph.reference import run_reference
    from tunedb.runtime.tolerance import sum_length

    b = GraphBuilder("colsum")
    x = b.input("x", (65536, 8), "float32")
    g = b.build([b.reduce_sum(x, axes=[0])])
    m = GraphBuilder("m")
    means = m.build([m.reduce_mean(m.input("y", (4, 4)), axes=[0])])
    assert sum_length(g) == 65536 and sum_length(means) == 0
    tol = tolerance(g, "float32")
    xs = np.random.default_rng(0).standard_normal((65536, 8)).astype(np.float32)
    ref = run_reference(g, {"x": xs})[g.outputs[0]]
    naive = np.zeros(8, np.float32)
    for row in xs:  # sequential float32 accumulation, the worst order a kernel might use
        naive += row
    assert np.abs(naive - ref).max() > 1e-4  # the old bound (sqrt(n) * eps) would fail it
    assert check_host(naive, ref, tol)[0]
    wrong = naive + xs[17]  # one row of 65,536 counted twice is off by ~1: far outside
    assert not check_host(wrong, ref, tol)[0]


def test_host_check_rule_fails_nan_and_wrong_values() -> None:
    ref = np.array([1.0, 2.0, np.inf, np.nan], dtype=np.float32)
    tol = Tolerance(1e-5, 1e-4)
    assert check_host(ref.copy(), ref, tol)[0]
    bad = ref.copy()
    bad[0] = np.nan  # an unwritten (poisoned) element
    ok, err = check_host(bad, ref, tol)
    assert not ok and err == np.inf
    off = ref.copy()
    off[1] = 2.01
    ok, err = check_host(off, ref, tol)
    assert not ok and err == pytest.approx(0.01, rel=1e-3)


def test_parse_clocks() -> None:
    assert parse_clocks("1980, 3201, 41, 120.55\n") == {"sm_mhz": 1980.0, "mem_mhz": 3201.0,
                                                       "temperature_c": 41.0, "power_w": 120.55}
    assert parse_clocks("1980 MHz, 3201 MHz, 41, [N/A]\n") == {"sm_mhz": 1980.0, "mem_mhz": 3201.0,
                                                                "temperature_c": 41.0}
    assert parse_clocks("") == {}


def test_plan_to_wire_takes_scalar_widths_from_the_kernel_signature() -> None:
    src = ('extern "C" __global__ void __launch_bounds__(256) k(\n const float* __restrict__ x,\n'
           '    float* __restrict__ y, long long R, long long C, float s, int n) {}')
    plan = {"kernels": [{"name": "k", "source": src, "grid": (2, 1, 1), "block": (256, 1, 1),
                         "args": ["x", "y", 8, 16, 2, 3]}]}
    args = plan_to_wire(plan)["kernels"][0]["args"]
    assert args[2:] == [{"type": "int64", "value": 8}, {"type": "int64", "value": 16},
                        {"type": "float32", "value": 2}, {"type": "int32", "value": 3}]


def test_plan_to_wire_normalises_args_and_scratch() -> None:
    plan = {"kernels": [{"name": "k", "source": "src", "grid": 4, "block": (128, 1, 1), "shared_bytes": 0,
                         "args": ["x", "y", 128, 0.5, ("int64", 3)]}],
            "scratch": [("ws", 64, False)]}
    wire = plan_to_wire(plan)
    k = wire["kernels"][0]
    assert k["grid"] == [4] and k["block"] == [128, 1, 1]
    assert k["args"] == ["x", "y", {"type": "int32", "value": 128}, {"type": "float32", "value": 0.5},
                         {"type": "int64", "value": 3}]
    assert wire["scratch"] == [{"name": "ws", "nbytes": 64, "zero": False}]


def test_batching_is_decided_per_workload_not_per_candidate_probe() -> None:
    from tunedb.records import Protocol
    from tunedb.runtime.measure import MAX_BATCH, SHORT_BYTES, batch_size, batched_workload

    def copy_graph(n: int):
        b = GraphBuilder("c")
        return b.build([b.relu(b.input("x", (n, 1024), "float32"))])

    small, big = copy_graph(1024), copy_graph(16384)  # 8 MiB and 128 MiB moved
    assert batched_workload(small) and not batched_workload(big)
    assert 4 * 1024 * 1024 * 2 < SHORT_BYTES < 4 * 16384 * 1024 * 2
    proto = Protocol()
    # the same workload-level decision whatever the probe says: no split around 10 µs
    assert batch_size(9.9, proto, True) > 1 and batch_size(10.1, proto, True) > 1
    assert batch_size(9.9, proto, False) == 1 and batch_size(10.1, proto, False) == 1
    # without a decision (the bench's quick timing) the probe decides, as before
    assert batch_size(9.9, proto, None) == 6 and batch_size(10.1, proto, None) == 1
    assert batch_size(0.01, proto, True) == min(MAX_BATCH, 250)  # probes floored at 0.2 µs
    assert batch_size(3.0, Protocol(batch=7), False) == 7  # an explicit batch wins

"""Generated kernels on a real GPU (CuPy/NVRTC): every legal schedule of the quick suite against
the float64 reference, outputs poisoned beforehand so unwritten elements fail."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_emu import generable_schedules, make_inputs, max_error, poisoned_output

from tunedb.graph.reference import run_reference
from tunedb.kernels import analyze, generate, suite

pytestmark = pytest.mark.gpu


def _launch(cp, plan, bufs):
    for name, nbytes in plan.scratch:
        bufs[name] = cp.full(max(1, nbytes // 4), np.nan, cp.float32)
    for k in plan.kernels:
        fn = cp.RawModule(code=k.source, options=("-std=c++17",)).get_function(k.name)
        if k.shared_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = k.shared_bytes
        args = tuple(bufs[a] if isinstance(a, str) else a for a in k.args)
        fn(k.grid, k.block, args, shared_mem=k.shared_bytes)
    cp.cuda.runtime.deviceSynchronize()


def test_quick_suite_on_gpu():
    import cupy as cp

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    failures = []
    for case in suite("quick"):
        g = case.graph
        dev, ref = make_inputs(g, analyze(g).C)
        want = run_reference(g, ref)
        legal = generable_schedules(g, sm_count=sm)
        print(f"{case.name}: {len(legal)} schedules", flush=True)  # progress, with -s
        for s in legal:
            plan = generate(g, s, sm_count=sm)
            bufs = {v: cp.asarray(a) for v, a in dev.items()}
            bufs.update({v: cp.asarray(poisoned_output(g.type_of(v))) for v in g.outputs})
            _launch(cp, plan, bufs)
            host = {v: cp.asnumpy(bufs[v]) for v in g.outputs}
            v, err = max_error(g, host, want)
            if err > 1.0:
                failures.append(f"{case.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


def test_batched_transposes_on_gpu():
    """Transposes that keep leading batch dims, fused with their consumers: every legal schedule
    (the emulated test's graphs) against the float64 reference."""
    import cupy as cp
    from test_kernels_emulated import _batched_transposes

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    failures, n = [], 0
    for g in _batched_transposes():
        dev, ref = make_inputs(g, analyze(g).C)
        want = run_reference(g, ref)
        for s in generable_schedules(g, sm_count=sm):
            bufs = {v: cp.asarray(a) for v, a in dev.items()}
            bufs.update({v: cp.asarray(poisoned_output(g.type_of(v))) for v in g.outputs})
            _launch(cp, generate(g, s, sm_count=sm), bufs)
            v, err = max_error(g, {v: cp.asnumpy(bufs[v]) for v in g.outputs}, want)
            n += 1
            if err > 1.0:
                failures.append(f"{g.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    assert n >= 100 and not failures, "\n".join(failures[:40])

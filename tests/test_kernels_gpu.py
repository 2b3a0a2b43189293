"""Generated kernels on a real GPU (CuPy/NVRTC): every legal schedule of the quick suite against
the float64 reference, through the runtime's one launch path, on the protocol's inputs, outputs
poisoned beforehand so unwritten elements fail, checked with the protocol's tolerance."""

from __future__ import annotations

import pytest

from tunedb.kernels import generate, suite
from tunedb.runtime.emu import generable_schedules, poisoned_outputs
from tunedb.runtime.inputs import make_inputs, reference_outputs
from tunedb.runtime.launch import plan_launcher
from tunedb.runtime.tolerance import compare_outputs

pytestmark = pytest.mark.gpu


def _verify(cp, g, plan, dev, want, modules) -> tuple[str, float]:
    """The plan through the runtime's launch path into poisoned outputs, checked with the
    protocol's tolerance: ``(worst output, its error over the tolerance)``."""
    bufs = {v: cp.asarray(a) for v, a in dev.items()}
    bufs.update({v: cp.asarray(a) for v, a in poisoned_outputs(g).items()})
    plan_launcher(cp, plan, bufs, modules)()
    cp.cuda.runtime.deviceSynchronize()
    return compare_outputs(g, {v: cp.asnumpy(bufs[v]) for v in g.outputs}, want)


def test_quick_suite_on_gpu():
    import cupy as cp

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    failures, modules = [], {}
    for case in suite("quick"):
        g = case.graph
        dev, ref = make_inputs(g, 0)
        want = reference_outputs(g, ref)
        legal = generable_schedules(g, sm_count=sm)
        print(f"{case.name}: {len(legal)} schedules", flush=True)  # progress, with -s
        for s in legal:
            v, err = _verify(cp, g, generate(g, s, sm_count=sm), dev, want, modules)
            if err > 1.0:
                failures.append(f"{case.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


def test_batched_transposes_on_gpu():
    """Transposes that keep leading batch dims, fused with their consumers: every legal schedule
    (the emulated test's graphs) against the float64 reference."""
    import cupy as cp
    from test_kernels_emulated import _batched_transposes

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    failures, n, modules = [], 0, {}
    for g in _batched_transposes():
        dev, ref = make_inputs(g, 0)
        want = reference_outputs(g, ref)
        for s in generable_schedules(g, sm_count=sm):
            v, err = _verify(cp, g, generate(g, s, sm_count=sm), dev, want, modules)
            n += 1
            if err > 1.0:
                failures.append(f"{g.name} {s.label()}: output {v} off by {err:.3g}x tolerance")
    assert n >= 100 and not failures, "\n".join(failures[:40])

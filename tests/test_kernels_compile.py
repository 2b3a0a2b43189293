"""Every legal schedule of the quick suite generates CUDA that nvcc compiles for sm_90.

Sources are concatenated into two translation units (the prelude is include-guarded, names are
unique per plan) compiled in parallel; ptxas reports registers and spills, and no kernel may
spill: a row cache that spills would read memory twice.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tunedb.kernels import generate, suite
from tunedb.runtime.emu import generable_schedules

NVCC = shutil.which("nvcc")


def _compile(path, out):
    return subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(out), str(path)],
                          capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_quick_suite_compiles_with_nvcc(tmp_path):
    sources: dict[str, str] = {}
    names: dict[str, str] = {}
    for case in suite("quick"):
        legal = generable_schedules(case.graph)
        assert legal, case.name
        for s in legal:
            plan = generate(case.graph, s)
            for k in plan.kernels:
                sources.setdefault(k.name, k.source)
                names.setdefault(k.name, f"{case.name} {s.label()}")
    assert len(sources) > 400
    parts = [list(sources.values())[i::2] for i in range(2)]
    paths = []
    for i, part in enumerate(parts):
        p = tmp_path / f"tu{i}.cu"
        p.write_text("\n".join(part))
        paths.append(p)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: _compile(p, p.with_suffix(".cubin")), paths))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    log = "\n".join(r.stderr for r in results)
    spills = re.findall(r"Compiling entry function '(\w+)'.*?\n.*?(\d+) bytes spill stores", log)
    spilled = [names.get(k, k) for k, n in spills if int(n) > 0]
    assert not spilled, f"{len(spilled)} kernels spill, e.g. {spilled[:5]}"
    assert len(re.findall(r"Compiling entry function", log)) == len(sources)

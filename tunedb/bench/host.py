"""Host-side helpers of ``tunedb bench fusion``: process pools (spawned, so no CUDA state is
inherited) and each case's random inputs and float64 references, prepared in worker processes
and handed over as ``.npy`` files."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from tunedb.graph.ir import Graph
from tunedb.graph.reference import run_reference
from tunedb.runtime.inputs import make_inputs, workload_seed


def spawn_pool(n: int) -> Any:
    """A process pool (spawn: no CUDA state is inherited), or None if one cannot start."""
    if n <= 0:
        return None
    try:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        return ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn"))
    except Exception:  # noqa: BLE001 - the work then runs in this process
        return None


def submit_or_none(owner: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``owner.pool.submit(fn, *args)``; None (and no pool from now on) when the pool is broken."""
    if owner.pool is None:
        return None
    try:
        return owner.pool.submit(fn, *args)
    except Exception:  # noqa: BLE001
        owner.pool = None
        return None


def host_case(graph_json: dict, workload_hash: str, folder: str) -> dict[str, dict[str, str]]:
    """Pool task: a case's random inputs (``make_inputs``, seeded by the workload) and float64
    reference outputs, saved as ``.npy`` files in ``folder`` (arrays of up to a GiB: files, not
    pipes). The reference takes seconds per large case, so worker processes compute it ahead."""
    g = Graph.from_json(graph_json)
    dev, ref_in = make_inputs(g, workload_seed(workload_hash))
    refs = run_reference(g, ref_in)
    files: dict[str, dict[str, str]] = {"inputs": {}, "refs": {}}
    for kind, names, arrays in (("inputs", g.inputs, dev), ("refs", g.outputs, refs)):
        for i, n in enumerate(names):
            files[kind][n] = path = os.path.join(folder, f"{workload_hash[:16]}_{kind}{i}.npy")
            np.save(path, np.asarray(arrays[n]), allow_pickle=False)
    return files


class HostPrep:
    """Inputs and references of the cases, ``ahead`` cases in advance, in worker processes."""

    def __init__(self, jobs: list[tuple[str, Graph]], ahead: int = 2) -> None:
        import tempfile

        self.jobs, self.ahead, self.futs = jobs, ahead, {}
        self.folder = tempfile.mkdtemp(prefix="tunedb-bench-")
        # float64 references take seconds per large case: a worker per case, up to half the cores
        self.pool = spawn_pool(max(ahead, min(len(jobs), (os.cpu_count() or 2) // 2)))
        self.want(0)

    def want(self, i: int) -> None:
        for j in range(i, min(i + self.ahead + 1, len(self.jobs))):
            if j not in self.futs:
                h, g = self.jobs[j]
                self.futs[j] = submit_or_none(self, host_case, g.to_json(), h, self.folder)

    def get(self, i: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        self.want(i + 1)
        fut = self.futs.pop(i, None)
        try:
            files = fut.result() if fut is not None else None
        except Exception:  # noqa: BLE001 - the worker died (memory?): compute here
            files = None
        h, g = self.jobs[i]
        files = files or host_case(g.to_json(), h, self.folder)
        loaded = []
        for kind in ("inputs", "refs"):
            loaded.append({n: np.load(path, allow_pickle=False) for n, path in files[kind].items()})
            for path in files[kind].values():
                if os.path.exists(path):
                    os.remove(path)
        return loaded[0], loaded[1]

    def settle(self) -> None:
        """Prepare every case now and stop the workers (see ``CaseSearch.settle``)."""
        self.ahead = len(self.jobs)
        self.want(0)
        for fut in self.futs.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - ``get`` computes it in-process
                pass
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.pool = None

    def close(self) -> None:
        import shutil

        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.folder, ignore_errors=True)

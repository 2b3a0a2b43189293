"""``PackingCollector``: every candidate of every packing workload of a suite, on the engine.

suite (``tunedb.kernels.packing_suites``, families interleaved so a time limit cuts every family)
-> packing workloads -> ``candidates(w)`` (partition x backend x concurrency) -> the device.
``tunedb collect --collector packing --suite standard --db DB`` measures on a ``PackingDevice``
(``tunedb.runtime.pack_device``: float64-checked, CUDA-graph replays, failures as rows);
``--device replay:PATH`` replays stored packing rows like any kind. ``extra = True`` (a
subclass, ``benchmarks/packing_collect_extra.py``) adds the ``splitk`` and ``chunks``
candidates (``all_candidates``) with their parameters; their padding waste is in the config.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tunedb.collect import Collector, Job
from tunedb.kernels.packing import Candidate as PackCandidate
from tunedb.kernels.packing import PackingWorkload, all_candidates, candidate_waste, candidates
from tunedb.kernels.packing_suites import interleave, suite
from tunedb.records import Workload, canonical_json
from tunedb.runtime.pack_device import PackingDevice


def workload_record(w: PackingWorkload) -> Workload:
    return Workload(w.hash, w.family, w.name, canonical_json(w.to_json()))


def candidate_config(w: PackingWorkload, cand: PackCandidate) -> dict:
    """The stored config: partition, backends, concurrency, clusters (JSON), padding waste."""
    return {"partition": cand.partition, "backends": "+".join(sorted({c.label for c in cand.clusters})),
            "concurrent": cand.concurrent, "clusters": canonical_json(cand.to_json()["clusters"]),
            "waste": round(candidate_waste(w, cand), 6)}


class PackingCollector(Collector):
    name = "packing"
    kind = "packing"
    extra = False  # True: also the splitk and chunks candidates

    def candidates_of(self, w: PackingWorkload) -> list[PackCandidate]:
        return all_candidates(w) if self.extra else candidates(w)

    def jobs(self, suite_name: str) -> Iterator[Job]:
        seen: set[str] = set()
        for w in interleave(suite(suite_name)):
            if w.hash in seen:
                continue
            seen.add(w.hash)
            yield Job(workload_record(w), [(candidate_config(w, c), c) for c in self.candidates_of(w)])

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        return "", {"candidate": spec.to_json()}  # the worker builds the cuBLAS calls itself

    def open_device(self, spec: str, **kw: Any) -> Any:
        if spec in ("cuda", "gpu"):
            return PackingDevice(timeout_s=kw.get("timeout_s", 60.0), protocol=kw.get("protocol"))
        if spec == "emu":
            raise ValueError("packing candidates are cuBLAS calls: no CPU emulation; use cuda or "
                             "replay:PATH")
        return super().open_device(spec, **kw)

"""Synthetic tuning data shared by the store and CLI tests (no tests of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload, canonical_json, sha256_hex
from tunedb.store import TuningStore

H200 = DeviceInfo("NVIDIA H200", "uuid-a", "9.0", 132, 60 * 2**20, 141 * 2**30, "580.159", "13.0", "14.2")
A100 = DeviceInfo("NVIDIA A100", "uuid-b", "8.0", 108, 40 * 2**20, 80 * 2**30, "550.54", "12.4", "13.3")


@dataclass
class Data:
    devices: list[DeviceInfo] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    workloads: list[Workload] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        keys = {(m.candidate_hash, m.device_id, m.run_id) for m in self.measurements}
        return {"devices": len({d.id for d in self.devices}), "runs": len({r.id for r in self.runs}),
                "workloads": len({w.hash for w in self.workloads}),
                "candidates": len({c.hash for c in self.candidates}), "measurements": len(keys),
                "models": 0}


def make_workload(i: int, family: str = "softmax") -> Workload:
    graph = {"name": f"{family}_{i}", "rows": 128 * (i + 1), "cols": 4096}
    return Workload(sha256_hex(canonical_json(graph)), family, f"{family}_{i}", canonical_json(graph))


def make_data(n_workloads: int = 10, configs: int = 20, runs: range = range(2), samples: int = 10,
              devices: tuple[DeviceInfo, ...] = (H200,), seed: int = 0, fail_every: int = 7) -> Data:
    """Workloads x configs candidates, each measured once per (device, run).

    Every ``fail_every``-th candidate fails to compile (no samples), so filters have work to do.
    Samples depend on (candidate, device, run) only, so overlapping datasets agree row for row.
    """
    d = Data(devices=list(devices))
    d.runs = [Run(f"run-{r}", "fusion", "0.1.0", "abc123", "host", canonical_json({"r": r}),
                  f"2026-01-{r % 28 + 1:02d}T00:00:00Z", f"2026-01-{r % 28 + 1:02d}T01:00:00Z", "{}", "{}")
              for r in runs]
    d.workloads = [make_workload(i, family=("softmax", "layernorm")[i % 2]) for i in range(n_workloads)]
    for w in d.workloads:
        for c in range(configs):
            kind = "fusion" if c % 5 else "schedule"
            d.candidates.append(Candidate(w.hash, kind, {"block": 32 * (c + 1), "vec": c % 4 + 1},
                                          source_hash=sha256_hex(f"{w.hash}{c}")))
    hashes = [c.hash for c in d.candidates]  # a property that hashes JSON: compute once
    for dev in devices:
        dev_id = dev.id  # also a hashing property
        dev_salt = int(dev_id, 16) % 997
        for r, run in zip(runs, d.runs):
            for ci, chash in enumerate(hashes):
                # Cheap deterministic "noise" from (seed, candidate, device, run): fast for 100k rows.
                key = (seed * 7919 + ci * 104729 + dev_salt * 131 + r * 31) % 1009
                if ci % fail_every == fail_every - 1:
                    d.measurements.append(Measurement(chash, dev_id, run.id, "compile_error",
                                                      error="ptxas: too many resources"))
                    continue
                base = 10.0 + (ci % configs) * 1.5
                d.measurements.append(Measurement(
                    chash, dev_id, run.id, "ok",
                    tuple(base + ((key * (j + 3)) % 101) / 100.0 for j in range(samples)),
                    registers=32 + ci % 64, shared_bytes=(ci % 3) * 1024,
                    local_bytes=-1 if ci % 2 else 0))
    return d


def fill(store: TuningStore, d: Data) -> None:
    store.add_devices(d.devices)
    store.add_runs(d.runs)
    store.add_workloads(d.workloads)
    store.add_candidates(d.candidates)
    store.add_measurements(d.measurements)

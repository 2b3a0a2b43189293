"""Typed records that cross every boundary: collector -> store -> cost model -> planner.

All are frozen and JSON round-trippable. Identities are SHA-256 hashes of canonical JSON, so they
are the same on every machine and Python version (never Python's ``hash()``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tunedb.graph.hashing import canonical_json, graph_hash, sha256_hex
from tunedb.graph.ir import Graph

__all__ = ["KINDS", "STATUSES", "Candidate", "DeviceInfo", "Measurement", "Protocol", "Run", "Workload",
           "canonical_json", "sha256_hex"]

STATUSES: tuple[str, ...] = ("ok", "compile_error", "runtime_error", "incorrect", "timeout")
KINDS: tuple[str, ...] = ("fusion", "packing", "schedule")


def _frozen_config(config: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    items = config.items() if isinstance(config, Mapping) else config
    return tuple(sorted((str(k), v) for k, v in items))


@dataclass(frozen=True)
class Workload:
    """A canonical subgraph with shapes and dtypes. ``hash`` is the canonical graph hash
    (``tunedb.graph.hashing.graph_hash``); ``graph_json`` is the graph's JSON text."""

    hash: str
    family: str
    name: str
    graph_json: str = field(repr=False)

    @staticmethod
    def from_graph(graph: Graph, family: str, name: str) -> Workload:
        return Workload(graph_hash(graph), family, name, canonical_json(graph.to_json()))

    @property
    def graph(self) -> Graph:
        return Graph.from_json(json.loads(self.graph_json))


@dataclass(frozen=True)
class Candidate:
    """A workload plus a schedule/stitch configuration. ``config`` is a sorted tuple of
    (key, JSON scalar) pairs; ``source_hash`` is the SHA-256 of the generated kernel source."""

    workload_hash: str
    kind: str
    config: tuple[tuple[str, Any], ...]
    source_hash: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", _frozen_config(self.config))

    @property
    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    @property
    def config_json(self) -> str:
        return canonical_json(self.config_dict)

    @property
    def hash(self) -> str:
        return sha256_hex(canonical_json([self.workload_hash, self.kind, self.config_dict]))


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    uuid_hash: str
    compute_capability: str
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    driver: str
    cuda_runtime: str
    cupy_version: str

    @property
    def id(self) -> str:
        return sha256_hex(canonical_json(asdict(self)))[:16]


@dataclass(frozen=True)
class Run:
    id: str
    collector: str
    tunedb_version: str
    git_sha: str
    host: str
    config_json: str
    started_at: str  # ISO 8601, UTC
    finished_at: str = ""
    clocks_before: str = ""
    clocks_after: str = ""


@dataclass(frozen=True)
class Protocol:
    warmup: int = 3
    samples: int = 10
    flush_l2: bool = True
    batch: int = 1  # launches per timed sample; the sample is total / batch

    def to_json(self) -> str:
        return canonical_json(asdict(self))


@dataclass(frozen=True)
class Measurement:
    candidate_hash: str
    device_id: str
    run_id: str
    status: str
    samples_us: tuple[float, ...] = ()
    error: str = ""
    registers: int = -1
    shared_bytes: int = -1
    local_bytes: int = -1
    protocol_json: str = Protocol().to_json()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown measurement status {self.status!r}; expected one of {STATUSES}")
        object.__setattr__(self, "samples_us", tuple(float(s) for s in self.samples_us))
        if self.status == "ok" and not self.samples_us:
            raise ValueError("an ok measurement needs at least one sample")

    def _quantile(self, q: float) -> float | None:
        if not self.samples_us:
            return None
        s = sorted(self.samples_us)
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median_us(self) -> float | None:
        return statistics.median(self.samples_us) if self.samples_us else None

    @property
    def p20_us(self) -> float | None:
        return self._quantile(0.2)

    @property
    def p80_us(self) -> float | None:
        return self._quantile(0.8)

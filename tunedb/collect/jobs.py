"""The records a collection passes around: a ``Job`` (a workload and the specs of its candidates,
what a collector plugin yields and a strategy proposes), a ``Task`` (one candidate ready for the
device) and the ``Summary`` a run returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tunedb.records import Candidate, Workload
from tunedb.runtime.results import MeasureRequest


class CollectError(ValueError):
    """A collection cannot start (unknown suite, ...); the message is one line."""


@dataclass(frozen=True)
class Job:
    """One workload and the specs (schedules) of its legal candidates: ``(config dict, opaque spec
    handed to the collector's ``build``)``; ``pruned`` counts candidates the space ruled out."""

    workload: Workload
    specs: list[tuple[dict, Any]]
    pruned: int = 0


@dataclass(frozen=True)
class Task:
    """A candidate (with the hash of its generated source) and the request the device measures."""

    candidate: Candidate
    request: MeasureRequest


@dataclass
class Summary:
    run_id: str = ""
    device_id: str = ""
    workloads: int = 0
    total: int = 0              # legal candidates in the suite
    pruned: int = 0             # pruned by the schedule space, never measured
    already: int = 0            # measured on this device before (resume)
    missing: int = 0            # replay only: not in the replay data
    measured: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    stopped: str = ""           # "", "budget", "time" or "rounds"

    @property
    def ok(self) -> int:
        return self.statuses.get("ok", 0)

    @property
    def failed(self) -> int:
        return self.measured - self.ok

    @property
    def rate(self) -> float:
        return self.measured / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "failed": self.failed, "rate_per_s": round(self.rate, 2)}

"""The typed boundary between a collection (or the planner) and a measuring device.

A device's ``measure(workload, requests)`` takes ``MeasureRequest`` records and yields
``MeasureResult`` records. Between the parent and the GPU worker process the same records travel as
JSON (``to_wire`` / ``from_wire``): the pipe carries no pickles, so the dict form exists only there.
``MeasureResult.from_wire`` is also where a malformed or unknown result becomes a ``runtime_error``,
so nothing a worker sends can reach the store as a bad row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tunedb.records import STATUSES, Measurement, Protocol

ERROR_LIMIT = 4000  # characters of an error text kept in the store


@dataclass(frozen=True)
class MeasureRequest:
    """One candidate to measure: its hash and the plan the device runs (the ``plan_to_wire`` form
    of generated kernels), or ``error`` when code generation failed (measured as ``compile_error``)."""

    candidate_hash: str
    plan: Mapping[str, Any] = field(default_factory=dict, compare=False)
    error: str = ""

    @property
    def kernels(self) -> list[dict]:
        return list(self.plan.get("kernels", ()))

    def failed(self, error: str) -> MeasureRequest:
        """The same request marked as not compilable (``error`` names why)."""
        return replace(self, error=error)

    def to_wire(self) -> dict:
        wire = {**self.plan, "candidate_hash": self.candidate_hash}
        if self.error:
            wire["error"] = self.error
        return wire


@dataclass(frozen=True)
class MeasureResult:
    """What a device says about one request. ``protocol_json`` is empty when the device's own
    protocol was used unchanged; ``phases`` are seconds the worker spent (setup, compile, verify,
    time); ``restart`` asks the worker process to restart (a sticky CUDA error)."""

    status: str
    samples_us: tuple[float, ...] = ()
    error: str = ""
    registers: int = -1
    shared_bytes: int = -1
    local_bytes: int = -1
    protocol_json: str = ""
    phases: Mapping[str, Any] = field(default_factory=dict, compare=False)
    restart: bool = False

    @staticmethod
    def failure(status: str, error: str, restart: bool = False) -> MeasureResult:
        return MeasureResult(status, error=error, restart=restart).checked()

    def checked(self) -> MeasureResult:
        """This result with an unknown status, or an ok one without samples, as ``runtime_error``."""
        status, error = self.status, self.error
        if status == "ok" and not self.samples_us:
            status, error = "runtime_error", error or "no timing samples"
        if status not in STATUSES:
            status, error = "runtime_error", f"unknown status {status!r}: {error}"
        samples = self.samples_us if status == "ok" else ()
        return replace(self, status=status, error=error[:ERROR_LIMIT], samples_us=samples)

    @staticmethod
    def from_wire(res: Mapping[str, Any]) -> MeasureResult:
        """A result dict from the worker pipe (or a plugin device) as a checked record."""
        proto_json = str(res.get("protocol_json") or "")
        if not proto_json and res.get("protocol"):
            try:
                proto_json = Protocol(**res["protocol"]).to_json()
            except TypeError:
                proto_json = ""
        try:
            samples = tuple(float(s) for s in (res.get("samples_us") or ()))
        except (TypeError, ValueError):
            samples = ()
        return MeasureResult(str(res.get("status", "runtime_error")), samples,
                             str(res.get("error", "") or ""), int(res.get("registers", -1)),
                             int(res.get("shared_bytes", -1)), int(res.get("local_bytes", -1)), proto_json,
                             dict(res.get("phases") or {}), bool(res.get("_restart", False))).checked()

    def to_wire(self) -> dict:
        wire = asdict(self)
        wire["samples_us"] = list(self.samples_us)
        wire["_restart"] = wire.pop("restart")
        return wire

    def to_measurement(self, candidate_hash: str, device_id: str, run_id: str,
                       protocol: Protocol) -> Measurement:
        """The store's record of this result; ``protocol`` is the device's (used when the result
        names none)."""
        r = self.checked()
        return Measurement(candidate_hash, device_id, run_id, r.status, r.samples_us, r.error,
                           r.registers, r.shared_bytes, r.local_bytes, r.protocol_json or protocol.to_json())

    @staticmethod
    def from_measurement(m: Measurement) -> MeasureResult:
        """A stored measurement as the result a device would give (replay)."""
        return MeasureResult(m.status, m.samples_us, m.error, m.registers, m.shared_bytes, m.local_bytes,
                             m.protocol_json)

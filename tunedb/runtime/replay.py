"""``ReplayDevice``: serve stored measurements instead of timing (Kernel Tuner's simulation mode).

Opens a Parquet export directory (imported into an in-memory store) or a tunedb DuckDB file
(read-only) and answers ``measure`` from it by candidate hash, i.e. by (workload hash, kind, config).
The replayed device is the one recorded in the data (the one with most measurements, or
``device_id``), so a replayed collection looks exactly like the original one to the store.

Candidates that are not in the data are *skipped* (``measure`` yields ``None`` for them and the
collector counts them as missing) rather than recorded as failures: a fake ``runtime_error`` would
poison the training data of the replayed device. Runs entirely on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tunedb.records import DeviceInfo, Measurement, Protocol, Workload
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.store import TuningStore


class ReplayError(ValueError):
    """The replay source cannot be used (missing, empty, unknown device)."""


class ReplayDevice:
    kind = "replay"

    def __init__(self, path: str | Path, device_id: str | None = None,
                 protocol: Protocol | None = None) -> None:
        p = Path(path).expanduser()
        if not p.exists():
            raise ReplayError(f"replay data {p} does not exist")
        self.path = p
        self.protocol = protocol or Protocol()
        if p.is_dir():
            store = TuningStore.open(":memory:")
            try:
                store.import_parquet(p)
            except BaseException:
                store.close()
                raise
        else:
            store = TuningStore.open(p, read_only=True)
        try:
            devices = {d.id: d for d in store.devices()}
            if not devices:
                raise ReplayError(f"replay data {p} holds no devices")
            measurements = store.measurements()
        finally:
            store.close()
        counts: dict[str, int] = {}
        for m in measurements:
            counts[m.device_id] = counts.get(m.device_id, 0) + 1
        if device_id is None:
            device_id = max(devices, key=lambda d: (counts.get(d, 0), d))
        elif device_id not in devices:
            have = ", ".join(sorted(devices))
            raise ReplayError(f"replay data {p} has no device {device_id!r}; it has {have}")
        self.info: DeviceInfo = devices[device_id]
        # One measurement per candidate: an ok one if any run had it ok (runs are ordered by id).
        self._data: dict[str, Measurement] = {}
        for m in measurements:
            if m.device_id != device_id:
                continue
            have = self._data.get(m.candidate_hash)
            if have is None or (have.status != "ok" and m.status == "ok"):
                self._data[m.candidate_hash] = m

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, candidate_hash: object) -> bool:
        return candidate_hash in self._data

    def clocks(self) -> dict[str, float]:
        return {}

    def prefetch(self, requests: list[MeasureRequest], workload: Workload | None = None) -> None:
        return None

    def stats(self) -> dict:
        return {}

    def lookup(self, candidate_hash: str) -> MeasureResult | None:
        m = self._data.get(candidate_hash)
        return None if m is None else MeasureResult.from_measurement(m)

    def measure(self, workload: Workload, requests: list[MeasureRequest]
                ) -> Iterator[tuple[int, MeasureResult | None]]:
        """Yield ``(index, stored result or None)`` for every request."""
        for i, r in enumerate(requests):
            yield i, self.lookup(r.candidate_hash)

    def close(self) -> None:
        self._data = {}

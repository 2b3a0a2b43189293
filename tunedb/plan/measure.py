"""Measuring the best-ranked schedules of a plan's fused steps, and recording what was measured.

``measure_steps`` runs each fused step's ``top`` best-ranked schedules on a device (a GPU, or a
replay of stored measurements) and keeps the fastest correct one. With a ``Recorder`` every
result, ok and failed alike, is written to the tuning database the way a collector writes it:
one ``Run`` (collector ``plan``) with its provenance, then the Workload, Candidate and
Measurement rows in batched transactions, parents first. Candidates the database already holds a
measurement of on this device are not measured again: their stored result is used instead, so
re-planning on the same database adds no duplicate rows. A candidate shared by several steps
(the same workload in every layer of an encoder) is measured once per compile.

Value names: a schedule config names values in its ``stitch`` text, but a workload's hash does
not depend on value names, and the plan's canonical sub-graph (``x0``, ``v0``, ...) names its
values differently from the graph a collector stored for the same workload. When the database
(or the replay data) already holds the workload, candidates are identified and recorded in the
stored graph's names (values matched by structural hash), so that they agree with the stored
``graph_json`` and with what a collector measured; the plan's steps keep their own names.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import duckdb

from tunedb._version import __version__
from tunedb.collect.engine import git_sha, now_iso
from tunedb.graph.hashing import node_hashes
from tunedb.kernels.codegen import generate
from tunedb.kernels.schedule import Schedule
from tunedb.plan.cost import GroupCost, stitch_of
from tunedb.plan.record import KernelStep
from tunedb.records import Candidate, Measurement, Run, Workload, canonical_json
from tunedb.runtime.cuda import plan_to_wire
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.store import StoreError, TuningStore

Lookup = Callable[[str], "Workload | None"]


class Recorder:
    """Buffers what ``measure_steps`` measured and writes it to ``store`` in one batch per table.

    ``known(hash)`` answers from measurements already stored on the device (so they are reused,
    not repeated); ``flush()`` writes the Run (finished, with clocks before and after), then the
    workloads, candidates and measurements. Nothing is written when nothing was measured."""

    def __init__(self, store: Any, device: Any, config: dict[str, Any]) -> None:
        self.store, self.device = store, device
        self.info = device.info
        self.config = config
        self.started_at = now_iso()
        self.clocks_before = canonical_json(device.clocks())
        self.run_id = uuid.uuid4().hex
        self._stored = store.measured_candidates(self.info.id)
        self.workloads: dict[str, Workload] = {}
        self.candidates: dict[str, Candidate] = {}
        self.measurements: list[Measurement] = []

    def known(self, candidate_hash: str) -> MeasureResult | None:
        """The stored result of a candidate measured on this device before (an ok one if any run
        had it ok), or None."""
        if candidate_hash not in self._stored:
            return None
        rows = self.store.measurements(candidate_hash=candidate_hash, device_id=self.info.id)
        best = next((m for m in rows if m.status == "ok"), rows[0] if rows else None)
        if best is None:
            return None
        return MeasureResult.from_measurement(best)

    def add(self, workload: Workload, candidate: Candidate, result: MeasureResult) -> None:
        self.workloads.setdefault(workload.hash, workload)
        self.candidates.setdefault(candidate.hash, candidate)
        self.measurements.append(result.to_measurement(candidate.hash, self.info.id, self.run_id,
                                                       self.device.protocol))
        self._stored.add(candidate.hash)

    def flush(self) -> int:
        """Write everything buffered; returns the number of measurement rows written."""
        if not self.measurements:
            return 0
        run = Run(id=self.run_id, collector="plan", tunedb_version=__version__, git_sha=git_sha(),
                  host=socket.gethostname(),
                  config_json=canonical_json({**self.config, "device": getattr(self.device, "kind", "?"),
                                              "protocol": asdict(self.device.protocol)}),
                  started_at=self.started_at, finished_at=now_iso(),
                  clocks_before=self.clocks_before, clocks_after=canonical_json(self.device.clocks()))
        # Parents before children: the store checks that every row's parents exist.
        self.store.add_devices([self.info])
        self.store.add_runs([run])
        self.store.add_workloads(list(self.workloads.values()))
        self.store.add_candidates(list(self.candidates.values()))
        n = self.store.add_measurements(self.measurements)
        self.workloads, self.candidates, self.measurements = {}, {}, []
        return n


def replay_lookup(device: Any) -> Lookup | None:
    """Stored workloads of a replay device's data (a Parquet export or a database file)."""
    path = getattr(device, "path", None)
    if getattr(device, "kind", "") != "replay" or path is None:
        return None
    if Path(path).is_dir():
        table = Path(path) / "workloads.parquet"
        if not table.is_file():
            return None

        def from_parquet(h: str) -> Workload | None:
            rows = duckdb.execute("SELECT hash, family, name, graph_json FROM read_parquet(?) "
                                  "WHERE hash = ?", [str(table), h]).fetchall()
            return Workload(*rows[0]) if rows else None

        return from_parquet

    def from_db(h: str) -> Workload | None:
        try:
            with TuningStore.open(path, read_only=True) as s:
                return s.workload(h)
        except StoreError:  # open read-write in this process: the recorder's store has it
            return None

    return from_db


class Naming:
    """The stored form of a plan step's workload, looked up in ``sources`` in order, and the map
    from the step graph's value names to the stored graph's."""

    def __init__(self, sources: list[Lookup]) -> None:
        self.sources = sources
        self._cache: dict[str, tuple[Workload | None, dict[str, str]]] = {}

    def of(self, workload: Workload) -> tuple[Workload, dict[str, str]]:
        """(workload to record, value-name map) for ``workload`` (the plan's form)."""
        h = workload.hash
        if h not in self._cache:
            stored = next((w for w in (src(h) for src in self.sources) if w is not None), None)
            names: dict[str, str] = {}
            if stored is not None and stored.graph_json != workload.graph_json:
                by_hash: dict[str, str] = {}
                for v, vh in node_hashes(stored.graph).items():
                    by_hash.setdefault(vh, v)
                names = {v: by_hash[vh] for v, vh in node_hashes(workload.graph).items() if vh in by_hash}
            self._cache[h] = (stored, names)
        stored, names = self._cache[h]
        return stored or workload, names


def renamed(config: dict, names: dict[str, str]) -> dict:
    """``config`` with the value names of its ``stitch`` text mapped through ``names`` (sorted
    by name, as ``schedule.stitch_of`` writes it)."""
    text = str(config.get("stitch", "") or "")
    if not names or not text:
        return config
    parts = sorted((names.get(v, v), scheme) for v, scheme in
                   (p.rsplit(":", 1) for p in text.split(";") if ":" in p))
    return {**config, "stitch": ";".join(f"{v}:{scheme}" for v, scheme in parts)}


def _median(samples: list[float]) -> float:
    s = sorted(samples)
    return s[len(s) // 2]


def measure_steps(steps: list[KernelStep], costs: list[GroupCost], top: int, gpu: Any,
                  recorder: Recorder | None = None) -> tuple[list[KernelStep], int]:
    """Measure the ``top`` best-ranked schedules of every fused step on ``gpu``; keep the fastest
    correct one (``measured_us``). Returns the steps and how many results the device gave."""
    sources = [recorder.store.workload] if recorder is not None else []
    replay = replay_lookup(gpu)
    naming = Naming(sources + ([replay] if replay is not None else []))
    results: dict[str, MeasureResult | None] = {}  # candidate hash -> result, shared by equal workloads
    measured = 0
    out = []
    for step, cost in zip(steps, costs):
        configs = [cfg for _, cfg in cost.ranked[:top]]
        if step.kind != "fused" or not configs:
            out.append(step)
            continue
        # The device runs the step's own graph; the database gets the stored form.
        wl = Workload.from_graph(step.graph, "plan", step.workload_hash[:12])
        record_wl, names = naming.of(wl)
        keys = [Candidate(wl.hash, "fusion", renamed(cfg, names)).hash for cfg in configs]
        cands: list[Candidate] = []
        requests: list[MeasureRequest] = []
        for cfg, key in zip(configs, keys):
            if key in results or key in (c.hash for c in cands):
                continue
            stored = recorder.known(key) if recorder is not None else None
            if stored is not None:
                results[key] = stored
                continue
            source_hash = ""
            # A replay device answers by candidate hash: the stored (renamed) candidate's.
            try:
                kplan = generate(step.graph, Schedule.from_config(cfg), gpu.info.sm_count)
                request = MeasureRequest(key, plan_to_wire(kplan))
                source_hash = str(getattr(kplan, "source_hash", ""))
            except ValueError as e:  # UnsupportedFusion is a ValueError too: a compile_error
                request = MeasureRequest(key, error=str(e))
            cands.append(Candidate(wl.hash, "fusion", renamed(cfg, names), source_hash))
            requests.append(request)
        if requests:
            gpu.prefetch(requests, workload=wl)
            for i, res in gpu.measure(wl, requests):
                results[cands[i].hash] = res
                if res is None:  # a replay device without data for it: nothing to record
                    continue
                measured += 1
                if recorder is not None:
                    recorder.add(record_wl, cands[i], res)
        best: tuple[float, dict] | None = None
        for cfg, key in zip(configs, keys):
            res = results.get(key)
            if res is not None and res.status == "ok" and res.samples_us:
                med = _median(list(res.samples_us))
                if best is None or med < best[0]:
                    best = (med, cfg)
        verified = getattr(gpu, "verified", None)
        if best is None and verified is not None:
            # The CPU emulator verifies without timing: the best-ranked schedule that verified.
            first = next((cfg for cfg, key in zip(configs, keys) if key in verified), None)
            if first is not None:
                note = (step.note + "; " if step.note else "") + "verified in emulation, not timed"
                out.append(replace(step, config=first, stitch=stitch_of(first), note=note))
                continue
        if best is None:
            note = (step.note + "; " if step.note else "") + "no measured schedule ran"
            out.append(replace(step, note=note))
            continue
        out.append(replace(step, config=best[1], stitch=stitch_of(best[1]), measured_us=best[0]))
    return out, measured

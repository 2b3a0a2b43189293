"""Collector base: suite -> workloads -> candidates -> (resume filter) -> device -> store.

A collector says *what* to measure (``jobs``: workloads and their candidate specs; ``build``: one
spec's kernel plan); ``Collector.run`` does the rest the same way for every kind: skips candidates
already measured on this device (a killed collection re-run measures nothing twice), honours
``budget`` (candidates), ``time_s`` and ``rounds``, asks a strategy (``collectors.strategy``)
what to measure in each round and tells it every result, prepares (code-generates) the next
workload in a thread while the device measures the current one, and writes Workload / Candidate /
Measurement rows in batched transactions from this (the parent) process only, inside one
recorded Run.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunedb.records import Candidate, Measurement, Protocol, Run, Workload, canonical_json


class CollectError(ValueError):
    """A collection cannot start (unknown suite, ...); the message is one line."""


BUILTIN_COLLECTORS = {"fusion": "collectors.fusion:FusionCollector"}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_sha() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                           cwd=Path(__file__).resolve().parent, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


@dataclass
class Job:
    """One workload and the specs (schedules) of its legal candidates."""

    workload: Workload
    specs: list[tuple[dict, Any]]  # (config dict, opaque spec handed to ``build``)
    pruned: int = 0


@dataclass
class Task:
    candidate: Candidate
    wire: dict  # the plan as the device runs it, or {"error": text} when code generation failed


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


class _Writer:
    """Buffers rows; writes them every ``every`` measurements or ``seconds`` (parent only)."""

    def __init__(self, store: Any, every: int, seconds: float) -> None:
        self.store, self.every, self.seconds = store, max(1, every), seconds
        self.workloads: list[Workload] = []
        self.candidates: list[Candidate] = []
        self.measurements: list[Measurement] = []
        self.last = time.monotonic()

    def add(self, m: Measurement) -> None:
        self.measurements.append(m)
        if len(self.measurements) >= self.every or time.monotonic() - self.last >= self.seconds:
            self.flush()

    def flush(self) -> None:
        # Parents before children: the store checks that a measurement's candidate exists.
        if self.workloads:
            self.store.add_workloads(self.workloads)
        if self.candidates:
            self.store.add_candidates(self.candidates)
        if self.measurements:
            self.store.add_measurements(self.measurements)
        self.workloads, self.candidates, self.measurements = [], [], []
        self.last = time.monotonic()


@dataclass
class _Pass:
    """What every pass of one ``Collector.run`` shares."""

    writer: _Writer
    summary: Summary
    device: Any
    run_id: str
    device_id: str
    t0: float
    time_s: float | None
    progress: Callable[[Summary], None] | None
    chunk: int
    strategy: Any
    written: set[str] = field(default_factory=set)  # workloads already handed to the writer


def to_measurement(res: dict, candidate_hash: str, device_id: str, run_id: str,
                   protocol: Protocol) -> Measurement:
    """A device result dict as a Measurement record (bad results become ``runtime_error``)."""
    status = str(res.get("status", "runtime_error"))
    samples = tuple(float(s) for s in (res.get("samples_us") or ()))
    error = str(res.get("error", "") or "")
    if status == "ok" and not samples:
        status, error = "runtime_error", error or "no timing samples"
    if status not in ("ok", "compile_error", "runtime_error", "incorrect", "timeout"):
        status, error = "runtime_error", f"unknown status {status!r}: {error}"
    if res.get("protocol_json"):
        proto_json = str(res["protocol_json"])
    else:
        try:
            proto_json = Protocol(**res["protocol"]).to_json() if res.get("protocol") else protocol.to_json()
        except TypeError:
            proto_json = protocol.to_json()
    return Measurement(candidate_hash, device_id, run_id, status, samples if status == "ok" else (),
                       error[:4000], int(res.get("registers", -1)), int(res.get("shared_bytes", -1)),
                       int(res.get("local_bytes", -1)), proto_json)


class Collector:
    """Base class; subclasses set ``name`` / ``kind`` and implement ``jobs`` and ``build``."""

    name = "base"
    kind = "fusion"

    def jobs(self, suite: str) -> Iterator[Job]:
        raise NotImplementedError

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        """``(source_hash, wire plan)`` for one spec; raise to record a ``compile_error``."""
        raise NotImplementedError

    def candidates(self, suite: str) -> Iterator[Candidate]:
        """Every legal candidate of the suite (without code generation: no source hash)."""
        for job in self.jobs(suite):
            for config, _ in job.specs:
                yield Candidate(job.workload.hash, self.kind, config)

    # -- the collection loop -----------------------------------------------------------------
    def run(self, store: Any, device: Any, suite: str, budget: int | None = None,
            time_s: float | None = None, progress: Callable[[Summary], None] | None = None,
            flush_every: int = 256, flush_s: float = 5.0, chunk: int = 64,
            config: dict | None = None, strategy: Any = None, rounds: int | None = None) -> Summary:
        """Measure the suite on ``device`` into ``store``. ``strategy`` (``collectors.strategy``;
        default exhaustive: suite order, one pass) chooses what to measure in each round;
        ``rounds`` caps the number of rounds."""
        t0 = time.monotonic()
        info = device.info
        self.device_info = info  # collectors may size their search to the device (SM count)
        if rounds is not None and rounds < 1:
            raise CollectError(f"rounds must be >= 1, got {rounds}")
        if strategy is None:
            from collectors.strategy import ExhaustiveStrategy

            strategy = ExhaustiveStrategy()
        try:
            jobs = list(self.jobs(suite))  # before the Run row: a bad suite leaves no trace
        except (ValueError, KeyError, LookupError) as e:
            raise CollectError(f"suite {suite!r}: {' '.join(str(e).split())}") from None
        run = Run(id=uuid.uuid4().hex, collector=self.name, tunedb_version=_version(), git_sha=git_sha(),
                  host=socket.gethostname(),
                  config_json=canonical_json({"suite": suite, "budget": budget, "time_s": time_s,
                                              "device": getattr(device, "kind", "?"),
                                              "protocol": asdict(device.protocol), "rounds": rounds,
                                              **strategy.describe(), **(config or {})}),
                  started_at=now_iso(), clocks_before=canonical_json(device.clocks()))
        store.add_devices([info])
        store.add_runs([run])
        summary = Summary(run_id=run.id, device_id=info.id)
        measured = store.measured_candidates(info.id)
        prior = None
        if getattr(strategy, "wants_prior", False):  # earlier ok measurements warm-start a model
            prior = store.training_frame(kind=self.kind, device_id=info.id)
        summary.workloads = len(jobs)
        summary.total = sum(len(j.specs) for j in jobs)
        summary.pruned = sum(j.pruned for j in jobs)
        summary.already = strategy.start(jobs, measured, info, self.kind, prior)
        ctx = _Pass(writer=_Writer(store, flush_every, flush_s), summary=summary, device=device,
                    run_id=run.id, device_id=info.id, t0=t0, time_s=time_s, progress=progress,
                    chunk=chunk, strategy=strategy)
        try:
            done_rounds = 0
            while True:
                left = None if budget is None else budget - summary.measured - summary.missing
                if left is not None and left <= 0:
                    break
                if rounds is not None and done_rounds >= rounds:
                    if any(len(strategy.remaining(j)) for j in range(len(jobs))):
                        summary.stopped = "rounds"
                    break
                picks = strategy.propose(left)
                if not picks:
                    break
                self._measure_jobs(picks, measured, left, ctx)
                done_rounds += 1
                if summary.stopped:
                    break
            if budget is not None and summary.measured + summary.missing >= budget and not summary.stopped:
                remaining = summary.total - summary.already - summary.measured - summary.missing
                summary.stopped = "budget" if remaining > 0 else ""
        finally:
            ctx.writer.flush()
            store.finish_run(run.id, now_iso(), canonical_json(device.clocks()))
            summary.elapsed_s = time.monotonic() - t0
        return summary

    def _measure_jobs(self, jobs: list[Job], measured: set[str], budget: int | None, ctx: _Pass) -> None:
        """One pass (a strategy's round): code generation in a producer thread one workload
        ahead of the device, results written through the batching writer and shown to the
        strategy."""
        summary, device, writer = ctx.summary, ctx.device, ctx.writer
        stop = threading.Event()
        prepared: queue.Queue = queue.Queue(maxsize=2)
        producer = threading.Thread(target=self._prepare, daemon=True,
                                    args=(jobs, measured, budget, device, prepared, stop, summary))
        producer.start()
        try:
            while True:
                got = prepared.get()
                if got is None:
                    break
                if isinstance(got, BaseException):
                    raise got
                job, tasks = got
                if job.workload.hash not in ctx.written:
                    ctx.written.add(job.workload.hash)
                    writer.workloads.append(job.workload)
                writer.candidates.extend(t.candidate for t in tasks)
                for start in range(0, len(tasks), ctx.chunk):
                    if ctx.time_s is not None and time.monotonic() - ctx.t0 >= ctx.time_s:
                        summary.stopped = "time"
                        break
                    part = tasks[start:start + ctx.chunk]
                    wires = [{**t.wire, "candidate_hash": t.candidate.hash} for t in part]
                    for i, res in device.measure(job.workload, wires):
                        if res is None:
                            summary.missing += 1
                            continue
                        m = to_measurement(res, part[i].candidate.hash, ctx.device_id, ctx.run_id,
                                           device.protocol)
                        writer.add(m)
                        ctx.strategy.observe(m.candidate_hash, m.status, m.median_us)
                        summary.measured += 1
                        summary.statuses[m.status] = summary.statuses.get(m.status, 0) + 1
                        summary.elapsed_s = time.monotonic() - ctx.t0
                        if ctx.progress is not None:
                            ctx.progress(summary)
                if summary.stopped:
                    break
        finally:
            stop.set()
            while producer.is_alive():  # unblock a producer waiting on a full queue
                try:
                    prepared.get(timeout=0.1)
                except queue.Empty:
                    pass

    def _prepare(self, jobs: list[Job], measured: set[str], budget: int | None, device: Any,
                 out: queue.Queue, stop: threading.Event, summary: Summary) -> None:
        """Producer thread: resume filter, budget, code generation, pre-compile hand-off."""
        try:
            left = budget
            for job in jobs:
                if stop.is_set() or (left is not None and left <= 0):
                    break
                tasks: list[Task] = []
                for config, spec in job.specs:
                    cand = Candidate(job.workload.hash, self.kind, config)
                    if cand.hash in measured:
                        summary.already += 1
                        continue
                    if left is not None and len(tasks) >= left:
                        break
                    try:
                        source_hash, wire = self.build(job.workload, spec)
                    except Exception as e:  # noqa: BLE001 - a generator bug is this candidate's failure
                        source_hash, wire = "", {"error": f"code generation failed: {type(e).__name__}: {e}"}
                    measured.add(cand.hash)  # also dedupes specs that map to the same config
                    tasks.append(Task(Candidate(job.workload.hash, self.kind, config, source_hash), wire))
                if not tasks:
                    continue
                if left is not None:
                    left -= len(tasks)
                device.prefetch([t.wire for t in tasks], workload=job.workload)
                while not stop.is_set():
                    try:
                        out.put((job, tasks), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent thread
            out.put(e)
            return
        out.put(None)


def _version() -> str:
    from tunedb import __version__

    return __version__


def load_collector(name: str) -> Collector:
    """Instantiate the collector registered as ``name`` in the ``tunedb.collectors`` entry points
    (falling back to the built-in ones when the package is not installed)."""
    import importlib
    from importlib.metadata import entry_points

    target = None
    for ep in entry_points(group="tunedb.collectors"):
        if ep.name == name:
            target = ep.value
            break
    target = target or BUILTIN_COLLECTORS.get(name)
    if target is None:
        known = sorted({ep.name for ep in entry_points(group="tunedb.collectors")} | set(BUILTIN_COLLECTORS))
        raise ValueError(f"unknown collector {name!r}; known: {', '.join(known)}")
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)()

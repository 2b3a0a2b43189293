"""The collection engine: suite -> workloads -> candidates -> (resume filter) -> device -> store.

A collector plugin (``collectors/``, registered in the ``tunedb.collectors`` entry points) says
*what* to measure by subclassing ``Collector``:

- ``name`` (the plugin's name) and ``kind`` (the candidate kind: ``fusion``, ``packing``, ...);
- ``jobs(suite)``: one ``Job`` per workload, with the ``(config dict, spec)`` pair of every legal
  candidate (a config is a dict of JSON scalars; the spec is anything ``build`` needs);
- ``build(workload, spec)``: ``(source_hash, plan)``, the plan in the form the device runs
  (``tunedb.runtime.cuda.plan_to_wire``); raising records the candidate as a ``compile_error``.

``Collector.run`` does the rest the same way for every kind: skips candidates already measured on
this device (a killed collection re-run measures nothing twice), honours ``budget`` (candidates),
``time_s`` and ``rounds``, asks a strategy (``tunedb.collect.strategy``) what to measure in each
round and tells it every result, prepares (code-generates) the next workload in a thread while the
device measures the current one (``MeasureRequest`` in, ``MeasureResult`` out), and writes Workload /
Candidate / Measurement rows in batched transactions from this (the parent) process only, inside
one recorded Run.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from tunedb._version import __version__
from tunedb.collect.jobs import CollectError, Job, Summary, Task
from tunedb.collect.strategy import ExhaustiveStrategy, Strategy
from tunedb.records import Candidate, Measurement, Run, Workload, canonical_json
from tunedb.runtime import open_device
from tunedb.runtime.results import MeasureRequest

# Plugins of this source tree, for a checkout used without installing it (no entry points).
BUILTIN_COLLECTORS = {"fusion": "collectors.fusion:FusionCollector",
                      "packing": "collectors.packing:PackingCollector",
                      "stage": "collectors.stage:StageCollector"}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_sha() -> str:
    named = os.environ.get("TUNEDB_GIT_COMMIT", "").strip()
    if named:  # a copy of the tree shipped to another machine: its .git may be stale
        return named
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                           cwd=Path(__file__).resolve().parent, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


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


class Collector:
    """Base class of collector plugins; subclasses set ``name`` / ``kind`` and implement ``jobs``
    and ``build`` (see the module docstring). ``device_info`` is the measuring device's
    ``DeviceInfo`` while ``run`` runs (a plugin may size its search to it, e.g. the SM count)."""

    name = "base"
    kind = "fusion"
    device_info: Any = None

    def jobs(self, suite: str) -> Iterator[Job]:
        raise NotImplementedError

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        """``(source_hash, wire plan)`` for one spec; raise to record a ``compile_error``."""
        raise NotImplementedError

    def task(self, workload: Workload, config: dict, spec: Any) -> Task:
        """One candidate ready for the device: its plan built (``build``), or a request that
        records a code-generation failure as the candidate's ``compile_error``."""
        cand = Candidate(workload.hash, self.kind, config)
        try:
            source_hash, plan = self.build(workload, spec)
        except Exception as e:  # noqa: BLE001 - a generator bug is this candidate's failure
            error = f"code generation failed: {type(e).__name__}: {e}"
            return Task(cand, MeasureRequest(cand.hash, error=error))
        return Task(Candidate(workload.hash, self.kind, config, source_hash), MeasureRequest(cand.hash, plan))

    def open_device(self, spec: str, **kw: Any) -> Any:
        """The device this kind measures on (``tunedb.runtime.open_device``'s ``spec`` and keywords);
        a plugin whose candidates are not generated kernels returns its own for ``cuda``."""
        return open_device(spec, **kw)

    def candidates(self, suite: str) -> Iterator[Candidate]:
        """Every legal candidate of the suite (without code generation: no source hash)."""
        for job in self.jobs(suite):
            for config, _ in job.specs:
                yield Candidate(job.workload.hash, self.kind, config)

    # -- the collection loop -----------------------------------------------------------------
    def run(self, store: Any, device: Any, suite: str, budget: int | None = None,
            time_s: float | None = None, progress: Callable[[Summary], None] | None = None,
            flush_every: int = 256, flush_s: float = 5.0, chunk: int = 64,
            config: dict | None = None, strategy: Strategy | None = None,
            rounds: int | None = None) -> Summary:
        """Measure the suite on ``device`` into ``store``. ``strategy`` (default exhaustive: suite
        order, one pass) chooses what to measure in each round; ``rounds`` caps the rounds."""
        t0 = time.monotonic()
        info = device.info
        self.device_info = info  # collectors may size their search to the device (SM count)
        if rounds is not None and rounds < 1:
            raise CollectError(f"rounds must be >= 1, got {rounds}")
        if strategy is None:
            strategy = ExhaustiveStrategy()
        try:
            jobs = list(self.jobs(suite))  # before the Run row: a bad suite leaves no trace
        except (ValueError, KeyError, LookupError) as e:
            raise CollectError(f"suite {suite!r}: {' '.join(str(e).split())}") from None
        run = Run(id=uuid.uuid4().hex, collector=self.name, tunedb_version=__version__, git_sha=git_sha(),
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
            # Boards of one model rank schedules alike: a new board starts from the others' data.
            prior = [store.training_frame(kind=self.kind, device_id=i) for i in store.same_model_ids(info)]
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
            try:
                ctx.writer.flush()
            finally:  # a flush that fails (Ctrl-C inside a commit) still closes the run
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
                    for i, res in device.measure(job.workload, [t.request for t in part]):
                        if res is None:
                            summary.missing += 1
                            continue
                        m = res.to_measurement(part[i].candidate.hash, ctx.device_id, ctx.run_id,
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
                    measured.add(cand.hash)  # also dedupes specs that map to the same config
                    tasks.append(self.task(job.workload, config, spec))
                if not tasks:
                    continue
                if left is not None:
                    left -= len(tasks)
                device.prefetch([t.request for t in tasks], workload=job.workload)
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


def load_collector(name: str) -> Collector:
    """Instantiate the collector registered as ``name`` in the ``tunedb.collectors`` entry points
    (falling back to the built-in ones when the package is not installed)."""
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

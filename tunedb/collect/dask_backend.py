"""Collection over a Dask cluster: many devices (GPUs, hosts), one writer.

The client (this process) runs the collector plugin's ``jobs`` and ``build`` (code generation), cuts
every workload's candidates into batches and submits each batch as one Dask task. A worker opens
its own device once (``open_device(spec)``: a GPU of its host, or ``replay:PATH`` in tests),
compiles, verifies and times the batch there and returns its results as JSON text (typed on both
ends: ``MeasureRequest`` / ``MeasureResult`` wire forms). The client is the only writer of the
DuckDB file and commits results as they arrive (``_Writer``), each row keeping the device that
timed it.

Faults are Dask's: a worker that dies loses only the batches it was running; the scheduler re-queues
them on another worker. ``allowed-failures`` is set to 1 here (LocalCluster) and should be on a
remote scheduler: a batch that was running on two workers that died raises ``KilledWorker``, and
the client records its candidates as ``runtime_error`` rows and goes on. A killed client loses
nothing it committed; the next run skips every candidate measured on any of the cluster's devices.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tunedb._version import __version__
from tunedb.collect.engine import Collector, _Writer, git_sha, load_collector, now_iso
from tunedb.collect.jobs import CollectError, Job, Summary, Task
from tunedb.records import Candidate, DeviceInfo, Protocol, Run, Workload, canonical_json
from tunedb.runtime import open_device
from tunedb.runtime.results import MeasureRequest, MeasureResult

ALLOWED_FAILURES = 1  # a batch that was running on 2 workers that died is given up
_DEVICES: dict[str, Any] = {}  # per worker process: device spec -> the open device
_COLLECTORS: dict[str, Collector] = {}  # per worker process: plugin name -> instance
_OPENING = threading.Lock()  # a worker's batch threads open its device and plugin once
_MEASURING: dict[str, threading.Lock] = {}  # device spec -> held while a batch measures on it
GPU_THREADS = 2  # per GPU worker: one batch measures while the next generates code and compiles


class ClusterError(CollectError):
    """The cluster cannot be used (no scheduler, no workers, dask missing); one line."""


def _worker_device(spec: str) -> Any:
    with _OPENING:
        dev = _DEVICES.get(spec)
        if dev is None:
            if spec in ("cuda", "gpu") and multiprocessing.current_process().daemon:
                # CudaDevice runs the GPU and its compiles in child processes; a daemonic one has none.
                raise ClusterError("this Dask worker is a daemonic process and a GPU device needs child "
                                   "processes: start workers with DASK_DISTRIBUTED__WORKER__DAEMON=False")
            dev = _DEVICES[spec] = open_device(spec)
            _MEASURING[spec] = threading.Lock()
        return dev


def worker_hello(spec: str) -> str:
    """JSON of the worker's device (opened here once): ``{"info": DeviceInfo, "protocol": ...}``."""
    dev = _worker_device(spec)
    return json.dumps({"info": asdict(dev.info), "protocol": asdict(dev.protocol), "pid": os.getpid()})


def measure_batch(spec: str, workload_json: str, requests_json: str, pace_s: float | list[float] = 0.0,
                  kill_workloads: tuple[str, ...] = ()) -> str:
    """Measure one batch (candidates of one workload) on this worker's device; JSON in and out.

    ``pace_s`` makes each candidate take that many seconds (one number, or one per request: a
    replay device standing in for a GPU's recorded times) and ``kill_workloads`` makes a batch of
    those workloads kill its worker (a GPU fault): both exist for the tests and the benchmarks."""
    dev = _worker_device(spec)
    workload = Workload(**json.loads(workload_json))
    if workload.hash in kill_workloads:
        os.kill(os.getpid(), signal.SIGKILL)
    requests = [MeasureRequest(r["candidate_hash"], r.get("plan") or {}, r.get("error", ""))
                for r in json.loads(requests_json)]
    # A GPU compiles the batch in its pool now, while another batch of this worker may still be
    # measuring; the device measures one batch at a time.
    dev.prefetch(requests, workload=workload)
    out: list[dict | None] = [None] * len(requests)
    paces = pace_s if isinstance(pace_s, list) else [pace_s] * len(requests)
    with _MEASURING[spec]:
        due = time.monotonic()
        for i, res in dev.measure(workload, requests):
            out[i] = None if res is None else res.to_wire()
            if paces[i]:  # against a running deadline: sleep overshoots do not add up
                due += paces[i]
                time.sleep(max(0.0, due - time.monotonic()))
    return json.dumps({"device": asdict(dev.info), "pid": os.getpid(), "results": out}, allow_nan=True)


def build_and_measure_batch(spec: str, collector: str, workload_json: str, configs_json: str,
                            pace_s: float | list[float] = 0.0, kill_workloads: tuple[str, ...] = ()) -> str:
    """``measure_batch`` with code generation on the worker (its host's CPUs, not the client's):
    the collector plugin rebuilds each candidate's spec from its config (``spec_from_config``)."""
    info = _worker_device(spec).info
    with _OPENING:
        coll = _COLLECTORS.get(collector)
        if coll is None:
            coll = _COLLECTORS[collector] = load_collector(collector)
            coll.device_info = info
    workload = Workload(**json.loads(workload_json))
    requests, sources = [], []
    for config in json.loads(configs_json):
        cand = Candidate(workload.hash, coll.kind, config)
        try:
            source_hash, plan = coll.build(workload, coll.spec_from_config(workload, config))
            requests.append({"candidate_hash": cand.hash, "plan": plan})
        except Exception as e:  # noqa: BLE001 - a generator bug is this candidate's failure
            source_hash = ""
            requests.append({"candidate_hash": cand.hash,
                             "error": f"code generation failed: {type(e).__name__}: {e}"})
        sources.append(source_hash)
    reply = json.loads(measure_batch(spec, workload_json, json.dumps(requests, allow_nan=True), pace_s,
                                     kill_workloads))
    reply["source_hashes"] = sources
    return json.dumps(reply, allow_nan=True)


def _request_json(tasks: list[Task]) -> str:
    return json.dumps([{"candidate_hash": t.request.candidate_hash, "plan": dict(t.request.plan),
                        "error": t.request.error} for t in tasks], allow_nan=True)


@dataclass
class ClusterSummary(Summary):
    workers: dict[str, int] = field(default_factory=dict)   # worker address -> candidates measured
    devices: dict[str, int] = field(default_factory=dict)   # device id -> candidates measured
    killed_batches: int = 0                                 # batches given up (KilledWorker)
    remote_build: bool = False                              # the workers generated the code


def open_client(cluster: str, n_workers: int | None = None, device: str = "cuda",
                threads: int | None = None) -> tuple[Any, Any]:
    """``(client, cluster or None)``: ``local`` starts one worker process per GPU (dask-cuda's
    ``LocalCUDACluster``, ``GPU_THREADS`` batch threads each; a ``LocalCluster`` of ``n_workers``
    of one thread for replay/emu devices; ``threads`` overrides); an address ``tcp://HOST:PORT``
    connects to a running scheduler."""
    try:
        import dask
        from distributed import Client, LocalCluster
    except ImportError:
        raise ClusterError("--cluster needs Dask: pip install 'tunedb[cluster]'") from None
    if cluster != "local":
        if "://" not in cluster:
            raise ClusterError(f"--cluster {cluster!r}: expected 'local' or a scheduler address "
                               "such as tcp://HOST:8786")
        try:
            return Client(cluster, timeout="10s"), None
        except (OSError, TimeoutError) as e:
            raise ClusterError(f"cannot reach the Dask scheduler at {cluster}: {e}") from None
    # Worker processes must not be daemonic: a GPU device starts child processes of its own.
    dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                     "distributed.worker.daemon": False})
    if device in ("cuda", "gpu"):
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            raise ClusterError("--cluster local on GPUs needs dask-cuda: pip install dask-cuda") from None
        lc = LocalCUDACluster(threads_per_worker=threads or GPU_THREADS)
    else:
        lc = LocalCluster(n_workers=n_workers or 4, threads_per_worker=threads or 1, processes=True,
                          dashboard_address=":0")
    return Client(lc), lc


def _batches(coll: Collector, jobs: list[Job], measured: set[str], chunk: int,
             budget: int | None, summary: Summary, remote: bool) -> Iterator[tuple[Job, list[Task]]]:
    """Resume filter, budget and (unless the workers do it: ``remote``) code generation, a batch at
    a time (lazily: overlaps the cluster)."""
    left = budget
    for job in jobs:
        tasks: list[Task] = []
        for config, spec in job.specs:
            if left is not None and left <= 0:
                break
            cand = Candidate(job.workload.hash, coll.kind, config)
            if cand.hash in measured:
                summary.already += 1
                continue
            measured.add(cand.hash)
            if remote:
                tasks.append(Task(cand, MeasureRequest(cand.hash)))
                if left is not None:
                    left -= 1
                if len(tasks) >= chunk:
                    yield job, tasks
                    tasks = []
                continue
            tasks.append(coll.task(job.workload, config, spec))
            if left is not None:
                left -= 1
            if len(tasks) >= chunk:
                yield job, tasks
                tasks = []
        if tasks:
            yield job, tasks
        if left is not None and left <= 0:
            return


def run_cluster(coll: Collector, store: Any, client: Any, device: str, suite: str,
                budget: int | None = None, chunk: int = 64, window: int = 2,
                progress: Callable[[ClusterSummary], None] | None = None,
                flush_every: int = 256, flush_s: float = 2.0, pace_s: float | Mapping[str, float] = 0.0,
                kill_workloads: tuple[str, ...] = (), remote_build: bool = True) -> ClusterSummary:
    """Measure ``suite`` on every worker of ``client``'s cluster into ``store`` (exhaustive order).
    ``window`` batches per worker thread are in flight, so the client never keeps a worker waiting.
    ``pace_s`` (tests, benchmarks): seconds per candidate on a replay worker, or a candidate hash
    -> seconds mapping (recorded device times)."""
    from distributed import as_completed
    from distributed.client import FutureCancelledError
    from distributed.scheduler import KilledWorker

    t0 = time.monotonic()
    # Workers come and go (one restarting after a crash): those that answer are the cluster.
    answers = client.run(worker_hello, device, on_error="return")
    hellos = {a: h for a, h in answers.items() if isinstance(h, str)}
    if not hellos:
        errors = [e for e in answers.values() if isinstance(e, BaseException)]
        why = f": {' '.join(str(errors[0]).split())}" if errors else ""
        raise ClusterError(f"no Dask worker could open device {device!r}{why}")
    infos = {a: DeviceInfo(**json.loads(h)["info"]) for a, h in hellos.items()}
    protocol = Protocol(**json.loads(next(iter(hellos.values())))["protocol"])
    by_id = {i.id: i for i in infos.values()}
    primary = max(by_id.values(), key=lambda i: (sum(x.id == i.id for x in infos.values()), i.id))
    coll.device_info = primary  # the plugin may size its search to the device (SM count)
    try:
        jobs = list(coll.jobs(suite))
    except (ValueError, KeyError, LookupError) as e:
        raise CollectError(f"suite {suite!r}: {' '.join(str(e).split())}") from None
    run = Run(id=uuid.uuid4().hex, collector=coll.name, tunedb_version=__version__, git_sha=git_sha(),
              host=socket.gethostname(),
              config_json=canonical_json({"suite": suite, "budget": budget, "device": device,
                                          "cluster": client.scheduler.address, "workers": len(infos),
                                          "protocol": asdict(protocol), "strategy": "exhaustive"}),
              started_at=now_iso(), clocks_before="{}")
    store.add_devices(list(by_id.values()))
    store.add_runs([run])
    summary = ClusterSummary(run_id=run.id, device_id=primary.id, workers={a: 0 for a in infos})
    measured: set[str] = set()
    for dev_id in by_id:
        measured |= store.measured_candidates(dev_id)
    summary.workloads = len(jobs)
    summary.total = sum(len(j.specs) for j in jobs)
    summary.pruned = sum(j.pruned for j in jobs)
    writer = _Writer(store, flush_every, flush_s)
    written: set[str] = set()
    # Plugins that can rebuild a spec from its config have the workers generate code.
    remote = summary.remote_build = remote_build and callable(getattr(coll, "spec_from_config", None))
    pending = _batches(coll, jobs, measured, chunk, budget, summary, remote)
    inflight: dict[Any, tuple[Job, list[Task]]] = {}
    done = as_completed()

    def submit() -> bool:
        got = next(pending, None)
        if got is None:
            return False
        job, tasks = got
        key, wl = f"tunedb-batch-{uuid.uuid4().hex}", canonical_json(asdict(job.workload))
        pace = ([float(pace_s.get(t.candidate.hash, 0.0)) for t in tasks] if isinstance(pace_s, Mapping)
                else pace_s)
        if remote:
            configs = json.dumps([dict(t.candidate.config) for t in tasks])
            fut = client.submit(build_and_measure_batch, device, coll.name, wl, configs, pace,
                                tuple(kill_workloads), key=key, pure=False)
        else:
            fut = client.submit(measure_batch, device, wl, _request_json(tasks), pace,
                                tuple(kill_workloads), key=key, pure=False)
        inflight[fut] = got
        done.add(fut)
        return True

    def record(job: Job, tasks: list[Task], results: list[dict | None], device_id: str) -> None:
        if job.workload.hash not in written:
            written.add(job.workload.hash)
            writer.workloads.append(job.workload)
        writer.candidates.extend(t.candidate for t in tasks)
        for task, res in zip(tasks, results, strict=True):
            if res is None:
                summary.missing += 1
                continue
            m = MeasureResult.from_wire(res).to_measurement(task.candidate.hash, device_id, run.id, protocol)
            writer.add(m)
            summary.measured += 1
            summary.statuses[m.status] = summary.statuses.get(m.status, 0) + 1
            summary.devices[device_id] = summary.devices.get(device_id, 0) + 1

    try:
        slots = sum(client.nthreads().values()) or len(infos)  # batch threads of the cluster
        for _ in range(window * max(1, slots)):
            if not submit():
                break
        for fut in done:
            job, tasks = inflight.pop(fut)
            try:
                reply = json.loads(fut.result())
            except (KilledWorker, FutureCancelledError) as e:
                # The batch took down its workers: its candidates are failures, never retried.
                summary.killed_batches += 1
                err = f"batch killed its Dask workers: {' '.join(str(e).split())}"[:2000]
                record(job, tasks, [MeasureResult.failure("runtime_error", err).to_wire()] * len(tasks),
                       primary.id)
            except Exception as e:  # noqa: BLE001 - the cluster, not a candidate: stop, keep what is committed
                raise ClusterError(batch_error(e)) from None
            else:
                info = DeviceInfo(**reply["device"])
                if info.id not in by_id:  # a worker that joined later, maybe another board
                    by_id[info.id] = info
                    store.add_devices([info])
                who = fut.status == "finished" and _who_has(client, fut) or f"pid {reply['pid']}"
                summary.workers[who] = summary.workers.get(who, 0) + len(tasks)
                if "source_hashes" in reply:
                    tasks = [Task(replace(t.candidate, source_hash=h), t.request)
                             for t, h in zip(tasks, reply["source_hashes"], strict=True)]
                record(job, tasks, reply["results"], info.id)
            fut.release()
            summary.elapsed_s = time.monotonic() - t0
            if progress is not None:
                progress(summary)
            submit()
    finally:
        for fut in inflight:
            fut.cancel()
        writer.flush()
        store.finish_run(run.id, now_iso(), "{}")
        summary.elapsed_s = time.monotonic() - t0
    return summary


def batch_error(e: BaseException) -> str:
    """One line for a batch that failed on the cluster (not a candidate's failure)."""
    text = " ".join(str(e).split())
    if "deserialization of the task graph" in text:
        return ("the Dask scheduler cannot load tunedb's tasks: install tunedb, the version of this "
                "client, on the scheduler's host and on every worker's")
    return f"a batch failed on the Dask cluster: {type(e).__name__}: {text}"[:2000]


def _who_has(client: Any, fut: Any) -> str:
    try:
        where = client.who_has([fut]).get(fut.key) or ()
    except (OSError, KeyError):
        return ""
    return where[0] if where else ""


def collect_on_cluster(coll: Collector, store: Any, cluster: str, device: str, suite: str,
                       budget: int | None = None, n_workers: int | None = None,
                       show_progress: bool = True) -> ClusterSummary:
    """``tunedb collect --cluster``: open the cluster, run, show one progress bar per worker."""
    client, lc = open_client(cluster, n_workers, device)
    try:
        if not show_progress:
            return run_cluster(coll, store, client, device, suite, budget=budget)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            total = bar.add_task("[bold]all workers", total=None)
            rows: dict[str, Any] = {}

            def progress(s: ClusterSummary) -> None:
                todo = max(0, s.total - s.already)
                bar.update(total, completed=s.measured + s.missing,
                           total=(min(todo, budget) if budget else todo) or None)
                for who, n in s.workers.items():
                    if who not in rows:
                        rows[who] = bar.add_task(f"  {who}", total=None)
                    bar.update(rows[who], completed=n)

            return run_cluster(coll, store, client, device, suite, budget=budget, progress=progress)
    finally:
        client.close()
        if lc is not None:
            lc.close()

"""Stage collector: IOS stage candidates measured on the GPU, stored as rows of kind ``stage``
(the records: ``tunedb.collect.stage_rows``, shared with ``tunedb.compile(..., measure_top=...)``).

A stage is named by what runs, not by where in a graph it runs. Its ``Workload`` is the set of
its members: each member is a step's kind, workload hash and schedule. The workload uses family
``stage``, and its graph_json is scheme ``tunedb.stage/2``: the sorted member texts and each
member's facts (``tunedb.costmodel.stage.member_facts``: FLOPs, bytes, CTAs, launches, all fixed
by the member's sub-graph), which the ``stage`` cost model reads. Its
``Candidate`` (kind ``stage``) is the split into groups: the member indices of each group in
run order, groups sorted, with the stage key of ``tunedb.plan.stages.StageKeys``. The same
stage in another graph, or in the next compile of this one, is therefore the same row. A stage
that fails to build or capture is a row too (status ``runtime_error``, with its one-line
message).

* ``StageCollector`` (``tunedb collect --collector stage --suite CANDIDATES.json``): every stage
  candidate of a candidates file on the collection engine, resumable, failures as rows. The file
  is the stage bench's form (per graph: its plan's JSON and rows of ``groups`` and ``key``):
  ``python -m tunedb.bench.stages CANDIDATES.json --candidates`` writes every candidate of the
  IOS search, and a bench run's ``OUT_rows.json`` works too. ``--device replay:DB`` replays
  stored rows; ``--device cuda`` times each stage with ``StageDevice``, which runs plans and so
  needs the planner's loader (``load_plan``, lent by ``tunedb collect``: this layer may not
  import the planner).
* ``measure_stages(plan, stages)`` (GPU): time each stage with the harness executor
  (``StagedExecutor(plan, stage_streams=W).time_stage``, values never sharing memory).
* ``store_stage_rows(db, plan, rows, device, config)``: one Run with every row.
The library reads the rows back (``tunedb.plan.stage_refine.stored_stage_times``): ``tunedb.compile(...,
schedule="ios", db=DB)`` prices every stored stage at its measured time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tunedb.collect import Collector, Job
from tunedb.collect.stage_rows import KIND, SCHEME, member_text, records_of, stage_records, write_stage_rows
from tunedb.costmodel.stage import family_of
from tunedb.records import DeviceInfo, Protocol, Workload
from tunedb.runtime.device import clocks, device_info, device_uuid
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.store.core import TuningStore

__all__ = ["KIND", "SCHEME", "StageCollector", "StageDevice", "StageSpec", "import_rows", "measure_stages",
           "member_text", "records_of", "stage_records", "store_stage_rows"]
COLLECTOR = "stage"
COPIES, REPS, SAMPLES = 5, 4, 3   # a stage's graph holds COPIES copies, replayed REPS times per sample
HARNESS_STREAMS = 8               # the widest stage the harness runs (IOS's s = 8)
Groups = Sequence[Sequence[int]]


def _time_stage(ex: Any, groups: tuple[tuple[int, ...], ...], copies: int, reps: int,
                samples: int) -> dict[str, Any]:
    """One row: ``groups`` timed ``samples`` times by a harness executor, or why it failed."""
    row: dict[str, Any] = {"groups": [list(g) for g in groups]}
    try:
        row["samples_us"] = [ex.time_stage(groups, copies=copies, reps=reps) for _ in range(samples)]
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a failing stage is a row
        row.update(status="runtime_error", message=" ".join(str(e).split())[:300])
    return row


def measure_stages(plan: Any, stages: Iterable[tuple[Groups, str]], *, copies: int = 5, reps: int = 4,
                   samples: int = 3) -> list[dict[str, Any]]:
    """Time each ``(groups, key)`` stage of ``plan`` (a plan whose values never share memory:
    buffers planned with one time for every step) on this machine's GPU; ``key`` is the stage's
    ``StageKeys`` key. One row per stage, failures included."""
    todo = [(tuple(tuple(g) for g in st), key) for st, key in stages]
    ex = StagedExecutor(plan, stage_streams=max([len(st) for st, _ in todo] + [1]), capture=False)
    try:
        return [{**_time_stage(ex, st, copies, reps, samples), "key": key} for st, key in todo]
    finally:
        ex.close_streams()


def store_stage_rows(db: str | Path, plan: Any, rows: Sequence[dict[str, Any]], device: DeviceInfo,
                     config: dict[str, Any], *, copies: int = 5, reps: int = 4) -> dict[str, int]:
    """One Run holding every row (ok or not); returns the counts of rows added."""
    with TuningStore.open(db) as store:
        return write_stage_rows(store, plan.steps, plan.graph.name, rows, device, config, COLLECTOR,
                                copies=copies, reps=reps)


class JsonStep:
    """A plan step known by its JSON (``KernelStep.to_json``): what a stage row needs of it."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d, self.kind = d, d["kind"]
        self.workload_hash = d.get("workload_hash", "")
        self.config_dict = dict(d.get("config", {}))

    def to_json(self) -> dict[str, Any]:
        return self.d


class JsonPlan:
    """A plan's JSON with ``steps`` as ``JsonStep`` and ``graph.name``: enough to store its rows."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.steps = [JsonStep(s) for s in d["steps"]]
        self.graph = SimpleNamespace(name=str(d.get("graph", {}).get("name", "")))


def import_rows(rows_file: str | Path, db: str | Path) -> dict[str, int]:
    """Store every row of a stage bench's rows file (``OUT_rows.json``: per graph its plan and
    measured stages) in ``db``: one Run per graph with its ``case`` (the bench's name) in the
    Run's config, which the stage cost model reads as the model family. The board is the file's
    ``device_info``, else a device known by the file's device name alone."""
    doc = json.loads(Path(rows_file).read_text())
    info = doc.get("device_info") or {"name": doc.get("device") or "unknown", "uuid_hash": "",
                                      "compute_capability": "", "sm_count": 0, "l2_bytes": 0,
                                      "memory_bytes": 0, "driver": "", "cuda_runtime": "", "cupy_version": ""}
    device = DeviceInfo(**info)
    total: dict[str, int] = {}
    for name, case in sorted(doc["cases"].items()):
        plan = JsonPlan(case["plan"])
        rows = [r for r in case["rows"] if not all(plan.steps[i].kind == "layout_view"
                                                   for g in r["groups"] for i in g)]
        counts = store_stage_rows(db, plan, rows, device, {"case": name, "family": family_of(name),
                                                           "source": Path(rows_file).name})
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total


@dataclass(frozen=True)
class StageSpec:
    """One stage candidate of a candidates file: the graph (``case``) whose plan its step indices
    refer to, its groups, and its ``StageKeys`` key."""

    case: str
    groups: tuple[tuple[int, ...], ...]
    key: str


def candidate_jobs(doc: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[Job]]:
    """A candidates file's plans by case and one ``Job`` per stage workload (its members); the
    same members split another way, or met in another graph, are candidates of the same job."""
    plans: dict[str, dict[str, Any]] = {}
    jobs: dict[str, tuple[Workload, list[tuple[dict, StageSpec]]]] = {}
    seen: set[str] = set()
    for name, case in sorted(doc["cases"].items()):
        plans[name] = case["plan"]
        plan = JsonPlan(case["plan"])
        for r in case["rows"]:
            groups = tuple(tuple(int(i) for i in g) for g in r["groups"])
            if all(plan.steps[i].kind == "layout_view" for g in groups for i in g):
                continue  # views only: nothing launches
            w, c = stage_records(plan.steps, groups, str(r["key"]))
            if c.hash in seen:
                continue
            seen.add(c.hash)
            jobs.setdefault(w.hash, (w, []))[1].append((c.config, StageSpec(name, groups, str(r["key"]))))
    return plans, [Job(w, specs) for w, specs in jobs.values()]


class StageDevice:
    """Times stage candidates on this machine's GPU, in this process: per graph one harness
    executor (``StagedExecutor(plan, stage_streams=8)``, built from the plan's JSON by
    ``load_plan``, which must keep every value apart). A stage that fails is a row."""

    kind = "cuda"

    def __init__(self, plans: Mapping[str, dict[str, Any]], load_plan: Callable[[dict[str, Any]], Any],
                 protocol: Protocol | None = None) -> None:
        self.info = device_info()
        self.uuid = device_uuid()
        self.protocol = protocol or Protocol(warmup=3, samples=SAMPLES, flush_l2=False, batch=COPIES * REPS)
        self.plans, self.load_plan = plans, load_plan
        self._case, self._ex = "", None
        self._counts: dict[str, int] = {}

    def clocks(self) -> dict[str, float]:
        return clocks(self.uuid)

    def prefetch(self, requests: list[MeasureRequest], workload: Workload | None = None) -> None:
        return None  # the harness builds every step once per stream when a graph comes up

    def _executor(self, case: str) -> Any:
        if case != self._case:
            self.close()
            self._ex = StagedExecutor(self.load_plan(self.plans[case]), stage_streams=HARNESS_STREAMS,
                                      capture=False)
            self._case = case
        return self._ex

    def measure(self, workload: Workload, requests: list[MeasureRequest]
                ) -> Iterator[tuple[int, MeasureResult]]:
        for i, req in enumerate(requests):
            if req.error:
                res = MeasureResult.failure("compile_error", req.error)
            else:
                groups = tuple(tuple(g) for g in req.plan["groups"])
                try:
                    if len(groups) > HARNESS_STREAMS:
                        raise ValueError(f"{len(groups)} groups: the harness runs at most {HARNESS_STREAMS}")
                    row = _time_stage(self._executor(req.plan["case"]), groups, COPIES, REPS,
                                      self.protocol.samples)
                except Exception as e:  # noqa: BLE001 - a plan that cannot be built fails its stages
                    row = {"status": "runtime_error", "message": " ".join(str(e).split())[:300]}
                res = (MeasureResult("ok", tuple(row["samples_us"])).checked() if row["status"] == "ok"
                       else MeasureResult.failure("runtime_error", row["message"]))
            self._counts[res.status] = self._counts.get(res.status, 0) + 1
            yield i, res

    def stats(self) -> dict:
        return {f"status_{k}": v for k, v in sorted(self._counts.items())}

    def close(self) -> None:
        if self._ex is not None:
            self._ex.close_streams()
        self._case, self._ex = "", None


class StageCollector(Collector):
    """``tunedb collect --collector stage --suite CANDIDATES.json`` (module docstring)."""

    name = COLLECTOR
    kind = KIND

    def __init__(self) -> None:
        self.plans: dict[str, dict[str, Any]] = {}  # filled by jobs(); the device reads it

    def jobs(self, suite: str) -> Iterator[Job]:
        path = Path(suite)
        if not path.is_file():
            raise ValueError(f"the stage collector's suite is a stage candidates file "
                             f"(python -m tunedb.bench.stages FILE --candidates); {suite} is not a file")
        try:
            doc = json.loads(path.read_text())
            plans, jobs = candidate_jobs(doc)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{suite} is not a stage candidates file: {type(e).__name__}: {e}") from None
        self.plans.clear()
        self.plans.update(plans)
        yield from jobs

    def build(self, workload: Workload, spec: StageSpec) -> tuple[str, dict]:
        return "", {"case": spec.case, "groups": [list(g) for g in spec.groups]}

    def open_device(self, spec: str, **kw: Any) -> Any:
        load_plan = kw.pop("load_plan", None)
        if spec in ("cuda", "gpu"):
            if load_plan is None:
                raise ValueError("the stage collector times plans: it needs the planner's load_plan "
                                 "(tunedb collect lends it)")
            return StageDevice(self.plans, load_plan, protocol=kw.get("protocol"))
        if spec == "emu":
            raise ValueError("stage candidates are timed on streams: no CPU emulation; "
                             "use cuda or replay:PATH")
        return super().open_device(spec, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collectors.stage ROWS.json DB``: store a stage bench's rows in a database."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m collectors.stage ROWS.json DB.duckdb", file=sys.stderr)
        return 2
    try:
        counts = import_rows(args[0], args[1])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: cannot import {args[0]}: {' '.join(str(e).split())[:200]}", file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

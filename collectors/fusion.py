"""``FusionCollector``: fused memory-bound kernels of a suite, one candidate per legal schedule.

suite -> workloads (``tunedb.kernels.suite``) -> ``schedule_space(graph)`` (legal schedules are
measured; pruned ones are only counted) -> ``generate(graph, schedule)`` -> the device.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

from tunedb.collect import Collector, Job
from tunedb.kernels import generate, schedule_space
from tunedb.kernels import suite as load_suite
from tunedb.records import Workload
from tunedb.runtime.cuda import plan_to_wire


def schedule_config(schedule: Any) -> dict:
    """A schedule as the candidate's config dict of JSON scalars."""
    for attr in ("config", "to_config"):
        v = getattr(schedule, attr, None)
        if v is not None:
            v = v() if callable(v) else v
            return dict(v.items() if isinstance(v, Mapping) else v)
    if hasattr(schedule, "to_json"):
        v = schedule.to_json()
        return dict(json.loads(v) if isinstance(v, str) else v)
    if dataclasses.is_dataclass(schedule):
        return dataclasses.asdict(schedule)
    if isinstance(schedule, Mapping):
        return dict(schedule)
    raise TypeError(f"cannot turn schedule {schedule!r} into a config")


def _count(x: Any) -> int:
    if isinstance(x, int):
        return x
    try:
        return len(x)
    except TypeError:
        return 0


class FusionCollector(Collector):
    name = "fusion"
    kind = "fusion"

    def __init__(self) -> None:
        self.device_info = None
        self.unsupported: list[str] = []  # suite cases the generator does not handle, with why

    def jobs(self, suite: str) -> Iterator[Job]:
        seen: set[str] = set()
        for case in load_suite(suite):
            graph = case.graph
            workload = Workload.from_graph(graph, case.family, case.name)
            if workload.hash in seen:  # two cases of the same canonical graph: measure once
                continue
            seen.add(workload.hash)
            info = getattr(self, "device_info", None)
            try:
                kw = {"sm_count": info.sm_count} if info is not None else {}
                legal, pruned = schedule_space(graph, **kw)
            except ValueError as e:  # UnsupportedFusion: outside the generator; nothing to measure
                self.unsupported.append(f"{case.name}: {e}")
                continue
            specs = []
            configs: set[str] = set()
            for s in legal:
                cfg = schedule_config(s)
                key = json.dumps(cfg, sort_keys=True, default=str)
                if key not in configs:
                    configs.add(key)
                    specs.append((cfg, (graph, s)))
            yield Job(workload, specs, _count(pruned))

    def spec_from_config(self, workload: Workload, config: dict) -> Any:
        """The spec of a stored config, so that a cluster worker generates code itself."""
        from tunedb.kernels.schedule import Schedule

        return workload.graph, Schedule.from_config(config)

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        graph, schedule = spec
        plan = generate(graph, schedule)
        return str(getattr(plan, "source_hash", "")), plan_to_wire(plan)

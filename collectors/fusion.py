"""``FusionCollector``: fused memory-bound kernels of a suite, one candidate per legal schedule.

suite -> workloads (``tunedb.kernels.suite``) -> ``schedule_space(graph)`` (legal schedules are
measured; pruned ones are only counted) -> ``generate(graph, schedule)`` -> the device.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tunedb.collect import Collector, Job
from tunedb.kernels import generate, schedule_space
from tunedb.kernels import suite as load_suite
from tunedb.kernels.schedule import Schedule
from tunedb.records import Workload
from tunedb.runtime.cuda import plan_to_wire


class FusionCollector(Collector):
    name = "fusion"
    kind = "fusion"

    def __init__(self) -> None:
        self.unsupported: list[str] = []  # suite cases the generator does not handle, with why

    def jobs(self, suite: str) -> Iterator[Job]:
        seen: set[str] = set()
        for case in load_suite(suite):
            graph = case.graph
            workload = Workload.from_graph(graph, case.family, case.name)
            if workload.hash in seen:  # two cases of the same canonical graph: measure once
                continue
            seen.add(workload.hash)
            kw = {"sm_count": self.device_info.sm_count} if self.device_info is not None else {}
            try:
                legal, pruned = schedule_space(graph, **kw)
            except ValueError as e:  # UnsupportedFusion: outside the generator; nothing to measure
                self.unsupported.append(f"{case.name}: {e}")
                continue
            specs = {}
            for s in legal:  # schedules that differ only outside their config are one candidate
                cfg = s.to_config()
                specs.setdefault(json.dumps(cfg, sort_keys=True), (cfg, (graph, s)))
            yield Job(workload, list(specs.values()), len(pruned))

    def spec_from_config(self, workload: Workload, config: dict) -> Any:
        """The spec of a stored config, so that a Dask worker generates the code itself."""
        return workload.graph, Schedule.from_config(config)

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        graph, schedule = spec
        plan = generate(graph, schedule)
        return str(getattr(plan, "source_hash", "")), plan_to_wire(plan)

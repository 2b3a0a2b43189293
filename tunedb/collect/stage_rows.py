"""Stage rows (kind ``stage``): an IOS stage candidate and its measurement as database records.

A stage is named by what runs, not by where in a graph it runs. Its ``Workload`` is the set of
its members: each member is a step's kind, workload hash and schedule. The workload uses family
``stage``, and its graph_json is scheme ``tunedb.stage/2``: the sorted member texts and each
member's facts (``tunedb.costmodel.stage.member_facts``), which the ``stage`` cost model reads.
Its ``Candidate`` (kind ``stage``) is the split into groups: the member indices of each group in
run order, groups sorted, with the stage key of ``tunedb.plan.stages.StageKeys``. A stage that
failed to build or run is a row too (status ``runtime_error``, with its one-line message).

Here, below the planner, so that ``tunedb.compile(..., measure_top=...)`` stores the stages it
measures and the ``collectors.stage`` plugin writes the same rows. Steps are duck-typed (``kind``,
``workload_hash``, ``config_dict``, ``to_json()``): nothing here imports the planner.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from tunedb._version import __version__
from tunedb.costmodel.stage import member_facts
from tunedb.graph.hashing import sha256_hex
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload, canonical_json

KIND = "stage"
SCHEME = "tunedb.stage/2"  # 2: the members' facts (FLOPs, bytes, CTAs, launches) for the stage model
Groups = Sequence[Sequence[int]]


def member_text(step: Any) -> str:
    """The same text ``StageKeys`` hashes for a member."""
    return f"{step.kind}:{step.workload_hash}:{sorted(step.config_dict.items())}"


def stage_records(steps: Sequence[Any], groups: Groups, key: str) -> tuple[Workload, Candidate]:
    texts = [member_text(steps[i]) for g in groups for i in g]
    members = sorted(texts)
    facts = {member_text(steps[i]): member_facts(steps[i].to_json()) for g in groups for i in g}
    doc = {"scheme": SCHEME, "members": members, "facts": [facts[t] for t in members]}
    text = canonical_json(doc)
    w = Workload(sha256_hex(text), "stage", f"stage of {len(texts)} steps", text)
    # each member's place in the sorted list (a repeated member takes its next free place)
    free: dict[str, list[int]] = {}
    for k, t in enumerate(members):
        free.setdefault(t, []).append(k)
    placed = sorted([free[member_text(steps[i])].pop(0) for i in g] for g in groups)
    cfg = {"groups": json.dumps(placed), "width": len(groups), "key": key}
    return w, Candidate(w.hash, KIND, cfg)


def records_of(steps: Sequence[Any], rows: Iterable[dict[str, Any]], device_id: str, run_id: str,
               protocol: Protocol) -> tuple[list[Workload], list[Candidate], list[Measurement]]:
    ws, cs, ms = [], [], []
    for row in rows:
        w, c = stage_records(steps, row["groups"], row["key"])
        ws.append(w)
        cs.append(c)
        ok = row.get("status") == "ok"
        ms.append(Measurement(c.hash, device_id, run_id, "ok" if ok else "runtime_error",
                              tuple(row.get("samples_us", ())) if ok else (),
                              error="" if ok else row.get("message", "failed"),
                              protocol_json=protocol.to_json()))
    return ws, cs, ms


def write_stage_rows(store: Any, steps: Sequence[Any], graph_name: str, rows: Sequence[dict[str, Any]],
                     device: DeviceInfo, config: dict[str, Any], collector: str = "stage", *,
                     copies: int = 5, reps: int = 4) -> dict[str, int]:
    """One Run of ``collector`` holding every row (ok or not) in an open, writable store;
    returns the counts of rows added."""
    protocol = Protocol(warmup=3, samples=max([len(r.get("samples_us", ())) for r in rows] + [1]),
                        flush_l2=False, batch=copies * reps)
    run_id = str(uuid.uuid4())
    ws, cs, ms = records_of(steps, rows, device.id, run_id, protocol)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run = Run(run_id, collector, __version__, "", socket.gethostname(),
              canonical_json({**config, "graph": graph_name}), now, now)
    store.add_devices([device])
    store.add_runs([run])
    return {"workloads": store.add_workloads(ws), "candidates": store.add_candidates(cs),
            "measurements": store.add_measurements(ms)}

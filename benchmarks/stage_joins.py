"""Where a staged plan's time goes beyond its stage sum: barriers, concurrency and the harness.

    python benchmarks/stage_joins.py OUT.json [--budget-s=120] [--rounds=3] [--auto] [--no-harness]
                                     [--refine]

Inception V3 batch 1 (GPU). The schedules are the stored v6 run's (``stages_h200_v6_b1.json``:
the refined and the full oracle's stages, applied to today's IOS plan, whose steps are the same)
and today's predicted IOS schedule. Each staged plan is run two ways by ``StagedExecutor``:
``joins="stage"`` (a fork and a join per wide stage) and ``joins="dataflow"`` (no barrier: each
group waits only on the groups it conflicts with), and ``dataflow+priority`` (the longest
predicted path on a stream of the highest priority, the graph instantiated to honour it).
``refined_serial`` is the refined plan with each stage's groups run one after another on one
stream: the same kernels in the same stage order without concurrency. Every plan is verified
against the float64 reference and onnxruntime before it is timed; all are timed in interleaved
rounds (throughput mode, median µs).
``--auto``: ``tunedb.compile(model, schedule="auto")`` as a user calls it too (merge choice
included; timed once if its plan is one of the others).
``--refine``: the refinement loop and the full-profiling oracle run again here
(``stage_cases.refine``, as the stage bench does); their schedules (``refined_now``,
``oracle_now``) join the others, with stage and dataflow joins, with and without priority.
``+priority`` on stage joins: each wide stage's longest predicted group on the priority stream.
The harness part times each refined stage as the refinement does (``time_stage``, values kept
apart, 5 copies x 4 replays): concurrent, with its groups serial, and each step alone; the sums
set against the end-to-end times say how much of the gap is the stage barriers and how much the
harness (warm caches, no neighbours).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import _one_line, write_json
from tunedb.bench.peers import interleaved_rounds
from tunedb.bench.plan import ORT_SLACK, _free, _host, onnxruntime_outputs, verify
from tunedb.bench.provenance import provenance
from tunedb.bench.stage_cases import INPUT_SEED, cases, refine
from tunedb.bench.stages import ROUND_S, plan_digest
from tunedb.graph.reference import run_reference
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.merge import bind_constants
from tunedb.plan.stages import apply_stages
from tunedb.runtime.device import current_stream, device_info
from tunedb.runtime.graph_priority import graph_size
from tunedb.runtime.inputs import input_roles, make_inputs
from tunedb.runtime.stage_exec import StagedExecutor
from tunedb.runtime.streams import gc_paused

ROOT = Path(__file__).resolve().parents[1]
V6 = ROOT / "data" / "bench" / "stages_h200_v6_b1.json"


def _stages(doc: Any) -> list[tuple[tuple[int, ...], ...]]:
    return [tuple(tuple(int(i) for i in g) for g in st) for st in doc]


def _plans(graph: Any, dev: dict, want_auto: bool, rec: dict) -> dict[str, Any]:
    t = time.perf_counter()
    seq = compile_plan(graph, device="cuda", schedule="sequential", bias_epilogue=True)
    ios = compile_plan(graph, device="cuda", schedule="ios", bias_epilogue=True)
    base = replace(ios, stages=())
    v6 = json.loads(V6.read_text())["cases"]["inception_v3_b1"]
    refined = _stages(v6["refine"]["refined_stages"])
    plans = {"sequential": seq, "ios": ios,
             "refined": apply_stages(base, refined, {"schedule": "ios (measured, v6)"}),
             "oracle": apply_stages(base, _stages(v6["refine"]["oracle_full"]["oracle_stages"]),
                                    {"schedule": "ios (oracle, v6)"}),
             "refined_serial": apply_stages(base, [(tuple(i for g in st for i in g),) for st in refined],
                                            {"schedule": "ios (measured, v6), groups serial"})}
    rec["plan_s"] = round(time.perf_counter() - t, 2)
    if want_auto:
        t = time.perf_counter()
        roles = input_roles(graph)
        weights = [v for v in graph.inputs if roles.get(v, ("data", 0))[0] != "data"]
        plans["auto"] = compile_plan(bind_constants(graph, dev, weights), device="cuda", schedule="auto",
                                     bias_epilogue=True, merge="auto")
        rec["auto_plan_s"] = round(time.perf_counter() - t, 2)
    return plans


def _harness(base: Any, stages: list, rec: dict, deadline: float) -> None:
    """Refined stages in the refinement's harness: concurrent, serial, and each step alone."""
    steps = base.steps
    separate = replace(base, buffers=plan_buffers(base.graph, steps, times=[0] * len(steps)), stages=())
    t = time.perf_counter()
    h = StagedExecutor(separate, stage_streams=max(len(st) for st in stages), capture=False)
    rec["harness_build_s"] = round(time.perf_counter() - t, 2)

    def timed(groups: Any) -> float:
        if all(steps[i].kind == "layout_view" for g in groups for i in g):
            return 0.0
        return h.time_stage(groups, copies=5, reps=4)

    per = []
    for st in stages:
        if time.perf_counter() > deadline:
            rec["harness_error"] = "budget spent"
            break
        serial = (tuple(i for g in st for i in g),)
        row = {"groups": [list(g) for g in st], "concurrent_us": round(timed(st), 2)}
        if len(st) > 1:
            row["serial_us"] = round(timed(serial), 2)
            row["alone_us"] = round(sum(timed(((i,),)) for i in serial[0]), 2)
        else:
            row["serial_us"] = row["concurrent_us"]
        per.append(row)
    rec["stages"] = per
    rec["sum_concurrent_us"] = round(sum(r["concurrent_us"] for r in per), 1)
    rec["sum_serial_us"] = round(sum(r["serial_us"] for r in per), 1)
    h.close_streams()


def _graph_size(ex: Any) -> tuple[int | None, int | None]:
    """Nodes and edges of the executor's launches captured once more (a diagnostic)."""
    cp = ex.cp
    pool = cp.cuda.MemoryPool()
    try:
        with gc_paused(), current_stream(cp, ex.stream), cp.cuda.using_allocator(pool.malloc):
            return graph_size(ex.stream, ex._enqueue)
    except Exception:  # noqa: BLE001 - no count is no harm
        return None, None


def run(out: Path, budget_s: float, rounds: int, want_auto: bool, harness: bool,
        fresh: bool = False) -> dict:
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    info = device_info()
    res: dict[str, Any] = {"device": str(info.name), **provenance(), "rounds": rounds, "variants": {}}

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    graph, model = dict(cases())["inception_v3_b1"]()
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs = run_reference(graph, ref_in)
    ort = onnxruntime_outputs(model, graph, dev)
    plans = _plans(graph, dev, want_auto, res)
    say(f"planned in {res['plan_s']} s (+ auto {res.get('auto_plan_s')})")
    variants = [("sequential", "stage"), ("ios", "stage"), ("ios", "dataflow+priority"),
                ("refined", "stage"), ("refined", "stage+priority"), ("refined", "dataflow+priority"),
                ("oracle", "stage"), ("oracle", "stage+priority"), ("oracle", "dataflow+priority")]
    if not fresh:  # call 2's set: the plain dataflow joins and the refined groups run serially
        variants += [("ios", "dataflow"), ("refined", "dataflow"), ("oracle", "dataflow"),
                     ("refined_serial", "stage")]
    if fresh:
        base = replace(plans["ios"], stages=())
        ref = refine(base, say, deadline - 45, "full")
        ref.pop("all_rows", None)
        ref.pop("stage_rows", None)
        ref.pop("rounds", None)
        res["refine"] = ref
        plans["refined_now"] = apply_stages(base, _stages(ref["stages"]), {"schedule": "ios (measured)"})
        variants += [("refined_now", j) for j in ("stage", "stage+priority", "dataflow", "dataflow+priority")]
        full = ref.get("oracle_full") or {}
        if full.get("complete"):
            plans["oracle_now"] = apply_stages(base, _stages(full["oracle_stages"]),
                                               {"schedule": "ios (oracle)"})
            variants += [("oracle_now", j) for j in ("stage", "stage+priority", "dataflow+priority")]
        write_json(res, out)
    if "auto" in plans:
        res["auto_same_plan_as"] = next((k for k in ("ios", "sequential")
                                         if plan_digest(plans[k]) == plan_digest(plans["auto"])), None)
        if res["auto_same_plan_as"] is None:
            variants += [("auto", "stage"), ("auto", "dataflow")]
        res["auto_search"] = dict(plans["auto"].search)
    live: dict[str, Any] = {}
    try:
        for name, joins in variants:
            key = f"{name}/{joins}"
            rec: dict[str, Any] = {"kernels": plans[name].kernels, "stages": len(plans[name].stages),
                                   "wide_stages": sum(1 for st in plans[name].stages if len(st) > 1)}
            res["variants"][key] = rec
            try:
                ex = StagedExecutor(plans[name], joins=joins.split("+")[0], priority="+priority" in joins)
                rec["executor"] = {k: v for k, v in ex.summary().items() if k != "paths"}
                rec["graph_nodes"], rec["graph_edges"] = _graph_size(ex)
                got = _host(ex.run({v: dev[v] for v in graph.inputs}))
                rec["verify"] = {"reference": verify(graph, got, refs),
                                 "onnxruntime": verify(graph, got, ort, ORT_SLACK)}
                ok = rec["verify"]["reference"]["ok"] and rec["verify"]["onnxruntime"]["ok"]
                if ok and ex.graph_capture:
                    live[key] = ex
                else:
                    rec["error"] = "not verified or not captured: not timed"
            except Exception as e:  # noqa: BLE001 - a failure is a result
                rec["error"] = _one_line(e)
            say(f"{key}: built ({rec.get('error', 'ok')})")
        us, errors = interleaved_rounds({k: (ex.replay, ex.synchronize) for k, ex in live.items()},
                                        rounds, ROUND_S)
    finally:
        live.clear()
        _free(None)
    for key, rec in res["variants"].items():
        if key in errors:
            rec["error"] = errors[key]
        elif us.get(key):
            rec["us"], rec["rounds_us"] = round(float(np.median(us[key])), 2), us[key]
        say(f"{key}: {rec.get('us')} us")
    seq = res["variants"]["sequential/stage"].get("us")
    res["speedup_vs_sequential"] = {k: round(seq / r["us"], 4) for k, r in res["variants"].items()
                                    if seq and r.get("us")}
    write_json(res, out)
    if harness and time.perf_counter() < deadline:
        v6 = json.loads(V6.read_text())["cases"]["inception_v3_b1"]
        h: dict[str, Any] = {}
        res["harness"] = h
        try:
            _harness(replace(plans["ios"], stages=()), _stages(v6["refine"]["refined_stages"]), h, deadline)
        except Exception as e:  # noqa: BLE001
            h["error"] = _one_line(e)
        say(f"harness: concurrent sum {h.get('sum_concurrent_us')}, serial sum {h.get('sum_serial_us')}")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(res, out)
    return res


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    val = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if "=" in a}
    flags = ("--budget-s", "--rounds", "--auto", "--no-harness", "--refine")
    bad = [a for a in argv[1:] if a.split("=", 1)[0] not in flags]
    if bad:
        print(f"error: unknown argument {bad[0]!r}", file=sys.stderr)
        return 2
    run(Path(argv[0]), float(val.get("--budget-s", 120)), int(val.get("--rounds", 3)),
        "--auto" in argv, "--no-harness" not in argv, "--refine" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

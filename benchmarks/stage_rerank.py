"""Inception V3 b1: the sequential plan with and without packs, and the refinement's best few
schedules timed end to end (GPU).

    python benchmarks/stage_rerank.py OUT.json [--budget-s=100] [--rounds=3] [--top=4]
                                      [--max-rounds=80] [--no-horizontal] [--stages=FILE.json]
                                      [--again=NAME,...] [--oracle] [--prefetch=NAME,...]

Plans, all of Inception V3 batch 1 with the conv-bias lever, in one process:

- ``sequential``: ``compile(schedule="sequential")`` as shipped (packs where the packing model
  says they pay, horizontal merges of small sibling kernels);
- ``sequential_unpacked``: the same with ``pack=False``; ``sequential_plain``: ``pack=False,
  horizontal=False``, the steps the IOS search schedules, one after another on one stream;
- ``ios``: ``compile(schedule="ios")``, stages on predictions (``auto``'s plan on this graph);
- ``refined_1`` .. ``refined_K``: the refinement loop runs here (every operator alone first, up
  to ``--max-rounds`` rounds and 9.5 % of the stage candidates measured), and the ``--top``
  distinct schedules with the least measured stage sums (``top_schedules``) are each timed end
  to end; ``refined_e2e`` names the fastest of them (the loop's winner is ``refined_1``);
- ``refined_h``: the loop on the plan with horizontal merges (``horizontal=True``), its winner
  (skipped with ``--no-horizontal`` or when the budget is short);
- ``--stages=FILE.json``: schedules of an earlier run (its ``schedules``) timed again as
  ``again_<name>`` (``--again``: only those), so a winner picked from several is re-timed
  without the pick's bias;
  ``--top=0`` skips the loop;
- ``sequential+prefetch``, ``refined_1+prefetch``, ``oracle+prefetch`` (``--prefetch=NAME,...``:
  those plans instead, e.g. ``again_refined_2``): the same plans with
  the next stage's weights (8 steps' without stages) pulled into L2 on a side stream while a
  stage runs (``tunedb.runtime.stage_prefetch``): the harness times stages with warm weights;
- ``--oracle``: every stage candidate measured (IOS's full profiling, ``stage_cases.refine``
  with ``oracle="full"``), its schedule timed as ``oracle``; it stops measuring 30 s before the
  budget ends, and on Inception needs about 40 s of it (``--budget-s=75`` or more).

Staged plans run with stage joins (the default for measured schedules). Every plan is verified
against the float64 reference and onnxruntime before it is timed; all are timed together in
interleaved rounds (throughput mode, median µs). ``packs`` says, for each pack of the sequential
plan, where its two members sit in the loop's winner: concurrent (one stage, two groups) or not.
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
from tunedb.bench.stages import ROUND_S
from tunedb.graph.reference import run_reference
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.stage_refine import refine_stages, top_schedules
from tunedb.plan.stages import StageEstimator, StageKeys, apply_stages, ios_search
from tunedb.runtime.device import NoGPUError, device_info
from tunedb.runtime.inputs import make_inputs
from tunedb.runtime.stage_exec import StagedExecutor

PREFETCH = ("sequential", "refined_1", "oracle")  # the plans timed with the L2 prefetch too
MEASURE_SHARE = 0.095  # the loop stops before measuring more than this share of the candidates


def _groups(doc: Any) -> list[tuple[tuple[int, ...], ...]]:
    return [tuple(tuple(int(i) for i in g) for g in st) for st in doc]


def refine_top(base: Any, top: int, max_rounds: int, say: Any) -> tuple[dict[str, Any], list]:
    """The refinement loop on ``base`` (its stages dropped) in the GPU harness, and its ``top``
    best distinct schedules measured in full."""
    steps = base.steps
    separate = replace(base, buffers=plan_buffers(base.graph, steps, times=[0] * len(steps)), stages=())
    est = StageEstimator(steps, launch_us=base.launch_us)
    keys = StageKeys(steps)
    t = time.perf_counter()
    harness = StagedExecutor(separate, stage_streams=8, capture=False)
    rec: dict[str, Any] = {"harness_build_s": round(time.perf_counter() - t, 2)}
    candidates = ios_search(steps, est)[2].candidates
    times: dict[str, float] = {}
    gpu_s = 0.0

    def measure(groups: Any) -> float:
        nonlocal gpu_s
        key = keys(groups)
        if key not in times:
            t1 = time.perf_counter()
            times[key] = harness.time_stage(groups, copies=5, reps=4)
            gpu_s += time.perf_counter() - t1
        return times[key]

    try:
        ref = refine_stages(steps, measure, estimator=est, max_rounds=max_rounds, alone=True,
                            max_measured=int(MEASURE_SHARE * candidates))
    finally:
        harness.close_streams()
    best = top_schedules(ref, top)
    rec.update(candidates=candidates, measured=len(ref.measured),
               measured_fraction=round(len(ref.measured) / max(1, candidates), 4),
               rounds=len(ref.rounds), converged=ref.converged, search_s=round(ref.search_s, 2),
               measuring_s=round(gpu_s, 2), winner_us_sum=round(ref.total_us, 2),
               top_us_sums=[round(t, 2) for t, _ in best])
    say(f"refine: {len(ref.measured)} of {candidates} measured ({gpu_s:.1f} s GPU), "
        f"{len(ref.rounds)} rounds, converged {ref.converged}; top sums {rec['top_us_sums']}")
    return rec, [st for _, st in best]


def pack_places(seq: Any, base: Any, stages: list) -> list[dict[str, Any]]:
    """For each pack of ``seq``: its members' (stage, group, width) in ``stages`` over ``base``."""
    at = {s.nodes: i for i, s in enumerate(base.steps)}
    where = {i: (si, gi, len(st)) for si, st in enumerate(stages) for gi, g in enumerate(st) for i in g}
    out = []
    for p in seq.packs:
        members = [where.get(at.get(seq.steps[i].nodes, -1)) for i in p.steps]
        same = all(m is not None for m in members) and len({m[0] for m in members}) == 1
        out.append({"pack": p.label, "outputs": [seq.steps[i].outputs[0] for i in p.steps],
                    "places": members, "concurrent_in_stages": same and len({m[1] for m in members}) > 1})
    return out


def run(out: Path, budget_s: float, rounds: int, top: int, max_rounds: int, horizontal: bool,
        again: dict[str, Any] | None = None, oracle: bool = False,
        prefetch: tuple[str, ...] = PREFETCH) -> dict:
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    res: dict[str, Any] = {"device": str(device_info().name), **provenance(), "rounds": rounds,
                           "plans": {}, "schedules": {}}

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    graph, model = dict(cases())["inception_v3_b1"]()
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    refs = run_reference(graph, ref_in)
    ort = onnxruntime_outputs(model, graph, dev)
    say("reference and onnxruntime ready")
    kw = dict(device="cuda", bias_epilogue=True)
    plans = {"sequential": compile_plan(graph, schedule="sequential", **kw),
             "sequential_unpacked": compile_plan(graph, schedule="sequential", pack=False, **kw),
             "sequential_plain": compile_plan(graph, schedule="sequential", pack=False, horizontal=False,
                                              **kw),
             "ios": compile_plan(graph, schedule="ios", **kw)}
    base = replace(plans["ios"], stages=())
    say(f"planned; sequential packs {len(plans['sequential'].packs)}")
    tops: list = []
    if top > 0:
        res["refine"], tops = refine_top(base, top, max_rounds, say)
    for k, st in enumerate(tops, 1):
        plans[f"refined_{k}"] = apply_stages(base, st, {"schedule": f"ios (measured, top {k})"})
        res["schedules"][f"refined_{k}"] = [[list(g) for g in s] for s in st]
    if tops:
        res["packs"] = pack_places(plans["sequential"], base, tops[0])
    if horizontal and top > 0 and time.perf_counter() < t0 + 0.45 * budget_s:
        hbase = replace(plans["sequential_unpacked"], stages=())
        res["refine_h"], htops = refine_top(hbase, 1, max_rounds, say)
        if htops:
            plans["refined_h"] = apply_stages(hbase, htops[0], {"schedule": "ios (measured, horizontal)"})
            res["schedules"]["refined_h"] = [[list(g) for g in s] for s in htops[0]]
    if oracle:
        # 30 s left for building and timing the plans (call 2 of session 9 left none at 3/4)
        full = refine(base, say, deadline - 30, "full")
        got = full.get("oracle_full") or {}
        res["oracle"] = {k: v for k, v in got.items() if k != "oracle_stages"}
        if got.get("complete"):
            plans["oracle"] = apply_stages(base, _groups(got["oracle_stages"]), {"schedule": "ios (oracle)"})
            res["schedules"]["oracle"] = got["oracle_stages"]
    for name, st in (again or {}).items():
        if name.startswith("refined_h"):
            plans[f"again_{name}"] = apply_stages(replace(plans["sequential_unpacked"], stages=()),
                                                  _groups(st), {"schedule": f"ios ({name} again)"})
        else:
            plans[f"again_{name}"] = apply_stages(base, _groups(st), {"schedule": f"ios ({name} again)"})
    write_json(res, out)
    # +prefetch: the next stage's (or 8 steps') weights pulled into L2 on a side stream
    runs = [(name, plan, False) for name, plan in plans.items()]
    runs[4:4] = [(f"{k}+prefetch", plans[k], True) for k in prefetch if k in plans]
    live: dict[str, Any] = {}
    try:
        for name, plan, prefetch in runs:
            rec: dict[str, Any] = {"kernels": plan.kernels, "stages": len(plan.stages),
                                   "wide_stages": sum(1 for st in plan.stages if len(st) > 1),
                                   "packs": len(plan.packs)}
            res["plans"][name] = rec
            if time.perf_counter() > deadline - 20:
                rec["error"] = "budget spent before it was built"
                continue
            try:
                ex = StagedExecutor(plan, joins="stage", prefetch=prefetch)
                rec["prefetch_bytes"] = ex.summary()["prefetch_bytes"]
                got = _host(ex.run({v: dev[v] for v in graph.inputs}))
                rec["verify"] = {"reference": verify(graph, got, refs),
                                 "onnxruntime": verify(graph, got, ort, ORT_SLACK)}
                ok = rec["verify"]["reference"]["ok"] and rec["verify"]["onnxruntime"]["ok"]
                if ok and ex.graph_capture:
                    live[name] = ex
                else:
                    rec["error"] = "not verified or not captured: not timed"
            except Exception as e:  # noqa: BLE001 - a failure is a result
                rec["error"] = _one_line(e)
            say(f"{name}: built ({rec.get('error', 'ok')})")
        us, errors = interleaved_rounds({k: (ex.replay, ex.synchronize) for k, ex in live.items()},
                                        rounds, ROUND_S)
    finally:
        live.clear()
        _free(None)
    for name, rec in res["plans"].items():
        if name in errors:
            rec["error"] = errors[name]
        elif us.get(name):
            rec["us"], rec["rounds_us"] = round(float(np.median(us[name])), 2), us[name]
        say(f"{name}: {rec.get('us')} us")
    timed = {k: r["us"] for k, r in res["plans"].items() if r.get("us")}
    tops_timed = {k: v for k, v in timed.items() if k.startswith("refined_") and k[8:].isdigit()}
    if tops_timed:
        res["refined_e2e"] = min(tops_timed, key=lambda k: tops_timed[k])
    for basis in ("sequential", "sequential_unpacked"):
        if timed.get(basis):
            res[f"speedup_vs_{basis}"] = {k: round(timed[basis] / v, 4) for k, v in timed.items()}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(res, out)
    return res


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    val = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if "=" in a}
    try:
        budget, rounds, top, max_rounds = (float(val.get("--budget-s", 100)), int(val.get("--rounds", 3)),
                                           int(val.get("--top", 4)), int(val.get("--max-rounds", 80)))
    except ValueError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    flags = ("--budget-s", "--rounds", "--top", "--max-rounds", "--no-horizontal", "--stages", "--again",
             "--oracle", "--prefetch")
    bad = [a for a in argv[1:] if a.split("=", 1)[0] not in flags]
    if bad:
        print(f"error: unknown argument {bad[0]!r}", file=sys.stderr)
        return 2
    again = None
    if "--stages" in val:
        try:
            again = json.loads(Path(val["--stages"]).read_text())["schedules"]
            if "--again" in val:
                again = {k: again[k] for k in val["--again"].split(",")}
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --stages {val['--stages']}: no schedules ({_one_line(e)})", file=sys.stderr)
            return 2
    try:
        run(Path(argv[0]), budget, rounds, top, max_rounds, "--no-horizontal" not in argv, again,
            "--oracle" in argv, tuple(val["--prefetch"].split(",")) if "--prefetch" in val else PREFETCH)
    except NoGPUError as e:
        print(f"error: this bench needs a GPU ({_one_line(e)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

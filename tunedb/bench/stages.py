"""Stage scheduling on the GPU: sequential plan vs IOS plans vs torch.compile, one process.

    python -m tunedb.bench.stages OUT.json [--peers[=NAME,...]] [--refine] [--refine-all]
                                  [--oracle=block|full|none] [--concat-views] [--one-stream]
                                  [--merge[=KEY,...]] [--only=NAME,...] [--budget-s=200]
    python -m tunedb.bench.stages [OUT.json] --replay=ROWS.json [--no-alone]
    python -m tunedb.bench.stages [OUT.json] --auto-replay=BENCH.json [--stored=ROWS.json]
    python -m tunedb.bench.stages CANDIDATES.json --candidates [--only=NAME,...]

Per case (Inception V3 batch 1 and SqueezeNet 1.1 exported from torchvision, NASNet-A-style and
RandWire-style graphs from ``tunedb.graph.multibranch``; batch 1 and 16 except Inception): the
sequential plan (``tunedb.compile``, one stream, horizontal packing on), the IOS plan
(``schedule="ios"``), and ``auto``; each run by its executor (``StagedExecutor`` for stages, one
CUDA graph), verified first on inputs from ``make_inputs`` (weights normal(0, 1/sqrt(fan_in)))
against the float64 reference and, for the ONNX models, onnxruntime on the CPU; then timed in
throughput mode (``peers.throughput_us``). ``--peers``: torch.compile (default and
reduce-overhead) and JAX on the same graph and input values, TF32 off. ``--refine``: on every batch-1
graph, the measured refinement loop (measure every operator alone, then the winner's stages,
search again with the measurements, until the winner's stages are all measured) and the
full-profiling oracle on one block, or on the whole graph with ``--oracle=full`` (the oracle
command: every stage candidate measured, where a graph has at most ``ORACLE_MAX``); the refined
and the oracle's schedules then run end to end; ``auto_stored`` is ``auto``'s choice with the
stages measured so far as its database. Plans use ``bias_epilogue`` (Inception V3 also
without it: ``*_plain``); peers are torch.compile reduce-overhead, JAX and torch.compile
(``--peers=torch_compile_ro,...``: only those). ``--concat-views``: the plans with
``concat_views`` too (``sequential_views``, ``ios_views``, ``auto_views``; no ``*_plain``).
``--refine-all``: the refinement on every case, not only batch 1. ``--one-stream``: the
sequential plan without packs too (``sequential_one_stream``: packs may run their members on
streams). ``--merge``: the plans with sibling convolutions merged (IOS's merge strategy,
``tunedb.plan.merge``; the weights bound as constants, same values): ``sequential_merge``,
``ios_merge`` (every merge), ``auto_merge`` (``schedule="auto", merge="auto"``), with concat
views when ``--concat-views``; on Inception ``ios_merge_exact`` too (only the merges of one
kernel size: the 1x1 heads, no zero taps); with ``--refine`` the refinement on ``ios_merge`` too where it has
concurrent stages (``ios_merge_refined``); ``--merge=ios_merge,...`` only those variants.
``--only``'s order is the run order.
The JSON is rewritten after every case; ``--budget-s`` stops starting new work when spent.
Every measured stage goes to ``OUT_rows.json`` with the plan it belongs to; ``--replay`` runs the
refinement loop on the CPU against those times and compares it with the oracle (``replay``);
``python -m collectors.stage ROWS.json DB`` stores them as rows of kind ``stage``.
The loop first measures every operator alone and prices stages from those times
(``refine_stages(alone=True)``); ``--no-alone`` uses the roofline estimator instead.
``--candidates`` writes every stage candidate of each graph with its plan, the suite of
``tunedb collect --collector stage`` (CPU only).
``--auto-replay`` makes ``auto``'s predicted choice again on the CPU for each graph of a stored
run and sets it next to that run's measured times (``auto_replay``); ``--stored``: with that run's
stage rows as the database (``choose_auto``'s stored paths).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import _finite, _one_line, rel_l2, write_json
from tunedb.bench.peers import Frameworks, throughput_us
from tunedb.bench.plan import ORT_SLACK, _free, _host, _peer, _tf32_off, onnxruntime_outputs, verify
from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph
from tunedb.graph.reference import run_reference
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.merge import bind_constants
from tunedb.plan.record import Plan
from tunedb.plan.stage_refine import choose_auto, choose_auto_measured, refine_stages
from tunedb.plan.stages import StageEstimator, StageKeys, apply_stages, ios_search, search_blocks
from tunedb.runtime.device import device_info
from tunedb.runtime.inputs import input_roles, make_inputs
from tunedb.runtime.stage_exec import StagedExecutor

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "data" / "graphs" / "ios"
INPUT_SEED = 20240531
ORACLE_MAX = 6000  # full profiling only where a graph has at most this many stage candidates


def cases() -> list[tuple[str, Callable[[], tuple[Any, Any]]]]:
    """(name, loader) pairs; a loader gives (graph, onnx model or None)."""
    from tunedb.graph.onnx_import import import_onnx

    def onnx_case(file: str) -> Callable[[], tuple[Any, Any]]:
        def load() -> tuple[Any, Any]:
            import onnx

            path = GRAPHS / file
            return import_onnx(path, fill_initializers=False), onnx.load(str(path))
        return load

    out: list[tuple[str, Callable[[], tuple[Any, Any]]]] = [
        ("inception_v3_b1", onnx_case("inception_v3_b1.onnx"))]
    for b in (1, 16):
        out.append((f"squeezenet1_1_b{b}", onnx_case(f"squeezenet1_1_b{b}.onnx")))
        out.append((f"nasnet_a_b{b}", lambda b=b: (nasnet_a_graph(b), None)))
        out.append((f"randwire_b{b}", lambda b=b: (randwire_graph(b), None)))
    return out


def _run_plan(plan: Any, dev: dict, refs: dict, ort: dict | None, graph: Any) -> dict:

    rec: dict[str, Any] = {"us": None, "kernels": plan.kernels, "stages": len(plan.stages),
                           "wide_stages": sum(1 for st in plan.stages if len(st) > 1),
                           "search": dict(plan.search)}
    ex = None
    try:
        ex = StagedExecutor(plan)
        rec["executor"] = {k: v for k, v in ex.summary().items() if k != "paths"}
        got = _host(ex.run(dev))
        rec["verify"] = {"reference": verify(graph, got, refs)}
        if ort is not None:
            rec["verify"]["onnxruntime"] = verify(graph, got, ort, ORT_SLACK)
        ok = rec["verify"]["reference"]["ok"] and (ort is None or rec["verify"]["onnxruntime"]["ok"])
        if ok and ex.graph_capture:  # a timing counts only once the result is verified
            rec["us"] = _finite(throughput_us(ex.replay, ex.synchronize))
        elif not ok:
            rec["error"] = "outputs differ from the reference: not timed"
    except Exception as e:  # noqa: BLE001 - a failure is a result
        rec["error"] = _one_line(e)
    finally:
        del ex
        _free(None)
    return rec


def refine(base: Any, say: Callable[[str], None], deadline: float, oracle: str = "block",
           time_stage: Callable[[Any], float] | None = None, alone: bool = True) -> dict:
    """The measured-refinement loop and an oracle on ``base`` (a plan without horizontal
    packing): stages measured in a harness executor whose values never share memory.
    ``oracle``: ``"block"`` measures every candidate of the largest block, ``"full"`` every
    candidate of the graph (IOS's full profiling; until ``deadline``, estimates after it and
    ``complete`` false), ``"none"``. ``time_stage``: measure with this instead of the GPU
    harness (a CPU check of the bookkeeping)."""

    steps = base.steps
    stage_key = StageKeys(steps)
    separate = replace(base, buffers=plan_buffers(base.graph, steps, times=[0] * len(steps)), stages=())
    est = StageEstimator(steps, launch_us=base.launch_us)
    t0 = time.perf_counter()
    harness = StagedExecutor(separate, stage_streams=8, capture=False) if time_stage is None else None
    timer = time_stage or (lambda g: harness.time_stage(g, copies=5, reps=4))
    out: dict[str, Any] = {"harness_build_s": round(time.perf_counter() - t0, 2)}
    measured: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    gpu_s = 0.0

    def measure(groups: Any) -> float:
        nonlocal gpu_s
        key = stage_key(groups)
        if all(steps[i].kind == "layout_view" for g in groups for i in g):
            return 0.0  # views only: nothing to launch
        if key not in measured:
            t = time.perf_counter()
            measured[key] = timer(groups)
            rows.append({"groups": [list(g) for g in groups], "key": key, "status": "ok",
                         "samples_us": [measured[key]]})  # collectors/stage.py row format
            gpu_s += time.perf_counter() - t
        return measured[key]

    # the loop of tunedb.plan.stage_refine; its own dict of measurements, shared with the
    # oracle below only through the measuring function's cache
    ref = refine_stages(steps, measure, estimator=est, max_rounds=40, alone=alone)
    stages, total = ref.stages, ref.total_us
    out.update(rounds=ref.rounds, candidates=ref.candidates, measured=len(ref.measured),
               measured_fraction=round(ref.measured_fraction, 4), converged=ref.converged,
               search_s=round(ref.search_s, 2), measuring_s=round(gpu_s, 2),
               refined_us_sum=round(total, 2), refined_stages=[[list(g) for g in st] for st in stages])
    say(f"refine: {len(ref.measured)} of {ref.candidates} candidates measured ({gpu_s:.1f} s), "
        f"{len(ref.rounds)} rounds")
    refined_measured = dict(measured)  # before the oracle adds its own measurements
    refined_rows = len(rows)
    if oracle == "full":
        def full_cost(groups: Any) -> float:
            return measure(groups) if time.perf_counter() < deadline else est(groups)

        o_total, o_stages, o_stats = ios_search(steps, full_cost)
        complete = time.perf_counter() < deadline
        out["oracle_full"] = {"candidates": o_stats.candidates, "oracle_us": round(o_total, 2),
                              "refined_us": round(total, 2), "complete": complete,
                              "refined_converged": ref.converged,
                              "measured_fraction": round(len(refined_measured) / max(1, o_stats.candidates),
                                                         5),
                              "oracle_stages": [[list(g) for g in st] for st in o_stages],
                              "refined_vs_oracle": _finite(total / o_total) if o_total else None}
        say(f"oracle (full): {o_stats.candidates} candidates, {o_total:.1f} us vs refined {total:.1f} us"
            f"{'' if complete else ' (incomplete: budget)'}")
    if oracle == "block":
        # the largest block of the refinement's own search: its stages never leave it, so the
        # oracle there searches the space the loop searched, every candidate measured
        blocks = [b for b in search_blocks(steps) if len(b) >= 6]
        blk = max(blocks, key=len) if blocks else None
        if blk is not None and time.perf_counter() < deadline:
            def oracle_cost(groups: Any) -> float:
                return measure(groups) if time.perf_counter() < deadline else est(groups)

            o_total, o_stages, o_stats = ios_search(steps, oracle_cost, only=blk, max_endings=10**6)
            inside = [st for st in stages if all(i in blk for g in st for i in g)]
            # a refined stage leaving the block would mean the two searches cut blocks differently
            covered = {i for st in inside for g in st for i in g} == set(blk)
            r_total = (sum(refined_measured.get(stage_key(st), math.nan) for st in inside)
                       if covered else math.nan)
            out["oracle_block"] = {"steps": [blk[0], blk[-1]], "candidates": o_stats.candidates,
                                   "oracle_us": round(o_total, 2), "refined_us": _finite(r_total),
                                   "complete": time.perf_counter() < deadline,
                                   "oracle_stages": [[list(g) for g in st] for st in o_stages],
                                   "refined_stages": [[list(g) for g in st] for st in inside],
                                   "refined_vs_oracle": _finite(r_total / o_total) if o_total else None,
                                   "comparable": covered}
    out["measuring_s"] = round(gpu_s, 2)
    out["stage_rows"] = rows[:refined_rows]  # the refinement's own measurements
    out["all_rows"] = rows                   # every stage measured (the stage model's data)
    out["stages"] = [[list(g) for g in st] for st in stages]
    if harness is not None:
        harness.close_streams()
    return out


def _replay_case(plan: Any, table: dict[str, float], alone: bool, max_rounds: int) -> dict[str, Any]:
    steps, keys = plan.steps, StageKeys(plan.steps)
    missing: list[int] = []

    def truth(groups: Any) -> float:
        if all(steps[i].kind == "layout_view" for g in groups for i in g):
            return 0.0
        hit = table.get(keys(groups))
        if hit is None:
            missing.append(1)
            return math.inf
        return hit

    t = time.perf_counter()
    o_total, _, o_stats = ios_search(steps, truth)
    if missing:  # the oracle did not run on this graph: no reference to replay against
        return {"error": f"{len(missing)} candidates were never measured"}
    est = StageEstimator(steps, launch_us=plan.launch_us)
    ref = refine_stages(steps, truth, estimator=est, max_rounds=max_rounds, alone=alone)
    return {"candidates": o_stats.candidates, "oracle_us": round(o_total, 2),
            "refined_us": round(ref.total_us, 2), "refined_vs_oracle": ref.total_us / o_total,
            "measured": len(ref.measured), "measured_fraction": ref.measured_fraction,
            "rounds": len(ref.rounds), "converged": ref.converged, "cpu_s": round(time.perf_counter() - t, 2)}


def replay(rows_file: Path, alone: bool = True, max_rounds: int = 40) -> dict[str, Any]:
    """The refinement loop once more, on the CPU, against stage times a GPU run measured
    (``OUT_rows.json``: every candidate where the oracle ran): per graph, the loop's schedule,
    how many stages it measured, and the full-profiling oracle's schedule on the same times."""
    doc = json.loads(Path(rows_file).read_text())
    out: dict[str, Any] = {"rows": Path(rows_file).name, "device": doc.get("device"), "alone": alone,
                           "cases": {}}
    for name, case in doc["cases"].items():
        table = {r["key"]: float(np.median(r["samples_us"])) for r in case["rows"] if r.get("status") == "ok"}
        out["cases"][name] = _replay_case(Plan.from_json(case["plan"]), table, alone, max_rounds)
    return out


def candidates(only: list[str] | None = None) -> dict[str, Any]:
    """Every stage candidate of the IOS search (r = 3, s = 8: IOS's full profiling set) of each
    graph, with the plan its step indices refer to (the plan the refinement measures: IOS's, no
    horizontal packing, no stages): the suite of ``tunedb collect --collector stage``. CPU only."""
    out: dict[str, Any] = {"cases": {}}
    for name, load in cases():
        if only and name not in only:
            continue
        graph, _ = load()
        base = replace(compile_plan(graph, device="cuda", schedule="ios", bias_epilogue=True), stages=())
        keys = StageKeys(base.steps)
        rows: dict[str, list[list[int]]] = {}

        def record(groups: Any, keys: Any = keys, rows: dict = rows) -> float:
            rows.setdefault(keys(groups), [list(g) for g in groups])
            return 1.0

        ios_search(base.steps, record)
        out["cases"][name] = {"plan": base.to_json(),
                              "rows": [{"groups": g, "key": k} for k, g in rows.items()]}
    return out


def auto_replay(bench_file: Path, only: list[str] | None = None, stored_rows: Path | None = None
                ) -> dict[str, Any]:
    """``compile(schedule="auto")``'s choice, made again on the CPU for each graph of a stored GPU
    run (``OUT.json``), next to the run's measured sequential and IOS times: did ``auto`` keep the
    faster plan? Predicted, or with ``stored_rows`` (a run's ``OUT_rows.json``) as a database
    holding those stages would make it. Plans are rebuilt from today's code; kernel counts show
    whether they still match the ones that were timed."""
    doc = json.loads(Path(bench_file).read_text())
    tables = {} if stored_rows is None else {
        name: {r["key"]: float(np.median(r["samples_us"])) for r in case["rows"] if r.get("status") == "ok"}
        for name, case in json.loads(Path(stored_rows).read_text())["cases"].items()}
    out: dict[str, Any] = {"bench": Path(bench_file).name, "device": doc.get("device"), "cases": {},
                           "stored_rows": None if stored_rows is None else Path(stored_rows).name}
    for name, load in cases():
        rec = doc["cases"].get(name, {})
        seq_us, ios_us = rec.get("sequential", {}).get("us"), rec.get("ios", {}).get("us")
        if (only and name not in only) or not (seq_us and ios_us):
            continue
        graph, _ = load()
        sequential = compile_plan(graph, device="cuda", schedule="sequential", bias_epilogue=True)
        staged = compile_plan(graph, device="cuda", schedule="ios", bias_epilogue=True)
        auto = choose_auto(sequential, staged, tables.get(name))
        pick = "ios" if auto.stages else "sequential"
        search = dict(auto.search)
        predicted = (search["auto_predicted_ios_us"] / search["auto_predicted_sequential_us"]
                     if "auto_predicted_ios_us" in search else None)
        decided = (search["auto_ios_us"] / search["auto_sequential_us"]
                   if "auto_ios_us" in search else None)
        out["cases"][name] = {
            "picks": pick, "how": search["schedule"], "measured_sequential_us": round(seq_us, 1),
            "measured_ios_us": round(ios_us, 1),
            "predicted_ratio": None if predicted is None else round(predicted, 3),
            "stored_ratio": None if decided is None else round(decided, 3),
            "stored_share": search.get("auto_stored_share"),
            "measured_ratio": round(ios_us / seq_us, 3),
            "kept_the_faster": (pick == "ios") == (ios_us < seq_us),
            "auto_vs_sequential": round(seq_us / (ios_us if pick == "ios" else seq_us), 3),
            "kernels_now": [sequential.kernels, staged.kernels],
            "kernels_timed": [rec["sequential"].get("kernels"), rec["ios"].get("kernels")]}
    return out


PEERS = ("torch_compile_ro", "jax", "torch_compile")
MERGE_VARIANTS = (("sequential_merge", "sequential", True), ("ios_merge", "ios", True),
                  ("auto_merge", "auto", "auto"))
MERGE_KEYS = ("sequential_merge", "ios_merge", "auto_merge", "ios_merge_refined", "ios_merge_exact")


def run(out_path: Path, peers: bool | list[str], do_refine: bool, budget_s: float, only: list[str],
        oracle: str = "block", concat_views: bool = False, refine_all: bool = False,
        one_stream: bool = False, merge: bool | list[str] = False) -> dict:


    t_start = time.perf_counter()
    deadline = t_start + budget_s
    fw = Frameworks() if peers else None
    result: dict[str, Any] = {"device": str(device_info().name), "budget_s": budget_s, "cases": {}}
    if fw is not None:
        result["tf32"] = _tf32_off(fw)

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    kept: dict[str, tuple[Any, dict, dict]] = {}
    # every measured stage with the plan its step indices refer to: the stage model's data
    stage_data: dict[str, Any] = {}
    rows_path = out_path.with_name(out_path.stem + "_rows.json")
    # in the order ``only`` names them: what matters most runs before the budget is spent
    for name, load in sorted(cases(), key=lambda c: only.index(c[0]) if c[0] in only else len(only)):
        if only and name not in only:
            continue
        if time.perf_counter() > deadline:
            result["cases"][name] = {"error": "budget spent: not run"}
            continue
        rec: dict[str, Any] = {}
        result["cases"][name] = rec
        try:
            graph, model = load()
            dev, ref_in = make_inputs(graph, INPUT_SEED)
            refs = run_reference(graph, ref_in)
            ort = onnxruntime_outputs(model, graph, dev) if model is not None else None
            if ort is not None:
                rec["onnxruntime_vs_reference"] = max(rel_l2(ort[v], refs[v]) for v in graph.outputs)
            plans = {}
            variants = [("sequential", "sequential", True, False), ("ios", "ios", True, False)]
            if one_stream:  # packs of the sequential plan may run their members on streams
                variants += [("sequential_one_stream", "sequential", True, False)]
            if concat_views:  # the branches write their slices of each concat (no copy kernel)
                variants += [("sequential_views", "sequential", True, True), ("ios_views", "ios", True, True)]
            elif name == "inception_v3_b1":  # the plans before the bias moved into the epilogue
                variants += [("sequential_plain", "sequential", False, False),
                             ("ios_plain", "ios", False, False)]
            for key, sched, bias_epilogue, views in variants:
                t = time.perf_counter()
                plans[key] = compile_plan(graph, device="cuda", schedule=sched, bias_epilogue=bias_epilogue,
                                          concat_views=views,
                                          pack=False if key == "sequential_one_stream" else "auto")
                rec.setdefault("plan_s", {})[key] = round(time.perf_counter() - t, 2)
            if merge:  # the weights as constants (the values make_inputs drew): a merge needs them
                roles = input_roles(graph)
                weights = [v for v in graph.inputs if roles.get(v, ("data", 0))[0] != "data"]
                bound = bind_constants(graph, dev, weights)
                exact = [("ios_merge_exact", "ios", "exact")] if name.startswith("inception") else []
                for key, sched, how in (*MERGE_VARIANTS, *exact):
                    if merge is not True and key not in merge:
                        continue
                    t = time.perf_counter()
                    plans[key] = compile_plan(bound, device="cuda", schedule=sched, bias_epilogue=True,
                                              concat_views=concat_views, merge=how)
                    rec.setdefault("plan_s", {})[key] = round(time.perf_counter() - t, 2)
            inputs_of = {k: {v: dev[v] for v in p.graph.inputs} for k, p in plans.items()}
            for sched, plan in plans.items():
                rec[sched] = _run_plan(plan, inputs_of[sched], refs, ort, graph)
                if "merge" in sched:
                    rec[sched]["merged_convs"] = len(dict(plan.search).get("merged_convs", ()))
                say(f"{name} {sched}: {rec[sched].get('us')} us ({rec[sched].get('error', 'ok')})")
            auto = choose_auto(plans["sequential"], plans["ios"])
            rec["auto"] = {"picks": "ios" if auto.stages else "sequential",
                           "us": rec["ios" if auto.stages else "sequential"]["us"]}
            if rec["sequential"]["us"] and rec["ios"]["us"]:  # the measured choice: times above
                timed = {id(plans["sequential"]): rec["sequential"]["us"], id(plans["ios"]): rec["ios"]["us"]}
                measured = choose_auto_measured(plans["sequential"], plans["ios"],
                                                lambda p, t=timed: t[id(p)])
                pick = "ios" if measured.stages else "sequential"
                rec["auto_measured"] = {"picks": pick, "us": rec[pick]["us"]}
            if concat_views:
                auto = choose_auto(plans["sequential_views"], plans["ios_views"])
                pick = "ios_views" if auto.stages else "sequential_views"
                rec["auto_views"] = {"picks": pick, "us": rec[pick]["us"]}
            if do_refine and (refine_all or name.endswith("_b1")):
                base = replace(plans["ios"], stages=())
                small = dict(plans["ios"].search).get("ios_candidates", 0) <= ORACLE_MAX
                rec["refine"] = refine(base, say, deadline - 60, oracle if small else "none")
                rows = rec["refine"].pop("all_rows")
                stage_data[name] = {"plan": base.to_json(), "rows": rows}
                # auto as a compile would decide with these stages stored in its database
                table = {r["key"]: r["samples_us"][0] for r in rows}
                stored = choose_auto(plans["sequential"], plans["ios"], table)
                pick = "ios" if stored.stages else "sequential"
                rec["auto_stored"] = {"picks": pick, "how": dict(stored.search)["schedule"],
                                      "us": rec[pick]["us"]}
                write_json({"device": result["device"], "device_info": asdict(device_info()),
                            "cases": stage_data}, rows_path)
                st = [tuple(tuple(g) for g in s) for s in rec["refine"]["stages"]]
                rec["ios_refined"] = _run_plan(apply_stages(base, st, {"schedule": "ios (measured)"}),
                                               dev, refs, ort, graph)
                say(f"{name} ios refined: {rec['ios_refined'].get('us')} us")
                full = rec["refine"].get("oracle_full")
                if full and full.get("complete"):
                    st = [tuple(tuple(g) for g in s) for s in full["oracle_stages"]]
                    rec["ios_oracle"] = _run_plan(apply_stages(base, st, {"schedule": "ios (oracle)"}),
                                                  dev, refs, ort, graph)
                    say(f"{name} ios oracle: {rec['ios_oracle'].get('us')} us")
                if "ios_merge" in plans and any(len(st) > 1 for st in plans["ios_merge"].stages):
                    base = replace(plans["ios_merge"], stages=())
                    rec["refine_merge"] = refine(base, say, deadline - 30, "none")
                    rows = rec["refine_merge"].pop("all_rows")
                    stage_data[name + "_merge"] = {"plan": base.to_json(), "rows": rows}
                    st = [tuple(tuple(g) for g in s) for s in rec["refine_merge"]["stages"]]
                    refined = apply_stages(base, st, {"schedule": "ios (measured)"})
                    rec["ios_merge_refined"] = _run_plan(refined, inputs_of["ios_merge"], refs, ort, graph)
                    say(f"{name} ios merge refined: {rec['ios_merge_refined'].get('us')} us")
                    write_json({"device": result["device"], "device_info": asdict(device_info()),
                                "cases": stage_data}, rows_path)
            seq = rec["sequential"].get("us")
            rec["speedup_vs_sequential"] = {k: _finite(seq / rec[k]["us"]) if seq and rec.get(k, {}).get("us")
                                            else None for k in ("ios", "auto", "ios_refined", "ios_oracle",
                                                                *MERGE_KEYS) if k in rec}
            single = rec.get("sequential_one_stream", {}).get("us")
            if single:  # the sequential plan: one kernel at a time, one stream
                mine = ("sequential", "ios", "ios_refined", "ios_oracle")
                rec["speedup_vs_sequential_one_stream"] = {k: _finite(single / rec[k]["us"]) for k in mine
                                                           if rec.get(k, {}).get("us")}
            views = rec.get("sequential_views", {}).get("us")
            if views:  # the same lever on both sides
                mine = ("sequential", "ios_views", "auto_views", *MERGE_KEYS)
                rec["speedup_vs_sequential_views"] = {k: _finite(views / rec[k]["us"]) for k in mine
                                                      if rec.get(k, {}).get("us")}
            plain = rec.get("sequential_plain", {}).get("us")
            if plain:
                mine = ("sequential", "ios", "ios_plain", "ios_refined", "ios_oracle")
                rec["speedup_vs_sequential_plain"] = {k: _finite(plain / rec[k]["us"]) for k in mine
                                                      if rec.get(k, {}).get("us")}
            kept[name] = (graph, dev, refs)
        except Exception as e:  # noqa: BLE001 - recorded; the next case still runs
            rec["error"] = _one_line(e)
            say(f"{name}: {rec['error']}")
        _free(fw)
        write_json(result, out_path)
    # Peers last (torch.compile takes seconds per graph to compile): batch 1 first, and each
    # peer on every graph of a batch before the next peer, strongest peer first
    order = sorted(kept, key=lambda n: (not n.endswith("_b1"), n.startswith("inception"), n))
    tiers = [[n for n in order if n.endswith("_b1")], [n for n in order if not n.endswith("_b1")]]
    for names in tiers if fw is not None else ():
        for p in [q for q in PEERS if peers is True or q in peers]:
            for name in names:
                graph, dev, refs = kept[name]
                rec = result["cases"][name]
                if time.perf_counter() > deadline:
                    rec.setdefault("peers", {})[p] = {"error": "budget spent: not run"}
                    continue
                rec.setdefault("peers", {})[p] = _peer(fw, p, graph, dev, refs)
                _free(fw)
                say(f"{name} {p}: {rec['peers'][p].get('us')} us")
                ours = {k: rec[k]["us"] for k in ("sequential", "ios", "auto", "ios_refined", "ios_oracle",
                                                  "sequential_views", "ios_views", "auto_views", *MERGE_KEYS)
                        if rec.get(k, {}).get("us")}
                rec["speedup_vs_peer"] = {q: {k: _finite(r["us"] / u) for k, u in ours.items()}
                                          for q, r in rec.get("peers", {}).items() if r.get("us")}
                write_json(result, out_path)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_json(result, out_path)
    return result


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    # the two CPU replays: one stored file in, the result printed and written to OUT if given
    stored = next((Path(a.split("=", 1)[1]) for a in argv if a.startswith("--stored=")), None)
    replays = {"--auto-replay": lambda f: auto_replay(f, stored_rows=stored),
               "--replay": lambda f: replay(f, alone="--no-alone" not in argv)}
    for flag, make in replays.items():
        src = next((a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}=")), None)
        if src is None:
            continue
        try:
            res = make(Path(src))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot replay {src}: {_one_line(e)}", file=sys.stderr)
            return 1
        print(json.dumps(res, indent=1))
        if not argv[0].startswith("--"):
            write_json(res, Path(argv[0]))
        return 0
    only = [a.split("=", 1)[1] for a in argv if a.startswith("--only=")]
    names = ",".join(only).split(",") if only else []
    if "--candidates" in argv:
        write_json(candidates(names), Path(argv[0]))
        return 0
    budget = next((float(a.split("=", 1)[1]) for a in argv if a.startswith("--budget-s=")), 200.0)
    oracle = next((a.split("=", 1)[1] for a in argv if a.startswith("--oracle=")), "block")
    if oracle not in ("block", "full", "none"):
        print(f"error: --oracle must be block, full or none, got {oracle!r}", file=sys.stderr)
        return 2
    merge_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--merge=")), None)
    merge: bool | list[str] = "--merge" in argv if merge_arg is None else merge_arg.split(",")
    peer_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--peers=")), None)
    peers: bool | list[str] = "--peers" in argv if peer_arg is None else peer_arg.split(",")
    if peers is not True and peers and not set(peers) <= set(PEERS):
        print(f"error: --peers names one of {', '.join(PEERS)}, got {peer_arg!r}", file=sys.stderr)
        return 2
    run(Path(argv[0]), peers, "--refine" in argv, budget, names, oracle,
        concat_views="--concat-views" in argv, refine_all="--refine-all" in argv,
        one_stream="--one-stream" in argv, merge=merge)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

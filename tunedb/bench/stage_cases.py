"""The stage bench's graphs, its refinement loop with the oracle on the GPU, and its CPU replays.

``cases()``: Inception V3 batch 1 and SqueezeNet 1.1 exported from torchvision, NASNet-A-style and
RandWire-style graphs from ``tunedb.graph.multibranch``, at batch 1 and 16 (not Inception).
``refine``: the measured-refinement loop and an oracle on one plan, timed in a harness executor.
``replay``, ``auto_replay`` and ``candidates`` run on the CPU (``python -m tunedb.bench.stages``
documents the flags).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import _finite
from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.record import Plan
from tunedb.plan.stage_refine import choose_auto, refine_stages
from tunedb.plan.stages import StageEstimator, StageKeys, ios_search, search_blocks
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

"""Stage scheduling on the GPU: sequential plan vs IOS plans vs torch.compile, one process.

    python -m tunedb.bench.stages OUT.json [--peers[=NAME,...]] [--refine[=NAME,...]] [--refine-all]
                                  [--oracle=block|full|none] [--concat-views] [--one-stream]
                                  [--merge[=KEY,...]] [--only=NAME,...] [--budget-s=200] [--rounds=3]
                                  [--peers-only] [--plain] [--both-joins]
    python -m tunedb.bench.stages [OUT.json] --replay=ROWS.json [--no-alone]
    python -m tunedb.bench.stages [OUT.json] --auto-replay=BENCH.json [--stored=ROWS.json]
    python -m tunedb.bench.stages CANDIDATES.json --candidates [--only=NAME,...]

Per case (Inception V3 batch 1 and SqueezeNet 1.1 exported from torchvision, NASNet-A-style and
RandWire-style graphs from ``tunedb.graph.multibranch``; batch 1 and 16 except Inception): the
sequential plan (``tunedb.compile``, one stream, horizontal packing on), the IOS plan
(``schedule="ios"``), and ``auto``; each run by its executor (``StagedExecutor`` for stages, one
CUDA graph), verified first on inputs from ``make_inputs`` (weights normal(0, 1/sqrt(fan_in)))
against the float64 reference and, for the ONNX models, onnxruntime on the CPU; then the plans of
a case are timed together in ``--rounds`` interleaved rounds (``peers.interleaved_rounds``,
throughput mode; ``us`` is the median of the rounds). Plans that run the same kernels in the same
stages (``plan_digest``) are built and timed once: the others say ``same_plan_as`` and carry its
time. ``--peers``: torch.compile (default and reduce-overhead) and JAX on the same graph and input
values, TF32 off. ``--refine``: on every batch-1 graph (``--refine=NAME,...``: on those cases), the
measured refinement loop (measure every operator alone, then the winner's stages, search again
with the measurements, until the winner's stages are all measured) and the full-profiling oracle
on one block, or on the whole graph with ``--oracle=full`` (the oracle command: every stage
candidate measured, where a graph has at most ``ORACLE_MAX``); the refined and the oracle's
schedules are timed with the other plans; ``auto_stored`` is ``auto``'s choice with the stages
measured so far as its database. Plans use ``bias_epilogue`` (``--plain``: Inception V3 also
without it, ``*_plain``); peers are torch.compile reduce-overhead,
JAX and torch.compile (``--peers=torch_compile_ro,...``: only those; ``--peers-only``: the
peers alone, no plan of ours). ``--concat-views``: the
plans with ``concat_views`` too (``sequential_views``, ``ios_views``, ``auto_views``).
``--refine-all``: the refinement on every case, not only batch 1. ``--one-stream``: the
sequential plan without packs too (``sequential_one_stream``: packs may run their members on
streams). ``--merge``: the plans with sibling convolutions merged (IOS's merge strategy,
``tunedb.plan.merge``; the weights bound as constants, same values): ``sequential_merge``,
``ios_merge`` (every merge), ``auto_merge`` (``schedule="auto", merge="auto"``: what
``tunedb.compile(model, schedule="auto")`` gives a user), with concat views when
``--concat-views``; on Inception ``ios_merge_exact`` too (only the merges of one kernel size: the
1x1 heads, no zero taps); with ``--refine`` the refinement on ``ios_merge`` too where it has
concurrent stages (``ios_merge_refined``); ``--merge=ios_merge,...`` only those variants.
``--both-joins``: every staged plan also run with the staged executor's other ``joins`` (stage
barriers or dataflow, ``tunedb.runtime.stage_flow``), as ``KEY@JOINS``, in the same rounds.
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

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import _finite, _one_line, rel_l2, write_json
from tunedb.bench.peers import Frameworks, interleaved_rounds
from tunedb.bench.plan import ORT_SLACK, _free, _host, _peer, _tf32_off, onnxruntime_outputs, verify
from tunedb.bench.provenance import provenance
from tunedb.bench.stage_cases import (
    GRAPHS,
    INPUT_SEED,
    ORACLE_MAX,
    auto_replay,
    candidates,
    cases,
    refine,
    replay,
)
from tunedb.graph.reference import run_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.plan.merge import bind_constants
from tunedb.plan.record import Plan
from tunedb.plan.stage_refine import choose_auto, choose_auto_measured
from tunedb.plan.stages import apply_stages
from tunedb.runtime.device import NoGPUError, device_info
from tunedb.runtime.inputs import input_roles, make_inputs
from tunedb.runtime.stage_exec import JOINS, StagedExecutor, resolve_joins

__all__ = ["GRAPHS", "INPUT_SEED", "ORACLE_MAX", "auto_replay", "candidates", "cases", "main",
           "plan_digest", "refine", "replay", "run", "time_plans"]

ROUND_S = 0.1  # each round's throughput batches: 5 of about this long
# what a step runs, without the search's prices and notes (how the weights arrive is no part of it)
_NOT_RUN = ("predicted_us", "cost_source", "measured_us", "note", "workload_hash")


def plan_digest(plan: Plan) -> str:
    """A digest of what ``plan`` runs: its steps' kernels and values, stages, buffers and packs.
    Two plans with one digest are one plan timed twice: their difference would be noise."""
    doc = {"steps": [{k: v for k, v in s.to_json().items() if k not in _NOT_RUN} for s in plan.steps],
           "stages": [[list(g) for g in st] for st in plan.stages],
           "buffers": plan.buffers.to_json(), "packs": [p.to_json() for p in plan.packs]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def time_plans(plans: dict[str, Plan], dev: dict, refs: dict, ort: dict | None, graph: Any,
               rounds: int = 3, joins: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """One record per plan: each distinct plan (``plan_digest``) built, verified against the
    reference (and onnxruntime), and only then timed, all of them in ``rounds`` interleaved
    rounds; a plan equal to one before it says ``same_plan_as`` and carries that plan's time.
    ``joins``: key -> the staged executor's ``joins`` for that plan (else its default)."""
    recs: dict[str, dict[str, Any]] = {}
    first: dict[str, str] = {}
    live: dict[str, Any] = {}
    joins = joins or {}
    try:
        for key, plan in plans.items():
            digest = plan_digest(plan) + (f"@{joins[key]}" if key in joins else "")
            rec: dict[str, Any] = {"us": None, "kernels": plan.kernels, "stages": len(plan.stages),
                                   "wide_stages": sum(1 for st in plan.stages if len(st) > 1),
                                   "digest": digest, "search": dict(plan.search)}
            recs[key] = rec
            if digest in first:
                rec["same_plan_as"] = first[digest]
                continue
            first[digest] = key
            try:
                ex = StagedExecutor(plan, joins=joins.get(key))
                rec["executor"] = {k: v for k, v in ex.summary().items() if k != "paths"}
                got = _host(ex.run({v: dev[v] for v in plan.graph.inputs}))
                rec["verify"] = {"reference": verify(graph, got, refs)}
                if ort is not None:
                    rec["verify"]["onnxruntime"] = verify(graph, got, ort, ORT_SLACK)
                ok = rec["verify"]["reference"]["ok"] and (ort is None or rec["verify"]["onnxruntime"]["ok"])
                if ok and ex.graph_capture:  # a timing counts only once the result is verified
                    live[key] = ex
                elif not ok:
                    rec["error"] = "outputs differ from the reference: not timed"
            except Exception as e:  # noqa: BLE001 - a failure is a result
                rec["error"] = _one_line(e)
        us, errors = interleaved_rounds({k: (ex.replay, ex.synchronize) for k, ex in live.items()},
                                        rounds, ROUND_S)
    finally:
        live.clear()
        _free(None)
    for key, rec in recs.items():
        if key in errors:
            rec["error"] = errors[key]
        elif us.get(key):
            rec["us"], rec["rounds_us"] = _finite(float(np.median(us[key]))), us[key]
    for rec in recs.values():
        src = recs.get(rec.get("same_plan_as", ""))
        if src is not None:
            rec["us"] = src["us"]
            if "error" in src:
                rec["error"] = src["error"]
    return recs


PEERS = ("torch_compile_ro", "jax", "torch_compile")
MERGE_VARIANTS = (("sequential_merge", "sequential", True), ("ios_merge", "ios", True),
                  ("auto_merge", "auto", "auto"))
MERGE_KEYS = ("sequential_merge", "ios_merge", "auto_merge", "ios_merge_refined", "ios_merge_exact")
OURS = ("sequential", "ios", "auto", "ios_refined", "ios_oracle", "sequential_views", "ios_views",
        "auto_views", *MERGE_KEYS)


def _compile_case(name: str, graph: Any, dev: dict, rec: dict, concat_views: bool, one_stream: bool,
                  merge: bool | list[str], plain: bool = False) -> dict[str, Plan]:
    """The plans of one case, each with its planning time in ``rec["plan_s"]``."""
    plans: dict[str, Plan] = {}
    variants = [("sequential", "sequential", True, False), ("ios", "ios", True, False)]
    if one_stream:  # packs of the sequential plan may run their members on streams
        variants += [("sequential_one_stream", "sequential", True, False)]
    if concat_views:  # the branches write their slices of each concat (no copy kernel)
        variants += [("sequential_views", "sequential", True, True), ("ios_views", "ios", True, True)]
    if plain and name == "inception_v3_b1":  # the plans before the bias moved into the epilogue
        variants += [("sequential_plain", "sequential", False, False), ("ios_plain", "ios", False, False)]
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
    return plans


def _refine_case(name: str, plans: dict[str, Plan], rec: dict, say: Callable[[str], None],
                 deadline: float, oracle: str, stage_data: dict) -> None:
    """The refinement loop (and the oracle) on the IOS plan, and on ``ios_merge`` where it has
    concurrent stages: their schedules join ``plans``, the measured stages ``stage_data``."""
    base = replace(plans["ios"], stages=())
    small = dict(plans["ios"].search).get("ios_candidates", 0) <= ORACLE_MAX
    rec["refine"] = refine(base, say, deadline - 60, oracle if small else "none")
    stage_data[name] = {"plan": base.to_json(), "rows": rec["refine"].pop("all_rows")}
    st = [tuple(tuple(g) for g in s) for s in rec["refine"]["stages"]]
    plans["ios_refined"] = apply_stages(base, st, {"schedule": "ios (measured)"})
    full = rec["refine"].get("oracle_full")
    if full and full.get("complete"):
        st = [tuple(tuple(g) for g in s) for s in full["oracle_stages"]]
        plans["ios_oracle"] = apply_stages(base, st, {"schedule": "ios (oracle)"})
    if "ios_merge" in plans and any(len(st) > 1 for st in plans["ios_merge"].stages):
        base = replace(plans["ios_merge"], stages=())
        rec["refine_merge"] = refine(base, say, deadline - 30, "none")
        stage_data[name + "_merge"] = {"plan": base.to_json(), "rows": rec["refine_merge"].pop("all_rows")}
        st = [tuple(tuple(g) for g in s) for s in rec["refine_merge"]["stages"]]
        plans["ios_merge_refined"] = apply_stages(base, st, {"schedule": "ios (measured)"})


def _choices(plans: dict[str, Plan], rec: dict, stage_data: dict, name: str) -> None:
    """``auto``'s choices (predicted, measured end to end, with the measured stages stored), each
    with the time of the plan it picks."""
    auto = choose_auto(plans["sequential"], plans["ios"])
    pick = "ios" if auto.stages else "sequential"
    rec["auto"] = {"picks": pick, "us": rec[pick]["us"]}
    if rec["sequential"]["us"] and rec["ios"]["us"]:  # the measured choice: times above
        timed = {id(plans["sequential"]): rec["sequential"]["us"], id(plans["ios"]): rec["ios"]["us"]}
        measured = choose_auto_measured(plans["sequential"], plans["ios"], lambda p, t=timed: t[id(p)])
        pick = "ios" if measured.stages else "sequential"
        rec["auto_measured"] = {"picks": pick, "us": rec[pick]["us"]}
    if "sequential_views" in plans:
        pick = "ios_views" if choose_auto(plans["sequential_views"], plans["ios_views"]).stages \
            else "sequential_views"
        rec["auto_views"] = {"picks": pick, "us": rec[pick]["us"]}
    if name in stage_data:  # auto as a compile would decide with these stages in its database
        table = {r["key"]: r["samples_us"][0] for r in stage_data[name]["rows"]}
        stored = choose_auto(plans["sequential"], plans["ios"], table)
        pick = "ios" if stored.stages else "sequential"
        rec["auto_stored"] = {"picks": pick, "how": dict(stored.search)["schedule"], "us": rec[pick]["us"]}


def _speedups(rec: dict) -> None:
    seq = rec["sequential"].get("us")
    rec["speedup_vs_sequential"] = {k: _finite(seq / rec[k]["us"]) if seq and rec.get(k, {}).get("us")
                                    else None for k in ("ios", "auto", "ios_refined", "ios_oracle",
                                                        *MERGE_KEYS) if k in rec}
    for base, mine in (("sequential_one_stream", ("sequential", "ios", "ios_refined", "ios_oracle")),
                       ("sequential_views", ("sequential", "ios_views", "auto_views", *MERGE_KEYS)),
                       ("sequential_plain", ("sequential", "ios", "ios_plain", "ios_refined", "ios_oracle"))):
        ref = rec.get(base, {}).get("us")
        if ref:  # the same lever on both sides (one stream: the one kernel at a time)
            rec[f"speedup_vs_{base}"] = {k: _finite(ref / rec[k]["us"]) for k in mine
                                         if rec.get(k, {}).get("us")}


def run(out_path: Path, peers: bool | list[str], do_refine: bool | list[str], budget_s: float,
        only: list[str], oracle: str = "block", concat_views: bool = False, refine_all: bool = False,
        one_stream: bool = False, merge: bool | list[str] = False, rounds: int = 3,
        peers_only: bool = False, plain: bool = False, both_joins: bool = False) -> dict:
    """The bench (module docstring); the result as written to ``out_path``."""
    t_start = time.perf_counter()
    deadline = t_start + budget_s
    info = device_info()  # NoGPUError here, before anything is written
    fw = Frameworks() if peers else None
    result: dict[str, Any] = {"device": str(info.name), **provenance(), "budget_s": budget_s,
                              "rounds": rounds, "cases": {}}
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
            if peers_only:  # the peers of another run's plans (same graphs, seed and protocol)
                kept[name] = (graph, dev, refs)
                continue
            plans = _compile_case(name, graph, dev, rec, concat_views, one_stream, merge, plain)
            say(f"{name}: planned {', '.join(f'{k} {s} s' for k, s in rec['plan_s'].items())}")
            if (name in do_refine if isinstance(do_refine, list)
                    else do_refine and (refine_all or name.endswith("_b1"))):
                _refine_case(name, plans, rec, say, deadline, oracle, stage_data)
                write_json({"device": result["device"], "device_info": asdict(info), "cases": stage_data},
                           rows_path)
            other: dict[str, str] = {}
            if both_joins:  # every staged plan also with the joins its executor does not default to
                for k, p in list(plans.items()):
                    if any(len(st) > 1 for st in p.stages):
                        alt = next(j for j in JOINS if j != resolve_joins(p))
                        other[f"{k}@{alt}"] = alt
                        plans[f"{k}@{alt}"] = p
            for key, r in time_plans(plans, dev, refs, ort, graph, rounds, other).items():
                rec[key] = r
                if "merge" in key:
                    r["merged_convs"] = len(dict(plans[key].search).get("merged_convs", ()))
                same = f" (same plan as {r['same_plan_as']})" if "same_plan_as" in r else ""
                say(f"{name} {key}: {r.get('us')} us ({r.get('error', 'ok')}){same}")
            _choices(plans, rec, stage_data, name)
            _speedups(rec)
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
                ours = {k: rec[k]["us"] for k in OURS if rec.get(k, {}).get("us")}
                rec["speedup_vs_peer"] = {q: {k: _finite(r["us"] / u) for k, u in ours.items()}
                                          for q, r in rec.get("peers", {}).items() if r.get("us")}
                write_json(result, out_path)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_json(result, out_path)
    return result


_FLAGS = ("--peers", "--refine", "--refine-all", "--oracle=", "--concat-views", "--one-stream", "--merge",
          "--only=", "--budget-s=", "--rounds=", "--peers-only", "--plain", "--replay=", "--no-alone",
          "--auto-replay=", "--stored=", "--candidates", "--both-joins")


def _value(argv: list[str], flag: str) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")), None)


def _usage_error(argv: list[str]) -> str | None:
    """The first thing wrong with the arguments of a GPU run, as one line; None when none is."""
    if not argv or argv[0].startswith("-"):
        return "the first argument is the output JSON file"
    unknown = [a for a in argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f))
                                              or a.startswith(f + "=") for f in _FLAGS)]
    if unknown:
        return f"unknown argument {unknown[0]!r} (--help lists them)"
    names = {n for n, _ in cases()}
    for flag in ("--only", "--refine"):
        bad = [n for n in (_value(argv, flag) or "").split(",") if n and n not in names]
        if bad:
            return f"{flag} names a case of {', '.join(sorted(names))}, got {bad[0]!r}"
    if (_value(argv, "--oracle") or "block") not in ("block", "full", "none"):
        return f"--oracle must be block, full or none, got {_value(argv, '--oracle')!r}"
    bad = [k for k in (_value(argv, "--merge") or "").split(",") if k and k not in MERGE_KEYS]
    if bad:
        return f"--merge names one of {', '.join(MERGE_KEYS)}, got {bad[0]!r}"
    peer_arg = _value(argv, "--peers")
    if "--peers-only" in argv and peer_arg is None and "--peers" not in argv:
        return "--peers-only needs --peers (or --peers=NAME,...)"
    if peer_arg is not None and not set(peer_arg.split(",")) <= set(PEERS):
        return f"--peers names one of {', '.join(PEERS)}, got {peer_arg!r}"
    for flag, kind in (("--budget-s", float), ("--rounds", int)):
        text = _value(argv, flag)
        try:
            ok = text is None or kind(text) > 0
        except ValueError:
            ok = False
        if not ok:
            return f"{flag} must be a positive {kind.__name__}, got {text!r}"
    return None


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    # the two CPU replays: one stored file in, the result printed and written to OUT if given
    stored = next((Path(a.split("=", 1)[1]) for a in argv if a.startswith("--stored=")), None)
    replays = {"--auto-replay": lambda f: auto_replay(f, stored_rows=stored),
               "--replay": lambda f: replay(f, alone="--no-alone" not in argv)}
    for flag, make in replays.items():
        src = _value(argv, flag)
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
    problem = _usage_error(argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    names = [n for n in (_value(argv, "--only") or "").split(",") if n]
    if "--candidates" in argv:
        write_json(candidates(names), Path(argv[0]))
        return 0
    merge_arg, peer_arg = _value(argv, "--merge"), _value(argv, "--peers")
    refine_arg = _value(argv, "--refine")
    try:
        run(Path(argv[0]), "--peers" in argv if peer_arg is None else peer_arg.split(","),
            "--refine" in argv if refine_arg is None else refine_arg.split(","),
            float(_value(argv, "--budget-s") or 200.0), names, _value(argv, "--oracle") or "block",
            concat_views="--concat-views" in argv, refine_all="--refine-all" in argv,
            one_stream="--one-stream" in argv,
            merge="--merge" in argv if merge_arg is None else merge_arg.split(","),
            rounds=int(_value(argv, "--rounds") or 3), peers_only="--peers-only" in argv,
            plain="--plain" in argv, both_joins="--both-joins" in argv)
    except NoGPUError as e:
        print(f"error: no GPU for the stage bench: {_one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

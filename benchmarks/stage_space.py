"""What limits Inception V3's stages? The IOS schedule space modelled on the CPU from stored H200
stage times (``data/bench/stages_h200_v2_rows.json``: every stage candidate of Inception V3,
SqueezeNet 1.1 and RandWire b1, measured by the harness).

    python benchmarks/stage_space.py [--rows=ROWS.json] [--out=OUT.json]

Per graph, in µs of stage sums (the harness's times, not end to end):

1. ``sum alone``: every operator alone, one after another; ``critical path``: the longest chain
   of operators at their alone times (no schedule beats it); ``bound r, s``: the DP's best
   schedule when concurrent groups overlap perfectly (longest group + 1 µs per extra group), for
   several pruning settings (does a larger r or s pay?); ``block critical paths``: the sum over
   the search's blocks (equal to the whole graph's: stages across block edges cannot pay);
   ``oracle``: the DP on the measured times.
2. The contention model: a multi-group stage measured against its groups' alone times,
   ``t = a * longest + b * others + c * (groups - 1)`` by least squares, fitted on Inception and,
   out of family, on the two other graphs; the error on Inception's stages, and the schedule the
   DP picks with it (measured), against the oracle.
3. IOS's ``merged`` strategy for the convolutions that read one input (1x1, each Mixed block's
   branch heads): one GEMM of the summed rows, priced as its largest member plus the others'
   FLOPs at the marginal rate of Inception's measured 1x1 convolutions; the DP under the
   contention model and under perfect overlap, merged against as built.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tunedb.plan.cost import compute_flops
from tunedb.plan.record import Plan
from tunedb.plan.stages import StageKeys, ios_search, operator_units, search_blocks, step_dag

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "data" / "bench" / "stages_h200_v2_rows.json"
GRAPHS = ("inception_v3_b1", "squeezenet1_1_b1", "randwire_b1")
PRUNING = ((3, 8), (3, 3), (4, 8), (6, 8), (10, 8))


class Case:
    """One graph's plan, operators and stored stage times."""

    def __init__(self, case: dict[str, Any]) -> None:
        self.rows = case["rows"]
        self.steps = Plan.from_json(case["plan"]).steps
        self.keys = StageKeys(self.steps)
        preds, succs = step_dag(self.steps)
        self.units = operator_units(self.steps, preds, succs)
        self.unit_of = {i: u for u, m in enumerate(self.units) for i in m}
        self.upreds = [{self.unit_of[j] for i in m for j in preds[i]} - {u} for u, m in enumerate(self.units)]
        ok = [r for r in self.rows if r.get("status") == "ok"]
        self.table = {r["key"]: float(np.median(r["samples_us"])) for r in ok}
        self.alone = [0.0 if self.views_only(((m),)) else self.table.get(self.keys((m,)), math.nan)
                      for m in self.units]

    def views_only(self, groups: Any) -> bool:
        return all(self.steps[i].kind == "layout_view" for g in groups for i in g)

    def truth(self, groups: Any) -> float:
        return 0.0 if self.views_only(groups) else self.table.get(self.keys(groups), math.inf)

    def group_times(self, groups: Any) -> list[float]:
        times = (sum(self.alone[u] for u in {self.unit_of[i] for i in g}) for g in groups)
        return sorted(times, reverse=True)

    def critical_path(self, units: list[int]) -> float:
        inside, finish = set(units), {}
        for u in sorted(units):
            finish[u] = max([finish[p] for p in self.upreds[u] if p in inside], default=0.0) + self.alone[u]
        return max(finish.values(), default=0.0)


def perfect_overlap(groups_us: list[float]) -> float:
    return max(groups_us) + 1.0 * (len(groups_us) - 1)


def features(times: list[float]) -> tuple[float, float, int]:
    busy = sum(1 for t in times if t > 0)
    return times[0], sum(times[1:]), max(busy - 1, 0)


def fit_contention(cases: list[Case]) -> tuple[np.ndarray, int]:
    X, y = [], []
    for c in cases:
        for r in c.rows:
            if r.get("status") == "ok" and len(r["groups"]) > 1:
                f = features(c.group_times(r["groups"]))
                if not any(map(math.isnan, f)):
                    X.append(f)
                    y.append(float(np.median(r["samples_us"])))
    coef, *_ = np.linalg.lstsq(np.array(X), np.array(y), rcond=None)
    return coef, len(y)


def contention_cost(coef: np.ndarray):
    def cost(times: list[float]) -> float:
        return times[0] if len(times) == 1 else float(np.dot(coef, features(times)))
    return cost


def mape_on(c: Case, coef: np.ndarray) -> float:
    cost, errs = contention_cost(coef), []
    for r in c.rows:
        if r.get("status") == "ok" and len(r["groups"]) > 1:
            y = float(np.median(r["samples_us"]))
            errs.append(abs(cost(c.group_times(r["groups"])) - y) / y)
    return float(np.mean(errs))


def space(c: Case) -> dict[str, Any]:
    out: dict[str, Any] = {"operators": len(c.units), "sum_alone": sum(c.alone),
                           "critical_path": c.critical_path(list(range(len(c.units))))}
    blocks = search_blocks(c.steps)
    out["block_critical_paths"] = sum(c.critical_path(sorted({c.unit_of[i] for i in b})) for b in blocks)
    for r, s in PRUNING:
        total, _, stats = ios_search(c.steps, lambda g: perfect_overlap(c.group_times(g)), r=r, s=s,
                                     max_endings=10**5)
        out[f"bound_r{r}_s{s}"] = total
    out["oracle"] = ios_search(c.steps, c.truth)[0]
    return out


def merged_study(c: Case, coef: np.ndarray) -> dict[str, Any]:
    """Same-input 1x1 convolutions merged into one operator each (see the module docstring)."""
    pts, heads = [], {}
    for u, m in enumerate(c.units):
        st = c.steps[m[0]]
        if st.kind == "conv2d":
            w = st.graph.type_of(st.graph.nodes[0].inputs[1]).shape
            if w[2] == w[3] == 1:
                pts.append((compute_flops(st.graph)[0], c.alone[u]))
                heads.setdefault(st.inputs[0], []).append(u)
    per_flop, base = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    sets = [g for g in heads.values() if len(g) > 1]
    first = {u: g for g in sets for u in g[:1]}
    gone = {u for g in sets for u in g[1:]}
    io = [({v for i in m for v in c.steps[i].inputs}, {v for i in m for v in c.steps[i].outputs}, c.alone[u])
          for u, m in enumerate(c.units)]

    def unit_dp(units: list[tuple[set, set, float]], cost: Any) -> float:
        steps = [SimpleNamespace(kind="op", inputs=tuple(sorted(i - o)), outputs=tuple(sorted(o)))
                 for i, o, _ in units]
        return ios_search(steps, lambda gs: cost(sorted((sum(units[u][2] for u in g) for g in gs),
                                                        reverse=True)), contract=False)[0]

    merged = []
    for u in range(len(c.units)):
        if u in gone:
            continue
        g = first.get(u, [u])
        big = max(g, key=lambda x: c.alone[x])
        flops = {x: compute_flops(c.steps[c.units[x][0]].graph)[0] for x in g} if len(g) > 1 else {}
        t = c.alone[big] + per_flop * (sum(flops.values()) - flops.get(big, 0.0))
        merged.append((set().union(*(io[x][0] for x in g)), set().union(*(io[x][1] for x in g)), t))
    model = contention_cost(coef)
    return {"sets": len(sets), "convs": sum(map(len, sets)),
            "conv1x1_us": [round(base, 2), round(per_flop * 1e9, 2)],
            "sum_alone": [sum(t for _, _, t in io), sum(t for _, _, t in merged)],
            "contention_dp": [unit_dp(io, model), unit_dp(merged, model)],
            "perfect_overlap_dp": [unit_dp(io, perfect_overlap), unit_dp(merged, perfect_overlap)]}


def main(argv: list[str]) -> int:
    rows = Path(next((a.split("=", 1)[1] for a in argv if a.startswith("--rows=")), ROWS))
    out_path = next((a.split("=", 1)[1] for a in argv if a.startswith("--out=")), None)
    doc = json.loads(rows.read_text())
    cases = {n: Case(doc["cases"][n]) for n in GRAPHS}
    result: dict[str, Any] = {"rows": rows.name, "device": doc.get("device"), "space": {}, "contention": {}}
    print(f"stage sums, µs ({rows.name}, {doc.get('device')})")
    cols = (["sum_alone", "critical_path", "block_critical_paths"] + [f"bound_r{r}_s{s}" for r, s in PRUNING]
            + ["oracle"])
    print("| graph | " + " | ".join(cols) + " |")
    for name, c in cases.items():
        sp = result["space"][name] = space(c)
        print(f"| {name} | " + " | ".join(f"{sp[k]:.0f}" for k in cols) + " |")
    inception = cases["inception_v3_b1"]
    print("\ncontention model on Inception's multi-group stages: t = a*longest + b*others + c*(groups-1)")
    for label, train in (("in family (Inception)", ["inception_v3_b1"]),
                         ("out of family (SqueezeNet, RandWire)", ["squeezenet1_1_b1", "randwire_b1"])):
        coef, n = fit_contention([cases[t] for t in train])
        cost = contention_cost(coef)
        _, sched, _ = ios_search(inception.steps, lambda g, cost=cost: cost(inception.group_times(g)))
        measured = sum(inception.truth(st) for st in sched)
        oracle = result["space"]["inception_v3_b1"]["oracle"]
        result["contention"][label] = {"coef": [round(float(x), 3) for x in coef], "rows": n,
                                       "mape_inception": round(mape_on(inception, coef), 4),
                                       "dp_schedule_measured": round(measured, 1),
                                       "vs_oracle": round(measured / oracle, 4)}
        print(f"  {label}: a, b, c = {', '.join(f'{x:.3f}' for x in coef)} ({n} stages); MAPE on Inception "
              f"{mape_on(inception, coef):.3f}; its DP schedule measures {measured:.0f} us = "
              f"{measured / oracle:.4f} x the oracle, measuring only the operators alone")
    coef = np.array(result["contention"]["in family (Inception)"]["coef"])
    m = result["merged"] = merged_study(inception, coef)
    print(f"\nmerged 1x1 convs of one input ({m['sets']} sets, {m['convs']} convs; a 1x1 conv alone = "
          f"{m['conv1x1_us'][0]} us + {m['conv1x1_us'][1]} us/GFLOP): as built -> merged")
    for k in ("sum_alone", "contention_dp", "perfect_overlap_dp"):
        a, b = m[k]
        print(f"  {k}: {a:.0f} -> {b:.0f} us ({a / b:.3f}x)")
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Generator coverage audit of the generalization suite (issue 21): does tunedb's planner run
each maximal memory-bound workload as one generated kernel? Planner on the CPU, roofline
prices, no database, no packing (what a new user gets without a GPU). Prints, per workload:
kernels, launches, the bytes the plan moves (each step reads its inputs and writes its outputs
once: the planned traffic model) against the workload's floor (its inputs read once, its
outputs written once), and flags:

* ``library:<kind> <ops>``: a step the generator does not produce (conv2d, pool, a lone ``op``);
* ``copy:<ops>``: a materialising ``layout`` step beside other kernels (a copy between them; a
  workload that is one transpose or gather alone is one kernel at its floor, not flagged);
* ``split``: more than one kernel launched;
* ``traffic``: the plan moves over 5 % more bytes than the floor (intermediates through memory).

    python benchmarks/generalization_coverage.py [--tier bandwidth|launch] [--kind K] [--json OUT]
        [--only NAME ...] [--markdown]

Ends with a summary (workloads in one kernel, flags by kind, total planned / floor bytes).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

from tunedb.kernels.suite_generalization import manifest, suite_dir

TRAFFIC_SLACK = 1.05


def audit(path: Path) -> dict:
    """One workload's plan summary: kernels, launches, planned and floor bytes, flags."""
    from tunedb.graph.onnx_import import import_onnx
    from tunedb.plan.driver import compile as plan_compile
    from tunedb.plan.explain import ops_text

    graph = import_onnx(path)
    floor = graph.floor_bytes()
    try:
        plan = plan_compile(graph, cost_model=False, device=None, pack=False)
    except Exception as e:  # noqa: BLE001 - recorded as the workload's flag, the audit goes on
        return {"floor_bytes": floor, "kernels": 0, "launches": 0, "planned_bytes": 0,
                "flags": [f"plan-error: {' '.join(str(e).split())[:120]}"], "steps": []}
    flags: list[str] = []
    copies: list[str] = []
    steps: list[str] = []
    planned = 0
    kernels = launches = 0
    for s in plan.steps:
        if s.kind == "layout_view" or s.launches == 0:
            continue  # a reshape of a buffer or a view: no kernel, no traffic
        kernels += 1
        launches += s.launches
        planned += s.graph.floor_bytes()
        text = f"{s.kind}: {ops_text(s.ops)}"
        steps.append(text)
        if s.kind == "layout":
            copies.append(f"copy:{ops_text(s.ops)}")
        elif s.kind != "fused":
            flags.append(f"library:{text}")
    if kernels > 1 or launches > 1:
        flags = ["split", *copies, *flags]  # a lone copy is the workload itself, not extra
    if planned > TRAFFIC_SLACK * floor:
        flags.append("traffic")
    return {"floor_bytes": floor, "kernels": kernels, "launches": launches, "planned_bytes": planned,
            "flags": flags, "steps": steps}


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=("bandwidth", "launch"), default=None)
    ap.add_argument("--kind", default=None, help="only workloads of this kind (norm, windowed, ...)")
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--markdown", action="store_true", help="the flagged rows as a markdown table")
    args = ap.parse_args(argv)
    try:
        ws = manifest()["workloads"]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ws = [w for w in ws if (args.tier is None or w.get("tier") == args.tier)
          and (args.kind is None or w["kind"] == args.kind) and (args.only is None or w["name"] in args.only)]
    if not ws:
        print("error: no workload of the suite matches the filters", file=sys.stderr)
        return 2
    rows = []
    t0 = time.monotonic()
    print("| workload | kind | tier | kernels | launches | planned MiB | floor MiB | planned/floor | flags |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in ws:
        r = audit(suite_dir() / w["file"])
        r.update(name=w["name"], kind=w["kind"], tier=w.get("tier"))
        rows.append(r)
        ratio = r["planned_bytes"] / r["floor_bytes"] if r["floor_bytes"] else 0.0
        if not args.markdown or r["flags"]:
            print(f"| {w['name']} | {w['kind']} | {r['tier']} | {r['kernels']} | {r['launches']} | "
                  f"{_mb(r['planned_bytes'])} | {_mb(r['floor_bytes'])} | {ratio:.2f} | "
                  f"{', '.join(r['flags']) or 'ok'} |", flush=True)
    one = sum(r["kernels"] == 1 and r["launches"] == 1 for r in rows)
    flagged = collections.Counter(f.split(":")[0] for r in rows for f in r["flags"])
    what = collections.Counter(f for r in rows for f in r["flags"] if ":" in f)
    print(f"\n{len(rows)} workloads ({time.monotonic() - t0:.0f} s): {one} in one kernel and one launch; "
          f"{sum(r['kernels'] for r in rows)} kernels, {sum(r['launches'] for r in rows)} launches; "
          f"planned {_mb(sum(r['planned_bytes'] for r in rows))} MiB against a floor of "
          f"{_mb(sum(r['floor_bytes'] for r in rows))} MiB")
    print("flags: " + (", ".join(f"{k} {n}" for k, n in flagged.most_common()) or "none"))
    for f, n in what.most_common():
        print(f"  {n:4d}  {f}")
    by_kind = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        t = by_kind[r["kind"]]
        t[0] += 1
        t[1] += r["kernels"] == 1 and r["launches"] == 1
        t[2] += r["kernels"]
    print("\n| kind | workloads | one kernel | kernels |\n|---|---|---|---|")
    for k, t in sorted(by_kind.items()):
        print(f"| {k} | {t[0]} | {t[1]} | {t[2]} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two source trees' step timings side by side, from a file of ``bench_conv_steps.py`` runs
keyed ``TREE_MODEL`` (as ``data/bench/conv_steps_b8_h200.json`` stores them): per model the whole
plans, the step sums, the difference by executor path and the steps that moved most.

    python benchmarks/bench_conv_compare.py RUNS.json OLD NEW [--top N]
    python benchmarks/bench_conv_compare.py data/bench/conv_steps_b8_h200.json e5983d8 head

Steps are lined up by their ops and path (``difflib``), so a plan that fused two steps into one
shows them as one replaced pair.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any


def line_up(old: list[dict], new: list[dict]) -> list[dict]:
    """Step pairs of two plans: ``{"ops", "path", "old_us", "new_us", "delta"}``, matched steps one
    by one, replaced runs of steps as one pair (ops joined with ``|``)."""
    key = [(s["ops"], s["path"]) for s in old], [(s["ops"], s["path"]) for s in new]
    pairs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=key[0], b=key[1], autojunk=False).get_opcodes():
        if tag == "equal":
            chunks = [([old[i]], [new[j]]) for i, j in zip(range(i1, i2), range(j1, j2))]
        else:
            chunks = [(old[i1:i2], new[j1:j2])]
        for a, b in chunks:
            ua, ub = sum(s.get("us", 0.0) for s in a), sum(s.get("us", 0.0) for s in b)
            pairs.append({"ops": "|".join(s["ops"] for s in a) + ("" if tag == "equal" else " => " +
                                                                   "|".join(s["ops"] for s in b)),
                          "path": a[0]["path"] if tag == "equal" else "changed", "x": (a or b)[0]["x"],
                          "old_us": ua, "new_us": ub, "delta": ub - ua})
    return pairs


def compare(runs: dict[str, Any], old: str, new: str, top: int = 8) -> list[str]:
    """Lines comparing every model that both trees ran."""
    models = sorted({k.split("_", 1)[1] for k in runs if "_" in k})
    out = []
    for name in models:
        a, b = runs.get(f"{old}_{name}"), runs.get(f"{new}_{name}")
        if not a or not b:
            continue
        ma, mb = a["models"][0], b["models"][0]
        out.append(f"{name}: whole {ma.get('whole_us', 0):.0f} -> {mb.get('whole_us', 0):.0f} µs, "
                   f"steps {ma.get('steps_sum_us')} -> {mb.get('steps_sum_us')} µs")
        if "steps" not in ma or "steps" not in mb:
            continue
        pairs = line_up(ma["steps"], mb["steps"])
        by_path: dict[str, float] = {}
        for p in pairs:
            by_path[p["path"]] = by_path.get(p["path"], 0.0) + p["delta"]
        out.append("  by path: " + ", ".join(f"{k} {v:+.1f}" for k, v in sorted(by_path.items(),
                                                                               key=lambda kv: -abs(kv[1]))))
        for p in sorted(pairs, key=lambda p: -abs(p["delta"]))[:top]:
            out.append(f"  {p['delta']:+7.1f}  {p['old_us']:6.1f} -> {p['new_us']:6.1f}  "
                       f"{p['path'][:24]:24s} {p['x'][:24]:24s} {p['ops'][:60]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    try:
        runs = json.loads(args.runs.read_text())
    except (OSError, ValueError) as e:
        print(f"error: {args.runs}: {e}", file=sys.stderr)
        return 2
    lines = compare(runs, args.old, args.new, args.top) if isinstance(runs, dict) else []
    if not lines:
        print(f"error: {args.runs} has no model run by both {args.old!r} and {args.new!r}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

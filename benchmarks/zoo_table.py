"""The zoo results (``bench_zoo_plan.py``'s JSON) as the markdown table of docs/frontends.md.

    python benchmarks/zoo_table.py RESULT.json [BACKEND.json]

One row per model, batch and dtype: tunedb's whole plan (µs, kernels), verified or not, each
peer's time, and tunedb's speedup over the best peer that ran. With ``bench_torch_backend.py``'s
JSON, a second table for the torch.compile backend.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

PEERS = ("torch_eager", "torch_compile", "torch_compile_ro", "jax")


def _us(x: Any) -> str:
    return "—" if not x or not math.isfinite(x) else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _row_key(name: str) -> tuple[str, int, str]:
    m = re.match(r"(.+)_dynamo_(fp32|bf16)(?:_b(\d+))?$", name)
    if not m:
        return name, 1, ""
    return m.group(1), int(m.group(3) or 1), m.group(2)


def _verified(e: dict) -> str:
    v = e.get("verify") or {}
    ref, ort = (v.get("reference") or {}), (v.get("onnxruntime") or {})
    if ref.get("ok") is None:
        return "—"
    marks = ["ref " + ("ok" if ref["ok"] else "FAIL")]
    if ort.get("ok") is not None:
        marks.append("ORT " + ("ok" if ort["ok"] else "FAIL"))
    return ", ".join(marks)


def zoo_lines(result: dict) -> list[str]:
    lines = ["| model | batch | dtype | tunedb µs | kernels (op by op) | verified | torch eager | "
             "torch.compile | reduce-overhead | jax.jit | vs best peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(result.get("entries", []), key=lambda e: _row_key(e["name"]))
    for e in rows:
        model, batch, dtype = _row_key(e["name"])
        t = (e.get("tunedb") or {}).get("us")
        peers = e.get("peers") or {}
        us = {p: (peers.get(p) or {}).get("us") for p in PEERS}
        ran = [u for u in us.values() if u]
        best = min(ran) if ran else None
        plan = e.get("plan") or {}
        kern = f"{plan.get('kernels')} ({(e.get('graph') or {}).get('op_by_op')})" if plan else "—"
        if e.get("error") and not t:
            lines.append(f"| {model} | {batch} | {dtype} | {e['error'][:60]} | {kern} | — | "
                         + " | ".join(_us(us[p]) for p in PEERS) + " | — |")
            continue
        vs = f"{best / t:.2f}x" if t and best else "—"
        lines.append(f"| {model} | {batch} | {dtype} | **{_us(t)}** | {kern} | {_verified(e)} | "
                     + " | ".join(_us(us[p]) for p in PEERS) + f" | {vs} |")
    return lines


def backend_lines(result: dict) -> list[str]:
    lines = ["| model | dtype | FX graphs (as plans) | max rel. diff vs eager | equal | eager µs | "
             "backend µs | plans replayed µs | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in result.get("cases", []):
        if c.get("error"):
            lines.append(f"| {c['model']} | {c['dtype']} | {c['error'][:80]} | | | | | | |")
            continue
        lines.append(f"| {c['model']} | {c['dtype']} | {c['fx_graphs']} ({c['planned']}) | "
                     f"{c['max_rel_err']:.1e} | {'yes' if c['equal_within_tolerance'] else 'no'} | "
                     f"{_us(c.get('eager_us'))} | {_us(c.get('backend_us'))} | "
                     f"{_us(c.get('plan_replay_us'))} | {c['compile_s']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    for line in zoo_lines(json.loads(Path(args[0]).read_text())):
        print(line)
    if len(args) > 1:
        print()
        for line in backend_lines(json.loads(Path(args[1]).read_text())):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

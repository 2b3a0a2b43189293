"""Issue 21 on one GPU: the 12 anchors as plans against the bandwidth floor, then the issue's
generator patterns and bandwidth-tier workloads of the generalization suite as plans next to
torch eager, torch.compile and JAX (``tunedb.bench.plan``: verified against the float64
reference first, throughput timing). Not run in CI; needs a GPU with CuPy.

    python benchmarks/bench_generalization.py OUT_DIR [--limit S] [--db DB]

Writes ``OUT_DIR/anchors_plan.json`` and ``OUT_DIR/generalization_plan.json`` (the ``tunedb
bench plan`` JSON plus ``floor_bytes``/``floor_us`` per entry and ``copy_TBps``: each input
read once and each output written once at the measured device-to-device copy bandwidth).
Suite workloads: the bandwidth tier of ``data/graphs/generalization/manifest.json`` without
the windowed kind (convolutions), interleaved by kind and model, largest floor first;
``--limit`` seconds after which no new graph starts.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tunedb.bench.peers import copy_tbps  # noqa: E402
from tunedb.bench.plan import Entry, collect_entries, load_entry, run_bench  # noqa: E402
from tunedb.kernels.suites import ANCHOR_CASES  # noqa: E402
from tunedb.runtime.device import import_cupy  # noqa: E402

SUITE = ROOT / "data" / "graphs" / "generalization"
KINDS = ("norm", "softmax", "data_movement", "elementwise", "reduce")


def patterns() -> list[Entry]:
    import test_kernels_generalization as t

    cases = [("mid_mean_64x512x256", t.mid_mean(64, 512, 256)),
             ("rotary_8x32x512x128", t.rotary(8, 32, 512, 128)),
             ("groupnorm_16x128g32x56x56", t.groupnorm(16, 128, 32, 56, 56)),
             ("instnorm_16x128x56x56", t.instnorm(16, 128, 56, 56)),
             ("masked_softmax_heads_8x12x512", t.per_head_softmax(8, 12, 512)),
             ("swiglu_split_8x512x4096", t.glu_split(8, 512, 4096)),
             ("kv_append_8x32x1024x1x128", t.kv_append(8, 32, 1024, 1, 128)),
             ("mid_center_32x64x16x256", t.mid_center(32, 64, 16, 256))]
    return [Entry(n, "pattern", graph=g) for n, g in cases]


def suite_paths() -> list[Path]:
    m = json.loads((SUITE / "manifest.json").read_text())
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for w in m["workloads"]:
        if w.get("tier") == "bandwidth" and w["kind"] in KINDS:
            by[w["kind"]].append(w)
    for ws in by.values():
        ws.sort(key=lambda w: -w["floor_us_h200"])
    out: list[Path] = []
    used: collections.Counter = collections.Counter()
    for rnd in range(len(m["workloads"])):
        if not any(by.values()):
            break
        for k in KINDS:  # one workload per (kind, model) a round: every model early
            for j, w in enumerate(by[k]):
                if used[(k, w["model"])] <= rnd:
                    out.append(SUITE / by[k].pop(j)["file"])
                    used[(k, w["model"])] += 1
                    break
    return out


def add_floors(result: dict, entries: list[Entry], bw: float) -> None:
    named = {e.name: e for e in entries}
    for rec in result["entries"]:
        try:
            g, _ = load_entry(named[rec["name"]])
            rec["floor_bytes"] = g.floor_bytes()
            rec["floor_us"] = rec["floor_bytes"] / (bw * 1e12) * 1e6
        except Exception as e:  # noqa: BLE001 - recorded, the others still get theirs
            rec["floor_error"] = str(e)[:200]
    result["copy_TBps"] = bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--limit", type=float, default=600.0)
    ap.add_argument("--db", default=None)
    args = ap.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    cp = import_cupy()
    bw = copy_tbps(cp, cp.cuda.Stream.null.synchronize, 1 << 30)
    print(f"copy {bw:.3f} TB/s", flush=True)
    runs = (("anchors_plan", [Entry(c.name, "anchor", graph=c.graph) for c in ANCHOR_CASES], ()),
            ("generalization_plan", patterns() + collect_entries(suite_paths()),
             ("torch_eager", "torch_compile", "jax")))
    for name, entries, peers in runs:
        path = args.out / f"{name}.json"
        left = max(10.0, args.limit - (time.monotonic() - t0)) if peers else 0.0
        result = run_bench(entries, path, db=args.db, peers=peers, time_limit_s=left, progress=print,
                           on_entry=lambda i, n, rec: print(i, n, rec["name"], rec["tunedb"].get("us"),
                                                            rec.get("speedup"), flush=True))
        add_floors(result, entries, bw)
        path.write_text(json.dumps(result, indent=1, default=str))
    print("done", round(time.monotonic() - t0, 1), flush=True)


if __name__ == "__main__":
    main()

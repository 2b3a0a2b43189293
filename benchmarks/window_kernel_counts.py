"""Kernel counts with and without windowed fusion (``tunedb.plan.window``), planner on the CPU
with roofline prices: the suite's windowed workloads by model, then whole models. Prints the
markdown tables of docs/fusion-generalization.md (windowed ops). The µs are the planner's
estimates (roofline plus 2.5 µs per launch), not measurements.

    python benchmarks/window_kernel_counts.py [MODEL.onnx ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from tunedb.kernels.split_reduce import split_reductions
from tunedb.plan.cost import Coster
from tunedb.plan.driver import load_graph
from tunedb.plan.fusion import explore
from tunedb.plan.rewrite import rewrite_for_plan
from tunedb.plan.subgraph import GraphIndex
from tunedb.plan.window import kernel_count

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "data" / "graphs" / "generalization"
MODELS = ["zoo/mobilenet_v3_ts_fp32.onnx", "zoo/mobilenet_v3_ts_bf16.onnx",
          "zoo_b8/mobilenet_v3_dynamo_fp32_b8.onnx", "zoo/efficientnet_b0_ts_fp32.onnx",
          "zoo/efficientnet_b0_ts_bf16.onnx", "zoo/resnet50_ts_fp32.onnx", "zoo/convnext_tiny_ts_fp32.onnx"]


def counts(path: str) -> list[tuple[int, float]]:
    """(kernels, estimated µs) without and with windowed fusion."""
    g = split_reductions(rewrite_for_plan(load_graph(path)))
    out = []
    for window in (False, True):
        ix = GraphIndex(g)
        part = explore(ix, Coster(ix), window=window)
        out.append((kernel_count(part.costs), sum(c.us + 2.5 * c.launches for c in part.costs)))
    return out


def main(argv: list[str]) -> None:
    man = json.loads((SUITE / "manifest.json").read_text())
    tot: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
    for w in man["workloads"]:
        if w["kind"] == "windowed":
            (b, bu), (a, au) = counts(str(SUITE / w["file"]))
            t = tot[w["model"]]
            for i, x in enumerate((1, b, a, bu, au)):
                t[i] += x
    print("| windowed workloads of the suite | workloads | kernels before | after | est. µs before | after |")
    print("|---|---|---|---|---|---|")
    for k, t in sorted(tot.items()) + [("all", [sum(t[i] for t in tot.values()) for i in range(5)])]:
        print(f"| {k} | {t[0]} | {t[1]} | {t[2]} | {t[3]:.0f} | {t[4]:.0f} |")
    print("\n| whole model | kernels before | after | est. µs before | after |\n|---|---|---|---|---|")
    for m in argv or [str(ROOT / "data" / "graphs" / p) for p in MODELS]:
        (b, bu), (a, au) = counts(m)
        print(f"| {Path(m).stem} | {b} | {a} | {bu:.0f} | {au:.0f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Concat views on the CPU: what ``compile(concat_views=True)`` removes from the multi-branch CNNs.

For each graph, the sequential plan and the IOS stage plan (``schedule="ios"``, roofline prices
without a device) with and without concat views: concat nodes, concat kernels left, kernels,
stages that launch a kernel, and the arena's bytes. No GPU: these are plan facts, not timings.
``--bias-epilogue`` plans with the conv-bias lever the stage runs use (``compile(bias_epilogue=True)``).

    python benchmarks/concat_views.py [--no-ios] [--bias-epilogue]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.graph.multibranch import nasnet_a_graph, randwire_graph
from tunedb.plan.driver import compile as compile_plan
from tunedb.runtime.executor_views import is_concat_view

ROOT = Path(__file__).resolve().parents[1]


def densenet_block(batch: int = 1, channels: int = 64, growth: int = 32, layers: int = 6,
                   size: int = 28) -> Graph:
    """A DenseNet-style dense block (weights as graph inputs): each layer reads the concat of
    every earlier output (ReLU, 1x1 to 4*growth, ReLU, 3x3 to growth)."""
    b = GraphBuilder(f"densenet_block_b{batch}")
    feats = [b.input("x", (batch, channels, size, size))]
    for i in range(layers):
        cat = feats[0] if len(feats) == 1 else b.concat(*feats, axis=1)
        cin = b.type_of(cat).shape[1]
        w1 = b.input(f"w{i}a", (4 * growth, cin, 1, 1))
        w3 = b.input(f"w{i}b", (growth, 4 * growth, 3, 3))
        h = b.conv2d(b.relu(cat), w1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), groups=1)
        feats.append(b.conv2d(b.relu(h), w3, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), groups=1))
    return b.build([b.concat(*feats, axis=1)])


def graphs() -> list[tuple[str, Any]]:
    ios = ROOT / "data" / "graphs" / "ios"
    return [("Inception V3 b1", str(ios / "inception_v3_b1.onnx")),
            ("SqueezeNet 1.1 b1", str(ios / "squeezenet1_1_b1.onnx")),
            ("SqueezeNet 1.1 b16", str(ios / "squeezenet1_1_b16.onnx")),
            ("NASNet-A b1", nasnet_a_graph(1)),
            ("RandWire b1", randwire_graph(1)),
            ("DenseNet block b1", densenet_block(1))]


def facts(plan: Any, graph_concats: int) -> dict[str, Any]:
    return {"concats": graph_concats,
            "concat kernels": sum("concat" in s.ops for s in plan.steps if s.kind != "layout_view"),
            "views": sum(map(is_concat_view, plan.steps)),
            # a stage of views only (a concat view alone) launches nothing: not counted
            "kernels": plan.kernels, "stages": sum(any(plan.steps[i].launches for g in st for i in g)
                                                   for st in plan.stages) or "",
            "arena MiB": round(plan.buffers.sizes[0] / 2**20, 2) if plan.buffers.sizes else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-ios", action="store_true", help="the sequential plans only")
    ap.add_argument("--bias-epilogue", action="store_true", help="compile(bias_epilogue=True)")
    args = ap.parse_args(argv)
    kw = {"bias_epilogue": True} if args.bias_epilogue else {}
    print("| graph | schedule | concats | concat kernels (copy / views) | concat views | kernels "
          "(copy / views) | IOS stages (copy / views) | arena MiB (copy / views) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model in graphs():
        for schedule in ("sequential",) if args.no_ios else ("sequential", "ios"):
            a = compile_plan(model, device=None, schedule=schedule, **kw)
            b = compile_plan(model, device=None, schedule=schedule, concat_views=True, **kw)
            n = sum(nd.op == "concat" for nd in a.graph.nodes)
            fa, fb = facts(a, n), facts(b, n)
            print(f"| {name} | {schedule} | {n} | {fa['concat kernels']} / {fb['concat kernels']} | "
                  f"{fb['views']} | {fa['kernels']} / {fb['kernels']} | {fa['stages']} / {fb['stages']} | "
                  f"{fa['arena MiB']} / {fb['arena MiB']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

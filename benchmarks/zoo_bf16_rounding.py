"""How far bf16 rounding alone puts a zoo model from its float64 reference (CPU, no GPU).

    python benchmarks/zoo_bf16_rounding.py [--bench RESULT.json] MODEL_bf16.onnx ...

The float64 reference rounds nothing between ops. Every bf16 implementation rounds somewhere:
torch eager and JAX after every op, tunedb and torch.compile at the end of each fused kernel.
For each file (with the benchmark's fan-in-scaled weights and inputs) this prints the error of
two exact-arithmetic walks that differ from the reference only in those roundings:

* ``op by op``: every node's float output rounded to bf16 (float64 inside the op);
* ``plan steps``: the tunedb plan's steps evaluated in float64, their outputs rounded to bf16.

Each as the relative L2 error and as the worst error over the benchmark's tolerance (> 1
fails). Where even these fail, no bf16 implementation can pass the reference check: the model
is ill-conditioned in bf16 (T5's unscaled attention logits), not the plan wrong. ``--bench``
adds the measured errors of tunedb and its peers from ``bench_zoo_plan.py``'s JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.fusion import rel_l2
from tunedb.bench.plan import INPUT_SEED, collect_entries, load_entry
from tunedb.graph.ir import Graph
from tunedb.graph.ops import check_node, infer_graph
from tunedb.graph.reference import eval_node, run_reference, to_reference
from tunedb.plan.driver import compile as compile_plan
from tunedb.runtime.inputs import bf16_bits, bf16_to_f32, make_inputs
from tunedb.runtime.tolerance import error_ratio, reference_and_exp_span, tolerance


def to_bf16(a: Any, dtype: str) -> Any:
    """``a`` rounded to bf16 (nearest even) where ``dtype`` is bfloat16, as float64."""
    if dtype == "bfloat16" and np.asarray(a).dtype.kind == "f":
        return bf16_to_f32(bf16_bits(np.asarray(a, np.float32))).astype(np.float64)
    return a


def rounded_op_by_op(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference walk with every node's bf16 output rounded (an op-by-op bf16 run)."""
    g = infer_graph(graph)
    types = g.type_map
    env = {v: to_reference(inputs[v], types[v], f"input {v!r}") for v in g.inputs}
    env.update({v: to_reference(c.array, c.type, f"constant {v!r}") for v, c in g.constants})
    for node in g.nodes:
        _, attrs = check_node(node, [types[v] for v in node.inputs])
        for v, y in zip(node.outputs, eval_node(node, [env[v] for v in node.inputs], attrs)):
            env[v] = to_bf16(y, types[v].dtype)
    return {v: env[v] for v in g.outputs}


def rounded_steps(plan: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plan's steps in float64, each step's bf16 outputs rounded (a fused bf16 run)."""
    g = plan.graph
    env: dict[str, Any] = {v: np.asarray(inputs[v]) for v in g.inputs}
    env.update({v: c.array for v, c in g.constants})
    for step in plan.steps:
        sub = step.graph
        outs = run_reference(sub, {s: env[v] for s, v in zip(sub.inputs, step.inputs)})
        env.update({v: to_bf16(outs[s], sub.type_of(s).dtype) for s, v in zip(sub.outputs, step.outputs)})
    return {v: env[v] for v in g.outputs}


def rounding_errors(path: Path) -> dict[str, Any]:
    """``{"op_by_op": (rel_l2, ratio), "plan_steps": (rel_l2, ratio), "exp_span": ...}`` of the
    graph's first output against the float64 reference (the benchmark's weights and inputs)."""
    graph, _ = load_entry(collect_entries([path], anchors=False)[0])
    _, ref_in = make_inputs(graph, INPUT_SEED)
    refs, span = reference_and_exp_span(graph, ref_in)
    out = graph.outputs[0]
    tol = tolerance(graph, graph.type_of(out).dtype, span)
    plan = compile_plan(graph, device="cuda")  # the plan the GPU benchmark runs
    rec: dict[str, Any] = {"exp_span": span}
    walks = {"op_by_op": rounded_op_by_op(graph, ref_in), "plan_steps": rounded_steps(plan, ref_in)}
    for key, got in walks.items():
        rec[key] = (rel_l2(got[out], refs[out]), error_ratio(got[out], refs[out], tol)[0])
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--bench", type=Path, help="bench_zoo_plan.py JSON: the measured errors too")
    a = p.parse_args(argv)
    measured: dict[str, dict] = {}
    if a.bench:
        measured = {e["name"]: e for e in json.loads(a.bench.read_text()).get("entries", [])}
    print("| model (bf16) | exp span | op by op: rel / bound | plan steps: rel / bound | "
          "tunedb measured | peers measured |")
    print("|---|---|---|---|---|---|")
    for path in a.models:
        r = rounding_errors(path)
        e = measured.get(path.stem, {})
        ref = ((e.get("verify") or {}).get("reference") or {}).get("rel_err")
        peers = sorted(x for q in (e.get("peers") or {}).values()
                       if (x := (q or {}).get("rel_err")) is not None)
        print(f"| {path.stem} | {r['exp_span']:.0f} | {r['op_by_op'][0]:.4f} / {r['op_by_op'][1]:.2f} | "
              f"{r['plan_steps'][0]:.4f} / {r['plan_steps'][1]:.2f} | "
              f"{f'{ref:.4f}' if ref is not None else '—'} | "
              f"{f'{peers[0]:.4f}-{peers[-1]:.4f}' if peers else '—'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running a Plan: the CPU reference walk over its steps, and the hand-off to the GPU runtime."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.ir import GraphError
from tunedb.graph.reference import run_reference
from tunedb.runtime.device import import_cupy

EXECUTOR_MODULE = "tunedb.runtime.executor"
STAGED_MODULE = "tunedb.runtime.stage_exec"  # plans with IOS stages: streams forked in the graph
PACKED_MODULE = "tunedb.runtime.pack_exec"  # plans with superkernel packs


def run_reference_steps(plan: Any, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Evaluate ``plan`` step by step with the float64 reference: each step's sub-graph gets the
    values its ``inputs`` name and defines the values its ``outputs`` name. Equal to
    ``run_reference(plan.graph, inputs)`` exactly when the steps partition the graph correctly
    (every node is rounded to its dtype either way)."""
    g = plan.graph
    missing = [v for v in g.inputs if v not in inputs]
    if missing:
        raise GraphError(f"plan {g.name or '<unnamed>'}: missing input(s) {', '.join(map(repr, missing))}")
    env: dict[str, Any] = {v: np.asarray(inputs[v]) for v in g.inputs}
    env.update({v: c.array for v, c in g.constants})
    for k, step in enumerate(plan.steps):
        sub = step.graph
        absent = [v for v in step.inputs if v not in env]
        if absent:
            raise GraphError(f"plan step {k} ({step.kind}) reads {absent[0]!r} before any step defines it")
        outs = run_reference(sub, {s: env[v] for s, v in zip(sub.inputs, step.inputs)})
        for s, v in zip(sub.outputs, step.outputs):
            env[v] = outs[s]
    return {v: env[v] for v in g.outputs}


def run_cuda(plan: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Hand the plan to ``tunedb.runtime.executor.execute_plan(plan, inputs)``, or to
    ``tunedb.runtime.stage_exec``'s for a plan with stages.

    Raises ``NoGPUError`` first where there is no GPU, so the message is about the GPU."""
    import_cupy()
    name = STAGED_MODULE if getattr(plan, "stages", ()) else EXECUTOR_MODULE
    name = PACKED_MODULE if getattr(plan, "packs", ()) else name
    try:
        import importlib

        executor = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise RuntimeError(f"this tunedb has no plan executor ({name} is missing)") from None
    return executor.execute_plan(plan, inputs)

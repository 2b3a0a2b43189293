"""The driver's decisions: fusion explorer, cost of steps, the Plan record, ``compile``.

    plan = tunedb.compile("bert_layer.onnx", db="tunedb.duckdb", cost_model="models/")
    print(plan.explain())
    outputs = plan.run(inputs)          # on a GPU; backend="reference" checks it on the CPU
"""

from tunedb.plan.driver import compile, load_graph
from tunedb.plan.record import BufferPlan, KernelStep, Plan, PlanError
from tunedb.plan.subgraph import GraphIndex, extract_subgraph

__all__ = ["BufferPlan", "GraphIndex", "KernelStep", "Plan", "PlanError", "compile", "extract_subgraph",
           "load_graph"]

"""Code generation for fused memory-intensive kernels (FusionStitching/AStitch style).

``analyze(graph)`` canonicalises a fusion subgraph onto an [R, C] domain, ``schedule_space(graph)``
lists the legal schedules (and the pruned ones, with the reason), ``generate(graph, schedule)``
returns the CUDA C of a ``KernelPlan``, ``suite(name)`` the benchmark workloads.
"""

from tunedb.kernels.analysis import Analysis, UnsupportedFusion, analyze
from tunedb.kernels.codegen import KernelPlan, KernelSpec, generate
from tunedb.kernels.schedule import MAPPINGS, Schedule, schedule_space
from tunedb.kernels.suites import ANCHOR_CASES, FAMILIES, SuiteCase, suite

__all__ = [
    "ANCHOR_CASES", "FAMILIES", "MAPPINGS", "Analysis", "KernelPlan", "KernelSpec", "Schedule",
    "SuiteCase", "UnsupportedFusion", "analyze", "generate", "schedule_space", "suite",
]

"""The check GPU tests make of a plan's outputs: each against the float64 reference on the same
inputs, within the runtime's one tolerance table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedb.graph.reference import run_reference
from tunedb.runtime.tolerance import check_host, tolerance


def check_outputs(plan: Any, outs: Mapping[str, Any], ref_in: Mapping[str, np.ndarray]) -> None:
    g = plan.graph
    refs = run_reference(g, ref_in)
    for v in g.outputs:
        tol = tolerance(g, g.type_of(v).dtype)
        ok, err = check_host(np.asarray(outs[v]), refs[v], tol)
        assert ok, f"{g.name} output {v!r}: max abs error {err:.3g} ({tol})"

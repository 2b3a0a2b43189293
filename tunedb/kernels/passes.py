"""Passes of row-mapped kernels over a row, and the full-size values they keep between passes
(what a row cache holds): read off an ``Analysis``, for the schedule space and the generators."""

from __future__ import annotations

from tunedb.kernels.analysis import FULL, Analysis


def pass_of(a: Analysis) -> dict[str, int]:
    """Row-mapped kernels evaluate node outputs in passes over the row: a level-l row reduction
    in pass l, other full-size values as soon as their inputs are ready (pass = dep), column
    reductions of a multi pattern in the last pass."""
    dep = a.dep
    last = a.row_levels
    out: dict[str, int] = {}
    for n in a.nodes:
        v = n.outputs[0]
        r = next((r for r in a.reductions if r.value == v), None)
        if r is not None:
            out[v] = r.level if r.axis == "row" else last
        else:
            out[v] = dep.get(v, 0)
    return out


def cache_values(a: Analysis, mode: str) -> tuple[str, ...]:
    """The full-size values a row-mapped kernel keeps per element between passes.

    ``boundary``: the pre-reduction values that a later pass consumes (x + r in add_layernorm);
    ``inputs``: the full-size graph inputs those depend on, later passes recompute the rest."""
    cls, dep = a.cls, a.dep
    passes = pass_of(a)
    red = {r.value: r for r in a.reductions}
    boundary: list[str] = []
    for n in a.nodes:
        v = n.outputs[0]
        if n.op == "gather_elements":
            continue
        p = passes[v] if v in red else (dep.get(v, 0) if cls.get(v) == FULL else 0)
        if p == 0:
            continue
        for i in n.inputs:
            ri = a.resolve(i)
            if cls.get(ri) == FULL and dep.get(ri, 0) == 0 and ri not in boundary:
                boundary.append(ri)
    if mode == "boundary":
        return tuple(boundary)
    if mode != "inputs":
        raise ValueError(f"unknown cache mode {mode!r}; expected 'boundary' or 'inputs'")
    prod = {n.outputs[0]: n for n in a.nodes}
    leaves: list[str] = []

    def walk(v: str) -> None:
        v = a.resolve(v)
        if v in prod:
            for i in prod[v].inputs:
                walk(i)
        elif cls.get(v) == FULL and v not in leaves:
            leaves.append(v)

    for v in boundary:
        walk(v)
    return tuple(leaves)

"""CUDA C text for single values: types, literals, loads/stores, one expression per op, and the
emission of an expression cone (the nodes a set of targets needs, in topological order)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tunedb.graph.ir import Node
from tunedb.graph.ops import canonical_attrs
from tunedb.kernels.analysis import Analysis, UnsupportedFusion

FLOATS = ("float32", "float16", "bfloat16")
STORAGE = {"float32": "float", "float16": "unsigned short", "bfloat16": "unsigned short",
           "int32": "int", "int64": "long long", "bool": "unsigned char"}
COMPUTE = {"float32": "float", "float16": "float", "bfloat16": "float",
           "int32": "int", "int64": "long long", "bool": "bool"}
RED_INIT = {"reduce_sum": "0.0f", "reduce_mean": "0.0f", "reduce_prod": "1.0f",
            "reduce_max": "(-TDB_INF)", "reduce_min": "TDB_INF"}
RED_WARP = {"reduce_sum": "tdb_wsum", "reduce_mean": "tdb_wsum", "reduce_prod": "tdb_wprod",
            "reduce_max": "tdb_wmax", "reduce_min": "tdb_wmin"}


def red_comb(op: str, a: str, b: str) -> str:
    return {"reduce_sum": f"{a} + {b}", "reduce_mean": f"{a} + {b}", "reduce_prod": f"{a} * {b}",
            "reduce_max": f"fmaxf({a}, {b})", "reduce_min": f"fminf({a}, {b})"}[op]


def flit(x: float) -> str:
    """A float32 literal that C parses back to the same bits."""
    f = np.float32(x)
    if not np.isfinite(f):
        return f"__int_as_float(0x{int(f.view(np.uint32)):08x})"
    r = repr(float(f))
    return r + "f" if ("." in r or "e" in r) else r + ".0f"


def literal(x: float | int | bool, dtype: str) -> str:
    if dtype in FLOATS:
        return flit(float(x))
    if dtype == "bool":
        return "true" if bool(x) else "false"
    return f"{int(x)}LL" if dtype == "int64" else f"{int(x)}"


def load_conv(dtype: str, raw: str) -> str:
    return {"float16": f"tdb_h2f({raw})", "bfloat16": f"tdb_bf2f({raw})",
            "bool": f"({raw} != 0)"}.get(dtype, raw)


def store_conv(dtype: str, x: str) -> str:
    return {"float16": f"tdb_f2h({x})", "bfloat16": f"tdb_f2bf({x})",
            "bool": f"(unsigned char)({x})", "int32": f"(int)({x})",
            "int64": f"(long long)({x})"}.get(dtype, x)


class Names:
    """Stable C identifiers for graph values (sorted value names -> n0, n1, ...)."""

    def __init__(self, a: Analysis) -> None:
        vals = sorted(a.graph.type_map)
        self.idx = {v: i for i, v in enumerate(vals)}

    def __call__(self, v: str, prefix: str = "n") -> str:
        return f"{prefix}{self.idx[v]}"


def _cast(x: str, src: str, dst: str) -> str:
    sk, dk = COMPUTE[src], COMPUTE[dst]
    if dst in FLOATS:
        return x if sk == "float" else f"({x} ? 1.0f : 0.0f)" if sk == "bool" else f"(float)({x})"
    if dst == "bool":
        return f"({x} != 0)"
    if sk == "bool":
        return f"({dk})({x} ? 1 : 0)"
    if dst == "int32":
        return f"(int)(long long)({x})" if sk == "float" else f"(int)({x})"
    return f"(long long)({x})"


def op_expr(a: Analysis, node: Node, args: list[str], fast: bool = False) -> str:
    """One node's output as a C expression of its (already computed) input expressions."""
    g = a.graph
    op = node.op
    din = g.type_of(node.inputs[0]).dtype
    isf = din in FLOATS
    attrs = canonical_attrs(node, [g.type_of(v) for v in node.inputs])
    x = args[0]
    if op == "cast":
        return _cast(x, din, attrs["to"])
    if isf:
        e = "__expf" if fast else "expf"
        unary = {
            "neg": f"(-{x})", "abs": f"fabsf({x})", "exp": f"{e}({x})",
            "log": f"{'__logf' if fast else 'logf'}({x})", "sqrt": f"sqrtf({x})",
            "rsqrt": f"rsqrtf({x})", "reciprocal": f"(1.0f / {x})", "sin": f"sinf({x})",
            "cos": f"cosf({x})", "tanh": f"{'tdb_tanh_fast' if fast else 'tanhf'}({x})",
            "sigmoid": f"{'tdb_sigmoid_fast' if fast else 'tdb_sigmoid'}({x})",
            "relu": f"fmaxf({x}, 0.0f)", "erf": f"erff({x})", "floor": f"floorf({x})",
            "ceil": f"ceilf({x})", "sign": f"(float)(({x} > 0.0f) - ({x} < 0.0f))", "identity": x,
        }
    else:
        unary = {"neg": f"(-{x})", "abs": f"({x} < 0 ? -{x} : {x})", "floor": x, "ceil": x,
                 "sign": f"(({x} > 0) - ({x} < 0))", "relu": f"({x} > 0 ? {x} : 0)",
                 "identity": x, "not": f"(!{x})"}
    if op in unary:
        return unary[op]
    if op == "gelu":
        if attrs["approximate"] == "tanh":
            th = "tdb_tanh_fast" if fast else "tanhf"
            return (f"(0.5f * {x} * (1.0f + {th}(0.7978845608028654f * "
                    f"({x} + 0.044715f * {x} * {x} * {x}))))")
        return f"(0.5f * {x} * (1.0f + erff({x} * 0.7071067811865476f)))"
    if op == "leaky_relu":
        return f"({x} >= 0.0f ? {x} : {flit(attrs['alpha'])} * {x})"
    if op == "clip":
        lo, hi = attrs["min"], attrs["max"]
        if isf:
            y = x if lo is None else f"fmaxf({x}, {flit(lo)})"
            return y if hi is None else f"fminf({y}, {flit(hi)})"
        y = x if lo is None else f"max((long long)({x}), {math.ceil(lo)}LL)"
        return y if hi is None else f"min((long long)({y}), {math.floor(hi)}LL)"
    if op == "where":
        return f"({x} ? {args[1]} : {args[2]})"
    y = args[1] if len(args) > 1 else ""
    binary = {"add": f"({x} + {y})", "sub": f"({x} - {y})", "mul": f"({x} * {y})",
              "eq": f"({x} == {y})", "ne": f"({x} != {y})", "lt": f"({x} < {y})",
              "le": f"({x} <= {y})", "gt": f"({x} > {y})", "ge": f"({x} >= {y})",
              "and": f"({x} && {y})", "or": f"({x} || {y})"}
    if op in binary:
        return binary[op]
    if isf:
        if op == "div":
            return f"__fdividef({x}, {y})" if fast else f"({x} / {y})"
        if op == "pow":
            return _pow(a, node, x, y)
        return {"max": f"fmaxf({x}, {y})", "min": f"fminf({x}, {y})",
                "mod": f"tdb_fmod_floor({x}, {y})"}[op]
    ct = COMPUTE[din]
    return {"div": f"({ct})tdb_idiv({x}, {y})", "mod": f"({ct})tdb_imod({x}, {y})",
            "max": f"({x} > {y} ? {x} : {y})", "min": f"({x} < {y} ? {x} : {y})"}[op]


def _pow(a: Analysis, node: Node, x: str, y: str) -> str:
    c = a.graph.constant_map.get(a.resolve(node.inputs[1]))
    if c is not None and c.type.numel == 1:
        p = float(c.array.reshape(()))
        special = {1.0: x, 2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})", 0.5: f"sqrtf({x})",
                   -1.0: f"(1.0f / {x})", -0.5: f"rsqrtf({x})"}
        if p in special:
            return special[p]
    return f"powf({x}, {y})"


def cone(a: Analysis, targets: list[str], have: set[str]) -> tuple[list[Node], list[str]]:
    """Nodes needed to compute ``targets`` (topological order) stopping at values in ``have``;
    plus the leaves (graph inputs/constants, or reduction/gather results) reached."""
    prod = {n.outputs[0]: n for n in a.nodes}
    need: set[str] = set()
    leaves: list[str] = []

    def walk(v: str) -> None:
        v = a.resolve(v)
        if v in have or v in need or v in leaves:
            return
        n = prod.get(v)
        if n is None or n.op.startswith("reduce_") or n.op == "gather_elements":
            leaves.append(v)
            return
        need.add(v)
        for i in n.inputs:
            walk(i)

    for t in targets:
        walk(t)
    return [n for n in a.nodes if n.outputs[0] in need], leaves


def emit_nodes(a: Analysis, names: Names, nodes: list[Node], env: dict[str, str], lines: list[str],
               fast: bool, prefix: str = "e") -> None:
    """Append ``const T x = expr;`` for each node, reading operands from ``env``."""
    g = a.graph
    for n in nodes:
        out = n.outputs[0]
        args = []
        for i in n.inputs:
            ri = a.resolve(i)
            if ri not in env:
                raise UnsupportedFusion(f"internal: operand {ri!r} of {n.op} {out!r} is not available")
            args.append(env[ri])
        name = names(out, prefix)
        rcp = RCP + a.resolve(n.inputs[1]) if n.op == "div" else ""
        if rcp in env:  # x / row_value: multiply by the reciprocal the row scope computed once
            expr = f"({args[0]} * {env[rcp]})"
        else:
            expr = op_expr(a, n, args, fast)
        lines.append(f"const {COMPUTE[g.type_of(out).dtype]} {name} = {expr};")
        env[out] = name


RCP = "1/"  # env key prefix: env[RCP + v] names 1 / v, hoisted out of the per-element loop


def reciprocals(a: Analysis, values: list[str], env: dict[str, str], lines: list[str], prefix: str) -> None:
    """For each float value in ``values`` that divides a per-element value, emit its reciprocal
    once (``env[RCP + v]``); the element loop then multiplies (1 ulp from the division)."""
    cls = a.cls
    divisors = {a.resolve(n.inputs[1]) for n in a.nodes
                if n.op == "div" and cls.get(n.outputs[0]) == "full"}
    for v in values:
        if v in divisors and a.graph.type_of(v).dtype in FLOATS and RCP + v not in env and v in env:
            name = f"{prefix}{len([k for k in env if k.startswith(RCP)])}"
            lines.append(f"const float {name} = 1.0f / {env[v]};")
            env[RCP + v] = name


def scalar_leaf(a: Analysis, v: str, param: Callable[[str], str]) -> str:
    """A scalar leaf: a literal for a constant, else element 0 of the input buffer."""
    g = a.graph
    t = g.type_of(v)
    c = g.constant_map.get(v)
    if c is not None:
        return literal(c.array.reshape(-1)[0].item(), t.dtype)
    return load_conv(t.dtype, f"{param(v)}[0]")

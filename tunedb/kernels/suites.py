"""Workload suites of memory-intensive fusion subgraphs: ``suite(name) -> list[SuiteCase]``.

* ``quick``: ~15 small workloads, every family, all three float dtypes (seconds to generate)
* ``standard``: >= 300 workloads: every family over small to >= 128 MB shapes, odd sizes
  (not multiples of 4 or 32), float32/float16/bfloat16, plus the 12 anchor cases
* ``full``: ``standard`` plus larger and more varied shapes
* ``generalization``: the memory-bound subgraphs of real models (``suite_generalization``)

Everything is deterministic (no randomness at all). ``ANCHOR_CASES`` are the 12 fusion cases
of the anchor table (float32), by name; ``SuiteCase.floor_bytes`` is the fewest bytes a kernel
must move: each input read once, each output written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import Graph
from tunedb.kernels.suite_breadth import breadth_specs
from tunedb.kernels.suite_generalization import generalization_cases

FAMILIES = ("bias_act", "gated", "norm", "softmax", "xent", "col_reduce", "norm_backward",
            "permute", "broadcast", "eltwise_chain")
SUITES = ("quick", "standard", "full", "anchors", "breadth", "generalization")


@dataclass(frozen=True)
class SuiteCase:
    family: str
    name: str
    graph: Graph

    @property
    def floor_bytes(self) -> int:
        return self.graph.floor_bytes()


def _dt(dtype: str) -> str:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype]


# --- family builders: (R, C, dtype, variant) -> Graph ------------------------------------------

def bias_act(R: int, C: int, dt: str, act: str) -> Graph:
    b = GraphBuilder(f"bias_{act}_{R}x{C}_{_dt(dt)}")
    x, bias = b.input("x", (R, C), dt), b.input("b", (C,), dt)
    h = b.add(x, bias)
    y = {"gelu_tanh": lambda: b.gelu(h, approximate="tanh"), "gelu": lambda: b.gelu(h),
         "relu": lambda: b.relu(h), "silu": lambda: b.mul(h, b.sigmoid(h)),
         "leaky_relu": lambda: b.leaky_relu(h, alpha=0.1), "tanh": lambda: b.tanh(h)}[act]()
    return b.build([y])


def gated(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    a, g = b.input("a", (R, C), dt), b.input("b", (R, C), dt)
    if kind == "swiglu":
        y = b.mul(b.mul(a, b.sigmoid(a)), g)
    else:  # geglu
        y = b.mul(b.gelu(a), g)
    return b.build([y])


def norm(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (R, C), dt)
    g = b.input("g", (C,), dt)
    if kind in ("add_layernorm", "add_layernorm_res"):
        r = b.input("r", (R, C), dt)
        h = b.add(x, r)
        y = b.layernorm(h, g, b.input("beta", (C,), dt), eps=1e-5)
        return b.build([y, h] if kind == "add_layernorm_res" else [y])
    if kind == "layernorm":
        return b.build([b.layernorm(x, g, b.input("beta", (C,), dt), eps=1e-5)])
    if kind == "add_rmsnorm":
        r = b.input("r", (R, C), dt)
        return b.build([b.rmsnorm(b.add(x, r), g, eps=1e-6)])
    return b.build([b.rmsnorm(x, g, eps=1e-6)])  # rmsnorm


def softmax(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (R, C), dt)
    if kind == "softmax":
        y = b.softmax(x)
    elif kind == "scale_mask_softmax":
        y = b.softmax(b.add(b.mul(x, 0.125), b.input("m", (C,), dt)))
    elif kind == "masked_softmax":  # a full-size additive mask (attention with padding)
        y = b.softmax(b.add(b.mul(x, 0.125), b.input("m", (R, C), dt)))
    elif kind == "log_softmax":
        y = b.log_softmax(x)
    else:  # scaled softmax with temperature and clipping
        y = b.softmax(b.clip(b.mul(x, 0.5), min=-30.0, max=30.0))
    return b.build([y])


def xent(R: int, C: int, dt: str, kind: str) -> Graph:
    """softmax_xent: logsumexp(x, row) - x[row, label[row]]; nll: -log_softmax(x)[row, label]."""
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (R, C), dt)
    lab = b.input("label", (R, 1), "int64")  # a graph input used directly as gather indices
    if kind == "softmax_xent":
        m = b.reduce_max(x, axes=(1,), keepdims=True)
        lse = b.add(b.log(b.reduce_sum(b.exp(b.sub(x, m)), axes=(1,), keepdims=True)), m)
        loss = b.sub(lse, b.gather_elements(x, lab, axis=1))
    else:
        loss = b.neg(b.gather_elements(b.log_softmax(x), lab, axis=1))
    return b.build([b.reshape(loss, shape=(R,))])


def col_reduce(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (R, C), dt)
    if kind == "col_center":
        y = b.sub(x, b.reduce_mean(x, axes=(0,), keepdims=True))
    elif kind == "col_mean":
        y = b.reduce_mean(x, axes=(0,))
    elif kind == "bias_grad":  # db = sum over rows of dy * act'(h) (gelu-free: relu mask)
        h = b.input("h", (R, C), dt)
        y = b.reduce_sum(b.where(b.gt(h, b.scalar(0.0, h)), x, b.scalar(0.0, x)), axes=(0,))
    elif kind == "col_max":
        y = b.reduce_max(x, axes=(0,))
    else:  # col_std: two chained column reductions
        d = b.sub(x, b.reduce_mean(x, axes=(0,), keepdims=True))
        y = b.sqrt(b.reduce_mean(b.mul(d, d), axes=(0,)))
    return b.build([y])


def norm_backward(R: int, C: int, dt: str, kind: str) -> Graph:
    """Layernorm/rmsnorm backward: dx needs row reductions, dgamma/dbeta column reductions."""
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    dy, x = b.input("dy", (R, C), dt), b.input("x", (R, C), dt)
    g = b.input("g", (C,), dt)
    rs = b.input("rstd", (R, 1), dt)
    if kind == "layernorm_backward":
        mu = b.input("mean", (R, 1), dt)
        xh = b.mul(b.sub(x, mu), rs)
        gdy = b.mul(dy, g)
        dx = b.mul(rs, b.sub(b.sub(gdy, b.reduce_mean(gdy, axes=(1,), keepdims=True)),
                             b.mul(xh, b.reduce_mean(b.mul(gdy, xh), axes=(1,), keepdims=True))))
        return b.build([dx, b.reduce_sum(b.mul(dy, xh), axes=(0,)), b.reduce_sum(dy, axes=(0,))])
    xh = b.mul(x, rs)
    gdy = b.mul(dy, g)
    dx = b.mul(rs, b.sub(gdy, b.mul(xh, b.reduce_mean(b.mul(gdy, xh), axes=(1,), keepdims=True))))
    return b.build([dx, b.reduce_sum(b.mul(dy, xh), axes=(0,))])


def permute(R: int, C: int, dt: str, kind: str) -> Graph:
    """Output [R, C] from an input stored [C, R]: transpose_add, bias, scale+cast."""
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (C, R), dt)
    xt = b.transpose(x, perm=(1, 0))
    if kind == "transpose_add":
        y = b.add(xt, b.input("z", (R, C), dt))
    elif kind == "transpose_bias_relu":
        y = b.relu(b.add(xt, b.input("b", (C,), dt)))
    else:  # transpose_copy: a pure layout change with a scale
        y = b.mul(xt, 2.0)
    return b.build([y])


def broadcast(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    if kind == "row_col_affine":  # x * a[R,1] + c[C] + 1
        x = b.input("x", (R, C), dt)
        y = b.add(b.add(b.mul(x, b.input("a", (R, 1), dt)), b.input("c", (C,), dt)), 1.0)
    elif kind == "outer_sum":  # u[R,1] + v[C] -> full, no full-size input
        y = b.add(b.input("u", (R, 1), dt), b.input("v", (C,), dt))
        y = b.tanh(y)
    elif kind == "mask_fill":  # where(mask[C], x, -inf-ish) * scale[R,1]
        x = b.input("x", (R, C), dt)
        keep = b.gt(b.input("mask", (C,), dt), b.scalar(0.0, x))
        y = b.mul(b.where(keep, x, b.scalar(-1e4, x)), b.input("s", (R, 1), dt))
    else:  # batch_bias: x[B, S, H] + bias[S, H] (a column block of S*H)
        bs = max(1, R // 8)
        x = b.input("x", (bs, 8, C), dt)
        y = b.relu(b.add(x, b.input("bias", (8, C), dt)))
    return b.build([y])


def eltwise_chain(R: int, C: int, dt: str, kind: str) -> Graph:
    b = GraphBuilder(f"{kind}_{R}x{C}_{_dt(dt)}")
    x = b.input("x", (R, C), dt)
    if kind == "eltwise_chain8":  # sigmoid(tanh(1.7x + 0.3) * x + 1) * 2 - exp(-x^2)
        t = b.tanh(b.add(b.mul(x, 1.7), 0.3))
        s = b.sigmoid(b.add(b.mul(t, x), 1.0))
        y = b.sub(b.mul(s, 2.0), b.exp(b.neg(b.mul(x, x))))
    elif kind == "cast_scale":  # x * 0.5 + 1 computed in float32, stored back
        xf = b.cast(x, to="float32")
        y = b.cast(b.add(b.mul(xf, 0.5), 1.0), to=dt)
    elif kind == "residual_dropout_mask":  # x * keep * 1.25 + r, keep a bool mask
        keep = b.input("keep", (R, C), "bool")
        y = b.add(b.mul(b.where(keep, x, b.scalar(0.0, x)), 1.25), b.input("r", (R, C), dt))
    else:  # poly: clipped polynomial with abs/max
        y = b.clip(b.add(b.mul(b.mul(x, x), 0.25), b.abs(x)), min=-4.0, max=4.0)
    return b.build([y])


BUILDERS: dict[str, tuple[Callable[..., Graph], tuple[str, ...]]] = {
    "bias_act": (bias_act, ("gelu_tanh", "gelu", "relu", "silu", "leaky_relu", "tanh")),
    "gated": (gated, ("swiglu", "geglu")),
    "norm": (norm, ("add_layernorm", "layernorm", "rmsnorm", "add_rmsnorm", "add_layernorm_res")),
    "softmax": (softmax, ("softmax", "scale_mask_softmax", "masked_softmax", "log_softmax", "clip_softmax")),
    "xent": (xent, ("softmax_xent", "nll")),
    "col_reduce": (col_reduce, ("col_center", "col_mean", "bias_grad", "col_max", "col_std")),
    "norm_backward": (norm_backward, ("layernorm_backward", "rmsnorm_backward")),
    "permute": (permute, ("transpose_add", "transpose_bias_relu", "transpose_copy")),
    "broadcast": (broadcast, ("row_col_affine", "outer_sum", "mask_fill", "batch_bias")),
    "eltwise_chain": (eltwise_chain, ("eltwise_chain8", "cast_scale", "residual_dropout_mask", "poly")),
}


def case(family: str, variant: str, R: int, C: int, dtype: str = "float32") -> SuiteCase:
    fn, variants = BUILDERS[family]
    if variant not in variants:
        raise ValueError(f"unknown {family} variant {variant!r}; expected one of {', '.join(variants)}")
    g = fn(R, C, dtype, variant)
    return SuiteCase(family, g.name, g)


# --- the anchors (fp32, exact definitions of the anchor table) --------------------------------

def _anchor_list() -> list[SuiteCase]:
    spec = [("bias_act", "gelu_tanh", 8192, 4096, "bias_gelu_8192x4096"),
            ("norm", "add_layernorm", 8192, 4096, "add_layernorm_8192x4096"),
            ("norm", "add_layernorm", 65536, 768, "add_layernorm_65536x768"),
            ("softmax", "scale_mask_softmax", 8192, 4096, "scale_mask_softmax_8192x4096"),
            ("softmax", "scale_mask_softmax", 262144, 128, "softmax_262144x128"),
            ("softmax", "scale_mask_softmax", 1024, 32768, "softmax_1024x32768"),
            ("norm", "rmsnorm", 8192, 4096, "rmsnorm_8192x4096"),
            ("permute", "transpose_add", 4096, 8192, "transpose_add_8192x4096"),
            ("col_reduce", "col_center", 8192, 4096, "col_center_8192x4096"),
            ("eltwise_chain", "eltwise_chain8", 8192, 4096, "eltwise_chain8_8192x4096"),
            ("xent", "softmax_xent", 8192, 4096, "softmax_xent_8192x4096"),
            ("gated", "swiglu", 8192, 4096, "swiglu_8192x4096")]
    out = []
    for fam, var, R, C, name in spec:
        g = BUILDERS[fam][0](R, C, "float32", var)
        g = Graph(g.inputs, g.outputs, g.nodes, g.types, g.constants, name)
        out.append(SuiteCase(fam, name, g))
    return out


ANCHOR_CASES: tuple[SuiteCase, ...] = tuple(_anchor_list())


# --- suites -----------------------------------------------------------------------------------

QUICK = [("bias_act", "gelu_tanh", 32, 768, "float32"), ("bias_act", "silu", 64, 1000, "bfloat16"),
         ("gated", "swiglu", 48, 512, "float16"), ("norm", "add_layernorm", 32, 768, "float32"),
         ("norm", "rmsnorm", 40, 1024, "bfloat16"), ("softmax", "scale_mask_softmax", 64, 512, "float16"),
         ("softmax", "softmax", 256, 128, "float32"), ("softmax", "log_softmax", 16, 4099, "float32"),
         ("xent", "softmax_xent", 64, 1000, "float32"), ("col_reduce", "col_center", 96, 768, "float32"),
         ("col_reduce", "bias_grad", 200, 333, "float16"),
         ("norm_backward", "layernorm_backward", 64, 768, "float32"),
         ("permute", "transpose_add", 96, 160, "float32"),
         ("broadcast", "row_col_affine", 37, 768, "bfloat16"),
         ("eltwise_chain", "eltwise_chain8", 33, 1001, "float32")]

# Shapes span 32x768 (96 KB) to 16384x8192 fp32 (512 MB); odd sizes on both axes.
_SHAPES = {
    "small": [(32, 768), (128, 1000), (333, 777), (64, 4099)],
    "medium": [(2048, 1024), (1000, 3001), (4096, 768), (8192, 128)],
    "large": [(8192, 4096), (65536, 768), (1024, 32768), (262144, 128), (30001, 1024)],
    "huge": [(16384, 8192), (4096, 50257), (131072, 1001)],
}
_SHORT = [(65536, 32), (100000, 64), (50000, 100)]
_LONG = [(256, 65536), (64, 250000)]


def _standard() -> list[tuple[str, str, int, int, str]]:
    out = []
    dts = ("float32", "float16", "bfloat16")
    for fam, (_, variants) in BUILDERS.items():
        for vi, var in enumerate(variants):
            shapes = _SHAPES["small"] + _SHAPES["medium"] + _SHAPES["large"][: 2 + vi % 3]
            for si, (R, C) in enumerate(shapes):
                out.append((fam, var, R, C, dts[(si + vi) % 3]))
    for R, C in _SHORT + _LONG:
        for var in ("softmax", "log_softmax"):
            out.append(("softmax", var, R, C, "float32"))
        out.append(("norm", "rmsnorm", R, C, "bfloat16"))
    return out


def _full() -> list[tuple[str, str, int, int, str]]:
    out = _standard()
    for fam, (_, variants) in BUILDERS.items():
        for var in variants:
            for R, C in _SHAPES["large"] + _SHAPES["huge"]:
                for dt in ("float32", "bfloat16"):
                    out.append((fam, var, R, C, dt))
    return out


def suite(name: str) -> list[SuiteCase]:
    """The workloads of suite ``name`` (quick, standard, full, anchors: the 12 anchor cases
    alone, or generalization), deterministic, names unique."""
    if name == "anchors":
        return list(ANCHOR_CASES)
    if name == "generalization":  # cut out of real models: data/graphs/generalization
        return [SuiteCase(fam, n, g) for fam, n, g in generalization_cases()]
    if name == "quick":
        specs = QUICK
    elif name == "standard":
        specs = _standard()
    elif name == "full":
        specs = _full()
    elif name == "breadth":  # off-grid shapes and dtypes (suite_breadth.py), no anchors
        specs = breadth_specs({fam: variants for fam, (_, variants) in BUILDERS.items()})
    else:
        raise ValueError(f"unknown suite {name!r}; expected one of {', '.join(SUITES)}")
    cases: dict[str, SuiteCase] = {}
    for fam, var, R, C, dt in specs:
        c = case(fam, var, R, C, dt)
        cases.setdefault(c.name, c)
    if name not in ("quick", "breadth"):
        for c in _anchor_list():
            cases.setdefault(c.name, c)
    return list(cases.values())

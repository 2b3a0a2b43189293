"""CuPy implementations of the plan steps that are not generated fused kernels.

Every builder returns ``(launch, kernels)``: ``launch()`` enqueues the work on the current CuPy
stream (the executor's), writing into preallocated output arrays, and ``kernels`` counts the
device kernels it enqueues. Nothing here synchronises or copies between host and device, so every
launch can be captured into a CUDA graph.

* matmul / gemm: cuBLAS through ``tunedb.runtime.blas`` (ctypes, its own handle and workspace),
  because CuPy refuses cuBLAS calls while a stream captures a CUDA graph. float32 stays float32
  (TF32 only with ``CUPY_TF32=1``, which the executor reports); gemm's ``beta * C`` is cuBLAS's
  ``beta`` on a copy of C already in the output, or, for a bias vector with cuBLASLt switched
  on, cuBLASLt's bias epilogue in one launch (``tunedb.runtime.executor_lt``).
* conv2d: a 1x1 stride-1 convolution is one GEMM over the channels; a depthwise one is one
  kernel; any other is an im2col kernel into a scratch buffer then one batched GEMM (CuPy 14 has
  no cuDNN), then a broadcast bias add. Where per-sample GEMM rows are unaligned or short, the
  batch runs as one GEMM instead (``tunedb.runtime.executor_conv``). float32 and bfloat16
  (im2col moves the 16-bit bits, the GEMM accumulates in fp32, the depthwise and bias kernels
  round once to nearest even).
* pools: one window kernel per pool (max, average with or without the padding counted); global
  pools are the same kernel with one window over all spatial positions (CuPy reductions may
  allocate while capturing).
* layout ops: CuPy copies on the storage (bit) level, so they work for every dtype.
* anything else: ``Evaluator`` runs the op (or a whole step's sub-graph) node by node with CuPy
  in float32 (integers and bools natively), with the reference interpreter's semantics.

bfloat16 lives as its uint16 bits (what the generated kernels read and write); compute paths
widen it to float32 and round back to nearest even.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tunedb.graph.ir import FLOAT_DTYPES, Graph, Node, TensorType
from tunedb.graph.ops import check_node, slice_bounds
from tunedb.runtime.conv_cudnn import Cudnn, CudnnError, conv_layout, cudnn_wanted
from tunedb.runtime.copykernel import strided_copy
from tunedb.runtime.executor_conv import conv_form, conv_launches, im2col_gemm
from tunedb.runtime.executor_kernels import KERNEL_SOURCE
from tunedb.runtime.inputs import bf16_bits

Launch = Callable[[], None]
BLOCK = 256
NVRTC_OPTIONS = ("-std=c++17",)

class KernelSet:
    """The executor's own CUDA kernels (im2col, pools), compiled once per process."""

    _module: Any = None

    def __init__(self, cp: Any, sm_count: int) -> None:
        self.cp = cp
        self.max_blocks = max(1, sm_count) * 32
        if KernelSet._module is None:
            KernelSet._module = cp.RawModule(code=KERNEL_SOURCE, options=NVRTC_OPTIONS)
        self.module = KernelSet._module

    def launch(self, name: str, total: int, args: Sequence[Any]) -> Launch:
        fn = self.module.get_function(name)
        grid = (max(1, min(self.max_blocks, -(-int(total) // BLOCK))),)
        # Scalars go as int64: every scalar parameter of these kernels is a long long.
        full = tuple(np.int64(a) if isinstance(a, (int, np.integer)) else a for a in args)

        def run() -> None:
            fn(grid, (BLOCK,), full)

        return run

    def launch_rows(self, name: str, rows: int, row_len: int, args: Sequence[Any]) -> Launch:
        """A kernel with a block per row (grid-stride over rows), threads along the row."""
        fn = self.module.get_function(name)
        grid = (max(1, min(int(rows), 1 << 20)),)
        block = (max(32, min(BLOCK, -(-int(row_len) // 32) * 32)),)
        full = tuple(np.int64(a) if isinstance(a, (int, np.integer)) else a for a in args)

        def run() -> None:
            fn(grid, block, full)

        return run


# -- storage <-> compute --------------------------------------------------------------------------
def storage_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        return np.dtype(np.uint16)
    return np.dtype(np.bool_) if dtype == "bool" else np.dtype(dtype)


def load(cp: Any, a: Any, dtype: str) -> Any:
    """A stored array as a compute array: floats as float32, integers and bools as they are."""
    if dtype == "bfloat16":
        return (a.astype(cp.uint32) << 16).view(cp.float32)
    if dtype == "float16":
        return a.astype(cp.float32)
    return a


def to_bf16_bits(cp: Any, v: Any) -> Any:
    """float32 -> bfloat16 bits, round to nearest even; NaN -> the quiet NaN 0x7FC0."""
    v = cp.ascontiguousarray(v, dtype=cp.float32)
    bits = v.view(cp.uint32)
    one, sixteen = np.uint32(1), np.uint32(16)
    r = ((bits + np.uint32(0x7FFF) + ((bits >> sixteen) & one)) >> sixteen).astype(cp.uint16)
    return cp.where(cp.isnan(v), np.uint16(0x7FC0), r)


def store(cp: Any, v: Any, out: Any, dtype: str) -> None:
    """Write compute value ``v`` into the stored array ``out`` (rounding to the graph dtype)."""
    if dtype == "bfloat16":
        cp.copyto(out, to_bf16_bits(cp, v))
    else:
        cp.copyto(out, v, casting="unsafe")


def storage_scalar(value: float, dtype: str) -> Any:
    """``value`` as one element of the stored dtype (bfloat16 as its bits)."""
    if dtype == "bfloat16":
        return np.uint16(bf16_bits(np.asarray([value], dtype=np.float32))[0])
    if dtype == "bool":
        return np.bool_(value)
    return storage_dtype(dtype).type(value)


# -- reference semantics in CuPy ------------------------------------------------------------------
def _slices(rank: int, a: dict, shape: Sequence[int]) -> tuple:
    index: list[Any] = [slice(None)] * rank
    bounds = slice_bounds([shape[i] for i in a["axes"]], a["starts"], a["ends"], a["steps"])
    for ax, (s, e, _), st in zip(a["axes"], bounds, a["steps"]):
        index[ax] = slice(s, e if e >= 0 else None, st)
    return tuple(index)


def _gelu(cp: Any, x: Any, a: dict) -> Any:
    if a["approximate"] == "tanh":
        return 0.5 * x * (1.0 + cp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    from cupyx.scipy.special import erf

    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))


def _cast(cp: Any, x: Any, to: str) -> Any:
    if to in FLOAT_DTYPES:
        return x.astype(cp.float32)
    if to == "bool":
        return x != 0
    if x.dtype.kind == "f":
        x = cp.trunc(x)
    return x.astype(cp.int64).astype(to)  # int64 first: int32 wraps like C


def _clip(cp: Any, x: Any, a: dict) -> Any:
    lo, hi = a["min"], a["max"]
    if x.dtype.kind in "iu":
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
    if lo is not None:
        x = cp.maximum(x, x.dtype.type(lo))
    if hi is not None:
        x = cp.minimum(x, x.dtype.type(hi))
    return x


def _unary(cp: Any, op: str, x: Any, a: dict) -> Any:
    if op == "erf":
        from cupyx.scipy.special import erf

        return erf(x)
    if op in ("floor", "ceil") and x.dtype.kind != "f":
        return x
    simple = {"neg": cp.negative, "abs": cp.abs, "exp": cp.exp, "log": cp.log, "sqrt": cp.sqrt,
              "sin": cp.sin, "cos": cp.cos, "tanh": cp.tanh, "floor": cp.floor, "ceil": cp.ceil,
              "sign": cp.sign, "not": cp.logical_not}
    if op in simple:
        return simple[op](x)
    if op == "rsqrt":
        return 1.0 / cp.sqrt(x)
    if op == "reciprocal":
        return 1.0 / x
    if op == "sigmoid":
        return 1.0 / (1.0 + cp.exp(-x))
    if op == "relu":
        return cp.maximum(x, x.dtype.type(0))
    if op == "identity":
        return x
    if op == "gelu":
        return _gelu(cp, x, a)
    if op == "clip":
        return _clip(cp, x, a)
    if op == "cast":
        return _cast(cp, x, a["to"])
    if op == "leaky_relu":
        return cp.where(x >= 0, x, x * a["alpha"])
    raise NotImplementedError(op)


def _binary(cp: Any, op: str, x: Any, y: Any) -> Any:
    if op == "div" and x.dtype.kind in "iu":
        q = cp.abs(x) // cp.where(y == 0, 1, cp.abs(y))
        return cp.where(y == 0, 0, cp.sign(x) * cp.sign(y) * q)
    if op == "mod" and x.dtype.kind in "iu":
        return cp.mod(x, cp.where(y == 0, 1, y)) * (y != 0)
    fn = {"add": cp.add, "sub": cp.subtract, "mul": cp.multiply, "div": cp.divide, "pow": cp.power,
          "max": cp.maximum, "min": cp.minimum, "mod": cp.mod, "eq": cp.equal, "ne": cp.not_equal,
          "lt": cp.less, "le": cp.less_equal, "gt": cp.greater, "ge": cp.greater_equal,
          "and": cp.logical_and, "or": cp.logical_or}[op]
    return fn(x, y)


def eval_node(cp: Any, node: Node, a: dict, args: list[Any], out_types: list[TensorType],
              ops: ComputeOps) -> list[Any]:
    """One node on compute arrays (float32 / int / bool), with the reference's semantics."""
    op = node.op
    x = args[0] if args else None
    shape = out_types[0].shape if out_types else ()
    if op in ("where",):
        return [cp.where(*args)]
    if op in ("add", "sub", "mul", "div", "pow", "max", "min", "mod", "eq", "ne", "lt", "le", "gt",
              "ge", "and", "or"):
        return [_binary(cp, op, args[0], args[1])]
    if op.startswith("reduce_"):
        fn = {"reduce_sum": cp.sum, "reduce_mean": cp.mean, "reduce_max": cp.amax,
              "reduce_min": cp.amin, "reduce_prod": cp.prod}[op]
        return [fn(x, axis=tuple(a["axes"]), keepdims=bool(a["keepdims"]))]
    if op == "argmax":
        y = cp.argmax(x, axis=a["axis"]).astype(cp.int64)
        return [cp.expand_dims(y, a["axis"]) if a["keepdims"] else y]
    if op in ("global_avg_pool", "global_max_pool"):
        fn = cp.mean if op == "global_avg_pool" else cp.amax
        return [fn(x, axis=tuple(range(2, x.ndim)), keepdims=True)]
    if op == "transpose":
        return [cp.transpose(x, a["perm"])]
    if op in ("reshape", "squeeze", "unsqueeze"):
        return [x.reshape(shape)]
    if op == "expand":
        return [cp.broadcast_to(x, shape)]
    if op == "slice":
        return [x[_slices(x.ndim, a, x.shape)]]
    if op == "concat":
        out = cp.empty(shape, dtype=args[0].dtype)
        _concat_into(cp, args, out, a["axis"])
        return [out]
    if op == "split":
        return [p for p in _split_views(x, a["axis"], a["sizes"])]
    if op == "pad":
        out = cp.empty(shape, dtype=x.dtype)
        value = x.dtype.type(a["value"]) if x.dtype.kind != "b" else bool(a["value"])
        _pad_into(cp, x, out, a["pads"], value)
        return [out]
    if op == "gather":
        return [cp.take(x, args[1], axis=a["axis"])]
    if op == "gather_elements":
        return [cp.take_along_axis(x, args[1], axis=a["axis"])]
    if op in ("matmul", "gemm") and x.dtype.kind != "f":
        return [_int_matmul(cp, op, a, args)]  # cuBLAS has no integer GEMM here
    if op in ("matmul", "gemm", "conv2d", "max_pool2d", "avg_pool2d"):
        xs = list(args)
        back = None
        if op.endswith("pool2d") and x.dtype.kind != "f":
            xs[0], back = x.astype(cp.float64), x.dtype  # exact for |x| < 2**53
        out = cp.empty(shape, dtype=xs[0].dtype)
        for launch in ops.build(node, a, xs, [out])[0]:
            launch()
        return [out.astype(back) if back is not None else out]
    return [_unary(cp, op, x, a)]


def _int_matmul(cp: Any, op: str, a: dict, args: list[Any]) -> Any:
    x, y = args[0], args[1]
    if op == "matmul":
        return cp.matmul(x, y)
    out = cp.matmul(x.T if a["trans_a"] else x, y.T if a["trans_b"] else y)
    if float(a["alpha"]) != 1.0:
        out = out * out.dtype.type(a["alpha"])
    if len(args) == 3 and float(a["beta"]) != 0.0:
        out = out + args[2] * out.dtype.type(a["beta"])
    return out


def device_views(op: str, a: dict, x: Any, out_shapes: Sequence[Sequence[int]]) -> list[Any]:
    """The outputs of a view node (reshape-like, or a strided transpose/slice/split planned as a
    view, tunedb.plan.views; ``a``: its canonical attributes) as arrays over ``x``'s bytes,
    CuPy's views where strides express them; the executor checks that no copy was made."""
    if op == "transpose":
        return [x.transpose(a["perm"])]
    if op == "slice":
        return [x[_slices(x.ndim, a, x.shape)]]
    if op == "split":
        return _split_views(x, a["axis"], a["sizes"])
    return [x.reshape(tuple(out_shapes[0]))]


def _split_views(x: Any, axis: int, sizes: Sequence[int]) -> list[Any]:
    out, start = [], 0
    for s in sizes:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + s)
        out.append(x[tuple(index)])
        start += s
    return out


def _concat_into(cp: Any, args: Sequence[Any], out: Any, axis: int) -> int:
    """One copy per input (CuPy's concatenate uploads a pointer table: not capturable)."""
    start, n = 0, 0
    for t in args:
        index = [slice(None)] * out.ndim
        index[axis] = slice(start, start + t.shape[axis])
        start += t.shape[axis]
        if t.size:
            cp.copyto(out[tuple(index)], t)
            n += 1
    return n


def _pad_into(cp: Any, x: Any, out: Any, pads: Sequence[int], value: Any) -> int:
    r = x.ndim
    crop = tuple(slice(max(0, -pads[i]), x.shape[i] - max(0, -pads[i + r])) for i in range(r))
    inner = tuple(slice(max(0, pads[i]), out.shape[i] - max(0, pads[i + r])) for i in range(r))
    n = 0
    if any(p > 0 for p in pads):
        out.fill(value)
        n += 1
    src = x[crop]
    if src.size:
        cp.copyto(out[inner], src)
        n += 1
    return n


class Evaluator:
    """A sub-graph run node by node in CuPy: stored inputs in, stored outputs out."""

    def __init__(self, cp: Any, graph: Graph, ops: ComputeOps) -> None:
        self.cp, self.graph, self.ops = cp, graph, ops
        types = graph.type_map
        self.types = types
        self.attrs = [check_node(n, [types[v] for v in n.inputs])[1] for n in graph.nodes]
        self.consts = {}
        for name, c in graph.constants:
            arr = c.array  # bfloat16 widened to float32: already the compute form
            self.consts[name] = cp.asarray(arr.astype(np.float32) if c.type.dtype in FLOAT_DTYPES else arr)

    def launch(self, ins: Sequence[Any], outs: Sequence[Any]) -> tuple[Launch, int]:
        cp, g = self.cp, self.graph

        def run() -> None:
            env: dict[str, Any] = dict(self.consts)
            for v, a in zip(g.inputs, ins):
                env[v] = load(cp, a, self.types[v].dtype)
            for node, attrs in zip(g.nodes, self.attrs):
                res = eval_node(cp, node, attrs, [env[v] for v in node.inputs],
                                [self.types[o] for o in node.outputs], self.ops)
                env.update(zip(node.outputs, res))
            for v, o in zip(g.outputs, outs):
                store(cp, env[v], o, self.types[v].dtype)

        # Counted as one kernel per node plus one store per output: CuPy may launch a few more.
        return run, len(g.nodes) + len(g.outputs)


# -- compute ops writing straight into their outputs ----------------------------------------------
def _bias_vector_gemm(alpha: float, beta: float, trans_a: Any, c_shape: Sequence[int],
                      out_shape: Sequence[int]) -> bool:
    """``alpha * A @ B + beta * C`` is ``A @ B`` plus a bias vector along a 2-D output's columns
    (a ``[M, 1]`` C of the same size broadcasts along the rows: no bias vector)."""
    n = out_shape[-1]
    return (alpha == beta == 1.0 and not trans_a and len(out_shape) == 2
            and tuple(c_shape) in ((n,), (1, n)))


def gemm_bias_epilogue(node: Node, types: Mapping[str, TensorType]) -> bool:
    """A gemm that adds a bias vector to ``A @ B`` (alpha = beta = 1, A not transposed): one
    cuBLASLt call with its bias epilogue where cuBLASLt is on."""
    if node.op != "gemm" or len(node.inputs) != 3 or not node.inputs[2]:
        return False
    return _bias_vector_gemm(node.attr("alpha", 1.0), node.attr("beta", 1.0), node.attr("trans_a", 0),
                             types[node.inputs[2]].shape, types[node.outputs[0]].shape)


def compute_launches(node: Node, types: Mapping[str, TensorType], cublaslt: bool = True) -> int:
    """Kernels ``ComputeOps.build`` launches for ``node`` (no GPU needed): a conv2d adds its
    im2col kernel and, unless depthwise, its bias kernel; a gemm with ``beta * C`` copies C
    first unless cuBLASLt takes the bias vector (``cublaslt``: it is on). 1 for other nodes."""
    if node.op == "conv2d":
        a = check_node(node, [types[v] for v in node.inputs])[1]
        x, w, out = types[node.inputs[0]], types[node.inputs[1]].shape, types[node.outputs[0]].shape
        isz = storage_dtype(x.dtype).itemsize
        bias = len(node.inputs) == 3 and bool(node.inputs[2]) and conv_form(x.shape, w, a, isz) != "depthwise"
        return conv_launches(x.shape, w, out, a, isz) + int(bias)
    if node.op == "gemm" and len(node.inputs) == 3 and node.inputs[2] and node.attr("beta", 1.0) != 0.0:
        return 1 if cublaslt and gemm_bias_epilogue(node, types) else 2
    return 1


class ComputeOps:
    """Builders for single compute / layout nodes on stored arrays. ``build`` returns
    ``(launches, kernels, path)``; ``path`` names the implementation for the executor's report."""

    def __init__(self, cp: Any, kernels: KernelSet, scratch: Callable[[int], Callable[[], Any]],
                 blas: Any, lt: Any = None) -> None:
        self.cp, self.k, self.blas = cp, kernels, blas
        self.lt = lt  # a tunedb.runtime.executor_lt.BlasLt: gemm bias vectors as its epilogue
        self.scratch = scratch  # nbytes -> getter of a uint8 device buffer of at least that size
        self.dnn: Any = None  # a conv_cudnn.Cudnn, made at the first convolution sent to cuDNN
        self.dnn_error = ""  # why cuDNN could not be loaded: its convolutions take im2col
        self.dnn_skipped: list[str] = []  # convolutions cuDNN could not run, and why
        self.constant_ptrs: set[int] = set()  # device addresses of the plan's constants (the executor's)
        self.conv_io: dict[int, tuple[bool, bool]] = {}  # conv_chain.conv_io: NHWC input / output

    def build(self, node: Node, a: dict, ins: list[Any], outs: list[Any]) -> tuple[list[Launch], int, str]:
        op = node.op
        if op == "matmul":
            return [self._matmul(ins[0], ins[1], outs[0])], 1, "cublas"
        if op == "gemm":
            return self._gemm(ins, outs[0], a)
        if op == "conv2d":
            return self._conv(ins, outs[0], a)
        if op in ("max_pool2d", "avg_pool2d"):
            return self._pool(op, ins[0], outs[0], a)
        if op in ("global_avg_pool", "global_max_pool"):
            return self._global_pool(op, ins[0], outs[0])
        raise NotImplementedError(op)

    def _matmul(self, x: Any, y: Any, out: Any, alpha: float = 1.0, beta: float = 0.0) -> Launch:
        # bfloat16 is stored as its uint16 bits: cuBLAS is told the type (fp32 accumulation).
        bf16 = "bfloat16" if out.dtype == np.uint16 else None
        return self.blas.gemm(x, y, out, alpha=alpha, beta=beta, dtype=bf16)

    def _gemm(self, ins: list[Any], out: Any, a: dict) -> tuple[list[Launch], int, str]:
        cp = self.cp
        A = ins[0].T if a["trans_a"] else ins[0]
        B = ins[1].T if a["trans_b"] else ins[1]
        alpha, beta = float(a["alpha"]), float(a["beta"])
        steps: list[Launch] = []
        # the same rule as the plan's ``gemm_bias_epilogue``, on the arrays
        if self.lt is not None and len(ins) == 3 \
                and _bias_vector_gemm(alpha, beta, a["trans_a"], ins[2].shape, out.shape):
            dtype = "bfloat16" if out.dtype == np.uint16 else str(out.dtype)
            one = self.lt.gemm_bias(ins[0], ins[1], ins[2].reshape(-1), out, trans_b=bool(a["trans_b"]),
                                    dtype=dtype)
            if one is not None:
                return [one], 1, "cublasLt bias epilogue"
        if len(ins) == 3 and beta != 0.0:
            c = cp.broadcast_to(ins[2], out.shape)
            steps.append(lambda: cp.copyto(out, c))  # cuBLAS then adds alpha * A @ B to beta * C
        else:
            beta = 0.0
        steps.append(self._matmul(A, B, out, alpha, beta))
        return steps, len(steps), "cublas"

    def _global_pool(self, op: str, x: Any, out: Any) -> tuple[list[Launch], int, str]:
        # One pool window over all spatial positions of each (n, c): [N, C, 1, S] -> [N, C, 1, 1].
        if not (x.flags.c_contiguous and out.flags.c_contiguous):
            raise NotImplementedError(f"{op} on a strided array")
        n, c = x.shape[:2]
        s = int(np.prod(x.shape[2:], dtype=np.int64))
        x4, out4 = x.reshape(n, c, 1, s), out.reshape(n, c, 1, 1)
        mode = 0 if op == "global_max_pool" else 1
        a = {"kernel": (1, s), "strides": (1, 1), "pads": (0, 0, 0, 0), "dilations": (1, 1),
             "count_include_pad": False}
        return self._pool("max_pool2d" if mode == 0 else "avg_pool2d", x4, out4, a)

    def _conv(self, ins: list[Any], out: Any, a: dict) -> tuple[list[Launch], int, str]:
        cp = self.cp
        x, w = ins[0], ins[1]
        n, c, h, wd = x.shape
        o, _, kh, kw = w.shape
        (sh, sw), (pt, pl, _, _), (dh, dw) = a["strides"], a["pads"], a["dilations"]
        _, _, oh, ow = out.shape
        steps: list[Launch] = []
        bf16 = out.dtype == np.uint16  # bfloat16 bits: GEMMs on cuBLAS, kernels on the bits
        form = conv_form(x.shape, w.shape, a, out.dtype.itemsize)
        dnn = self._cudnn_conv(x, w, out, a, bf16) if form != "depthwise" and not self.dnn_error \
            and cudnn_wanted(x.shape, w.shape, out.shape, a, out.dtype.itemsize) else None
        if dnn is not None:
            steps += dnn
            path = "cudnn"
        elif form == "1x1":  # on [N, C, 1, 1] too: x[N, C] @ W^T ran fp32 SE convs 3.7 -> 54 µs (H200)
            w2, x3, y3 = w.reshape(o, c), x.reshape(n, c, h * wd), out.reshape(n, o, oh * ow)
            steps.append(self._matmul(w2, x3, y3))
            path = "cublas (1x1 conv as GEMM)"
        elif form == "depthwise" and x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous:
            bias = ins[2] if len(ins) == 3 else w
            tail = (n * o * oh * ow, c, h, wd, oh, ow, kh, kw, sh, sw, pt, pl, dh, dw, len(ins) == 3)
            name = "tdbx_dwconv2d_bf16" if bf16 else "tdbx_dwconv2d_f32"
            launch = self.k.launch(name, tail[0], (x, w, bias, out) + tail)
            return [launch], 1, "depthwise kernel"
        else:
            steps += im2col_gemm(self, x, w, out, a, merged=form == "im2col merged")
            path = "im2col + cublas, batch merged" if form == "im2col merged" else "im2col + cublas"
        if len(ins) == 3 and bf16:
            steps.append(self.k.launch("tdbx_bias_nchw_bf16", out.size, (out, ins[2], out.size, o, oh * ow)))
        elif len(ins) == 3:
            bias = ins[2].reshape(1, o, 1, 1)
            steps.append(lambda: cp.add(out, bias, out=out))
        return steps, len(steps), path

    def _cudnn_conv(self, x: Any, w: Any, out: Any, a: dict, bf16: bool) -> list[Launch] | None:
        """cuDNN's launches of the convolution, or None (im2col then) where the library does not
        load here or has no algorithm for it (noted in ``dnn_skipped``)."""
        if self.dnn is None:  # one handle per builder, on the stream of its cuBLAS handle
            try:
                self.dnn = Cudnn(self.cp, self.blas.stream)
            except CudnnError as e:
                self.dnn_error = str(e)
                return None
        chain = self.conv_io.get(int(w.data.ptr))  # channels-last with its neighbours
        io = chain or (False, False)
        layout = "nhwc" if chain else conv_layout(x.shape, w.shape, out.shape, a, out.dtype.itemsize)
        try:
            return self.dnn.conv(x, w, out, a, "bfloat16" if bf16 else str(out.dtype), self.scratch,
                                 constant_w=w.data.ptr in self.constant_ptrs, io_nhwc=io, layout=layout)
        except CudnnError as e:
            if io != (False, False):  # its neighbours read or write NHWC: im2col would not do
                raise
            self.dnn_skipped.append(f"conv {tuple(x.shape)} * {tuple(w.shape)}: {e}")
            return None

    def _pool(self, op: str, x: Any, out: Any, a: dict) -> tuple[list[Launch], int, str]:
        (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
        dh, dw = a.get("dilations", (1, 1))
        mode = 0 if op == "max_pool2d" else (2 if a.get("count_include_pad") else 1)
        _, _, h, w = x.shape
        _, _, oh, ow = out.shape
        total = out.size
        name = "tdbx_pool2d_f32" if x.dtype == np.float32 else "tdbx_pool2d_f64"
        tail = (total, h, w, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, mode)
        if x.dtype in (np.float32, np.float64):
            return [self.k.launch(name, total, (x, out) + tail)], 1, "pool kernel"
        raise NotImplementedError(f"{op} on {x.dtype}")  # the caller runs it through load/store


def compute_launch(cp: Any, ops: ComputeOps, node: Node, a: dict, dtypes: list[str], ins: list[Any],
                   outs: list[Any], out_dtype: str) -> tuple[list[Launch], int, str] | None:
    """A single compute node straight on its stored arrays, when their dtype allows it
    (float32; float16 for the cuBLAS ops; bfloat16 for those and conv2d); ``None``: run it
    through the ``Evaluator``."""
    op = node.op
    direct = {"float32"} | ({"float16", "bfloat16"} if op in ("matmul", "gemm") else
                            {"bfloat16"} if op == "conv2d" else set())
    if op in ("global_avg_pool", "global_max_pool"):
        direct = {"float32"}
    if op in ("matmul", "gemm", "conv2d", "max_pool2d", "avg_pool2d", "global_avg_pool",
              "global_max_pool") and set(dtypes) <= direct and out_dtype in direct:
        return ops.build(node, a, ins, outs)
    return None


def layout_launch(cp: Any, node: Node, a: dict, ins: list[Any], outs: list[Any],
                  dtype: str) -> tuple[list[Launch], int] | None:
    """A single data-movement node on the stored bits (any dtype); ``None`` if not one."""
    op = node.op
    x = ins[0] if ins else None
    if op in ("transpose", "slice", "reshape", "squeeze", "unsqueeze", "identity"):
        src = device_views(op, a, x, [outs[0].shape])[0]
    elif op == "expand":
        src = cp.broadcast_to(x, outs[0].shape)
    elif op == "gather":
        xs, idx, out, axis = x, ins[1], outs[0], a["axis"]
        return [lambda: cp.take(xs, idx, axis=axis, out=out)], 1
    elif op == "concat":
        args, out, axis = list(ins), outs[0], a["axis"]
        n = sum(1 for t in args if t.size)
        return [lambda: _concat_into(cp, args, out, axis)], n
    elif op == "split":
        copies = [strided_copy(cp, s, o) for o, s in zip(outs, _split_views(x, a["axis"], a["sizes"]))
                  if o.size]
        return [lambda: [c() for c in copies]], len(copies)
    elif op == "pad":
        out, pads, value = outs[0], a["pads"], storage_scalar(a["value"], dtype)
        n = int(any(p > 0 for p in pads)) + 1
        return [lambda: _pad_into(cp, x, out, pads, value)], n
    else:
        return None
    return [strided_copy(cp, src, outs[0])], 1

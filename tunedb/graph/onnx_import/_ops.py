"""One handler per ONNX op: ``_op_<OpType>(node, attrs)`` emits tunedb primitives.

Handlers run only for nodes with at least one computed (non-constant) input; nodes whose inputs
are all constants were folded before (see ``_convert``). Attribute-vs-input differences between
opsets (axes of Squeeze/Unsqueeze/Reduce*, Split sizes, Slice bounds, Pad pads, Clip bounds) are
resolved here, against ``self.opset``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

UNARY = {"Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
         "Reciprocal": "reciprocal", "Sin": "sin", "Cos": "cos", "Tanh": "tanh",
         "Sigmoid": "sigmoid", "Relu": "relu", "Erf": "erf", "Floor": "floor", "Ceil": "ceil",
         "Sign": "sign", "Not": "not"}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "And": "and",
          "Or": "or", "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt",
          "GreaterOrEqual": "ge", "Xor": "ne"}
# Ops that only ever produce constants here: shape/data computations with constant inputs.
FOLD_ONLY = frozenset(("Constant", "ConstantOfShape", "Range"))


def _prod(dims: Sequence[int]) -> int:
    return int(np.prod(dims, dtype=np.int64))


class OpHandlers:
    """Mixin of ``_Importer``: relies on its value helpers (val, set, shape, dtype, ints, ...)."""

    # -- elementwise --------------------------------------------------------------------------
    def _op_Identity(self, n, a):
        self.set(0, self.val(n.input[0]))

    def _op_Dropout(self, n, a):
        if self.opset >= 12 and len(n.input) > 2 and n.input[2]:
            if bool(np.asarray(self.const(2, "training_mode")).reshape(-1)[0]):
                raise self.err("training_mode=True is not supported (inference only)")
        self.set(0, self.val(n.input[0]))
        if len(n.output) > 1 and n.output[1]:  # the mask of an inference dropout keeps all
            self.consts[n.output[1]] = np.ones(self.shape(n.input[0]), dtype=bool)

    def _op_Max(self, n, a, op="max"):
        vals = [self.val(i) for i in n.input if i]
        acc = vals[0]
        for v in vals[1:]:
            acc = self.b.op(op, acc, v)
        self.set(0, acc)

    def _op_Min(self, n, a):
        self._op_Max(n, a, "min")

    def _op_Sum(self, n, a):
        self._op_Max(n, a, "add")

    def _op_Mean(self, n, a):
        self._op_Sum(n, a)
        k = len([i for i in n.input if i])
        if k > 1:
            y = self.env[n.output[0]]
            self.set(0, self.b.div(y, self.b.scalar(float(k), y)))

    def _op_Mod(self, n, a):
        x, y = self.val(n.input[0]), self.val(n.input[1])
        r = self.b.mod(x, y)  # tunedb mod is floored: the divisor's sign (ONNX fmod=0)
        if a.get("fmod", 0):
            # C fmod takes the dividend's sign: where the signs differ and r != 0, subtract y.
            z = self.b.scalar(0, x)
            fix = self.b.and_(self.b.ne(r, z), self.b.ne(self.b.lt(x, z), self.b.lt(y, z)))
            r = self.b.where(fix, self.b.sub(r, y), r)
        self.set(0, r)

    def _op_LeakyRelu(self, n, a):
        self.set(0, self.b.leaky_relu(self.val(n.input[0]), alpha=float(a.get("alpha", 0.01))))

    def _op_Gelu(self, n, a):
        self.set(0, self.b.gelu(self.val(n.input[0]), approximate=a.get("approximate", "none")))

    def _hard_sigmoid(self, x: str, alpha: float, beta: float) -> str:
        return self.b.clip(self.b.add(self.b.mul(x, self.b.scalar(alpha, x)), self.b.scalar(beta, x)),
                           min=0.0, max=1.0)

    def _op_HardSigmoid(self, n, a):
        x = self.val(n.input[0])
        self.set(0, self._hard_sigmoid(x, float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))))

    def _op_HardSwish(self, n, a):  # x * HardSigmoid(x) with alpha 1/6, beta 1/2
        x = self.val(n.input[0])
        self.set(0, self.b.mul(x, self._hard_sigmoid(x, 1.0 / 6.0, 0.5)))

    def _op_Where(self, n, a):
        self.set(0, self.b.where(*(self.val(i) for i in n.input)))

    def _op_Clip(self, n, a):
        x = self.val(n.input[0])
        if self.opset < 11:
            lo, hi = a.get("min"), a.get("max")
        else:
            lo, hi = (self._scalar_input(i) for i in (1, 2))
        if isinstance(lo, str) or isinstance(hi, str):  # computed bounds: max, then min
            y = self.b.max(x, lo if isinstance(lo, str) else self.b.scalar(lo, x)) \
                if lo is not None else x
            self.set(0, (self.b.min(y, hi if isinstance(hi, str) else self.b.scalar(hi, x))
                         if hi is not None else y))
        else:
            self.set(0, self.b.clip(x, min=lo, max=hi))

    def _scalar_input(self, i: int) -> float | str | None:
        n = self.node
        if i >= len(n.input) or not n.input[i]:
            return None
        if n.input[i] in self.consts:
            return float(np.asarray(self.consts[n.input[i]], dtype=np.float64).reshape(-1)[0])
        return self.val(n.input[i])

    def _op_Cast(self, n, a):
        to = int(a["to"])
        if to == 11 and self.dtype(n.input[0]) in ("float32", "float16", "bfloat16"):
            # DOUBLE: the TorchScript exporter widens fp16 before IsInf (T5). tunedb has no
            # float64; float32 holds these values exactly, what follows computes in float32.
            to = 1
        self.set(0, self.cast(n.input[0], self.dtype_of_onnx(to)))

    def _op_CastLike(self, n, a):
        self.set(0, self.cast(n.input[0], self.dtype(n.input[1])))

    # -- reductions ---------------------------------------------------------------------------
    def _reduce(self, n, a, op: str, attr_before: int = 18) -> None:
        axes = self._axes(a, attr_before)
        x = self.val(n.input[0])
        if not axes and a.get("noop_with_empty_axes", 0):
            self.set(0, x)
            return
        self.set(0, self.b.op(op, x, axes=tuple(axes) if axes else None,
                              keepdims=bool(a.get("keepdims", 1))))

    def _op_ReduceSum(self, n, a):
        self._reduce(n, a, "reduce_sum", 13)

    def _op_ReduceMean(self, n, a):
        self._reduce(n, a, "reduce_mean")

    def _op_ReduceMax(self, n, a):
        self._reduce(n, a, "reduce_max")

    def _op_ReduceMin(self, n, a):
        self._reduce(n, a, "reduce_min")

    def _op_ReduceProd(self, n, a):
        self._reduce(n, a, "reduce_prod")

    def _op_ArgMax(self, n, a, neg: bool = False):
        if a.get("select_last_index", 0):
            raise self.err("select_last_index=1 is not supported")
        x = self.val(n.input[0])
        self.set(0, self.b.argmax(self.b.neg(x) if neg else x, axis=int(a.get("axis", 0)),
                                  keepdims=bool(a.get("keepdims", 1))))

    def _op_ArgMin(self, n, a):
        self._op_ArgMax(n, a, neg=True)

    # -- layout -------------------------------------------------------------------------------
    def _op_Transpose(self, n, a):
        perm = a.get("perm")
        self.set(0, self.b.transpose(self.val(n.input[0]),
                                     perm=None if perm is None else tuple(int(p) for p in perm)))

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        shape = tuple(int(s) for s in shape)
        return x if self.b.type_of(x).shape == shape else self.b.reshape(x, shape=shape)

    def _op_Reshape(self, n, a):
        src = self.shape(n.input[0])
        target = self.ints(1, "shape")
        allowzero = a.get("allowzero", 0)
        dims = [src[i] if (s == 0 and not allowzero) else s for i, s in enumerate(target)]
        if dims.count(-1) == 1:
            known = _prod([d for d in dims if d != -1])
            if known and _prod(src) % known == 0:
                dims[dims.index(-1)] = _prod(src) // known
        if any(d < 0 for d in dims) or _prod(dims) != _prod(src):
            raise self.err(f"cannot reshape {list(src)} to {target}")
        self.set(0, self.reshape(self.val(n.input[0]), dims))

    def _op_Flatten(self, n, a):
        src = self.shape(n.input[0])
        axis = self.axis(int(a.get("axis", 1)), len(src))
        self.set(0, self.reshape(self.val(n.input[0]), (_prod(src[:axis]), _prod(src[axis:]))))

    def _op_Squeeze(self, n, a):
        src = self.shape(n.input[0])
        axes = self._axes(a, 13)
        if axes is None:
            axes = [i for i, d in enumerate(src) if d == 1]
        x = self.val(n.input[0])
        self.set(0, self.b.squeeze(x, axes=tuple(axes)) if axes else x)

    def _op_Unsqueeze(self, n, a):
        axes = self._axes(a, 13)
        out_rank = len(self.shape(n.input[0])) + len(axes)
        self.set(0, self.b.unsqueeze(self.val(n.input[0]),
                                     axes=tuple(sorted(self.axis(v, out_rank) for v in axes))))

    def _op_Expand(self, n, a):
        src, target = self.shape(n.input[0]), self.ints(1, "shape")
        try:  # ONNX Expand broadcasts both ways: the result may be larger than ``shape``
            out = tuple(np.broadcast_shapes(src, tuple(target)))
        except ValueError:
            raise self.err(f"cannot expand {list(src)} to {target}") from None
        x = self.val(n.input[0])
        self.set(0, x if out == src else self.b.expand(x, shape=out))

    def _op_Slice(self, n, a):
        if self.opset < 10:
            starts, ends, axes, steps = a["starts"], a["ends"], a.get("axes"), None
        else:
            starts, ends = self.ints(1, "starts"), self.ints(2, "ends")
            axes, steps = self.ints(3, "axes"), self.ints(4, "steps")
        axes = range(len(starts)) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        self.set(0, self.b.slice(self.val(n.input[0]), starts=tuple(starts), ends=tuple(ends),
                                 axes=tuple(axes), steps=tuple(steps)))

    def _op_Concat(self, n, a):
        self.set(0, self.b.concat(*(self.val(i) for i in n.input if i), axis=int(a["axis"])))

    def _op_Split(self, n, a):
        src = self.shape(n.input[0])
        axis = self.axis(int(a.get("axis", 0)), len(src))
        k = len(n.output)
        sizes = list(a["split"]) if "split" in a else (self.ints(1, "split") if self.opset >= 13
                                                       else None)
        if sizes is None:  # equal parts; opset 18's num_outputs lets the last one be smaller
            chunk = -(-src[axis] // k) if "num_outputs" in a else src[axis] // k
            sizes = [chunk] * (k - 1) + [src[axis] - chunk * (k - 1)]
        outs = self.b.split(self.val(n.input[0]), axis=axis, sizes=tuple(int(s) for s in sizes))
        for i, o in enumerate(outs):
            self.set(i, o)

    def _op_Pad(self, n, a):
        mode = a.get("mode", "constant")
        if mode not in ("constant", "reflect", "edge", "wrap"):
            raise self.err(f"Pad mode {mode!r} is not supported")
        rank = len(self.shape(n.input[0]))
        if self.opset < 11:
            pads, value = list(a["pads"]), float(a.get("value", 0.0))
        else:
            pads = self.ints(1, "pads")
            v = self.const(2, "constant_value")
            value = 0.0 if v is None else float(np.asarray(v, dtype=np.float64).reshape(-1)[0])
            axes = self.ints(3, "axes")
            if axes is not None:  # opset 18: pads for the listed axes only
                full = [0] * (2 * rank)
                for j, ax in enumerate(axes):
                    ax = self.axis(ax, rank)
                    full[ax], full[ax + rank] = pads[j], pads[j + len(axes)]
                pads = full
        x = self.val(n.input[0])
        if mode != "constant":  # constant-index gathers (``_ops_more``)
            self.set(0, self._pad_indexed(x, list(pads), mode))
            return
        self.set(0, self.b.pad(x, pads=tuple(pads), value=value) if any(pads) else x)

    def _op_Gather(self, n, a):
        self.set(0, self.b.gather(self.val(n.input[0]), self.val(n.input[1]),
                                  axis=int(a.get("axis", 0))))

    def _op_GatherElements(self, n, a):
        self.set(0, self.b.gather_elements(self.val(n.input[0]), self.val(n.input[1]),
                                           axis=int(a.get("axis", 0))))

    def _op_GatherND(self, n, a):
        if int(a.get("batch_dims", 0)):
            raise self.err("GatherND with batch_dims > 0 is not supported")
        data = self.shape(n.input[0])
        idx_shape = self.shape(n.input[1])
        k = idx_shape[-1]
        # Gather rows of the data flattened over its first k dims, at the linear index
        # sum_j idx[..., j] * stride_j (negative indices count from the end, as in ONNX).
        strides = [_prod(data[j + 1:k]) for j in range(k)]
        flat = self.reshape(self.val(n.input[0]), (_prod(data[:k]),) + tuple(data[k:]))
        if n.input[1] in self.consts:
            idx = np.asarray(self.consts[n.input[1]], np.int64)
            lin = ((idx % np.asarray(data[:k], np.int64)) * np.asarray(strides, np.int64)).sum(-1)
            self.set(0, self.b.gather(flat, self.b.constant(lin, dtype="int64"), axis=0))
            return
        idx, lin = self.val(n.input[1]), None
        rank = len(idx_shape)
        for j in range(k):
            c = self.b.squeeze(self.b.slice(idx, starts=(j,), ends=(j + 1,), axes=(rank - 1,),
                                            steps=(1,)), axes=(rank - 1,))
            c = self.b.where(self.b.lt(c, self.b.scalar(0, c)),
                             self.b.add(c, self.b.scalar(data[j], c)), c)
            c = self.b.mul(c, self.b.scalar(strides[j], c)) if strides[j] != 1 else c
            lin = c if lin is None else self.b.add(lin, c)
        self.set(0, self.b.gather(flat, lin, axis=0))

    def _op_IsNaN(self, n, a):
        x = self.val(n.input[0])
        self.set(0, self.b.ne(x, x))

    def _op_IsInf(self, n, a):
        x = self.val(n.input[0])
        inf = self.b.scalar(float("inf"), x)
        pos = self.b.eq(x, inf) if a.get("detect_positive", 1) else None
        neg = self.b.eq(x, self.b.neg(inf)) if a.get("detect_negative", 1) else None
        if pos is None and neg is None:  # detects nothing: x < -inf is false everywhere
            self.set(0, self.b.lt(x, self.b.neg(inf)))
            return
        self.set(0, pos if neg is None else neg if pos is None else self.b.or_(pos, neg))

    def _op_Trilu(self, n, a):
        src = self.shape(n.input[0])
        k = self.ints(1, "k")
        ones = np.ones(src[-2:], dtype=bool)
        k0 = 0 if k is None else k[0]
        mask = np.triu(ones, k0) if a.get("upper", 1) else np.tril(ones, k0)
        x = self.val(n.input[0])
        self.set(0, self.b.where(self.b.constant(mask, dtype="bool"), x, self.b.scalar(0, x)))

    def _op_Shape(self, n, a):
        src = self.shape(n.input[0])
        start, end = int(a.get("start", 0)), a.get("end")
        self.consts[n.output[0]] = np.array(src[start:None if end is None else int(end)], np.int64)

    def _op_Size(self, n, a):
        self.consts[n.output[0]] = np.array(_prod(self.shape(n.input[0])), np.int64)

    # Constant-only ops are evaluated by the folding path; listed so they count as supported.
    _op_Constant = _op_ConstantOfShape = _op_Range = None

    # -- compute ------------------------------------------------------------------------------
    def _op_MatMul(self, n, a):
        self.set(0, self.b.matmul(self.val(n.input[0]), self.val(n.input[1])))

    def _op_Gemm(self, n, a):
        ins = [self.val(i) for i in n.input if i]
        self.set(0, self.b.gemm(*ins, alpha=float(a.get("alpha", 1.0)), beta=float(a.get("beta", 1.0)),
                                trans_a=bool(a.get("transA", 0)), trans_b=bool(a.get("transB", 0))))

    def _window(self, n, a, kernel: Sequence[int]) -> tuple[dict, int]:
        """Conv/pool attributes as tunedb's 2-D ones; returns (attrs, spatial rank)."""
        src = self.shape(n.input[0])
        sp = len(src) - 2
        if sp not in (1, 2):
            raise self.err(f"only 1-D and 2-D windows are supported, input shape {list(src)}")
        strides = list(a.get("strides", [1] * sp))
        dil = list(a.get("dilations", [1] * sp))
        pads = list(a.get("pads", [0] * 2 * sp))
        auto = a.get("auto_pad", "NOTSET")
        if auto in ("SAME_UPPER", "SAME_LOWER"):  # output = ceil(input / stride)
            for i in range(sp):
                out = -(-src[2 + i] // strides[i])
                total = max((out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - src[2 + i], 0)
                small = total // 2
                pads[i], pads[i + sp] = (small, total - small) if auto == "SAME_UPPER" \
                    else (total - small, small)
        elif auto == "VALID":
            pads = [0] * 2 * sp
        elif auto != "NOTSET":
            raise self.err(f"auto_pad {auto!r} is not supported")
        kernel = list(kernel)
        if sp == 1:  # 1-D windows run as 2-D ones over an image of height 1
            strides, dil, kernel = [1] + strides, [1] + dil, [1] + kernel
            pads = [0, pads[0], 0, pads[1]]
        return {"strides": tuple(strides), "dilations": tuple(dil), "pads": tuple(pads),
                "kernel": tuple(int(k) for k in kernel)}, sp

    def _as2d(self, name: str, sp: int) -> str:
        return self.b.unsqueeze(self.val(name), axes=(2,)) if sp == 1 else self.val(name)

    def _from2d(self, v: str, sp: int) -> str:
        return self.b.squeeze(v, axes=(2,)) if sp == 1 else v

    def _op_Conv(self, n, a):
        kernel = a.get("kernel_shape") or self.shape(n.input[1])[2:]
        w, sp = self._window(n, a, kernel)
        bias = [self.val(n.input[2])] if len(n.input) > 2 and n.input[2] else []
        y = self.b.conv2d(self._as2d(n.input[0], sp), self._as2d(n.input[1], sp), *bias,
                          strides=w["strides"], pads=w["pads"], dilations=w["dilations"],
                          groups=int(a.get("group", 1)))
        self.set(0, self._from2d(y, sp))

    def _op_MaxPool(self, n, a):
        self.unused(1, "Indices")
        w, sp = self._window(n, a, a["kernel_shape"])
        y = self.b.max_pool2d(self._as2d(n.input[0], sp), kernel=w["kernel"], strides=w["strides"],
                              pads=w["pads"], dilations=w["dilations"],
                              ceil_mode=bool(a.get("ceil_mode", 0)))
        self.set(0, self._from2d(y, sp))

    def _op_AveragePool(self, n, a):
        w, sp = self._window(n, a, a["kernel_shape"])
        if any(d != 1 for d in w["dilations"]):
            raise self.err("AveragePool with dilations is not supported")
        y = self.b.avg_pool2d(self._as2d(n.input[0], sp), kernel=w["kernel"], strides=w["strides"],
                              pads=w["pads"], ceil_mode=bool(a.get("ceil_mode", 0)),
                              count_include_pad=bool(a.get("count_include_pad", 0)))
        self.set(0, self._from2d(y, sp))

    def _global(self, n, op: str, reduce: str) -> None:
        rank = len(self.shape(n.input[0]))
        x = self.val(n.input[0])
        self.set(0, self.b.op(op, x) if rank == 4 else
                 self.b.op(reduce, x, axes=tuple(range(2, rank)), keepdims=True))

    def _op_GlobalAveragePool(self, n, a):
        self._global(n, "global_avg_pool", "reduce_mean")

    def _op_GlobalMaxPool(self, n, a):
        self._global(n, "global_max_pool", "reduce_max")

    # -- composites ---------------------------------------------------------------------------
    def _op_Softmax(self, n, a, log: bool = False):
        src = self.shape(n.input[0])
        fn = self.b.log_softmax if log else self.b.softmax
        x = self.val(n.input[0])
        if self.opset >= 13:
            self.set(0, fn(x, axis=self.axis(int(a.get("axis", -1)), len(src))))
            return
        # Before opset 13 the input is coerced to 2-D at ``axis`` (default 1).
        axis = self.axis(int(a.get("axis", 1)), len(src))
        if axis == len(src) - 1:
            self.set(0, fn(x, axis=axis))
            return
        flat = (_prod(src[:axis]), _prod(src[axis:]))
        self.set(0, self.reshape(fn(self.reshape(x, flat), axis=1), src))

    def _op_LogSoftmax(self, n, a):
        self._op_Softmax(n, a, log=True)

    def _op_LayerNormalization(self, n, a):
        self.unused(1, "Mean/InvStdDev")
        x = self.val(n.input[0])
        self.set(0, self.b.layernorm(x, self.opt(1), self.opt(2), axis=int(a.get("axis", -1)),
                                     eps=float(a.get("epsilon", 1e-5))))

    def _rmsnorm(self, n, a) -> None:
        rank = len(self.shape(n.input[0]))
        axes = tuple(range(self.axis(int(a.get("axis", -1)), rank), rank))
        self.set(0, self.b.rmsnorm(self.val(n.input[0]), self.opt(1), axis=axes,
                                   eps=float(a.get("epsilon", 1e-5))))

    def _op_SimplifiedLayerNormalization(self, n, a):  # onnxruntime's RMS norm
        self.unused(1, "InvStdDev")
        self._rmsnorm(n, a)

    def _op_RMSNormalization(self, n, a):  # opset 23
        self._rmsnorm(n, a)

    def _op_BatchNormalization(self, n, a):
        if a.get("training_mode", 0):
            raise self.err("training_mode=1 is not supported (inference only)")
        self.unused(1, "running statistics")
        x, scale, bias, mean, var = (self.val(i) for i in n.input[:5])
        self.set(0, self.b.batchnorm(x, scale, bias, mean, var, eps=float(a.get("epsilon", 1e-5))))

"""More ONNX handlers: the rest of the elementwise, reduction, normalization and data-movement
families of opsets 13-21, each decomposed into tunedb primitives so the fusion planner sees
(and can fuse) every piece. Index arithmetic that depends only on shapes or constant inputs
(Resize's source coordinates, Scatter's write map, OneHot's iota) is computed here with NumPy
and enters the graph as constants, so data movement becomes a gather or a select.
"""

from __future__ import annotations

import math

import numpy as np

from tunedb.graph.onnx_import._model import BF16
from tunedb.graph.onnx_import._ops import _prod

# atan on [-tan(pi/12), tan(pi/12)] by its Taylor series to u**19: error below 1e-12 there.
_ATAN_TERMS = 10
_TAN_PI_12 = 2.0 - math.sqrt(3.0)
_MAX_SCATTER_COLUMNS = 8  # selects chained for ScatterElements at computed indices


class MoreOpHandlers:
    """Mixin of the importer, like ``OpHandlers``: relies on its value helpers."""

    # -- elementwise --------------------------------------------------------------------------
    def _un(self, n) -> str:
        return self.val(n.input[0])

    def _c(self, v: float, like: str) -> str:
        return self.b.scalar(v, like)

    def _op_Tan(self, n, a):
        x = self._un(n)
        self.set(0, self.b.div(self.b.sin(x), self.b.cos(x)))

    def _exp_pair(self, x: str) -> tuple[str, str]:
        return self.b.exp(x), self.b.exp(self.b.neg(x))

    def _op_Sinh(self, n, a):
        x = self._un(n)
        e, f = self._exp_pair(x)
        self.set(0, self.b.mul(self.b.sub(e, f), self._c(0.5, x)))

    def _op_Cosh(self, n, a):
        x = self._un(n)
        e, f = self._exp_pair(x)
        self.set(0, self.b.mul(self.b.add(e, f), self._c(0.5, x)))

    def _op_Asinh(self, n, a):  # sign(x) log(|x| + sqrt(x^2 + 1)): no cancellation for x < 0
        x = self._un(n)
        ax = self.b.abs(x)
        r = self.b.log(self.b.add(ax, self.b.sqrt(self.b.add(self.b.mul(x, x), self._c(1.0, x)))))
        self.set(0, self.b.mul(self.b.sign(x), r))

    def _op_Acosh(self, n, a):  # log(x + sqrt((x - 1)(x + 1)))
        x = self._un(n)
        one = self._c(1.0, x)
        s = self.b.sqrt(self.b.mul(self.b.sub(x, one), self.b.add(x, one)))
        self.set(0, self.b.log(self.b.add(x, s)))

    def _op_Atanh(self, n, a):  # log((1 + x) / (1 - x)) / 2
        x = self._un(n)
        one = self._c(1.0, x)
        r = self.b.log(self.b.div(self.b.add(one, x), self.b.sub(one, x)))
        self.set(0, self.b.mul(r, self._c(0.5, x)))

    def atan(self, x: str) -> str:
        """atan from primitives: |x| > 1 through pi/2 - atan(1/|x|), then above tan(pi/12)
        through pi/6 + atan((t sqrt3 - 1) / (t + sqrt3)), then a short odd series."""
        b = self.b
        ax = b.abs(x)
        inv = b.gt(ax, self._c(1.0, x))
        t = b.where(inv, b.reciprocal(ax), ax)
        big = b.gt(t, self._c(_TAN_PI_12, x))
        s3 = self._c(math.sqrt(3.0), x)
        u = b.where(big, b.div(b.sub(b.mul(t, s3), self._c(1.0, x)), b.add(t, s3)), t)
        u2 = b.mul(u, u)
        p = self._c(1.0 / (2 * _ATAN_TERMS - 1) * (-1) ** (_ATAN_TERMS - 1), x)
        for k in range(_ATAN_TERMS - 2, -1, -1):  # Horner in u^2
            p = b.add(b.mul(p, u2), self._c((-1) ** k / (2 * k + 1), x))
        r = b.add(b.mul(p, u), b.where(big, self._c(math.pi / 6, x), self._c(0.0, x)))
        r = b.where(inv, b.sub(self._c(math.pi / 2, x), r), r)
        return b.where(b.lt(x, self._c(0.0, x)), b.neg(r), r)

    def _op_Atan(self, n, a):
        self.set(0, self.atan(self._un(n)))

    def _op_Asin(self, n, a):  # atan(x / sqrt((1 - x)(1 + x))); |x| = 1 goes through atan(inf)
        x = self._un(n)
        one = self._c(1.0, x)
        c = self.b.sqrt(self.b.mul(self.b.sub(one, x), self.b.add(one, x)))
        self.set(0, self.atan(self.b.div(x, c)))

    def _op_Acos(self, n, a):  # 2 atan(sqrt((1 - x) / (1 + x))): accurate near x = 1
        x = self._un(n)
        one = self._c(1.0, x)
        r = self.atan(self.b.sqrt(self.b.div(self.b.sub(one, x), self.b.add(one, x))))
        self.set(0, self.b.mul(r, self._c(2.0, x)))

    def _op_Round(self, n, a):  # half to even, exact: the fraction x - floor(x) is exact
        x = self._un(n)
        b = self.b
        f = b.floor(x)
        d = b.sub(x, f)
        half, one = self._c(0.5, x), self._c(1.0, x)
        odd = b.ne(b.mod(f, self._c(2.0, x)), self._c(0.0, x))
        up = b.or_(b.gt(d, half), b.and_(b.eq(d, half), odd))
        self.set(0, b.where(up, b.add(f, one), f))

    def softplus(self, x: str) -> str:  # max(x, 0) + log(1 + exp(-|x|)): no overflow
        b = self.b
        e = b.exp(b.neg(b.abs(x)))
        return b.add(b.relu(x), b.log(b.add(e, self._c(1.0, x))))

    def _op_Softplus(self, n, a):
        self.set(0, self.softplus(self._un(n)))

    def _op_Softsign(self, n, a):
        x = self._un(n)
        self.set(0, self.b.div(x, self.b.add(self.b.abs(x), self._c(1.0, x))))

    def _op_Mish(self, n, a):
        x = self._un(n)
        self.set(0, self.b.mul(x, self.b.tanh(self.softplus(x))))

    def _expm1_scaled(self, x: str, alpha: float) -> str:  # alpha * (exp(x) - 1)
        return self.b.mul(self.b.sub(self.b.exp(x), self._c(1.0, x)), self._c(alpha, x))

    def _op_Elu(self, n, a):
        x = self._un(n)
        neg = self._expm1_scaled(x, float(a.get("alpha", 1.0)))
        self.set(0, self.b.where(self.b.lt(x, self._c(0.0, x)), neg, x))

    def _op_Selu(self, n, a):
        x = self._un(n)
        alpha = float(a.get("alpha", 1.67326319217681884765625))
        gamma = float(a.get("gamma", 1.05070102214813232421875))
        y = self.b.where(self.b.gt(x, self._c(0.0, x)), x, self._expm1_scaled(x, alpha))
        self.set(0, self.b.mul(y, self._c(gamma, x)))

    def _op_Celu(self, n, a):
        x = self._un(n)
        alpha = float(a.get("alpha", 1.0))
        neg = self._expm1_scaled(self.b.div(x, self._c(alpha, x)), alpha)
        self.set(0, self.b.add(self.b.relu(x), self.b.min(neg, self._c(0.0, x))))

    def _op_ThresholdedRelu(self, n, a):
        x = self._un(n)
        keep = self.b.gt(x, self._c(float(a.get("alpha", 1.0)), x))
        self.set(0, self.b.where(keep, x, self._c(0.0, x)))

    def _op_PRelu(self, n, a):
        x, slope = self._un(n), self.val(n.input[1])
        self.set(0, self.b.where(self.b.lt(x, self._c(0.0, x)), self.b.mul(x, slope), x))

    def _op_Shrink(self, n, a):
        x = self._un(n)
        lambd, bias = float(a.get("lambd", 0.5)), float(a.get("bias", 0.0))
        b = self.b
        lo = b.where(b.lt(x, self._c(-lambd, x)), b.add(x, self._c(bias, x)), self._c(0.0, x))
        self.set(0, b.where(b.gt(x, self._c(lambd, x)), b.sub(x, self._c(bias, x)), lo))

    def iota(self, size: int, axis: int, rank: int) -> str:
        """0..size-1 (int64) along ``axis`` of a rank-``rank`` tensor of ones elsewhere."""
        shape = [1] * rank
        shape[axis] = size
        return self.b.constant(np.arange(size, dtype=np.int64).reshape(shape), dtype="int64")

    def _op_Hardmax(self, n, a):  # one-hot of the first maximum along ``axis``
        x = self._un(n)
        src = self.shape(n.input[0])
        axis = self.axis(int(a.get("axis", -1 if self.opset >= 13 else 1)), len(src))
        if self.opset < 13 and axis != len(src) - 1:
            raise self.err("Hardmax before opset 13 over a non-last axis is not supported")
        hit = self.b.eq(self.b.argmax(x, axis=axis, keepdims=True), self.iota(src[axis], axis, len(src)))
        self.set(0, self.b.cast(hit, to=self.dtype(n.input[0])))

    # -- reductions ---------------------------------------------------------------------------
    def _reduce_via(self, n, a, pre, op: str, post=None) -> None:
        """``post(op(pre(x)))`` over the node's axes; with noop_with_empty_axes and no axes,
        the reduction is over no axis: ``post(pre(x))``."""
        axes = self._axes(a, 18)
        x = self.val(n.input[0])
        y = pre(x)
        if not axes and a.get("noop_with_empty_axes", 0):
            self.set(0, post(y) if post else y)
            return
        y = self.b.op(op, y, axes=tuple(axes) if axes else None, keepdims=bool(a.get("keepdims", 1)))
        self.set(0, post(y) if post else y)

    def _op_ReduceL1(self, n, a):
        self._reduce_via(n, a, self.b.abs, "reduce_sum")

    def _op_ReduceL2(self, n, a):
        self._reduce_via(n, a, lambda x: self.b.mul(x, x), "reduce_sum", self.b.sqrt)

    def _op_ReduceSumSquare(self, n, a):
        self._reduce_via(n, a, lambda x: self.b.mul(x, x), "reduce_sum")

    def _op_ReduceLogSum(self, n, a):
        self._reduce_via(n, a, lambda x: x, "reduce_sum", self.b.log)

    def _op_ReduceLogSumExp(self, n, a):  # max + log(sum(exp(x - max))): no overflow
        axes = self._axes(a, 18)
        x = self.val(n.input[0])
        if not axes and a.get("noop_with_empty_axes", 0):
            self.set(0, x)
            return
        ax = tuple(axes) if axes else None
        keep = bool(a.get("keepdims", 1))
        m = self.b.reduce_max(x, axes=ax, keepdims=True)
        s = self.b.reduce_sum(self.b.exp(self.b.sub(x, m)), axes=ax, keepdims=keep)
        self.set(0, self.b.add(self.b.log(s), m if keep else self.reshape(m, self.b.type_of(s).shape)))

    # -- losses -------------------------------------------------------------------------------
    def _op_NegativeLogLikelihoodLoss(self, n, a, logp: str | None = None):
        """-logp[label] per sample (class axis 1), weighted, ignore_index zeroed, then reduced:
        'mean' divides by the summed weights of the samples not ignored, as ONNX does."""
        b = self.b
        logp = logp or self.val(n.input[0])
        lab = self.val(n.input[1])
        if self.dtype(n.input[1]) != "int64":
            lab = b.cast(lab, to="int64")
        keep = None
        if "ignore_index" in a:
            keep = b.ne(lab, self._c(int(a["ignore_index"]), lab))
            lab = b.where(keep, lab, self._c(0, lab))  # any valid class: zeroed below
        picked = b.squeeze(b.gather_elements(logp, b.unsqueeze(lab, axes=(1,)), axis=1), axes=(1,))
        loss = b.neg(picked)
        w = None
        if len(n.input) > 2 and n.input[2]:
            w = b.gather(self.val(n.input[2]), lab, axis=0)
            loss = b.mul(loss, w)
        if keep is not None:
            zero = self._c(0.0, loss)
            loss = b.where(keep, loss, zero)
            w = b.where(keep, w if w is not None else self._c(1.0, loss), zero)
        red = a.get("reduction", "mean")
        if red == "none":
            self.set(0, loss)
            return
        total = b.reduce_sum(loss, axes=None, keepdims=False)
        if red == "sum":
            self.set(0, total)
        elif red == "mean":
            den = (b.reduce_sum(w, axes=None, keepdims=False) if w is not None and
                   b.type_of(w).shape == b.type_of(loss).shape else
                   self._c(float(b.type_of(loss).numel), loss))
            self.set(0, b.div(total, den))
        else:
            raise self.err(f"reduction={red!r} is not one of none, sum, mean")

    def _op_SoftmaxCrossEntropyLoss(self, n, a):
        x = self.val(n.input[0])
        logp = self.b.log_softmax(x, axis=1)
        self._op_NegativeLogLikelihoodLoss(n, a, logp)
        if len(n.output) > 1 and n.output[1]:
            self.set(1, logp)

    # -- normalization ------------------------------------------------------------------------
    def per_channel(self, v: str, rank: int) -> str:
        """A [C] parameter as [C, 1, ...] against an N C ... tensor of rank ``rank``."""
        trailing = tuple(range(1, rank - 1))
        return self.b.unsqueeze(v, axes=trailing) if trailing else v

    def _op_InstanceNormalization(self, n, a):
        src = self.shape(n.input[0])
        if len(src) < 3:
            raise self.err(f"InstanceNormalization needs rank >= 3, input shape {list(src)}")
        x = self.val(n.input[0])
        y = self.b.layernorm(x, axis=tuple(range(2, len(src))), eps=float(a.get("epsilon", 1e-5)))
        scale, bias = (self.per_channel(self.val(i), len(src)) for i in n.input[1:3])
        self.set(0, self.b.add(self.b.mul(y, scale), bias))

    def _op_GroupNormalization(self, n, a):
        """Normalise [N, G, C/G, S] over its last two axes; the affine is per group before
        opset 21 (scale of shape [G]) and per channel from 21 on."""
        src = self.shape(n.input[0])
        g = int(a["num_groups"])
        if len(src) < 3 or g < 1 or src[1] % g:
            raise self.err(f"cannot split {src[1] if len(src) > 1 else '?'} channels of input "
                           f"{list(src)} into num_groups={g}")
        x = self.val(n.input[0])
        grouped = self.reshape(x, (src[0], g, src[1] // g, _prod(src[2:])))
        y = self.b.layernorm(grouped, axis=(2, 3), eps=float(a.get("epsilon", 1e-5)))
        scale, bias = self.val(n.input[1]), self.val(n.input[2])
        if self.opset < 21:
            y = self.b.add(self.b.mul(y, self.reshape(scale, (g, 1, 1))), self.reshape(bias, (g, 1, 1)))
            self.set(0, self.reshape(y, src))
            return
        y = self.reshape(y, src)
        self.set(0, self.b.add(self.b.mul(y, self.per_channel(scale, len(src))),
                               self.per_channel(bias, len(src))))

    def _op_LpNormalization(self, n, a):
        src = self.shape(n.input[0])
        axis, p = self.axis(int(a.get("axis", -1)), len(src)), int(a.get("p", 2))
        if p not in (1, 2):
            raise self.err(f"LpNormalization p={p} is not supported (only 1 and 2)")
        x = self.val(n.input[0])
        if p == 1:
            norm = self.b.reduce_sum(self.b.abs(x), axes=(axis,), keepdims=True)
        else:
            norm = self.b.sqrt(self.b.reduce_sum(self.b.mul(x, x), axes=(axis,), keepdims=True))
        self.set(0, self.b.div(x, norm))

    def _op_MeanVarianceNormalization(self, n, a):  # (x - mean) / (std + 1e-9), as ONNX's body
        x = self.val(n.input[0])
        axes = tuple(int(v) for v in a.get("axes", (0, 2, 3)))
        d = self.b.sub(x, self.b.reduce_mean(x, axes=axes, keepdims=True))
        std = self.b.sqrt(self.b.reduce_mean(self.b.mul(d, d), axes=axes, keepdims=True))
        self.set(0, self.b.div(d, self.b.add(std, self._c(1e-9, x))))

    def _op_LRN(self, n, a):
        """x / (bias + alpha/size * sum of x^2 over a window of ``size`` channels)^beta; the
        window sum is ``size`` shifted slices of the channel-padded square."""
        src = self.shape(n.input[0])
        size = int(a["size"])
        alpha, beta, bias = (float(a.get(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75),
                                                             ("bias", 1.0)))
        x = self.val(n.input[0])
        rank, c = len(src), src[1]
        lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
        pads = [0] * (2 * rank)
        pads[1], pads[1 + rank] = lo, hi
        sq = self.b.pad(self.b.mul(x, x), pads=tuple(pads), value=0.0)
        total = None
        for k in range(size):
            part = self.b.slice(sq, starts=(k,), ends=(k + c,), axes=(1,), steps=(1,))
            total = part if total is None else self.b.add(total, part)
        base = self.b.add(self.b.mul(total, self._c(alpha / size, x)), self._c(bias, x))
        self.set(0, self.b.mul(x, self.b.pow(base, self._c(-beta, x))))

    # -- data movement ------------------------------------------------------------------------
    def _op_Tile(self, n, a):  # [d0, d1] -> [1, d0, 1, d1] -> expand [r0, d0, r1, d1] -> reshape
        src, reps = self.shape(n.input[0]), self.ints(1, "repeats")
        if len(reps) != len(src) or any(r < 0 for r in reps):
            raise self.err(f"repeats {reps} do not fit input shape {list(src)}")
        x = self.val(n.input[0])
        if all(r == 1 for r in reps):
            self.set(0, x)
            return
        inter = tuple(v for d in src for v in (1, d))
        full = tuple(v for r, d in zip(reps, src) for v in (r, d))
        y = self.b.expand(self.reshape(x, inter), shape=full)
        self.set(0, self.reshape(y, tuple(r * d for r, d in zip(reps, src))))

    def _op_CumSum(self, n, a):
        """A prefix sum as log2(n) shifted adds (Hillis-Steele): x += x shifted by 1, 2, 4, ...
        along the axis, each shift a slice and a zero pad: memory-bound primitives only."""
        src = self.shape(n.input[0])
        axis = self.axis(int(np.asarray(self.const(1, "axis")).reshape(-1)[0]), len(src))
        size, rank = src[axis], len(src)
        x = self.val(n.input[0])

        def shift(v: str, k: int, fill_end: bool) -> str:  # v moved k places, zeros come in
            pads = [0] * (2 * rank)
            pads[axis + (rank if fill_end else 0)] = k
            lo, hi = (k, size) if fill_end else (0, size - k)
            return self.b.pad(self.b.slice(v, starts=(lo,), ends=(hi,), axes=(axis,), steps=(1,)),
                              pads=tuple(pads), value=0.0)

        rev = bool(a.get("reverse", 0))
        k = 1
        y = x
        while k < size:
            y = self.b.add(y, shift(y, k, rev))
            k *= 2
        if a.get("exclusive", 0):
            y = shift(y, 1, rev) if size > 1 else self.b.mul(y, self._c(0, y))
        self.set(0, y)

    def _op_DepthToSpace(self, n, a):
        nb, c, h, w = self._rank4(n)
        bs = int(a["blocksize"])
        if c % (bs * bs):
            raise self.err(f"{c} channels are not divisible by blocksize^2 = {bs * bs}")
        x = self.val(n.input[0])
        if a.get("mode", "DCR") == "DCR":
            y = self.b.transpose(self.reshape(x, (nb, bs, bs, c // bs // bs, h, w)), perm=(0, 3, 4, 1, 5, 2))
        else:
            y = self.b.transpose(self.reshape(x, (nb, c // bs // bs, bs, bs, h, w)), perm=(0, 1, 4, 2, 5, 3))
        self.set(0, self.reshape(y, (nb, c // bs // bs, h * bs, w * bs)))

    def _op_SpaceToDepth(self, n, a):
        nb, c, h, w = self._rank4(n)
        bs = int(a["blocksize"])
        if h % bs or w % bs:
            raise self.err(f"spatial size {h}x{w} is not divisible by blocksize {bs}")
        y = self.b.transpose(self.reshape(self.val(n.input[0]), (nb, c, h // bs, bs, w // bs, bs)),
                             perm=(0, 3, 5, 1, 2, 4))
        self.set(0, self.reshape(y, (nb, c * bs * bs, h // bs, w // bs)))

    def _rank4(self, n) -> tuple[int, ...]:
        src = self.shape(n.input[0])
        if len(src) != 4:
            raise self.err(f"{n.op_type} needs a rank-4 input, got shape {list(src)}")
        return src

    def _const_gather(self, x: str, idx: np.ndarray, axis: int) -> str:
        return self.b.gather(x, self.b.constant(np.asarray(idx, np.int64), dtype="int64"), axis=axis)

    def _op_Compress(self, n, a):
        cond = np.asarray(self.const(1, "condition")).astype(bool).reshape(-1)
        x = self.val(n.input[0])
        if "axis" not in a:
            x, axis = self.reshape(x, (_prod(self.shape(n.input[0])),)), 0
        else:
            axis = self.axis(int(a["axis"]), len(self.shape(n.input[0])))
        self.set(0, self._const_gather(x, np.flatnonzero(cond), axis))

    def _op_EyeLike(self, n, a):  # depends only on the (static) shape: a constant
        src = self.shape(n.input[0])
        if len(src) != 2:
            raise self.err(f"EyeLike needs a rank-2 input, got shape {list(src)}")
        dtype = self.dtype_of_onnx(int(a["dtype"])) if "dtype" in a else self.dtype(n.input[0])
        eye = np.eye(src[0], src[1], k=int(a.get("k", 0)))
        self.consts[n.output[0]] = eye.astype(BF16 if dtype == "bfloat16" else dtype)

    def _op_OneHot(self, n, a):
        depth = int(np.asarray(self.const(1, "depth")).reshape(-1)[0])
        values = np.asarray(self.const(2, "values")).reshape(-1)
        idx = self.val(n.input[0])
        if self.dtype(n.input[0]) not in ("int64", "int32"):
            idx = self.b.cast(idx, to="int64")  # ONNX allows float indices
        elif self.dtype(n.input[0]) == "int32":
            idx = self.b.cast(idx, to="int64")
        rank = len(self.shape(n.input[0])) + 1
        axis = self.axis(int(a.get("axis", -1)), rank)
        idx = self.b.where(self.b.lt(idx, self._c(0, idx)), self.b.add(idx, self._c(depth, idx)), idx)
        hit = self.b.eq(self.b.unsqueeze(idx, axes=(axis,)), self.iota(depth, axis, rank))
        off, on = values[0], values[1]
        dtype = self.dtype(n.input[2])
        self.set(0, self.b.where(hit, self.b.constant(np.array(on), dtype=dtype),
                                 self.b.constant(np.array(off), dtype=dtype)))

    def _scatter(self, data: str, updates: str, src: np.ndarray) -> str:
        """``data`` with the positions where ``src`` >= 0 replaced by element ``src`` of the
        flattened ``updates``: a gather through a constant index map, then a select."""
        shape = self.b.type_of(data).shape
        flat = self.reshape(updates, (self.b.type_of(updates).numel,))
        written = src >= 0
        got = self._const_gather(flat, np.where(written, src, 0).reshape(shape), 0)
        if written.all():
            return got
        return self.b.where(self.b.constant(written.reshape(shape), dtype="bool"), got, data)

    def _no_reduction(self, a) -> None:
        if a.get("reduction", "none") != "none":
            raise self.err(f"reduction={a['reduction']!r} is not supported (only 'none')")

    def _op_ScatterND(self, n, a):
        self._no_reduction(a)
        data = self.shape(n.input[0])
        idx = np.asarray(self.const(1, "indices"), np.int64)
        k = idx.shape[-1]
        rest = _prod(data[k:])
        lin = np.ravel_multi_index(tuple(np.moveaxis(idx % np.asarray(data[:k]), -1, 0)), data[:k])
        rows = np.full(_prod(data[:k]), -1, np.int64)
        rows[lin.reshape(-1)] = np.arange(lin.size)  # a repeated index: the last write wins
        src = np.where(rows[:, None] >= 0, rows[:, None] * rest + np.arange(rest), -1)
        self.set(0, self._scatter(self.val(n.input[0]), self.val(n.input[2]), src.reshape(-1)))

    def _op_ScatterElements(self, n, a):
        self._no_reduction(a)
        data = self.shape(n.input[0])
        axis = self.axis(int(a.get("axis", 0)), len(data))
        if n.input[1] not in self.consts:
            self._scatter_computed(n, data, axis)
            return
        idx = np.asarray(self.const(1, "indices"), np.int64)
        pos = list(np.indices(idx.shape))
        pos[axis] = idx % data[axis]
        lin = np.ravel_multi_index(tuple(pos), data)
        src = np.full(_prod(data), -1, np.int64)
        src[lin.reshape(-1)] = np.arange(lin.size)
        self.set(0, self._scatter(self.val(n.input[0]), self.val(n.input[2]), src))

    def _scatter_computed(self, n, data: tuple[int, ...], axis: int) -> None:
        """ScatterElements at computed indices that span ``data`` except along ``axis`` (a
        loss gradient writes one class per row): a select per index column, iota == index,
        later columns winning as ONNX's last write does."""
        ishape = self.shape(n.input[1])
        k = ishape[axis]
        if any(i != d for j, (i, d) in enumerate(zip(ishape, data)) if j != axis) or k > _MAX_SCATTER_COLUMNS:
            raise self.err(f"ScatterElements at computed indices {list(ishape)} into {list(data)} is "
                           f"supported only when they span the data off axis {axis} and have at most "
                           f"{_MAX_SCATTER_COLUMNS} entries along it")
        idx = self.val(n.input[1])
        if self.dtype(n.input[1]) != "int64":
            idx = self.b.cast(idx, to="int64")
        idx = self.b.where(self.b.lt(idx, self._c(0, idx)), self.b.add(idx, self._c(data[axis], idx)), idx)
        iota = self.iota(data[axis], axis, len(data))
        y, upd = self.val(n.input[0]), self.val(n.input[2])
        for j in range(k):
            ci, cu = ((idx, upd) if k == 1 else
                      (self.b.slice(v, starts=(j,), ends=(j + 1,), axes=(axis,), steps=(1,))
                       for v in (idx, upd)))
            y = self.b.where(self.b.eq(iota, ci), cu, y)
        self.set(0, y)

    def _op_Resize(self, n, a):
        """Nearest and (bi/tri)linear resizing with constant scales or sizes: one gather per
        resized axis (two and a blend for linear) with constant indices and weights."""
        mode = a.get("mode", "nearest")
        if mode not in ("nearest", "linear"):
            raise self.err(f"Resize mode {mode!r} is not supported (only 'nearest' and 'linear')")
        ctm = a.get("coordinate_transformation_mode", "half_pixel")
        if ctm == "tf_crop_and_resize":
            raise self.err("Resize coordinate_transformation_mode 'tf_crop_and_resize' is not supported")
        src = self.shape(n.input[0])
        rank = len(src)
        axes = [self.axis(int(v), rank) for v in a.get("axes", range(rank))]
        scales = self.const(2, "scales") if len(n.input) > 2 else None
        sizes = self.ints(3, "sizes") if len(n.input) > 3 else None
        if sizes is not None:
            policy = a.get("keep_aspect_ratio_policy", "stretch")
            ratio = [sizes[j] / src[ax] for j, ax in enumerate(axes)]
            if policy != "stretch":
                r = min(ratio) if policy == "not_larger" else max(ratio)
                ratio = [r] * len(axes)
                sizes = [int(math.floor(r * src[ax] + 0.5)) for ax in axes]
            out = dict(zip(axes, sizes))
            scale = dict(zip(axes, ratio))
        elif scales is not None and np.asarray(scales).size:
            sc = [float(s) for s in np.asarray(scales).reshape(-1)]
            scale = dict(zip(axes, sc))
            out = {ax: int(math.floor(src[ax] * s)) for ax, s in scale.items()}
        else:
            raise self.err("Resize needs constant scales or sizes")
        if a.get("antialias", 0) and mode == "linear" and any(out[ax] < src[ax] for ax in axes):
            raise self.err("Resize antialias=1 when shrinking is not supported")
        y = self.val(n.input[0])
        for ax in axes:
            if out[ax] == src[ax] and scale[ax] == 1.0:
                continue
            coord = self._resize_coords(ctm, src[ax], out[ax], scale[ax])
            if mode == "nearest":
                y = self._const_gather(y, self._nearest(a, coord, src[ax]), ax)
                continue
            if self.dtype(n.input[0]) not in ("float32", "float16", "bfloat16"):
                raise self.err("linear Resize of an integer tensor is not supported")
            c = np.clip(coord, 0, src[ax] - 1)
            i0 = np.floor(c).astype(np.int64)
            i1 = np.minimum(i0 + 1, src[ax] - 1)
            w = np.zeros([1] * (rank - ax - 1), np.float32) + (c - i0).reshape((-1,) + (1,) * (rank - ax - 1))
            wv = self.b.constant(w, dtype=self.dtype(n.input[0]))
            lo, hi = self._const_gather(y, i0, ax), self._const_gather(y, i1, ax)
            y = self.b.add(lo, self.b.mul(self.b.sub(hi, lo), wv))
        self.set(0, y)

    @staticmethod
    def _resize_coords(ctm: str, size: int, out: int, scale: float) -> np.ndarray:
        """Source coordinate of each output position along one axis (ONNX Resize's formulas)."""
        x = np.arange(out, dtype=np.float64)
        if ctm == "half_pixel":
            return (x + 0.5) / scale - 0.5
        if ctm == "pytorch_half_pixel":
            return (x + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
        if ctm == "align_corners":
            return x * (size - 1) / (out - 1) if out > 1 else np.zeros(out)
        if ctm == "asymmetric":
            return x / scale
        if ctm == "half_pixel_symmetric":
            adjustment = out / (scale * size)
            offset = size / 2 * (1 - adjustment)
            return offset + (x + 0.5) / scale - 0.5
        raise ValueError(f"unknown coordinate_transformation_mode {ctm!r}")

    def _nearest(self, a: dict, coord: np.ndarray, size: int) -> np.ndarray:
        mode = a.get("nearest_mode", "round_prefer_floor")
        pick = {"round_prefer_floor": lambda c: np.ceil(c - 0.5),
                "round_prefer_ceil": lambda c: np.floor(c + 0.5),
                "floor": np.floor, "ceil": np.ceil}
        if mode not in pick:
            raise self.err(f"Resize nearest_mode {mode!r} is not supported")
        return np.clip(pick[mode](coord), 0, size - 1).astype(np.int64)

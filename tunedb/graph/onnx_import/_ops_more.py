"""More ONNX handlers of the issue-21 families (split from ``_ops_ext`` for its size): Pad's
reflect, edge and wrap modes, CenterCropPad and GlobalLpPool. Each becomes tunedb primitives:
constant-index gathers (data movement the planner takes as index maps or copies), slices, pads
and reductions."""

from __future__ import annotations

import numpy as np


def pad_indices(size: int, begin: int, end: int, mode: str) -> np.ndarray:
    """Source index of every position of one axis padded by (begin, end) in ``mode``
    (negative pads crop): edge repeats the border, reflect mirrors without repeating it,
    wrap continues periodically."""
    p = np.arange(-begin, size + end, dtype=np.int64)
    if mode == "edge":
        return np.clip(p, 0, size - 1)
    if mode == "wrap":
        return np.mod(p, size)
    if mode == "reflect":
        if size == 1:
            return np.zeros_like(p)
        m = np.mod(p, 2 * size - 2)
        return np.where(m < size, m, 2 * size - 2 - m)
    raise ValueError(f"unknown pad mode {mode!r}")


class PadCropHandlers:
    """Mixin of the importer, like ``OpHandlers``: relies on its value helpers."""

    def _pad_indexed(self, x: str, pads: list[int], mode: str) -> str:
        """``x`` padded in a non-constant mode: one constant-index gather per padded axis."""
        shape = self.b.type_of(x).shape
        rank = len(shape)
        for ax in range(rank):
            begin, end = int(pads[ax]), int(pads[ax + rank])
            if not begin and not end:
                continue
            if mode == "reflect" and (begin >= shape[ax] or end >= shape[ax]):
                raise self.err(f"Pad mode 'reflect' needs pads shorter than the axis "
                               f"({begin}, {end} on an axis of {shape[ax]})")
            if shape[ax] + begin + end <= 0:
                raise self.err(f"Pad leaves axis {ax} empty")
            x = self._const_gather(x, pad_indices(shape[ax], begin, end, mode), ax)
        return x

    def _op_CenterCropPad(self, n, a):
        shape = list(self.shape(n.input[0]))
        rank = len(shape)
        target = self.ints(1, "shape")
        if target is None:
            raise self.err("CenterCropPad needs a constant shape")
        axes = [self.axis(int(x), rank) for x in a.get("axes", range(rank))]
        if len(axes) != len(target):
            raise self.err(f"CenterCropPad has {len(target)} target sizes for {len(axes)} axes")
        x = self.val(n.input[0])
        pads = [0] * (2 * rank)
        for ax, t in zip(axes, target):
            t = int(t)
            if t < shape[ax]:  # crop the middle: the start rounds down, as ONNX's reference
                start = (shape[ax] - t) // 2
                x = self.b.slice(x, starts=(start,), ends=(start + t,), axes=(ax,), steps=(1,))
            elif t > shape[ax]:
                pads[ax] = (t - shape[ax]) // 2
                pads[ax + rank] = t - shape[ax] - pads[ax]
        self.set(0, self.b.pad(x, pads=tuple(pads), value=0.0) if any(pads) else x)

    def _op_GlobalLpPool(self, n, a):
        p = int(a.get("p", 2))
        x = self.val(n.input[0])
        if self.dtype(n.input[0]) not in ("float32", "float16", "bfloat16"):
            raise self.err("GlobalLpPool of an integer tensor is not supported")
        if p < 1:
            raise self.err(f"GlobalLpPool p={p} is not supported (p >= 1)")
        axes = tuple(range(2, len(self.shape(n.input[0]))))
        ax = self.b.abs(x)
        if p == 1:
            self.set(0, self.b.reduce_sum(ax, axes=axes, keepdims=True))
            return
        powed = self.b.mul(x, x) if p == 2 else self.b.pow(ax, self.b.scalar(float(p), x))
        s = self.b.reduce_sum(powed, axes=axes, keepdims=True)
        self.set(0, self.b.sqrt(s) if p == 2 else self.b.pow(s, self.b.scalar(1.0 / p, x)))

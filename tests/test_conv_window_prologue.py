"""Whether a strided depthwise window takes the SiLU before it (``gen_window.costly_prologue``)
depends on the bytes it saves: a 16-bit tensor saves half of a float32 one for the same SFU
work (H200, EfficientNet b8, one call: bf16 18.4 µs apart against 22.7-26.1 fused; float32
36.1 apart against 26.7 fused; data/bench/conv_steps_b8_h200.json)."""

from __future__ import annotations

import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.kernels.gen_window import costly_prologue, match_window


def _silu_dw(dtype: str, stride: int):
    b = GraphBuilder("silu_dw")
    x = b.input("x", (2, 16, 72, 72), dtype)
    h = b.mul(x, b.sigmoid(x))
    y = b.conv2d(h, b.input("wd", (16, 1, 3, 3), dtype), strides=(stride, stride), pads=(1, 1, 1, 1),
                 groups=16)
    return b.build([y])


@pytest.mark.parametrize("dtype,stride,costly", [
    ("float32", 2, False),   # 2.25 taps an element: the SiLU goes into the window kernel
    ("float32", 1, True),    # 9 taps: apart
    ("bfloat16", 2, True),   # half the bytes saved: apart
    ("bfloat16", 1, True),
])
def test_the_silu_joins_a_strided_window_only_where_its_bytes_pay(dtype, stride, costly):
    g = _silu_dw(dtype, stride)
    assert costly_prologue(g, match_window(g)) is costly

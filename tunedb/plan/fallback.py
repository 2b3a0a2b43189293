"""Schedules for fused kernels that no cost model prices: the roofline plus rules of thumb.

The roofline estimate (the bytes a schedule moves over the bandwidth) ties most schedules of a
kernel, and it cannot see what decides among them: coalescing (a transpose read element by element),
how many threads share a row, or a column reduction whose grid leaves most SMs idle. Left to
itself it picked the first tied schedule of the space. So the legal schedules are ordered by a few
rules first, each a pattern of the shipped H200 measurements (``data/fusion_h200_v2``: 435
workloads, every legal schedule timed), and by the estimate within them. There the first pick runs
1.24x the best measured schedule (geomean over the workloads; top-1 score 0.830; 1.17x since the
fast-math twin comes first where there is one), where the
space's own order gave 2.57x (0.563); a cost model does better (the shipped one: top-1 0.964 on
workloads it never saw). The rules were read off that same data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tunedb.kernels.analysis import Analysis
from tunedb.kernels.passes import cache_values
from tunedb.kernels.schedule import Schedule, full_bytes

# Rows of at most SHORT_ROW_BYTES: a warp per row; longer rows: a block per row.
SHORT_ROW_BYTES = 1024
MAPPING_ORDER = {
    "transpose": ("transpose_tiled", "elementwise"),
    "short_rows": ("warp_per_row", "block_per_row", "rows_per_block", "split_row"),
    "long_rows": ("block_per_row", "warp_per_row", "split_row", "rows_per_block"),
    "few_long_rows": ("split_row", "block_per_row", "warp_per_row", "rows_per_block"),
    "col_reduce": ("col_tiled", "col_cluster"),
}
COLUMN_MAPPINGS = ("col_tiled", "col_cluster")
# A column grid under half a wave of blocks leaves SMs idle: 8x slower on 65536x768 mean columns.
MIN_COLUMN_WAVES = 0.5
# Few long rows: a block per row leaves an SM a block or two, and a row split over a cluster ran
# 1.14-1.7x faster in the shipped data (256 x 65536, 64 x 250000; 1000 rows: the block per row
# won). Rows of 20-40 KB (UNet's GroupNorm at batch 8, 256 x 5120-10240) lost with the split on
# the H200 (block per row 1.0-1.7x faster, generalization_steps_h200.json), so it needs long rows.
MIN_ROWS_PER_SM = 2
SPLIT_ROW_MIN_BYTES = 128 << 10  # of one row
SPLIT_ROW_BLOCKS_PER_SM = 4  # the split that gives each SM this many blocks (best: s4-s8 there)
ESTIMATE_BIN = 1.05  # estimates within 5 % count as equal, so the rules after them decide
# A block per row over at most 4 rows an SM, each of 16 KB or more (the GroupNorms of UNet and GN
# ResNet-18, 256-512 rows of 20-40 KB): 512 threads ran 3-23 % faster than 256, 1024 slower
# (generalization_steps3_h200.json); elsewhere 256, the shipped data's choice.
FEW_ROWS_PER_SM = 4
FEW_ROWS_MIN_BYTES = 16 << 10
FEW_ROWS_BLOCK = 512
# Vocabulary-wide rows with two or more row-long values to keep (a cross-entropy gradient: the
# logits and the one-hot target, 125-196 KB rows): none in the shipped data (its longest such rows
# are 64 KB), and the model's pick, a row split over a cluster of 8 with the rows in registers
# (159-192 registers: one block of 256 threads an SM), ran 357 and 520 µs on the H200. Timed over
# the whole space (generalization_space_h200.json), a row split over two blocks of 1024 threads
# was fastest on both: 512 x 50257 161 µs (in shared memory, fast math; torch.compile 187, JAX
# 342), 2048 x 32000 331 µs (in registers, fast math; JAX 433); a block of 1024 re-reading the row
# next (265, 371).
VOCAB_ROW_BYTES = 96 << 10
# Fast math where the space offers it (kernels with exp/log/sigmoid/tanh: ``__expf``, ``__logf``,
# ``__fdividef``): GroupNorm + SiLU row steps ran 10-30 % faster on the H200 and passed the float64
# check (generalization_steps3_h200.json); within the intrinsics' documented error the plan's
# tolerance holds (tests/test_gen_fast_math.py).


def vocabulary_rows(a: Analysis) -> bool:
    """Rows of ``VOCAB_ROW_BYTES`` or more with two or more values cached along them."""
    return (a.pattern in ("row_reduce", "multi") and a.C * full_bytes(a) >= VOCAB_ROW_BYTES
            and len(cache_values(a, "boundary")) >= 2)


def _vocab_rank(s: Schedule) -> int:
    """The forms that ran fastest on vocabulary rows, as timed (a grid of one wave)."""
    if s.grid != "wave" or s.block != 1024:
        return 2
    if s.mapping == "split_row" and s.split == 2:
        return 0
    return 1 if s.mapping == "block_per_row" and s.row_cache == "reread" else 2


def _mapping_order(a: Analysis, elem_bytes: int, sm_count: int) -> tuple[str, ...]:
    if a.pattern in ("row_reduce", "multi"):
        short = a.C * elem_bytes <= SHORT_ROW_BYTES
        few = a.R < MIN_ROWS_PER_SM * sm_count and a.C * elem_bytes >= SPLIT_ROW_MIN_BYTES
        if not short and few:
            return MAPPING_ORDER["few_long_rows"]
        return MAPPING_ORDER["short_rows" if short else "long_rows"]
    return MAPPING_ORDER.get(a.pattern, ())


def fallback_order(a: Analysis, legal: Sequence[Schedule], roofline_us: np.ndarray,
                   waves: np.ndarray, sm_count: int = 132) -> list[int]:
    """Indices of ``legal``, best first; ties keep the schedule space's order."""
    eb = full_bytes(a)  # the element width the space's vector widths are checked against
    order = _mapping_order(a, eb, sm_count)
    few = (a.pattern in ("row_reduce", "multi") and a.R <= FEW_ROWS_PER_SM * sm_count
           and a.C * eb >= FEW_ROWS_MIN_BYTES)
    vocab = vocabulary_rows(a)

    def key(i: int) -> tuple:
        s, column = legal[i], legal[i].mapping in COLUMN_MAPPINGS
        hoisting = column or s.mapping == "transpose_tiled"  # loads issued together: more unroll
        return (_vocab_rank(s) if vocab else 0,
                order.index(s.mapping) if s.mapping in order else len(order),
                column and waves[i] < MIN_COLUMN_WAVES,
                s.mapping == "split_row" and a.R * s.split < SPLIT_ROW_BLOCKS_PER_SM * sm_count,
                round(math.log(max(float(roofline_us[i]), 1e-9)) / math.log(ESTIMATE_BIN)),
                s.grid != "full",                                    # a block per chunk of work
                -min(s.vec * eb, 16),                                # 16-byte accesses
                s.row_cache != "registers",
                not s.fast_math,                                     # FAST_MATH below
                -s.unroll if hoisting else s.unroll,
                abs(s.block - (512 if column else FEW_ROWS_BLOCK if few and s.mapping == "block_per_row"
                               else 256)),
                i)

    return sorted(range(len(legal)), key=key)

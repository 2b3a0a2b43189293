"""The ``breadth`` suite's specs: every op of the standard suite on shapes the standard suite
never uses, in the dtypes it did not pair them with (issue 22: more distinct workloads).

The standard suite is a grid of ops x 17 shapes with one dtype per (op, shape), so a held-out
workload nearly always has a twin of the same shape in training. Here every op gets shapes off
that grid: one to a few dozen rows (decode-time batches), odd and model-sized widths (257, 511,
1537, 2050, 3073, 5120, 11008, 14336, 50257) and up to a million short rows, about 0.1 KB to
160 MB per operand. Each (op, shape) takes the dtype the rotation of the standard suite does
not give it, and a few shapes are taken in all three float dtypes, so each op is also seen
across dtypes at equal shape. Deterministic; the suite itself is ``tunedb.kernels.suite``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

# (rows, columns). None of them is a standard-suite shape (a test checks).
BREADTH_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 4096), (7, 11008), (17, 50257), (96, 131072),          # few rows: decode batches, vocab
    (512, 96), (3000, 257), (1536, 511), (777, 1537),           # odd widths
    (4097, 2050), (2500, 5120), (12288, 3073), (2048, 14336),   # model widths, odd rows
    (524288, 64), (1048576, 24), (200003, 160), (131072, 257),  # many short rows
)
# Shapes at which every op is taken in all three float dtypes.
ALL_DTYPE_SHAPES: tuple[tuple[int, int], ...] = ((3000, 257), (4097, 2050))


def breadth_specs(variants: Mapping[str, Sequence[str]]) -> list[tuple[str, str, int, int, str]]:
    """(family, variant, rows, columns, dtype) of the breadth suite for the families' variants
    (``tunedb.kernels.suites.BUILDERS``' variant names, passed in to keep the modules apart)."""
    out: list[tuple[str, str, int, int, str]] = []
    k = 0
    for fam, names in variants.items():
        for var in names:
            for si, (R, C) in enumerate(BREADTH_SHAPES):
                if (R, C) in ALL_DTYPE_SHAPES:
                    out += [(fam, var, R, C, dt) for dt in FLOAT_DTYPES]
                else:
                    # Offset by one from the standard suite's (shape + variant) rotation.
                    out.append((fam, var, R, C, FLOAT_DTYPES[(si + k + 1) % 3]))
            k += 1
    return out

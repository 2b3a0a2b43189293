"""Schedules for fused memory-bound kernels and the space of legal ones per workload.

A ``Schedule`` is the tunable half of a candidate (``Candidate.config``): how the [R, C] domain
of the analysis (``tunedb.kernels.analysis``) maps onto threads, how wide the vector accesses
are, where a row lives between the passes over it, and how each intermediate is handed from
producer to consumer (the *stitch* scheme, after FusionStitching/AStitch):

* ``recompute``: evaluated again from values at hand (cheap elementwise chains)
* ``register``: kept per thread in registers (the row cache of a row-mapped kernel)
* ``shuffle``: a reduction result combined and broadcast with warp shuffles
* ``smem``: kept in shared memory (long rows, block-wide reductions, column partials)
* ``dsmem``: through the shared memory of the other blocks of a thread-block cluster (sm_90
  distributed shared memory: ``split_row`` splits a row across the blocks of one cluster)
* ``global``: through global memory (a re-read of the inputs, or partials between two kernels)

``split_row`` splits each row across ``split`` blocks (2, 4 or 8) of one thread-block cluster;
the blocks exchange reduction partials through distributed shared memory and synchronise with
cluster barriers, so it is one kernel and the row is still read once. ``col_cluster`` does the
same for column reductions: a cluster of ``split`` blocks owns a column strip, each block a
range of rows kept in registers, so x - mean(x, 0) reads x once.

``row_cache="prefetch"`` (block/warp per row, grid-stride loop) keeps the row in registers like
``registers`` and streams the block's next row into shared memory with ``cp.async`` while the
current one is reduced and written: a 128 KB row fills half the register file, so without it an
SM holds one row and waits out its load latency once per row. ``transpose_tiled`` with
``unroll=2`` issues every global load of its tile before the first shared-memory store, and with
``swizzle`` (64-wide tiles) each lane walks its tile columns in its own order, so a warp's
shared-memory stores and loads spread over all 32 banks instead of pairing up on 16.

``stream`` marks every vector load and store of the kernel with the streaming cache hint
(``ld.global.cs`` / ``st.global.cs``: evict first, from L1 and L2). ``evict_last`` marks every
vector load with the evict-last policy in L1 and L2 (``createpolicy`` + ``L2::cache_hint``), as
torch.compile's Triton reductions issue a row's first read; offered for row caches in registers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from tunedb.graph.ir import DTYPE_BYTES, Graph
from tunedb.kernels.analysis import (
    BCOL,
    COL,
    FULL,
    ROW,
    TRANS,
    TRANSCENDENTAL,
    Analysis,
    analyze,
)
from tunedb.kernels.passes import cache_values

MAPPINGS = ("elementwise", "warp_per_row", "block_per_row", "rows_per_block", "split_row",
            "col_tiled", "col_cluster", "transpose_tiled")
ROW_MAPPINGS = ("warp_per_row", "block_per_row", "rows_per_block", "split_row")
ROW_CACHES = ("registers", "smem", "reread", "prefetch")
CACHE_MODES = ("boundary", "inputs")
STITCH = ("recompute", "register", "shuffle", "smem", "dsmem", "global")
GRIDS = ("wave", "full")
GRID_MAPPINGS = ("elementwise",) + ROW_MAPPINGS
# Fields added after the first H200 dataset: left out of ``to_config`` at their default, so the
# configs (and candidate hashes) stored before they existed still name the same kernels.
_LATE_DEFAULTS = {"grid": "wave", "swizzle": False, "stream": False, "evict_last": False}
# Mappings whose vector loads and stores may carry the streaming (evict-first) cache hint. Not
# col_cluster (35 % slower with it on the H200) nor split_row (cluster exchanges like col_cluster's;
# not measured), and not prefetch row caches (4-18 % slower; their rows arrive by cp.async).
STREAM_MAPPINGS = ("elementwise", "transpose_tiled", "warp_per_row", "block_per_row", "rows_per_block",
                   "col_tiled")
# Mappings whose vector loads may carry the evict-last policy: one row per warp or block, its
# cache in registers. On H200s it took rmsnorm 8192x4096 from 66.1 to 64.7 µs on one board (and
# 66.6 to 66.8 on another) and add_layernorm from 95.3 to 93.8, made scale_mask_softmax 20 %
# slower on one board, and slowed re-read rows, transposes, elementwise, col_tiled and
# rows_per_block by up to 9 % (docs/investigations.md, evict_last): the search decides per workload.
EVICT_LAST_MAPPINGS = ("warp_per_row", "block_per_row")

MAX_CACHE_REGS = 64          # registers/thread a row cache may take (of 255; spills kill bandwidth)
MAX_SMEM = 227 * 1024        # dynamic shared memory per block on sm_90
MAX_UNROLLED = 64            # vector iterations per thread a row kernel unrolls fully


@dataclass(frozen=True)
class Schedule:
    mapping: str
    block: int = 256            # threads per block
    vec: int = 1                # elements per vector access (16 bytes at most)
    unroll: int = 1             # independent vector accesses per thread per loop trip
    group: int = 0              # row mappings: threads per row; col_tiled: threads across columns
    split: int = 1              # col_tiled: row splits (>1: partials through global, two kernels);
                                # split_row / col_cluster: blocks per cluster
    tile: int = 32              # transpose_tiled: square tile edge
    row_cache: str = "registers"
    cache: str = "boundary"     # what a row cache holds: boundary values or the full-size inputs
    fast_math: bool = False
    stitch: str = ""            # "value:scheme;..." (derived by ``schedule_space``, descriptive)
    grid: str = "wave"          # elementwise / row mappings: "wave" = at most one wave of resident
                                # blocks, each looping over its share; "full" = a block per chunk
                                # (more blocks in flight; measured 9 % faster on some H200 cases)
    swizzle: bool = False       # transpose_tiled (tile 64, unroll 2): bank-conflict-free tile order
    stream: bool = False        # vector loads and stores with the streaming (evict-first) cache hint
    evict_last: bool = False    # vector loads with the evict-last policy in L1 and L2

    def __post_init__(self) -> None:
        if self.mapping not in MAPPINGS:
            raise ValueError(f"unknown mapping {self.mapping!r}; expected one of {', '.join(MAPPINGS)}")
        if self.row_cache not in ROW_CACHES:
            raise ValueError(f"unknown row_cache {self.row_cache!r}; expected one of {', '.join(ROW_CACHES)}")
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; expected one of {', '.join(GRIDS)}")
        for flag in ("swizzle", "stream", "evict_last"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"unknown cache {self.cache!r}; expected one of {', '.join(CACHE_MODES)}")
        for f in ("block", "vec", "unroll", "split", "tile"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"schedule {f}={v!r} must be a positive int")
        if self.vec not in (1, 2, 4, 8):
            raise ValueError(f"vector width {self.vec} must be 1, 2, 4 or 8")
        if self.block > 1024 or self.block % 32:
            raise ValueError(f"block {self.block} must be a multiple of 32 and at most 1024")

    @property
    def threads_per_row(self) -> int:
        return {"warp_per_row": 32, "block_per_row": self.block, "split_row": self.block}.get(
            self.mapping, self.group)

    @property
    def row_split(self) -> int:
        return self.split if self.mapping == "split_row" else 1

    def to_config(self) -> dict:
        """JSON scalars only (``Candidate.config``)."""
        d = asdict(self)
        for k, v in _LATE_DEFAULTS.items():
            if d[k] == v:
                del d[k]
        return d

    @staticmethod
    def from_config(config: dict | tuple) -> Schedule:
        d = dict(config)
        known = {f.name for f in fields(Schedule)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown schedule key(s) {', '.join(unknown)}")
        if "mapping" not in d:
            raise ValueError("schedule config has no 'mapping'")
        return Schedule(**d)

    @property
    def stitch_map(self) -> dict[str, str]:
        return dict(p.rsplit(":", 1) for p in self.stitch.split(";") if p)

    def label(self) -> str:
        parts = [self.mapping, f"b{self.block}", f"v{self.vec}"]
        if self.mapping in ROW_MAPPINGS:
            parts += [f"t{self.threads_per_row}", self.row_cache, self.cache]
            if self.mapping == "split_row":
                parts.append(f"s{self.split}")
        if self.mapping == "col_tiled":
            parts += [f"tx{self.group}", f"s{self.split}", f"u{self.unroll}"]
        if self.mapping == "col_cluster":
            parts += [f"tx{self.group}", f"s{self.split}", self.cache]
        if self.mapping == "transpose_tiled":
            parts += [f"tile{self.tile}"] + ([f"u{self.unroll}"] if self.unroll > 1 else [])
            parts += ["swz"] if self.swizzle else []
        if self.mapping == "elementwise":
            parts += [f"u{self.unroll}"]
        if self.grid != "wave":
            parts.append(f"grid{self.grid}")
        if self.fast_math:
            parts.append("fast")
        if self.stream:
            parts.append("cs")
        if self.evict_last:
            parts.append("el")
        return "_".join(parts)


# --- facts the space and the generator share -------------------------------------------------

def full_bytes(a: Analysis) -> int:
    """Widest element among the arrays accessed with vectors (full-size and per-column; bcol
    leaves too wide for the vector are read element by element, ``Frame.bcol_loads``)."""
    types = a.graph.type_map
    cls = a.cls
    vals = [v for v in list(a.graph.inputs) + list(a.graph.outputs)
            if cls.get(a.resolve(v)) in (FULL, COL, TRANS)]
    data = max((DTYPE_BYTES[types[v].dtype] for v in vals if cls.get(a.resolve(v)) != COL), default=0)
    # a per-column input wider than the data (int64 class ids next to float logits) is read
    # element by element (``Frame.col_load``), so it does not narrow the data's vectors
    return max((DTYPE_BYTES[types[v].dtype] for v in vals
                if not (cls.get(a.resolve(v)) == COL and v in a.graph.inputs
                        and types[v].dtype in ("int64", "int32", "bool") and data)), default=4)


def row_iters(C: int, threads: int, vec: int) -> int:
    return math.ceil(C / (threads * vec))


def cache_regs(a: Analysis, s: Schedule) -> int:
    """Registers per thread for the row cache and the column-reduction accumulators."""
    n_col = sum(r.axis == "col" for r in a.reductions)
    per = row_iters(a.C, s.threads_per_row * s.row_split, s.vec) * s.vec
    return per * (len(cache_values(a, s.cache)) * (s.row_cache in ("registers", "prefetch")) + n_col)


def row_smem_layout(a: Analysis, s: Schedule) -> tuple[dict[str, int], int]:
    """Byte offsets of a row-mapped kernel's dynamic shared-memory regions, and the total: the
    generator places its buffers here and the space sizes the launch from the same numbers.
    Regions: "red" (reduction slots, more than a warp per row), "rcs" (the shared row cache),
    "pf:<input>" (the next row of each full-size input, row prefetch), "cpart" (column
    partials)."""
    t = s.threads_per_row
    groups = s.block // t
    n_row = sum(r.axis == "row" for r in a.reductions)
    n_col = sum(r.axis == "col" for r in a.reductions)
    at: dict[str, int] = {}
    off = 0
    if t > 32:
        at["red"] = 0
        off = (4 * 33 * max(1, n_row) + 15) // 16 * 16
    if s.row_cache == "smem":
        at["rcs"] = off
        per_group = row_iters(a.C, t * s.row_split, s.vec) * s.vec * t
        off += 4 * groups * len(cache_values(a, s.cache)) * per_group
    if s.row_cache == "prefetch":
        per_group = row_iters(a.C, t, s.vec) * s.vec * t
        for v in _full_inputs(a):
            at[f"pf:{v}"] = off
            off += (groups * per_group * DTYPE_BYTES[a.graph.type_of(v).dtype] + 15) // 16 * 16
    if n_col:
        at["cpart"] = off
    return at, off + 4 * n_col * a.C


def row_smem_bytes(a: Analysis, s: Schedule) -> int:
    """Dynamic shared memory of a row-mapped kernel (``row_smem_layout``)."""
    return row_smem_layout(a, s)[1]


def _full_inputs(a: Analysis) -> list[str]:
    return [v for v in list(a.graph.inputs) + [c for c, _ in a.graph.constants] if a.cls.get(v) == FULL]


def legal_vecs(a: Analysis, need_c: bool = True, need_r: bool = False) -> tuple[list[int], list[str]]:
    eb = full_bytes(a)
    ok, why = [], []
    for v in (8, 4, 2, 1):
        if v * eb > 16:
            why.append(f"vector width {v} of {eb}-byte elements exceeds 16 bytes")
        elif need_c and a.C % v:
            why.append(f"vector width {v} does not divide C={a.C}")
        elif need_r and a.trans_rows % v:
            why.append(f"vector width {v} does not divide the transposed rows ({a.trans_rows})")
        else:
            ok.append(v)
    return ok, why


def stitch_of(a: Analysis, s: Schedule) -> str:
    """The stitch scheme of every reduction result and cached intermediate under ``s``."""
    out: dict[str, str] = {}
    if s.mapping in ROW_MAPPINGS:
        t = s.threads_per_row
        for r in a.reductions:
            out[r.value] = (("shuffle" if t <= 32 else "smem") if s.row_split == 1 else "dsmem"
                            ) if r.axis == "row" else "global"
        cached = cache_values(a, s.cache)
        scheme = {"registers": "register", "smem": "smem", "reread": "global",
                  "prefetch": "register"}[s.row_cache]
        for v in cache_values(a, "boundary"):
            out.setdefault(v, scheme if v in cached else "recompute")
        for v in cached:
            out.setdefault(v, scheme)
    elif s.mapping == "col_tiled":
        for r in a.reductions:
            out[r.value] = "smem" if s.split == 1 else "global"
        for v in cache_values(a, "boundary"):
            out[v] = "global"  # re-read in the second sweep or the second kernel
    elif s.mapping == "col_cluster":
        for r in a.reductions:
            out[r.value] = "dsmem"
        cached = cache_values(a, s.cache)
        for v in cache_values(a, "boundary"):
            out[v] = "register" if v in cached else "recompute"
        for v in cached:
            out.setdefault(v, "register")
    elif s.mapping == "transpose_tiled":
        for v in a.transposed_inputs:
            out[v] = "smem"
    return ";".join(f"{k}:{v}" for k, v in sorted(out.items()))


# --- the space --------------------------------------------------------------------------------

def _with_stitch(a: Analysis, s: Schedule) -> Schedule:
    return replace(s, stitch=stitch_of(a, s))


def check(a: Analysis, s: Schedule) -> str:
    """Why ``s`` cannot run ``a`` ("" when it can)."""
    m = s.mapping
    pat = a.pattern
    allowed = {"elementwise": ("elementwise",), "transpose": ("transpose_tiled", "elementwise"),
               "row_reduce": ROW_MAPPINGS, "multi": ROW_MAPPINGS,
               "col_reduce": ("col_tiled", "col_cluster")}[pat]
    if m not in allowed:
        return f"mapping {m} does not fit a {pat} subgraph (use {', '.join(allowed)})"
    if s.grid == "full" and (m not in GRID_MAPPINGS or pat == "multi"):
        return (f"grid full needs one of {', '.join(GRID_MAPPINGS)} without column partials "
                f"(their count follows the grid)")
    if s.swizzle and m != "transpose_tiled":
        return "swizzle orders a transpose tile; only transpose_tiled has one"
    if s.stream and s.evict_last:
        return "the streaming cache hint and the evict-last policy exclude each other"
    if s.stream and not _may_stream(s):
        return (f"the streaming cache hint applies to {', '.join(STREAM_MAPPINGS)} without a "
                f"prefetched row cache")
    if s.evict_last and not _may_evict_last(s):
        return (f"the evict-last policy applies to {', '.join(EVICT_LAST_MAPPINGS)} with a register "
                f"row cache")
    eb = full_bytes(a)
    if s.vec * eb > 16:
        return f"vector width {s.vec} of {eb}-byte elements exceeds 16 bytes"
    cls = a.cls
    needs_c = m != "elementwise" or any(c in (ROW, COL, TRANS, BCOL) for c in cls.values())
    if needs_c and a.C % s.vec:
        return f"vector width {s.vec} does not divide C={a.C}"
    if m == "transpose_tiled":
        if a.trans_rows % s.vec:
            return f"vector width {s.vec} does not divide the transposed rows ({a.trans_rows})"
        if s.tile % s.vec or s.tile // s.vec > s.block or s.block % (s.tile // s.vec):
            return f"tile {s.tile} with vec {s.vec} does not fit block {s.block}"
        if s.unroll not in (1, 2):
            return f"transpose_tiled unroll is 1 (loads per tile row) or 2 (all loads first), not {s.unroll}"
        if s.unroll == 2 and s.tile % (s.block // (s.tile // s.vec)):
            return f"block {s.block} does not cover tile {s.tile} in whole rows per thread"
        if s.swizzle and (s.tile != 64 or s.vec < 2 or s.unroll != 2):
            return "swizzle needs a 64-wide tile, vec >= 2 and unroll 2 (the conflicts it removes)"
        if math.ceil(a.R / s.tile) > 65535:
            return f"R={a.R} needs more than 65535 tile rows"
    if m in ROW_MAPPINGS:
        t = s.threads_per_row
        if t < 1 or t > s.block or s.block % t or (t < 32 and 32 % t) or (t > 32 and t % 32):
            return f"{t} threads per row does not tile block {s.block}"
        if m == "split_row":
            if s.split not in (2, 4, 8):
                return f"split_row needs a cluster of 2, 4 or 8 blocks, not {s.split}"
            if pat == "multi":
                return "split_row cannot hold per-thread column partials of a multi pattern"
            if t * s.split * s.vec > a.C:
                return (f"row split across {s.split} blocks of {t} threads x vec {s.vec} covers "
                        f"{t * s.split * s.vec} columns, more than C={a.C}")
        elif t * s.vec > 2 * a.C and t > 4:
            return f"{t} threads x vec {s.vec} cover {t * s.vec} columns, more than twice C={a.C}"
        it = row_iters(a.C, t * s.row_split, s.vec)
        if (s.row_cache != "smem" or pat == "multi") and it > MAX_UNROLLED:
            return f"row of {a.C} needs {it} vector iterations per thread > {MAX_UNROLLED}"
        if s.row_cache == "prefetch":
            if m == "split_row" or pat == "multi" or s.grid != "wave":
                return ("prefetch streams a block's next row: one block per row group looping over "
                        "rows (grid wave), no cluster, no column partials")
            narrow = [a.graph.type_of(v).dtype for v in _full_inputs(a)
                      if s.vec * DTYPE_BYTES[a.graph.type_of(v).dtype] < 4]
            if narrow:
                return f"prefetch copies of vec {s.vec} x {narrow[0]} are under 4 bytes"
        if s.row_cache in ("registers", "prefetch") or pat == "multi":
            regs = cache_regs(a, s)
            limit = min(MAX_CACHE_REGS, 65536 // s.block - 32)
            if regs > limit:
                dt = a.graph.type_of(a.graph.outputs[0]).dtype
                return (f"row of {a.C} {dt} needs {regs} registers/thread at block {s.block}, "
                        f"vec {s.vec} > limit {limit}")
        smem = row_smem_bytes(a, s)
        if smem > MAX_SMEM:
            return f"needs {smem} bytes of shared memory > {MAX_SMEM}"
    if m == "col_cluster":
        tx = s.group
        if a.col_seg:
            return "col_cluster reduces all R rows; a middle-axis (segmented) reduction needs col_tiled"
        if s.split not in (2, 4, 8):
            return f"col_cluster needs a cluster of 2, 4 or 8 blocks, not {s.split}"
        if tx < 1 or s.block % tx:
            return f"{tx} threads across columns does not tile block {s.block}"
        nj = math.ceil(math.ceil(a.R / s.split) / (s.block // tx))
        if nj > MAX_UNROLLED:
            return f"{nj} rows per thread > {MAX_UNROLLED}"
        n_full = sum(1 for v in a.graph.inputs if cls.get(v) == FULL)
        regs = nj * s.vec * max(len(cache_values(a, s.cache)), n_full)
        limit = min(MAX_CACHE_REGS, 65536 // s.block - 32)
        if regs > limit:
            return (f"{nj} rows x vec {s.vec} per thread need {regs} registers at block {s.block} "
                    f"> limit {limit}; R={a.R} is too tall for a cluster of {s.split}")
    if m == "col_tiled":
        tx = s.group
        if tx < 1 or s.block % tx or s.block // tx < 1:
            return f"{tx} threads across columns does not tile block {s.block}"
        if s.split > 1 and a.col_levels > 1:
            return "row split of chained column reductions needs more than two kernels"
        if s.split > math.ceil(a.seg / (s.block // tx)):
            return f"split {s.split} leaves row ranges shorter than a block's {s.block // tx} rows"
    return ""


def _candidates(a: Analysis, sm_count: int) -> list[Schedule]:
    pat = a.pattern
    out: list[Schedule] = []
    vecs_c, _ = legal_vecs(a, need_c=True)
    if pat in ("elementwise", "transpose"):
        ew_vecs = (8, 4, 2, 1) if pat == "elementwise" else (1,)
        for b in (128, 256, 512):
            for v in ew_vecs:
                for u in (1, 2, 4):
                    out.append(Schedule("elementwise", block=b, vec=v, unroll=u))
    if pat == "transpose":
        # 512 and 1024 threads on a 64-wide tile: 20-32 registers a thread instead of 54, twice
        # the warps per SM (H200 transpose_add: 95.4 us against 96.0 for the best 256-thread tile)
        for tile, blocks in ((32, (128, 256)), (64, (128, 256, 512, 1024))):
            for b in blocks:
                for v in (1, 2, 4, 8):
                    if b % (tile // v) == 0 and b // (tile // v) <= tile:
                        # unroll 2: every load of the tile issued before the shared-memory stores
                        out += [Schedule("transpose_tiled", block=b, vec=v, tile=tile, unroll=u)
                                for u in (1, 2)]
        # 64-wide hoisted tiles again with the bank-conflict-free order
        out += [replace(c, swizzle=True) for c in out
                if c.mapping == "transpose_tiled" and c.tile == 64 and c.vec >= 2 and c.unroll == 2]
        # 128-wide tiles (66 KB of shared memory): more loads in flight per block, hoisted only
        out += [Schedule("transpose_tiled", block=b, vec=v, tile=128, unroll=2)
                for b in (256, 512) for v in (2, 4) if b % (128 // v) == 0]
    if pat in ("row_reduce", "multi"):
        top = [v for v in (8, 4, 2, 1)][:4]
        legal = [v for v in top if v in vecs_c][:2] or [1]
        differ = set(cache_values(a, "inputs")) != set(cache_values(a, "boundary"))
        modes = ["boundary"] + (["inputs"] if differ else [])
        shapes = ([("rows_per_block", b, t) for t in (4, 8, 16) for b in (128, 256)]
                  + [("warp_per_row", b, 32) for b in (128, 256, 512)]
                  + [("block_per_row", b, b) for b in (128, 256, 512, 1024)]
                  + [("split_row", b, sp) for sp in (2, 4, 8) for b in (256, 512, 1024)
                     if pat == "row_reduce" and b * sp * 2 <= a.C])
        for m, b, t in shapes:
            for v in (8, 4, 2, 1):
                for mode in modes:
                    for rc in ROW_CACHES:
                        s = Schedule(m, block=b, vec=v, group=t if m == "rows_per_block" else 0,
                                     split=t if m == "split_row" else 1, row_cache=rc, cache=mode)
                        if rc != "registers" and mode != "boundary":
                            continue
                        if v not in legal:
                            if rc == "registers" and mode == "boundary":
                                out.append(s)  # kept so the pruned list says why
                            continue
                        if rc == "smem" and not check(a, replace(s, row_cache="registers")):
                            continue  # registers fit: shared memory only adds traffic
                        if rc == "reread" and (m in ("rows_per_block", "split_row") or v != legal[0]):
                            continue
                        if rc == "prefetch" and (m not in ("block_per_row", "warp_per_row")
                                                 or pat != "row_reduce"):
                            continue
                        out.append(s)
    if pat == "col_reduce":
        differ = set(cache_values(a, "inputs")) != set(cache_values(a, "boundary"))
        for sp in (2, 4, 8):
            for tx, ty in ((4, 128), (8, 64), (8, 128), (16, 32), (16, 64), (32, 32)):
                for v in [v for v in (8, 4, 2, 1) if v in vecs_c][:2] or [1]:
                    for mode in ("boundary", "inputs") if differ else ("boundary",):
                        out.append(Schedule("col_cluster", block=tx * ty, vec=v, group=tx, split=sp,
                                            cache=mode))
        for tx, ty in ((8, 32), (16, 16), (32, 8), (16, 32), (32, 16), (8, 16), (4, 64), (8, 64)):
            for v in (8, 4, 2, 1):
                strips = math.ceil(a.C / (tx * v)) * (a.R // a.seg)  # blocks of one row range
                auto = max(1, min(math.ceil(2 * sm_count / strips), math.ceil(a.seg / (8 * ty))))
                for sp in sorted({1, auto}):
                    for u in (1, 4):
                        out.append(Schedule("col_tiled", block=tx * ty, vec=v, unroll=u, group=tx, split=sp))
    return out


def schedule_space(graph: Graph | Analysis, sm_count: int = 132
                   ) -> tuple[list[Schedule], list[tuple[Schedule, str]]]:
    """Legal schedules of ``graph`` and the pruned ones with the reason. Raises
    ``UnsupportedFusion`` when the subgraph itself is outside the generator."""
    a = graph if isinstance(graph, Analysis) else analyze(graph)
    legal: list[Schedule] = []
    pruned: list[tuple[Schedule, str]] = []
    seen: set[Schedule] = set()
    cands = _candidates(a, sm_count)
    if any(n.op in TRANSCENDENTAL for n in a.nodes):
        # exp/tanh/erf chains can cost more ALU time than their bytes take at full bandwidth:
        # offer the fast-math variant of the configurations most likely to be fastest
        cands += [replace(s, fast_math=True) for s in cands
                  if s.mapping in ("elementwise", "split_row", "col_cluster")
                  or (s.row_cache in ("registers", "prefetch") and s.cache == "boundary"
                      and s.mapping in ROW_MAPPINGS)]
    # every elementwise / row candidate also with a block per chunk of work (no grid-stride loop)
    cands += [replace(s, grid="full") for s in cands
              if s.mapping in GRID_MAPPINGS and a.pattern != "multi" and s.row_cache != "prefetch"]
    for s in cands:
        if s in seen:
            continue
        seen.add(s)
        why = check(a, s)
        if why:
            pruned.append((s, why))
        else:
            legal.append(_with_stitch(a, s))
    # ... and every legal one that may stream with evict-first loads and stores, where the
    # outputs are small, or load with the evict-last policy; the hints change nothing else the
    # checks or the stitch map look at. Both twin lists come from the plain schedules: the two
    # hints exclude each other (``check``).
    last = [replace(s, evict_last=True) for s in legal if _may_evict_last(s)]
    twins = [replace(s, stream=True) for s in legal if _may_stream(s)]
    legal += last
    if _small_outputs(a.graph):
        legal += twins
    else:
        pruned += [(s, STREAM_LARGE_OUTPUTS) for s in twins]
    return legal, pruned


# On the H200 the evict-first hint paid only where a kernel writes little of what it reads:
# softmax_xent (4 bytes out per 16 KB row) 2.8 % faster; 1-10 % slower on the 9 anchors whose
# outputs are half their inputs or more (data/bench/twins_stream_h200.json).
STREAM_LARGE_OUTPUTS = ("streaming cache hint: outputs over a quarter of the inputs' bytes "
                        "(1-10 % slower on the H200 anchors)")


def _may_stream(s: Schedule) -> bool:
    return s.mapping in STREAM_MAPPINGS and s.row_cache != "prefetch"


def _may_evict_last(s: Schedule) -> bool:
    return s.mapping in EVICT_LAST_MAPPINGS and s.row_cache == "registers"


def _small_outputs(graph: Graph) -> bool:
    inputs, outputs = graph.io_bytes()
    return 4 * outputs <= inputs

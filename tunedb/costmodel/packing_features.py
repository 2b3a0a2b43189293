"""Features of the cost-model kind ``packing`` (``FEATURES``, schema ``FEATURE_SCHEMA``), from the
workload record and the candidate alone: the model ranks candidates before any is measured.
``tunedb.costmodel.packing`` trains and evaluates on them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from tunedb.kernels.packing import (
    BACKENDS,
    DTYPES,
    EXTRA_BACKENDS,
    Candidate,
    Cluster,
    Member,
    PackingWorkload,
    all_candidates,
    candidate_waste,
    done_macs,
    padded_shape,
    splitk_depth,
)

# 2: padded_t; 3: waves per launch; 4: layout, split-K; 5: traffic, relative; 6: splitk, chunks
FEATURE_SCHEMA = "packing/6"
SMS, TILE = 132, 128
PEAK_FLOPS = {"float32": 60e12, "bfloat16": 800e12, "float16": 800e12}  # attainable, not datasheet
PEAK_BYTES = 4.0e12
LAUNCH_US = 2.5  # one launch inside a graph, roughly


def _roofline_us(flops: float, nbytes: float, dtype: str) -> float:
    return 1e6 * max(flops / PEAK_FLOPS[dtype], nbytes / PEAK_BYTES)


def workload_features(w: PackingWorkload) -> dict[str, float]:
    ms = w.members
    m = np.array([x.m for x in ms], float)
    n = np.array([x.n for x in ms], float)
    k = np.array([x.k for x in ms], float)
    tiles = np.array([x.batch * math.ceil(x.m / TILE) * math.ceil(x.n / TILE) for x in ms], float)
    single = [_roofline_us(x.flops, x.bytes(), x.dtype) for x in ms]
    waves = tiles.sum() / SMS
    return {
        "members": len(ms), "problems": w.problems, "log_flops": math.log2(w.flops),
        "log_bytes": math.log2(w.bytes()), "intensity": w.flops / w.bytes(),
        "dtype_bytes": DTYPES[ms[0].dtype], "is_fp32": float(ms[0].dtype == "float32"),
        "nt_share": float(np.mean([x.layout == "nt" for x in ms])),
        "log_m_max": math.log2(m.max()), "log_m_min": math.log2(m.min()), "m_cv": float(m.std() / m.mean()),
        "log_n_max": math.log2(n.max()), "log_n_min": math.log2(n.min()),
        "log_k_max": math.log2(k.max()), "log_k_min": math.log2(k.min()),
        "shapes": len({x.key for x in ms}), "nk_groups": len({(x.n, x.k) for x in ms}),
        "waves": waves, "tail": waves - math.floor(waves), "max_member_waves": tiles.max() / SMS,
        "single_sum_us": float(sum(single)), "single_max_us": float(max(single)),
    }


def _tiles(m: int, n: int, batch: int = 1) -> int:
    return batch * math.ceil(m / TILE) * math.ceil(n / TILE)


def launch_tiles(mem: Sequence[Member], backend: str, split: int = 1, rows: int = 0
                 ) -> list[tuple[int, int]]:
    """(output tiles, depth k) of each launch a backend makes for ``mem``: one per member for
    serial and streams, one padded or concatenated problem set for the batched backends; for
    ``splitk`` and ``chunks`` every (slice, problem or chunk) is a tile set of one slice's depth."""
    if backend == "splitk":
        M, N, K = padded_shape(mem)
        return [(_tiles(M, N, sum(x.batch for x in mem)) * split, splitk_depth(K, split))]
    if backend == "chunks":
        _, N, K = padded_shape(mem)
        chunks = sum(x.batch * -(-x.m // rows) for x in mem)
        depth = splitk_depth(K, split) if split > 1 else K
        return [(chunks * _tiles(rows, N) * split, depth)]
    if backend in ("serial", "streams"):
        return [(_tiles(x.m, x.n, x.batch), x.k) for x in mem]
    if backend in ("padded", "padded_t", "pointer"):
        M, N, K = padded_shape(mem)
        return [(_tiles(M, N, sum(x.batch for x in mem)), K)]
    if backend == "concat":
        return [(_tiles(sum(x.batch * x.m for x in mem), sum(x.n for x in mem)), mem[0].k)]
    return [(sum(_tiles(x.m, x.n, x.batch) for x in mem), max(x.k for x in mem))]  # grouped


def candidate_features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    count: dict[str, int] = defaultdict(int)
    launches, cluster_us, biggest = 0, [], 0
    # Waves rounded up per launch: a launch of 133 tiles costs two waves on 132 SMs, and streams
    # share the SMs, so k lanes take at least the waves of all their tiles together.
    tiles, slots, wave_us = 0, 0.0, 0.0
    tile_us = 1e6 * 2 * TILE * TILE * SMS / PEAK_FLOPS[w.members[0].dtype]  # per unit of k
    for cl in c.clusters:
        mem = [w.members[i] for i in cl.members]
        ts = launch_tiles(mem, cl.backend, cl.split, cl.rows)
        s = sum(math.ceil(t / SMS) for t, _ in ts)
        u = sum(math.ceil(t / SMS) * k for t, k in ts)
        if cl.streams > 1:
            together = math.ceil(sum(t for t, _ in ts) / SMS)
            s, u = max(together, s / cl.streams), max(u / cl.streams, together * max(k for _, k in ts))
        tiles += sum(t for t, _ in ts)
        slots += s
        wave_us += u * tile_us
        count[cl.backend] += len(mem)
        per_call = cl.backend in ("serial", "streams")
        calls = 1 + (cl.split > 1)  # split-K partials: a second launch sums them
        launches += len(mem) if per_call else calls
        done = done_macs(mem, cl.backend, cl.split, cl.rows)
        nbytes = sum(x.bytes() for x in mem) + partial_bytes(mem, cl)
        cluster_us.append(_roofline_us(2 * done, nbytes, mem[0].dtype)
                          + (LAUNCH_US * len(mem) / max(1, cl.streams) if per_call else LAUNCH_US * calls))
        biggest = max(biggest, len(mem))
    lanes = max(c.concurrent, max(cl.streams for cl in c.clusters))
    out = {f"share_{b}": count[b] / len(w.members) for b in BACKENDS + EXTRA_BACKENDS}
    out.update({"clusters": len(c.clusters), "concurrent": c.concurrent, "lanes": lanes,
                "launches": launches, "waste": candidate_waste(w, c), "biggest_cluster": biggest,
                "est_sum_us": float(sum(cluster_us)), "est_max_us": float(max(cluster_us)),
                "est_lanes_us": float(max(max(cluster_us), sum(cluster_us) / lanes))})
    conc = max(1, c.concurrent)
    useful = sum(_tiles(x.m, x.n, x.batch) for x in w.members)
    out.update({"cand_tiles": tiles, "cand_wave_slots": slots / conc,
                "cand_fill": useful / max(1.0, slots * SMS), "est_wave_us": wave_us / conc})
    return out


def layout_features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    """How the candidate reads its operands: the share of members whose B is read transposed
    (``padded_t`` flips the layout), its partition, the largest batched problem, most streams:
    cuBLAS picks other kernels for these, which the roofline estimates do not see."""
    ms = w.members
    trans = sum((ms[i].layout != "nt") if cl.backend == "padded_t" else (ms[i].layout == "nt")
                for cl in c.clusters for i in cl.members)
    out = {"trans_b_share": trans / len(ms)}
    out.update({f"part_{p}": float(c.partition == p) for p in ("whole", "shape", "nk", "bins", "k")})
    big = [_tiles(*padded_shape([ms[i] for i in cl.members])[:2]) for cl in c.clusters
           if cl.backend in ("padded", "padded_t", "pointer", "splitk")]
    big += [_tiles(cl.rows, padded_shape([ms[i] for i in cl.members])[1]) for cl in c.clusters
            if cl.backend == "chunks"]
    out["log_batched_tiles_max"] = float(np.log2(max(big))) if big else -1.0
    out["streams_max"] = float(max(cl.streams for cl in c.clusters))
    # packing/6: the parameters of splitk and chunks (slices of the depth, rows per chunk)
    out["split_max"] = float(max(cl.split for cl in c.clusters))
    rows = [cl.rows for cl in c.clusters if cl.backend == "chunks"]
    out["log_chunk_rows"] = float(np.log2(min(rows))) if rows else 0.0
    part = sum(partial_bytes([ms[i] for i in cl.members], cl) for cl in c.clusters)
    out["partial_over_bytes"] = part / w.bytes()
    return out


def partial_bytes(mem: Sequence[Member], cl: Cluster) -> int:
    """Bytes of float32 partial sums a split depth writes and its summing kernel reads back."""
    if cl.split <= 1:
        return 0
    if cl.backend == "chunks":
        _, N, _ = padded_shape(mem)
        rows = sum(x.batch * -(-x.m // cl.rows) * cl.rows for x in mem)
        return 2 * 4 * cl.split * rows * N
    M, N, _ = padded_shape(mem)
    return 2 * 4 * cl.split * sum(x.batch for x in mem) * M * N


def splitk_features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    """Wave time with split-K: a single GEMM of t tiles and depth k runs min(132 / t, k / 256)
    CTAs per tile (cuBLAS splits k when the output alone does not fill the SMs); a batched call
    one."""
    ms = w.members
    tile_us = 1e6 * 2 * TILE * TILE * SMS / PEAK_FLOPS[ms[0].dtype]
    total, splits = 0.0, []
    for cl in c.clusters:
        ts = launch_tiles([ms[i] for i in cl.members], cl.backend, cl.split, cl.rows)
        single = cl.backend in ("serial", "streams")
        us, ctas, sp_cl = [], 0, []
        for t, k in ts:
            # splitk and chunks: the slices are in the tiles already (launch_tiles)
            sp = max(1, min(SMS // max(1, t), k // 256)) if single else 1
            sp_cl.append(sp)
            us.append(math.ceil(t * sp / SMS) * k / sp)
            ctas += t * sp
        u = sum(us)
        if cl.streams > 1:
            u = max(u / cl.streams, math.ceil(ctas / SMS) * max(k for _, k in ts) / max(sp_cl), max(us))
        total += u * tile_us
        splits += [cl.split] if cl.split > 1 else sp_cl
    return {"est_splitk_us": total / max(1, c.concurrent), "mean_split": float(np.mean(splits))}


def moved_bytes(mem: Sequence[Member], backend: str, split: int = 1, rows: int = 0) -> int:
    """Bytes a backend reads and writes for ``mem``: the padded stacks of the batched backends
    (``splitk``: depth padded to its slices, plus the partials), ``chunks``' rows padded to
    whole chunks, ``concat``'s stacked rows and whole output, each member's own operands
    otherwise."""
    isz = DTYPES[mem[0].dtype]
    if backend in ("padded", "padded_t", "pointer", "splitk"):
        M, N, K = padded_shape(mem)
        K = split * splitk_depth(K, split) if backend == "splitk" else K
        part = partial_bytes(mem, Cluster((0,), backend, split=split, rows=rows)) if split > 1 else 0
        return isz * sum(x.batch for x in mem) * (M * K + K * N + M * N) + part
    if backend == "chunks":
        _, N, K = padded_shape(mem)
        K = split * splitk_depth(K, split) if split > 1 else K
        r = sum(x.batch * -(-x.m // rows) * rows for x in mem)
        part = partial_bytes(mem, Cluster((0,), backend, split=split, rows=rows)) if split > 1 else 0
        return isz * (r * K + sum(x.batch for x in mem) * K * N + r * N) + part
    if backend == "concat":
        rows, cols = sum(x.batch * x.m for x in mem), sum(x.n for x in mem)
        return isz * (rows * mem[0].k + mem[0].k * cols + rows * cols)
    return sum(x.bytes() for x in mem)


def traffic_features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    """Memory traffic: padding a LoRA set to its largest m reads the activations many times."""
    total, us = 0, 0.0
    for cl in c.clusters:
        mem = [w.members[i] for i in cl.members]
        b = moved_bytes(mem, cl.backend, cl.split, cl.rows)
        total += b
        done = done_macs(mem, cl.backend, cl.split, cl.rows)
        us += _roofline_us(2 * done, b, mem[0].dtype) / max(1, cl.streams)
    return {"log_moved_bytes": math.log2(total), "moved_over_bytes": total / w.bytes(),
            "est_moved_us": us / max(1, c.concurrent)}


REL_KEYS = ("est_sum_us", "est_lanes_us", "est_wave_us", "est_splitk_us", "est_moved_us",
            "cand_wave_slots", "launches", "cand_tiles")
_best_estimates: dict[str, dict[str, float]] = {}  # workload hash -> REL_KEYS' minima


def _estimates(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    f = {**candidate_features(w, c), **splitk_features(w, c), **traffic_features(w, c)}
    return {k: f[k] for k in REL_KEYS}


def relative_features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    """Each estimate and size over the workload's least among all its candidates (log): a ranker
    compares candidates of one workload, and the ratio carries over between workloads of other
    scales and families where the absolute time does not (docs/packing.md, ``packing/5``)."""
    best = _best_estimates.get(w.hash)
    if best is None:
        ests = [_estimates(w, x) for x in all_candidates(w)]
        best = {k: min(e[k] for e in ests) for k in REL_KEYS}
        if len(_best_estimates) > 4096:
            _best_estimates.clear()
        _best_estimates[w.hash] = best
    own = _estimates(w, c)
    return {f"rel_{k}": math.log(own[k] / best[k]) for k in REL_KEYS}


def features(w: PackingWorkload, c: Candidate) -> dict[str, float]:
    return {**workload_features(w), **candidate_features(w, c), **layout_features(w, c),
            **splitk_features(w, c), **traffic_features(w, c), **relative_features(w, c)}


def _feature_names() -> tuple[str, ...]:
    w = PackingWorkload("x", "x", (Member(2, 2, 2),))
    return tuple(features(w, Candidate("whole", (Cluster((0,), "serial"),))))


FEATURES: tuple[str, ...] = _feature_names()

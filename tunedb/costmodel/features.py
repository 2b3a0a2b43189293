"""Cost-model features: (workload graph, candidate config, device facts) -> float32 row.

Three parts, computed at three granularities so that 100,000 candidates take seconds:
workload facts once per workload hash (``workload.py``), config facts once per distinct config
JSON text, and the interactions (launch geometry, occupancy, waves, traffic, roofline)
vectorised over rows.

Configs are fused-kernel schedules (``tunedb.kernels.schedule.Schedule.to_config``): mapping,
block, vec, unroll, group, split, tile, row_cache, cache, fast_math, grid and the stitch map. The
launch geometry below mirrors the generators (``gen_simple``, ``gen_rows``, ``gen_cols``)
without generating code. Unknown keys are ignored and missing ones take the Schedule defaults,
so featurisation never depends on a config being legal. Changing what any feature means bumps
FEATURE_SCHEMA_VERSION: models trained under another version are refused when loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tunedb.costmodel.workload import WORKLOAD_FEATURES, workload_vector
from tunedb.graph.hashing import graph_hash

# v2: the schedule's ``grid`` ("full": a block per chunk of work, no grid-stride loop) sets the
# launch geometry and the ``grid_full`` column; v1 took every config as one wave of blocks.
# v3: ``row_prefetch`` marks a register row cache whose next row streams into shared memory
# (row_cache="prefetch"); v2 featurised it as its register twin.
FEATURE_SCHEMA_VERSION: int = 3

# The generator's mappings (tunedb.kernels.schedule.MAPPINGS) plus "other" for anything else.
MAPPINGS: tuple[str, ...] = ("elementwise", "warp_per_row", "block_per_row", "rows_per_block",
                             "split_row", "col_tiled", "col_cluster", "transpose_tiled", "other")
ROW_MAPPINGS: tuple[str, ...] = ("warp_per_row", "block_per_row", "rows_per_block", "split_row")
ROW_CACHES: tuple[str, ...] = ("registers", "smem", "reread")
STITCH_SCHEMES: tuple[str, ...] = ("recompute", "register", "shuffle", "smem", "dsmem", "global")

_CONFIG_FEATURES: tuple[str, ...] = (
    "block", "vec", "unroll", "group", "split", "tile", "fast_math", "cache_inputs", "grid_full",
    "row_prefetch",
    *(f"mapping_{m}" for m in MAPPINGS),
    *(f"row_cache_{r}" for r in ROW_CACHES),
    *(f"stitch_{s}" for s in STITCH_SCHEMES),
)
_DERIVED_FEATURES: tuple[str, ...] = (
    "threads_per_row", "rows_per_block", "row_iters", "cached_values", "cache_regs", "kernels",
    "grid", "elems_per_thread", "lane_utilization", "regs_est", "smem_est", "blocks_per_sm",
    "occupancy", "waves", "wave_efficiency", "stride_iters", "stride_efficiency", "access_bytes",
    "cluster_threads", "ilp", "inflight_bytes_per_sm", "concurrency", "flops_per_byte", "trans_per_element",
    "fast_trans_per_element", "extra_bytes", "est_bytes", "traffic_ratio",
    "floor_us", "roofline_us",
    "regs_measured", "smem_measured", "local_bytes_measured", "occupancy_measured",
)
_LOG_OF: tuple[str, ...] = ("floor_bytes", "est_bytes", "flops", "transcendental_ops", "rows",
                            "row_len", "grid", "waves", "roofline_us", "elems_per_thread", "block",
                            "smem_est", "inflight_bytes_per_sm", "ilp")
FEATURE_NAMES: tuple[str, ...] = (
    *WORKLOAD_FEATURES, *_CONFIG_FEATURES, *_DERIVED_FEATURES, *(f"log2_{n}" for n in _LOG_OF))
ROOFLINE_FEATURE = "roofline_us"
# Features that exist only after a candidate was compiled; UNKNOWN when not (yet) measured.
# The trainer hides them at random so that the model also works when the planner predicts
# before compiling. A sentinel rather than NaN keeps the matrix dense: XGBoost's missing-value
# path made training on 1M rows twice as slow.
MEASURED_FEATURES: tuple[str, ...] = ("regs_measured", "smem_measured", "local_bytes_measured",
                                      "occupancy_measured")
UNKNOWN: float = -1.0
# Columns that are the same for every candidate of a workload (its facts, not the schedule's).
WORKLOAD_LEVEL_FEATURES: tuple[str, ...] = (
    *WORKLOAD_FEATURES, "flops_per_byte", "trans_per_element", "floor_us", "log2_floor_bytes", "log2_flops",
    "log2_transcendental_ops", "log2_rows", "log2_row_len")

_INDEX = {n: i for i, n in enumerate(FEATURE_NAMES)}
_BLOCK_ROWS = 65536


def feature_index(name: str) -> int:
    try:
        return _INDEX[name]
    except KeyError:
        raise ValueError(f"unknown feature {name!r}") from None


@dataclass(frozen=True)
class DeviceFacts:
    """What the features need to know about the GPU. Defaults describe an H200 (sm_90)."""

    name: str = "NVIDIA H200"
    sm_count: int = 132
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    smem_per_sm: int = 233472  # 228 KiB per SM on sm_90
    bandwidth_bytes_per_s: float = 4.2e12
    launch_us: float = 2.5

    @staticmethod
    def from_device_info(info: Any) -> DeviceFacts:
        """From a ``tunedb.records.DeviceInfo``; the per-SM limits are those of its generation."""
        return DeviceFacts(name=info.name, sm_count=int(info.sm_count))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> DeviceFacts:
        known = set(DeviceFacts.__dataclass_fields__)
        return DeviceFacts(**{k: v for k, v in d.items() if k in known})


# ---- config parsing -------------------------------------------------------------------------

# Schedule defaults (tunedb.kernels.schedule.Schedule) for keys a config leaves out.
_DEFAULTS: dict[str, float] = {"block": 256, "vec": 1, "unroll": 1, "group": 0, "split": 1, "tile": 32}


def _number(v: Any, default: float) -> float:
    if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return default
    return default


def _stitch_counts(stitch: Any) -> list[float]:
    """How many values each stitch scheme carries: "value:scheme;..." (or any JSON naming them)."""
    if isinstance(stitch, str):
        schemes = [p.rsplit(":", 1)[-1].strip().lower() for p in stitch.split(";") if p.strip()]
        return [float(schemes.count(s)) for s in STITCH_SCHEMES]
    text = json.dumps(stitch, sort_keys=True).lower()
    return [float(text.count(s)) for s in STITCH_SCHEMES]


# Schedule knobs without a feature column yet (no training rows): a config featurises as its twin
# without them.
UNFEATURISED_KNOBS: tuple[str, ...] = ("swizzle", "stream", "evict_last")


def featurised_form(cfg: Mapping[str, Any]) -> str:
    """Canonical JSON of what the features see of a config: equal for twins that differ only in
    ``UNFEATURISED_KNOBS``."""
    return json.dumps({k: v for k, v in cfg.items() if k not in UNFEATURISED_KNOBS}, sort_keys=True)


def config_vector(cfg: Mapping[str, Any]) -> np.ndarray:
    """_CONFIG_FEATURES of one candidate config, float64."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"candidate config must be a JSON object, got {type(cfg).__name__}")
    mapping = str(cfg.get("mapping", ""))
    mapping = mapping if mapping in MAPPINGS else "other"
    row_cache = str(cfg.get("row_cache", "registers"))
    # UNFEATURISED_KNOBS (``swizzle``: a transpose tile's bank-conflict-free order; ``stream``:
    # evict-first cache hints; ``evict_last``: evict-last load policies) have no training rows
    # yet: a config featurises as its plain twin until measured data lets a new schema tell them
    # apart.
    # "prefetch" keeps the row in registers like "registers" (so every derived register and
    # occupancy estimate applies) and is told apart by its own column
    prefetch = row_cache == "prefetch"
    row_cache = "registers" if prefetch else row_cache
    return np.array([
        *(max(_number(cfg.get(k), d), 0.0) for k, d in _DEFAULTS.items()),
        float(bool(cfg.get("fast_math", False))),
        float(cfg.get("cache", "boundary") == "inputs"),
        float(cfg.get("grid", "wave") == "full"),
        float(prefetch),
        *(float(mapping == m) for m in MAPPINGS),
        *(float(row_cache == r) for r in ROW_CACHES),
        *_stitch_counts(cfg.get("stitch", "")),
    ], dtype=np.float64)


def _parse_config(text: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(text, Mapping):
        return text
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot read candidate config JSON {str(text)[:60]!r}: {e}") from None


# ---- assembly -------------------------------------------------------------------------------

def _nan_array(values: Sequence[Any] | np.ndarray | None, n: int) -> np.ndarray:
    """Measured resource facts as float64; None, NaN or negative (the records' -1) -> NaN."""
    if values is None:
        return np.full(n, np.nan)
    a = np.array([np.nan if v is None else v for v in values], dtype=np.float64) \
        if not isinstance(values, np.ndarray) else values.astype(np.float64)
    if len(a) != n:
        raise ValueError(f"resource column has {len(a)} values for {n} candidates")
    return np.where(a < 0, np.nan, a)


def _blocks_per_sm(block: np.ndarray, regs: np.ndarray, smem: np.ndarray, dev: DeviceFacts) -> np.ndarray:
    """Resident blocks per SM from the thread, register (allocated per warp in units of 256)
    and shared-memory limits."""
    warps = np.ceil(block / 32.0)
    regs_per_warp = np.ceil(np.maximum(regs, 1.0) * 32.0 / 256.0) * 256.0
    by_threads = np.floor(dev.max_threads_per_sm / block)
    by_regs = np.floor(dev.regs_per_sm / (regs_per_warp * warps))
    by_smem = np.where(smem > 0, np.floor(dev.smem_per_sm / (smem + 1024.0)), np.inf)
    return np.clip(np.minimum(np.minimum(by_threads, by_regs), np.minimum(by_smem, dev.max_blocks_per_sm)),
                   0.0, None)


def assemble(wl: np.ndarray, cf: np.ndarray, dev: DeviceFacts, registers: np.ndarray,
             shared: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Rows of workload facts ``wl`` and config facts ``cf`` (already gathered per candidate)
    plus measured resources -> the float32 feature matrix in FEATURE_NAMES order."""
    w = {n: wl[:, i] for i, n in enumerate(WORKLOAD_FEATURES)}
    c = {n: cf[:, i] for i, n in enumerate(_CONFIG_FEATURES)}
    one = np.ones(len(wl))
    R, C = np.maximum(w["rows"], 1.0), np.maximum(w["row_len"], 1.0)
    B = np.clip(c["block"], 1.0, 1024.0)
    V, U, S = np.maximum(c["vec"], 1.0), np.maximum(c["unroll"], 1.0), np.maximum(c["split"], 1.0)
    tile = np.maximum(c["tile"], 1.0)
    m = {name: c[f"mapping_{name}"] > 0 for name in MAPPINGS}
    rowmap = m["warp_per_row"] | m["block_per_row"] | m["rows_per_block"] | m["split_row"]
    colmap = m["col_tiled"] | m["col_cluster"]
    n_row_red, n_col_red = w["n_row_reductions"], w["n_col_reductions"]
    cluster = np.where(m["split_row"] | m["col_cluster"], S, 1.0)  # blocks of one thread-block cluster

    # Threads per row (row mappings) or across columns (column mappings), rows per block, and
    # the iterations one thread makes along the row (row mappings; a split row spans the
    # cluster) or down its rows (column mappings).
    T = np.select([m["warp_per_row"], m["block_per_row"] | m["split_row"], m["rows_per_block"] | colmap],
                  [32.0 * one, B, np.maximum(c["group"], 1.0)], default=B)
    T = np.minimum(T, B)
    G = np.where(rowmap | colmap, np.maximum(np.floor(B / T), 1.0), 1.0)
    col_rows = np.where(m["col_tiled"], np.ceil(R / S), np.ceil(R / cluster))  # rows one block sweeps
    nit = np.select([rowmap, colmap], [np.ceil(C / (T * cluster * V)), np.ceil(col_rows / G)], default=0.0)
    cached_vals = np.where(c["cache_inputs"] > 0, w["n_cache_inputs"], w["n_cache_boundary"])
    cached_vals = np.where((rowmap & (c["row_cache_reread"] == 0)) | m["col_cluster"],
                           np.nan_to_num(cached_vals), 0.0)
    eb = np.nan_to_num(w["vec_elem_bytes"], nan=4.0)
    full_inputs = np.maximum(np.round(w["full_in_bytes"] / (R * C * eb)), 1.0)  # full-size arrays read
    cache_regs = np.select(
        [rowmap, m["col_cluster"]],
        [nit * V * (cached_vals * (c["row_cache_registers"] > 0) + n_col_red),
         nit * V * np.maximum(cached_vals, full_inputs)], default=0.0)

    # Shared memory per block, as the generators size it.
    strip = T * V
    smem = np.select(
        [rowmap, m["col_tiled"], m["col_cluster"], m["transpose_tiled"]],
        [np.where(T > 32, np.ceil(132.0 * np.maximum(n_row_red, 1.0) / 16.0) * 16.0, 0.0)
         + np.where(c["row_cache_smem"] > 0, 4.0 * G * cached_vals * nit * V * T, 0.0) + 4.0 * n_col_red * C,
         4.0 * (n_col_red * G * strip + n_col_red * strip),
         4.0 * (n_col_red * G * strip + 2.0 * n_col_red * strip),
         4.0 * tile * (tile + 1.0) * np.nan_to_num(w["n_transposed_inputs"])],
        default=0.0)
    regs = np.minimum(255.0, 28.0 + cache_regs + 2.0 * V * U + 2.0 * w["n_transcendental_nodes"])
    bps = _blocks_per_sm(B, regs, smem, dev)
    resident = dev.sm_count * np.maximum(bps, 1.0)

    # Launch geometry: grid-stride kernels are capped at one resident wave by the generators
    # unless the schedule asks for a full grid (a block, or a cluster, per chunk of work);
    # a split row takes a whole cluster of blocks.
    work = R * C
    full = c["grid_full"] > 0
    ew_blocks = np.ceil(work / (V * B * U))
    one_wave = dev.sm_count * np.maximum(np.floor(2048.0 / B), 1.0)
    ew_grid = np.where(full, ew_blocks, np.minimum(ew_blocks, one_wave))
    # Row kernels size their wave by threads and shared memory only (gen_rows): with many
    # registers a second, partial wave follows.
    row_resident = dev.sm_count * np.maximum(1.0, np.minimum(np.floor(dev.max_threads_per_sm / B),
                                                            np.floor(dev.smem_per_sm / (smem + 1024.0))))
    clusters = np.where(full, R, np.maximum(1.0, np.minimum(R, np.floor(row_resident / cluster))))
    row_grid = np.where(m["split_row"], cluster * clusters,
                        np.where(full, np.ceil(R / G), np.minimum(np.ceil(R / G), row_resident)))
    gx = np.ceil(C / strip)
    grid = np.select([m["elementwise"], rowmap, colmap, m["transpose_tiled"]],
                     [ew_grid, row_grid, gx * S, np.ceil(C / tile) * np.ceil(R / tile)],
                     default=np.ceil(work / (V * B)))
    grid = np.maximum(grid, 1.0)
    # A second kernel combines column partials that went through global memory.
    kernels = 1.0 + ((m["col_tiled"] & (S > 1)) | (rowmap & (n_col_red > 0))).astype(np.float64)
    ept = work / (grid * B)
    # Lanes that find no element in the last iteration of a row (or strip of columns) idle.
    lane = np.select([rowmap, colmap], [C / np.maximum(nit * T * cluster * V, 1.0), C / (gx * strip)],
                     default=1.0)
    occ = bps * B / dev.max_threads_per_sm
    waves = grid / resident
    wave_eff = waves / np.ceil(np.maximum(waves, 1e-9))
    # Grid-stride loops: trips per block, and how evenly the last trip is filled.
    units = np.select([m["elementwise"], rowmap], [np.ceil(work / (V * B * U)), np.ceil(R / G) * cluster],
                      default=grid)
    stride = np.ceil(units / grid)
    stride_eff = units / (grid * np.maximum(stride, 1.0))
    # Little's law: HBM needs enough bytes in flight per SM to hide its latency.
    # Independent loads a thread issues before it needs their data: the unroll of a grid-stride
    # or column sweep, the fully unrolled row of a row kernel, the rows a col_cluster thread keeps.
    access = V * eb
    ilp = np.select([m["elementwise"] | m["col_tiled"], rowmap | m["col_cluster"]], [U, np.maximum(nit, 1.0)],
                    default=1.0)
    blocks_on_sm = np.minimum(bps, np.ceil(grid / dev.sm_count))
    inflight = blocks_on_sm * B * access * ilp * full_inputs
    concurrency = np.minimum(grid, resident) * B / (dev.sm_count * dev.max_threads_per_sm)
    elems = np.maximum(w["domain_elements"], 1.0)
    flops_per_byte = w["flops"] / np.maximum(w["floor_bytes"], 1.0)
    trans_per_elem = w["transcendental_ops"] / elems

    regs_m = _nan_array(registers, len(wl))
    smem_m = _nan_array(shared, len(wl))
    local_m = _nan_array(local, len(wl))
    occ_m = np.where(np.isfinite(regs_m), _blocks_per_sm(B, np.nan_to_num(regs_m, nan=32.0),
                                                         np.nan_to_num(smem_m, nan=0.0), dev)
                     * B / dev.max_threads_per_sm, np.nan)
    regs_m, smem_m, local_m, occ_m = (np.where(np.isnan(v), UNKNOWN, v)
                                      for v in (regs_m, smem_m, local_m, occ_m))

    # Bytes beyond the floor: re-reading the full-size inputs for every later pass when the row
    # is not cached (row mappings) or for every later level / post sweep (col_tiled), and the
    # column partials written and read back through global memory.
    full_in = w["full_in_bytes"]
    row_rereads = np.where(c["row_cache_reread"] > 0, np.nan_to_num(w["row_levels"]), 0.0)
    col_rereads = np.where(S > 1, 0.0, np.maximum(np.nan_to_num(w["col_levels"]) - 1.0, 0.0)) \
        + np.nan_to_num(w["has_post_col_outputs"])
    partials = np.select([m["col_tiled"] & (S > 1), rowmap & (n_col_red > 0)],
                         [8.0 * n_col_red * S * C, 8.0 * n_col_red * row_grid * C], default=0.0)
    # (col_cluster keeps its rows in registers: it reads the input once, like a cached row.)
    extra = np.select([rowmap, m["col_tiled"]], [row_rereads * full_in, col_rereads * full_in], default=0.0) \
        + partials
    est = w["floor_bytes"] + extra
    floor_us = w["floor_bytes"] / dev.bandwidth_bytes_per_s * 1e6
    roofline = est / dev.bandwidth_bytes_per_s * 1e6 + kernels * dev.launch_us

    derived = {
        "threads_per_row": T, "rows_per_block": G, "row_iters": nit, "cached_values": cached_vals,
        "cache_regs": cache_regs, "kernels": kernels, "grid": grid, "elems_per_thread": ept,
        "lane_utilization": lane, "regs_est": regs, "smem_est": smem, "blocks_per_sm": bps,
        "occupancy": occ, "waves": waves, "wave_efficiency": wave_eff, "stride_iters": stride,
        "stride_efficiency": stride_eff, "access_bytes": access, "cluster_threads": cluster * B, "ilp": ilp,
        "inflight_bytes_per_sm": inflight,
        "concurrency": concurrency, "flops_per_byte": flops_per_byte, "trans_per_element": trans_per_elem,
        "fast_trans_per_element": trans_per_elem * c["fast_math"],
        "extra_bytes": extra,
        "est_bytes": est, "traffic_ratio": est / np.maximum(w["floor_bytes"], 1.0), "floor_us": floor_us,
        "roofline_us": roofline, "regs_measured": regs_m, "smem_measured": smem_m,
        "local_bytes_measured": local_m, "occupancy_measured": occ_m,
    }
    every = {**w, **c, **derived}
    cols = [wl, cf, np.stack([derived[n] for n in _DERIVED_FEATURES], axis=1),
            np.stack([np.log2(1.0 + np.maximum(every[n], 0.0)) for n in _LOG_OF], axis=1)]
    return np.concatenate(cols, axis=1).astype(np.float32)


def _encode(values: Any) -> tuple[list[Any], np.ndarray]:
    """(distinct values, index of each row's value), via Arrow's hash table (fast for 1M rows)."""
    arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, type=pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if arr.null_count:
        raise ValueError("a workload hash or config is missing (null)")
    enc = arr.dictionary_encode()
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _measured(values: Any, n: int) -> np.ndarray:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
    return _nan_array(values, n)


def _featurize(hashes: Any, graph_of: Any, configs: Any, device: DeviceFacts | None,
               registers: Any, shared_bytes: Any, local_bytes: Any) -> np.ndarray:
    """Shared core: ``graph_of(row)`` gives the graph of a row; it is called once per workload."""
    dev = device or DeviceFacts()
    wl_keys, wl_idx = _encode(hashes)
    n = len(wl_idx)
    if len(configs) != n:
        raise ValueError(f"featurize got {n} workload hashes but {len(configs)} configs")
    if n == 0:
        return np.zeros((0, len(FEATURE_NAMES)), dtype=np.float32)
    _, first = np.unique(wl_idx, return_index=True)
    wl = np.stack([workload_vector(graph_of(int(r)), str(wl_keys[k])) for k, r in enumerate(first)])
    if not isinstance(configs, (pa.Array, pa.ChunkedArray)):
        configs = [c if isinstance(c, str) else json.dumps(c, sort_keys=True) for c in configs]
    cf_keys, cf_idx = _encode(configs)
    cf = np.stack([config_vector(_parse_config(k)) for k in cf_keys])
    regs, smem, local = _measured(registers, n), _measured(shared_bytes, n), _measured(local_bytes, n)
    # Row blocks bound the float64 temporaries: the float32 result is the only full-size array.
    out = np.empty((n, len(FEATURE_NAMES)), dtype=np.float32)
    for lo in range(0, n, _BLOCK_ROWS):
        sl = slice(lo, lo + _BLOCK_ROWS)
        out[sl] = assemble(wl[wl_idx[sl]], cf[cf_idx[sl]], dev, regs[sl], smem[sl], local[sl])
    return out


def featurize(graphs: Sequence[Any] | Mapping[str, Any], workload_hashes: Sequence[str],
              configs: Sequence[Any], device: DeviceFacts | None = None, registers: Any = None,
              shared_bytes: Any = None, local_bytes: Any = None) -> np.ndarray:
    """Feature matrix (n, len(FEATURE_NAMES)), float32. ``graphs`` is one graph per row, or a
    mapping workload hash -> graph; a graph is a Graph, its JSON dict or its JSON text.
    ``configs[i]`` is a config dict or its JSON text. Workloads are analysed once per hash and
    configs parsed once per distinct text. Measured resources: None / NaN / -1 mean unknown."""
    hashes = [str(h) for h in workload_hashes]
    if isinstance(graphs, Mapping):
        missing = sorted(set(hashes) - set(graphs))
        if missing:
            raise ValueError(f"no graph given for workload {missing[0]}")
        return _featurize(hashes, lambda r: graphs[hashes[r]], configs, device,
                          registers, shared_bytes, local_bytes)
    if len(graphs) != len(hashes):
        raise ValueError(f"featurize got {len(graphs)} graphs for {len(hashes)} workload hashes")
    return _featurize(hashes, lambda r: graphs[r], configs, device, registers, shared_bytes, local_bytes)


def featurize_frame(frame: Any, device: DeviceFacts | None = None,
                    graphs: Mapping[str, Any] | None = None) -> np.ndarray:
    """Features for a training frame (pyarrow Table) with at least workload_hash, config_json
    and graph_json, or without graph_json given ``graphs`` (workload hash -> graph or its JSON;
    the store's ``training_frame(include_graph=False)`` saves repeating it on every row).
    registers/shared_bytes/local_bytes are used when present."""
    if not isinstance(frame, pa.Table):
        frame = pa.table(frame)
    cols = set(frame.column_names)
    need = ("workload_hash", "config_json") + (() if graphs is not None else ("graph_json",))
    missing = [c for c in need if c not in cols]
    if missing:
        raise ValueError(f"frame lacks column(s) {', '.join(missing)} needed for features")
    hashes = frame["workload_hash"]
    if graphs is not None:
        def graph_of(r: int) -> Any:
            h = hashes[r].as_py()
            if h not in graphs:
                raise ValueError(f"no graph given for workload {h}")
            return graphs[h]
    else:
        gcol = frame["graph_json"]  # only one graph_json per workload is ever read

        def graph_of(r: int) -> Any:
            return gcol[r].as_py()
    resources = (frame[c] if c in cols else None for c in ("registers", "shared_bytes", "local_bytes"))
    return _featurize(hashes, graph_of, frame["config_json"], device, *resources)


def featurize_candidates(graph: Any, configs: Sequence[Mapping[str, Any]], device: DeviceFacts | None = None,
                         workload_hash: str | None = None) -> np.ndarray:
    """Features for many candidate configs of one workload (the planner's query)."""
    if workload_hash is None:
        workload_hash = graph_hash(graph)
    return featurize({workload_hash: graph}, [workload_hash] * len(configs), list(configs), device)

"""Cost-model features: (workload graph, candidate config, device facts) -> float32 row.

Three parts, computed at three granularities so that 100,000 candidates take seconds:
workload facts once per workload hash (``workload.py``), config facts once per distinct config
JSON text, and the interactions (grid, waves, occupancy, traffic, roofline) vectorised over rows.

Configs are read generically (known key spellings, substring classes for the mapping and the
stitch schemes) so that a new schedule field does not break featurisation; anything the schema
does not name is ignored. Changing what any feature means bumps FEATURE_SCHEMA_VERSION: models
trained under another version are refused when loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tunedb.costmodel.workload import WORKLOAD_FEATURES, workload_vector

FEATURE_SCHEMA_VERSION: int = 1

MAPPINGS: tuple[str, ...] = ("elementwise", "thread_row", "warp_row", "block_row", "split_row",
                             "column", "other")
STITCH_SCHEMES: tuple[str, ...] = ("register", "warp", "shared", "global")

_CONFIG_FEATURES: tuple[str, ...] = (
    "block", "vec", "unroll", "row_cache", "split", "kernels",
    *(f"mapping_{m}" for m in MAPPINGS),
    *(f"stitch_{s}" for s in STITCH_SCHEMES),
)
_DERIVED_FEATURES: tuple[str, ...] = (
    "threads_per_row", "rows_per_block", "grid", "elems_per_thread", "lane_utilization",
    "regs_est", "smem_est", "blocks_per_sm", "occupancy", "waves", "wave_efficiency",
    "est_bytes", "traffic_ratio", "floor_us", "roofline_us",
    "regs_measured", "smem_measured", "local_bytes_measured", "occupancy_measured",
)
_LOG_OF: tuple[str, ...] = ("floor_bytes", "est_bytes", "flops", "transcendental_ops", "rows",
                            "row_len", "max_reduction_len", "grid", "waves", "roofline_us",
                            "elems_per_thread", "block")
FEATURE_NAMES: tuple[str, ...] = (
    *WORKLOAD_FEATURES, *_CONFIG_FEATURES, *_DERIVED_FEATURES, *(f"log2_{n}" for n in _LOG_OF))
ROOFLINE_FEATURE = "roofline_us"
# Features that exist only after a candidate was compiled; the trainer masks them at random so
# that the model also works (NaN = missing) when the planner predicts before compiling.
MEASURED_FEATURES: tuple[str, ...] = ("regs_measured", "smem_measured", "local_bytes_measured",
                                      "occupancy_measured")

_INDEX = {n: i for i, n in enumerate(FEATURE_NAMES)}


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
    smem_per_sm: int = 233472  # 228 KiB usable per SM on sm_90
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

_KEYS = {
    "block": ("block", "block_size", "threads", "block_threads", "num_threads"),
    "vec": ("vec", "vector", "vector_width", "vec_width", "vectorize"),
    "unroll": ("unroll", "unroll_factor"),
    "row_cache": ("row_cache", "cache_row", "cache"),
    "split": ("split", "splits", "blocks_per_row", "split_k", "split_rows", "num_splits"),
    "kernels": ("kernels", "num_kernels", "launches", "n_kernels"),
    "rows_per_block": ("rows_per_block", "rows_per_cta"),
    "grid": ("grid", "grid_size", "blocks"),
}


def _number(v: Any, default: float) -> float:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
        return float(np.prod(v))  # block=(x, y, z)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("", "none", "off", "false", "no"):
            return 0.0
        if s in ("on", "true", "yes", "register", "registers", "shared", "smem"):
            return 1.0
        try:
            return float(s)
        except ValueError:
            return default
    if isinstance(v, Mapping):
        return float(bool(v))
    return default


def _lookup(cfg: Mapping[str, Any], field: str, default: float) -> float:
    for k in _KEYS[field]:
        if k in cfg:
            return _number(cfg[k], default)
    return default


def mapping_class(value: Any) -> str:
    """Map a schedule's mapping name onto MAPPINGS by substring (robust to spelling)."""
    s = str(value or "").lower()
    if not s:
        return "other"
    if "elem" in s or "flat" in s or "pointwise" in s or "1d" in s:
        return "elementwise"
    if "col" in s or "tile" in s or "transpose" in s:
        return "column"
    if "split" in s or "multi" in s or "grid" in s or "cluster" in s:
        return "split_row"
    if "thread" in s:
        return "thread_row"
    if "warp" in s:
        return "warp_row"
    if "block" in s or "cta" in s:
        return "block_row"
    return "other"


def _stitch_counts(cfg: Mapping[str, Any]) -> list[float]:
    """How often each stitch scheme is named under any key containing 'stitch'."""
    text = " ".join(json.dumps(v, sort_keys=True).lower() for k, v in cfg.items() if "stitch" in k.lower())
    return [
        float(text.count("reg")),
        float(text.count("warp") + text.count("shuffle")),
        float(text.count("shared") + text.count("smem")),
        float(text.count("global")),
    ]


def config_vector(cfg: Mapping[str, Any]) -> np.ndarray:
    """_CONFIG_FEATURES plus explicit rows_per_block / grid (NaN when absent) as float64."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"candidate config must be a JSON object, got {type(cfg).__name__}")
    mapping = mapping_class(cfg.get("mapping", cfg.get("map", cfg.get("strategy", ""))))
    stitch = _stitch_counts(cfg)
    kernels = _lookup(cfg, "kernels", float("nan"))
    if not np.isfinite(kernels):
        kernels = 1.0 + stitch[3]  # a global stitch splits the fusion at a grid-wide barrier
    return np.array([
        max(_lookup(cfg, "block", 256.0), 1.0),
        max(_lookup(cfg, "vec", 1.0), 1.0),
        max(_lookup(cfg, "unroll", 1.0), 1.0),
        _lookup(cfg, "row_cache", 0.0),
        max(_lookup(cfg, "split", 1.0), 1.0),
        max(kernels, 1.0),
        *(float(mapping == m) for m in MAPPINGS),
        *stitch,
        _lookup(cfg, "rows_per_block", float("nan")),
        _lookup(cfg, "grid", float("nan")),
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
    """Measured resource facts: None, NaN or negative (the records' -1) all mean unknown."""
    if values is None:
        return np.full(n, np.nan)
    a = np.array([np.nan if v is None else v for v in values], dtype=np.float64) \
        if not isinstance(values, np.ndarray) else values.astype(np.float64)
    if len(a) != n:
        raise ValueError(f"resource column has {len(a)} values for {n} candidates")
    return np.where(a < 0, np.nan, a)


def _occupancy(block: np.ndarray, regs: np.ndarray, smem: np.ndarray, dev: DeviceFacts) -> np.ndarray:
    """Resident blocks per SM from the thread, register (allocated per warp in units of 256)
    and shared-memory limits."""
    warps = np.ceil(block / 32.0)
    regs_per_warp = np.ceil(np.maximum(regs, 1.0) * 32.0 / 256.0) * 256.0
    by_threads = np.floor(dev.max_threads_per_sm / np.maximum(block, 1.0))
    by_regs = np.floor(dev.regs_per_sm / (regs_per_warp * warps))
    by_smem = np.where(smem > 0, np.floor(dev.smem_per_sm / np.maximum(smem + 1024.0, 1.0)), np.inf)
    return np.clip(np.minimum(np.minimum(by_threads, by_regs), np.minimum(by_smem, dev.max_blocks_per_sm)),
                   0.0, None)


def assemble(wl: np.ndarray, cf: np.ndarray, dev: DeviceFacts, registers: np.ndarray,
             shared: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Rows of workload facts ``wl`` and config facts ``cf`` (already gathered per candidate)
    plus measured resources -> the float32 feature matrix in FEATURE_NAMES order."""
    w = {n: wl[:, i] for i, n in enumerate(WORKLOAD_FEATURES)}
    c = {n: cf[:, i] for i, n in enumerate(_CONFIG_FEATURES)}
    rows_given, grid_given = cf[:, len(_CONFIG_FEATURES)], cf[:, len(_CONFIG_FEATURES) + 1]
    R, C, dsz = w["rows"], w["row_len"], w["dtype_bytes"]
    block, vec, unroll, split = c["block"], c["vec"], c["unroll"], c["split"]
    m = {name: c[f"mapping_{name}"] > 0 for name in MAPPINGS}
    flat = m["elementwise"] | m["other"]

    tpr = np.select([m["thread_row"], m["warp_row"], m["block_row"], m["split_row"]],
                    [np.ones_like(block), np.full_like(block, 32.0), block, block * split], default=block)
    rpb = np.where(np.isfinite(rows_given) & (rows_given > 0), rows_given, np.maximum(np.floor(block / tpr), 1.0))
    work = np.maximum(R * C, 1.0)
    grid = np.select(
        [flat, m["column"]],
        [np.ceil(work / (block * vec * unroll)), np.ceil(C / (block * vec)) * split],
        default=np.ceil(R / rpb) * np.where(m["split_row"], split, 1.0))
    grid = np.where(np.isfinite(grid_given) & (grid_given > 0), grid_given, np.maximum(grid, 1.0))
    ept = work / (grid * block)
    # Threads of a row that find no element (a warp on a 16-wide row) are wasted lanes.
    lane = np.where(flat | m["column"], 1.0, np.minimum(1.0, C / np.maximum(tpr * vec, 1.0)))

    cached = c["row_cache"] > 0
    row_elems_per_thread = np.ceil(C / np.maximum(tpr, 1.0))
    regs_est = np.minimum(255.0, 24.0 + 4.0 * vec * unroll
                          + np.where(cached, row_elems_per_thread * dsz / 4.0, 0.0)
                          + 4.0 * w["n_transcendental_nodes"])
    smem_est = (c["stitch_shared"] * rpb * C * dsz
                + np.where(m["block_row"] | m["split_row"], np.ceil(block / 32.0) * 8.0, 0.0))
    bps = _occupancy(block, regs_est, smem_est, dev)
    occ = bps * block / dev.max_threads_per_sm
    waves = grid / (dev.sm_count * np.maximum(bps, 1.0))
    wave_eff = waves / np.ceil(np.maximum(waves, 1e-9))

    regs_m = _nan_array(registers, len(wl))
    smem_m = _nan_array(shared, len(wl))
    local_m = _nan_array(local, len(wl))
    occ_m = np.where(np.isfinite(regs_m),
                     _occupancy(block, np.nan_to_num(regs_m, nan=32.0), np.nan_to_num(smem_m, nan=0.0), dev)
                     * block / dev.max_threads_per_sm, np.nan)

    # Bytes the candidate really moves: the floor, plus re-reading the main input for every
    # reduction pass after the first when the row is not cached, plus a write and a read of the
    # domain for every global stitch (the intermediate goes through HBM).
    rereads = np.where(cached, 0.0, np.maximum(w["reduction_passes"], 0.0)) * w["main_bytes"]
    est = w["floor_bytes"] + rereads + c["stitch_global"] * 2.0 * work * dsz
    floor_us = w["floor_bytes"] / dev.bandwidth_bytes_per_s * 1e6
    roofline = est / dev.bandwidth_bytes_per_s * 1e6 + c["kernels"] * dev.launch_us

    derived = {
        "threads_per_row": tpr, "rows_per_block": rpb, "grid": grid, "elems_per_thread": ept,
        "lane_utilization": lane, "regs_est": regs_est, "smem_est": smem_est, "blocks_per_sm": bps,
        "occupancy": occ, "waves": waves, "wave_efficiency": wave_eff, "est_bytes": est,
        "traffic_ratio": est / np.maximum(w["floor_bytes"], 1.0), "floor_us": floor_us,
        "roofline_us": roofline, "regs_measured": regs_m, "smem_measured": smem_m,
        "local_bytes_measured": local_m, "occupancy_measured": occ_m,
    }
    every = {**w, **c, **derived}
    cols = [wl, cf[:, :len(_CONFIG_FEATURES)], np.stack([derived[n] for n in _DERIVED_FEATURES], axis=1),
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
    return assemble(wl[wl_idx], cf[cf_idx], dev, _measured(registers, n), _measured(shared_bytes, n),
                    _measured(local_bytes, n))


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


def featurize_frame(frame: Any, device: DeviceFacts | None = None) -> np.ndarray:
    """Features for a training frame (pyarrow Table) with at least workload_hash, graph_json,
    config_json; registers/shared_bytes/local_bytes are used when present."""
    if not isinstance(frame, pa.Table):
        frame = pa.table(frame)
    cols = set(frame.column_names)
    missing = [c for c in ("workload_hash", "graph_json", "config_json") if c not in cols]
    if missing:
        raise ValueError(f"frame lacks column(s) {', '.join(missing)} needed for features")
    # Only one graph_json per workload is ever read: the column repeats it on every row.
    gcol = frame["graph_json"]
    return _featurize(frame["workload_hash"], lambda r: gcol[r].as_py(), frame["config_json"], device,
                      *(frame[c] if c in cols else None for c in ("registers", "shared_bytes", "local_bytes")))


def featurize_candidates(graph: Any, configs: Sequence[Mapping[str, Any]], device: DeviceFacts | None = None,
                         workload_hash: str | None = None) -> np.ndarray:
    """Features for many candidate configs of one workload (the planner's query)."""
    if workload_hash is None:
        from tunedb.graph.hashing import graph_hash

        workload_hash = graph_hash(graph)
    return featurize({workload_hash: graph}, [workload_hash] * len(configs), list(configs), device)

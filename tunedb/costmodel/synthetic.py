"""Synthetic training frames: real fusion graphs and schedule configs, made-up latencies.

Used by the tests and the training benchmark before (and besides) real GPU data. The latency is
a hidden, deterministic function of the candidate (bandwidth efficiency that depends on
occupancy, vector width, wasted lanes and wave quantisation, plus launches, arithmetic and spill
penalties) with log-normal noise: learnable from the features, but not by the roofline alone.
The frame has the columns of ``TuningStore.training_frame``.
"""

from __future__ import annotations

import functools
import itertools
import json

import numpy as np
import pyarrow as pa

from tunedb.costmodel.features import FEATURE_NAMES, DeviceFacts, featurize
from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import Graph
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.schedule import schedule_space
from tunedb.kernels.suites import BUILDERS
from tunedb.records import sha256_hex

FAMILIES: tuple[str, ...] = tuple(BUILDERS)

# Mappings a pattern can take (as in tunedb.kernels.schedule.check).
_PATTERN_MAPPINGS = {"elementwise": ("elementwise",), "transpose": ("transpose_tiled", "elementwise"),
                     "row_reduce": ("warp_per_row", "block_per_row", "rows_per_block"),
                     "multi": ("warp_per_row", "block_per_row", "rows_per_block"),
                     "col_reduce": ("col_tiled",)}


def make_graph(family: str, rows: int, cols: int, dtype: str, rng: np.random.Generator) -> Graph:
    """One workload graph of ``family`` (a random variant) over a [rows, cols] tensor."""
    try:
        build, variants = BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown synthetic family {family!r}; "
                         f"expected one of {', '.join(FAMILIES)}") from None
    return build(rows, cols, dtype, str(rng.choice(variants)))


@functools.cache
def _grid_configs(pattern: str) -> tuple[str, ...]:
    """Every combination of schedule fields a pattern's mappings use, as config JSON; legal or
    not (features do not need legality, and the benchmark needs many candidates per workload)."""
    out = []
    for mapping in _PATTERN_MAPPINGS[pattern]:
        groups = {"rows_per_block": (4, 8, 16), "col_tiled": (8, 16, 32)}.get(mapping, (0,))
        caches = ("registers", "smem", "reread") if mapping in ("warp_per_row", "block_per_row",
                                                               "rows_per_block") else ("registers",)
        tiles = (32, 64) if mapping == "transpose_tiled" else (32,)
        for block, vec, unroll, group, rc, tile, fast in itertools.product(
                (64, 128, 256, 512, 1024), (1, 2, 4, 8), (1, 2, 4), groups, caches, tiles, (False, True)):
            for split in ((1, 2, 4, 8) if mapping == "col_tiled" else (1,)):
                out.append(json.dumps({"mapping": mapping, "block": block, "vec": vec, "unroll": unroll,
                                       "group": group, "split": split, "row_cache": rc, "tile": tile,
                                       "fast_math": fast}, sort_keys=True))
    return tuple(out)


def _configs(g: Graph, legal_only: bool, sm_count: int) -> tuple[str, ...]:
    if legal_only:
        return tuple(json.dumps(s.to_config(), sort_keys=True) for s in schedule_space(g, sm_count)[0])
    return _grid_configs(analyze(g).pattern)


def hidden_latency_us(X: np.ndarray, dev: DeviceFacts, rng: np.random.Generator,
                      noise: float = 0.03) -> np.ndarray:
    """The synthetic ground truth, from the features of each candidate."""
    class _Cols(dict):  # columns as float64 on first use only (1M rows x 100 features is big)
        def __missing__(self, name: str) -> np.ndarray:
            v = self[name] = X[:, FEATURE_NAMES.index(name)].astype(np.float64)
            return v

    f = _Cols()
    access = np.minimum(f["vec"] * f["dtype_bytes"], 16.0)
    eff = (np.minimum(1.0, 0.3 + 0.7 * np.sqrt(f["occupancy"]))
           * (0.55 + 0.45 * access / 16.0)
           * np.power(np.clip(f["lane_utilization"], 0.05, 1.0), 0.7)
           * (0.6 + 0.4 * f["wave_efficiency"] ** 0.5))
    t_mem = f["est_bytes"] / (dev.bandwidth_bytes_per_s * eff) * 1e6
    t_alu = (f["flops"] / 4e13 + f["transcendental_ops"] / 4e12) * 1e6 / np.maximum(f["occupancy"], 0.1)
    spill = np.where(f["regs_est"] > 128, 1.0 + (f["regs_est"] - 128) / 128.0, 1.0)
    launches = f["kernels"] * dev.launch_us
    small_grid = np.where(f["grid"] < dev.sm_count, 1.0 + 0.5 * (1 - f["grid"] / dev.sm_count), 1.0)
    t = (launches + np.maximum(t_mem, t_alu) + 0.2 * np.minimum(t_mem, t_alu)) * spill * small_grid
    return t * np.exp(rng.normal(0.0, noise, len(t)))


def synthetic_frame(n_workloads: int = 60, candidates_per_workload: int = 40, seed: int = 0,
                    families: tuple[str, ...] = FAMILIES, device: DeviceFacts | None = None,
                    fail_fraction: float = 0.02, noise: float = 0.03, legal_only: bool = True) -> pa.Table:
    """A training frame of ``n_workloads`` workloads (round-robin over ``families``, random
    shapes and dtypes) with up to ``candidates_per_workload`` schedules each: the legal ones of
    ``schedule_space`` (``legal_only``), else any combination of schedule fields.
    graph_json is dictionary-encoded (it repeats on every row of a workload)."""
    dev = device or DeviceFacts()
    rng = np.random.default_rng(seed)
    graphs: list[str] = []
    hashes: list[str] = []
    meta: list[tuple[str, str]] = []
    wl_rows: list[np.ndarray] = []
    cfg_rows: list[str] = []
    seen: set[str] = set()
    for w in range(n_workloads):
        family = families[w % len(families)]
        for _ in range(50):  # draw until the workload is new (hashes are unique) and supported
            rows = int(rng.integers(1, 2 ** int(rng.integers(4, 16)) + 1))
            cols = int(rng.integers(16, 2 ** int(rng.integers(6, 15)) + 1))
            if rng.random() < 0.5:  # half the shapes are the usual multiples of 32
                rows, cols = max(32, rows // 32 * 32), max(32, cols // 32 * 32)
            dtype = str(rng.choice(("float32", "float16", "bfloat16")))
            if rows * cols > 2 ** 25:
                continue
            g = make_graph(family, rows, cols, dtype, rng)
            h = graph_hash(g)
            if h in seen:
                continue
            try:
                configs = _configs(g, legal_only, dev.sm_count)
            except UnsupportedFusion:
                continue
            if configs:
                break
        else:
            raise ValueError(f"could not draw a new supported {family} workload")
        seen.add(h)
        pick = rng.choice(len(configs), size=min(candidates_per_workload, len(configs)), replace=False)
        graphs.append(json.dumps(g.to_json(), sort_keys=True))
        hashes.append(h)
        meta.append((family, g.name))
        wl_rows.append(np.full(len(pick), len(graphs) - 1))
        cfg_rows.extend(configs[i] for i in pick)
    widx = np.concatenate(wl_rows)
    n = len(widx)
    X = featurize(dict(zip(hashes, graphs)), [hashes[i] for i in widx], cfg_rows, dev)
    lat = hidden_latency_us(X, dev, rng, noise)
    regs_est = X[:, FEATURE_NAMES.index("regs_est")]
    regs = np.minimum(255, np.round(regs_est + rng.integers(-4, 5, n))).astype(np.int32)
    smem = X[:, FEATURE_NAMES.index("smem_est")].astype(np.int64)
    local = np.where(regs >= 200, 64, 0).astype(np.int64)
    failed = rng.random(n) < fail_fraction
    status = np.where(failed, "compile_error", "ok")
    lat_or_null = pa.array(np.where(failed, np.nan, lat), mask=failed)
    cand = [sha256_hex(hashes[w] + c) for w, c in zip(widx, cfg_rows)]
    dev_id = sha256_hex(dev.name)[:16]
    idx = pa.array(widx.astype(np.int32))
    zeros = pa.array(np.zeros(n, dtype=np.int32))

    def per_workload(values: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(idx, pa.array(values)).dictionary_decode()

    def constant(value: str) -> pa.Array:
        return pa.DictionaryArray.from_arrays(zeros, pa.array([value])).dictionary_decode()

    return pa.table({
        "workload_hash": per_workload(hashes),
        "family": per_workload([m[0] for m in meta]),
        "workload_name": per_workload([m[1] for m in meta]),
        "graph_json": pa.DictionaryArray.from_arrays(idx, pa.array(graphs)),
        "candidate_hash": pa.array(cand),
        "kind": constant("fusion"),
        "config_json": pa.array(cfg_rows),
        "device_id": constant(dev_id),
        "device_name": constant(dev.name),
        "status": pa.array(status.tolist()),
        "median_us": lat_or_null,
        "p20_us": pa.array(np.where(failed, np.nan, lat * 0.98), mask=failed),
        "p80_us": pa.array(np.where(failed, np.nan, lat * 1.02), mask=failed),
        "registers": pa.array(regs, mask=failed),
        "shared_bytes": pa.array(smem, mask=failed),
        "local_bytes": pa.array(local, mask=failed),
    })

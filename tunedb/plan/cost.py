"""What one step costs: an exact database hit first, the cost model next, the roofline last.

``Coster.group(nodes)`` prices a candidate group of nodes (cached by the cut's structural key,
so the twelve identical layers of an encoder are priced once):

* ``db``: the best measured median of this workload on this device (``TuningStore.top_k``);
* ``model``: the cost model's best prediction over the group's legal schedules;
* ``roofline``: bytes / bandwidth for memory-bound groups, max(flops / peak, bytes / bandwidth)
  for matmul / gemm / conv (never below ``MIN_KERNEL_US``), when there is no model or the
  generator cannot fuse the group.

``None`` means the group cannot be one kernel (``UnsupportedFusion``, or no legal schedule); the
explorer then keeps it split. Launch overhead is added per launch by the plan, not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tunedb.costmodel.features import (
    FEATURE_NAMES,
    DeviceFacts,
    featurised_form,
    featurize,
    featurize_candidates,
)
from tunedb.graph.hashing import graph_hash
from tunedb.graph.ir import Graph, GraphError
from tunedb.graph.ops import LAYOUT_OPS
from tunedb.kernels.analysis import Analysis, UnsupportedFusion, analyze
from tunedb.kernels.gen_trows import trows_kernel
from tunedb.kernels.gen_window import (
    WINDOW_CONFIG,
    costly_prologue,
    has_window_op,
    is_window_node,
    match_window,
    window_kernel,
)
from tunedb.kernels.schedule import Schedule, schedule_space
from tunedb.plan.fallback import fallback_order, vocabulary_rows
from tunedb.plan.subgraph import COMPUTE_KIND, GraphIndex
from tunedb.runtime.executor_ops import compute_launches

# Sustained fp32 (no TF32) and fp16/bf16 tensor-core rates of an H200, for the compute roofline.
PEAK_FLOPS = {"float32": 50e12, "float16": 660e12, "bfloat16": 660e12}
# The shortest a kernel runs, however little it moves (CUDA-event timing of a one-wave kernel on
# an H100/H200). Without it the roofline would call tiny kernels free, and every split group
# priced by the roofline would look cheaper than the same group measured in the database.
MIN_KERNEL_US = 2.0
RANKED_KEEP = 16  # schedules kept per group, best predicted first (for measuring the top few)


@dataclass(frozen=True)
class GroupCost:
    kind: str                       # a STEP_KINDS name
    us: float                       # predicted kernel time without launch overhead
    source: str                     # db | model | roofline | none
    launches: int = 1
    config: dict | None = None      # chosen schedule config (None: choose at the end)
    ranked: tuple[tuple[float, dict], ...] = field(default=(), repr=False)
    note: str = ""


def compute_flops(sub: Graph) -> tuple[float, str]:
    """Multiply-add flops (x2) of the one compute node of ``sub`` and its dtype."""
    n = sub.nodes[0]
    t = sub.type_map
    out = t[n.outputs[0]]
    if n.op == "matmul":
        a = t[n.inputs[0]]
        k = a.shape[-1] if a.rank >= 1 else 1
        return 2.0 * out.numel * k, out.dtype
    if n.op == "gemm":
        a = t[n.inputs[0]]
        k = a.shape[0] if n.attr("trans_a", False) else a.shape[-1]
        return 2.0 * out.numel * k, out.dtype
    if n.op == "conv2d":
        w = t[n.inputs[1]]
        return 2.0 * out.numel * math.prod(w.shape[1:]), out.dtype
    return 0.0, out.dtype


def stitch_of(config: dict | None) -> tuple[tuple[str, str], ...]:
    """(value, scheme) pairs of a schedule config's ``stitch`` text ("value:scheme;...")."""
    text = (config or {}).get("stitch", "") or ""
    return tuple(tuple(p.rsplit(":", 1)) for p in str(text).split(";") if ":" in p)


def model_predict_us(model: Any, graph: Graph, configs: Sequence[dict], workload_hash: str) -> np.ndarray:
    """Predicted µs of ``configs`` on ``graph``: ``CostModel.predict_candidates`` (the model's
    own device facts), or any callable ``model(graph, configs) -> µs``."""
    fn = getattr(model, "predict_candidates", None)
    if fn is not None:
        out = fn(graph, list(configs), workload_hash=workload_hash)
    elif callable(model):
        out = model(graph, list(configs))
    else:
        raise TypeError(f"cost model {type(model).__name__} has no predict_candidates(graph, configs)")
    us = np.asarray(out, dtype=np.float64).reshape(-1)
    if len(us) != len(configs):
        raise ValueError(f"cost model returned {len(us)} predictions for {len(configs)} configs")
    return us


class Coster:
    """Prices groups of nodes of one graph; see the module docstring."""

    def __init__(self, index: GraphIndex, *, store: Any = None,
                 device_id: str | Sequence[str] | None = None, model: Any = None,
                 device: DeviceFacts | None = None) -> None:
        self.index = index
        self.store = store
        # the device's id, or several (boards of one model): exact hits from any of them
        self.device_ids = ([device_id] if isinstance(device_id, str) else list(device_id or ()))
        self.model = model
        self.device = device or DeviceFacts()
        self._by_key: dict[tuple, GroupCost | None] = {}
        self._hash: dict[tuple, str] = {}
        self._sub: dict[tuple, Graph] = {}
        self._analysis: dict[tuple, Analysis | None] = {}
        self._chosen: dict[tuple, GroupCost | None] = {}
        self._pending: dict[tuple, tuple[int, ...]] = {}
        # Set by the explorer for a first search pass: model prices are batched afterwards.
        self.defer_model = False
        self._measured: set[str] = self._measured_hashes()
        self.stats = {"groups_priced": 0, "db_hits": 0, "model_calls": 0}

    def _measured_hashes(self) -> set[str]:
        """Workloads with an ok measurement on this device, in one query (most groups miss)."""
        if self.store is None or not self.device_ids:
            return set()
        marks = ", ".join("?" for _ in self.device_ids)
        rows = self.store.con.execute(
            "SELECT DISTINCT c.workload_hash FROM measurements m JOIN candidates c "
            f"ON c.hash = m.candidate_hash WHERE m.device_id IN ({marks}) AND m.status = 'ok'",
            self.device_ids).fetchall()
        return {r[0] for r in rows}

    # -- cached facts of a cut ----------------------------------------------------------------
    def subgraph(self, nodes: Sequence[int], key: tuple | None = None) -> Graph:
        """The canonical sub-graph of ``nodes``, cached by structure. Its value names are
        canonical; for the whole-graph names of its inputs/outputs use ``GraphIndex.cut``."""
        key = key if key is not None else self.index.key(nodes)
        g = self._sub.get(key)
        if g is None:
            g = self._sub[key] = self.index.cut(nodes).graph
        return g

    def workload_hash(self, nodes: Sequence[int], key: tuple | None = None) -> str:
        key = key if key is not None else self.index.key(nodes)
        h = self._hash.get(key)
        if h is None:
            h = self._hash[key] = graph_hash(self.subgraph(nodes, key))
        return h

    def analysis(self, nodes: Sequence[int], key: tuple | None = None) -> Analysis | None:
        key = key if key is not None else self.index.key(nodes)
        if key not in self._analysis:
            try:
                self._analysis[key] = analyze(self.subgraph(nodes, key))
            except (UnsupportedFusion, GraphError):
                self._analysis[key] = None
        return self._analysis[key]

    # -- pricing ------------------------------------------------------------------------------
    def group(self, nodes: Sequence[int]) -> GroupCost | None:
        """Cost of running ``nodes`` (sorted indices) as one step; None if they cannot be one."""
        if all(self.index.view[j] for j in nodes):
            # Before the cache: a strided view and a copied transpose of the same shapes share
            # a key (BERT's V and Q transposes), and only the view needs no kernel.
            return GroupCost("layout_view", 0.0, "none", launches=0)
        key = self.index.key(nodes)
        if key in self._by_key:
            return self._by_key[key]
        self.stats["groups_priced"] += 1
        cost = self._price(nodes, key)
        self._by_key[key] = cost
        return cost

    def _db(self, nodes: Sequence[int], key: tuple, fused: bool = False) -> tuple[float, dict] | None:
        """(best measured µs, its config) on this device, if the database has the workload. A
        fused step must be able to run the config, so only schedule configs count for it."""
        if not self._measured:
            return None
        h = self.workload_hash(nodes, key)
        if h not in self._measured:
            return None
        for cand, us in self.store.top_k(h, self.device_ids, 8):
            if fused:
                try:
                    Schedule.from_config(cand.config_dict)
                except (ValueError, TypeError):
                    continue
            self.stats["db_hits"] += 1
            return us, cand.config_dict
        return None

    def _roofline_us(self, sub: Graph) -> float:
        return max(MIN_KERNEL_US, sub.floor_bytes() / self.device.bandwidth_bytes_per_s * 1e6)

    def _price(self, nodes: Sequence[int], key: tuple) -> GroupCost | None:
        ix = self.index
        if all(ix.view[j] for j in nodes):
            return GroupCost("layout_view", 0.0, "none", launches=0)
        if len(nodes) == 1 and ix.compute[nodes[0]]:
            if is_window_node(ix.graph, ix.nodes[nodes[0]]):
                # Generated even alone: constant taps unrolled, a strip of outputs a thread; the
                # runtime's kernel loops over runtime bounds (ConvNeXt's 7x7: 0.03 of the floor).
                window = self._window(nodes, key)
                if window is not None:
                    return window
            return self._compute(nodes, key)
        if len(nodes) > 1 and any(ix.compute[j] or is_window_node(ix.graph, ix.nodes[j]) for j in nodes):
            return self._window(nodes, key)  # is_window_node: a resample gather (no compute op)
        if len(nodes) > 1 and not all(ix.fusable[j] for j in nodes):
            return None
        a = self.analysis(nodes, key) if all(ix.fusable[j] for j in nodes) else None
        if a is None:
            if len(nodes) > 1:
                return self._window(nodes, key)  # rows of a transposed input (gen_trows), or None
            return self._single(nodes, key, "the fused-kernel generator cannot take this op")
        if len(nodes) == 1 and not a.nodes:
            # one copy op alone (a transpose, a split): the runtime's layout kernel, as before
            # index-mapped copies; in a group it is read through an index map instead
            # (``Explorer._unfuse_copies`` splits groups that end up copies alone)
            return self._single(nodes, key, "a lone copy")
        hit = self._db(nodes, key, fused=True)
        if hit is not None:
            us, cfg = hit
            return GroupCost("fused", us, "db", launches=_launches(cfg), config=cfg)
        if self.model is None or unseen_by_model(a):
            return GroupCost("fused", self._roofline_us(a.graph), "roofline")
        if self.defer_model:
            # Priced by the roofline for now; ``price_pending`` asks the model for all at once.
            self._pending[key] = tuple(nodes)
            return GroupCost("fused", self._roofline_us(a.graph), "roofline")
        return self._model_prices([(key, tuple(nodes))])[key]

    def price_pending(self) -> int:
        """Ask the model about every group priced provisionally while ``defer_model`` was set,
        in one batch; returns how many groups it priced."""
        items = list(self._pending.items())
        self._pending.clear()
        if items:
            self._by_key.update(self._model_prices(items))
        return len(items)

    def _model_prices(self, items: list[tuple[tuple, tuple[int, ...]]]) -> dict[tuple, GroupCost | None]:
        """Model prices of fusable groups: the best prediction over each one's legal schedules.
        A ``CostModel`` gets one featurize + predict call for all of them (a call has a fixed
        overhead of milliseconds); any other model one call per group."""
        out: dict[tuple, GroupCost | None] = {}
        work = []
        for key, nodes in items:
            a = self.analysis(nodes, key)
            legal = schedule_space(a, self.device.sm_count)[0] if a is not None else []
            if not legal:
                out[key] = None if len(nodes) > 1 else self._single(nodes, key, "no legal schedule")
                continue
            work.append((key, a.graph, [s.to_config() for s in legal], self.workload_hash(nodes, key)))
        if not work:
            return out
        self.stats["model_calls"] += 1
        if hasattr(self.model, "predict") and hasattr(self.model, "device"):
            graphs = {h: g for _, g, _, h in work}
            hashes = [h for _, _, cfgs, h in work for _ in cfgs]
            configs = [c for _, _, cfgs, _ in work for c in cfgs]
            us_all = np.asarray(self.model.predict(featurize(graphs, hashes, configs, self.model.device)),
                                dtype=np.float64).reshape(-1)
            parts, start = [], 0
            for _, _, cfgs, _ in work:
                parts.append(us_all[start:start + len(cfgs)])
                start += len(cfgs)
        else:
            parts = [model_predict_us(self.model, g, cfgs, h) for _, g, cfgs, h in work]
        for (key, _, configs, _), us in zip(work, parts):
            ranked = ranked_configs(us, configs)
            best_us, best_cfg = ranked[0]
            out[key] = GroupCost("fused", best_us, "model", launches=_launches(best_cfg),
                                 config=best_cfg, ranked=ranked)
        return out

    def _window(self, nodes: Sequence[int], key: tuple) -> GroupCost | None:
        """A depthwise convolution or pool with elementwise neighbours (``plan.window``): one
        generated kernel, priced by the roofline (the model never saw these kernels)."""
        sub = self.subgraph(nodes, key)
        window = has_window_op(sub)
        try:
            (window_kernel if window else trows_kernel)(sub, self.device.sm_count)
        except (UnsupportedFusion, GraphError):
            return None
        if window and costly_prologue(sub, match_window(sub)):
            return None  # the roofline would miss the per-tap recomputation
        return GroupCost("fused", self._roofline_us(sub), "roofline", config=dict(WINDOW_CONFIG),
                         note="window")

    def _single(self, nodes: Sequence[int], key: tuple, note: str) -> GroupCost:
        """A lone op outside the generator: a copy kernel of the runtime, roofline priced."""
        op = self.index.nodes[nodes[0]].op
        kind = "layout" if op in LAYOUT_OPS else "op"
        hit = self._db(nodes, key)
        if hit is not None:
            return GroupCost(kind, hit[0], "db", config=hit[1], note=note)
        return GroupCost(kind, self._roofline_us(self.subgraph(nodes, key)), "roofline", note=note)

    def _compute(self, nodes: Sequence[int], key: tuple) -> GroupCost:
        node = self.index.nodes[nodes[0]]
        kind = COMPUTE_KIND.get(node.op, "op")
        # the executor's kernels for it: a conv's im2col and bias kernels count as launches too
        launches = compute_launches(node, self.index.types)
        hit = self._db(nodes, key)
        if hit is not None:
            return GroupCost(kind, hit[0], "db", launches=launches, config=hit[1])
        sub = self.subgraph(nodes, key)
        flops, dtype = compute_flops(sub)
        peak = PEAK_FLOPS.get(dtype, PEAK_FLOPS["float32"])
        us = max(flops / peak, sub.floor_bytes() / self.device.bandwidth_bytes_per_s) * 1e6
        us = max(MIN_KERNEL_US, us)
        return GroupCost(kind, us, "roofline", launches=launches)

    # -- schedule for a final group -----------------------------------------------------------
    def choose_schedule(self, nodes: Sequence[int], cost: GroupCost) -> GroupCost | None:
        """Fill in the schedule of a fused group priced without one (roofline): the first legal
        schedule of ``tunedb.plan.fallback`` (rules of thumb, then the roofline estimate). None
        when the group has no legal schedule (the caller splits it)."""
        if cost.kind != "fused" or cost.config is not None:
            return cost
        key = self.index.key(nodes)
        if key in self._chosen:
            return self._chosen[key]
        a = self.analysis(nodes, key)
        legal = schedule_space(a, self.device.sm_count)[0] if a is not None else []
        chosen = None
        if legal:
            configs = [s.to_config() for s in legal]
            est, waves = _feature_roofline(a.graph, configs, self.workload_hash(nodes, key), self.device)
            ranked = ranked_configs(est, configs,
                                    order=fallback_order(a, legal, est, waves, self.device.sm_count))
            chosen = GroupCost("fused", cost.us, cost.source, launches=_launches(ranked[0][1]),
                               config=ranked[0][1], ranked=ranked, note=cost.note)
        self._chosen[key] = chosen
        return chosen


def unseen_by_model(a: Analysis) -> bool:
    """Kernels of a kind the shipped model never trained on (issue 21's generator coverage),
    priced by the roofline and scheduled by ``fallback_order`` instead: reductions over a middle
    block of axes (the model priced a [64, 512, 256] middle mean at 41 us, the kernel ran 11 us,
    and it split x - mean over a middle block into 3 kernels), and reductions reading an
    operand through an index map (it gave an instance norm a re-read row cache: 0.57 of the
    floor on the H200). Elementwise kernels with index maps keep the model (0.84-0.93 there).
    Also rows of vocabulary width with several values cached along them (``vocabulary_rows``)."""
    return bool(a.col_seg) or (bool(a.idx_maps) and a.pattern != "elementwise"
                               and a.pattern != "transpose") or vocabulary_rows(a)


def ranked_configs(us: Any, configs: list[dict], order: Sequence[int] | None = None
                   ) -> tuple[tuple[float, dict], ...]:
    """The RANKED_KEEP best (µs, config) pairs, best first: by ``us`` (ties in schedule-space
    order), or in ``order`` when given. Twins that differ only in knobs without a feature
    (``UNFEATURISED_KNOBS``: same features, same estimate) are kept once, the first of the space
    (the plain one): the plan measures the top few of this list, and two of them should not be
    one estimate twice."""
    out: list[tuple[float, dict]] = []
    seen: set[str] = set()
    if order is None:
        order = np.argsort(np.asarray(us, dtype=np.float64), kind="stable")
    for i in order:
        key = featurised_form(configs[i])
        if key in seen:
            continue
        seen.add(key)
        out.append((float(us[i]), configs[i]))
        if len(out) == RANKED_KEEP:
            break
    return tuple(out)


def _feature_roofline(graph: Graph, configs: list[dict], workload_hash: str,
                      device: DeviceFacts) -> tuple[np.ndarray, np.ndarray]:
    """The cost-model features ``roofline_us`` and ``waves`` of each config (zeros and ones
    when the graph cannot be featurised)."""
    try:
        X = featurize_candidates(graph, configs, device, workload_hash=workload_hash)
        return (X[:, FEATURE_NAMES.index("roofline_us")].astype(np.float64),
                X[:, FEATURE_NAMES.index("waves")].astype(np.float64))
    except (ValueError, GraphError, KeyError):
        return np.zeros(len(configs)), np.ones(len(configs))


def _launches(config: dict | None) -> int:
    """Kernels a fused schedule launches: two when partial reductions go through global memory."""
    if not config:
        return 1
    try:
        s = Schedule.from_config(config)
    except (ValueError, TypeError):
        return int(config.get("kernels", 1) or 1)
    return 2 if s.mapping == "col_tiled" and s.split > 1 else 1


"""Fusion explorer: partition a graph's memory-intensive ops into fusion groups.

Compute ops (matmul, gemm, conv, pool) are steps of their own. Every other node is decided in
topological order by a beam search over merge decisions; a node may

* start a group of its own,
* join the group of one of its producers (producer-consumer: elementwise chains, reductions
  stitched to their consumers, as FusionStitching does),
* join the union of all its producers' groups,
* join a group that reads the same large input (sibling / multi-output fusion).

A state's score is the sum of its groups' costs (``Coster``: DB hit, cost model, roofline) plus
``launch_us`` per kernel launch; the ``beam`` best states survive each node. A merge that the
generator cannot fuse (``UnsupportedFusion``, no legal schedule) is not taken, so such groups
stay split. A merge that would make a cycle (a path that leaves the group and comes back, also
through other groups) is never taken. After the search, small independent groups are packed
horizontally into one kernel when the generator can (saving launches), and groups whose
schedule was not chosen yet get one (or are split when none is legal). Last, a depthwise
convolution or pool takes in the elementwise work around it where that is cheaper
(``tunedb.plan.window``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tunedb.plan.cost import Coster, GroupCost
from tunedb.plan.subgraph import GraphIndex, extract_subgraph
from tunedb.plan.window import window_fusion

__all__ = ["Explorer", "Partition", "explore", "extract_subgraph"]

HPACK_MAX_US = 20.0    # only groups this fast gain noticeably from saving a launch
HPACK_WINDOW = 8       # partners tried per group, in execution order
MAX_SIBLINGS = 2       # sibling groups tried per node


@dataclass
class _State:
    gid: list[int]                          # node -> group id (smallest node of its group)
    members: dict[int, tuple[int, ...]]     # multi-node groups
    scores: dict[int, float]                # group id -> cost + launch overhead (non-compute)
    total: float
    sig: frozenset
    ngroups: int


@dataclass
class Partition:
    """Groups of node indices in an execution order that respects every dependency."""

    groups: list[tuple[int, ...]]
    costs: list[GroupCost]
    stats: dict = field(default_factory=dict)


class Explorer:
    def __init__(self, index: GraphIndex, coster: Coster, beam: int = 4, launch_us: float = 2.5,
                 horizontal: bool = True, window: bool = True) -> None:
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        self.ix = index
        self.coster = coster
        self.beam = beam
        self.launch_us = launch_us
        self.horizontal = horizontal
        self.window = window
        self.stats: dict = {"beam": beam, "candidates": 0, "cycle_checks": 0, "cycles_rejected": 0,
                            "unfusable_rejected": 0, "horizontal_merges": 0, "splits": 0,
                            "absorbed": 0}

    def score(self, c: GroupCost) -> float:
        return c.us + self.launch_us * c.launches

    # -- search -------------------------------------------------------------------------------
    def run(self) -> Partition:
        t0 = time.perf_counter()
        if self.coster.model is not None:
            # Two passes: the first meets the candidate groups (priced by the roofline), the
            # model then prices them all in one batch, and the second pass decides with those.
            self.coster.defer_model = True
            self._search()
            self.coster.defer_model = False
            self.stats["model_batch"] = self.coster.price_pending()
        best = self._search()
        ix = self.ix
        n = len(ix.nodes)
        groups: dict[int, list[int]] = {}
        for i in range(n):
            groups.setdefault(best.gid[i], []).append(i)
        group_list = [tuple(g) for g in groups.values()]
        self.stats["search_s"] = round(time.perf_counter() - t0, 4)
        group_list = self._absorb(group_list)
        if self.horizontal:
            group_list = self._pack(group_list)
        group_list = self._finalize(group_list)
        group_list = self._unfuse_copies(group_list)
        if self.window:
            costs = [self._final_cost(g) for g in group_list]
            group_list, _, merges = window_fusion(self.ix, self.coster, group_list, costs, self.launch_us)
            self.stats["window_merges"] = len(merges)
        order = self._topo(group_list)
        ordered = [group_list[i] for i in order]
        costs = [self._final_cost(g) for g in ordered]
        self.stats["explore_s"] = round(time.perf_counter() - t0, 4)
        return Partition(ordered, costs, {**self.stats, **self.coster.stats})

    def _unfuse_copies(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """A fused group that only copies (a transpose and its views, no compute, no repeat)
        goes back to one step per op: the runtime's layout copy, measured and known, rather
        than an index-mapped gather the model never saw. A repeat (GQA's expand of a
        transposed input) stays one gathered copy instead of two copies."""
        out: list[tuple[int, ...]] = []
        for g in groups:
            cost = self.coster.group(g) if len(g) > 1 else None
            a = self.coster.analysis(g) if cost is not None and cost.kind == "fused" else None
            if a is not None and not a.nodes and not any(n.op == "expand" for n in a.graph.nodes):
                out += [(j,) for j in g]
                self.stats["copies_unfused"] = self.stats.get("copies_unfused", 0) + 1
            else:
                out.append(g)
        return out

    def _search(self) -> _State:
        ix = self.ix
        n = len(ix.nodes)
        gid = [i if ix.compute[i] else -1 for i in range(n)]
        beam = [_State(gid, {}, {}, 0.0, frozenset(), 0)]
        for v in range(n):
            if not ix.compute[v]:
                beam = self._step(beam, v)
        return beam[0]

    def _open(self, state: _State, g: int) -> bool:
        """Whether group ``g`` may grow: every member is an op the generator may fuse. Only
        fusable nodes ever join a group, so a multi-node group always is."""
        return g in state.members or self.ix.fusable[g]

    def _options(self, state: _State, v: int) -> list[tuple[int, ...]]:
        ix = self.ix
        opts: list[tuple[int, ...]] = [()]
        if not ix.fusable[v]:
            return opts
        pg: list[int] = []
        for p in ix.pred[v]:
            g = state.gid[p]
            if not ix.compute[p] and g not in pg and self._open(state, g):
                pg.append(g)
        opts += [(g,) for g in pg]
        if len(pg) > 1:
            opts.append(tuple(pg))
        # Siblings: groups that read one of v's inputs, when that input is as large as v's
        # output (reading a big tensor once is the gain; a shared mask vector is not worth it).
        out_numel = max(ix.types[o].numel for o in ix.nodes[v].outputs)
        sib: list[int] = []
        for x in dict.fromkeys(ix.nodes[v].inputs):
            if x in ix.inline or ix.types[x].numel < out_numel:
                continue
            for c in reversed(ix.consumers.get(x, ())):
                if c >= v or ix.compute[c]:
                    continue
                g = state.gid[c]
                if g not in pg and g not in sib and self._open(state, g):
                    sib.append(g)
                if len(sib) >= MAX_SIBLINGS:
                    break
        opts += [(g,) for g in sib]
        return opts

    def _step(self, beam: list[_State], v: int) -> list[_State]:
        cands = []
        seq = 0
        for state in beam:
            for opt in self._options(state, v):
                members = [v]
                for g in opt:
                    members.extend(state.members.get(g, (g,)))
                U = tuple(sorted(members))
                self.stats["candidates"] += 1
                cost = self.coster.group(U)
                if cost is None:
                    self.stats["unfusable_rejected"] += 1
                    continue
                if opt and self._cycle(state, U, opt, v):
                    self.stats["cycles_rejected"] += 1
                    continue
                s = self.score(cost)
                total = state.total - sum(state.scores[g] for g in opt) + s
                ngroups = state.ngroups + 1 - len(opt)
                cands.append((round(total, 9), ngroups, seq, state, opt, U, s))
                seq += 1
        cands.sort(key=lambda c: c[:3])
        out: list[_State] = []
        seen: set[frozenset] = set()
        for total, ngroups, _, state, opt, U, s in cands:
            old = [state.members[g] for g in opt if g in state.members]
            sig = state.sig.difference(old)
            if len(U) > 1:
                sig = sig | {U}
            if sig in seen:
                continue
            seen.add(sig)
            out.append(self._apply(state, opt, U, s, total, sig, ngroups))
            if len(out) >= self.beam:
                break
        return out

    @staticmethod
    def _apply(state: _State, opt: tuple[int, ...], U: tuple[int, ...], s: float, total: float,
               sig: frozenset, ngroups: int) -> _State:
        gid = state.gid.copy()
        members = dict(state.members)
        scores = dict(state.scores)
        for g in opt:
            members.pop(g, None)
            del scores[g]
        new = U[0]
        for j in U:
            gid[j] = new
        if len(U) > 1:
            members[new] = U
        scores[new] = s
        return _State(gid, members, scores, total, sig, ngroups)

    def _cycle(self, state: _State, U: tuple[int, ...], opt: tuple[int, ...], v: int) -> bool:
        """Would merging ``U`` (groups ``opt`` plus node ``v``) make a cycle? True when a path
        leaves U and re-enters it. Only nodes before v are assigned; later ones cannot lead
        back (edges go forward and they are in no group yet), so the walk stays below v."""
        ix = self.ix
        inside = set(U)
        if len(opt) == 1 and all(p in inside for p in ix.pred[v]):
            return False  # the only way back in would be an edge into v from outside
        self.stats["cycle_checks"] += 1
        gid, members = state.gid, state.members
        seen: set[int] = set()
        stack = [s for u in U for s in ix.succ[u] if s < v and s not in inside]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            for y in members.get(gid[x], (x,)):
                seen.add(y)
                for s in ix.succ[y]:
                    if s in inside:
                        return True
                    if s < v and s not in seen:
                        stack.append(s)
        return False

    # -- after the search ---------------------------------------------------------------------
    def _group_dag(self, groups: Sequence[tuple[int, ...]]) -> tuple[list[int], list[set[int]]]:
        where = {}
        for k, g in enumerate(groups):
            for j in g:
                where[j] = k
        succ = [set() for _ in groups]
        for k, g in enumerate(groups):
            for j in g:
                for s in self.ix.succ[j]:
                    t = where[s]
                    if t != k:
                        succ[k].add(t)
        return [where[j] for j in range(len(self.ix.nodes))], succ

    def _topo(self, groups: Sequence[tuple[int, ...]]) -> list[int]:
        """Kahn's order over the group DAG, earliest first node first (deterministic)."""
        _, succ = self._group_dag(groups)
        indeg = [0] * len(groups)
        for ss in succ:
            for t in ss:
                indeg[t] += 1
        heap = [(groups[k][0], k) for k in range(len(groups)) if indeg[k] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, k = heapq.heappop(heap)
            order.append(k)
            for t in succ[k]:
                indeg[t] -= 1
                if indeg[t] == 0:
                    heapq.heappush(heap, (groups[t][0], t))
        if len(order) != len(groups):
            raise AssertionError("fusion groups form a cycle (explorer bug)")
        return order

    def _reach(self, groups: Sequence[tuple[int, ...]], order: list[int]) -> list[int]:
        """desc[k]: bitset of the groups reachable from group k."""
        _, succ = self._group_dag(groups)
        desc = [0] * len(groups)
        for k in reversed(order):
            d = 0
            for t in succ[k]:
                d |= (1 << t) | desc[t]
            desc[k] = d
        return desc

    def _pack(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Horizontal packing: merge small independent fused groups when one kernel can run
        both (same domain) and it is cheaper than two launches."""
        groups = list(groups)
        done: set[tuple[int, ...]] = set()  # groups that found no partner
        is_small: dict[tuple[int, ...], bool] = {}
        while True:
            order = self._topo(groups)
            desc = self._reach(groups, order)
            for g in groups:
                if g not in is_small:
                    is_small[g] = self._small(g)
            small = [k for k in order if is_small[groups[k]]]
            merged = False
            for i, a in enumerate(small):
                if groups[a] in done:
                    continue
                for b in small[i + 1:i + 1 + HPACK_WINDOW]:
                    if (desc[a] >> b) & 1 or (desc[b] >> a) & 1:
                        continue  # dependent: one kernel for both would be a cycle
                    U = tuple(sorted(groups[a] + groups[b]))
                    cu = self.coster.group(U)
                    ca, cb = self.coster.group(groups[a]), self.coster.group(groups[b])
                    if cu is None or cu.kind != "fused" or ca is None or cb is None:
                        continue
                    if self.score(cu) < self.score(ca) + self.score(cb) - 1e-9:
                        groups = [g for k, g in enumerate(groups) if k not in (a, b)] + [U]
                        self.stats["horizontal_merges"] += 1
                        merged = True
                        break
                if merged:
                    break
                done.add(groups[a])
            if not merged:
                return groups

    def _absorb(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """A lone op whose every reader sits in one fused group joins it when that is cheaper.

        The search decides nodes in order, so a producer joins a group only through its
        consumers: a slice that the generator reads as an index map only inside its concat
        (``tunedb.kernels.movement``) stays a copy kernel when the op after it, alone with it,
        is not fusable. No cycle can appear: the whole group reads the op, none of it feeds it."""
        ix = self.ix
        where = {j: k for k, g in enumerate(groups) for j in g}
        merged: dict[int, int] = {}  # absorbed group index -> the group that took it
        for k, g in enumerate(groups):
            if len(g) != 1 or ix.compute[g[0]] or not ix.fusable[g[0]]:
                continue
            readers = {where[s] for s in ix.succ[g[0]]}
            if len(readers) != 1 or any(o in ix.outputs for o in ix.nodes[g[0]].outputs):
                continue
            h = readers.pop()
            while h in merged:
                h = merged[h]
            if not self.window and any(ix.compute[j] for j in groups[h]):
                continue  # a prologue into a depthwise conv / pool: windowed fusion
            cg, ch = self.coster.group(g), self.coster.group(groups[h])
            U = tuple(sorted(g + groups[h]))
            cu = self.coster.group(U)
            if cu is None or cu.kind != "fused" or cg is None or ch is None:
                continue
            if self.score(cu) < self.score(cg) + self.score(ch) - 1e-9:
                groups[h] = U
                merged[k] = h
                self.stats["absorbed"] += 1
        return [g for k, g in enumerate(groups) if k not in merged]

    def _small(self, g: tuple[int, ...]) -> bool:
        c = self.coster.group(g)
        return c is not None and c.kind == "fused" and c.us <= HPACK_MAX_US

    def _finalize(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Give every fused group a schedule; split the ones that have no legal schedule."""
        out: list[tuple[int, ...]] = []
        for g in groups:
            c = self.coster.group(g)
            if len(g) == 1 or (c is not None and (c.kind != "fused"
                                                  or self.coster.choose_schedule(g, c) is not None)):
                out.append(g)
                continue
            self.stats["splits"] += 1
            out.extend((j,) for j in g)
        return out

    def _final_cost(self, g: tuple[int, ...]) -> GroupCost:
        c = self.coster.group(g)
        if c is None:
            raise AssertionError(f"group {g} has no cost after finalize (explorer bug)")
        if c.kind == "fused":
            chosen = self.coster.choose_schedule(g, c)
            if chosen is not None:
                return chosen
            return GroupCost("op", c.us, c.source, note="no legal schedule for this op alone")
        return c


def explore(index: GraphIndex, coster: Coster, beam: int = 4, launch_us: float = 2.5,
            horizontal: bool = True, window: bool = True) -> Partition:
    """Partition ``index.graph`` into steps; see the module docstring."""
    return Explorer(index, coster, beam, launch_us, horizontal, window).run()

"""Inter-operator scheduling (IOS, Ding et al., MLSys 2021) over a plan's steps.

The steps of a plan form a DAG (a step depends on the steps whose outputs it reads). A *stage* is a
set of steps split into *groups*: the weakly connected components of the stage's sub-DAG; each group
runs its steps in order on its own stream and the groups run concurrently (the executor forks and
joins streams inside one CUDA graph). Stages run one after another.

The search is the IOS dynamic program: for a set ``S`` of steps still to schedule (always closed
under predecessors), ``cost(S) = min over endings E of S: cost(S - E) + stage_us(E)``, where an
ending is a non-empty subset of ``S`` that no other step of ``S`` depends on. The DP runs over
operators (``operator_units``: a conv, GEMM or pool with the elementwise steps only it feeds).
Pruning as IOS: at most ``r`` operators per group and ``s`` groups per stage. Large graphs are
split into blocks at narrow points of the operator order (where at most ``cut_width`` earlier
operators feed later ones, and at least every ``max_block`` operators): the DP runs per block and
stages never cross a block edge.

Stage latency comes from a stage-cost callable. ``StageEstimator`` predicts it from the members'
times and their share of the GPU (CTAs on the SMs): concurrent groups overlap as long as their
shares add up to less than the whole GPU. Measured stage times (``measured``) override it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tunedb.costmodel.features import DeviceFacts
from tunedb.plan.buffers import plan_buffers
from tunedb.plan.cost import compute_flops
from tunedb.plan.record import Plan, PlanError

COMPUTE_KINDS = ("conv2d", "matmul", "gemm")
GEMM_TILE = 128 * 128          # output elements per CTA a cuBLAS kernel is assumed to take
THREADS_TO_FILL_SM = 1024      # resident threads per SM that saturate a memory-bound kernel
MIN_KERNEL_US = 2.0
FORK_US = 1.0                  # per extra stream of a stage: the fork/join edges of the graph
HEAD_KINDS = COMPUTE_KINDS + ("pool",)   # operators whose elementwise epilogue joins them in the DP
EPILOGUE_KINDS = ("fused", "layout_view")

Groups = tuple[tuple[int, ...], ...]


# -- the DAG of steps ---------------------------------------------------------------------------
def step_dag(steps: Sequence[Any]) -> tuple[list[set[int]], list[set[int]]]:
    """(preds, succs) of each step: j depends on i when j reads a value i writes."""
    writer: dict[str, int] = {}
    preds: list[set[int]] = [set() for _ in steps]
    succs: list[set[int]] = [set() for _ in steps]
    for j, s in enumerate(steps):
        for v in s.inputs:
            i = writer.get(v)
            if i is not None and i != j:
                preds[j].add(i)
                succs[i].add(j)
        for v in s.outputs:
            writer[v] = j
    return preds, succs


def components(members: Sequence[int], preds: Sequence[set[int]], succs: Sequence[set[int]]) -> Groups:
    """The weakly connected components of ``members``' sub-DAG, each in ascending step order,
    ordered by their first step."""
    left = set(members)
    out = []
    while left:
        seed = min(left)
        comp, todo = {seed}, [seed]
        while todo:
            u = todo.pop()
            for v in (preds[u] | succs[u]) & left:
                if v not in comp:
                    comp.add(v)
                    todo.append(v)
        left -= comp
        out.append(tuple(sorted(comp)))
    return tuple(sorted(out))


# -- predicted stage latency --------------------------------------------------------------------
@dataclass(frozen=True)
class MemberProfile:
    us: float      # kernel time alone, launch overhead included
    share: float   # fraction of the GPU's SMs it keeps busy while it runs (0..1]
    kernels: int


class StageEstimator:
    """Predicted stage latency from the members of its groups.

    A member alone takes ``max(predicted, roofline / share)`` plus its launches; ``share`` is the
    fraction of the SMs its CTAs occupy (cuBLAS/conv: one 128x128 output tile per CTA; other
    kernels: 1024 resident threads fill an SM). A stage takes the longest group, or the SM-time
    all members need together, whichever is larger, plus ``fork_us`` per extra stream."""

    def __init__(self, steps: Sequence[Any], device: DeviceFacts | None = None, launch_us: float = 2.5,
                 fork_us: float = FORK_US) -> None:
        self.device = device or DeviceFacts()
        self.launch_us, self.fork_us = launch_us, fork_us
        self.profiles = [self.profile(s) for s in steps]

    def profile(self, step: Any) -> MemberProfile:
        if step.kind == "layout_view":
            return MemberProfile(0.0, 0.0, 0)
        sub = step.graph
        sm = self.device.sm_count
        out_elems = sum(sub.type_of(v).numel for v in sub.outputs)
        if step.kind in COMPUTE_KINDS and len(sub.nodes) == 1:
            share = min(1.0, math.ceil(out_elems / GEMM_TILE) / sm)
        else:
            share = min(1.0, out_elems / 4 / (THREADS_TO_FILL_SM * sm))  # ~4 elements per thread
        share = max(share, 1.0 / sm)
        roof = sub.floor_bytes() / self.device.bandwidth_bytes_per_s * 1e6
        if step.kind in COMPUTE_KINDS and len(sub.nodes) == 1:
            flops, _ = compute_flops(sub)
            roof = max(roof, flops / 60e12 * 1e6)
        kernel = max(step.predicted_us, roof / share, MIN_KERNEL_US)
        return MemberProfile(kernel + self.launch_us * step.launches, share, step.launches)

    def __call__(self, groups: Groups) -> float:
        longest = 0.0
        sm_time = 0.0
        for g in groups:
            t = 0.0
            for i in g:
                p = self.profiles[i]
                t += p.us
                sm_time += (p.us - self.launch_us * p.kernels) * p.share
            longest = max(longest, t)
        busy = [g for g in groups if any(self.profiles[i].kernels for i in g)]
        return max(longest, sm_time) + self.fork_us * max(0, len(busy) - 1)


class StageKeys:
    """``keys(groups)``: a key of a stage that names what runs, not where: each group's members'
    kinds, workload hashes and schedules in order, groups sorted (the database key of a measured
    stage). The members' texts are made once per plan."""

    def __init__(self, steps: Sequence[Any]) -> None:
        self.member = [f"{s.kind}:{s.workload_hash}:{sorted(s.config_dict.items())}" for s in steps]

    def __call__(self, groups: Groups) -> str:
        text = "|".join(sorted(";".join(self.member[i] for i in g) for g in groups))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def stage_key(steps: Sequence[Any], groups: Groups) -> str:
    """``StageKeys(steps)(groups)`` for one stage."""
    return StageKeys(steps)(groups)


# -- blocks -------------------------------------------------------------------------------------
def count_states(block: range, preds: Sequence[set[int]], cap: int) -> int:
    """Sets of steps of ``block`` closed under predecessors (the DP's states), counted up to
    ``cap + 1``."""
    a = block.start
    pm = [sum(1 << (j - a) for j in preds[i] if j in block) for i in block]
    seen, todo = {0}, [0]
    while todo:
        S = todo.pop()
        for u, need in enumerate(pm):
            if not S >> u & 1 and need & ~S == 0:
                S2 = S | 1 << u
                if S2 not in seen:
                    seen.add(S2)
                    if len(seen) > cap:
                        return cap + 1
                    todo.append(S2)
    return len(seen)


def split_blocks(n: int, succs: Sequence[set[int]], preds: Sequence[set[int]] | None = None,
                 max_block: int = 40, cut_width: int = 1, max_states: int = 3000) -> list[range]:
    """Consecutive ranges of the step order (a topological order). A cut before ``p`` is natural
    when at most ``cut_width`` steps before ``p`` feed steps at or after ``p`` (0: no natural cuts);
    a cut keeps the steps on either side in different stages. Ranges longer than
    ``max_block`` steps, or with more than ``max_states`` DP states, are cut again at their
    narrowest point near the middle."""
    width = [0] * (n + 1)
    for p in range(1, n):
        width[p] = sum(1 for i in range(p) if any(j >= p for j in succs[i]))
    natural = [p for p in range(1, n) if width[p] <= cut_width] if cut_width >= 1 else []
    cuts = [0] + natural + [n]
    out: list[range] = []

    def add(a: int, b: int) -> None:
        too_big = b - a > max_block or (
            preds is not None and b - a > 2 and count_states(range(a, b), preds, max_states) > max_states)
        if not too_big:
            out.append(range(a, b))
            return
        lo, hi = a + max(1, (b - a) // 4), b - max(1, (b - a) // 4)
        p = min(range(lo, hi), key=lambda q: (width[q], abs(q - (a + b) // 2)))
        add(a, p)
        add(p, b)

    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            add(a, b)
    return out


# -- the dynamic program ------------------------------------------------------------------------
@dataclass
class SearchStats:
    states: int = 0
    transitions: int = 0
    candidates: int = 0       # distinct stages priced (IOS measures each one of these)
    blocks: int = 0
    largest_block: int = 0
    truncated: int = 0        # states whose endings were cut off at max_endings
    seconds: float = 0.0


def _dp_block(block: Sequence[int], preds: Sequence[set[int]], succs: Sequence[set[int]],
              kernel: Sequence[bool], cost: Callable[[Groups], float], r: int, s: int,
              max_endings: int, stats: SearchStats, cache: dict) -> tuple[float, list[Groups]]:
    memo_stage: dict[int, tuple[float, Groups]] = {}
    # endings of each state and groups of each ending depend on the DAG only: kept across searches
    ending_cache: dict[int, list[int]] = cache.setdefault("endings", {})
    group_cache: dict[int, Groups] = cache.setdefault("groups", {})
    n = len(block)
    local = {g: k for k, g in enumerate(block)}
    sm = [sum(1 << local[j] for j in succs[g] if j in local) for g in block]
    pm = [sum(1 << local[j] for j in preds[g] if j in local) for g in block]
    nb = [sm[k] | pm[k] for k in range(n)]
    kbit = sum(1 << k for k in range(n) if kernel[block[k]])
    best: dict[int, tuple[float, int, Groups]] = {0: (0.0, 0, ())}

    def comp_of(u: int, e: int) -> int:
        comp, frontier = 1 << u, 1 << u
        while frontier:
            k = (frontier & -frontier).bit_length() - 1
            frontier &= frontier - 1
            new = nb[k] & e & ~comp
            comp |= new
            frontier |= new
        return comp

    def groups_of(e: int) -> Groups:
        hit = group_cache.get(e)
        if hit is not None:
            return hit
        out, left = [], e
        while left:
            k = (left & -left).bit_length() - 1
            c = comp_of(k, e)
            left &= ~c
            out.append(tuple(block[i] for i in range(n) if c >> i & 1))
        group_cache[e] = tuple(out)
        return group_cache[e]

    def price(e: int) -> tuple[float, Groups]:
        hit = memo_stage.get(e)
        if hit is None:
            g = groups_of(e)
            hit = memo_stage[e] = (cost(g), g)
            stats.candidates += 1
        return hit

    def endings(S: int) -> list[int]:
        hit = ending_cache.get(S)
        if hit is not None:
            return hit
        members = [k for k in range(n - 1, -1, -1) if S >> k & 1]
        found: list[int] = []

        def rec(idx: int, e: int, groups_left: int) -> None:
            if len(found) >= max_endings:
                return
            if idx == len(members):
                if e:
                    found.append(e)
                return
            u = members[idx]
            rec(idx + 1, e, groups_left)
            if sm[u] & S & ~e:
                return  # a successor still remains: u cannot end the schedule
            e2 = e | (1 << u)
            comp = comp_of(u, e2)
            if bin(comp & kbit).count("1") > r:
                return
            touched, near = 0, nb[u] & e
            while near:  # the groups of e that u joins into one
                near &= ~comp_of((near & -near).bit_length() - 1, e)
                touched += 1
            left = groups_left + touched - 1
            if left < 0:
                return
            rec(idx + 1, e2, left)

        rec(0, 0, s)
        if len(found) >= max_endings:
            stats.truncated += 1
        ending_cache[S] = found
        return found

    def solve(S: int) -> tuple[float, int, Groups]:
        hit = best.get(S)
        if hit is not None:
            return hit
        stats.states += 1
        top: tuple[float, int, Groups] | None = None
        for e in endings(S):
            stats.transitions += 1
            c, g = price(e)
            total = solve(S & ~e)[0] + c
            if top is None or total < top[0]:
                top = (total, e, g)
        assert top is not None
        best[S] = top
        return top

    full = (1 << n) - 1
    total = solve(full)[0]
    stages: list[Groups] = []
    S = full
    while S:
        _, e, g = best[S]
        stages.append(g)
        S &= ~e
    stages.reverse()
    return total, stages


def operator_units(steps: Sequence[Any], preds: Sequence[set[int]],
                   succs: Sequence[set[int]]) -> list[tuple[int, ...]]:
    """The steps grouped into the DP's operators, in step order: a compute or pool step together
    with the chain of elementwise steps that only it feeds and that feed only each other (conv ->
    ReLU is one operator, as in IOS, where r counts conv-bn-relu as one). Every other step is an
    operator of its own."""
    head = list(range(len(steps)))
    for i, st in enumerate(steps):
        if st.kind not in EPILOGUE_KINDS or len(preds[i]) != 1:
            continue
        (p,) = preds[i]
        if succs[p] == {i} and steps[head[p]].kind in HEAD_KINDS:
            head[i] = head[p]
    units: dict[int, list[int]] = {}
    for i, h in enumerate(head):
        units.setdefault(h, []).append(i)
    return [tuple(units[h]) for h in sorted(units)]


@dataclass(frozen=True)
class _Operators:
    """The DP's view of a plan: views of graph inputs set apart (``sources``), the operators
    (``units``, tuples of step indices) and their DAG."""
    sources: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]
    upreds: tuple[set[int], ...]
    usuccs: tuple[set[int], ...]
    kernel: tuple[bool, ...]


def _operators(steps: Sequence[Any], contract: bool) -> _Operators:
    preds, succs = step_dag(steps)
    for j, p in enumerate(preds):
        if any(i > j for i in p):
            raise PlanError(f"step {j} reads a value of a later step: the steps are not in order")
    # Views of graph inputs (a bias reshaped for its epilogue) launch nothing and wait for
    # nothing: they form a first stage and leave the DP.
    sources = [i for i, st in enumerate(steps) if contract and st.kind == "layout_view" and not preds[i]]
    if sources:
        gone = set(sources)
        preds = [p - gone for p in preds]
        succs = [set() if i in gone else q for i, q in enumerate(succs)]
    units = (operator_units(steps, preds, succs) if contract else [(i,) for i in range(len(steps))])
    units = [m for m in units if m[0] not in sources]
    unit_of = {i: u for u, members in enumerate(units) for i in members}
    upreds = tuple({unit_of[j] for i in m for j in preds[i]} - {u} for u, m in enumerate(units))
    usuccs = tuple({unit_of[j] for i in m for j in succs[i]} - {u} for u, m in enumerate(units))
    kernel = tuple(any(steps[i].kind != "layout_view" for i in m) for m in units)
    return _Operators(tuple(sources), tuple(units), upreds, usuccs, kernel)


def search_blocks(steps: Sequence[Any], *, max_block: int = 40, cut_width: int = 1, max_states: int = 3000,
                  contract: bool = True) -> list[tuple[int, ...]]:
    """The step indices of each block ``ios_search`` splits ``steps`` into with these settings
    (views of graph inputs, which form a stage of their own, belong to none). A block's stages
    never leave it, so ``ios_search(..., only=block)`` searches exactly the space the whole
    search had inside that block."""
    ops = _operators(steps, contract)
    blocks = split_blocks(len(ops.units), ops.usuccs, ops.upreds, max_block, cut_width, max_states)
    return [tuple(sorted(i for u in block for i in ops.units[u])) for block in blocks]


def ios_search(steps: Sequence[Any], cost: Callable[[Groups], float], *, r: int = 3, s: int = 8,
               max_block: int = 40, cut_width: int = 1, max_states: int = 3000,
               max_endings: int = 4000, cache: dict | None = None,
               contract: bool = True,
               only: Sequence[int] | None = None) -> tuple[float, list[Groups], SearchStats]:
    """The least-latency partition of ``steps`` (plan order, a topological order) into stages:
    (total µs, stages as groups of step indices, statistics). ``cache``: a dict kept between
    searches of the same steps with other costs (the refinement loop) to reuse their DAG work.
    ``contract``: the DP runs over operators (``operator_units``: a conv and its ReLU are one),
    so ``r`` counts operators and an epilogue never runs in another stage than its producer.
    ``only``: schedule just these steps (a block of ``search_blocks``), as one block, with the
    operators and dependences of the whole plan; the other steps are taken as already run."""
    cache = {} if cache is None else cache
    if r < 1 or s < 1:
        raise PlanError(f"IOS pruning needs r >= 1 and s >= 1, got r={r} s={s}")
    t0 = time.perf_counter()
    ops = _operators(steps, contract)
    units, sources = ops.units, ops.sources
    if only is not None:
        inside = set(only)
        split = [m for m in units if inside.intersection(m) and not inside.issuperset(m)]
        if split:
            raise PlanError(f"only= cuts operator {list(split[0])} in two: pass a block of search_blocks")
        sources = tuple(i for i in sources if i in inside)

    def expand(groups: Groups) -> Groups:
        return tuple(tuple(sorted(i for u in g for i in units[u])) for g in groups)

    def unit_cost(groups: Groups) -> float:
        return cost(expand(groups))

    if only is None:
        blocks = [list(b) for b in split_blocks(len(units), ops.usuccs, ops.upreds, max_block, cut_width,
                                                max_states)]
    else:
        blocks = [[u for u, m in enumerate(units) if m[0] in inside]]
        if blocks[0] and blocks[0] != list(range(blocks[0][0], blocks[0][-1] + 1)):
            raise PlanError("only= must be consecutive operators (a block of search_blocks)")
    stats = SearchStats()
    total, stages = 0.0, [(tuple(sources),)] if sources else []
    for block in blocks:
        if not block:
            continue
        stats.blocks += 1
        stats.largest_block = max(stats.largest_block, len(block))
        key = (block[0], block[-1], len(block), r, s, max_endings, contract)
        c, st = _dp_block(block, ops.upreds, ops.usuccs, ops.kernel, unit_cost, r, s, max_endings, stats,
                          cache.setdefault(key, {}))
        total += c
        stages += [expand(g) for g in st]
    stats.seconds = time.perf_counter() - t0
    return total, stages, stats


def sequential_stages(n: int) -> list[Groups]:
    return [((i,),) for i in range(n)]


# -- the plan with stages -----------------------------------------------------------------------
def apply_stages(plan: Plan, stages: Sequence[Groups], search: Mapping[str, Any] | None = None) -> Plan:
    """``plan`` with its steps reordered stage by stage (groups in turn, each in step order),
    ``stages`` set, each step's ``stage``/``stream`` filled, and buffers re-planned so that no
    two values alive in one stage share memory."""
    order = [i for st in stages for g in st for i in g]
    if sorted(order) != list(range(len(plan.steps))):
        raise PlanError("stages must cover every step of the plan exactly once")
    new_index = {old: k for k, old in enumerate(order)}
    steps, times, groups = [], [], []
    for si, st in enumerate(stages):
        gs = []
        for gi, g in enumerate(st):
            for i in g:
                steps.append(replace(plan.steps[i], stage=si, stream=gi))
                times.append(si)
            gs.append(tuple(new_index[i] for i in g))
        groups.append(tuple(gs))
    buffers = plan_buffers(plan.graph, steps, times=times)
    merged = {**{k: v for k, v in plan.search}, **(search or {})}
    out = replace(plan, steps=tuple(steps), buffers=buffers, stages=tuple(groups), search=merged)
    out.check()
    return out


def schedule_plan(plan: Plan, *, r: int = 3, s: int = 8, max_block: int = 40,
                  device: DeviceFacts | None = None,
                  measured: Mapping[str, float] | None = None) -> tuple[Plan, dict[str, Any]]:
    """Run the IOS search on ``plan``'s steps (predicted stage costs; ``measured`` maps
    ``stage_key`` to measured µs and overrides the prediction) and return the plan with stages
    and the search's numbers (predicted sequential and staged µs, states, candidates, seconds)."""
    est = StageEstimator(plan.steps, device, plan.launch_us)
    steps = plan.steps
    keys = StageKeys(steps)

    def cost(groups: Groups) -> float:
        if measured:
            hit = measured.get(keys(groups))
            if hit is not None:
                return float(hit)
        return est(groups)

    total, stages, stats = ios_search(steps, cost, r=r, s=s, max_block=max_block)
    sequential = sum(est(((i,),)) for i in range(len(steps)))
    hits = sum(1 for st in stages if measured and keys(st) in measured)
    info = {"schedule": "ios", "ios_r": r, "ios_s": s, "ios_states": stats.states,
            "ios_transitions": stats.transitions, "ios_candidates": stats.candidates,
            "ios_blocks": stats.blocks, "ios_largest_block": stats.largest_block,
            "ios_search_s": round(stats.seconds, 3), "ios_truncated": stats.truncated,
            "ios_stages": len(stages), "ios_stage_hits": hits,
            "ios_predicted_us": round(total, 2), "sequential_predicted_us": round(sequential, 2)}
    return apply_stages(plan, stages, info), info

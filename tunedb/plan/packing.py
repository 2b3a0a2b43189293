"""Which independent GEMM-like steps of a graph (or of several tenants' plans) to launch together.

``gemm_member`` reads a ``matmul`` / ``gemm`` / ``conv2d`` node as a packing ``Member`` (a conv
as its im2col GEMM; a weight that is a constant or graph input gets that value's name as its
weight tag, so two nodes reading one weight share it). ``ready_sets`` groups the GEMM-like nodes
of a graph by GEMM depth (1 + the deepest GEMM-like ancestor): nodes of one depth never depend on
each other, so each group of two or more is one packing opportunity (BERT's Q/K/V projections,
an Inception block's parallel 1x1 convolutions). ``pack_tenants`` forms the workload of several
plans' ready layers. ``choose`` ranks a workload's candidates with a packing cost model (or, with
none, the rule of the bench: one padded call where it exists, else 8 streams) and keeps serial
when no candidate is predicted to beat it by ``min_gain``: packing must pay.

``PlanPack`` records a pack inside a plan (``Plan.packs``; ``check_packs`` validates it);
``pack_plan_steps`` is the driver's pass: it packs a ready set only where measurements (an exact
database hit) or a packing cost model say a plan backend beats serial by ``min_gain``.
``pack_plans`` packs the ready layers of several tenants' plans into one step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from tunedb.costmodel.packing import board_labels
from tunedb.graph.ir import Graph, Node
from tunedb.graph.ops import canonical_attrs, infer_graph
from tunedb.kernels.packing import (
    Candidate,
    Cluster,
    Member,
    PackingWorkload,
    all_candidates,
    candidate_waste,
)
from tunedb.kernels.packing_inplace import INPLACE_BACKENDS, inplace_ok
from tunedb.records import Candidate as Record
from tunedb.records import Workload, canonical_json
from tunedb.runtime.device import import_cupy
from tunedb.runtime.pack import PackedRun, reference, storage, worst_error
from tunedb.runtime.results import MeasureRequest
from tunedb.runtime.streams import StreamPool

GEMM_OPS = ("matmul", "gemm", "conv2d")
PACK_DTYPES = ("float32", "bfloat16", "float16")


def gemm_member(graph: Graph, node: Node, label: str = "") -> Member | None:
    """``node`` as one packing member, or None (not GEMM-like, a broadcast batch, grouped conv,
    an unsupported dtype)."""
    if node.op not in GEMM_OPS:
        return None
    types = graph.type_map
    ins = [types[v] for v in node.inputs]
    if ins[0].dtype not in PACK_DTYPES:
        return None
    named = {v for v, _ in graph.constants} | set(graph.inputs)
    tag = node.inputs[1] if node.inputs[1] in named else ""
    dt = ins[0].dtype
    if node.op == "matmul":
        xs, ws = ins[0].shape, ins[1].shape
        if len(xs) < 2 or len(ws) < 2:
            return None
        if len(ws) == 2:  # a linear layer: every leading dim of x is rows
            return Member(math.prod(xs[:-1]), ws[1], ws[0], dtype=dt, weight=tag, label=label)
        if xs[:-2] != ws[:-2]:
            return None
        return Member(xs[-2], ws[-1], xs[-1], batch=math.prod(xs[:-2]), dtype=dt, kind="bgemm",
                      weight=tag, label=label)
    attrs = canonical_attrs(node, ins)
    if node.op == "gemm":
        if attrs["trans_a"]:
            return None
        m, k = ins[0].shape
        n = ins[1].shape[0] if attrs["trans_b"] else ins[1].shape[1]
        return Member(m, n, k, dtype=dt, layout="nt" if attrs["trans_b"] else "nn", weight=tag,
                      label=label)
    if attrs["groups"] != 1:
        return None
    out = types[node.outputs[0]].shape
    o, c, kh, kw = ins[1].shape
    return Member(out[0] * out[2] * out[3], o, c * kh * kw, dtype=dt, kind="conv", weight=tag,
                  label=label)


def ready_sets(graph: Graph) -> list[list[Node]]:
    """GEMM-like nodes grouped by GEMM depth, groups of two or more, in depth order."""
    graph = infer_graph(graph)
    depth: dict[str, int] = {}  # value -> deepest GEMM-like producer on any path to it
    groups: dict[int, list[Node]] = {}
    for node in graph.nodes:  # topological order
        d = max((depth.get(v, 0) for v in node.inputs), default=0)
        if node.op in GEMM_OPS:
            d += 1
            groups.setdefault(d, []).append(node)
        for v in node.outputs:
            depth[v] = d
    return [groups[d] for d in sorted(groups) if len(groups[d]) > 1]


def graph_workloads(graph: Graph, name: str, family: str = "graphs") -> list[PackingWorkload]:
    """The packing workloads inside ``graph``: one per ready set, members of one dtype."""
    graph = infer_graph(graph)
    out = []
    for i, nodes in enumerate(ready_sets(graph)):
        by_dtype: dict[str, list[Member]] = {}
        for node in nodes:
            mb = gemm_member(graph, node, label=node.outputs[0])
            if mb is not None:
                by_dtype.setdefault(mb.dtype, []).append(mb)
        for dt, ms in sorted(by_dtype.items()):
            if len(ms) > 1:
                out.append(PackingWorkload(f"{name}.set{i}.{dt}", family, tuple(ms)))
    return out


def pack_tenants(layers: Sequence[Sequence[Member]], name: str) -> PackingWorkload:
    """The ready layers of several plans (one list of members per tenant) as one workload;
    labels say which tenant each member came from, weight tags stay per tenant."""
    ms = []
    for t, layer in enumerate(layers):
        for mb in layer:
            ms.append(Member(mb.m, mb.n, mb.k, mb.batch, mb.dtype, mb.layout, mb.kind,
                             f"t{t}.{mb.weight}" if mb.weight else "", f"t{t}.{mb.label}"))
    return PackingWorkload(name, "tenants", tuple(ms))


def choose(w: PackingWorkload, model: Any = None, min_gain: float = 0.05
           ) -> tuple[Candidate, list[tuple[str, float | None]]]:
    """The candidate to run and the ranking it came from (name, predicted µs or None).

    With ``model`` (a booster of ``tunedb.costmodel.packing``, passed in by the caller so that
    planning does not depend on the cost-model layer) the fastest prediction wins unless it beats
    serial by less than ``min_gain``; without, the rule. Every kind of candidate
    (``all_candidates``): a tenants' pack runs any backend (``PackedRun``)."""
    cands = all_candidates(w)
    serial = next(c for c in cands if c.name == "whole:serial")
    if model is None:
        names = [c.name for c in cands]
        for want in ("whole:padded", "whole:streams8"):
            if want in names:
                return cands[names.index(want)], [(want, None)]
        return serial, [(serial.name, None)]
    pred = np.asarray(model(w, cands), dtype=float)
    order = np.argsort(pred, kind="stable")
    ranking = [(cands[i].name, float(pred[i])) for i in order]
    best = cands[int(order[0])]
    serial_us = float(pred[cands.index(serial)])
    if best is not serial and pred[order[0]] > serial_us * (1.0 - min_gain):
        return serial, ranking
    return best, ranking


# -- packs inside a plan ---------------------------------------------------------------------------
# Backends a plan runs with the plan's own buffers (tunedb.runtime.pack_exec): one call per member,
# on one stream or on forked streams, or one grouped call over plain GEMM members' own arrays. The
# padded/pointer/concat backends need operands restacked, copies the database did not time;
# splitk and chunks run when their problems fall on the members' own arrays (inplace_ok).
PLAN_BACKENDS = ("serial", "streams", "grouped", "splitk", "chunks")
PLAIN_BACKENDS = ("grouped",) + INPLACE_BACKENDS  # pointers into the members' own arrays
PACK_STEP_KINDS = ("matmul", "gemm", "conv2d")
PACK_SOURCES = ("model", "db", "measured")


@dataclass(frozen=True)
class PlanPack:
    """Consecutive GEMM/conv steps of a plan launched together: ``steps`` (plan step indices),
    ``candidate`` (canonical JSON of a ``Candidate`` whose cluster members index ``steps``), the
    packing ``workload_hash``, and the evidence: ``source`` (model or db), predicted or measured
    µs of the pack and of the same members one after another (``serial_us``)."""

    steps: tuple[int, ...]
    candidate: str
    workload_hash: str = ""
    predicted_us: float = 0.0
    serial_us: float = 0.0
    source: str = "model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(int(i) for i in self.steps))
        if self.source not in PACK_SOURCES:
            raise ValueError(f"pack source {self.source!r}: expected one of {PACK_SOURCES}")

    @property
    def cand(self) -> Candidate:
        return Candidate.from_json(json.loads(self.candidate))

    @property
    def clusters(self) -> tuple[Cluster, ...]:
        """The clusters with plan step indices as members (what the executor runs)."""
        return tuple(Cluster(tuple(self.steps[i] for i in c.members), c.backend, c.streams, c.split, c.rows)
                     for c in self.cand.clusters)

    @property
    def label(self) -> str:
        return self.cand.name

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "candidate": json.loads(self.candidate),
                "workload_hash": self.workload_hash, "predicted_us": self.predicted_us,
                "serial_us": self.serial_us, "source": self.source}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> PlanPack:
        try:
            cand = canonical_json(Candidate.from_json(d["candidate"]).to_json())
            return PlanPack(tuple(d["steps"]), cand, str(d.get("workload_hash", "")),
                            float(d.get("predicted_us", 0.0)), float(d.get("serial_us", 0.0)),
                            str(d.get("source", "model")))
        except KeyError as e:
            raise ValueError(f"malformed plan pack: no {e.args[0]!r}") from None


def check_packs(plan: Any) -> None:
    """Raise ``ValueError`` unless every pack of ``plan`` is runnable: two or more consecutive
    single-node GEMM/conv steps, each in one pack, none reading another's output or sharing
    bytes of the buffer plan with another member's inputs (they all run at once), a candidate
    whose clusters partition the members with plan backends, and no IOS stages besides."""
    if plan.packs and plan.stages:
        raise ValueError("a plan has either IOS stages or packs, not both")
    seen: set[int] = set()
    where = {v: (b, o, o + n) for v, b, o, n in plan.buffers.assign}
    for p, pack in enumerate(plan.packs):
        st = pack.steps
        if len(st) < 2 or list(st) != list(range(st[0], st[0] + len(st))):
            raise ValueError(f"pack {p}: steps {list(st)} are not two or more consecutive steps")
        if st[0] < 0 or st[-1] >= len(plan.steps):
            raise ValueError(f"pack {p}: steps {list(st)} outside the plan's {len(plan.steps)} steps")
        if seen & set(st):
            raise ValueError(f"pack {p}: step {min(seen & set(st))} is in two packs")
        seen |= set(st)
        steps = [plan.steps[i] for i in st]
        for i, s in zip(st, steps):
            if s.kind not in PACK_STEP_KINDS or len(s.nodes) != 1:
                raise ValueError(f"pack {p}: step {i} ({s.kind} {'+'.join(s.ops)}) is not one GEMM/conv")
        outs = {v for s in steps for v in s.outputs}
        ins = {v for s in steps for v in s.inputs}
        if outs & ins:
            raise ValueError(f"pack {p}: a member reads {sorted(outs & ins)[0]!r}, another member's output")
        for o in outs:
            for v in ins:
                if o in where and v in where and where[o][0] == where[v][0] \
                        and where[o][1] < where[v][2] and where[v][1] < where[o][2]:
                    raise ValueError(f"pack {p}: output {o!r} shares buffer bytes with input {v!r}")
        try:
            cand = pack.cand
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"pack {p}: malformed candidate ({e})") from None
        got = sorted(i for c in cand.clusters for i in c.members)
        if got != list(range(len(st))):
            raise ValueError(f"pack {p}: its clusters do not partition its {len(st)} members")
        g = plan.graph
        nodes = [g.nodes[s.nodes[0]] for s in steps]
        bad = [c.backend for c in cand.clusters if c.backend not in PLAN_BACKENDS or (
            c.backend in PLAIN_BACKENDS and not all(plain_gemm(g, nodes[i]) for i in c.members))
            or (c.backend in INPLACE_BACKENDS and not inplace_ok(
                [gemm_member(g, nodes[i]) for i in c.members], c.backend, c.split, c.rows))]
        if bad or cand.concurrent != 1:
            what = (bad or ["concurrent clusters"])[0]
            raise ValueError(f"pack {p}: backend {what} does not run in a plan")


def plain_gemm(graph: Graph, node: Node) -> bool:
    """A node a grouped GEMM computes as is: a matmul (2-D weight or equal batch) or a gemm
    without C, trans_a or alpha."""
    if node.op == "gemm":
        attrs = canonical_attrs(node, [graph.type_map[v] for v in node.inputs])
        if len(node.inputs) > 2 or attrs["trans_a"] or attrs["alpha"] != 1.0:
            return False
    return node.op in ("matmul", "gemm") and gemm_member(graph, node) is not None


def plan_candidates(w: PackingWorkload, grouped: bool = True) -> list[Candidate]:
    """The candidates of ``w`` a plan can run (``PLAN_BACKENDS``, clusters one after another;
    ``grouped``, ``splitk`` and ``chunks`` only when every member is a ``plain_gemm``, the
    latter two where ``inplace_ok``)."""
    ok = PLAN_BACKENDS if grouped else tuple(b for b in PLAN_BACKENDS if b not in PLAIN_BACKENDS)
    return [c for c in all_candidates(w) if c.concurrent == 1 and all(cl.backend in ok and (
        cl.backend not in INPLACE_BACKENDS or inplace_ok([w.members[i] for i in cl.members], cl.backend,
                                                          cl.split, cl.rows)) for cl in c.clusters)]


def store_times(store: Any, device_ids: Sequence[str] | None) -> Any:
    """A lookup ``w -> {candidate name: µs}`` of a tuning store's ok packing measurements on
    ``device_ids`` (whole-workload candidates only: their meaning does not depend on the order
    of the members, which the workload hash ignores), boards combined as training combines them
    (``board_labels``: one board's basis, so serial and a pack are not judged on two boards)."""
    def times(w: PackingWorkload) -> dict[str, float]:
        per: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
        for c in store.candidates(workload_hash=w.hash, kind="packing"):
            cfg = c.config_dict
            if cfg.get("partition") != "whole":
                continue
            cand = Candidate.from_json({"partition": "whole", "concurrent": cfg.get("concurrent", 1),
                                        "clusters": json.loads(cfg["clusters"])})
            for m in store.measurements(candidate_hash=c.hash):
                if m.status == "ok" and (device_ids is None or m.device_id in device_ids):
                    us = float(np.median(m.samples_us))
                    per.setdefault(cand.name, {}).setdefault(m.device_id, []).append((us, us, us))
        return {k: band[1] for k, band in board_labels(per, dict.fromkeys(per, w.hash)).items()}
    return times


def decide(w: PackingWorkload, *, model: Any = None, times: Any = None, min_gain: float = 0.05,
           grouped: bool = True, measure: Any = None, top: int = 0
           ) -> tuple[Candidate, float, float, str] | None:
    """The plan candidate to run for ``w`` with its µs, serial's µs and the evidence (``db``:
    measured serial and a faster candidate; else ``model``), or None when the evidence does not
    say a pack beats serial by ``min_gain`` (or there is none: a plan never packs on a guess).
    With ``measure`` (``PackMeasurer``) and ``top``: the ``top`` candidates the model ranks first
    (the plan candidates' order without one) and serial are measured first (``measured``)."""
    cands = plan_candidates(w, grouped)
    by_name = {c.name: c for c in cands}
    measured = {k: v for k, v in (times(w) if times is not None else {}).items() if k in by_name}
    pred = None if model is None else np.asarray(model(w, cands), dtype=float)
    source = "db"
    if measure is not None and top > 0:
        ranked = [cands[i] for i in np.argsort(pred, kind="stable")] if pred is not None else cands
        pick = ranked[:top] + [c for c in cands if c.name == "whole:serial" and c not in ranked[:top]]
        fresh = measure(w, pick)
        measured.update(fresh)
        source = "measured" if fresh else source
    if "whole:serial" in measured and len(measured) > 1:
        name = min(measured, key=lambda k: measured[k])
        if name != "whole:serial" and measured[name] <= measured["whole:serial"] * (1 - min_gain):
            return by_name[name], measured[name], measured["whole:serial"], source
        return None
    if pred is None:
        return None
    best = int(np.argmin(pred))
    serial = pred[[c.name for c in cands].index("whole:serial")]
    if cands[best].name == "whole:serial" or pred[best] > serial * (1 - min_gain):
        return None
    return cands[best], float(pred[best]), float(serial), "model"


def pack_records(w: PackingWorkload, cands: Sequence[Candidate]) -> tuple[Workload, list[Record]]:
    """Store records of ``w`` and ``cands``, as the packing collector writes them (same hashes)."""
    wl = Workload(w.hash, w.family, w.name, canonical_json(w.to_json()))
    return wl, [Record(w.hash, "packing", {
        "partition": c.partition, "backends": "+".join(sorted({cl.label for cl in c.clusters})),
        "concurrent": c.concurrent, "clusters": canonical_json(c.to_json()["clusters"]),
        "waste": round(candidate_waste(w, c), 6)}) for c in cands]


def _shape(mb: Member) -> tuple:
    return (mb.m, mb.n, mb.k, mb.batch, mb.dtype, mb.layout, mb.kind)


class PackMeasurer:
    """``measure(w, cands) -> {candidate name: median µs}`` of the ok results: ``cands`` measured
    on ``device`` (a ``PackingDevice``, or a replay of stored rows), results this board stored
    before reused. Each result goes to ``recorder`` (written when the compile ends) unless the
    store lists ``w``'s members in another order and the candidate splits them: its cluster
    indices would name other members there."""

    def __init__(self, device: Any, recorder: Any = None) -> None:
        self.device, self.recorder = device, recorder
        self.requested = 0

    def _same_order(self, w: PackingWorkload) -> bool:
        stored = self.recorder.store.workload(w.hash)
        if stored is None:
            return True
        mine = [_shape(mb) for mb in w.members]
        return [_shape(mb) for mb in PackingWorkload.from_json(json.loads(stored.graph_json)).members] == mine

    def __call__(self, w: PackingWorkload, cands: Sequence[Candidate]) -> dict[str, float]:
        wl, recs = pack_records(w, cands)
        keep = self.recorder is not None and self._same_order(w)
        out: dict[str, float] = {}
        todo = []
        for c, r in zip(cands, recs):
            known = self.recorder.known(r.hash) if self.recorder is not None else None
            if known is None:
                todo.append((c, r))
            elif known.status == "ok":
                out[c.name] = float(np.median(known.samples_us))
        requests = [MeasureRequest(r.hash, {"candidate": c.to_json()}) for c, r in todo]
        self.requested += len(requests)
        for i, res in self.device.measure(wl, requests) if requests else ():
            if res is None:  # a replay without this candidate
                continue
            c, r = todo[i]
            if self.recorder is not None and (keep or c.partition == "whole"):
                self.recorder.add(wl, r, res)
            if res.status == "ok":
                out[c.name] = float(np.median(res.samples_us))
        return out


def pack_plan_steps(graph: Graph, steps: Sequence[Any], *, model: Any = None, times: Any = None,
                    min_gain: float = 0.05, measure: Any = None, top: int = 0
                    ) -> tuple[list[Any], list[PlanPack]]:
    """Steps reordered so each chosen pack's members are consecutive, and the packs.

    Per ready set of the graph (``ready_sets``), its members are the single-node GEMM/conv steps
    of one dtype; they move to just after the last step that produces one of their inputs, which
    must come before any step reading one of their outputs (else the set is left alone)."""
    graph = infer_graph(graph)
    steps = list(steps)
    chosen: list[tuple[list[Any], Candidate, PackingWorkload, float, float, str]] = []
    for nodes in ready_sets(graph):
        step_of = {s.nodes[0]: s for s in steps if len(s.nodes) == 1 and s.kind in PACK_STEP_KINDS}
        idx = {n.outputs[0]: j for j, n in enumerate(graph.nodes)}
        by_dtype: dict[str, list[tuple[Any, Member]]] = {}
        for node in nodes:
            s = step_of.get(idx[node.outputs[0]])
            mb = gemm_member(graph, node, label=node.outputs[0]) if s is not None else None
            if mb is not None:
                by_dtype.setdefault(mb.dtype, []).append((s, mb))
        for dt, pairs in sorted(by_dtype.items()):
            if len(pairs) < 2:
                continue
            w = PackingWorkload(f"{graph.name or 'graph'}.{pairs[0][1].label}.{dt}", "graphs",
                                tuple(mb for _, mb in pairs))
            plain = all(plain_gemm(graph, graph.nodes[s.nodes[0]]) for s, _ in pairs)
            got = decide(w, model=model, times=times, min_gain=min_gain, grouped=plain,
                         measure=measure, top=top)
            if got is None:
                continue
            members = [s for s, _ in pairs]
            moved = _gather(steps, members)
            if moved is not None:
                steps = moved
                chosen.append((members, *got[:1], w, *got[1:]))
    at = {id(s): i for i, s in enumerate(steps)}
    packs = []
    for members, cand, w, us, serial_us, source in chosen:
        pos = [at[id(s)] for s in members]
        if max(pos) - min(pos) != len(pos) - 1:  # a later set moved into the middle: no pack
            continue
        order = sorted(range(len(pos)), key=lambda i: pos[i])  # members in plan order
        back = {old: new for new, old in enumerate(order)}
        remap = Candidate(cand.partition, tuple(Cluster(tuple(sorted(back[i] for i in c.members)),
                                                        c.backend, c.streams, c.split, c.rows)
                                                for c in cand.clusters))
        packs.append(PlanPack(tuple(sorted(pos)), canonical_json(remap.to_json()), w.hash,
                              round(us, 3), round(serial_us, 3), source))
    return steps, sorted(packs, key=lambda p: p.steps)


def _gather(steps: list[Any], members: list[Any]) -> list[Any] | None:
    """``steps`` with ``members`` moved together (see ``pack_plan_steps``), or None."""
    ids = {id(s) for s in members}
    rest = [s for s in steps if id(s) not in ids]
    ins = {v for s in members for v in s.inputs}
    outs = {v for s in members for v in s.outputs}
    after = max([i + 1 for i, s in enumerate(rest) if ins & set(s.outputs)], default=0)
    before = min([i for i, s in enumerate(rest) if outs & set(s.inputs)], default=len(rest))
    if after > before:
        return None
    ordered = sorted(members, key=lambda s: [id(x) for x in steps].index(id(s)))
    return rest[:after] + ordered + rest[after:]


def runnable_packs(graph: Graph, steps: Sequence[Any], buffers: Any, packs: Sequence[PlanPack]
                   ) -> list[PlanPack]:
    """The packs that pass ``check_packs`` with this buffer plan (one whose members' outputs
    the buffer plan put over other members' inputs is dropped: it would run unpacked)."""
    out = []
    for p in packs:
        try:
            check_packs(SimpleNamespace(graph=graph, steps=tuple(steps), buffers=buffers, packs=(p,),
                                        stages=()))
        except ValueError:
            continue
        out.append(p)
    return out


# -- tenants: the ready layers of several plans as one step ---------------------------------------
@dataclass(frozen=True)
class TenantPack:
    """One launch for the ready layers of several plans: ``workload`` (members labelled
    ``t<tenant>.<output value>``), the ``candidate`` that runs it, ``members`` (tenant, plan step)
    per workload member, and where the choice came from (``model``, ``db`` or ``rule``)."""

    workload: PackingWorkload
    candidate: Candidate
    members: tuple[tuple[int, int], ...]
    predicted_us: float | None = None
    source: str = "rule"


def ready_layer(plan: Any) -> list[int]:
    """Steps of ``plan`` that can start at once and run as plain GEMMs: single matmul/gemm nodes
    (no bias input, alpha = beta = 1) reading only graph inputs and constants."""
    g = plan.graph
    ready = set(g.inputs) | set(g.constant_map)
    out = []
    for k, s in enumerate(plan.steps):
        if s.kind not in ("matmul", "gemm") or len(s.nodes) != 1 or not set(s.inputs) <= ready:
            continue
        if plain_gemm(g, g.nodes[s.nodes[0]]):
            out.append(k)
    return out


def pack_plans(plans: Sequence[Any], *, model: Any = None, times: Any = None,
               min_gain: float = 0.05) -> TenantPack:
    """The ready layers (``ready_layer``) of ``plans`` (one per tenant) as one packed step:
    measured times of the workload (``times``, e.g. ``store_times``) decide first, then
    ``model``, else the rule of ``choose``. Raises ``ValueError`` when fewer than two members or
    several dtypes are ready."""
    layers, where = [], []
    for t, plan in enumerate(plans):
        g = plan.graph
        layer = []
        for k in ready_layer(plan):
            mb = gemm_member(g, g.nodes[plan.steps[k].nodes[0]], label=plan.steps[k].outputs[0])
            if mb is not None:
                layer.append(mb)
                where.append((t, k))
        layers.append(layer)
    if len(where) < 2:
        raise ValueError(f"the plans have {len(where)} ready GEMM layer(s); packing needs two or more")
    w = pack_tenants(layers, "tenants." + ".".join(p.graph.name or "graph" for p in plans))
    if len({m.dtype for m in w.members}) > 1:
        raise ValueError("the tenants' ready layers differ in dtype; pack them per dtype")
    measured = times(w) if times is not None else {}
    if measured:
        by_name = {c.name: c for c in all_candidates(w)}
        name = min((k for k in measured if k in by_name), key=lambda k: measured[k], default=None)
        if name is not None and "whole:serial" in measured \
                and measured[name] <= measured["whole:serial"] * (1 - min_gain):
            return TenantPack(w, by_name[name], tuple(where), measured[name], "db")
    cand, ranking = choose(w, model, min_gain)
    us = dict(ranking).get(cand.name)
    return TenantPack(w, cand, tuple(where), us, "model" if model is not None else "rule")


def tenant_inputs(plans: Sequence[Any], tp: TenantPack, feeds: Sequence[Mapping[str, Any]]
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per member ``(x [batch, m, k], weight)`` as float32 (weights ``[batch, k, n]``, or
    ``[batch, n, k]`` for layout ``nt``), from each tenant's graph inputs and constants."""
    out = []
    for (t, k), mb in zip(tp.members, tp.workload.members):
        g, s = plans[t].graph, plans[t].steps[k]
        env = {**{v: c.array for v, c in g.constants}, **dict(feeds[t])}
        x, wt = (np.asarray(env[v], dtype=np.float32) for v in g.nodes[s.nodes[0]].inputs[:2])
        wshape = (mb.batch, mb.k, mb.n) if mb.layout == "nn" else (mb.batch, mb.n, mb.k)
        out.append((x.reshape(mb.batch, mb.m, mb.k), wt.reshape(wshape)))
    return out


def run_tenant_pack(plans: Sequence[Any], tp: TenantPack, feeds: Sequence[Mapping[str, Any]]
                    ) -> list[dict[str, np.ndarray]]:
    """Run the pack on the GPU (``tunedb.runtime.pack``) with each tenant's ``feeds``, check every
    member against the float64 reference first, and return per tenant its members' outputs
    (float64, the graph's shapes). Raises ``ValueError`` when a member is wrong."""
    cp = import_cupy()
    w = tp.workload
    inputs = [(storage(x, mb.dtype), storage(wt, mb.dtype))
              for (x, wt), mb in zip(tenant_inputs(plans, tp, feeds), w.members)]
    pool = StreamPool(max([c.streams for c in tp.candidate.clusters] + [tp.candidate.concurrent, 1]))
    try:
        run = PackedRun(cp, w, tp.candidate, inputs, pool)
        run.run()
        got = run.outputs()
    finally:
        pool.close()
    err = worst_error(w, got, reference(w, inputs))
    if not err <= 1.0:
        raise ValueError(f"tenant pack {tp.candidate.name}: outputs off the float64 reference "
                         f"({err:.3g} x the tolerance)")
    out: list[dict[str, np.ndarray]] = [{} for _ in plans]
    for (t, k), o in zip(tp.members, got):
        v = plans[t].steps[k].outputs[0]
        out[t][v] = np.asarray(o).reshape(plans[t].graph.type_map[v].shape)
    return out

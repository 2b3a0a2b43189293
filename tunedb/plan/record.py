"""The Plan record: what the driver decided, frozen and JSON round-trippable.

A plan is a list of small frozen steps (one kernel launch each, or a free view), in an order
that respects every dependency, plus the graph they run, an intermediate-buffer assignment and
totals. Each step carries the sub-graph it computes (canonical value names, so that its workload
hash matches the tuning database), the schedule it runs with and where the time estimate came
from. A plan replays: load its JSON and run it, no search.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tunedb.graph.ir import Graph, GraphError
from tunedb.graph.ops import infer_graph
from tunedb.kernels.schedule import Schedule
from tunedb.plan.execute import run_cuda, run_reference_steps
from tunedb.plan.packing import PlanPack, check_packs
from tunedb.plan.rewrite import rewrite_for_plan
from tunedb.plan.subgraph import GraphIndex
from tunedb.records import canonical_json, sha256_hex

PLAN_FORMAT = 1
STEP_KINDS: tuple[str, ...] = (
    "fused",        # memory-intensive ops in one generated kernel (tunedb.kernels)
    "matmul", "gemm", "conv2d", "pool",   # compute ops: one library/generated kernel each
    "layout",       # a materialising layout op the generator cannot fuse (transpose copy, concat)
    "layout_view",  # a reshape of a buffer, or a strided view only matmuls read: no kernel at all
    "op",           # any other single op the generator cannot fuse (argmax, gather, ...)
)
COST_SOURCES: tuple[str, ...] = ("db", "model", "roofline", "none")


class PlanError(ValueError):
    """A plan record is malformed (bad JSON, unknown kind or format)."""


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, Mapping):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    return v


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


def _number(v: Any, what: str) -> float:
    """A finite float from JSON; text, bools and NaN are refused (a plan is data, not a guess)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise PlanError(f"plan field {what} must be a finite number, got {v!r}")
    return float(v)


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise PlanError(f"plan field {what} must be an integer, got {v!r}")
    return int(v)


def _pairs(v: Mapping | tuple | list) -> tuple[tuple[str, Any], ...]:
    items = v.items() if isinstance(v, Mapping) else v
    return tuple(sorted((str(k), _freeze(x)) for k, x in items))


@dataclass(frozen=True)
class KernelStep:
    """One step of a plan.

    ``inputs``/``outputs`` are values of the plan's graph, positionally matching the inputs and
    outputs of ``subgraph`` (canonical JSON text of a ``Graph``). ``nodes`` index the plan
    graph's nodes this step computes; ``ops`` are their op names. ``config`` is the schedule
    (``tunedb.kernels.Schedule.to_config()`` for fused steps); ``stitch`` maps each stitched
    subgraph value to its scheme. ``predicted_us`` excludes the launch overhead, which the plan
    adds per launch. ``stream``/``stage`` are reserved for superkernel packing and IOS stages."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[int, ...]
    ops: tuple[str, ...]
    subgraph: str = field(default="", repr=False)
    workload_hash: str = ""
    config: tuple[tuple[str, Any], ...] = ()
    stitch: tuple[tuple[str, str], ...] = ()
    predicted_us: float = 0.0
    cost_source: str = "none"
    launches: int = 1
    measured_us: float | None = None
    stream: int = 0
    stage: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise PlanError(f"unknown step kind {self.kind!r}; expected one of {', '.join(STEP_KINDS)}")
        if self.cost_source not in COST_SOURCES:
            raise PlanError(f"unknown cost source {self.cost_source!r}; "
                            f"expected one of {', '.join(COST_SOURCES)}")
        try:
            for f in ("inputs", "outputs", "ops"):
                object.__setattr__(self, f, tuple(str(x) for x in getattr(self, f)))
            object.__setattr__(self, "nodes", tuple(_int(x, "node index") for x in self.nodes))
            object.__setattr__(self, "config", _pairs(self.config))
            object.__setattr__(self, "stitch", _pairs(self.stitch))
            object.__setattr__(self, "predicted_us", _number(self.predicted_us, "predicted_us"))
            if self.measured_us is not None:
                object.__setattr__(self, "measured_us", _number(self.measured_us, "measured_us"))
            for f in ("launches", "stream", "stage"):
                object.__setattr__(self, f, _int(getattr(self, f), f))
        except (TypeError, AttributeError) as e:
            raise PlanError(f"malformed {self.kind} step: {' '.join(str(e).split())}") from None
        if self.launches < 0:
            raise PlanError(f"{self.kind} step has {self.launches} launches")

    @property
    def config_dict(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.config}

    @cached_property
    def graph(self) -> Graph:
        """The step's sub-graph (canonical names; inputs/outputs in the order of ``inputs``/``outputs``)."""
        if not self.subgraph:
            raise PlanError(f"{self.kind} step has no sub-graph")
        return Graph.from_json(json.loads(self.subgraph))

    @property
    def schedule_label(self) -> str:
        """Short text for the schedule: the kernels package's label for fused steps."""
        cfg = self.config_dict
        if self.kind == "layout_view":
            return "view (no kernel)"
        if self.kind == "fused" and cfg:
            try:
                return Schedule.from_config(cfg).label()
            except (ImportError, ValueError, TypeError):
                pass
        if not cfg:
            return "-"
        return " ".join(f"{k}={v}" for k, v in cfg.items() if k != "stitch")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "inputs": list(self.inputs), "outputs": list(self.outputs),
            "nodes": list(self.nodes), "ops": list(self.ops), "subgraph": self.subgraph,
            "workload_hash": self.workload_hash, "config": self.config_dict,
            "stitch": dict(self.stitch), "predicted_us": self.predicted_us,
            "cost_source": self.cost_source, "launches": self.launches,
            "measured_us": self.measured_us, "stream": self.stream, "stage": self.stage,
            "note": self.note,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> KernelStep:
        try:
            return KernelStep(
                kind=d["kind"], inputs=tuple(d["inputs"]), outputs=tuple(d["outputs"]),
                nodes=tuple(d["nodes"]), ops=tuple(d["ops"]), subgraph=d.get("subgraph", ""),
                workload_hash=d.get("workload_hash", ""), config=d.get("config", {}),
                stitch=d.get("stitch", {}), predicted_us=d.get("predicted_us", 0.0),
                cost_source=d.get("cost_source", "none"), launches=d.get("launches", 1),
                measured_us=d.get("measured_us"), stream=d.get("stream", 0),
                stage=d.get("stage", 0), note=str(d.get("note", "")))
        except KeyError as e:
            raise PlanError(f"malformed plan step: no {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"malformed plan step: {' '.join(str(e).split())}") from None


@dataclass(frozen=True)
class BufferPlan:
    """Intermediate buffers: ``sizes[b]`` bytes for buffer ``b``; ``assign`` maps a value to
    ``(buffer, offset, nbytes)``. Buffer 0 is the arena that intermediates share by liveness;
    every graph output gets its own buffer (it is handed to the caller). Views share their
    source's bytes. Graph inputs and constants are not assigned (the caller / the plan own them)."""

    sizes: tuple[int, ...] = ()
    assign: tuple[tuple[str, int, int, int], ...] = ()
    naive_bytes: int = 0  # the intermediates' total without reuse, for comparison

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "assign", tuple(sorted(
            (str(v), int(b), int(o), int(n)) for v, b, o, n in self.assign)))

    @property
    def assignment(self) -> dict[str, tuple[int, int]]:
        """value -> (buffer id, byte offset)."""
        return {v: (b, o) for v, b, o, _ in self.assign}

    @property
    def arena_bytes(self) -> int:
        return self.sizes[0] if self.sizes else 0

    def to_json(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "assign": [list(a) for a in self.assign],
                "naive_bytes": self.naive_bytes}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> BufferPlan:
        try:
            return BufferPlan(tuple(d.get("sizes", ())), tuple(tuple(a) for a in d.get("assign", ())),
                              _int(d.get("naive_bytes", 0), "naive_bytes"))
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"malformed plan buffers: {' '.join(str(e).split())}") from None


def _check_stages(plan: Plan) -> None:
    """Stages list the steps in plan order, each once; a step's ``stage``/``stream`` name its
    stage and group; no group reads a value another group of its stage writes."""
    order = [i for st in plan.stages for g in st for i in g]
    if order != list(range(len(plan.steps))):
        raise PlanError("plan stages must list every step once, in plan order")
    for si, st in enumerate(plan.stages):
        writer: dict[str, int] = {}
        for gi, g in enumerate(st):
            if not g:
                raise PlanError(f"stage {si} has an empty group")
            for i in g:
                if (plan.steps[i].stage, plan.steps[i].stream) != (si, gi):
                    raise PlanError(f"step {i} says stage {plan.steps[i].stage} stream "
                                    f"{plan.steps[i].stream}; the stages put it in {si}/{gi}")
                writer.update({v: gi for v in plan.steps[i].outputs})
        for gi, g in enumerate(st):
            for i in g:
                other = [v for v in plan.steps[i].inputs if writer.get(v, gi) != gi]
                if other:
                    raise PlanError(f"stage {si}: step {i} reads {other[0]!r}, which another group "
                                    "of the same stage writes")


# Constants up to this size stay in the plan JSON (scalars, small shape tensors); larger ones,
# the model's weights, are referred to by hash when the plan names its model file.
_INLINE_BYTES = 256
# Step kinds whose sub-graph is the cut of their nodes (tunedb.plan.subgraph.GraphIndex.cut).
_CUT_KINDS = ("fused", "matmul", "gemm", "conv2d", "pool", "layout", "layout_view", "op")


def source_of(model: Any, bindings: Mapping[str, int] | None = None, fill_initializers: bool = True
              ) -> dict[str, Any]:
    """What a plan records of a model file it was compiled from (``{}`` for in-memory models)."""
    if not isinstance(model, (str, Path)) or not Path(model).is_file():
        return {}
    p = Path(model).resolve()
    return {"model": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bindings": dict(sorted((bindings or {}).items())), "fill_initializers": fill_initializers}


def _with_constants(graph: Mapping[str, Any], source: Mapping[str, Any]) -> Mapping[str, Any]:
    """The graph JSON with every constant's bytes: those the plan refers to (``sha256`` instead
    of ``data``) are read from the model file it names, which must be unchanged."""
    refs = {k: c for k, c in (graph.get("constants") or {}).items() if "data" not in c}
    if not refs:
        return graph
    if not isinstance(source, Mapping) or not source.get("model"):
        raise PlanError("plan leaves out constants' bytes but names no model file to read them from")
    p = Path(str(source["model"]))
    if not p.is_file():
        raise PlanError(f"plan refers to model {p} for its weights, and that file is missing")
    if hashlib.sha256(p.read_bytes()).hexdigest() != source.get("sha256"):
        raise PlanError(f"model {p} changed since the plan was made (sha256 differs)")
    if p.suffix == ".json":
        model = infer_graph(Graph.from_json(json.loads(p.read_text())))
    else:
        from tunedb.graph.onnx_import import import_onnx

        model = import_onnx(str(p), dict(source.get("bindings") or {}),
                            fill_initializers=bool(source.get("fill_initializers", True)))
    have = model.constant_map
    if any(name not in have for name in refs):  # constants the planner's rewrites derive
        have = {**have, **rewrite_for_plan(model).constant_map}
    out = {**graph, "constants": dict(graph["constants"])}
    for name, ref in refs.items():
        c = have.get(name)
        if c is None or hashlib.sha256(c.data).hexdigest() != ref.get("sha256"):
            raise PlanError(f"model {p} has no constant {name!r} with the bytes the plan refers to")
        out["constants"][name] = c.to_json()
    return out


def _check_subgraphs(plan: Plan, graph: Graph) -> None:
    index = GraphIndex(graph)
    for k, s in enumerate(plan.steps):
        if not s.subgraph or s.kind not in _CUT_KINDS:
            continue
        cut = index.cut(s.nodes)
        try:
            claimed = canonical_json(json.loads(s.subgraph))
        except ValueError:
            raise PlanError(f"step {k} ({s.kind}): its sub-graph is not JSON") from None
        if sha256_hex(claimed) != sha256_hex(canonical_json(cut.graph.to_json())):
            raise PlanError(f"step {k} ({s.kind}, {'+'.join(s.ops)}): its sub-graph differs from "
                            "the graph's nodes it names (an edited plan)")
        if (cut.inputs, cut.outputs) != (s.inputs, s.outputs):
            raise PlanError(f"step {k} ({s.kind}): its inputs/outputs differ from the graph's")


@dataclass(frozen=True)
class Plan:
    """A compiled graph: ``steps`` in execution order over ``graph_json`` (canonical JSON text)."""

    graph_json: str = field(repr=False)
    steps: tuple[KernelStep, ...]
    buffers: BufferPlan = BufferPlan()
    device: str = ""            # device name / id the estimates are for ("" = generic H200 facts)
    launch_us: float = 2.5      # launch overhead added per kernel launch
    search: tuple[tuple[str, Any], ...] = ()  # how the plan was found (beam, states, seconds, ...)
    format: int = PLAN_FORMAT
    # IOS stages (tunedb.plan.stages): stage -> groups -> step indices; the groups of a stage run
    # concurrently, each on its own stream. Empty: every step in order on one stream.
    stages: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # The model file the graph came from (model path, its sha256, bindings; ``source_of``): the
    # JSON then refers to it for the constants' bytes instead of carrying weights.
    source: tuple[tuple[str, Any], ...] = ()
    # Superkernel packs (tunedb.plan.packing.PlanPack): consecutive GEMM/conv steps run together.
    packs: tuple[PlanPack, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "packs", tuple(self.packs))
        object.__setattr__(self, "search", _pairs(self.search))
        object.__setattr__(self, "source", _pairs(self.source))
        try:
            object.__setattr__(self, "stages", tuple(tuple(tuple(int(i) for i in g) for g in st)
                                                     for st in self.stages))
        except (TypeError, ValueError):
            raise PlanError("plan stages must be lists of groups of step indices") from None
        if self.format != PLAN_FORMAT:
            raise PlanError(f"plan format {self.format} is not supported (this tunedb reads {PLAN_FORMAT})")

    @cached_property
    def graph(self) -> Graph:
        return Graph.from_json(json.loads(self.graph_json))

    # -- totals -------------------------------------------------------------------------------
    @property
    def kernels(self) -> int:
        """Kernel launches per run."""
        return sum(s.launches for s in self.steps)

    @property
    def predicted_us(self) -> float:
        """Sum of the steps' predictions plus the launch overhead of every launch."""
        return sum(s.predicted_us for s in self.steps) + self.launch_us * self.kernels

    def totals(self) -> dict[str, Any]:
        by_source: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for s in self.steps:
            by_kind[s.kind] = by_kind.get(s.kind, 0) + 1
            if s.kind != "layout_view":
                by_source[s.cost_source] = by_source.get(s.cost_source, 0) + 1
        return {"steps": len(self.steps), "kernels": self.kernels,
                "predicted_us": round(self.predicted_us, 3),
                "fused_ops": sum(len(s.ops) for s in self.steps if s.kind == "fused"),
                "graph_ops": len(self.graph.nodes), "by_kind": by_kind, "cost_sources": by_source,
                "arena_bytes": self.buffers.arena_bytes, "naive_bytes": self.buffers.naive_bytes}

    def check(self) -> None:
        """Raise ``PlanError`` unless the steps compute every node of the graph exactly once,
        each step reads only graph inputs, constants and values of earlier steps (so the steps
        have no cycle), every graph output is computed, and each step's sub-graph is the cut of
        its nodes out of the graph (same canonical hash): an edited step cannot compute
        something else than the graph says."""
        g = self.graph
        seen: dict[int, int] = {}
        ready = set(g.inputs) | set(g.constant_map)
        for k, s in enumerate(self.steps):
            for j in s.nodes:
                if not 0 <= j < len(g.nodes):
                    raise PlanError(f"step {k} names node {j}; the graph has {len(g.nodes)} nodes")
                if j in seen:
                    raise PlanError(f"node {j} ({g.nodes[j].op}) is in steps {seen[j]} and {k}")
                seen[j] = k
            inside = {o for j in s.nodes for o in g.nodes[j].outputs}
            for j in s.nodes:
                for v in g.nodes[j].inputs:
                    if v not in inside and v not in ready:
                        raise PlanError(f"step {k} ({s.kind}) reads {v!r} before a step computes it")
            bad = [v for v in s.outputs if v not in inside]
            if bad:
                raise PlanError(f"step {k} ({s.kind}) lists output {bad[0]!r} it does not compute")
            ready |= set(s.outputs)
        missing = [j for j in range(len(g.nodes)) if j not in seen]
        if missing:
            raise PlanError(f"no step computes node {missing[0]} ({g.nodes[missing[0]].op})")
        absent = [v for v in g.outputs if v not in ready]
        if absent:
            raise PlanError(f"graph output {absent[0]!r} is not an output of any step")
        _check_subgraphs(self, g)
        if self.stages:
            _check_stages(self)
        if self.packs:
            try:
                check_packs(self)
            except ValueError as e:
                raise PlanError(str(e)) from None

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        graph = json.loads(self.graph_json)
        source = {k: _thaw(v) for k, v in self.source}
        if source:  # the model file holds the weights: refer to them by hash
            for c in graph.get("constants", {}).values():
                raw = base64.b64decode(c["data"])
                if len(raw) > _INLINE_BYTES:
                    c.pop("data")
                    c["sha256"] = hashlib.sha256(raw).hexdigest()
        return {"format": self.format, "device": self.device, "launch_us": self.launch_us,
                "search": {k: _thaw(v) for k, v in self.search},
                **({"source": source} if source else {}),
                "graph": graph, "steps": [s.to_json() for s in self.steps],
                "buffers": self.buffers.to_json(), "totals": self.totals(),
                **({"stages": [[list(g) for g in st] for st in self.stages]} if self.stages else {}),
                **({"packs": [p.to_json() for p in self.packs]} if self.packs else {})}

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @staticmethod
    def from_json(d: Mapping[str, Any] | str) -> Plan:
        """From ``to_json()``'s dict or its JSON text (``totals`` is recomputed, not read)."""
        if isinstance(d, (str, bytes)):
            try:
                d = json.loads(d)
            except ValueError as e:
                raise PlanError(f"plan is not valid JSON: {e}") from None
        if not isinstance(d, Mapping) or "steps" not in d or "graph" not in d:
            raise PlanError("plan JSON needs 'graph' and 'steps'")
        try:
            if not isinstance(d["steps"], list) or not isinstance(d["graph"], Mapping):
                raise PlanError("plan JSON: 'steps' must be a list and 'graph' an object")
            source = d.get("source") or {}
            plan = Plan(graph_json=canonical_json(_with_constants(d["graph"], source)),
                        steps=tuple(KernelStep.from_json(s) for s in d["steps"]),
                        buffers=BufferPlan.from_json(d.get("buffers", {})), device=str(d.get("device", "")),
                        launch_us=_number(d.get("launch_us", 2.5), "launch_us"), search=d.get("search", {}),
                        format=_int(d.get("format", PLAN_FORMAT), "format"),
                        stages=d.get("stages", ()) or (), source=source,
                        packs=tuple(PlanPack.from_json(p) for p in d.get("packs") or ()))
            plan.check()
        except GraphError as e:
            raise PlanError(f"plan graph: {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"malformed plan JSON: {' '.join(str(e).split())}") from None
        return plan

    # -- report -------------------------------------------------------------------------------
    def explain(self, width: int = 160) -> str:
        from tunedb.plan.explain import explain

        return explain(self, width=width)

    # -- execution ----------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, Any], backend: str = "cuda") -> dict[str, Any]:
        """Run the plan on ``inputs`` (graph input name -> array); returns the graph outputs.

        ``backend="cuda"`` hands the plan to the runtime's executor (CuPy; raises
        ``tunedb.runtime.NoGPUError`` where there is no GPU). ``backend="reference"`` runs the
        steps one by one with the float64 NumPy reference, in plan order through the buffer
        assignment's values: a CPU check that the steps compose to the whole graph."""
        if backend == "reference":
            return run_reference_steps(self, inputs)
        if backend != "cuda":
            raise PlanError(f"unknown backend {backend!r}; expected 'cuda' or 'reference'")

        return run_cuda(self, inputs)

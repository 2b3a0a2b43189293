"""The importer proper: walks an ONNX graph once, folding constants and emitting tunedb nodes.

Every ONNX value is either *computed* (``env``: its tunedb value in the builder) or *constant*
(``consts``: a NumPy array). A node whose inputs are all constants is evaluated right away, so
the shape arithmetic exporters emit (Shape -> Gather -> Concat -> Reshape, ConstantOfShape,
Range, Equal/Where on constants) never becomes a tunedb node. Folding runs the node's own tunedb
translation through tunedb's reference interpreter (the semantics the node would have at run
time); ops tunedb does not map (NonZero, Range, ...) go to ONNX's reference evaluator. A node
neither can fold stays a runtime node (logged at debug level): folding never aborts an import.
Shape and Size of computed values fold too: tunedb types are static. A constant feeding a
computed node becomes a tunedb constant on first use.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.ir import FLOAT_DTYPES, Graph, GraphError, Node, TensorType
from tunedb.graph.onnx_import._model import (
    BF16,
    OnnxImportError,
    dtype_of_array,
    dtype_of_onnx,
    one_line,
)
from tunedb.graph.onnx_import._ops import BINARY, FOLD_ONLY, UNARY, OpHandlers
from tunedb.graph.onnx_import._ops_ext import MoreOpHandlers
from tunedb.graph.onnx_import._ops_more import PadCropHandlers
from tunedb.graph.reference import run_reference

_log = logging.getLogger(__name__)

_DEFAULT_DOMAINS = ("", "ai.onnx")
# Never evaluated at import: random ops, and control flow whose bodies may read computed values.
_NO_FOLD = frozenset(("Bernoulli", "Multinomial", "If", "Loop", "Scan"))
# Ops whose float inputs ONNX types alike (one T); a constant of another float dtype among
# them is converted at import (``_constants_as_computed``).
_SAME_FLOAT_TYPE = frozenset(("Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub",
                              "Mul", "Div"))
# Node-name prefix of tunedb.graph.onnx_export's two-op spellings of rsqrt and ne.
SPELLED_PREFIX = "tunedb."


def supported_ops() -> tuple[str, ...]:
    """ONNX op types ``import_onnx`` maps (default domain)."""
    handled = {m[4:] for m in dir(Importer) if m.startswith("_op_")}
    return tuple(sorted(set(UNARY) | set(BINARY) | handled))


# The opsets whose op semantics the handlers implement (the package docstring says the same).
MIN_OPSET, MAX_OPSET = 11, 23

class Importer(OpHandlers, MoreOpHandlers, PadCropHandlers):
    def __init__(self, model: onnx.ModelProto, bindings: dict[str, int]) -> None:
        self.model = model
        self.bindings = bindings
        self.opset = next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS),
                          MAX_OPSET)
        if not MIN_OPSET <= self.opset <= MAX_OPSET:  # op semantics differ across opsets
            raise OnnxImportError(f"model uses ONNX opset {self.opset}; tunedb imports opsets "
                                  f"{MIN_OPSET}-{MAX_OPSET} (re-export it with one of those)")
        self.b = GraphBuilder(model.graph.name or "onnx")
        self.env: dict[str, str] = {}  # computed ONNX value -> builder value
        self.consts: dict[str, np.ndarray] = {}  # constant ONNX value -> its array
        self.materialised: set[str] = set()  # builder constants made from ``consts``
        self.node: onnx.NodeProto | None = None
        self._producer = {o: n for n in model.graph.node for o in n.output if o}
        self._used = {i for n in model.graph.node for i in n.input} | \
            {o.name for o in model.graph.output}

    # -- driver -------------------------------------------------------------------------------
    def run(self) -> Graph:
        g = self.model.graph
        for init in g.initializer:
            self.consts[init.name] = numpy_helper.to_array(init)
        for vi in g.input:
            if vi.name not in self.consts:  # an input with an initializer is a constant
                shape, dtype = self._input_type(vi)
                self.env[vi.name] = self.b.input(vi.name, shape, dtype)
        for node in g.node:
            self.node = node
            try:
                self._convert(node)
            except OnnxImportError:
                raise
            except GraphError as e:  # shape/dtype errors from inference: name the ONNX node
                raise self.err(one_line(e)) from None
            except (KeyError, ValueError, TypeError, IndexError) as e:  # malformed attributes
                raise self.err(f"{type(e).__name__}: {one_line(e)}") from None
        self.node = None
        outs = [self.val(o.name) for o in g.output]
        # A graph output that is an input, a constant or another output needs a node of its own.
        taken = set(self.b_inputs()) | self.materialised
        for i, v in enumerate(outs):
            if v in taken:
                outs[i] = self.b.identity(v)
            taken.add(outs[i])
        try:
            graph = self.b.build(outs)
        except GraphError as e:
            raise OnnxImportError(f"graph {g.name!r}: {one_line(e)}") from None
        return _rename(graph, dict(zip(outs, (o.name for o in g.output))))

    def b_inputs(self) -> list[str]:
        return [self.env[vi.name] for vi in self.model.graph.input if vi.name in self.env]

    def _input_type(self, vi: onnx.ValueInfoProto) -> tuple[tuple[int, ...], str]:
        t = vi.type
        if t.WhichOneof("value") != "tensor_type":
            raise OnnxImportError(f"input {vi.name!r} is not a tensor")
        dtype = dtype_of_onnx(t.tensor_type.elem_type, f"input {vi.name!r}")
        if not t.tensor_type.HasField("shape"):
            raise OnnxImportError(f"input {vi.name!r} has no shape; tunedb needs static shapes")
        dims = []
        for axis, d in enumerate(t.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.HasField("dim_param"):
                if d.dim_param not in self.bindings:
                    raise OnnxImportError(f"input {vi.name!r} has symbolic dim {d.dim_param!r}; give "
                                          f"its size with --bind {d.dim_param}=INT (Python: "
                                          f"bindings={{{d.dim_param!r}: INT}})")
                n = self.bindings[d.dim_param]
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                    raise OnnxImportError(f"binding {d.dim_param!r}={n!r} must be a positive int")
                dims.append(int(n))
            else:
                raise OnnxImportError(f"input {vi.name!r} has an unknown dim at axis {axis}; "
                                      f"tunedb needs static shapes")
        return tuple(dims), dtype

    def _convert(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        ms_rms = op == "SimplifiedLayerNormalization" and node.domain == "com.microsoft"
        if node.domain not in _DEFAULT_DOMAINS and not ms_rms:
            raise self._unsupported()
        ins = [i for i in node.input if i]
        # Any deterministic default-domain op on constants folds, supported or not: exporters'
        # shape arithmetic uses ops (NonZero, Einsum, ...) tunedb has no use for at run time.
        if not ms_rms and all(i in self.consts for i in ins) and (
                op in FOLD_ONLY or ins and op not in _NO_FOLD and not op.startswith("Random")):
            if self._fold(node):
                return
        if not self._maps(op):
            raise self._unsupported()
        if op in _SAME_FLOAT_TYPE:
            node = self.node = self._constants_as_computed(node)
        self._emit(node)

    def _constants_as_computed(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """``node`` with each float constant input whose dtype differs from its computed float
        inputs' one dtype converted to it now (a debug note each). ONNX types these inputs alike,
        but some optimizers fold a bf16 batch norm into a float32 conv weight; a constant cast at
        plan time is no runtime cast. Computed inputs of differing dtypes still fail."""
        ins = list(node.input)
        computed = {self.dtype(i) for i in ins if i and i not in self.consts}
        if len(computed) != 1 or not computed <= set(FLOAT_DTYPES):
            return node
        (want,) = computed
        changed = False
        for k, i in enumerate(ins):
            have = self.dtype(i) if i in self.consts else want
            if have != want and have in FLOAT_DTYPES:
                _log.debug("%s: constant %r cast from %s to %s at import", self._where(), i, have, want)
                key = f"{i}\0{want}"  # NUL cannot occur in an ONNX name (as in ``cast``)
                if key not in self.consts:
                    self.consts[key] = _as_dtype(self.consts[i].astype(np.float64), want)
                ins[k], changed = key, True
        if not changed:
            return node
        fixed = onnx.NodeProto()
        fixed.CopyFrom(node)
        fixed.input[:] = ins
        return fixed

    def _emit(self, node: onnx.NodeProto) -> None:
        """Translate ``node`` into tunedb nodes of ``self.b`` (constants become builder ones)."""
        op = node.op_type
        if op in FOLD_ONLY:
            raise self.err("needs constant inputs (tunedb graphs have static shapes)")
        elif self._spelled(node):
            return
        elif op in UNARY:
            self.set(0, self.b.op(UNARY[op], self.val(node.input[0])))
        elif op in BINARY:
            x, y = node.input[0], node.input[1]
            if op == "Pow" and self.dtype(y) != self.dtype(x):  # ONNX lets exponents differ
                self.set(0, self.b.pow(self.val(x), self.cast(y, self.dtype(x))))
            else:
                self.set(0, self.b.op(BINARY[op], self.val(x), self.val(y)))
        else:
            getattr(self, "_op_" + op)(node, _attrs(node))

    def _spelled(self, node: onnx.NodeProto) -> bool:
        """A tunedb primitive that ``graph_to_onnx`` spelled as two ONNX ops and marked by the
        second node's name (``tunedb.rsqrt``: Reciprocal of Sqrt, ``tunedb.ne``: Not of Equal)
        comes back as that primitive, so a written graph reads back with its own hash. The first
        op's node stays only if something else reads it."""
        src = self._producer.get(node.input[0]) if node.input else None
        if src is None or not node.name.startswith(SPELLED_PREFIX):
            return False
        prim = node.name[len(SPELLED_PREFIX):].split(":")[0]
        if prim == "rsqrt" and node.op_type == "Reciprocal" and src.op_type == "Sqrt":
            self.set(0, self.b.rsqrt(self.val(src.input[0])))
        elif prim == "ne" and node.op_type == "Not" and src.op_type == "Equal":
            self.set(0, self.b.ne(self.val(src.input[0]), self.val(src.input[1])))
        else:
            return False
        return True

    def _unsupported(self) -> OnnxImportError:
        n = self.node
        dom = f" in domain {n.domain!r}" if n.domain not in _DEFAULT_DOMAINS else ""
        ops = supported_ops()
        return OnnxImportError(
            f"unsupported ONNX op {n.op_type!r}{dom} (node {n.name or n.output[0]!r}); tunedb "
            f"supports {len(ops)} ops: {', '.join(ops[:6])}, ... (`tunedb onnx-ops` lists them)")

    def _where(self) -> str:
        n = self.node
        return f"ONNX node {n.name or n.output[0]!r} ({n.op_type})" if n is not None else "graph"

    def err(self, msg: str) -> OnnxImportError:
        return OnnxImportError(f"{self._where()}: {msg}")

    def _maps(self, op: str) -> bool:
        """Whether tunedb has a runtime translation of default-domain ``op``."""
        return op in UNARY or op in BINARY or getattr(self, "_op_" + op, None) is not None

    def _fold(self, node: onnx.NodeProto) -> bool:
        """Evaluate an all-constant node into ``consts``; False (and a debug note) when it cannot
        be folded but can run, so that the caller converts it as a runtime node."""
        errors = []
        if self._maps(node.op_type):
            try:
                return self._fold_tunedb(node)
            except (GraphError, KeyError, ValueError, TypeError, IndexError) as e:
                errors.append(f"tunedb reference: {one_line(e)}")
        from onnx.reference import ReferenceEvaluator  # heavy import, needed only here

        feeds = {i: self.consts[i] for i in node.input if i}
        try:
            outs = ReferenceEvaluator(node, opsets={"": self.opset}).run(None, feeds)
        except Exception as e:  # any evaluator failure is this node's problem
            errors.append(f"onnx reference: {one_line(e)}")
        else:
            for name, v in zip(node.output, outs):
                if name:
                    self.consts[name] = np.asarray(v)
            return True
        if node.op_type in FOLD_ONLY or not self._maps(node.op_type):
            raise self.err(f"constant folding failed: {'; '.join(errors)}")
        _log.debug("%s: not folded, kept as a runtime node (%s)", self._where(), "; ".join(errors))
        return False

    def _fold_tunedb(self, node: onnx.NodeProto) -> bool:
        """Fold through the node's tunedb translation: it is emitted into a scratch builder whose
        only values are the constant inputs, then run by ``run_reference`` (float64) and rounded
        to the output types. The importer's builder state is swapped out meanwhile."""
        saved = self.b, self.env, self.materialised
        self.b, self.env, self.materialised = GraphBuilder("fold"), {}, set()
        try:
            before = set(self.consts)
            self._emit(node)
            pending = [(o, self.env[o]) for o in node.output
                       if o and o in self.env and o not in before]
            if pending:
                outs = [self.b.identity(v) if v in self.materialised else v for _, v in pending]
                graph = self.b.build(outs)
                types = graph.type_map
                got = run_reference(graph, {})
                for (o, _), v in zip(pending, graph.outputs):
                    self.consts[o] = _as_dtype(got[v], types[v].dtype)
        finally:
            self.b, self.env, self.materialised = saved
        return True

    # -- values -------------------------------------------------------------------------------
    def val(self, name: str) -> str:
        """Builder value of an ONNX value; a folded constant becomes a builder constant."""
        if name in self.env:
            return self.env[name]
        if name in self.consts:
            a = self.consts[name]
            try:
                dtype = dtype_of_array(a, f"constant {name!r}")
            except OnnxImportError as e:
                raise self.err(str(e)) from None
            v = self.b.constant(a.astype(np.float32) if dtype == "bfloat16" else a, dtype=dtype)
            self.env[name] = v
            self.materialised.add(v)
            return v
        raise self.err(f"input {name!r} is not produced by any earlier node")

    def set(self, i: int, value: str) -> None:
        self.env[self.node.output[i]] = value

    def ty(self, name: str) -> TensorType:
        if name in self.consts and name not in self.env:
            a = self.consts[name]
            return TensorType(a.shape, dtype_of_array(a, f"constant {name!r}"))
        return self.b.type_of(self.val(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.consts[name].shape) if name in self.consts else self.ty(name).shape

    def dtype(self, name: str) -> str:
        return self.ty(name).dtype

    def dtype_of_onnx(self, elem_type: int) -> str:
        try:
            return dtype_of_onnx(elem_type, "target")
        except OnnxImportError as e:
            raise self.err(str(e)) from None

    def const(self, i: int, what: str) -> np.ndarray | None:
        """Constant value of input ``i`` (None when the optional input is absent)."""
        n = self.node
        if i >= len(n.input) or not n.input[i]:
            return None
        if n.input[i] not in self.consts:
            raise self.err(f"input {what!r} must be a constant (it is computed: {n.input[i]!r})")
        return self.consts[n.input[i]]

    def ints(self, i: int, what: str) -> list[int] | None:
        c = self.const(i, what)
        return None if c is None else [int(v) for v in np.asarray(c).reshape(-1)]

    def opt(self, i: int) -> str | None:
        n = self.node
        return self.val(n.input[i]) if i < len(n.input) and n.input[i] else None

    def cast(self, name: str, dtype: str) -> str:
        """``name`` as ``dtype``: a constant is converted here, a computed value gets a cast."""
        if self.dtype(name) == dtype:
            return self.val(name)
        if name in self.consts and name not in self.env:
            a = self.consts[name]
            with np.errstate(invalid="ignore"):  # inf/nan to int: undefined in ONNX, as in C
                a = a.astype(np.float32).astype(BF16) if dtype == "bfloat16" else a.astype(dtype)
            key = f"{name}\0{dtype}"  # NUL cannot occur in an ONNX name
            self.consts[key] = a
            return self.val(key)
        return self.b.cast(self.val(name), to=dtype)

    def unused(self, first: int, what: str) -> None:
        """Error when optional outputs ``first..`` (not supported) feed anything."""
        for o in self.node.output[first:]:
            if o and o in self._used:
                raise self.err(f"output {o!r} ({what}) is not supported")

    @staticmethod
    def axis(axis: int, rank: int) -> int:
        return axis + rank if axis < 0 else axis

    def _axes(self, a: dict, attr_before: int) -> list[int] | None:
        """Axes from the attribute (opset < attr_before) or else from input 1."""
        if self.opset < attr_before or "axes" in a:
            return None if a.get("axes") is None else [int(x) for x in a["axes"]]
        return self.ints(1, "axes")


def _as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """A reference result (float64/int64/bool) rounded to a tunedb dtype as a NumPy array."""
    with np.errstate(invalid="ignore"):  # inf/nan to int: undefined in ONNX, as in C
        return a.astype(np.float32).astype(BF16) if dtype == "bfloat16" else a.astype(dtype)


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _rename(graph: Graph, names: dict[str, str]) -> Graph:
    """Give graph outputs their ONNX names where no other value has that name already."""
    values = {k for k, _ in graph.types}
    m: dict[str, str] = {}
    for old, new in names.items():
        if old != new and new not in values and old not in graph.inputs:
            m[old] = new
            values.add(new)
    if not m:
        return graph
    r = lambda v: m.get(v, v)  # noqa: E731
    return Graph(
        inputs=graph.inputs, outputs=tuple(r(v) for v in graph.outputs),
        nodes=tuple(Node(n.op, tuple(r(v) for v in n.inputs), tuple(r(v) for v in n.outputs), n.attrs)
                    for n in graph.nodes),
        types={r(k): t for k, t in graph.types}, constants=graph.constants, name=graph.name)

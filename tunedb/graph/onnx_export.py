"""Write a tunedb graph as an ONNX model (opset 20), so that workloads cut out of models can be
stored as ONNX, read back by ``import_onnx`` and run by onnxruntime.

    model = graph_to_onnx(graph)
    onnx.save(model, "workload.onnx")

Every primitive maps to one ONNX op, or a short spelling where ONNX has none: ``rsqrt`` is
Reciprocal(Sqrt), ``ne`` Not(Equal) (their second node's name, ``tunedb.rsqrt:...`` and
``tunedb.ne:...``, tells ``import_onnx`` to read the primitive back), float ``mod`` is
a - floor(a / b) * b. Importing the file gives the same graph, hash included, except where a
float ``mod`` was spelled out.
Constants become initializers, attribute-like operands (axes, shapes, pads) constant inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tunedb.graph.ir import FLOAT_DTYPES, Constant, Graph, GraphError, Node, TensorType
from tunedb.graph.ops import check_node, infer_graph

OPSET = 20  # Gelu arrived in opset 20; axes are inputs of every Reduce* from 18
_ONNX_DTYPE = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
               "bfloat16": onnx.TensorProto.BFLOAT16, "int32": onnx.TensorProto.INT32,
               "int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL}
_SAME = {"neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt",
         "reciprocal": "Reciprocal", "sin": "Sin", "cos": "Cos", "tanh": "Tanh",
         "sigmoid": "Sigmoid", "relu": "Relu", "erf": "Erf", "floor": "Floor", "ceil": "Ceil",
         "sign": "Sign", "not": "Not", "identity": "Identity", "add": "Add", "sub": "Sub",
         "mul": "Mul", "div": "Div", "pow": "Pow", "max": "Max", "min": "Min", "eq": "Equal",
         "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual", "and": "And",
         "or": "Or", "where": "Where", "matmul": "MatMul", "global_avg_pool": "GlobalAveragePool",
         "global_max_pool": "GlobalMaxPool"}
_REDUCE = {"reduce_sum": "ReduceSum", "reduce_mean": "ReduceMean", "reduce_max": "ReduceMax",
           "reduce_min": "ReduceMin", "reduce_prod": "ReduceProd"}


def _np_of(const: Constant) -> np.ndarray:
    a = const.array
    if const.type.dtype == "bfloat16":  # ml_dtypes comes with onnx
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a


class _Writer:
    def __init__(self, graph: Graph) -> None:
        self.graph = infer_graph(graph)
        self.types = self.graph.type_map
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"_{hint}{self.count}"

    def const(self, array: np.ndarray, hint: str = "k") -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, values, hint: str = "i") -> str:
        return self.const(np.asarray(values, np.int64).reshape(-1), hint)

    def scalar_like(self, value: float, dtype: str) -> str:
        const = Constant.from_array(np.array(value), dtype=dtype)
        return self.const(_np_of(const), "s")

    def emit(self, op: str, ins: list[str], outs: list[str], name: str | None = None, **attrs) -> None:
        self.nodes.append(helper.make_node(op, ins, outs, name=name, **attrs))

    def node(self, n: Node) -> None:
        _, a = check_node(n, [self.types[v] for v in n.inputs])
        op, ins, outs = n.op, list(n.inputs), list(n.outputs)
        dtype = self.types[ins[0]].dtype if ins else "float32"
        if op in _SAME:
            self.emit(_SAME[op], ins, outs)
        elif op == "rsqrt":  # the name marks the pair for import_onnx (SPELLED_PREFIX)
            s = self.fresh("sqrt")
            self.emit("Sqrt", ins, [s])
            self.emit("Reciprocal", [s], outs, name=f"tunedb.rsqrt:{outs[0]}")
        elif op == "ne":
            e = self.fresh("eq")
            self.emit("Equal", ins, [e])
            self.emit("Not", [e], outs, name=f"tunedb.ne:{outs[0]}")
        elif op == "mod":
            if dtype in FLOAT_DTYPES:  # ONNX Mod needs fmod=1 on floats: C's sign, not Python's
                q, f, p = self.fresh("q"), self.fresh("f"), self.fresh("p")
                self.emit("Div", ins, [q])
                self.emit("Floor", [q], [f])
                self.emit("Mul", [f, ins[1]], [p])
                self.emit("Sub", [ins[0], p], outs)
            else:
                self.emit("Mod", ins, outs, fmod=0)
        elif op == "gelu":
            self.emit("Gelu", ins, outs, approximate=a["approximate"])
        elif op == "leaky_relu":
            self.emit("LeakyRelu", ins, outs, alpha=a["alpha"])
        elif op == "clip":
            lo = self.scalar_like(a["min"], dtype) if a["min"] is not None else ""
            hi = self.scalar_like(a["max"], dtype) if a["max"] is not None else ""
            self.emit("Clip", ins + [lo, hi], outs)
        elif op == "cast":
            self.emit("Cast", ins, outs, to=_ONNX_DTYPE[a["to"]])
        elif op in _REDUCE:
            axes = [self.ints(a["axes"], "axes")] if a["axes"] is not None else []
            self.emit(_REDUCE[op], ins + axes, outs, keepdims=int(a["keepdims"]))
        elif op == "argmax":
            self.emit("ArgMax", ins, outs, axis=a["axis"], keepdims=int(a["keepdims"]))
        elif op == "transpose":
            self.emit("Transpose", ins, outs, perm=list(a["perm"]))
        elif op in ("reshape", "expand"):
            self.emit(op.capitalize(), ins + [self.ints(a["shape"], "shape")], outs)
        elif op in ("squeeze", "unsqueeze"):
            self.emit(op.capitalize(), ins + [self.ints(a["axes"], "axes")], outs)
        elif op == "slice":
            self.emit("Slice", ins + [self.ints(a[k], k) for k in ("starts", "ends", "axes", "steps")],
                      outs)
        elif op == "concat":
            self.emit("Concat", ins, outs, axis=a["axis"])
        elif op == "split":
            self.emit("Split", ins + [self.ints(a["sizes"], "split")], outs, axis=a["axis"])
        elif op == "pad":
            self.emit("Pad", ins + [self.ints(a["pads"], "pads"), self.scalar_like(a["value"], dtype)],
                      outs)
        elif op in ("gather", "gather_elements"):
            self.emit("Gather" if op == "gather" else "GatherElements", ins, outs, axis=a["axis"])
        elif op == "gemm":
            self.emit("Gemm", ins, outs, alpha=a["alpha"], beta=a["beta"], transA=int(a["trans_a"]),
                      transB=int(a["trans_b"]))
        elif op == "conv2d":
            self.emit("Conv", ins, outs, strides=list(a["strides"]), pads=list(a["pads"]),
                      dilations=list(a["dilations"]), group=a["groups"])
        elif op in ("max_pool2d", "avg_pool2d"):
            kw = {"kernel_shape": list(a["kernel"]), "strides": list(a["strides"]),
                  "pads": list(a["pads"]), "ceil_mode": int(a["ceil_mode"])}
            if op == "max_pool2d":
                self.emit("MaxPool", ins, outs, dilations=list(a["dilations"]), **kw)
            else:
                self.emit("AveragePool", ins, outs, count_include_pad=int(a["count_include_pad"]), **kw)
        else:  # pragma: no cover - every op of OP_SPECS is handled above
            raise GraphError(f"graph_to_onnx: no ONNX spelling for op {op!r}")

    def value_info(self, v: str) -> onnx.ValueInfoProto:
        t: TensorType = self.types[v]
        return helper.make_tensor_value_info(v, _ONNX_DTYPE[t.dtype], list(t.shape))

    def model(self) -> onnx.ModelProto:
        g = self.graph
        for v, c in g.constants:
            self.inits.append(numpy_helper.from_array(_np_of(c), v))
        for n in g.nodes:
            self.node(n)
        outs = list(g.outputs)
        if len(set(outs)) != len(outs) or set(outs) & set(g.inputs):
            raise GraphError("graph_to_onnx: an output listed twice or that is an input has no "
                             "ONNX spelling; give it an identity node")
        graph = helper.make_graph(self.nodes, g.name or "tunedb", [self.value_info(v) for v in g.inputs],
                                  [self.value_info(v) for v in outs], initializer=self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="tunedb")
        m.ir_version = 10  # what onnxruntime 1.16+ and the checker accept for opset 20
        return m


def graph_to_onnx(graph: Graph) -> onnx.ModelProto:
    """``graph`` as a checked ONNX model of opset 20 (see the module docstring)."""
    model = _Writer(graph).model()
    onnx.checker.check_model(model)
    return model

"""Peer executors: run a tunedb Graph through PyTorch (eager / torch.compile) or JAX (jit / XLA).

Each translator walks the graph once and returns a Python function of the graph inputs, so the
peers compute exactly the subgraph tunedb fused, on the same inputs. Only the benchmark imports
this module, on a machine that has the frameworks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunedb.graph.ir import Graph, Node

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "int32": "int32", "int64": "int64", "bool": "bool"}


def _axes(node: Node, rank: int) -> tuple[int, ...]:
    axes = node.attr("axes")
    return tuple(range(rank)) if axes is None else tuple(a % rank for a in axes)


def _torch_op(torch: Any, node: Node, args: list[Any], graph: Graph) -> Any:  # noqa: C901
    op, a = node.op, node.attr
    x = args[0] if args else None
    unary = {
        "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
        "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
        "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "erf": torch.erf,
        "floor": torch.floor, "ceil": torch.ceil, "sign": torch.sign, "not": torch.logical_not,
        "identity": lambda t: t,
    }
    binary = {
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
        "max": torch.maximum, "min": torch.minimum, "mod": torch.fmod, "eq": torch.eq, "ne": torch.ne,
        "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "and": torch.logical_and,
        "or": torch.logical_or,
    }
    if op in unary:
        return unary[op](x)
    if op in binary:
        return binary[op](args[0], args[1])
    if op == "gelu":
        return torch.nn.functional.gelu(x, approximate=a("approximate"))
    if op == "clip":
        return torch.clamp(x, a("min"), a("max"))
    if op == "leaky_relu":
        return torch.nn.functional.leaky_relu(x, a("alpha"))
    if op == "cast":
        return x.to(getattr(torch, _TORCH_DTYPES[a("to")]))
    if op == "where":
        return torch.where(args[0], args[1], args[2])
    if op.startswith("reduce_"):
        dims = _axes(node, x.dim())
        keep = bool(a("keepdims"))
        if op == "reduce_sum":
            return torch.sum(x, dim=dims, keepdim=keep)
        if op == "reduce_mean":
            return torch.mean(x, dim=dims, keepdim=keep)
        if op == "reduce_max":
            return torch.amax(x, dim=dims, keepdim=keep)
        if op == "reduce_min":
            return torch.amin(x, dim=dims, keepdim=keep)
    if op == "transpose":
        perm = a("perm") or tuple(reversed(range(x.dim())))
        return x.permute(*perm)
    if op in ("reshape", "expand"):
        shape = graph.type_of(node.outputs[0]).shape
        return x.reshape(shape) if op == "reshape" else x.expand(*shape)
    if op in ("squeeze", "unsqueeze"):
        return x.reshape(graph.type_of(node.outputs[0]).shape)
    if op == "gather_elements":  # torch.gather takes int64 indices only
        return torch.gather(x, a("axis") % x.dim(), args[1].long())
    if op == "gather":
        return torch.index_select(x, a("axis") % x.dim(), args[1].reshape(-1)).reshape(
            graph.type_of(node.outputs[0]).shape)
    if op == "concat":
        return torch.cat(args, dim=a("axis"))
    if op == "matmul":
        return torch.matmul(args[0], args[1])
    raise NotImplementedError(f"torch peer has no translation for op {op!r}")


def _jax_op(jnp: Any, jax: Any, node: Node, args: list[Any], graph: Graph) -> Any:  # noqa: C901
    op, a = node.op, node.attr
    x = args[0] if args else None
    unary = {
        "neg": jnp.negative, "abs": jnp.abs, "exp": jnp.exp, "log": jnp.log, "sqrt": jnp.sqrt,
        "rsqrt": jax.lax.rsqrt, "reciprocal": jnp.reciprocal, "sin": jnp.sin, "cos": jnp.cos,
        "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid, "relu": jax.nn.relu, "erf": jax.scipy.special.erf,
        "floor": jnp.floor, "ceil": jnp.ceil, "sign": jnp.sign, "not": jnp.logical_not,
        "identity": lambda t: t,
    }
    binary = {
        "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
        "pow": jnp.power, "max": jnp.maximum, "min": jnp.minimum, "mod": jnp.fmod, "eq": jnp.equal,
        "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater,
        "ge": jnp.greater_equal, "and": jnp.logical_and, "or": jnp.logical_or,
    }
    if op in unary:
        return unary[op](x)
    if op in binary:
        return binary[op](args[0], args[1])
    if op == "gelu":
        return jax.nn.gelu(x, approximate=a("approximate") == "tanh")
    if op == "clip":
        return jnp.clip(x, a("min"), a("max"))
    if op == "leaky_relu":
        return jax.nn.leaky_relu(x, a("alpha"))
    if op == "cast":
        return x.astype(jnp.dtype(a("to")))
    if op == "where":
        return jnp.where(args[0], args[1], args[2])
    if op.startswith("reduce_"):
        axes = _axes(node, x.ndim)
        keep = bool(a("keepdims"))
        fn = {"reduce_sum": jnp.sum, "reduce_mean": jnp.mean, "reduce_max": jnp.max,
              "reduce_min": jnp.min}[op]
        if op in ("reduce_sum", "reduce_mean") and x.dtype != jnp.float32:
            return fn(x, axis=axes, keepdims=keep, dtype=jnp.float32).astype(x.dtype)
        return fn(x, axis=axes, keepdims=keep)
    if op == "transpose":
        return jnp.transpose(x, a("perm"))
    if op in ("reshape", "squeeze", "unsqueeze"):
        return jnp.reshape(x, graph.type_of(node.outputs[0]).shape)
    if op == "expand":
        return jnp.broadcast_to(x, graph.type_of(node.outputs[0]).shape)
    if op == "gather_elements":
        return jnp.take_along_axis(x, args[1], axis=a("axis"))
    if op == "gather":
        return jnp.take(x, args[1], axis=a("axis"))
    if op == "concat":
        return jnp.concatenate(args, axis=a("axis"))
    if op == "matmul":
        return jnp.matmul(args[0], args[1])
    raise NotImplementedError(f"jax peer has no translation for op {op!r}")


def _interpret(graph: Graph, make_const: Callable[[Any], Any],
               apply: Callable[[Node, list[Any]], Any]) -> Callable[..., tuple]:
    # Constants are made once, here: converting (uploading) them inside ``fn`` would put a
    # host-to-device copy into every timed call and into torch.compile's trace.
    consts = {name: make_const(c) for name, c in graph.constants}

    def fn(*inputs: Any) -> tuple:
        env: dict[str, Any] = dict(zip(graph.inputs, inputs))
        for node in graph.nodes:
            args = []
            for name in node.inputs:
                if name not in env and name in consts:
                    env[name] = consts[name]
                args.append(env[name])
            out = apply(node, args)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            env.update(zip(node.outputs, outs))
        return tuple(env[o] for o in graph.outputs)

    return fn


def torch_function(graph: Graph, device: str = "cuda") -> Callable[..., tuple]:
    """The graph as a PyTorch function of its inputs (tensors on ``device`` in, a tuple of
    tensors out)."""
    import torch

    def const(c: Any) -> Any:
        t = torch.from_numpy(c.array).to(device)
        return t.to(getattr(torch, _TORCH_DTYPES[c.type.dtype]))

    return _interpret(graph, const, lambda n, args: _torch_op(torch, n, args, graph))


def jax_function(graph: Graph) -> Callable[..., tuple]:
    """The graph as a JAX function of its inputs, to be wrapped in ``jax.jit``."""
    import jax
    import jax.numpy as jnp

    def const(c: Any) -> Any:
        return jnp.asarray(c.array, dtype=jnp.dtype(c.type.dtype))

    return _interpret(graph, const, lambda n, args: _jax_op(jnp, jax, n, args, graph))


def throughput_us(run: Callable[[], Any], sync: Callable[[], None], target_s: float = 0.25) -> float:
    """Throughput-mode time in µs: back-to-back calls, synchronise, wall / calls; median of 5
    batches after 3 warm-ups (the protocol the anchor table uses for every peer)."""
    import time

    for _ in range(3):
        run()
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    iters = max(5, min(2000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sync()
        samples.append((time.perf_counter() - t0) / iters)
    return sorted(samples)[2] * 1e6



# -- running a peer on given host arrays (used by ``tunedb.bench.fusion``) ---------------------
PEER_KINDS = ("torch_eager", "torch_compile", "jax")


class Frameworks:
    """torch and jax, imported once; an import failure (or, with ``gpu``, no CUDA device for
    them) is kept as the error of their peers."""

    def __init__(self, gpu: bool = True) -> None:
        import os

        # JAX must not grab 75 % of GPU memory: CuPy and torch share the device with it.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        self.torch: Any = None
        self.jax: Any = None
        self.errors: dict[str, str] = {}
        try:
            import torch

            if gpu and not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            self.torch = torch
        except Exception as e:  # noqa: BLE001 - recorded, the other peers still run
            self.errors["torch"] = f"torch unavailable: {type(e).__name__}: {' '.join(str(e).split())}"[:300]
        try:
            import jax

            if gpu:
                jax.devices("gpu")
            self.jax = jax
        except Exception as e:  # noqa: BLE001
            self.errors["jax"] = f"jax unavailable: {type(e).__name__}: {' '.join(str(e).split())}"[:300]


def peer_call(fw: Frameworks, kind: str, graph: Graph, arrays: dict[str, Any], device: str = "cuda"
              ) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(run, sync)`` for one peer (``PEER_KINDS``) on the graph inputs ``arrays`` (host NumPy,
    bfloat16 given as its uint16 bits): ``run()`` enqueues one call and returns its outputs.
    ``device`` is torch's (JAX uses its default device)."""
    import numpy as np

    types = [graph.type_of(n) for n in graph.inputs]
    if kind in ("torch_eager", "torch_compile"):
        torch = fw.torch
        if torch is None:
            raise RuntimeError(fw.errors.get("torch", "torch unavailable"))
        ins = []
        for n, t in zip(graph.inputs, types):
            a = np.ascontiguousarray(arrays[n])
            ins.append(torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
                       if t.dtype == "bfloat16" else torch.from_numpy(a).to(device))
        fn = torch_function(graph, device)
        if kind == "torch_compile":
            # The interpreted functions of all graphs share one code object: without a reset,
            # dynamo's recompile limit would silently turn later graphs into eager runs.
            torch._dynamo.reset()
            fn = torch.compile(fn, dynamic=False)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        return (lambda: fn(*ins)), sync
    if kind != "jax":
        raise ValueError(f"unknown peer {kind!r}; expected one of {', '.join(PEER_KINDS)}")
    jax = fw.jax
    if jax is None:
        raise RuntimeError(fw.errors.get("jax", "jax unavailable"))
    jins = []
    for n, t in zip(graph.inputs, types):
        a = np.ascontiguousarray(arrays[n])
        if t.dtype == "bfloat16":
            import ml_dtypes  # ships with jax

            a = a.view(ml_dtypes.bfloat16)
        jins.append(jax.device_put(a))
    jfn = jax.jit(jax_function(graph))
    last: dict[str, Any] = {}

    def run() -> Any:
        last["y"] = jfn(*jins)
        return last["y"]

    def sync() -> None:
        if "y" in last:
            jax.block_until_ready(last["y"])

    return run, sync


def outputs_float64(outs: Any) -> list:
    """A peer's outputs (torch tensors or JAX arrays) as float64 NumPy arrays."""
    import numpy as np

    res = []
    for o in outs if isinstance(outs, (tuple, list)) else (outs,):
        if hasattr(o, "detach"):  # torch; NumPy has no bfloat16
            o = o.detach()
            o = (o.float() if o.is_floating_point() else o).cpu().numpy()
        res.append(np.asarray(o).astype(np.float64))
    return res


def _copy_us(cp: Any, sync: Callable[[], None], nbytes: int) -> float:
    a = cp.empty(nbytes // 4, dtype=cp.float32)
    a[...] = 1.0
    b = cp.empty_like(a)
    return throughput_us(lambda: b.__setitem__(Ellipsis, a), sync)


def copy_tbps(cp: Any, sync: Callable[[], None], nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, read + write counted (the anchors' floor)."""
    t = _copy_us(cp, sync, nbytes)
    cp.get_default_memory_pool().free_all_blocks()  # the two buffers died with _copy_us
    return 2 * nbytes / (t * 1e-6) / 1e12

"""Peer executors: run a tunedb Graph through PyTorch (eager / torch.compile) or JAX (jit / XLA).

Each translator walks the graph once and returns a Python function of the graph inputs, so the
peers compute exactly the subgraph tunedb fused, on the same inputs. Only the benchmark imports
this module, on a machine that has the frameworks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunedb.bench.peer_ops import JAX_OPS, TORCH_DTYPES, TORCH_OPS, jax_op, torch_op
from tunedb.graph.ir import Graph, Node

_TORCH_DTYPES = TORCH_DTYPES
__all__ = ["JAX_OPS", "PEER_KINDS", "TORCH_OPS", "Frameworks", "jax_function", "outputs_float64", "peer_call",
           "throughput_us", "torch_function"]


def _torch_op(torch: Any, node: Node, args: list[Any], graph: Graph) -> Any:
    """One node in PyTorch (the table ``peer_ops.TORCH_OPS``)."""
    return torch_op(torch, node, args, graph)


def _jax_op(jnp: Any, jax: Any, node: Node, args: list[Any], graph: Graph) -> Any:
    """One node in JAX (the table ``peer_ops.JAX_OPS``)."""
    return jax_op(jnp, jax, node, args, graph)


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


def interleaved_rounds(items: dict[str, tuple[Callable[[], Any], Callable[[], None]]], n: int,
                       target_s: float, after_round: Callable[[], None] | None = None
                       ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``n`` rounds, each timing every item once by ``throughput_us``, the order rotated by one
    per round so no item always runs first or after the same neighbour. An item that raises
    leaves the rounds with its one-line error; the others go on. Returns (µs per round, errors)."""
    names = list(items)
    us: dict[str, list[float]] = {k: [] for k in names}
    errors: dict[str, str] = {}
    for r in range(n if names else 0):
        k0 = r % len(names)
        for k in names[k0:] + names[:k0]:
            if k in errors:
                continue
            try:
                us[k].append(round(throughput_us(*items[k], target_s=target_s), 2))
            except Exception as e:  # noqa: BLE001 - the item leaves the rounds, the others go on
                errors[k] = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        if after_round is not None:
            after_round()
    return us, errors



# -- running a peer on given host arrays (used by ``tunedb.bench.fusion``) ---------------------
PEER_KINDS = ("torch_eager", "torch_compile", "jax", "torch_compile_ro")
# torch_compile_ro: torch.compile(mode="reduce-overhead"), i.e. with CUDA graphs; a call's outputs
# live in torch's graph pool and are overwritten by the next call.


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


def _loaded(fw: Frameworks, name: str) -> Any:
    """The framework module ``name`` of ``fw``, or why it could not be imported (RuntimeError)."""
    mod = getattr(fw, name)
    if mod is None:
        raise RuntimeError(fw.errors.get(name, f"{name} unavailable"))
    return mod


def peer_call(fw: Frameworks, kind: str, graph: Graph, arrays: dict[str, Any], device: str = "cuda"
              ) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(run, sync)`` for one peer (``PEER_KINDS``) on the graph inputs ``arrays`` (host NumPy,
    bfloat16 given as its uint16 bits): ``run()`` enqueues one call and returns its outputs.
    ``device`` is torch's (JAX uses its default device)."""
    import numpy as np

    # (contiguous host array, holds bfloat16 bits) of each input, in order
    host = [(np.ascontiguousarray(arrays[n]), graph.type_of(n).dtype == "bfloat16") for n in graph.inputs]
    if kind in ("torch_eager", "torch_compile", "torch_compile_ro"):
        torch = _loaded(fw, "torch")
        ins = [torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16) if bf16
               else torch.from_numpy(a).to(device) for a, bf16 in host]
        fn = _straight_line(torch, torch_function(graph, device), ins)
        if kind in ("torch_compile", "torch_compile_ro"):
            # The interpreted functions of all graphs share one code object: without a reset,
            # dynamo's recompile limit would silently turn later graphs into eager runs.
            torch._dynamo.reset()
            mode = "reduce-overhead" if kind == "torch_compile_ro" else None
            fn = torch.compile(fn, dynamic=False, mode=mode)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        return (lambda: fn(*ins)), sync
    if kind != "jax":
        raise ValueError(f"unknown peer {kind!r}; expected one of {', '.join(PEER_KINDS)}")
    jax = _loaded(fw, "jax")
    if any(bf16 for _, bf16 in host):
        import ml_dtypes  # ships with jax

        host = [(a.view(ml_dtypes.bfloat16) if bf16 else a, bf16) for a, bf16 in host]
    jins = [jax.device_put(a) for a, _ in host]
    jfn = jax.jit(jax_function(graph))
    last: dict[str, Any] = {}

    def run() -> Any:
        last["y"] = jfn(*jins)
        return last["y"]

    def sync() -> None:
        if "y" in last:
            jax.block_until_ready(last["y"])

    return run, sync


def _straight_line(torch: Any, fn: Callable[..., tuple], ins: list) -> Callable[..., tuple]:
    """The interpreted graph function traced once into a straight-line FX GraphModule of ATen
    calls. Handing dynamo the interpreter itself makes it guard on every node record it reads,
    and evaluating those guards on each call cost more than the kernels (torch.compile ran
    slower than eager); the traced module has no such closure state. Falls back to ``fn``."""
    try:
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(fn)(*ins)
    except Exception:  # noqa: BLE001 - an op make_fx cannot trace: the interpreter still runs
        return fn


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

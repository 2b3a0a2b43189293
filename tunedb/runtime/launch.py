"""The one launch path of generated kernels on the GPU: the measurement worker, the plan executor
and the GPU tests compile and launch a ``KernelPlan`` (or its wire form, ``plan_to_wire``)
through these two functions.

``kernel_function`` compiles a kernel's source with NVRTC (``cupy.RawModule``, kept in the
caller's module cache) and opts in to dynamic shared memory above 48 KiB; ``launcher`` binds the
kernels' arguments to buffers once and returns the closure that enqueues the whole plan: the
scratch buffers that need zeros are memset, then every kernel runs, in order, on ``stream``
(``None``: CuPy's current stream). CuPy arrives as an argument: this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
SHARED_DEFAULT = 48 * 1024  # dynamic shared memory a kernel gets without opting in

_SCALAR_TYPES = {"int32": np.int32, "int64": np.int64, "uint32": np.uint32, "uint64": np.uint64,
                 "float32": np.float32, "float64": np.float64, "float": np.float32, "int": np.int32}


def field(kernel: Any, name: str, default: Any = None) -> Any:
    """A kernel's (or plan's) field, from a wire dict or a ``KernelSpec`` / ``KernelPlan``."""
    return kernel.get(name, default) if isinstance(kernel, Mapping) else getattr(kernel, name, default)


def kernel_function(cp: Any, modules: MutableMapping, kernel: Any,
                    options: Sequence[str] | None = None) -> Any:
    """The compiled function of ``kernel`` (its module cached in ``modules`` by source and
    options), with the dynamic shared memory it launches with allowed."""
    opts = tuple(options or field(kernel, "options") or NVRTC_OPTIONS)
    key = (str(field(kernel, "source")), opts)
    mod = modules.get(key)
    if mod is None:
        mod = modules[key] = cp.RawModule(code=key[0], options=opts)
    fn = mod.get_function(str(field(kernel, "name")))
    shared = int(field(kernel, "shared_bytes", 0) or 0)
    if shared > SHARED_DEFAULT:
        fn.max_dynamic_shared_size_bytes = shared  # opt-in above the 48 KiB default
    return fn


def kernel_arg(a: Any) -> Any:
    """A scalar argument as the kernel takes it: a wire ``{"type", "value"}`` becomes a NumPy
    scalar of exactly that width (an int where the kernel reads a long long would hand it
    garbage upper bits); the generator's own NumPy scalars pass as they are."""
    if isinstance(a, Mapping):
        return _SCALAR_TYPES.get(str(a.get("type", "int32")), np.int32)(a["value"])
    return a


def launcher(funcs: Sequence[Any], kernels: Sequence[Any], buffers: Mapping[str, Any],
             zero: Sequence[Any] = (), stream: Any = None) -> Callable[[], None]:
    """A closure that enqueues the whole plan once on ``stream``: ``zero`` (scratch arrays the
    plan needs zeroed) memset, then every kernel with its arguments bound to ``buffers``."""
    calls = []
    for fn, k in zip(funcs, kernels):
        args = []
        for a in field(k, "args", ()):
            if isinstance(a, str):
                if a not in buffers:
                    raise KeyError(f"kernel {field(k, 'name')} argument {a!r} names no buffer")
                args.append(buffers[a])
            else:
                args.append(kernel_arg(a))
        calls.append((fn, tuple(field(k, "grid")), tuple(field(k, "block")), tuple(args),
                      int(field(k, "shared_bytes", 0) or 0)))
    zero = list(zero)

    def launch() -> None:
        for z in zero:
            z.data.memset_async(0, z.nbytes, stream)
        for fn, grid, block, args, shared in calls:
            fn(grid, block, args, shared_mem=shared, stream=stream)

    return launch


def scratch_zeroed(plan: Any) -> list[tuple[str, int, bool]]:
    """``(name, bytes, needs zeros)`` of a plan's scratch buffers (a ``KernelPlan`` lists the
    zeroed ones in ``zeroed``; a wire plan marks each ``zero``)."""
    zeroed = field(plan, "zeroed", None)
    out = []
    for s in field(plan, "scratch", ()) or ():
        if isinstance(s, Mapping):
            out.append((str(s["name"]), int(s["nbytes"]), bool(s.get("zero", True))))
        else:
            out.append((str(s[0]), int(s[1]), zeroed is None or s[0] in zeroed))
    return out


def plan_launcher(cp: Any, plan: Any, buffers: Mapping[str, Any], modules: MutableMapping | None = None,
                  stream: Any = None) -> Callable[[], None]:
    """Compile and bind a whole plan on fresh scratch buffers (the GPU tests' entry point)."""
    modules = {} if modules is None else modules
    funcs = [kernel_function(cp, modules, k) for k in field(plan, "kernels", ())]
    scratch, zero = {}, []
    for name, nbytes, needs_zero in scratch_zeroed(plan):
        scratch[name] = cp.full(max(1, nbytes // 4 + 1), np.nan, cp.float32)  # garbage unless zeroed
        if needs_zero:
            zero.append(scratch[name])
    return launcher(funcs, field(plan, "kernels", ()), {**buffers, **scratch}, zero, stream)

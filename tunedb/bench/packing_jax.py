"""JAX peers of ``tunedb bench packing`` (where JAX is installed): the members' GEMMs under ``jit``.

* ``jax vmap jit``: one ``jit`` program, ``vmap(matmul)`` over the stacked operands of each group
  of equal member shapes (stacking, like torch's ``vmap`` peer, is done before timing);
* ``jax loop jit``: one ``jit`` program of every member's ``matmul`` (XLA schedules them).

fp32 runs at ``precision="highest"`` (no TF32, as tunedb and torch). Outputs are checked against
the same float64 reference first; a timing is ``reps`` dispatches, then one wait for the results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedb.kernels.packing import PackingWorkload
from tunedb.runtime.pack import worst_error


def _jnp_operand(jnp: Any, a: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        return jnp.asarray(a.view(jnp.bfloat16))
    return jnp.asarray(a)


def jax_rows(w: PackingWorkload, host: Sequence[tuple[np.ndarray, np.ndarray]], refs: Sequence[Any],
             add: Callable[..., None], reps: int, samples: int) -> bool:
    """Add the JAX rows of ``w`` through ``add`` (``measure_row``'s arguments); False without JAX.
    ``refs``: the float64 references (CuPy or NumPy)."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return False
    jax.config.update("jax_default_matmul_precision", "highest")
    refs_host = [np.asarray(r.get() if hasattr(r, "get") else r) for r in refs]
    xs, ws = [], []
    for mb, (x, wt) in zip(w.members, host):
        xs.append(_jnp_operand(jnp, x, mb.dtype))
        wv = _jnp_operand(jnp, wt, mb.dtype)
        ws.append(wv if mb.layout == "nn" else jnp.swapaxes(wv, -1, -2))
    groups: dict[tuple, list[int]] = {}
    for i, mb in enumerate(w.members):
        groups.setdefault(mb.key, []).append(i)
    stacks = [(idx, jnp.concatenate([xs[i] for i in idx]), jnp.concatenate([ws[i] for i in idx]))
              for idx in groups.values()]
    vm = jax.jit(lambda ops: [jax.vmap(jnp.matmul)(x, wt) for x, wt in ops])
    loop = jax.jit(lambda a, b: [jnp.matmul(x, wt) for x, wt in zip(a, b)])

    def run_vmap() -> Any:
        return vm([(X, W) for _, X, W in stacks])

    def run_loop() -> Any:
        return loop(xs, ws)

    def outs_vmap(res: Any) -> list[np.ndarray]:
        got: list[Any] = [None] * len(w.members)
        for (idx, _, _), r in zip(stacks, res):
            r = np.asarray(r.astype(jnp.float32), np.float64)
            p = 0
            for i in idx:
                b = w.members[i].batch
                got[i] = r[p:p + b]
                p += b
        return got

    def outs_loop(res: Any) -> list[np.ndarray]:
        return [np.asarray(r.astype(jnp.float32), np.float64) for r in res]

    def timer(fn: Callable[[], Any]) -> list[float]:
        for _ in range(3):
            jax.block_until_ready(fn())
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            res = None
            for _ in range(reps):
                res = fn()
            jax.block_until_ready(res)
            out.append((time.perf_counter() - t0) * 1e6 / reps)
        return out

    for variant, fn, outs in (("jax vmap jit", run_vmap, outs_vmap), ("jax loop jit", run_loop, outs_loop)):
        add("jax", variant, lambda fn=fn, outs=outs: worst_error(w, outs(fn()), refs_host), fn, timer)
    return True

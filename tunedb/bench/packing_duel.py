"""Head to head after a packing case: tunedb's fastest candidates and the fastest torch peers,
timed again in interleaved rounds.

The first pass times every system one after another, so a clock or thermal drift between the
start and the end of a case lands on whichever system ran later. Here the ``top`` fastest of each
side are rebuilt, checked against the float64 reference again, and timed in ``rounds`` rounds,
each one sample (``reps`` launches, CUDA-event timed) of every item, the order rotated by one
per round. The result is the median per item and tunedb's best over the best peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunedb.kernels.packing import Candidate, PackingWorkload
from tunedb.runtime.pack import PackedRun, sample_stats, time_stream, worst_error


def torch_builders(tc: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], None] | None]]:
    """Peer variant -> (build the launch function, copy results out before a check)."""
    out: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]] = {
        "eager loop": (lambda: tc.loop, None),
        "graph loop": (lambda: tc.graph(tc.loop), None),
        "padded bmm": (tc.padded_bmm, tc.copy_padded_out),
        "padded bmm graph": (lambda: _graph_of(tc, tc.padded_bmm()), tc.copy_padded_out),
        "vmap by shape": (tc.vmap_groups, tc.copy_vmap_out),
        "vmap by shape graph": (lambda: tc.graph(tc.vmap_groups()), tc.copy_vmap_out),
    }
    for k in (4, 8, 16):
        out[f"streams{k} graph"] = (lambda k=k: tc.streams(k), None)
    return out


def _graph_of(tc: Any, fn: Callable[[], None] | None) -> Callable[[], None] | None:
    return None if fn is None else tc.graph(fn)


def duel(w: PackingWorkload, rows: Sequence[dict[str, Any]], *, cp: Any, torch: Any, pool: Any,
         inputs: Sequence[Any], refs: Sequence[Any], tc: Any, time_torch: Callable[..., list[float]],
         reps: int, rounds: int = 10, top: int = 2, log: Callable[[str], None] = print,
         choice: str = "", also: Sequence[str] = ()) -> dict[str, Any]:
    """Re-time the ``top`` fastest ok tunedb rows and torch rows of ``rows`` (one case) in
    interleaved rounds; every item is checked first and left out (with its error) if it fails.
    ``choice``: a tunedb variant timed too (the model's pick); ``choice_over_best_peer`` is its
    speedup over the best peer of the rounds; ``also``: more such variants (the database's pick),
    each in ``choices_over_best_peer``."""
    ok = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["median_us"])
    mine = [r for r in ok if r["system"] == "tunedb"][:top]
    for want in dict.fromkeys([choice, *also]):
        mine += [r for r in ok if r["system"] == "tunedb" and want and r["variant"] == want
                 and r not in mine][:1]
    builders = torch_builders(tc)
    theirs = [r for r in ok if r["system"] == "torch" and r["variant"] in builders][:top]
    items: dict[str, tuple[str, Callable[[], None], Callable[[], list[float]]]] = {}
    errors: dict[str, str] = {}
    for r in mine:
        name = f"tunedb {r['variant']}"
        try:
            run = PackedRun(cp, w, Candidate.from_json(r["candidate"]), inputs, pool)
            run.run()  # eagerly first: the handle's first call and kernel loads happen outside capture
            run.capture()
            run.clear_outputs()
            run.replay()
            err = worst_error(w, run.outputs(on_device=True), refs)
            if not err <= 1.0:
                raise RuntimeError(f"worst error {err:.3g} x tolerance")
            items[name] = ("tunedb", run.replay,
                           lambda run=run: time_stream(cp, run.replay, run.main, reps=reps, samples=1))
        except Exception as e:  # noqa: BLE001 - an item that fails is reported, not timed
            errors[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    for r in theirs:
        name = f"torch {r['variant']}"
        build, after = builders[r["variant"]]
        try:
            fn = build()
            tc.clear()
            fn()
            if after:
                after()
            err = worst_error(w, tc.outputs(), refs)
            if not err <= 1.0:
                raise RuntimeError(f"worst error {err:.3g} x tolerance")
            items[name] = ("torch", fn,
                           lambda fn=fn: time_torch(torch, fn, reps=reps, samples=1))
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    names = list(items)
    us: dict[str, list[float]] = {k: [] for k in names}
    for rd in range(rounds if names else 0):
        k0 = rd % len(names)
        for k in names[k0:] + names[:k0]:
            us[k] += items[k][2]()
    out: dict[str, Any] = {"rounds": rounds, "reps": reps,
                           "items": {k: {"system": items[k][0], **sample_stats(v)} for k, v in us.items()}}
    if errors:
        out["errors"] = errors
    best = {s: min((v["median_us"] for v in out["items"].values() if v["system"] == s), default=None)
            for s in ("tunedb", "torch")}
    if best["tunedb"] and best["torch"]:
        out["speedup_vs_best_peer"] = best["torch"] / best["tunedb"]
        if f"tunedb {choice}" in out["items"]:
            out["choice_over_best_peer"] = best["torch"] / out["items"][f"tunedb {choice}"]["median_us"]
        for v in dict.fromkeys([choice, *also]):
            if v and f"tunedb {v}" in out["items"]:
                out.setdefault("choices_over_best_peer", {})[v] = (
                    best["torch"] / out["items"][f"tunedb {v}"]["median_us"])
    for k, v in out["items"].items():
        log(f"  duel {k:36s} {v['median_us']:10.2f} us (p20 {v['p20_us']:.2f}, p80 {v['p80_us']:.2f})")
    return out

"""What ``tunedb bench fusion`` and ``tunedb bench plan`` print: a line per finished case, the
result table (rich) and the summary line, and the cases a fusion run takes from a suite name."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tunedb.bench.fusion import PEERS, BenchError, summarize, time_of
from tunedb.bench.plan import PEER_LABELS, fmt
from tunedb.kernels import suites


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def fusion_progress_line(i: int, n: int, case: dict) -> str:
    """One line per finished case (printed as the run goes)."""
    parts = [f"[{i}/{n}] {case.get('case')}: floor {_fmt(case.get('floor_us'))}"]
    t = time_of(case, "tunedb")
    tdb = case.get("tunedb") or {}
    parts.append(f"tunedb {_fmt(t)} ({tdb.get('schedule')})" if t else f"tunedb failed ({tdb.get('error')})")
    for p in PEERS:
        t = time_of(case, p)
        parts.append(f"{p} {_fmt(t)}" if t else f"{p} failed")
    return ", ".join(parts) + f" µs [{case.get('elapsed_s', 0):.0f}s]"


def fusion_table(result: dict) -> Any:
    """The benchmark result as a rich Table: one row per case, then the geomean row."""
    bw = result.get("copy_TBps")
    table = Table(title=f"fusion suite on {result.get('device', {}).get('name', '?')}, µs "
                        f"(floor: fewest bytes at {_fmt(bw, 2)} TB/s copy)")
    for col in ("case", "floor", "tunedb", "schedule", "torch eager", "torch.compile", "JAX",
                "tunedb/floor", "× compile", "× JAX"):
        table.add_column(col, justify="left" if col in ("case", "schedule") else "right")
    for c in result.get("cases", []):
        t, fl = time_of(c, "tunedb"), c.get("floor_us")
        tdb = c.get("tunedb") or {}
        peers = [time_of(c, p) for p in PEERS]
        comp, jx = peers[1], peers[2]
        sched = tdb.get("schedule") or f"error: {tdb.get('error') or '?'}"[:48]
        table.add_row(str(c.get("case", "?")), _fmt(fl), _fmt(t), sched, *[_fmt(p) for p in peers],
                      _fmt(fl / t if fl and t else None, 3), _fmt(comp / t if comp and t else None, 2),
                      _fmt(jx / t if jx and t else None, 2))
    s = summarize(result)
    fr = s["fraction_of_floor"]
    table.add_section()
    table.add_row("geomean fraction of floor", "1.00", _fmt(fr.get("tunedb"), 3), "",
                  *[_fmt(fr.get(p), 3) for p in PEERS], _fmt(fr.get("tunedb"), 3),
                  _fmt(s.get("speedup_vs_torch_compile"), 2), _fmt(s.get("speedup_vs_jax"), 2))
    return table


def fusion_summary_line(result: dict) -> str:

    s = summarize(result)
    slower = s["slower_than_torch_compile"]
    parts = [f"{s['cases']} case(s)",
             f"tunedb geomean {_fmt(s['fraction_of_floor'].get('tunedb'), 3)} of floor",
             f"{_fmt(s['speedup_vs_torch_compile'], 2)}x torch.compile "
             f"(min {_fmt(s['min_speedup_vs_torch_compile'], 2)}x)",
             f"{_fmt(s['speedup_vs_jax'], 2)}x JAX",
             "slower than torch.compile: " + (", ".join(slower) if slower else "none")]
    if result.get("stopped"):
        parts.append(f"stopped: {result['stopped']}")
    return "; ".join(parts)


def load_cases(suite: str) -> list[Any]:
    """``anchors`` -> the 12 ANCHORS.md cases; any other name -> that workload suite."""
    if suite == "anchors":
        return list(suites.ANCHOR_CASES)
    try:
        return list(suites.suite(suite))
    except (KeyError, ValueError) as e:
        raise BenchError(f"unknown suite {suite!r}: {' '.join(str(e).split())}") from None


def plan_table(result: dict) -> Any:
    peers = result.get("peers", [])
    table = Table(title=f"plans on {result.get('device', {}).get('name', '?')}, µs (throughput mode)")
    for col in ["graph", "ops", "kernels", "launches", "graph?", "ref err", "ort err", "tunedb"] + \
            [PEER_LABELS[p] for p in peers] + [f"× {PEER_LABELS[p]}" for p in peers]:
        table.add_column(col, justify="left" if col == "graph" else "right")
    for e in result.get("entries", []):
        plan, ver = e.get("plan") or {}, e.get("verify") or {}
        ref, ort = ver.get("reference") or {}, ver.get("onnxruntime") or {}
        t = (e.get("tunedb") or {}).get("us")
        tdb = fmt(t) if t else f"error: {(e.get('tunedb') or {}).get('error') or e.get('error') or '?'}"[:40]
        mark = "" if ref.get("ok") in (True, None) else " ✗"
        table.add_row(
            str(e.get("name")), str((e.get("graph") or {}).get("op_by_op", "—")),
            str(plan.get("kernels", "—")),
            str(plan.get("launches", "—")), "yes" if plan.get("graph_capture") else "no",
            fmt(ref.get("rel_err"), 7) + mark if ref else "—",
            fmt(ort.get("rel_err"), 7) if ort.get("rel_err") is not None else "—", tdb,
            *[fmt((e.get("peers", {}).get(p) or {}).get("us")) for p in peers],
            *[fmt((e.get("speedup") or {}).get(p), 2) for p in peers])
    return table


def plan_summary_line(result: dict) -> str:

    s = result.get("summary", {})
    parts = [f"{s.get('graphs', 0)} graph(s), {s.get('verified', 0)} verified, {s.get('timed', 0)} timed"]
    for p in result.get("peers", []):
        parts.append(f"{fmt(s.get(f'speedup_vs_{p}'), 2)}x {PEER_LABELS[p]} "
                     f"(min {fmt(s.get(f'min_speedup_vs_{p}'), 2)}x)")
    if s.get("failed"):
        parts.append("failed: " + ", ".join(map(str, s["failed"])))
    if result.get("stopped"):
        parts.append(f"stopped: {result['stopped']}")
    return "; ".join(parts)


def plan_entry_line(i: int, n: int, rec: dict) -> str:

    t = (rec.get("tunedb") or {}).get("us")
    ref = ((rec.get("verify") or {}).get("reference") or {})
    head = f"[{i}/{n}] {rec.get('name')}: "
    if not t:
        return head + f"failed ({(rec.get('tunedb') or {}).get('error') or rec.get('error')})"
    peers = ", ".join(f"{p} {fmt((v or {}).get('us'))}" for p, v in rec.get("peers", {}).items())
    return (head + f"tunedb {fmt(t)} µs ({'verified' if ref.get('ok') else 'NOT verified'}), {peers} "
            f"[{rec.get('elapsed_s', 0):.0f}s]")

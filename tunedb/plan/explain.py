"""``Plan.explain()``: one table row per step (kernel, ops fused, schedule, stitch schemes,
predicted µs, cost source) and the totals, as plain text rendered by rich."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from tunedb.plan.gemm_forms import forms_text, gemm_forms

MAX_OPS_TEXT = 60


def ops_text(ops: tuple[str, ...]) -> str:
    """``add×2 reduce_mean×2 sub mul×3 rsqrt`` in order of first appearance."""
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    text = " ".join(op if n == 1 else f"{op}×{n}" for op, n in counts.items())
    if len(text) > MAX_OPS_TEXT:
        text = text[:MAX_OPS_TEXT - 1] + "…"
    return text


def stitch_text(stitch: tuple[tuple[str, str], ...]) -> str:
    counts: dict[str, int] = {}
    for _, scheme in stitch:
        counts[scheme] = counts.get(scheme, 0) + 1
    return " ".join(s if n == 1 else f"{s}×{n}" for s, n in sorted(counts.items())) or "-"


def us_text(us: float) -> str:
    return f"{us:.2f}" if us >= 0.1 or us == 0 else f"{us:.3f}"


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.2f} MiB"


def explain(plan: Any, width: int = 160) -> str:
    g = plan.graph
    title = f"plan for {g.name or 'graph'}: {len(g.nodes)} ops -> {plan.kernels} kernel launches"
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("kernel")
    table.add_column("ops", justify="right")
    table.add_column("ops fused")
    table.add_column("schedule")
    table.add_column("stitch")
    table.add_column("pred µs", justify="right")
    table.add_column("source")
    if plan.stages:
        table.add_column("stage/stream", justify="right")
    forms = gemm_forms(plan)
    for k, s in enumerate(plan.steps):
        measured = f" (meas {s.measured_us:.2f})" if s.measured_us is not None else ""
        schedule = s.schedule_label if k not in forms else f"cublas {forms[k]}"
        table.add_row(str(k), s.kind, str(len(s.ops)), ops_text(s.ops), schedule,
                      stitch_text(s.stitch), us_text(s.predicted_us) + measured,
                      s.cost_source if s.kind != "layout_view" else "-",
                      *([f"{s.stage}/{s.stream}"] if plan.stages else []))
    out = io.StringIO()
    console = Console(file=out, width=width, no_color=True, highlight=False, soft_wrap=False)
    console.print(table)
    t = plan.totals()
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(t["by_kind"].items()))
    sources = ", ".join(f"{k} {n}" for k, n in sorted(t["cost_sources"].items())) or "-"
    kernel_us = sum(s.predicted_us for s in plan.steps)
    console.print(f"steps: {t['steps']} ({kinds}); fused {t['fused_ops']} of {t['graph_ops']} ops")
    console.print(f"predicted: {t['predicted_us']:.2f} µs = {kernel_us:.2f} µs kernels + "
                  f"{plan.kernels} launches × {plan.launch_us:g} µs; cost sources: {sources}")
    if forms:  # pointer: one cublasGemmBatchedEx, its pointer array built when the plan loads
        console.print(f"matmul steps as cuBLAS calls: {forms_text(forms)}")
    console.print(f"intermediates: arena {_kib(t['arena_bytes'])} (without reuse {_kib(t['naive_bytes'])})"
                  f"; device: {plan.device or 'generic H200 facts'}")
    if plan.stages:
        search = dict(plan.search)
        wide = sum(1 for st in plan.stages if len(st) > 1)
        console.print(f"stages (IOS): {len(plan.stages)}, {wide} with concurrent groups (at most "
                      f"{max(len(st) for st in plan.stages)} streams); predicted "
                      f"{search.get('ios_predicted_us', '?')} µs staged vs "
                      f"{search.get('sequential_predicted_us', '?')} µs in one stream")
    merged = dict(plan.search).get("merged_convs")
    if merged:  # IOS's merge strategy: sibling convolutions run as one (tunedb.plan.merge)
        console.print(f"merged convolutions: {len(merged)} ({'; '.join('+'.join(m) for m in merged)})")
    for pk in getattr(plan, "packs", ()):
        what = "measured" if pk.source == "db" else "predicted"
        console.print(f"pack: steps {pk.steps[0]}-{pk.steps[-1]} "
                      f"({ops_text(tuple(plan.steps[i].kind for i in pk.steps))}) as {pk.label}: "
                      f"{what} {pk.predicted_us:.2f} µs vs {pk.serial_us:.2f} µs one after another "
                      f"(source {pk.source})")
    return out.getvalue()

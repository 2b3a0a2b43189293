"""The report's figures, each returned as a PNG data URI (``data:image/png;base64,...``).

matplotlib is an optional dependency (``tunedb[report]``) and is imported only here, through its
object-oriented API with an Agg canvas: no pyplot, so no global backend is switched in the
caller's process and nothing needs a display.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from tunedb.report.data import ReportError

# Beyond this many points the scatter shows a seeded random sample (the PNG looks the same).
_MAX_POINTS = 50_000
_DPI = 100


def _mpl() -> tuple[Any, Any, Any]:
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("tunedb report needs matplotlib: pip install 'tunedb[report]'") from None
    return Figure, FigureCanvasAgg, colormaps


def require_matplotlib() -> None:
    """Fail early, before any training, when matplotlib is missing."""
    _mpl()


def _figure(w: float, h: float) -> Any:
    Figure, Canvas, _ = _mpl()
    fig = Figure(figsize=(w, h), dpi=_DPI, layout="constrained")
    Canvas(fig)
    return fig


def data_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def family_colors(names: list[str]) -> dict[str, Any]:
    """One stable colour per family (sorted names), shared by every figure."""
    _, _, cmaps = _mpl()
    cmap = cmaps["tab10" if len(names) <= 10 else "tab20"]
    return {n: cmap(i % cmap.N) for i, n in enumerate(sorted(names))}


def predicted_vs_measured(y: np.ndarray, pred: np.ndarray, families: np.ndarray,
                          colors: dict[str, Any]) -> str:
    """Log-log scatter of held-out predictions against measurements, coloured by family."""
    fig = _figure(7.0, 6.0)
    ax = fig.add_subplot()
    idx = np.arange(len(y))
    if len(idx) > _MAX_POINTS:
        idx = np.sort(np.random.default_rng(0).choice(idx, _MAX_POINTS, replace=False))
    for name in sorted(set(families.tolist())):
        m = idx[families[idx] == name]
        ax.scatter(y[m], pred[m], s=8, alpha=0.6, color=colors[name], label=name, linewidths=0)
    lo = float(min(np.min(y), np.min(pred)))
    hi = float(max(np.max(y), np.max(pred)))
    line = np.array([lo / 1.2, hi * 1.2])
    ax.plot(line, line, color="black", lw=1, label="prediction = measurement")
    ax.fill_between(line, line / 2, line * 2, color="grey", alpha=0.12, label="within 2×")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured latency (µs)")
    ax.set_ylabel("predicted latency, held-out workload (µs)")
    ax.set_title(f"held-out predictions, {len(y):,} candidates"
                 + (f" ({len(idx):,} shown)" if len(idx) < len(y) else ""))
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=8, loc="upper left", markerscale=2)
    return data_uri(fig)


def _grouped_bars(ax: Any, labels: list[str], series: dict[str, list[float]], colors: list[Any]) -> None:
    x = np.arange(len(labels))
    width = 0.8 / max(len(series), 1)
    for i, (name, vals) in enumerate(series.items()):
        v = np.array([np.nan if a is None else a for a in vals], dtype=np.float64)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, np.nan_to_num(v), width, label=name, color=colors[i])
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


_MODEL_COLOR, _ROOF_COLOR, _RANDOM_COLOR = "#1f77b4", "#ff7f0e", "#9e9e9e"


def family_bars(families: dict[str, dict[str, Any]]) -> str:
    """Per family: pairwise accuracy, top-1 score and MAPE of the model next to the roofline's."""
    names = list(families)
    fig = _figure(max(7.0, 0.9 * len(names) + 3.0), 3.8)
    axes = fig.subplots(1, 3)
    for ax, key, title in zip(axes, ("pairwise_accuracy", "top1_score", "mape"),
                              ("pairwise accuracy (higher is better)", "top-1 score (higher is better)",
                               "MAPE (lower is better)")):
        _grouped_bars(ax, names, {"XGBoost": [families[n][key] for n in names],
                                  "roofline": [families[n]["roofline"][key] for n in names]},
                      [_MODEL_COLOR, _ROOF_COLOR])
        ax.set_title(title, fontsize=9)
        if key != "mape":
            ax.set_ylim(0, 1.05)
            # Pairwise accuracy of a coin is 0.5; a perfect top-1 pick scores 1.
            ax.axhline(0.5 if key == "pairwise_accuracy" else 1.0, color="black", lw=0.6, ls=":")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=2, fontsize=8)
    return data_uri(fig)


def baseline_bars(cv: dict[str, Any], keys: tuple[str, ...], labels: dict[str, str]) -> str:
    """The model against the roofline and random predictors on the ranking metrics."""
    fig = _figure(7.0, 3.4)
    ax = fig.add_subplot()
    series = {"XGBoost": [cv[k] for k in keys],
              **{name: [cv["baselines"][name][k] for k in keys] for name in ("roofline", "random")}}
    _grouped_bars(ax, [labels.get(k, k) for k in keys], series, [_MODEL_COLOR, _ROOF_COLOR, _RANDOM_COLOR])
    ax.set_ylim(min(0.0, *(v for vals in series.values() for v in vals if v is not None and np.isfinite(v))),
                1.05)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    ax.set_title("held-out ranking quality: XGBoost vs baselines", fontsize=10)
    return data_uri(fig)


def anchor_strips(anchors: list[dict[str, Any]], colors: dict[str, Any]) -> str:
    """One panel per anchor case: every ok candidate's latency (jittered strip), the roofline
    floor as a dashed line, and the held-out model's pick when there is one."""
    n = len(anchors)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    fig = _figure(3.2 * cols, 2.8 * rows + 0.4)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(-1)
    rng = np.random.default_rng(0)
    for ax, a in zip(axes, anchors):
        lat = np.asarray(a["latencies_us"], dtype=np.float64)
        if len(lat):
            ax.scatter(rng.uniform(-0.3, 0.3, len(lat)), lat, s=10, alpha=0.6,
                       color=colors.get(a["family"], _MODEL_COLOR), linewidths=0, label="candidates")
        ax.axhline(a["floor_us"], color="black", ls="--", lw=1, label="roofline floor")
        if a.get("model_pick_us") is not None:
            ax.scatter([0.0], [a["model_pick_us"]], marker="x", s=60, color="red", label="model's pick")
        ax.set_yscale("log")
        top = max([a["floor_us"], *lat.tolist()])
        ax.set_ylim(a["floor_us"] / 1.15, top * 1.15)
        # Plain numbers at 1-2-5 steps: a log axis over less than a decade gets odd labels.
        decades = np.log10(top * 1.15 / (a["floor_us"] / 1.15))
        subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if decades < 1 else (1.0, 2.0, 5.0) if decades < 3 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(subs=subs))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlim(-0.6, 0.6)
        ax.set_xticks([])
        ax.set_ylabel("µs", fontsize=8)
        frac = a["floor_fraction"]
        ax.set_title(f"{a['case']}\nfloor/best = {frac:.2f}" if frac else f"{a['case']}\nno ok candidate",
                     fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.2)
    for ax in axes[n:]:
        ax.set_visible(False)
    handles: dict[str, Any] = {}
    for ax in axes[:n]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=3, fontsize=8)
    return data_uri(fig)

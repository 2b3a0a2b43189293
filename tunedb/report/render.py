"""The report as one self-contained HTML page: inline CSS, figures as PNG data URIs, and the
numbers behind every table embedded as JSON (``<script id="report-data">``) for other tools."""

from __future__ import annotations

import html
import json
import math
from typing import Any

import numpy as np

SECTIONS: dict[str, str] = {
    "predictions": "Predicted vs measured latency (held-out workloads)",
    "families": "Per-family metrics",
    "anchors": "Anchor cases against the roofline floor",
    "baselines": "Baseline comparison",
    "data": "Data summary",
}
METRIC_LABELS: dict[str, str] = {
    "top1_score": "top-1 score",
    "top1_within_2pct": "top-1 within 2 %",
    "decisive_pair_accuracy": "decisive pairs",
    "pairwise_accuracy": "pairwise acc. (mean per workload)",
    "pairwise_accuracy_pooled": "pairwise acc. (pooled)",
    "top5_score": "top-5 score",
    "mape": "MAPE",
    "spearman": "Spearman (per workload)",
    "spearman_global": "Spearman (global)",
}
BASELINE_KEYS: tuple[str, ...] = tuple(METRIC_LABELS)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0;font-size:.88em}
th,td{border:1px solid #ddd;padding:.25em .6em}th{background:#f3f3f3}
td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #eee}.note{color:#666;font-size:.9em}
"""


def clean(obj: Any) -> Any:
    """``obj`` with NaN / infinity as None and NumPy scalars as Python numbers (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def fmt(v: Any, digits: int = 4) -> str:
    """A table cell: numbers with ``digits`` decimals, missing values as an em dash."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(table_id: str, header: list[str], rows: list[list[Any]], digits: int = 4) -> str:
    """An HTML table; the first column is text, the rest are formatted as numbers."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for r in rows:
        cells = [f"<td>{html.escape(str(r[0]))}</td>"]
        for v in r[1:]:
            text = html.escape(v) if isinstance(v, str) else fmt(v, digits)
            cells.append(f'<td class="n">{text}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table id="{html.escape(table_id)}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def image(uri: str, alt: str) -> str:
    return f'<p><img src="{uri}" alt="{html.escape(alt)}"></p>'


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def section(key: str, body: str) -> str:
    return f'<section id="{key}"><h2>{html.escape(SECTIONS[key])}</h2>\n{body}\n</section>'


def page(title: str, intro: list[str], sections: list[str], data: dict[str, Any]) -> str:
    # "</" inside a script element would end it early; JSON allows the escaped form.
    blob = json.dumps(clean(data), sort_keys=True, allow_nan=False).replace("</", "<\\/")
    paras = "".join(f"<p>{p}</p>" for p in intro)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n{paras}\n" + "\n".join(sections)
        + f'\n<script type="application/json" id="report-data">{blob}</script>\n</body></html>\n'
    )

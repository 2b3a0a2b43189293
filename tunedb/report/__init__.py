"""``tunedb report``: one self-contained HTML page about a tuning database and its cost model.

    from tunedb.report import build_report
    with TuningStore.open("h200.duckdb", read_only=True) as db:
        build_report(db, kind="fusion").write("report.html")

Sections: (a) held-out predicted vs measured latency, coloured by family; (b) per-family
metrics; (c) the anchor cases' candidates against the roofline floor; (d) XGBoost vs the
roofline and random baselines; (e) the data summary. Every prediction shown comes from a model
that never saw the workload (GroupKFold by workload, as ``costmodel.evaluate.cross_validate``).
``--model`` takes the training parameters and device facts from a saved model's card; the
model itself is not scored (it has seen every row).
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunedb._version import __version__
from tunedb.costmodel.features import DeviceFacts
from tunedb.costmodel.model import CostModel
from tunedb.costmodel.registry import CARD_FILE, find_model, load_model
from tunedb.costmodel.train import TrainParams
from tunedb.kernels.suites import ANCHOR_CASES
from tunedb.records import KINDS
from tunedb.report import plots
from tunedb.report.data import ReportError, anchor_rows, fetch, pick_device, prepare, summarize
from tunedb.report.evaluation import FAMILY_KEYS, Evaluation, anchor_picks, evaluate
from tunedb.report.render import BASELINE_KEYS, METRIC_LABELS, SECTIONS, image, note, page, section, table

__all__ = ["SECTIONS", "Report", "ReportError", "build_report", "load_report_model"]


@dataclass
class Report:
    html: str
    data: dict[str, Any]  # the numbers behind the page (also embedded in it as JSON)

    def write(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(self.html, encoding="utf-8")
        except OSError as e:
            raise ReportError(f"cannot write report {p}: {e.strerror or e}") from None
        return p


def load_report_model(path: str | os.PathLike[str], device_name: str, kind: str) -> CostModel:
    """A model directory (holding card.json), or a registry root holding <device>/<kind>/."""
    p = Path(path)
    if (p / CARD_FILE).is_file() or p.name == CARD_FILE:
        return load_model(p)
    return find_model(p, device_name, kind)


def _params(model: CostModel | None, params: TrainParams | None) -> tuple[TrainParams, str]:
    if params is not None:
        return params, "as given"
    if model is None:
        return TrainParams(), "defaults"
    p = TrainParams.from_json(model.card.get("hyperparameters", {}))
    # Cross-validate what was deployed: the objective the model ended up with (as ``tunedb train``
    # pins it for its own cross-validation, whose numbers the card holds).
    return replace(p, objective=model.objective), "from the model card"


def _geomean(values: list[float | None]) -> float | None:
    v = [x for x in values if x]
    return float(np.exp(np.mean(np.log(v)))) if v else None


def _predictions_section(ev: Evaluation | None, ds: Any, why: str, colors: dict[str, Any]) -> str:
    if ev is None:
        return note(f"No held-out evaluation: {why}.")
    cv = ev.cv
    objectives = ", ".join(sorted(set(ev.fold_objectives)))
    return (image(plots.predicted_vs_measured(ds.y, ev.pred_us, ds.families, colors),
                  "predicted vs measured latency")
            + note(f"{cv['rows']:,} candidates of {cv['workloads']:,} workloads, GroupKFold by workload "
                   f"({cv['folds']} folds; objective chosen: {objectives}); compile-time facts "
                   f"{cv['measured_facts']} on the held-out rows. MAPE {cv['mape']:.3f}, "
                   f"global Spearman {cv['spearman_global']:.3f}."))


def _families_section(ev: Evaluation | None, why: str) -> str:
    if ev is None:
        return note(f"No held-out evaluation: {why}.")
    header = ["family", "rows", "workloads", *(METRIC_LABELS[k] for k in FAMILY_KEYS[:-2]),
              "roofline pairwise acc.", "roofline top-1", "roofline MAPE"]
    rows = [[name, f["rows"], f["workloads"], *(f[k] for k in FAMILY_KEYS[:-2]),
             f["roofline"]["pairwise_accuracy"], f["roofline"]["top1_score"], f["roofline"]["mape"]]
            for name, f in ev.families.items()]
    body = (note("Out-of-fold predictions of the GroupKFold model, scored within each family.")
            + table("families", header, rows) + image(plots.family_bars(ev.families), "per-family metrics"))
    if ev.lofo:
        lrows = [[name, f["rows"], *(f[k] for k in FAMILY_KEYS[:-2])]
                 for name, f in ev.lofo["families"].items()]
        pooled = ev.lofo["pooled"]
        lrows.append(["all families (pooled)", pooled["rows"], *(pooled[k] for k in FAMILY_KEYS[:-2])])
        body += (note("Leave-one-family-out: each family scored by a model trained without it.")
                 + table("lofo", ["family", "rows", *(METRIC_LABELS[k] for k in FAMILY_KEYS[:-2])], lrows))
    return body


def _anchors_section(anchors: list[dict[str, Any]], facts: DeviceFacts, colors: dict[str, Any]) -> str:
    if not anchors:
        return note(f"None of the {len(ANCHOR_CASES)} anchor cases is measured on this device.")
    header = ["case", "family", "ok candidates", "failed", "floor µs", "best µs", "median µs",
              "floor / best", "model's pick µs", "best / pick"]
    rows = [[a["case"], a["family"], a["candidates"], a["failed"], a["floor_us"], a["best_us"],
             a["median_us"], a["floor_fraction"], a.get("model_pick_us"), a.get("model_pick_score")]
            for a in anchors]
    rows.append(["geomean", "", None, None, None, None, None,
                 _geomean([a["floor_fraction"] for a in anchors]), None,
                 _geomean([a.get("model_pick_score") for a in anchors])])
    body = (note(f"Floor: fewest bytes (each input read once, each output written once) at "
                 f"{facts.bandwidth_bytes_per_s / 1e12:.2f} TB/s. {len(anchors)} of {len(ANCHOR_CASES)} "
                 "anchor cases are in the data; the model's pick is its held-out top-1 candidate.")
            + table("anchors", header, rows, digits=3))
    if any(a["latencies_us"] for a in anchors):
        body += image(plots.anchor_strips(anchors, colors), "anchor cases against the roofline floor")
    return body


def _baselines_section(ev: Evaluation | None, why: str) -> str:
    if ev is None:
        return note(f"No held-out evaluation: {why}.")
    cv = ev.cv
    rows = [["XGBoost", *(cv[k] for k in BASELINE_KEYS)]]
    rows += [[name, *(cv["baselines"][name][k] for k in BASELINE_KEYS)] for name in cv["baselines"]]
    if "with_measured" in cv:
        wm = cv["with_measured"]
        rows.append(["XGBoost, compile facts given", *(wm.get(k) for k in BASELINE_KEYS)])
    return (note("All predictors scored on the same held-out rows. roofline: the analytic roofline time; "
                 "random: seeded log-normal latencies.")
            + table("baselines", ["predictor", *(METRIC_LABELS[k] for k in BASELINE_KEYS)], rows)
            + image(plots.baseline_bars(cv, ("top1_score", "decisive_pair_accuracy", "pairwise_accuracy",
                                             "pairwise_accuracy_pooled", "top5_score", "spearman"),
                                        METRIC_LABELS),
                    "baseline comparison"))


def _data_section(s: dict[str, Any]) -> str:
    overview = [["measurements", s["measurements"]], ["ok", s["ok"]], ["failed", s["failed"]],
                ["workloads", s["workloads"]], ["candidates", s["candidates"]], ["runs", s["runs"]],
                ["devices", len(s["devices"])], ["families", len(s["families"])]]
    return (table("summary", ["", "count"], overview)
            + table("statuses", ["status", "measurements"], [[k, v] for k, v in s["statuses"].items()])
            + table("data-families", ["family", "workloads", "candidates", "measurements", "ok"],
                    [[k, v["workloads"], v["candidates"], v["measurements"], v["ok"]]
                     for k, v in s["families"].items()])
            + table("dtypes", ["dtype", "workloads"], [[k, v] for k, v in s["dtypes"].items()])
            + table("devices", ["device", "id", "measurements", "ok", "workloads"],
                    [[d["name"], d["id"], d["measurements"], d["ok"], d["workloads"]] for d in s["devices"]]))


def build_report(store: Any, kind: str = "fusion", device: str | None = None,
                 model: str | os.PathLike[str] | None = None, params: TrainParams | None = None,
                 folds: int = 5, seed: int | None = None, lofo: bool = False,
                 hide_measured_facts: bool = True, progress: Callable[[str], None] | None = None) -> Report:
    """The report for the ``kind`` measurements of an open TuningStore. ``device``: id or name
    for the model sections (default: the device with the most ok measurements). ``model``: a
    model directory or registry root whose card gives the training parameters and device
    facts; ``params`` overrides them. ``seed`` (default: the training seed) seeds the metrics'
    tie-breaks and the random baseline. ``progress(message)`` hears each phase (the evaluation
    takes most of a minute). Raises ReportError with a one-line message."""
    say = progress or (lambda _msg: None)
    if kind not in KINDS:
        raise ReportError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if folds < 2:
        raise ReportError(f"--folds must be at least 2, got {folds}")
    plots.require_matplotlib()
    frame, graphs = fetch(store, kind)
    devices = store.devices()
    summary = summarize(frame, graphs, devices)
    dev = pick_device(frame, devices, device)
    cost_model = load_report_model(model, dev.name, kind) if model is not None else None
    facts = cost_model.device if cost_model is not None else DeviceFacts.from_device_info(dev)
    train_params, params_from = _params(cost_model, params)
    seed = train_params.seed if seed is None else seed

    ds = prepare(frame, dev, facts)
    anchors = anchor_rows(frame, dev.id, facts)
    ev: Evaluation | None = None
    why = ""
    say(f"held-out evaluation ({folds} folds by workload{', leave-one-family-out' if lofo else ''})")
    try:
        ev = evaluate(ds, train_params, folds=folds, seed=seed, hide_measured_facts=hide_measured_facts,
                      lofo=lofo)
        anchor_picks(anchors, ds, ev.pred_us)
    except ReportError as e:
        why = str(e)
    say("plots")
    colors = plots.family_colors(sorted(set(ds.families.tolist()) | {a["family"] for a in anchors}))

    title = f"tunedb report: {kind} on {dev.name}"
    intro = [html.escape(f"Database {store.path if store.path is not None else '(in memory)'}; "
                         f"tunedb {__version__}. Model sections cover device {dev.name} ({dev.id}); "
                         f"the data summary covers every device."),
             html.escape(f"Training parameters {params_from}: objective {train_params.objective}, "
                         f"max_depth {train_params.max_depth}, eta {train_params.eta}, "
                         f"up to {train_params.num_boost_round} rounds, seed {train_params.seed}."
                         + (f" Model card: {model}." if model is not None else ""))]
    sections = [
        section("predictions", _predictions_section(ev, ds, why, colors)),
        section("families", _families_section(ev, why)),
        section("anchors", _anchors_section(anchors, facts, colors)),
        section("baselines", _baselines_section(ev, why)),
        section("data", _data_section(summary)),
    ]
    data = {
        "tunedb_version": __version__, "kind": kind,
        "device": {"id": dev.id, "name": dev.name, "facts": facts.to_json()},
        "model": str(model) if model is not None else None,
        "params": train_params.to_json(), "params_from": params_from,
        "evaluation": ev.cv if ev else None, "evaluation_note": why or None,
        "fold_objectives": ev.fold_objectives if ev else [],
        "families": ev.families if ev else {}, "lofo": ev.lofo if ev else None,
        "anchors": [{k: v for k, v in a.items() if k != "candidate_hashes"} for a in anchors],
        "summary": summary,
    }
    return Report(page(title, intro, sections, data), data)

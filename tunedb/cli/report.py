"""``tunedb report``: one self-contained HTML page (plots embedded as PNG) about the database
and a held-out evaluation of the cost model on it. Needs matplotlib (``tunedb[report]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunedb.cli.common import DbOption, JsonOption, handle_errors, open_store, print_json, writable_file


def report(
    db: DbOption = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="Model directory (with card.json) or model registry root: its card gives "
        "the training parameters and device facts of the evaluation.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="HTML file to write.")] = Path("report.html"),
    kind: Annotated[str, typer.Option("--kind", help="Measurement kind to report on.")] = "fusion",
    device: Annotated[str | None, typer.Option(
        "--device", help="Device id or name for the model sections (default: the one with the most "
        "ok measurements).")] = None,
    folds: Annotated[int, typer.Option("--folds", min=2, help="GroupKFold folds over workloads.")] = 5,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="Seed of the metrics' tie-breaks "
                                             "and the random baseline (default: the training "
                                             "seed).")] = None,
    lofo: Annotated[bool, typer.Option("--lofo", help="Also evaluate leave-one-family-out "
                                       "(trains once per family).")] = False,
    json_out: JsonOption = False,
) -> None:
    """Write one HTML page on the data and a held-out evaluation of the cost model.

    Sections: held-out predicted vs measured latency, per-family metrics, the anchor cases
    against the roofline floor, XGBoost vs the roofline and random baselines, a data summary.

    Every prediction comes from a model that never saw the workload (GroupKFold by workload).
    Opens the database read-only. Progress goes to stderr (on a terminal). With --json, prints the numbers
    behind the page.

    Example: tunedb report --db h200.duckdb --model models/nvidia-h200/fusion --out report.html
    """
    out = writable_file(out, "--out")  # before the evaluation, not after it
    from tunedb.cli.train import progress_printer
    from tunedb.costmodel.errors import CostModelError
    from tunedb.report import build_report
    from tunedb.report.data import ReportError
    from tunedb.report.render import clean

    with open_store(db, read_only=True) as store:
        try:
            rep = build_report(store, kind=kind, device=device, model=model, folds=folds, seed=seed,
                               lofo=lofo, progress=progress_printer())
        except CostModelError as e:
            raise ReportError(str(e)) from None
    path = rep.write(out)
    if json_out:
        print_json(clean({"out": str(path), **rep.data}))
        return
    d = rep.data
    s = d["summary"]
    line = (f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): {s['measurements']:,} measurements "
            f"({s['failed']:,} failed), {s['workloads']:,} workloads")
    ev = d["evaluation"]
    if ev:
        roof = ev["baselines"]["roofline"]
        line += (f"; held-out pairwise accuracy {ev['pairwise_accuracy']:.3f} (roofline "
                 f"{roof['pairwise_accuracy']:.3f}), top-1 {ev['top1_score']:.3f} "
                 f"(roofline {roof['top1_score']:.3f})")
    else:
        line += f"; no held-out evaluation: {d['evaluation_note']}"
    typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("report")(handle_errors(report))

"""``tunedb train``: fit the cost model on a tuning database, evaluate it on held-out workloads,
save it to a model registry and record it in the database's ``models`` table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from tunedb.cli.common import (
    DbOption,
    JsonOption,
    existing_db,
    handle_errors,
    print_json,
    usage_error,
    writable_dir,
)

_LABELS = {"top1_score": "top-1", "top1_within_2pct": "top-1 ≤2%", "decisive_pair_accuracy": "decisive",
           "pairwise_accuracy": "pairwise", "pairwise_accuracy_pooled": "pw pooled", "top5_score": "top-5",
           "mape": "MAPE", "spearman": "Spearman"}


def default_out() -> Path:
    """Where ``train`` saves without ``--out``: $TUNEDB_MODELS, else the user data folder (never
    the shipped models, which every plan uses)."""
    env = os.environ.get("TUNEDB_MODELS")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tunedb" / "models"


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}"


def _table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> Any:
    from rich.table import Table

    from tunedb.costmodel.metrics import METRIC_KEYS

    table = Table(title=title)
    table.add_column("predictor")
    for k in METRIC_KEYS:
        table.add_column(_LABELS.get(k, k), justify="right")
    for name, m in rows:
        table.add_row(name, *(_fmt(m.get(k)) for k in METRIC_KEYS))
    return table


def _print(metrics: dict[str, Any], where: Path) -> None:
    from rich.console import Console

    console = Console()
    held = (f"{metrics['folds']}-fold GroupKFold by workload, {metrics['workloads']} workloads, "
            f"{metrics['rows']:,} rows")
    rows = [("model", metrics)] + list(metrics["baselines"].items())
    console.print(_table(f"held-out ({held}); model objective {metrics['objective']}", rows))
    from tunedb.costmodel.evaluate import SPLITS

    splits = [(s, metrics[s]) for s in SPLITS if metrics.get(s)]
    if len(splits) > 1:
        console.print(_table("held out by workload, op, shape, family (pairwise: mean over workloads)",
                             splits))
    lo = (metrics.get("leave_family_out") or {}).get("families") or {}
    if lo:
        console.print(_table("leave_family_out, per family", sorted(lo.items())))
    console.print(f"model saved to {where}", highlight=False, soft_wrap=True)


def progress_printer() -> Any:
    """Phase lines on stderr with the seconds since the start (training takes minutes), when
    stderr is a terminal; ``None`` otherwise (logs and pipes get the result alone)."""
    import sys
    import time

    if not sys.stderr.isatty():
        return None
    t0 = time.monotonic()
    return lambda msg: typer.echo(f"[{time.monotonic() - t0:6.1f}s] {msg}", err=True)


def train(
    db: DbOption = None,
    kind: Annotated[str, typer.Option(
        "--kind", help="Candidate kind to learn (fusion, packing, stage, schedule).")]
    = "fusion",
    out: Annotated[Path | None, typer.Option(
        "--out", show_default=False, help="Model registry root; the model goes to "
        "OUT/<device>/<kind>/ (model.ubj + card.json). Default: $TUNEDB_MODELS, else "
        "$XDG_DATA_HOME/tunedb/models (~/.local/share/tunedb/models).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where XGBoost trains: cpu or cuda.")] = "cpu",
    device_id: Annotated[str | None, typer.Option(
        "--device-id", help="GPU model whose measurements to learn, as a device name or any of its "
        "boards' ids; needed when the database holds several models. All boards of the model "
        "(name, compute capability, SM count) are learnt together.")] = None,
    boards: Annotated[str, typer.Option(
        "--boards", help="With several boards: each (a row per candidate and board) or median "
        "(a row per candidate, the median over boards).")] = "each",
    folds: Annotated[int, typer.Option("--folds", min=2, help="GroupKFold folds by workload.")] = 5,
    objective: Annotated[str, typer.Option(
        "--objective", help="auto (regression vs ranking, better held-out pairwise accuracy wins), "
        "reg:squarederror, rank:pairwise or rank:ndcg.")] = "auto",
    lofo: Annotated[bool, typer.Option("--lofo/--no-lofo",
                                       help="Also hold out whole ops, shapes and families.")] = True,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the splits and of XGBoost.")] = 0,
    json_out: JsonOption = False,
) -> None:
    """Train the XGBoost cost model on the database's measurements and evaluate it held-out.

    Every metric comes from workloads the model did not see: GroupKFold by workload (and, with
    --lofo, by op, shape and family), next to the analytic roofline and a random baseline. The
    model is saved as OUT/<device>/<kind>/model.ubj with card.json, and recorded in the
    database's models table. Several boards of one GPU model (name, compute capability, SM
    count) train one model; held-out pairs never compare measurements of two boards. Progress
    goes to stderr (on a terminal). With --json, prints one JSON object: by_workload, leave_op_out,
    leave_shape_out and leave_family_out, each with top1_score, top1_within_2pct,
    decisive_pair_accuracy, pairwise_accuracy (mean over workloads), pairwise_accuracy_pooled,
    top5_score, spearman and mape; the by_workload ones also at the top level; baselines
    {roofline, random}, objective, folds, rows, workloads, boards, grid_pairs, model_dir, model_id.

    Example: tunedb train --db h200.duckdb --out my-models --json
    """
    from tunedb.costmodel.from_store import train_on_store

    if device not in ("cpu", "cuda"):
        usage_error(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        import xgboost

        if not xgboost.build_info().get("USE_CUDA"):
            usage_error("--device cuda: this XGBoost is built without CUDA (the xgboost-cpu "
                        "distribution); install the xgboost distribution in its place (docs/install.md)")
    path = existing_db(db)
    # Both writes happen after minutes of training: check them first.
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        usage_error(f"database {path} is not writable (train records the model in it)")
    root = writable_dir(out if out is not None else default_out())
    if kind == "stage":  # IOS stages: features from their members (tunedb.costmodel.stage)
        from tunedb.costmodel.stage import train_on_store as train_stage

        metrics = train_stage(path, out_root=root, device_id=device_id, folds=folds, seed=seed,
                              progress=progress_printer())
        if json_out:
            print_json(metrics)
        else:
            for split in ("by_workload", "by_family", "rule_longest_group", "rule_sum_of_groups"):
                m = {k: float(metrics.get(split, {}).get(k, float("nan")))
                     for k in ("mape", "median_ape", "spearman")}
                typer.echo(f"{split:20s} MAPE {m['mape']:.3f}  median {m['median_ape']:.3f}  "
                           f"spearman {m['spearman']:.3f}")
            typer.echo(f"model saved to {metrics['model_dir']}", err=True)
        return
    if kind == "packing":  # its own features and trainer (tunedb.costmodel.packing), same splits
        from tunedb.costmodel.packing import train_on_store as train_packing

        metrics = train_packing(path, out_root=root, device_id=device_id, folds=folds, lofo=lofo,
                                seed=seed, progress=progress_printer())
        if json_out:
            print_json(metrics)
        else:
            _print(metrics, Path(metrics["model_dir"]))
        return
    result = train_on_store(path, out_root=root, kind=kind, device_id=device_id, boards=boards,
                            folds=folds, lofo=lofo, objective=objective, device=device, seed=seed,
                            progress=progress_printer())
    if json_out:
        print_json({**result.metrics, "model_dir": str(result.model_dir), "model_id": result.model_id,
                    "device_name": result.device_name})
        return
    _print(result.metrics, result.model_dir)
    if os.environ.get("TUNEDB_MODELS") is None:
        typer.echo(f"plans use it with --model {result.model_dir}, or with "
                   f"TUNEDB_MODELS={root} for every plan", err=True)


def register(app: typer.Typer) -> None:
    app.command("train")(handle_errors(train))

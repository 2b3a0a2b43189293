"""``tunedb train``: fit the cost model on a tuning database, evaluate it on held-out workloads,
save it to the model registry and record it in the database's ``models`` table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tunedb.cli_common import (
    DbOption,
    JsonOption,
    fail,
    handle_errors,
    open_store,
    print_json,
    register_error,
)
from tunedb.costmodel.errors import CostModelError, TrainError
from tunedb.costmodel.metrics import METRIC_KEYS
from tunedb.records import canonical_json, sha256_hex

register_error(CostModelError)
register_error(TrainError)

_LABELS = {"pairwise_accuracy": "pairwise acc", "top1_score": "top-1", "top5_score": "top-5",
           "mape": "MAPE", "spearman": "Spearman"}


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}"


def _table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> Table:
    table = Table(title=title)
    table.add_column("predictor")
    for k in METRIC_KEYS:
        table.add_column(_LABELS[k], justify="right")
    for name, m in rows:
        table.add_row(name, *(_fmt(m.get(k)) for k in METRIC_KEYS))
    return table


def _print(metrics: dict[str, Any], where: Path | None) -> None:
    console = Console()
    held = (f"{metrics['folds']}-fold GroupKFold by workload, {metrics['workloads']} workloads, "
            f"{metrics['rows']:,} rows")
    rows = [("model", metrics)] + list(metrics["baselines"].items())
    console.print(_table(f"held-out ({held}); model objective {metrics['objective']}", rows))
    lo = metrics.get("leave_one_family_out") or {}
    if lo:
        fam_rows = [(name, m) for name, m in sorted(lo["families"].items())]
        fam_rows += [("all families (pooled)", lo)] + [(f"  {k}", m) for k, m in lo["baselines"].items()]
        console.print(_table("leave-one-family-out", fam_rows))
    if where is not None:
        console.print(f"model saved to {where}", highlight=False, soft_wrap=True)


def _pick_device(frame: Any, device_id: str | None) -> str:
    ids = sorted(set(frame["device_id"].to_pylist()))
    if device_id is not None:
        names = {}
        for i, n in zip(frame["device_id"].to_pylist(), frame["device_name"].to_pylist()):
            names.setdefault(i, n)
        hits = [i for i in ids if i == device_id] or [i for i in ids if names[i] == device_id]
        if len(hits) != 1:
            fail(f"--device-id {device_id!r} matches {len(hits)} of the devices with data "
                 f"({', '.join(f'{i} {names[i]}' for i in ids)})")
        return hits[0]
    if len(ids) > 1:
        fail(f"the database holds measurements from {len(ids)} devices ({', '.join(ids)}); "
             "choose one with --device-id")
    return ids[0]


def train(
    db: DbOption = None,
    kind: Annotated[str, typer.Option("--kind", help="Candidate kind to learn (fusion, packing, schedule).")]
    = "fusion",
    out: Annotated[Path, typer.Option("--out", help="Model registry root; the model goes to "
                                      "OUT/<device>/<kind>/ (model.ubj + card.json).")] = Path("models"),
    device: Annotated[str, typer.Option("--device", help="Where XGBoost trains: cpu or cuda.")] = "cpu",
    device_id: Annotated[str | None, typer.Option(
        "--device-id", help="GPU whose measurements to learn (id or name); needed when the database "
        "holds several.")] = None,
    folds: Annotated[int, typer.Option("--folds", min=2, help="GroupKFold folds by workload.")] = 5,
    objective: Annotated[str, typer.Option(
        "--objective", help="auto (regression vs ranking, better held-out pairwise accuracy wins), "
        "reg:squarederror, rank:pairwise or rank:ndcg.")] = "auto",
    lofo: Annotated[bool, typer.Option("--lofo/--no-lofo",
                                       help="Also evaluate leave-one-family-out.")] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the splits and of XGBoost.")] = 0,
    json_out: JsonOption = False,
) -> None:
    """Train the XGBoost cost model on the database's measurements and evaluate it held-out.

    Every metric comes from workloads the model did not see: GroupKFold by workload (and, with
    --lofo, leave-one-family-out), next to the analytic roofline and a random baseline. The
    model is saved as OUT/<device>/<kind>/model.ubj with card.json, and recorded in the
    database's models table. With --json, prints one JSON object: pairwise_accuracy, top1_score,
    top5_score, mape, spearman, baselines {roofline, random}, leave_one_family_out, objective,
    folds, rows, workloads, model_dir and model_id.

    Example: tunedb train --db h200.duckdb --out models --json
    """
    # XGBoost and scikit-learn load only when training, not for every tunedb command.
    from tunedb.costmodel.fit import device_facts_for, fit_frame
    from tunedb.costmodel.train import TrainParams

    params = TrainParams(objective=objective, device=device, seed=seed)
    with open_store(db, read_only=True) as store:
        # Graphs once per workload, not once per measurement row.
        frame = store.training_frame(kind=kind, include_graph=False)
        if frame.num_rows == 0:
            fail(f"no ok measurements of kind {kind!r} in {store.path}")
        dev_id = _pick_device(frame, device_id)
        if len(set(frame["device_id"].to_pylist())) > 1:
            frame = store.training_frame(kind=kind, device_id=dev_id, include_graph=False)
        devices = store.devices()
        wanted = set(frame["workload_hash"].to_pylist())
        graphs = {w.hash: w.graph_json for w in store.workloads() if w.hash in wanted}
    facts = device_facts_for(frame, devices)
    err = Console(stderr=True)
    say = None if json_out or not err.is_terminal else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    model, metrics, where = fit_frame(frame, kind=kind, out_root=out, device=facts, params=params,
                                      folds=folds, lofo=lofo, progress=say, graphs=graphs)
    card_json = canonical_json(model.card)
    model_id = sha256_hex(card_json)[:16]
    with open_store(db) as store:
        store.add_model(model_id, kind, facts.name, str(where), card_json)
    if json_out:
        print_json({**metrics, "model_dir": str(where), "model_id": model_id, "device_name": facts.name})
        return
    _print(metrics, where)


def register(app: typer.Typer) -> None:
    app.command("train")(handle_errors(train))

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


def _pick_boards(frame: Any, devices: list[Any], device_id: str | None) -> tuple[list[str], list[Any]]:
    """The boards (device ids) of the one device model to learn: the database's only model, or
    the model of ``device_id`` (a board's id, or a device name naming one model)."""
    with_data = set(frame["device_id"].to_pylist())
    boards = [d for d in devices if d.id in with_data]
    models: dict[tuple[str, str, int], list[Any]] = {}
    for d in boards:
        models.setdefault((d.name, d.compute_capability, int(d.sm_count)), []).append(d)

    def label(key: tuple[str, str, int]) -> str:
        ids = ", ".join(d.id for d in models[key])
        return f"{key[0]} (cc {key[1]}, {key[2]} SMs: {ids})"

    keys = sorted(models)
    if device_id is not None:
        keys = [k for k in keys if any(d.id == device_id for d in models[k])] or \
            [k for k in keys if k[0] == device_id]
        if len(keys) != 1:
            fail(f"--device-id {device_id!r} matches {len(keys)} of the device models with data "
                 f"({'; '.join(label(k) for k in sorted(models))})")
    elif len(keys) > 1:
        fail(f"the database holds measurements from {len(keys)} device models "
             f"({'; '.join(label(k) for k in keys)}); choose one with --device-id")
    chosen = models[keys[0]]
    return [d.id for d in chosen], chosen


def train(
    db: DbOption = None,
    kind: Annotated[str, typer.Option("--kind", help="Candidate kind to learn (fusion, packing, schedule).")]
    = "fusion",
    out: Annotated[Path, typer.Option("--out", help="Model registry root; the model goes to "
                                      "OUT/<device>/<kind>/ (model.ubj + card.json).")] = Path("models"),
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
                                       help="Also evaluate leave-one-family-out.")] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the splits and of XGBoost.")] = 0,
    json_out: JsonOption = False,
) -> None:
    """Train the XGBoost cost model on the database's measurements and evaluate it held-out.

    Every metric comes from workloads the model did not see: GroupKFold by workload (and, with
    --lofo, leave-one-family-out), next to the analytic roofline and a random baseline. The
    model is saved as OUT/<device>/<kind>/model.ubj with card.json, and recorded in the
    database's models table. Several boards of one GPU model (name, compute capability, SM
    count) train one model; held-out pairs never compare measurements of two boards. With
    --json, prints one JSON object: pairwise_accuracy, top1_score, top5_score, mape, spearman,
    baselines {roofline, random}, leave_one_family_out, objective, folds, rows, workloads,
    boards, grid_pairs, model_dir and model_id.

    Example: tunedb train --db h200.duckdb --out models --json
    """
    # XGBoost and scikit-learn load only when training, not for every tunedb command.
    import pyarrow as pa
    import pyarrow.compute as pc

    from tunedb.costmodel.fit import BOARD_ROWS, device_facts_for, fit_frame
    from tunedb.costmodel.train import TrainParams

    if boards not in BOARD_ROWS:
        fail(f"--boards must be one of {', '.join(BOARD_ROWS)}, got {boards!r}")
    params = TrainParams(objective=objective, device=device, seed=seed)
    with open_store(db, read_only=True) as store:
        # Graphs once per workload, not once per measurement row.
        frame = store.training_frame(kind=kind, include_graph=False)
        if frame.num_rows == 0:
            fail(f"no ok measurements of kind {kind!r} in {store.path}")
        ids, devices = _pick_boards(frame, store.devices(), device_id)
        if len(set(frame["device_id"].to_pylist())) > len(ids):
            frame = frame.filter(pc.is_in(frame["device_id"], value_set=pa.array(ids)))
        wanted = set(frame["workload_hash"].to_pylist())
        graphs = {w.hash: w.graph_json for w in store.workloads() if w.hash in wanted}
    facts = device_facts_for(frame, devices)
    err = Console(stderr=True)
    say = None if json_out or not err.is_terminal else (lambda msg: err.print(f"[dim]{msg}[/dim]"))
    model, metrics, where = fit_frame(frame, kind=kind, out_root=out, device=facts, params=params,
                                      folds=folds, lofo=lofo, progress=say, graphs=graphs,
                                      devices=devices, boards=boards)
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

"""Train a cost model on a tuning database (what ``tunedb train`` runs): choose the device model
to learn, read its frame and graphs, fit, save and record the model in the database."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunedb.costmodel.errors import TrainError
from tunedb.records import canonical_json, sha256_hex
from tunedb.store import BUSY_WAIT_S, TuningStore


@dataclass(frozen=True)
class TrainResult:
    metrics: dict[str, Any]
    model_dir: Path
    model_id: str
    device_name: str


def pick_boards(frame: Any, devices: list[Any], device_id: str | None) -> tuple[list[str], list[Any]]:
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
            raise TrainError(f"--device-id {device_id!r} matches {len(keys)} of the device models with "
                             f"data ({'; '.join(label(k) for k in sorted(models))})")
    elif len(keys) > 1:
        raise TrainError(f"the database holds measurements from {len(keys)} device models "
                         f"({'; '.join(label(k) for k in keys)}); choose one with --device-id")
    chosen = models[keys[0]]
    return [d.id for d in chosen], chosen


def train_on_store(db: Path, *, out_root: Path, kind: str = "fusion", device_id: str | None = None,
                   boards: str = "each", folds: int = 5, lofo: bool = True, objective: str = "auto",
                   device: str = "cpu", seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> TrainResult:
    """Fit, evaluate held-out, save under ``out_root`` and record in the database's ``models``
    table (the path stored absolute). The database is read, then opened for writing only to add
    the model row; the caller checks first that both can be written."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tunedb.costmodel.fit import BOARD_ROWS, device_facts_for, fit_frame
    from tunedb.costmodel.train import TrainParams
    if boards not in BOARD_ROWS:
        raise TrainError(f"--boards must be one of {', '.join(BOARD_ROWS)}, got {boards!r}")
    if seed < 0:
        raise TrainError(f"--seed must be 0 or more, got {seed}")
    params = TrainParams(objective=objective, device=device, seed=seed)
    say = progress or (lambda _msg: None)
    with TuningStore.open(db, read_only=True, wait_s=BUSY_WAIT_S) as store:
        # Graphs once per workload, not once per measurement row.
        frame = store.training_frame(kind=kind, include_graph=False)
        if frame.num_rows == 0:
            raise TrainError(f"no ok measurements of kind {kind!r} in {store.path}")
        ids, devices = pick_boards(frame, store.devices(), device_id)
        if len(set(frame["device_id"].to_pylist())) > len(ids):
            frame = frame.filter(pc.is_in(frame["device_id"], value_set=pa.array(ids)))
        wanted = set(frame["workload_hash"].to_pylist())
        graphs = {w.hash: w.graph_json for w in store.workloads() if w.hash in wanted}
    facts = device_facts_for(frame, devices)
    model, metrics, where = fit_frame(frame, kind=kind, out_root=out_root, device=facts, params=params,
                                      folds=folds, lofo=lofo, progress=say, graphs=graphs,
                                      devices=devices, boards=boards)
    assert where is not None  # out_root was given
    where = Path(where).resolve()
    card_json = canonical_json(model.card)
    model_id = sha256_hex(card_json)[:16]
    with TuningStore.open(db, wait_s=BUSY_WAIT_S) as store:
        store.add_model(model_id, kind, facts.name, str(where), card_json)
    return TrainResult(metrics=metrics, model_dir=where, model_id=model_id, device_name=facts.name)

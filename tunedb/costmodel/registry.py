"""Model registry on disk: ``<root>/<device>/<kind>/model.ubj`` + ``card.json``.

The booster is XGBoost's own UBJSON format and the card plain JSON: nothing is pickled, and a
model can be read by any XGBoost. Loading refuses a card written under another feature schema
(or with other feature names), since the booster's columns would silently mean other things.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import xgboost as xgb

from tunedb._version import __version__
from tunedb.costmodel.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, DeviceFacts
from tunedb.costmodel.model import CostModel, CostModelError
from tunedb.costmodel.train import TrainParams, TrainResult

MODEL_FILE = "model.ubj"
CARD_FILE = "card.json"


def slug(name: str) -> str:
    """A device or kind name as a directory name: 'NVIDIA H200' -> 'nvidia-h200'."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not s:
        raise CostModelError(f"cannot make a directory name from {name!r}")
    return s


def model_dir(root: str | os.PathLike[str], device_name: str, kind: str) -> Path:
    return Path(root) / slug(device_name) / slug(kind)


def data_snapshot_hash(frame: pa.Table) -> str:
    """SHA-256 over the training rows (candidate, device, label), independent of row order."""
    cols = [c for c in ("candidate_hash", "device_id", "median_us") if c in frame.column_names]
    if not cols:
        raise CostModelError("frame has none of candidate_hash, device_id, median_us to hash")
    t = frame.select(cols).sort_by([(c, "ascending") for c in cols])
    h = hashlib.sha256()
    for c in cols:
        col = t[c]
        if pa.types.is_floating(col.type):
            h.update(np.ascontiguousarray(col.to_numpy(zero_copy_only=False), dtype="<f8").tobytes())
        else:
            h.update("\n".join(str(v) for v in col.to_pylist()).encode())
        h.update(b"\x00")
    return h.hexdigest()


def make_card(result: TrainResult, params: TrainParams, device: DeviceFacts, kind: str,
              snapshot: dict[str, Any], metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model card: everything needed to trust, reproduce and refuse the model."""
    return {
        "kind": kind,
        "device_name": device.name,
        "device": device.to_json(),
        "feature_schema_version": FEATURE_SCHEMA_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "objective": result.objective,
        "calibration": [float(result.calibration[0]), float(result.calibration[1])],
        "calibration_floor": float(result.calibration_floor),
        "best_iteration": int(result.best_iteration),
        # The booster is the average of this many early-stopped members (``average_boosters``).
        "bag": len(result.best_iterations) or 1,
        "best_iterations": [int(i) for i in result.best_iterations],
        "level_iterations": [int(i) for i in result.level_iterations],
        "target": params.target,
        "objectives_tried": result.tried,
        "hyperparameters": params.to_json(),
        # Threads depend on the machine's load at training time, not on the model.
        "xgboost_params": {k: v for k, v in params.xgb_params(result.objective, result.n_train).items()
                           if k != "nthread"},
        "data": snapshot,
        "rows": {"train": result.n_train, "valid": result.n_valid},
        "metrics": metrics or {},
        "tunedb_version": __version__,
        "xgboost_version": xgb.__version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        # mkstemp creates the file private (0600); a model is an ordinary shared file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model(model: CostModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model.ubj`` and ``card.json`` into ``directory`` (created); returns it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    raw = model.booster.save_raw(raw_format="ubj")
    _atomic_write(d / MODEL_FILE, bytes(raw))
    # The card goes last: a directory with a card always has the matching booster beside it.
    _atomic_write(d / CARD_FILE, (json.dumps(model.card, indent=2, sort_keys=True) + "\n").encode())
    return d


def _check_card(card: dict[str, Any], where: Path) -> None:
    version = card.get("feature_schema_version")
    if version != FEATURE_SCHEMA_VERSION:
        raise CostModelError(f"model {where} was trained with feature schema v{version}, this tunedb "
                             f"uses v{FEATURE_SCHEMA_VERSION}; retrain with 'tunedb train'")
    names = tuple(card.get("feature_names", ()))
    if names != FEATURE_NAMES:
        diff = next((f"{a!r} vs {b!r}" for a, b in zip(names, FEATURE_NAMES) if a != b),
                    f"{len(names)} vs {len(FEATURE_NAMES)} features")
        raise CostModelError(f"model {where} has other feature names than feature schema "
                             f"v{FEATURE_SCHEMA_VERSION} ({diff}); retrain with 'tunedb train'")


def load_model(directory: str | os.PathLike[str]) -> CostModel:
    """Load a model directory (or its card.json); refuses another feature schema."""
    d = Path(directory)
    if d.name == CARD_FILE:
        d = d.parent
    card_path, model_path = d / CARD_FILE, d / MODEL_FILE
    if not card_path.is_file():
        raise CostModelError(f"no model card at {card_path}")
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as e:
        raise CostModelError(f"cannot read model card {card_path}: {e}") from None
    if not isinstance(card, dict):
        raise CostModelError(f"model card {card_path} is not a JSON object")
    _check_card(card, d)
    if not model_path.is_file():
        raise CostModelError(f"model card {card_path} has no booster beside it ({MODEL_FILE})")
    raw = model_path.read_bytes()
    # XGBoost aborts the whole process on an empty buffer (std::terminate): check first.
    if not raw.startswith(b"{"):
        what = "the file is empty" if not raw else "not an XGBoost UBJSON model"
        raise CostModelError(f"cannot read booster {model_path}: {what}; retrain it with 'tunedb train'")
    booster = xgb.Booster()
    try:
        booster.load_model(bytearray(raw))
    except (xgb.core.XGBoostError, UnicodeDecodeError, ValueError):
        raise CostModelError(f"cannot read booster {model_path}: truncated or corrupt; retrain it "
                             "with 'tunedb train'") from None
    if booster.num_features() != len(FEATURE_NAMES):
        raise CostModelError(f"booster {model_path} takes {booster.num_features()} features, "
                             f"the card names {len(FEATURE_NAMES)}")
    return CostModel(booster, card)


MODELS_ENV = "TUNEDB_MODELS"


def default_models_root() -> Path | None:
    """The registry a plan reads when it is given no cost model: ``$TUNEDB_MODELS`` (set but
    empty: none), else the shipped models (package ``tunedb.models``: the top-level ``models/``
    folder of a checkout, package data in an installed wheel)."""
    env = os.environ.get(MODELS_ENV)
    if env is not None:
        return Path(env) if env else None
    return shipped_models_root()


def shipped_models_root() -> Path | None:
    """Where the models shipped with tunedb are, or None when there are none."""
    try:
        root = Path(str(importlib.resources.files("tunedb.models")))
    except ModuleNotFoundError:  # an editable install made before the models were package data
        root = Path(__file__).resolve().parents[2] / "models"
    return root if root.is_dir() else None


def find_model(root: str | os.PathLike[str], device_name: str, kind: str = "fusion") -> CostModel:
    """The registered model for a device name and kind under ``root``."""
    return load_model(model_dir(root, device_name, kind))


def list_models(root: str | os.PathLike[str]) -> list[Path]:
    """Every model directory (one holding a card) under ``root``."""
    return sorted(p.parent for p in Path(root).glob(f"*/*/{CARD_FILE}"))

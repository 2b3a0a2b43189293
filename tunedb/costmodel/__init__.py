"""Cost model: features, XGBoost training, held-out evaluation and the model registry.

    from tunedb.costmodel import fit_frame, load_model
    model, metrics, where = fit_frame(store.training_frame("fusion"), out_root="models")
    us = load_model(where).predict_candidates(graph, configs)

Modules: ``features`` (FEATURE_SCHEMA_VERSION, FEATURE_NAMES, featurize*), ``workload``
(per-workload facts), ``train`` (train_booster), ``metrics`` / ``evaluate`` (ranking metrics,
the four held-out splits: by workload, leave op / shape / family out), ``ceiling`` (the noise
ceiling from re-measurements), ``model`` (CostModel), ``registry`` (save/load, model cards),
``fit`` (the whole pipeline), ``synthetic`` (test data; benchmarks/bench_train.py times training
on it).
Names are imported lazily so that ``import tunedb.costmodel.features`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FEATURE_SCHEMA_VERSION": "features", "FEATURE_NAMES": "features", "DeviceFacts": "features",
    "featurize": "features", "featurize_frame": "features", "featurize_candidates": "features",
    "TrainParams": "train", "TrainError": "train", "train_booster": "train",
    "cross_validate": "evaluate", "evaluate_splits": "evaluate", "Labels": "evaluate", "SPLITS": "evaluate",
    "remeasurement_ceiling": "ceiling",
    "CostModel": "model", "CostModelError": "model",
    "save_model": "registry", "load_model": "registry", "find_model": "registry", "model_dir": "registry",
    "fit_frame": "fit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tunedb.costmodel.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'tunedb.costmodel' has no attribute {name!r}")

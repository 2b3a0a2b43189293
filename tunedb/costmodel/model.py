"""CostModel: a trained booster plus its card; predicts kernel latency in microseconds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import xgboost as xgb

from tunedb.costmodel.errors import CostModelError
from tunedb.costmodel.features import (
    FEATURE_NAMES,
    FEATURE_SCHEMA_VERSION,
    DeviceFacts,
    featurize_candidates,
    featurize_frame,
)
from tunedb.costmodel.train import REGRESSION, predict_us


@dataclass
class CostModel:
    """``card`` holds at least objective, calibration [a, b] (and calibration_floor c: log(us) =
    a * cost + b + c * log(floor_us + 2.5), c = 1 for regression on the floor-relative target),
    device (DeviceFacts JSON), feature_schema_version and feature_names; see
    ``registry.make_card``."""

    booster: xgb.Booster
    card: dict[str, Any] = field(default_factory=dict)

    @property
    def objective(self) -> str:
        return str(self.card.get("objective", REGRESSION))

    @property
    def device(self) -> DeviceFacts:
        return DeviceFacts.from_json(self.card.get("device", {}))

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.card.get("feature_names", FEATURE_NAMES))

    def features(self, frame: Any) -> np.ndarray:
        """The feature matrix for a training-frame-like table (pyarrow Table or dict of columns)."""
        return featurize_frame(frame, self.device)

    def _matrix(self, frame_or_features: Any) -> np.ndarray:
        if isinstance(frame_or_features, (pa.Table, Mapping)):
            try:
                return self.features(frame_or_features)
            except ValueError as e:
                raise CostModelError(str(e)) from None
        X = np.asarray(frame_or_features, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != len(self.feature_names):
            raise CostModelError(f"feature matrix has shape {X.shape}; this model needs "
                                 f"(n, {len(self.feature_names)}) (feature schema v{FEATURE_SCHEMA_VERSION})")
        return X

    def predict_cost(self, frame_or_features: Any) -> np.ndarray:
        """The model's ordering key (lower = faster): predicted log microseconds. Within one
        workload this is the booster's own order (the calibration adds a workload constant)."""
        return np.log(self.predict(frame_or_features))

    def predict(self, frame_or_features: Any) -> np.ndarray:
        """Predicted latency in microseconds, one per row of a frame or feature matrix."""
        X = self._matrix(frame_or_features)
        return predict_us(self.booster, X, self.objective, self.card.get("calibration", (1.0, 0.0)),
                          float(self.card.get("calibration_floor", 0.0)))

    def predict_candidates(self, graph: Any, configs: Sequence[Mapping[str, Any]],
                           workload_hash: str | None = None) -> np.ndarray:
        """Predicted µs for each config of one workload (the planner's query)."""
        return self.predict(featurize_candidates(graph, configs, self.device, workload_hash))

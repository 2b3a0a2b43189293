"""Cost-model errors, importable without XGBoost or scikit-learn (the CLI registers them)."""

from __future__ import annotations


class CostModelError(ValueError):
    """A model cannot be trained, loaded or used (schema mismatch, missing files, bad input)."""


class TrainError(ValueError):
    """Training cannot proceed (too little data, bad labels, bad parameters)."""

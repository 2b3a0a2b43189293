"""Shared pytest setup: tests marked ``gpu`` run only where CuPy sees a CUDA device."""

from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CUDA driver errors on machines without a GPU
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CuPy with a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_default_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans in tests price by the roofline unless a test names a cost model: the models shipped
    under models/ would otherwise be picked up by default (tests of that default unset this)."""
    monkeypatch.setenv("TUNEDB_MODELS", "")

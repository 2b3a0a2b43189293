"""Shared pytest setup.

Markers: ``gpu`` tests run only where CuPy sees a CUDA device; ``nogpu`` tests (the one-line
errors a user without a GPU gets) run only where none is; ``slow`` marks CPU tests of more than a
few seconds (nvcc builds, emulation sweeps, training on the shipped data, wheel builds), left out
of the fast tier ``pytest -m "not gpu and not slow"``. ``has_gpu()`` is the one check.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def has_gpu() -> bool:
    """Whether CuPy imports and sees at least one CUDA device (asked once per session)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CUDA driver errors on machines without a GPU
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nogpu: checks behaviour without a CUDA device; skipped where one is")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = has_gpu()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (CuPy with a GPU)")
    skip_nogpu = pytest.mark.skip(reason="checks the error on machines without a GPU")
    for item in items:
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("nogpu") and gpu:
            item.add_marker(skip_nogpu)


@pytest.fixture(autouse=True)
def _no_default_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans in tests price by the roofline unless a test names a cost model: the models shipped
    under models/ would otherwise be picked up by default (tests of that default unset this)."""
    monkeypatch.setenv("TUNEDB_MODELS", "")

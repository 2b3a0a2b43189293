"""tunedb: autotuning database and cost-model trainer for GPU kernel fusion and scheduling.

``import tunedb`` needs neither CuPy nor a GPU; only ``tunedb.runtime`` touches CuPy.
"""

from __future__ import annotations

from typing import Any

from tunedb._version import __version__

__all__ = ["__version__", "compile"]


def compile(model: Any, **kwargs: Any) -> Any:
    """Plan ``model`` (ONNX path / ModelProto, or a Graph) -> ``tunedb.plan.Plan``; see
    ``tunedb.plan.driver.compile``. Imported on first use so that ``import tunedb`` stays light."""
    from tunedb.plan.driver import compile as _compile

    return _compile(model, **kwargs)

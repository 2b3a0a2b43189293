"""GPU runtime: device identity, the measurement protocol, the crash-isolated worker, replay.

Importing this package never imports CuPy; only the functions that run on a GPU do, lazily.
"""

from __future__ import annotations

from typing import Any

from tunedb.runtime.cuda import CudaDevice
from tunedb.runtime.device import NoGPUError, clocks, device_info
from tunedb.runtime.emu import EmuDevice
from tunedb.runtime.replay import ReplayDevice, ReplayError
from tunedb.runtime.worker import Worker, WorkerError

__all__ = ["NoGPUError", "ReplayDevice", "ReplayError", "Worker", "WorkerError", "clocks",
           "device_info", "open_device"]


def open_device(spec: str = "cuda", workers: int | None = None, timeout_s: float = 60.0,
                protocol: Any = None) -> Any:
    """``"cuda"`` -> ``CudaDevice`` (raises ``NoGPUError`` without one); ``"replay:PATH"`` ->
    ``ReplayDevice`` (CPU only); ``"emu"`` -> ``EmuDevice`` (the CPU emulator: verifies, never
    times). All offer ``info``, ``clocks()``, ``prefetch``, ``measure``, ``close``."""
    if spec.startswith("replay:"):
        path = spec[len("replay:"):]
        if not path:
            raise ValueError("--device replay:PATH needs a path to a Parquet export dir or a database")
        return ReplayDevice(path, protocol=protocol)
    if spec == "emu":
        return EmuDevice(timeout_s=max(timeout_s, 600.0), protocol=protocol)
    if spec not in ("cuda", "gpu"):
        raise ValueError(f"unknown device {spec!r}; expected 'cuda', 'emu' or 'replay:PATH'")

    return CudaDevice(workers=workers, timeout_s=timeout_s, protocol=protocol)

"""Device identity and provenance: ``DeviceInfo`` from CuPy, clocks from nvidia-smi.

CuPy is imported inside functions only, so this module imports on machines without it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tunedb.records import DeviceInfo, sha256_hex

CUPY_MISSING = "no CUDA device: CuPy is not installed (pip install tunedb[cuda13])"


class NoGPUError(RuntimeError):
    """No usable CUDA device (CuPy missing, or it found no device)."""


def import_cupy() -> Any:
    """Import CuPy and make sure it sees a device, else raise ``NoGPUError``."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA library install
        if isinstance(e, ImportError) and getattr(e, "name", "") in ("cupy", None):
            raise NoGPUError(CUPY_MISSING) from None
        raise NoGPUError(f"no CUDA device: CuPy failed to import ({type(e).__name__}: {e})") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        raise NoGPUError(f"no CUDA device: CuPy found no device ({' '.join(str(e).split())})") from None
    if n < 1:
        raise NoGPUError("no CUDA device: CuPy found no device")
    return cupy


@contextmanager
def current_stream(cp: Any, stream: Any) -> Iterator[Any]:
    """``stream`` is CuPy's current stream inside the block; afterwards the stream that was
    current before is again, whoever made it so. ``with stream:`` restores CuPy's stream stack
    instead, which does not record ``Stream.use()``: after the block the null stream was current
    and every later launch of the caller went there, outside its own stream's order."""
    previous = cp.cuda.get_current_stream()
    stream.use()
    try:
        yield stream
    finally:
        previous.use()


def _text(v: Any) -> str:
    return v.decode(errors="replace").rstrip("\x00") if isinstance(v, (bytes, bytearray)) else str(v)


def _uuid_text(props: dict) -> str:
    u = props.get("uuid", b"")
    if isinstance(u, (bytes, bytearray)) and len(u) == 16:
        h = bytes(u).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    return _text(u)


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def device_info(device: int = 0) -> DeviceInfo:
    """Identity of the CUDA device ``device`` (raises ``NoGPUError`` when there is none)."""
    cp = import_cupy()
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(device)
    uuid = _uuid_text(props)
    return DeviceInfo(
        name=_text(props.get("name", "unknown")),
        # The raw UUID identifies one physical board; only its hash is stored.
        uuid_hash=sha256_hex(uuid)[:16] if uuid else "",
        compute_capability=f"{props.get('major', 0)}.{props.get('minor', 0)}",
        sm_count=int(props.get("multiProcessorCount", 0)),
        l2_bytes=int(props.get("l2CacheSize", 0)),
        memory_bytes=int(props.get("totalGlobalMem", 0)),
        driver=_version(int(rt.driverGetVersion())),
        cuda_runtime=_version(int(rt.runtimeGetVersion())),
        cupy_version=str(cp.__version__),
    )


def device_uuid(device: int = 0) -> str:
    try:
        return _uuid_text(import_cupy().cuda.runtime.getDeviceProperties(device))
    except Exception:  # noqa: BLE001
        return ""


_CLOCK_FIELDS = ("sm_mhz", "mem_mhz", "temperature_c", "power_w")


def parse_clocks(text: str) -> dict[str, float]:
    """Parse the first line of ``nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,
    power.draw --format=csv[,noheader,nounits]``; fields that do not parse are left out."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("clocks")]
    if not lines:
        return {}
    out: dict[str, float] = {}
    for key, raw in zip(_CLOCK_FIELDS, lines[0].split(",")):
        tok = raw.strip().split(" ")[0]
        try:
            out[key] = float(tok)
        except ValueError:
            continue
    return out


def clocks(uuid: str = "") -> dict[str, float]:
    """SM/memory clocks, temperature and power now; ``{}`` when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    cmd = [exe, "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
           "--format=csv,noheader,nounits"]
    for extra in ([f"--id={uuid}"] if uuid else []), []:
        try:
            r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return {}
        if r.returncode == 0:
            return parse_clocks(r.stdout)
    return {}

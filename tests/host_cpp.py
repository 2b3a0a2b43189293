"""CUDA kernel source compiled as host C++ for CPU tests: one thread at index 0 runs every
element, so a kernel's arithmetic is checked against NumPy without a GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest


def build_host_lib(directory: Path, source: str) -> ctypes.CDLL:
    """``source`` compiled into a shared library in ``directory``; skips without a C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (directory / "k.cpp").write_text(source)
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", str(directory / "k.cpp"), "-o",
                    str(directory / "k.so")], check=True, capture_output=True)
    return ctypes.CDLL(str(directory / "k.so"))


def call_host(fn, *args) -> None:
    """Call a host-compiled kernel: arrays by pointer, everything else as a 64-bit integer."""
    fn(*[ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else ctypes.c_longlong(int(a))
         for a in args])

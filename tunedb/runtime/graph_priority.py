"""A CUDA graph whose kernels keep the priority of the stream they were captured on.

Stream capture copies each stream's priority into its kernel nodes, but a graph instantiated
without ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`` runs every node at the priority of
the stream it is launched into, and CuPy instantiates without flags. ``capture_with_priorities``
captures through the driver API (``libcuda`` by ctypes; CUstream and cudaStream_t are one
handle) and instantiates with that flag, so a staged plan's critical lane can run at a higher
priority than the groups beside it. Nothing here is imported without a GPU.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any

CAPTURE_MODE_RELAXED = 2          # CU_STREAM_CAPTURE_MODE_RELAXED, as CuPy captures
USE_NODE_PRIORITY = 8             # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
_LIB: list[Any] = []
_KEPT: list[Any] = []


def _driver() -> Any:
    if not _LIB:
        _LIB.append(ctypes.CDLL("libcuda.so.1"))
    return _LIB[0]


def _check(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({code})")


def greatest_priority() -> int:
    """The device's highest stream priority (the most negative number)."""
    least, greatest = ctypes.c_int(0), ctypes.c_int(0)
    _check(_driver().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
           "cuCtxGetStreamPriorityRange")
    return int(greatest.value)


def priority_stream(cp: Any, priority: int) -> Any:
    """A non-blocking stream of ``priority`` as a CuPy ``ExternalStream`` (CuPy's own streams
    take no priority); the stream is destroyed with the object."""
    lib = _driver()
    handle = ctypes.c_void_p()
    _check(lib.cuStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(1), ctypes.c_int(priority)),
           "cuStreamCreateWithPriority")  # 1: CU_STREAM_NON_BLOCKING
    stream = cp.cuda.ExternalStream(int(handle.value))
    try:
        weakref.finalize(stream, lib.cuStreamDestroy_v2, handle)
    except TypeError:  # a stream class without weak references: the handle lives on
        _KEPT.append(handle)
    return stream


class PriorityGraph:
    """An instantiated graph; ``launch(stream)`` as ``cupy.cuda.graph.Graph`` has it."""

    def __init__(self, graph: ctypes.c_void_p, exec_: ctypes.c_void_p) -> None:
        self._graph, self._exec = graph, exec_

    def launch(self, stream: Any) -> None:
        _check(_driver().cuGraphLaunch(self._exec, ctypes.c_void_p(stream.ptr)), "cuGraphLaunch")

    def __del__(self) -> None:
        try:
            lib = _driver()
            lib.cuGraphExecDestroy(self._exec)
            lib.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the driver may be gone
            pass


def _capture(lib: Any, stream: Any, enqueue: Callable[[], None]) -> ctypes.c_void_p:
    """The graph ``enqueue()`` captures on ``stream`` (relaxed mode), not instantiated."""
    handle = ctypes.c_void_p(stream.ptr)
    _check(lib.cuStreamBeginCapture_v2(handle, ctypes.c_int(CAPTURE_MODE_RELAXED)), "cuStreamBeginCapture")
    graph = ctypes.c_void_p()
    try:
        enqueue()
    finally:
        code = lib.cuStreamEndCapture(handle, ctypes.byref(graph))
    _check(code, "cuStreamEndCapture")
    return graph


def capture_with_priorities(stream: Any, enqueue: Callable[[], None]) -> PriorityGraph:
    """``enqueue()`` captured on ``stream`` (a CuPy stream, current for the call) and
    instantiated so that each kernel runs at its capturing stream's priority."""
    lib = _driver()
    graph = _capture(lib, stream, enqueue)
    exec_ = ctypes.c_void_p()
    code = lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, ctypes.c_ulonglong(USE_NODE_PRIORITY))
    if code != 0:
        lib.cuGraphDestroy(graph)
        _check(code, "cuGraphInstantiateWithFlags")
    return PriorityGraph(graph, exec_)


def graph_size(stream: Any, enqueue: Callable[[], None]) -> tuple[int, int]:
    """(nodes, edges) of the graph that ``enqueue()`` captures on ``stream`` (not instantiated):
    how many dependencies a schedule's joins put in the graph."""
    lib = _driver()
    graph = _capture(lib, stream, enqueue)
    try:
        nodes, edges = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(nodes)), "cuGraphGetNodes")
        _check(lib.cuGraphGetEdges(graph, None, None, ctypes.byref(edges)), "cuGraphGetEdges")
        return int(nodes.value), int(edges.value)
    finally:
        lib.cuGraphDestroy(graph)

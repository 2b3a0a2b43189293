"""cuDNN convolutions (NCHW or NHWC) that a CUDA graph can capture, where a cuDNN library loads.

CuPy 14 has no cuDNN, so this module calls cuDNN's C API through ``ctypes`` (the legacy
convolution API, still in cuDNN 9), as ``tunedb.runtime.blas`` does for cuBLAS: a handle bound
to the executor's stream, descriptors made once per convolution, an algorithm chosen among
those ``cudnnFindConvolutionForwardAlgorithmEx`` can run when the step is built (before any
capture; ``ALGO_PICK``), then one ``cudnnConvolutionForward`` a run with a fixed workspace (the
executor's shared scratch).
The library is looked up in ``$TUNEDB_CUDNN``, the ``nvidia/cudnn/lib`` folder of the NVIDIA
wheels (which torch installs) on ``sys.path``, then the dynamic loader's search.

Which convolutions go to cuDNN is ``CONV_CUDNN`` (``executor_conv`` decides the im2col forms):
``off`` (im2col + cuBLAS everywhere), ``auto`` (the default, ``cudnn_wanted``), ``always``
(every conv but the depthwise ones); ``$TUNEDB_CONV_CUDNN`` sets it for a process (a
benchmark's peers in the same run). Nothing here imports CuPy; the caller hands it in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import glob
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tunedb.runtime.copykernel import strided_copy

CONV_CUDNN = os.environ.get("TUNEDB_CONV_CUDNN", "auto")
# How a convolution's algorithm is chosen among those Find can run: "find" (Find's own times:
# 95-370 µs for convs that run 17-20 in a graph, host cost included, so its ranking is noise:
# it took WINOGRAD_NONFUSED (61 µs) or IMPLICIT_GEMM (128) for 5 of ResNet-50's 13 3x3s, the
# in-plan loss of session 8), "graph" (each re-timed as a CUDA graph of GRAPH_RUNS calls after
# a warm-up: GPU time alone, what a captured plan pays), "heuristic"
# (cudnnGetConvolutionForwardAlgorithm_v7's first, untimed).
ALGO_PICK = os.environ.get("TUNEDB_CUDNN_PICK", "graph")
GRAPH_RUNS, GRAPH_REPLAYS = 10, 3
# False: each convolution keeps a workspace of its own instead of the executor's shared scratch
# (a benchmark's control; the shared one costs no memory per convolution).
SHARED_WORKSPACE = True
# "nhwc": a convolution runs channels-last (cuDNN NHWC, 1.5-2x NCHW on ResNet-50's bf16 3x3s
# through torch), its input and output transposed around it by the tiled copy kernel, a
# constant weight transposed once; "nchw": on the plan's layout; "auto": NCHW unless
# ``conv_chain`` keeps the plan's activations channels-last between convolutions.
LAYOUT = os.environ.get("TUNEDB_CUDNN_LAYOUT", "auto")
DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 9}  # cudnnDataType_t
NCHW, NHWC, CROSS_CORRELATION = 0, 1, 1
# 16-bit data: tensor ops must be asked for (the default math gave bf16 ResNet-50 convs
# non-tensor-core algorithms on the H200: 3x3 at 56x56 61 µs, torch's cuDNN 20); float32: FMA
# only (cuDNN's default would allow TF32).
TENSOR_OP_MATH, FMA_MATH = 1, 3
ALGO_COUNT = 8
FIND_WORKSPACE = 64 << 20  # the largest workspace an algorithm may ask for
# Loaded before libcudnn so its dlopen calls by soname find them (wheels keep them side by side).
SUBLIBS = ("libcudnn_graph", "libcudnn_engines_precompiled", "libcudnn_engines_runtime_compiled",
           "libcudnn_heuristic", "libcudnn_ops", "libcudnn_cnn")
_LIB: list[Any] = []
Launch = Callable[[], None]
_RETIRED: list[int] = []  # handles of collected ``Cudnn`` objects, destroyed by the next one


class CudnnError(RuntimeError):
    """cuDNN could not be loaded or a call failed (one-line message)."""


class AlgoPerf(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


def conv_params(x_shape: Sequence[int], w_shape: Sequence[int], a: dict) -> tuple[int, ...] | None:
    """``(pad_h, pad_w, stride_h, stride_w, dil_h, dil_w, groups)`` of cuDNN's 2-D convolution
    descriptor, or None where it has none (asymmetric pads)."""
    pt, pl, pb, pr = (int(p) for p in a["pads"])
    if (pt, pl) != (pb, pr):
        return None
    (sh, sw), (dh, dw) = a["strides"], a["dilations"]
    return pt, pl, int(sh), int(sw), int(dh), int(dw), int(a["groups"])


def cudnn_wanted(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], a: dict,
                 itemsize: int) -> bool:
    """Whether ``CONV_CUDNN`` sends a convolution that is not depthwise to cuDNN (``always``:
    every one with symmetric pads, 1x1 ones included). ``auto``: 16-bit data, ungrouped, more
    than one output pixel a sample (the squeeze-excitation convs stay one cuBLAS GEMV batch:
    2.0 against 2.9-3.5 µs) and not a window wider than 3x3 on under 16 channels (ResNet-50's
    7x7 stem: im2col 71.7 against 84.6). H200, bf16 b8, every conv in cuDNN NCHW, in-plan
    (benchmarks/bench_conv_inplan.py, algorithms re-timed as graphs): EfficientNet-B0 732 ->
    650 µs, ResNet-50 1063 -> 942 (-> 914 with the 3x3 convs alone, 635 channels-last:
    ``conv_chain``)."""
    if CONV_CUDNN == "off" or conv_params(x_shape, w_shape, a) is None:
        return False
    if CONV_CUDNN == "always":
        return True
    _, c, _, _ = x_shape
    o, _, kh, kw = w_shape
    return itemsize == 2 and int(a["groups"]) == 1 and int(out_shape[2]) * int(out_shape[3]) > 1 \
        and not (c < 16 and kh * kw > 9)


def conv_layout(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], a: dict,
                itemsize: int) -> str:
    """The layout a convolution sent to cuDNN runs in on its own: ``LAYOUT``, NCHW under
    "auto" (channels-last pays only with its neighbours: ``conv_chain``)."""
    return "nchw" if LAYOUT == "auto" else LAYOUT


def _candidates() -> list[str]:
    env = os.environ.get("TUNEDB_CUDNN", "")
    found = [env] if env else []
    for d in sys.path:
        found += sorted(glob.glob(os.path.join(d or ".", "nvidia", "cudnn", "lib", "libcudnn.so.*")))
    lib = ctypes.util.find_library("cudnn")
    return found + ([lib] if lib else []) + ["libcudnn.so.9"]


def library() -> Any:
    """The cuDNN shared library with the prototypes used here (loaded once)."""
    if _LIB:
        return _LIB[0]
    errors = []
    lib = None
    for path in _candidates():
        folder = os.path.dirname(path)
        for sub in SUBLIBS if folder else ():
            for p in glob.glob(os.path.join(folder, sub + ".so*"))[:1]:
                try:
                    ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
                except OSError as e:
                    errors.append(f"{os.path.basename(p)}: {e}")
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    if lib is None:
        raise CudnnError("cannot load cuDNN: " + "; ".join(errors)[:300])
    vp, i, pi = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    protos = {
        "cudnnCreate": [ctypes.POINTER(vp)], "cudnnDestroy": [vp], "cudnnSetStream": [vp, vp],
        "cudnnCreateTensorDescriptor": [ctypes.POINTER(vp)],
        "cudnnSetTensor4dDescriptor": [vp, i, i, i, i, i, i],
        "cudnnCreateFilterDescriptor": [ctypes.POINTER(vp)],
        "cudnnSetFilter4dDescriptor": [vp, i, i, i, i, i, i],
        "cudnnCreateConvolutionDescriptor": [ctypes.POINTER(vp)],
        "cudnnSetConvolution2dDescriptor": [vp, i, i, i, i, i, i, i, i],
        "cudnnSetConvolutionGroupCount": [vp, i], "cudnnSetConvolutionMathType": [vp, i],
        "cudnnGetConvolution2dForwardOutputDim": [vp, vp, vp, pi, pi, pi, pi],
        "cudnnFindConvolutionForwardAlgorithmEx": [vp, vp, vp, vp, vp, vp, vp, vp, i, pi,
                                                   ctypes.POINTER(AlgoPerf), vp, ctypes.c_size_t],
        "cudnnConvolutionForward": [vp, vp, vp, vp, vp, vp, vp, i, vp, ctypes.c_size_t, vp, vp, vp],
        "cudnnGetConvolutionForwardAlgorithm_v7": [vp, vp, vp, vp, vp, i, pi, ctypes.POINTER(AlgoPerf)],
    }
    for name, args in protos.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise CudnnError(f"cuDNN library lacks {name}") from None
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.cudnnGetErrorString.argtypes, lib.cudnnGetErrorString.restype = [i], ctypes.c_char_p
    lib.cudnnGetVersion.argtypes, lib.cudnnGetVersion.restype = [], ctypes.c_size_t
    _LIB.append(lib)
    return lib


def _check(lib: Any, status: int, what: str) -> None:
    if status != 0:
        raise CudnnError(f"{what} failed: {lib.cudnnGetErrorString(status).decode(errors='replace')}")


class Cudnn:
    """A cuDNN handle bound to ``stream``; ``conv`` builds one convolution's launch. Keep it alive
    as long as a CUDA graph replays its calls."""

    def __init__(self, cp: Any, stream: Any) -> None:
        lib = self.lib = library()
        while _RETIRED:
            lib.cudnnDestroy(_RETIRED.pop())
        self.cp, self.stream, self.version = cp, stream, int(lib.cudnnGetVersion())
        self.chosen: list[tuple[int, int, float]] = []  # (algo, workspace bytes, Find's ms) a conv
        self.found: list[dict] = []  # a conv's shapes and every candidate's times
        h = ctypes.c_void_p()
        _check(lib, lib.cudnnCreate(ctypes.byref(h)), "cudnnCreate")
        self.handle = h.value
        self._final = weakref.finalize(self, _RETIRED.append, self.handle)
        self._final.atexit = False
        _check(lib, lib.cudnnSetStream(self.handle, int(stream.ptr) or None), "cudnnSetStream")

    def _desc(self, kind: str, setter: str, *args: int) -> ctypes.c_void_p:
        d = ctypes.c_void_p()
        _check(self.lib, getattr(self.lib, f"cudnnCreate{kind}Descriptor")(ctypes.byref(d)), kind)
        _check(self.lib, getattr(self.lib, setter)(d, *args), setter)
        return d

    def conv(self, x: Any, w: Any, out: Any, a: dict, dtype: str,
             scratch: Callable[[int], Callable[[], Any]], constant_w: bool = False,
             layout: str = "nchw", io_nhwc: tuple[bool, bool] = (False, False)) -> list[Launch]:
        """The launches of ``out = conv2d(x, w)`` (NCHW, contiguous, no bias) on stored arrays of
        ``dtype``; its workspace (and with ``layout`` "nhwc" the transposed input and output,
        and the weight unless ``constant_w``) comes from ``scratch`` (the executor's shared
        buffer). ``io_nhwc``: the input already holds NHWC data / the output is to (no
        transpose there; ``conv_chain``)."""
        lib, cp = self.lib, self.cp
        params = conv_params(x.shape, w.shape, a)
        if params is None or dtype not in DATA_TYPES:
            raise CudnnError(f"no cuDNN convolution for pads {a['pads']} / {dtype}")
        if not (x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous):
            raise CudnnError("cuDNN convolution on strided arrays")
        t, nhwc = DATA_TYPES[dtype], layout == "nhwc"
        fmt = NHWC if nhwc else NCHW
        xd = self._desc("Tensor", "cudnnSetTensor4dDescriptor", fmt, t, *map(int, x.shape))
        yd = self._desc("Tensor", "cudnnSetTensor4dDescriptor", fmt, t, *map(int, out.shape))
        wd = self._desc("Filter", "cudnnSetFilter4dDescriptor", t, fmt, *map(int, w.shape))
        cd = self._desc("Convolution", "cudnnSetConvolution2dDescriptor", *params[:6], CROSS_CORRELATION,
                        DATA_TYPES["float32"])
        _check(lib, lib.cudnnSetConvolutionGroupCount(cd, params[6]), "cudnnSetConvolutionGroupCount")
        _check(lib, lib.cudnnSetConvolutionMathType(cd, FMA_MATH if dtype == "float32" else TENSOR_OP_MATH),
               "cudnnSetConvolutionMathType")
        dims = [ctypes.c_int() for _ in range(4)]
        _check(lib, lib.cudnnGetConvolution2dForwardOutputDim(cd, xd, wd, *map(ctypes.byref, dims)),
               "cudnnGetConvolution2dForwardOutputDim")
        if tuple(d.value for d in dims) != tuple(out.shape):
            raise CudnnError(f"cuDNN output {tuple(d.value for d in dims)} is not {tuple(out.shape)}")
        # NHWC: Find and the re-timing run on zeroed stand-ins of the transposed arrays
        fx, fw, fy = (cp.zeros(v.size, v.dtype) for v in (x, w, out)) if nhwc else (x, w, out)
        perf, got = (AlgoPerf * ALGO_COUNT)(), ctypes.c_int()
        ws = cp.empty(FIND_WORKSPACE, dtype=cp.uint8)
        _check(lib, lib.cudnnFindConvolutionForwardAlgorithmEx(
            self.handle, xd, fx.data.ptr, wd, fw.data.ptr, cd, yd, fy.data.ptr, ALGO_COUNT,
            ctypes.byref(got), perf, ws.data.ptr, FIND_WORKSPACE), "cudnnFindConvolutionForwardAlgorithmEx")
        cp.cuda.Device().synchronize()
        ok = [p for p in perf[:got.value] if p.status == 0 and p.memory <= FIND_WORKSPACE]
        if not ok:
            raise CudnnError("cuDNN found no forward algorithm")
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

        def launch(algo: int, ptrs: Callable[[], tuple[int, ...]], nbytes: int) -> Launch:
            def run() -> None:
                px, pw, po, pws = ptrs()
                _check(lib, lib.cudnnConvolutionForward(
                    self.handle, ctypes.byref(one), xd, px, wd, pw, cd, algo, pws, nbytes,
                    ctypes.byref(zero), yd, po), "cudnnConvolutionForward")
            return run

        record = {"x": list(x.shape), "w": list(w.shape), "dtype": dtype, "layout": layout,
                  "find": [{"algo": int(p.algo), "bytes": int(p.memory), "find_us": round(p.time * 1e3, 2)}
                           for p in ok]}
        if ALGO_PICK == "graph":
            find_ptrs = (fx.data.ptr, fw.data.ptr, fy.data.ptr, ws.data.ptr)
            for c in record["find"]:
                try:
                    c["graph_us"] = self._graph_us(launch(c["algo"], lambda: find_ptrs, c["bytes"]))
                except Exception as e:  # noqa: BLE001 - one that does not capture is not picked
                    c["graph_us"], c["error"] = float("inf"), str(e).splitlines()[0][:100] if str(e) else "?"
            cp.cuda.Device().synchronize()
            pick = min(record["find"], key=lambda c: c["graph_us"])
        elif ALGO_PICK == "heuristic":
            pick = self._heuristic(xd, wd, cd, yd, record["find"])
        else:
            pick = min(record["find"], key=lambda c: c["find_us"])
        del ws, fx, fw, fy
        algo, nbytes = pick["algo"], pick["bytes"]
        record["pick"] = algo
        self.found.append(record)
        self.chosen.append((algo, nbytes, pick["find_us"] / 1e3))
        keep = (xd, yd, wd, cd, one, zero, x, w, out)
        if not nhwc:
            if SHARED_WORKSPACE:
                get = scratch(max(1, nbytes))
            else:
                own = cp.empty(max(1, nbytes), dtype=cp.uint8)
                get = lambda: own  # noqa: E731
            run = launch(algo, lambda: (x.data.ptr, w.data.ptr, out.data.ptr, get().data.ptr), nbytes)
            run.keep = (keep, get)  # type: ignore[attr-defined]  # what the call's pointers point into
            return [run]
        view: dict[str, Any] = {}  # the transposed arrays' launches and pointers, bound at the first run
        return self._nhwc_launches(launch(algo, lambda: view["ptrs"], nbytes), x, w, out, nbytes, scratch,
                                   constant_w, view, keep, io_nhwc)

    def _nhwc_launches(self, conv: Callable[[], None], x: Any, w: Any, out: Any, nbytes: int,
                       scratch: Callable[[int], Callable[[], Any]], constant_w: bool, view: dict,
                       keep: tuple, io_nhwc: tuple[bool, bool]) -> list[Launch]:
        """Transpose in, ``conv`` (channels-last), transpose out (where ``io_nhwc`` does not
        say the array holds NHWC already); the transposed arrays (and a weight that is not
        constant) in the shared scratch, bound at the first run."""
        cp = self.cp
        n, c, h, wd = x.shape
        o, cg, kh, kw = w.shape
        p = out.shape[2] * out.shape[3]

        def rounded(nb: int) -> int:
            return -(-nb // 256) * 256
        isz = x.dtype.itemsize
        xo, yo = 0, rounded(x.size * isz)
        wo = yo + rounded(out.size * isz)
        so = wo + (0 if constant_w else rounded(w.size * isz))
        get = scratch(so + max(1, nbytes))
        w_nhwc = cp.ascontiguousarray(w.reshape(o, cg, kh * kw).transpose(0, 2, 1)) if constant_w else None

        def bind() -> None:
            buf = get()

            def part(off: int, a: Any, *shape: int) -> Any:
                return buf[off:off + a.size * isz].view(x.dtype).reshape(shape)
            xt = x.reshape(n, h * wd, c) if io_nhwc[0] else part(xo, x, n, h * wd, c)
            yt = out.reshape(n, p, o) if io_nhwc[1] else part(yo, out, n, p, o)
            wt = w_nhwc if constant_w else part(wo, w, o, kh * kw, cg)
            view["x"] = None if io_nhwc[0] else \
                strided_copy(cp, x.reshape(n, c, h * wd).transpose(0, 2, 1), xt)
            view["w"] = None if constant_w else \
                strided_copy(cp, w.reshape(o, cg, kh * kw).transpose(0, 2, 1), wt)
            view["y"] = None if io_nhwc[1] else strided_copy(cp, yt.transpose(0, 2, 1), out.reshape(n, o, p))
            view["ptrs"] = (xt.data.ptr, wt.data.ptr, yt.data.ptr, buf.data.ptr + so)

        def transpose_in() -> None:
            if "ptrs" not in view:
                bind()
            for part in (view["x"], view["w"]):
                if part is not None:
                    part()

        def conv_bound() -> None:
            if "ptrs" not in view:
                bind()
            conv()

        def transpose_out() -> None:
            view["y"]()

        conv_bound.keep = (keep, w_nhwc, get)  # type: ignore[attr-defined]
        ins = [transpose_in] if not (io_nhwc[0] and constant_w) else []
        return ins + [conv_bound] + ([] if io_nhwc[1] else [transpose_out])

    def _graph_us(self, run: Callable[[], None]) -> float:
        """GPU µs of one ``run``: a CUDA graph of ``GRAPH_RUNS`` calls on the handle's stream
        after an eager warm-up (lazily loaded kernels load there), best of ``GRAPH_REPLAYS``."""
        cp, stream = self.cp, self.stream
        with stream:
            run()
            stream.synchronize()
            gc.disable()  # a finalizer freeing device memory would break the capture
            try:
                stream.begin_capture()
                try:
                    for _ in range(GRAPH_RUNS):
                        run()
                finally:
                    graph = stream.end_capture()
            finally:
                gc.enable()
            graph.launch(stream)
            times = []
            for _ in range(GRAPH_REPLAYS):
                t0, t1 = cp.cuda.Event(), cp.cuda.Event()
                t0.record(stream)
                graph.launch(stream)
                t1.record(stream)
                t1.synchronize()
                times.append(cp.cuda.get_elapsed_time(t0, t1) * 1e3 / GRAPH_RUNS)
        return round(min(times), 2)

    def _heuristic(self, xd: Any, wd: Any, cd: Any, yd: Any, found: list[dict]) -> dict:
        """The first of cuDNN's heuristic ranking that Find could run."""
        perf, got = (AlgoPerf * ALGO_COUNT)(), ctypes.c_int()
        _check(self.lib, self.lib.cudnnGetConvolutionForwardAlgorithm_v7(
            self.handle, xd, wd, cd, yd, ALGO_COUNT, ctypes.byref(got), perf),
            "cudnnGetConvolutionForwardAlgorithm_v7")
        by_algo = {c["algo"]: c for c in found}
        for p in perf[:got.value]:
            if p.status == 0 and int(p.algo) in by_algo:
                return by_algo[int(p.algo)]
        return min(found, key=lambda c: c["find_us"])

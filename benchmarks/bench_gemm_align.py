"""cuBLAS GEMMs as the executor calls them (``tunedb.runtime.blas``) with row strides as the
tensors have them next to the same GEMMs with every row stride padded to 16 bytes: does an
unaligned leading dimension cost, and how much? (ResNet-50's 14x14 and 7x7 convolutions in
bfloat16 have rows of 392 and 98 bytes; Whisper's attention scores rows of 3000.) Also CLIP
vision's batch-1 GEMMs (50 rows), next to torch's matmul on the same operands.

    python benchmarks/bench_gemm_align.py OUT.json [--dtype bfloat16] [--reps 20]

Each case: ``out[b] = x[b] @ y[b]`` (a missing batch dim broadcasts), both layouts verified
against torch's float32 matmul of the same values, then timed as a CUDA graph of ``reps``
back-to-back calls (median of 5 replays), next to ``torch.matmul`` on contiguous operands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tunedb.bench.fusion import _one_line
from tunedb.bench.provenance import provenance

# name -> (x shape, y shape): out = x @ y
CASES = {
    "resnet50 b8 1x1 14x14 (W @ x[n])": ((256, 1024), (8, 1024, 196)),
    "resnet50 b8 3x3 14x14 im2col": ((256, 2304), (8, 2304, 196)),
    "resnet50 b8 3x3 7x7 im2col": ((512, 4608), (8, 4608, 49)),
    "resnet50 b8 3x3 7x7 merged": ((512, 4608), (4608, 392)),
    "whisper b8 scores q @ k^T": ((48, 1500, 64), (48, 64, 1500)),
    "whisper b8 probs @ v": ((48, 1500, 1500), (48, 1500, 64)),
    # CLIP vision at batch 1 (50 tokens): fp32 ran 0.56x JAX; few output tiles per GEMM
    "clip_vision b1 qkv": ((50, 768), (768, 2304)),
    "clip_vision b1 fc2": ((50, 3072), (3072, 768)),
    "clip_vision b1 patch conv": ((768, 3072), (3072, 49)),
}


def _padded(cp: Any, shape: tuple[int, ...], dtype: Any, pad_to: int) -> Any:
    """A ``shape`` view into a buffer whose last dim is rounded up to ``pad_to`` elements."""
    full = (*shape[:-1], -(-shape[-1] // pad_to) * pad_to)
    return cp.zeros(full, dtype=dtype)[..., :shape[-1]]


def run_case(xs: tuple[int, ...], ys: tuple[int, ...], dtype: str, reps: int) -> dict:
    import cupy as cp
    import torch
    from bench_conv import _graph_us, _torch_us

    from tunedb.runtime.blas import Blas

    bf16 = dtype == "bfloat16"
    tdt = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    xt = torch.randn(xs, device="cuda", generator=gen).to(tdt)
    yt = (torch.randn(ys, device="cuda", generator=gen) / xs[-1] ** 0.5).to(tdt)
    want = torch.matmul(xt.float(), yt.float())
    torch.cuda.synchronize()
    out_shape = tuple(want.shape)
    store = cp.uint16 if bf16 else cp.float32
    res: dict[str, Any] = {"out": list(out_shape)}
    per = 8 if bf16 else 4  # elements in 16 bytes
    for name, pad in (("as_is", 1), ("padded", per)):
        stream = cp.cuda.Stream(non_blocking=True)
        blas = Blas(cp, stream)
        x, y, out = (_padded(cp, s, store, pad) for s in (xs, ys, out_shape))
        with stream:
            x[...] = cp.asarray(xt.view(torch.int16) if bf16 else xt).view(store)
            y[...] = cp.asarray(yt.view(torch.int16) if bf16 else yt).view(store)
        stream.synchronize()
        try:
            launch = blas.gemm(x, y, out, dtype="bfloat16" if bf16 else None)
            with stream:
                launch()
            stream.synchronize()
            got = torch.as_tensor(cp.ascontiguousarray(out).view(cp.int16) if bf16 else
                                  cp.ascontiguousarray(out), device="cuda")
            got = got.view(torch.bfloat16).float() if bf16 else got
            err = float((got - want).norm() / want.norm())
            r = {"rel_err": err, "ok": err < (1e-2 if bf16 else 1e-5),
                 "ld_bytes": [int(a.strides[-2]) for a in (x, y, out)]}
            if r["ok"]:
                r["us"] = _graph_us(cp, stream, [launch], reps)
        except Exception as e:  # noqa: BLE001
            r = {"error": _one_line(e)}
        res[name] = r
        del blas
    try:
        res["torch"] = {"us": _torch_us(torch, lambda: torch.matmul(xt, yt), reps)}
    except Exception as e:  # noqa: BLE001
        res["torch"] = {"error": _one_line(e)}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    rec: dict[str, Any] = {"benchmark": "bench_gemm_align", "dtype": args.dtype, "reps": args.reps,
                           "provenance": provenance(argv), "cases": {}}
    for name, (xs, ys) in CASES.items():
        rec["cases"][name] = r = run_case(xs, ys, args.dtype, args.reps)
        args.out.write_text(json.dumps(rec, indent=1))
        cells = [f"{k} {v['us']:.1f} us" if "us" in v else f"{k} {v.get('error', 'FAIL')}"
                 for k, v in r.items() if isinstance(v, dict)]
        print(f"{name}: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

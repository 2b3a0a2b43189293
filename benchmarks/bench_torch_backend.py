"""``torch.compile(model, backend=tunedb_backend)`` on BERT-base and ResNet-50 on the local GPU:
outputs against eager, times against eager (not for a table of peers: the zoo benchmark has
those) and the backend's own plans replayed without the hand-off.

    python benchmarks/bench_torch_backend.py OUT.json [--gpu-lock FILE] [--only NAME ...]

Models as the zoo builds them (``export_zoo.MODELS``: library default configs, random weights,
batch 1, BERT at sequence 128), in fp32 and bf16, TF32 off. Per model and dtype: the compile
time (Dynamo capture, ONNX export, tunedb plan, executor build and its check against the eager
graph), the number of FX graphs Dynamo handed over and how many run as tunedb plans, the largest
difference from eager relative to the output's largest magnitude, and three throughput times:
eager, the compiled module end to end (inputs copied into the plan's buffers, outputs copied out), and
the sum of its plans' CUDA-graph replays (what tunedb's ONNX path times). Timings hold
``--gpu-lock`` (``bench_zoo_plan.gpu_lock``) so that they can run beside the zoo benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_zoo_plan import locked_timer  # noqa: E402 - the sibling script

from tunedb.bench.fusion import _one_line  # noqa: E402
from tunedb.bench.provenance import provenance  # noqa: E402

CASES = (("bert_base", "float32"), ("bert_base", "bfloat16"),
         ("resnet50", "float32"), ("resnet50", "bfloat16"))


def _build(name: str, dtype: str) -> tuple[Any, tuple]:
    import torch
    from export_zoo import MODELS, _FirstOutput

    torch.manual_seed(0)
    model, args, names, _ = MODELS[name]()
    model = _FirstOutput(model, names if "input_ids" in names else None).eval()
    low = getattr(torch, dtype)
    model = model.to(low).cuda()
    args = tuple((a.to(low) if a.is_floating_point() else a).cuda() for a in args)
    return model, args


def one(name: str, dtype: str, lock: Path, target_s: float) -> dict:
    import torch

    from tunedb.frontends.torch_backend import TOLERANCE, TunedbGraph, tunedb_backend

    rec: dict[str, Any] = {"model": name, "dtype": dtype}
    timer = locked_timer(lock, target_s)
    model, args = _build(name, dtype)
    with torch.no_grad():
        want = model(*args).float()
        graphs: list[TunedbGraph] = []

        def backend(gm: Any, example_inputs: Any) -> Any:
            g = tunedb_backend(gm, example_inputs)
            graphs.append(g)
            return g

        torch._dynamo.reset()
        fast = torch.compile(model, backend=backend)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fast(*args).float()
        torch.cuda.synchronize()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        rec["warnings"] = [str(w.message)[:300] for w in caught if "tunedb" in str(w.message)]
        rec["fx_graphs"] = len(graphs)
        rec["planned"] = sum(g.executor is not None for g in graphs)
        rec["kernels"] = [g.plan.kernels if g.plan is not None else None for g in graphs]
        rec["fallbacks"] = [g.fallback for g in graphs if g.fallback]
        scale = float(want.abs().max()) or 1.0
        rec["max_rel_err"] = float((got - want).abs().max()) / scale
        atol, rtol = TOLERANCE[dtype]
        rec["equal_within_tolerance"] = bool(torch.allclose(got, want, atol=atol * scale, rtol=rtol))
        sync = torch.cuda.synchronize
        rec["eager_us"] = timer(lambda: model(*args), sync)
        rec["backend_us"] = timer(lambda: fast(*args), sync)
        ex = [g.executor for g in graphs if g.executor is not None]
        if ex and len(ex) == len(graphs):
            def replay() -> None:
                for e in ex:
                    e.replay()

            def sync_all() -> None:
                for e in ex:
                    e.synchronize()
            rec["plan_replay_us"] = timer(replay, sync_all)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", nargs="*", default=None, help="model names (bert_base, resnet50)")
    p.add_argument("--gpu-lock", type=Path, default=Path(tempfile.gettempdir()) / "tunedb-gpu.lock")
    p.add_argument("--target-s", type=float, default=0.1)
    a = p.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {"benchmark": "torch_backend", "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(), "cases": [], **provenance()}
    for name, dtype in CASES:
        if a.only and name not in a.only:
            continue
        try:
            rec = one(name, dtype, a.gpu_lock, a.target_s)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            rec = {"model": name, "dtype": dtype, "error": _one_line(e)}
        print(json.dumps(rec), flush=True)
        result["cases"].append(rec)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export tiny torch modules that make the exporters emit the ONNX op families of issue 21
(reductions, normalizations, data movement, activations) to data/graphs/onnx_ops, weights
kept (each file is a few KB). tests/test_onnx_ops.py imports every file and compares tunedb's
float64 reference with onnxruntime; what an exporter cannot export is listed in the manifest.

    PYTHONPATH=. python benchmarks/export_onnx_op_models.py [--out DIR]   # torch, onnxscript
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import onnx
import torch
from torch import nn
from torch.nn import functional as F

OUT = Path(__file__).resolve().parent.parent / "data" / "graphs" / "onnx_ops"


class Fn(nn.Module):
    def __init__(self, fn, *params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.p = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in params])

    def forward(self, *xs):
        return self.fn(*xs, *self.p)


def _kv_update(cache, new):  # a KV-cache write at fixed positions (index_put)
    cache = cache.clone()
    cache[:, 2:4] = new
    return cache * 1.0


def _scatter(x, src):
    idx = torch.tensor([[0, 3], [1, 2], [4, 0]])
    return x.scatter(1, idx, src)


def cases() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(21)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    img, seq = r(2, 8, 6, 6), r(2, 5, 16)
    return {
        "logsumexp": (Fn(lambda x: torch.logsumexp(x, dim=1)), (seq,)),
        "instance_norm": (nn.InstanceNorm2d(8, affine=True), (img,)),
        "group_norm": (nn.GroupNorm(4, 8), (img,)),
        "layer_norm_2d": (nn.LayerNorm([6, 6]), (img,)),
        "normalize_l2": (Fn(lambda x: F.normalize(x, dim=-1)), (seq,)),
        "norm_l1": (Fn(lambda x: torch.linalg.vector_norm(x, ord=1, dim=2)), (seq,)),
        "mean_middle_axis": (Fn(lambda x: x.mean(dim=1)), (seq,)),
        "var_std": (Fn(lambda x: torch.var(x, dim=(0, 2)) + x.std(dim=2).sum()), (seq,)),
        "interp_nearest": (Fn(lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest")), (img,)),
        "interp_bilinear": (Fn(lambda x: F.interpolate(x, size=(9, 11), mode="bilinear")), (img,)),
        "interp_bilinear_ac": (Fn(lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear",
                                                          align_corners=True)), (img,)),
        "pixel_shuffle": (Fn(lambda x: F.pixel_shuffle(x, 2)), (img,)),
        "pixel_unshuffle": (Fn(lambda x: F.pixel_unshuffle(x, 2)), (img,)),
        "repeat": (Fn(lambda x: x.repeat(2, 1, 3)), (seq,)),
        "roll": (Fn(lambda x: torch.roll(x, 3, dims=2)), (seq,)),
        "flip": (Fn(lambda x: torch.flip(x, dims=(1,))), (seq,)),
        "one_hot": (Fn(lambda i: F.one_hot(i, 7).float() * 2.0), (torch.randint(0, 7, (3, 4), generator=g),)),
        "kv_cache_update": (Fn(_kv_update), (r(2, 8, 4), r(2, 2, 4))),
        "scatter": (Fn(_scatter), (r(3, 5), r(3, 2))),
        "activations": (Fn(lambda x: F.softplus(x) + F.mish(x) + F.elu(x) + F.selu(x) + F.celu(x, 1.5)
                           + F.hardswish(x) + F.hardsigmoid(x) + F.silu(x) + F.softsign(x)
                           + F.hardtanh(x) + F.relu6(x) + F.logsigmoid(x) + F.tanhshrink(x)
                           + F.softshrink(x) + F.hardshrink(x)), (seq * 3,)),
        "prelu": (nn.PReLU(5), (seq,)),
        "trig": (Fn(lambda x: torch.atan(x) + torch.tan(x) + torch.sinh(x) + torch.cosh(x)
                    + torch.asinh(x) + torch.round(x * 2)), (seq,)),
        "inverse_trig": (Fn(lambda x: torch.asin(x) + torch.acos(x) + torch.atanh(x * 0.9)),
                         (torch.rand(3, 7, generator=g) * 1.8 - 0.9,)),
        "glu_chunk": (Fn(lambda x: F.glu(x, dim=-1)), (seq,)),
        "masked_fill": (Fn(lambda x: x.masked_fill(x > 0.5, -1e4).softmax(-1)), (seq,)),
        "amax_argmax": (Fn(lambda x: x.amax(dim=1) + x.argmax(dim=1).float()), (seq,)),
        "log_softmax_nll": (Fn(lambda x, t: F.cross_entropy(x, t, reduction="none")),
                            (r(6, 11), torch.randint(0, 11, (6,), generator=g))),
        "cumsum": (Fn(lambda x: torch.cumsum(x, dim=1)), (seq,)),
    }


def export(model: nn.Module, args, path: Path, dynamo: bool) -> None:
    names = [f"in{i}" for i in range(len(args))]
    with torch.no_grad():
        if dynamo:
            torch.onnx.export(model, args, str(path), dynamo=True, opset_version=18, input_names=names,
                              output_names=["y"], external_data=False)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=names,
                              output_names=["y"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, (model, args) in cases().items():
        for dynamo in (False, True):
            file = f"{name}_{'dynamo' if dynamo else 'ts'}.onnx"
            entry = {"file": file, "case": name, "exporter": "dynamo" if dynamo else "torchscript"}
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    export(model.eval(), args, Path(tmp) / "m.onnx", dynamo)
                    m = onnx.load(str(Path(tmp) / "m.onnx"))
                for n in m.graph.node:  # the dynamo exporter records stack traces: no paths
                    del n.metadata_props[:]
                    n.doc_string = ""
                m.doc_string = m.graph.doc_string = ""
                onnx.save(m, str(a.out / file))
                entry["ops"] = sorted({n.op_type for n in m.graph.node})
            except Exception as e:  # the exporter's limits, recorded
                entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            manifest.append(entry)
            print(json.dumps(entry), flush=True)
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

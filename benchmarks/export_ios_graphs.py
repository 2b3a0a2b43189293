"""Export the torchvision graphs of the stage-scheduling benchmark (not run in CI; needs PyTorch
and torchvision; offline, random weights, no downloads).

    PYTHONPATH=. python benchmarks/export_ios_graphs.py [OUT_DIR]   # default: data/graphs/ios

Writes ``inception_v3_b1.onnx`` (torchvision Inception V3, no aux head, 299x299, batch 1) and
``squeezenet1_1_b1.onnx`` / ``squeezenet1_1_b16.onnx`` (224x224): TorchScript exporter, opset 17,
constant folding on, eval mode (batch norm folded into the convs). Weights are stripped (every
float initializer over 1 KB becomes a graph input, ``tunedb.graph.onnx_import.strip_model``);
``import_onnx(path, fill_initializers=True)`` puts seeded values back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import torch
import torchvision

from tunedb.graph.onnx_import import strip_model


def export(model: torch.nn.Module, shape: tuple[int, ...], path: Path) -> None:
    model.eval()
    x = torch.randn(*shape)
    torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["logits"],
                      opset_version=17, do_constant_folding=True, dynamo=False)
    onnx.save(strip_model(onnx.load(str(path))), str(path))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    inc = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False,
                                          transform_input=False)
    export(inc, (1, 3, 299, 299), out / "inception_v3_b1.onnx")
    sq = torchvision.models.squeezenet1_1(weights=None)
    for b in (1, 16):
        export(sq, (b, 3, 224, 224), out / f"squeezenet1_1_b{b}.onnx")


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "data" / "graphs" / "ios"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)

"""Export the benchmark ONNX graphs shipped in this folder (not run in CI; needs PyTorch).

    pip install torch onnxscript            # any recent CPU build of torch
    PYTHONPATH=. python data/graphs/export_graphs.py [OUT_DIR]   # default: this folder

The models are written in plain PyTorch (no transformers / torchvision) with the shapes of the
real architectures, put in eval mode, and exported twice, with static shapes:

- ``NAME.onnx``: the TorchScript exporter (``dynamo=False``, opset 17, constant folding on);
- ``NAME_dynamo.onnx``: the ``torch.export``-based exporter that is PyTorch's default since 2.9
  (``dynamo=True``, opset 18, its optimizer on; needs ``onnxscript``, skipped without it).

Both exporters' graphs must import: they spell the same layers differently (e.g. the dynamo one
emits ReduceMean for global pooling and Pow for GELU tanh). The models:

- ``bert_layer.onnx``: one BERT-base encoder layer (hidden 768, 12 heads, intermediate 3072,
  GELU erf, post-LN, additive attention mask built from an int64 ``attention_mask``), batch 1,
  sequence 128.
- ``gpt2_block.onnx``: one GPT-2 block (pre-LN, fused qkv projection, causal mask via
  ``torch.tril`` + ``torch.where``, GELU tanh), batch 1, sequence 128.
- ``resnet_piece.onnx``: a ResNet-18 stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), two basic
  blocks (the second with stride 2 and a 1x1 downsample), global average pool and a linear head,
  batch 1, 3x224x224. (The exporter folds eval-mode BN into the convs.)
- ``inception_mixed_5b.onnx``: Inception V3's Mixed_5b block (35x35x192 input; 1x1, 5x5 and
  double 3x3 branches, 3x3 average pool + 1x1 branch, concat to 256 channels), batch 1.

Weights are *stripped* to keep the files small: every float initializer larger than 1 KB
becomes a graph input listed in the model metadata (``tunedb.graph.onnx_import.strip_model``).
``import_onnx(path, fill_initializers=True)`` and ``fill_model`` put seeded values back.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import onnx
import torch
import torch.nn.functional as F
from torch import nn

from tunedb.graph.onnx_import import strip_model

HERE = Path(__file__).resolve().parent


class BertLayer(nn.Module):
    def __init__(self, hidden: int = 768, heads: int = 12, inter: int = 3072) -> None:
        super().__init__()
        self.h, self.d = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln_attn = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, inter)
        self.output = nn.Linear(inter, hidden)
        self.ln_out = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.h, self.d).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        # The extended mask of BERT: 0 where attended, the dtype's minimum where padded.
        ext = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        probs = torch.softmax(scores + ext, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, t, c)
        x = self.ln_attn(x + self.attn_out(ctx))
        return self.ln_out(x + self.output(F.gelu(self.intermediate(x))))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.h, self.d = heads, hidden // heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.mlp_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.h, self.d).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(ctx)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNetPiece(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.block1 = BasicBlock(64, 64)
        self.block2 = BasicBlock(64, 128, stride=2)
        self.fc = nn.Linear(128, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.block2(self.block1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, **kw) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """Inception V3's Mixed_5b (torchvision's InceptionA(192, pool_features=32))."""

    def __init__(self, cin: int = 192, pool_features: int = 32) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)


def _randomise_bn(model: nn.Module) -> None:
    """Non-trivial BN statistics, so the folded conv biases are not all zero."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(1.0 + torch.rand(n, generator=g))
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


def models() -> dict[str, tuple[nn.Module, tuple, list[str], list[str]]]:
    torch.manual_seed(0)
    mask = torch.ones(1, 128, dtype=torch.int64)
    mask[:, 112:] = 0  # a padded tail, as in a real batch
    resnet, inception = ResNetPiece(), InceptionA()
    _randomise_bn(resnet)
    _randomise_bn(inception)
    return {
        "bert_layer": (BertLayer(), (torch.randn(1, 128, 768), mask),
                       ["hidden_states", "attention_mask"], ["output"]),
        "gpt2_block": (GPT2Block(), (torch.randn(1, 128, 768),), ["hidden_states"], ["output"]),
        "resnet_piece": (resnet, (torch.randn(1, 3, 224, 224),), ["pixels"], ["logits"]),
        "inception_mixed_5b": (inception, (torch.randn(1, 192, 35, 35),), ["x"], ["mixed_5b"]),
    }


def _scrub(m: onnx.ModelProto) -> None:
    """Drop what exporters record about the exporting machine (stack traces with local paths,
    module hierarchies) and intermediate shapes (tunedb infers its own)."""
    m.graph.doc_string = ""
    for n in m.graph.node:
        n.doc_string = ""
        del n.metadata_props[:]
    del m.graph.value_info[:]


def _has_onnxscript() -> bool:
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True


def export(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    flavours = [("", False, 17)] + ([("_dynamo", True, 18)] if _has_onnxscript() else [])
    if len(flavours) == 1:
        print("onnxscript is not installed: skipping the dynamo exports")
    for suffix, dynamo, opset in flavours:
        for name, (model, args, ins, outs) in models().items():
            path = out_dir / f"{name}{suffix}.onnx"
            model.eval()
            with torch.no_grad():
                if dynamo:
                    prog = torch.onnx.export(model, args, dynamo=True, opset_version=opset,
                                             input_names=ins, output_names=outs)
                    prog.save(str(path))
                else:
                    torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset,
                                      input_names=ins, output_names=outs, do_constant_folding=True)
            m = onnx.load(str(path))
            if m.functions:
                raise SystemExit(f"{path}: the exporter left local functions; inline them first")
            _scrub(m)
            m.graph.name = name
            m.doc_string = f"tunedb benchmark graph {name}: exported by data/graphs/export_graphs.py"
            m = strip_model(m)
            onnx.checker.check_model(m)
            onnx.save(m, str(path))
            print(f"{path}: {path.stat().st_size} bytes, {len(m.graph.node)} nodes")


if __name__ == "__main__":
    export(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)

"""Export the benchmark ONNX graphs shipped in data/graphs (not run in CI; needs PyTorch).

    pip install torch onnxscript            # any recent CPU build of torch
    python benchmarks/export_graphs.py [OUT_DIR]   # default: data/graphs

Runs offline on the CPU (random weights, no downloads) and writes only under OUT_DIR. The models
are written in plain PyTorch (no transformers / torchvision) with the shapes of the real
architectures, put in eval mode, and exported. Three sets:

1. ``OUT_DIR/NAME.onnx`` and ``OUT_DIR/NAME_dynamo.onnx``: the four models below with static
   shapes, batch 1, by the TorchScript exporter (``dynamo=False``, opset 17, constant folding
   on) and by the ``torch.export``-based exporter that is PyTorch's default since 2.9
   (``dynamo=True``, opset 18, its optimizer on; needs ``onnxscript``, skipped without it).
   Both exporters' graphs must import: they spell the same layers differently (e.g. the dynamo
   one emits ReduceMean for global pooling and Pow for GELU tanh).
2. ``OUT_DIR/dynamic/bert_layer.onnx`` and ``OUT_DIR/dynamic/gpt2_block.onnx``: the same two
   transformer layers with a symbolic batch dimension named ``batch`` (TorchScript exporter,
   opset 17), for ``tunedb bench plan data/graphs/dynamic/bert_layer.onnx --batch 1 --batch 32``.
   Each is checked against onnxruntime at two batch sizes after export.
3. ``OUT_DIR/fusion/fusion_<case>.onnx``: the memory-bound subgraphs of the fusion suite, fp32,
   with the shapes of ``tunedb.kernels.suites.ANCHOR_CASES`` (the 12 anchor cases, same names
   and input order), plus LayerNorm backward (``fusion_layernorm_backward_<R>x<C>``: dx, dgamma,
   dbeta from x, gamma and dy, the statistics recomputed, every formula written out) at
   8192x4096 and 65536x768. Every input is a graph input (no initializers). Each is checked
   against the float64 reference of its imported graph; the log says whether its workload hash
   equals the suite case's (then the collected measurements are exact DB hits for it).

The models of set 1:

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

GRAPHS = Path(__file__).resolve().parent.parent / "data" / "graphs"


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


# -- memory-bound subgraphs of the fusion suite ----------------------------------------------------
class Fn(nn.Module):
    """A module around a function of its inputs (the subgraphs have no parameters)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor):
        return self.fn(*xs)


def _eltwise_chain8(x):
    s = torch.sigmoid(torch.tanh(x * 1.7 + 0.3) * x + 1.0)
    return s * 2.0 - torch.exp(-(x * x))


def _softmax_xent(x, label):
    """logsumexp over the row minus the label's logit, written out as the suite does."""
    m = torch.amax(x, dim=1, keepdim=True)
    lse = torch.log(torch.sum(torch.exp(x - m), dim=1, keepdim=True)) + m
    return (lse - torch.gather(x, 1, label)).reshape(x.shape[0])


def _layernorm_backward(x, gamma, dy, eps: float = 1e-5):
    """LayerNorm backward without saved statistics: mean and rstd recomputed from x."""
    mu = torch.mean(x, dim=1, keepdim=True)
    xc = x - mu
    rstd = torch.rsqrt(torch.mean(xc * xc, dim=1, keepdim=True) + eps)
    xh = xc * rstd
    gdy = dy * gamma
    dx = rstd * (gdy - torch.mean(gdy, dim=1, keepdim=True)
                 - xh * torch.mean(gdy * xh, dim=1, keepdim=True))
    return dx, torch.sum(dy * xh, dim=0), torch.sum(dy, dim=0)


def _rmsnorm(x, g):
    return x * torch.rsqrt(torch.mean(x * x, dim=1, keepdim=True) + 1e-6) * g


def _rms_norm(x, g):
    return F.rms_norm(x, (x.shape[-1],), g, eps=1e-6)


# How a subgraph is exported when it is not the default (TorchScript exporter, opset 17): chosen
# so that the exported op is the one the suite's graph uses. At opset 17 GELU tanh becomes seven
# elementwise ops, and rsqrt becomes sqrt + div; opset 20 has Gelu(approximate="tanh"), and the
# torch.export-based exporter writes F.rms_norm as RMSNormalization at opset 23.
EXPORT_AS = {"bias_gelu_8192x4096": {"opset": 20},
             "rmsnorm_8192x4096": {"dynamo": True, "opset": 23, "fn": _rms_norm}}


# name -> (function, [(input name, shape, dtype)], output names). Shapes, names and input order
# follow ANCHOR_CASES (tunedb/kernels/suites.py), so that the imported graphs can hash like the
# suite's workloads; ``div`` shrinks every shape for a quick check of this script.
def fusion_specs(div: int = 1) -> dict[str, tuple]:
    f32 = torch.float32

    def sh(*dims: int) -> tuple[int, ...]:
        return tuple(max(1, d // div) for d in dims)

    def smx(x, m):
        return torch.softmax(x * 0.125 + m, dim=-1)

    def add_ln(x, g, r, beta):
        return F.layer_norm(x + r, (x.shape[-1],), g, beta, eps=1e-5)

    R, C = 8192, 4096
    specs = {
        "bias_gelu_8192x4096": (lambda x, b: F.gelu(x + b, approximate="tanh"),
                                [("x", sh(R, C), f32), ("b", sh(C), f32)], ["y"]),
        "add_layernorm_8192x4096": (add_ln, [("x", sh(R, C), f32), ("g", sh(C), f32), ("r", sh(R, C), f32),
                                             ("beta", sh(C), f32)], ["y"]),
        "add_layernorm_65536x768": (add_ln, [("x", sh(65536, 768), f32), ("g", sh(768), f32),
                                             ("r", sh(65536, 768), f32), ("beta", sh(768), f32)], ["y"]),
        "scale_mask_softmax_8192x4096": (smx, [("x", sh(R, C), f32), ("m", sh(C), f32)], ["y"]),
        "softmax_262144x128": (smx, [("x", sh(262144, 128), f32), ("m", sh(128), f32)], ["y"]),
        "softmax_1024x32768": (smx, [("x", sh(1024, 32768), f32), ("m", sh(32768), f32)], ["y"]),
        "rmsnorm_8192x4096": (_rmsnorm, [("x", sh(R, C), f32), ("g", sh(C), f32)], ["y"]),
        # x is stored [C, R] = 8192 x 4096; the output is [R, C] = 4096 x 8192.
        "transpose_add_8192x4096": (lambda x, z: x.t() + z,
                                    [("x", sh(R, C), f32), ("z", sh(C, R), f32)], ["y"]),
        "col_center_8192x4096": (lambda x: x - torch.mean(x, dim=0, keepdim=True),
                                 [("x", sh(R, C), f32)], ["y"]),
        "eltwise_chain8_8192x4096": (_eltwise_chain8, [("x", sh(R, C), f32)], ["y"]),
        "softmax_xent_8192x4096": (_softmax_xent, [("x", sh(R, C), f32), ("label", sh(R, 1), torch.int64)],
                                   ["loss"]),
        "swiglu_8192x4096": (lambda a, b: a * torch.sigmoid(a) * b,
                             [("a", sh(R, C), f32), ("b", sh(R, C), f32)], ["y"]),
    }
    for r, c in ((8192, 4096), (65536, 768)):
        specs[f"layernorm_backward_{r}x{c}"] = (
            _layernorm_backward, [("x", sh(r, c), f32), ("gamma", sh(c), f32), ("dy", sh(r, c), f32)],
            ["dx", "dgamma", "dbeta"])
    return specs


def _example(inputs: list[tuple[str, tuple[int, ...], torch.dtype]], seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _name, shape, dt in inputs:
        if dt == torch.int64:  # class labels: gather indices into the rows of the first input
            out.append(torch.randint(0, inputs[0][1][-1], shape, generator=g, dtype=dt))
        else:
            out.append(torch.randn(shape, generator=g, dtype=dt))
    return tuple(out)


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


def _finish(m: onnx.ModelProto, name: str, path: Path) -> onnx.ModelProto:
    """Scrub, name, strip and check an exported model, and save it over ``path``."""
    if m.functions:
        raise SystemExit(f"{path}: the exporter left local functions; inline them first")
    _scrub(m)
    m.graph.name = name
    m.doc_string = f"tunedb benchmark graph {name}: exported by benchmarks/export_graphs.py"
    m = strip_model(m)
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    print(f"{path}: {path.stat().st_size} bytes, {len(m.graph.node)} nodes")
    return m


def _export_ts(model: nn.Module, args: tuple, path: Path, ins: list[str], outs: list[str],
               dynamic_axes: dict | None = None, opset: int = 17) -> onnx.ModelProto:
    model.eval()
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset, input_names=ins,
                          output_names=outs, do_constant_folding=True, dynamic_axes=dynamic_axes)
    return onnx.load(str(path))


def _export_dynamo(model: nn.Module, args: tuple, path: Path, ins: list[str], outs: list[str],
                   opset: int) -> onnx.ModelProto:
    model.eval()
    with torch.no_grad():
        prog = torch.onnx.export(model, args, dynamo=True, opset_version=opset, input_names=ins,
                                 output_names=outs)
        prog.save(str(path))
    return onnx.load(str(path))


def export_static(out_dir: Path) -> list[Path]:
    """Set 1: the four models with static shapes, by both exporters."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    flavours = [("", False, 17)] + ([("_dynamo", True, 18)] if _has_onnxscript() else [])
    if len(flavours) == 1:
        print("onnxscript is not installed: skipping the dynamo exports")
    for suffix, dynamo, opset in flavours:
        for name, (model, args, ins, outs) in models().items():
            path = out_dir / f"{name}{suffix}.onnx"
            if dynamo:
                m = _export_dynamo(model, args, path, ins, outs, opset)
            else:
                m = _export_ts(model, args, path, ins, outs)
            _finish(m, name, path)
            written.append(path)
    return written


def _name_batch_dims(m: onnx.ModelProto) -> None:
    """Every symbolic leading dim of the graph's inputs and outputs is called ``batch``."""
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].dim_param = "batch"


def _check_dynamic(path: Path, batches: tuple[int, ...] = (1, 3)) -> None:
    """Import at each batch with seeded weights; compare with onnxruntime on the same model."""
    import numpy as np
    import onnxruntime as ort

    from tunedb.graph.onnx_import import fill_model, import_onnx
    from tunedb.graph.reference import example_feeds, run_reference

    filled = fill_model(path, seed=0)
    sess = ort.InferenceSession(filled.SerializeToString(), providers=["CPUExecutionProvider"])
    for b in batches:
        graph = import_onnx(path, {"batch": b}, fill_initializers=True, seed=0)
        feeds = example_feeds(graph, seed=b)
        want = sess.run(None, feeds)
        got = run_reference(graph, feeds)
        for out, w in zip(graph.outputs, want):
            assert got[out].shape == w.shape and w.shape[0] == b, (path, b, got[out].shape, w.shape)
            scale = float(np.max(np.abs(w)))
            np.testing.assert_allclose(got[out], w, rtol=1e-4, atol=1e-5 * scale)
        print(f"  {path.name}: batch {b} imports and matches onnxruntime")


def export_dynamic(out_dir: Path) -> list[Path]:
    """Set 2: BERT layer and GPT-2 block with a symbolic ``batch`` dim."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    all_models = models()
    for name in ("bert_layer", "gpt2_block"):
        model, args, ins, outs = all_models[name]
        # Traced at batch 2: a batch of 1 invites the tracer to specialise size-1 broadcasts.
        args = tuple(torch.cat([a, a]) for a in args)
        path = out_dir / f"{name}.onnx"
        m = _export_ts(model, args, path, ins, outs,
                       dynamic_axes={v: {0: "batch"} for v in ins + outs})
        _name_batch_dims(m)
        _finish(m, name, path)
        _check_dynamic(path)
        written.append(path)
    return written


def export_fusion(out_dir: Path, div: int = 1) -> list[Path]:
    """Set 3: the memory-bound subgraphs, each checked against the float64 reference."""
    import numpy as np

    from tunedb.graph.hashing import graph_hash
    from tunedb.graph.onnx_import import import_onnx
    from tunedb.graph.reference import run_reference
    from tunedb.kernels.suites import ANCHOR_CASES

    out_dir.mkdir(parents=True, exist_ok=True)
    anchors = {c.name: graph_hash(c.graph) for c in ANCHOR_CASES}
    written = []
    for name, (fn, inputs, outs) in fusion_specs(div).items():
        path = out_dir / f"fusion_{name}.onnx"
        args = _example(inputs)
        how = EXPORT_AS.get(name, {})
        names = [i[0] for i in inputs]
        if how.get("dynamo") and _has_onnxscript():
            m = _export_dynamo(Fn(how.get("fn", fn)), args, path, names, outs, how["opset"])
        else:  # (a dynamo one without onnxscript: the formula itself, by the TorchScript exporter)
            opset = 17 if how.get("dynamo") else how.get("opset", 17)
            m = _export_ts(Fn(fn), args, path, names, outs, opset=opset)
        m = _finish(m, f"fusion_{name}", path)
        if any(len(i.raw_data) > 1024 for i in m.graph.initializer):
            raise SystemExit(f"{path}: has an initializer over 1 KB; the subgraphs must stay tiny")
        graph = import_onnx(path)
        with torch.no_grad():
            want = fn(*args)
        want = want if isinstance(want, tuple) else (want,)
        got = run_reference(graph, {i[0]: a.numpy() for i, a in zip(inputs, args)})
        for v, w in zip(graph.outputs, want):
            w = w.numpy()
            scale = max(1.0, float(np.max(np.abs(w))))
            np.testing.assert_allclose(got[v], w, rtol=1e-4, atol=1e-4 * scale)
        same = "" if div != 1 or name not in anchors else (
            ", hashes like the suite case" if graph_hash(graph) == anchors[name] else
            ", NOT the suite case's hash")
        print(f"  {path.name}: matches the float64 reference{same}")
        written.append(path)
    return written


def export(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = export_static(out_dir) + export_dynamic(out_dir / "dynamic") + export_fusion(out_dir / "fusion")
    print(f"wrote {len(written)} files under {out_dir}:")
    for p in written:
        print(f"  {p.relative_to(out_dir)}")
    return written


if __name__ == "__main__":
    export(Path(sys.argv[1]) if len(sys.argv) > 1 else GRAPHS)

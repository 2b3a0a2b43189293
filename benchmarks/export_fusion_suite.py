"""Build the fusion generalization suite (issue 21) under data/graphs/generalization: every
maximal memory-bound subgraph of real models, deduplicated, as ONNX, with a manifest.

Two steps, in two environments (not run in CI):

    # 1. export the models (needs torch, torchvision, transformers; CPU, no downloads)
    PYTHONPATH=. python benchmarks/export_fusion_suite.py models WORK_DIR [--only NAME ...]
    # 2. cut, deduplicate and write the suite (needs tunedb's own dependencies only)
    python benchmarks/export_fusion_suite.py cut WORK_DIR [--out DIR]
    # 3. markdown tables of the suite (docs/fusion-generalization.md)
    python benchmarks/export_fusion_suite.py report [--out DIR]

Step 1 writes each model at each of its shapes (batch 1 and a serving batch, two sequence
lengths for transformers, some in float16 and, by the dynamo exporter, bfloat16 too; CNNs
with a symbolic batch, sized at import)
as structure-only ONNX
(weights stripped) plus ``models.json``. Models are built from their library's default configs
with random weights; transformers keep 2 layers (the layers repeat: more add no workload).
Training graphs are the backward passes of normalizations, softmax, activations and the loss,
traced by ``make_fx`` through ``torch.autograd.grad`` into ATen primitives and exported.

Step 2 imports every model at every shape and cuts out its maximal memory-bound regions
(``memory_bound_regions``): connected memory-bound nodes at the same depth of compute
(matmul, GEMM, full convolutions), which is what one kernel between two library calls could
compute; depthwise convolutions and pools count as memory-bound. Views that cuBLAS reads in
place are left out, as the planner leaves them. Regions of one depth that read the same large
tensor are one region (sibling, multi-output fusion). Lookups in tables (a gather from a graph
input four times larger than its result: embeddings, rotary caches) stay outside: a kernel
reads only the rows it gathers, but a workload's floor would count the whole table. Each
region is written as ONNX, read back and hashed (``graph_hash`` of the re-imported graph, the
suite's identity); duplicates keep the first source and count the others. ``manifest.json``
lists per workload its file, hash, kind, source models and shapes, the op summary, floor
bytes, how many kernels tunedb's planner (roofline prices, no GPU) splits it into today, and
whether the fused-kernel generator takes it as one kernel (else its reason).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "data" / "graphs" / "generalization"
MIN_FLOOR_BYTES = 64 * 1024  # smaller regions are launch-bound, not memory-bound
SIBLING_MIN_ELEMS = 16384    # a shared input this large makes sibling regions one
# Below this floor a kernel's time is mostly launch and tail, not bytes: "fraction of the
# bandwidth floor" means little there (the manifest's tier says which side a workload is on).
BANDWIDTH_TIER_BYTES = 16 * 2**20
H200_BYTES_PER_US = 4.8e6  # 4.8 TB/s, the H200's HBM3e peak
TABLE_RATIO = 4              # a gather reading a graph input this much larger is a table lookup
TX_SHAPES = ((1, 128), (16, 128), (8, 512))  # (batch, sequence) of the transformers
CNN_BATCHES = (1, 16)
HALF = (("bert", 16, 128), ("gpt2", 16, 128), ("llama", 16, 128), ("vit", 16, 128))
BF16 = (("bert", 16, 128), ("llama", 16, 128), ("t5_encoder", 16, 128))


# ---------------------------------------------------------------------------------------------
# Step 1: models (torch)

def _hf(cls_name: str, cfg_name: str, kind: str, **cfg: Any):
    def build(batch: int, seq: int):
        import torch
        import transformers

        config = getattr(transformers, cfg_name)(**cfg)
        model = getattr(transformers, cls_name)(config)
        if kind == "pixels":
            size = config.image_size
            return model, (torch.randn(batch, 3, size, size),), ["pixel_values"]
        ids = torch.randint(0, min(config.vocab_size, 1000), (batch, seq))
        if kind == "ids_only":
            return model, (ids,), ["input_ids"]
        return model, (ids, torch.ones(batch, seq, dtype=torch.int64)), ["input_ids", "attention_mask"]
    return build


TRANSFORMERS = {
    "bert": _hf("BertModel", "BertConfig", "ids", num_hidden_layers=2),
    "gpt2": _hf("GPT2Model", "GPT2Config", "ids", n_layer=2, use_cache=False),
    "llama": _hf("LlamaModel", "LlamaConfig", "ids", hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                 vocab_size=32000, use_cache=False),
    "t5_encoder": _hf("T5EncoderModel", "T5Config", "ids_only", num_layers=2),
    "vit": _hf("ViTModel", "ViTConfig", "pixels", num_hidden_layers=2, add_pooling_layer=False),
}


def _tv(fn: str, **kw: Any):
    def build():
        import torchvision

        return getattr(torchvision.models, fn)(weights=None, **kw)
    return build


def _gn_resnet18():
    import torch
    import torchvision

    return torchvision.models.resnet18(weights=None, norm_layer=lambda c: torch.nn.GroupNorm(32, c))


def _unet_block(channels: int, temb: int = 1280):
    """A Stable-Diffusion-style UNet level: two ResNet blocks (GroupNorm, SiLU, 3x3 conv, time
    embedding added per channel), a spatial transformer (GroupNorm, self-attention with
    LayerNorm, a GEGLU feed-forward) and a nearest x2 upsample with its conv."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Resnet(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(32, c, eps=1e-5), nn.Conv2d(c, c, 3, padding=1)
            self.t = nn.Linear(temb, c)
            self.n2, self.c2 = nn.GroupNorm(32, c, eps=1e-5), nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(t))[:, :, None, None]
            return x + self.c2(F.silu(self.n2(h)))

    class Transformer(nn.Module):
        def __init__(self, c: int, heads: int = 8) -> None:
            super().__init__()
            self.heads = heads
            self.norm, self.pin, self.pout = nn.GroupNorm(32, c, eps=1e-6), nn.Linear(c, c), nn.Linear(c, c)
            self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.qkv, self.o = nn.Linear(c, 3 * c, bias=False), nn.Linear(c, c)
            self.ff1, self.ff2 = nn.Linear(c, 8 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            b, c, hh, ww = x.shape
            h = self.pin(self.norm(x).permute(0, 2, 3, 1).reshape(b, hh * ww, c))
            q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
            sh = lambda t: t.reshape(b, hh * ww, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
            a = torch.softmax(sh(q) @ sh(k).transpose(-1, -2) * (c // self.heads) ** -0.5, dim=-1)
            h = h + self.o((a @ sh(v)).transpose(1, 2).reshape(b, hh * ww, c))
            u, gate = self.ff1(self.ln2(h)).chunk(2, dim=-1)
            h = h + self.ff2(u * F.gelu(gate))
            return x + self.pout(h).reshape(b, hh, ww, c).permute(0, 3, 1, 2)

    class Level(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.r1, self.tf, self.r2 = Resnet(channels), Transformer(channels), Resnet(channels)
            self.up = nn.Conv2d(channels, channels, 3, padding=1)

        def forward(self, x, t):
            h = self.r2(self.tf(self.r1(x, t)), t)
            return self.up(F.interpolate(h, scale_factor=2.0, mode="nearest"))

    return Level()


CNNS = {
    "resnet50": (_tv("resnet50"), 224),
    "mobilenet_v2": (_tv("mobilenet_v2"), 224),
    "efficientnet_b0": (_tv("efficientnet_b0"), 224),
    "convnext_tiny": (_tv("convnext_tiny"), 224),
    "gn_resnet18": (_gn_resnet18, 224),
}
UNETS = {"unet_320x32": (320, 32), "unet_640x16": (640, 16)}


def _training_fns():
    """Backward passes (and the forward statistics they need) of training-style layers:
    name -> (fn(*tensors) -> tuple of grads, list of input shape tuples per size)."""
    import torch
    from torch.nn import functional as F

    def grads(f, wrt: int):
        def g(*xs):
            xs = [x.requires_grad_(i < wrt) if x.is_floating_point() else x for i, x in enumerate(xs)]
            y = f(*xs[:-1])
            return torch.autograd.grad(y, xs[:wrt], xs[-1])
        return g

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def attn_softmax(s, mask):
        return torch.softmax(s * 0.125 + mask, dim=-1)

    def xent(logits, labels):
        return F.cross_entropy(logits, labels, reduction="none")

    def swiglu(a, b):
        return F.silu(a) * b

    rows = [(1, 128, 768), (16, 128, 768), (8, 512, 4096)]
    return {
        "layernorm_bwd": (grads(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), 3),
                          [[r, r[-1:], r[-1:], r] for r in rows]),
        "rmsnorm_bwd": (grads(rms, 2), [[r, r[-1:], r] for r in rows]),
        "gelu_tanh_bwd": (grads(lambda x: F.gelu(x, approximate="tanh"), 1), [[r, r] for r in rows]),
        "gelu_bwd": (grads(F.gelu, 1), [[(16, 128, 3072)] * 2]),
        "swiglu_bwd": (grads(swiglu, 2), [[(1, 128, 5632)] * 3, [(16, 128, 5632)] * 3]),
        "attn_softmax_bwd": (grads(attn_softmax, 1), [[(1, 12, 128, 128), (1, 1, 1, 128), (1, 12, 128, 128)],
                                                     [(8, 16, 512, 512), (8, 1, 1, 512), (8, 16, 512, 512)]]),
        "groupnorm_bwd": (grads(lambda x, w, b: F.group_norm(x, 32, w, b), 3),
                          [[(1, 320, 32, 32), (320,), (320,), (1, 320, 32, 32)],
                           [(8, 640, 16, 16), (640,), (640,), (8, 640, 16, 16)]]),
        "batchnorm_train_bwd": (grads(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), 3),
                                [[(16, 256, 56, 56), (256,), (256,), (16, 256, 56, 56)]]),
        "xent_bwd": (grads(xent, 1), [[(2048, 32000), ("int", (2048,), 32000), (2048,)],
                                      [(512, 50257), ("int", (512,), 50257), (512,)]]),
    }


def _export(model, args, names: list[str], path: Path, dynamic: dict | None = None,
            dynamo: bool = False) -> None:
    import torch

    with torch.no_grad():
        if dynamo:  # the torch.export-based exporter: it also does bfloat16
            torch.onnx.export(model, args, str(path), dynamo=True, opset_version=18, input_names=names,
                              output_names=["output"], external_data=True)
            return
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=["output"], dynamic_axes=dynamic, do_constant_folding=True)


def _save_structure(src: Path, dst: Path) -> None:
    import onnx

    from tunedb.graph.onnx_import import strip_model

    m = strip_model(onnx.load(str(src)))
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    del m.graph.value_info[:]
    m.graph.doc_string = m.doc_string = ""
    onnx.save(m, str(dst))


class _First:
    """Wraps a transformers model so that it returns the last hidden state tensor."""

    def __new__(cls, model, names):
        import torch

        class Wrap(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *args):
                y = self.model(**dict(zip(names, args)))
                return y if isinstance(y, torch.Tensor) else y[0]
        return Wrap().eval()


def export_models(work: Path, only: list[str] | None) -> None:
    import torch

    work.mkdir(parents=True, exist_ok=True)
    index_path = work / "models.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else []

    def record(entry: dict) -> None:
        nonlocal index
        index = [e for e in index if e["file"] != entry["file"]] + [entry]
        index_path.write_text(json.dumps(sorted(index, key=lambda e: e["file"]), indent=1) + "\n")
        print(json.dumps(entry), flush=True)

    def run(name: str, file: str, bindings: list[dict], fn) -> None:
        if only and name not in only:
            return
        t0 = time.perf_counter()
        entry = {"file": file, "model": name, "bindings": bindings}
        try:
            torch.manual_seed(0)
            with tempfile.TemporaryDirectory() as tmp:
                fn(Path(tmp) / "m.onnx")
                _save_structure(Path(tmp) / "m.onnx", work / file)
        except Exception as e:
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        entry["export_s"] = round(time.perf_counter() - t0, 1)
        record(entry)

    for name, build in TRANSFORMERS.items():
        for batch, seq in TX_SHAPES:
            if name == "vit" and seq != 128:
                continue  # images: one sequence (197 patches)

            def fn(path, build=build, batch=batch, seq=seq):
                model, args, names = build(batch, seq)
                _export(_First(model.eval(), names), args, names, path)
            run(name, f"{name}_b{batch}_s{seq}.onnx", [{}], fn)
    for name, batch, seq in HALF:  # float16 serving: the casts exporters put around softmax/norms
        def fn(path, build=TRANSFORMERS[name], batch=batch, seq=seq):
            model, args, names = build(batch, seq)
            model = model.half().eval()
            args = tuple(a.half() if a.is_floating_point() else a for a in args)
            _export(_First(model, names), args, names, path)
        run(f"{name}_fp16", f"{name}_fp16_b{batch}_s{seq}.onnx", [{}], fn)
    for name, batch, seq in BF16:  # bfloat16 serving, by the dynamo exporter
        def fn(path, build=TRANSFORMERS[name], batch=batch, seq=seq):
            model, args, names = build(batch, seq)
            model = model.to(torch.bfloat16).eval()
            args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
            _export(_First(model, names), args, names, path, dynamo=True)
        run(f"{name}_bf16", f"{name}_bf16_b{batch}_s{seq}.onnx", [{}], fn)
    for name, (build, size) in CNNS.items():
        def fn(path, build=build, size=size):
            _export(build().eval(), (torch.randn(1, 3, size, size),), ["pixels"], path,
                    {"pixels": {0: "batch"}, "output": {0: "batch"}})
        run(name, f"{name}.onnx", [{"batch": b} for b in CNN_BATCHES], fn)
    for name, (c, hw) in UNETS.items():
        def fn(path, c=c, hw=hw):
            _export(_unet_block(c).eval(), (torch.randn(1, c, hw, hw), torch.randn(1, 1280)),
                    ["latent", "temb"], path, {"latent": {0: "batch"}, "temb": {0: "batch"},
                                               "output": {0: "batch"}})
        run(name, f"{name}.onnx", [{"batch": b} for b in (1, 8)], fn)
    from torch._decomp import core_aten_decompositions, get_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten
    decomp = {**core_aten_decompositions(),  # ATen's core ops the TorchScript exporter lacks
              **get_decompositions([aten._softmax, aten._log_softmax, aten.native_group_norm,
                                    aten.native_batch_norm, aten._native_batch_norm_legit,
                                    aten._native_batch_norm_legit_functional])}
    for name, (fn_, sizes) in _training_fns().items():
        for k, shapes in enumerate(sizes):
            def fn(path, fn_=fn_, shapes=shapes):
                args = [torch.randint(0, s[2], s[1]) if s[0] == "int" else torch.randn(s)
                        for s in shapes]  # ("int", shape, high): class labels
                gm = make_fx(fn_, decomposition_table=decomp)(*args)
                for node in gm.graph.nodes:  # the TorchScript exporter squeezes one dim only
                    if node.target == aten.squeeze.dims:
                        node.target = aten.reshape.default
                        node.args = (node.args[0], list(node.meta["val"].shape))
                gm.recompile()
                names = [f"in{i}" for i in range(len(args))]
                _export(gm, tuple(args), names, path)
            run(f"train_{name}", f"train_{name}_{k}.onnx", [{}], fn)


# ---------------------------------------------------------------------------------------------
# Step 2: cut (tunedb)

WINDOWED = ("max_pool2d", "avg_pool2d", "global_avg_pool", "global_max_pool")


def memory_bound_regions(graph) -> list[tuple[int, ...]]:
    """Maximal memory-bound regions of ``graph`` as sorted node-index tuples (see the module
    docstring). A region never contains a path that leaves it and comes back (its nodes share
    one compute depth), so one kernel can compute it."""
    from tunedb.plan.subgraph import VIEW_OPS, GraphIndex

    ix = GraphIndex(graph)
    types = ix.types

    def member(i: int) -> bool:
        n = ix.nodes[i]
        if n.op == "conv2d":  # depthwise: one input channel per group
            w = types[n.inputs[1]].shape
            return w[1] == 1 and n.attr("groups", 1) > 1
        if n.op in WINDOWED:
            return True
        if ix.compute[i]:
            return False
        if n.op == "gather" and n.inputs[0] not in ix.producer and \
                types[n.inputs[0]].numel > TABLE_RATIO * types[n.outputs[0]].numel:
            return False  # a lookup in a table (embeddings): the floor would count the table
        return not (ix.view[i] and n.op not in VIEW_OPS)  # strided views cost nothing

    mem = [member(i) for i in range(len(ix.nodes))]
    depth = [0] * len(ix.nodes)
    for i in range(len(ix.nodes)):
        depth[i] = max((depth[p] + (0 if mem[p] else 1) for p in ix.pred[i]), default=0)
    parent = list(range(len(ix.nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(ix.nodes)):
        if mem[i]:
            for p in ix.pred[i]:
                if mem[p] and depth[p] == depth[i]:
                    parent[find(p)] = find(i)
    # Siblings: regions at one depth reading the same large tensor join (multi-output kernels,
    # a gradient's row and column reductions); all nodes of one depth form a convex set.
    for v, users in ix.consumers.items():
        if v in ix.inline or types[v].numel < SIBLING_MIN_ELEMS:
            continue
        first: dict[int, int] = {}
        for u in users:
            if mem[u]:
                parent[find(u)] = find(first.setdefault(depth[u], u))
    groups: dict[int, list[int]] = {}
    for i in range(len(ix.nodes)):
        if mem[i]:
            groups.setdefault(find(i), []).append(i)
    return [tuple(g) for g in groups.values() if any(ix.nodes[j].op not in VIEW_OPS for j in g)]


def kind_of(ops: set[str]) -> str:
    if ops & {"conv2d", "max_pool2d", "avg_pool2d"}:
        return "windowed"
    if {"exp", "reduce_max", "reduce_sum"} <= ops:
        return "softmax"
    if ops & {"rsqrt", "sqrt"} and ops & {"reduce_mean", "reduce_sum"}:
        return "norm"
    if ops & {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod", "argmax",
              "global_avg_pool", "global_max_pool"}:
        return "reduce"
    if ops & {"slice", "concat", "split", "pad", "gather", "gather_elements", "transpose", "expand"}:
        return "data_movement"
    return "elementwise"


def planned_steps(graph) -> list[str] | None:
    """The kernels tunedb's planner (roofline prices, generic device, no database) launches
    for ``graph`` today, each as ``kind: ops``; None when it cannot plan it."""
    try:
        from tunedb.plan.driver import compile as plan_compile
        from tunedb.plan.explain import ops_text

        plan = plan_compile(graph, cost_model=False, device=None, pack=False)
    except Exception:
        return None
    return [f"{s.kind}: {ops_text(s.ops)}" for s in plan.steps for _ in range(s.launches)]


def generator_verdict(graph) -> str:
    """``ok`` when tunedb's fused-kernel generator takes ``graph`` as one kernel today, else
    its one-line reason (names and numbers kept: the report groups them)."""
    from tunedb.kernels.analysis import analyze

    try:
        analyze(graph)
    except ValueError as e:  # UnsupportedFusion
        return " ".join(str(e).split())
    return "ok"


def _git_head() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out


def cut(work: Path, out: Path, plan: bool) -> None:
    import onnx

    from tunedb.graph.hashing import graph_hash
    from tunedb.graph.onnx_export import graph_to_onnx
    from tunedb.graph.onnx_import import import_onnx
    from tunedb.plan.explain import ops_text
    from tunedb.plan.subgraph import GraphIndex

    out.mkdir(parents=True, exist_ok=True)
    models = [e for e in json.loads((work / "models.json").read_text()) if "error" not in e]
    seen: dict[str, dict] = {}
    counts = {"models": sorted({e["model"] for e in models}), "regions": 0, "too_small": 0,
              "import_errors": []}
    for e in models:
        for bind in e["bindings"]:
            tag = "_".join(f"{k[0]}{v}" for k, v in bind.items())
            source = e["file"].removesuffix(".onnx") + (f"_{tag}" if tag else "")
            try:
                g = import_onnx(work / e["file"], bind)
            except Exception as exc:
                counts["import_errors"].append(f"{source}: {' '.join(str(exc).split())[:200]}")
                print("import failed:", source, exc, flush=True)
                continue
            ix = GraphIndex(g)
            for nodes in memory_bound_regions(g):
                counts["regions"] += 1
                sub = ix.cut(nodes).graph
                if sub.floor_bytes() < MIN_FLOOR_BYTES:
                    counts["too_small"] += 1
                    continue
                model = graph_to_onnx(sub)
                back = import_onnx(model)
                h = graph_hash(back)
                if h in seen:
                    seen[h]["occurrences"] += 1
                    if source not in seen[h]["sources"]:
                        seen[h]["sources"].append(source)
                    continue
                ops = {n.op for n in back.nodes}
                kind = kind_of(ops)
                name = f"{kind}_{source}_{h[:8]}"
                model.graph.name = name
                file = f"{name}.onnx"
                onnx.save(model, str(out / file))
                seen[h] = {"file": file, "name": name, "hash": h, "kind": kind, "model": e["model"],
                           "sources": [source], "occurrences": 1, "nodes": len(back.nodes),
                           "ops": ops_text(tuple(n.op for n in back.nodes)),
                           "dtypes": sorted({back.type_of(v).dtype for v in back.inputs}),
                           "floor_bytes": back.floor_bytes(),
                           "floor_us_h200": round(back.floor_bytes() / H200_BYTES_PER_US, 2),
                           "tier": "bandwidth" if back.floor_bytes() >= BANDWIDTH_TIER_BYTES else "launch",
                           "planned": planned_steps(back) if plan else None,
                           "generator": generator_verdict(back) if plan else None}
                if seen[h]["planned"] is not None:
                    seen[h]["planned_kernels"] = len(seen[h]["planned"])
                print(name, seen[h]["ops"][:90], flush=True)
    entries = sorted(seen.values(), key=lambda w: w["name"])
    manifest = {"about": "maximal memory-bound subgraphs of real models, deduplicated by the "
                         "graph hash of the stored ONNX (benchmarks/export_fusion_suite.py)",
                "planner_commit": _git_head() if plan else "",
                "counts": {**counts, "workloads": len(entries),
                           "bandwidth_tier": sum(1 for w in entries if w["tier"] == "bandwidth"),
                           "by_kind": {k: sum(1 for w in entries if w["kind"] == k)
                                       for k in sorted({w["kind"] for w in entries})}},
                "workloads": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest["counts"]), flush=True)


def report(folder: Path) -> str:
    """Markdown tables of a written suite: counts by kind, tier and source, and the patterns
    the planner splits into several kernels (docs/fusion-generalization.md quotes them)."""
    m = json.loads((folder / "manifest.json").read_text())
    ws = m["workloads"]
    lines = ["| kind | workloads | >= 16 MiB | < 16 MiB | split by the planner |", "|---|---|---|---|---|"]
    for k in sorted({w["kind"] for w in ws}):
        kw = [w for w in ws if w["kind"] == k]
        lines.append(f"| {k} | {len(kw)} | {sum(w['tier'] == 'bandwidth' for w in kw)} | "
                     f"{sum(w['tier'] == 'launch' for w in kw)} | "
                     f"{sum((w.get('planned_kernels') or 1) > 1 for w in kw)} |")
    lines.append(f"| all | {len(ws)} | {sum(w['tier'] == 'bandwidth' for w in ws)} | "
                 f"{sum(w['tier'] == 'launch' for w in ws)} | "
                 f"{sum((w.get('planned_kernels') or 1) > 1 for w in ws)} |")
    lines += ["", "| source model | workloads | shapes |", "|---|---|---|"]
    for model in sorted({w["model"] for w in ws}):
        mw = [w for w in ws if w["model"] == model]
        shapes = sorted({s.removeprefix(model + "_") for w in ws for s in w["sources"]
                         if re.sub(r"_(b\d+(_s\d+)?|\d+)$", "", s) == model})
        lines.append(f"| {model} | {len(mw)} | {', '.join(shapes)} |")
    patterns: dict[str, list[dict]] = {}
    for w in ws:
        if (w.get("planned_kernels") or 1) > 1:
            patterns.setdefault(w["ops"], []).append(w)
    lines += ["", "| ops (one workload) | kernels today | the planner's steps | workloads | example |",
              "|---|---|---|---|---|"]
    for ops, pw in sorted(patterns.items(), key=lambda kv: (-kv[1][0]["planned_kernels"], kv[0])):
        steps = "; ".join(pw[0]["planned"])
        lines.append(f"| {ops} | {pw[0]['planned_kernels']} | {steps} | {len(pw)} | {pw[0]['name']} |")
    reasons: dict[str, list[dict]] = {}
    for w in ws:
        if w.get("generator") not in (None, "ok"):
            key = re.sub(r"'[^']*'|\[[^]]*\]|\([^)]*\)|\d+", "#", w["generator"])
            reasons.setdefault(key, []).append(w)
    lines += ["", f"One kernel today: {sum(w.get('generator') == 'ok' for w in ws)} of {len(ws)}. "
              "The others, by the generator's reason:", "",
              "| the generator's reason (names and numbers as #) | workloads | kinds | example |",
              "|---|---|---|---|"]
    for key, rw in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        kinds = ", ".join(sorted({w["kind"] for w in rw}))
        lines.append(f"| {key[:150]} | {len(rw)} | {kinds} | {rw[0]['name']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    m = sub.add_parser("models", help="export the models (torch)")
    m.add_argument("work", type=Path)
    m.add_argument("--only", nargs="*", default=None)
    c = sub.add_parser("cut", help="cut, deduplicate and write the suite (tunedb)")
    c.add_argument("work", type=Path)
    c.add_argument("--out", type=Path, default=OUT)
    c.add_argument("--no-plan", action="store_true", help="skip counting the planner's kernels")
    r = sub.add_parser("report", help="markdown tables of a written suite")
    r.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    if a.step == "models":
        export_models(a.work, a.only)
    elif a.step == "cut":
        cut(a.work, a.out, not a.no_plan)
    else:
        print(report(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packing suites: replicas of one GEMM, real models' layers across tenants, MoE experts, LoRA.

Shapes are the models' own (im2col GEMMs of ResNet-18/50 at 224x224, BERT-base and GPT-2 linear
layers); token counts of MoE experts and LoRA adapters follow a fixed Zipf-like skew, so every
suite is the same on every machine.
"""

from __future__ import annotations

from tunedb.kernels.packing import Member, PackingWorkload

# (name, m = output pixels at batch 1, n = out-channels, k = in-channels * kernel area)
RESNET18 = [("conv1", 112 * 112, 64, 3 * 49), ("l1.3x3", 56 * 56, 64, 64 * 9),
            ("l2.3x3s2", 28 * 28, 128, 64 * 9), ("l2.3x3", 28 * 28, 128, 128 * 9),
            ("l2.down", 28 * 28, 128, 64), ("l3.3x3s2", 14 * 14, 256, 128 * 9),
            ("l3.3x3", 14 * 14, 256, 256 * 9), ("l3.down", 14 * 14, 256, 128),
            ("l4.3x3s2", 7 * 7, 512, 256 * 9), ("l4.3x3", 7 * 7, 512, 512 * 9),
            ("l4.down", 7 * 7, 512, 256)]
RESNET50 = [("conv1", 112 * 112, 64, 3 * 49)]
for _stage, (_hw, _c, _cin) in enumerate([(56, 64, 64), (28, 128, 256), (14, 256, 512), (7, 512, 1024)]):
    RESNET50 += [(f"s{_stage}.reduce", _hw * _hw, _c, _cin if _stage == 0 else _c * 4),
                 (f"s{_stage}.3x3", _hw * _hw, _c, _c * 9),
                 (f"s{_stage}.expand", _hw * _hw, _c * 4, _c),
                 (f"s{_stage}.down", _hw * _hw, _c * 4, _cin)]
BERT_BASE = [("q", 768, 768), ("k", 768, 768), ("v", 768, 768), ("attn_out", 768, 768),
             ("ffn_up", 3072, 768), ("ffn_down", 768, 3072)]  # (name, n, k), weights [n, k]
GPT2 = [("c_attn", 2304, 768), ("c_proj", 768, 768), ("c_fc", 3072, 768), ("mlp_proj", 768, 3072)]
# The independent GEMMs ``tunedb.compile`` finds in the shipped model zoo (data/graphs/zoo, the
# dynamo exports; ``tunedb.plan.packing.graph_workloads``): (model.set, dtype, kind, (m, n, k) of
# each member, each with its own weight), so the driver's exact database hits are these records.
ZOO_SETS = [
    ("bert_base_bf16.set0", "bfloat16", "gemm", ((128, 768, 768), (128, 768, 768), (128, 768, 768))),
    ("bert_base_bf16_b8.set0", "bfloat16", "gemm", ((1024, 768, 768), (1024, 768, 768), (1024, 768, 768))),
    ("bert_base_fp32.set0", "float32", "gemm", ((128, 768, 768), (128, 768, 768), (128, 768, 768))),
    ("bert_base_fp32_b8.set0", "float32", "gemm", ((1024, 768, 768), (1024, 768, 768), (1024, 768, 768))),
    ("clip_text_bf16.set0", "bfloat16", "gemm", ((77, 512, 512), (77, 512, 512), (77, 512, 512))),
    ("clip_text_fp32.set0", "float32", "gemm", ((77, 512, 512), (77, 512, 512), (77, 512, 512))),
    ("clip_vision_bf16.set0", "bfloat16", "gemm", ((50, 768, 768), (50, 768, 768), (50, 768, 768))),
    ("clip_vision_fp32.set0", "float32", "gemm", ((50, 768, 768), (50, 768, 768), (50, 768, 768))),
    ("llama_small_bf16.set0", "bfloat16", "gemm", ((128, 512, 512), (128, 256, 512), (128, 256, 512))),
    ("llama_small_bf16.set1", "bfloat16", "gemm", ((128, 1408, 512), (128, 1408, 512))),
    ("llama_small_fp32.set0", "float32", "gemm", ((128, 512, 512), (128, 256, 512), (128, 256, 512))),
    ("llama_small_fp32.set1", "float32", "gemm", ((128, 1408, 512), (128, 1408, 512))),
    ("resnet50_bf16.set0", "bfloat16", "conv", ((3136, 64, 64), (3136, 256, 64))),
    ("resnet50_bf16.set1", "bfloat16", "conv", ((3136, 128, 256), (784, 512, 256))),
    ("resnet50_bf16.set2", "bfloat16", "conv", ((784, 256, 512), (196, 1024, 512))),
    ("resnet50_bf16.set3", "bfloat16", "conv", ((196, 512, 1024), (49, 2048, 1024))),
    ("resnet50_fp32.set0", "float32", "conv", ((3136, 64, 64), (3136, 256, 64))),
    ("resnet50_fp32.set1", "float32", "conv", ((3136, 128, 256), (784, 512, 256))),
    ("resnet50_fp32.set2", "float32", "conv", ((784, 256, 512), (196, 1024, 512))),
    ("resnet50_fp32.set3", "float32", "conv", ((196, 512, 1024), (49, 2048, 1024))),
    ("t5_encoder_bf16.set0", "bfloat16", "gemm", ((128, 512, 512), (128, 512, 512), (128, 512, 512))),
    ("t5_encoder_fp32.set0", "float32", "gemm", ((128, 512, 512), (128, 512, 512), (128, 512, 512))),
    ("vit_bf16.set0", "bfloat16", "gemm", ((197, 768, 768), (197, 768, 768), (197, 768, 768))),
    ("vit_fp32.set0", "float32", "gemm", ((197, 768, 768), (197, 768, 768), (197, 768, 768))),
    ("whisper_encoder_bf16.set0", "bfloat16", "gemm", ((1500, 384, 384), (1500, 384, 384), (1500, 384, 384))),
    ("whisper_encoder_fp32.set0", "float32", "gemm", ((1500, 384, 384), (1500, 384, 384), (1500, 384, 384))),
]
SEQ_MIX = [16, 32, 48, 64, 128, 128, 256, 384]  # eight tenants' sequence lengths
REPLICA_SHAPE = (256, 128, 1152)  # m, n, k of the R-sweep


def skewed(total: int, parts: int, s: float = 1.0) -> list[int]:
    """``total`` tokens over ``parts`` experts with Zipf weights ``1/(i+1)^s``, each at least 1."""
    w = [1.0 / (i + 1) ** s for i in range(parts)]
    counts = [max(1, int(total * x / sum(w))) for x in w]
    counts[0] += total - sum(counts)
    return counts


def replicas(r: int, dtype: str, shape: tuple[int, int, int] = REPLICA_SHAPE) -> PackingWorkload:
    m, n, k = shape
    return PackingWorkload(f"replicas_r{r}_{m}x{n}x{k}_{dtype}", "replicas",
                           tuple(Member(m, n, k, dtype=dtype, label=f"copy{i}") for i in range(r)))


def resnet_tenants(layers: list, model: str, tenants: int, dtype: str, batch: int = 1) -> PackingWorkload:
    ms = tuple(Member(m * batch, n, k, dtype=dtype, kind="conv", label=f"t{t}.{name}")
               for t in range(tenants) for name, m, n, k in layers)
    return PackingWorkload(f"{model}_b{batch}_t{tenants}_{dtype}", f"{model}_tenants", ms)


def linear_tenants(layers: list, model: str, seqs: list[int], dtype: str,
                   names: tuple[str, ...] | None = None) -> PackingWorkload:
    """The linear layers named ``names`` (all by default) of one block, for each tenant (one
    sequence length each): the ops that are ready together across tenants and inside a block."""
    chosen = [lay for lay in layers if names is None or lay[0] in names]
    ms = tuple(Member(s, n, k, dtype=dtype, layout="nt", label=f"t{t}.{name}")
               for t, s in enumerate(seqs) for name, n, k in chosen)
    tag = "all" if names is None else "+".join(names)
    return PackingWorkload(f"{model}_{tag}_s{'-'.join(map(str, seqs))}_{dtype}", f"{model}_tenants", ms)


def moe(experts: int, tokens: int, d: int, ffn: int, dtype: str, s: float = 1.0) -> PackingWorkload:
    counts = skewed(tokens, experts, s)
    ms = tuple(Member(c, ffn, d, dtype=dtype, layout="nt", label=f"expert{i}.up")
               for i, c in enumerate(counts))
    return PackingWorkload(f"moe_e{experts}_t{tokens}_d{d}_f{ffn}_s{s:g}_{dtype}", "moe", ms)


def lora(adapters: int, tokens: int, d: int, ranks: tuple[int, ...], dtype: str) -> PackingWorkload:
    """The shrink GEMMs ``x[tokens_i, d] @ A_i[d, r_i]`` of several adapters (thin ``n``)."""
    counts = skewed(tokens, adapters, 0.8)
    ms = tuple(Member(c, ranks[i % len(ranks)], d, dtype=dtype, label=f"adapter{i}.shrink")
               for i, c in enumerate(counts))
    rs = "-".join(map(str, ranks))
    return PackingWorkload(f"lora_a{adapters}_t{tokens}_d{d}_r{rs}_{dtype}", "lora", ms)


def zoo_sets() -> list[PackingWorkload]:
    return [PackingWorkload(f"zoo_{name}_{dtype}", "zoo", tuple(
        Member(m, n, k, dtype=dtype, kind=kind, weight=f"w{i}", label=f"{name}.{i}")
        for i, (m, n, k) in enumerate(mnk))) for name, dtype, kind, mnk in ZOO_SETS]


def variety() -> list[PackingWorkload]:
    """More of each family than ``standard``'s grid: replica counts between its powers of two and
    other shapes, MoE skews and sizes, LoRA ranks and token counts."""
    out: list[PackingWorkload] = []
    for dt in ("bfloat16", "float32"):
        for shp in (REPLICA_SHAPE, (128, 256, 512), (64, 1024, 256), (2048, 128, 128)):
            for r in (3, 6, 12, 24, 48, 96):
                out.append(replicas(r, dt, shp))
        for e, tok, d, f in ((8, 2048, 1024, 2816), (8, 512, 4096, 1792), (32, 4096, 1024, 1408),
                             (16, 1024, 1024, 512)):
            for s in (0.4, 1.2, 2.0):
                out.append(moe(e, tok, d, f, dt, s))
        for a, tok, d, ranks in ((64, 4096, 4096, (8, 16, 32, 64)), (8, 512, 4096, (64,)),
                                 (16, 2048, 2048, (4, 128)), (4, 64, 4096, (16,)),
                                 (32, 512, 2048, (8,)), (12, 1536, 4096, (16, 32))):
            out.append(lora(a, tok, d, ranks, dt))
    return out


def bench_cases() -> list[PackingWorkload]:
    """The issue's must-show cases: R-sweep (fp32, bf16), ResNet-18 x4 tenants (bf16), 3 mixes."""
    out = [replicas(r, dt) for dt in ("float32", "bfloat16") for r in (2, 10, 20, 60, 120)]
    out.append(resnet_tenants(RESNET18, "resnet18", 4, "bfloat16"))
    out.append(linear_tenants(BERT_BASE, "bert", SEQ_MIX, "bfloat16", ("q", "k", "v")))
    out.append(moe(8, 2048, 1024, 2816, "bfloat16", 1.2))
    out.append(lora(16, 1024, 4096, (8, 16, 64), "bfloat16"))
    return out


def suite(name: str) -> list[PackingWorkload]:
    """``quick`` (the bench cases and a few more) or ``standard`` (the grid below, the model zoo's
    ready sets and ``variety``: 374 workloads)."""
    if name == "quick":
        return bench_cases() + [resnet_tenants(RESNET50, "resnet50", 2, "bfloat16"),
                                linear_tenants(GPT2, "gpt2", [64, 128, 256, 512], "bfloat16", ("c_attn",))]
    if name != "standard":
        raise ValueError(f"unknown packing suite {name!r}: expected quick or standard")
    out: list[PackingWorkload] = []
    shapes = [REPLICA_SHAPE, (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
              (1, 4096, 1024), (32, 768, 768), (1024, 64, 64)]
    for dt in ("float32", "bfloat16", "float16"):
        for shp in shapes:
            for r in (2, 4, 8, 16, 32, 64, 120):
                out.append(replicas(r, dt, shp))
    for dt in ("bfloat16", "float32"):
        for t in (1, 2, 4, 8):
            out.append(resnet_tenants(RESNET18, "resnet18", t, dt))
            out.append(resnet_tenants(RESNET50, "resnet50", t, dt))
        for seqs in ([128] * 4, SEQ_MIX, [32, 512], [64, 64, 128, 256, 512, 512]):
            for names in (("q", "k", "v"), ("ffn_up",), ("ffn_down",), None):
                out.append(linear_tenants(BERT_BASE, "bert", seqs, dt, names))
            for names in (("c_attn",), ("c_fc",), None):
                out.append(linear_tenants(GPT2, "gpt2", seqs, dt, names))
        for e, tok, d, f in ((8, 2048, 1024, 2816), (8, 512, 4096, 1792), (64, 4096, 2048, 1408),
                             (16, 1024, 1024, 512)):
            for s in (0.0, 0.8, 1.5):
                out.append(moe(e, tok, d, f, dt, s))
        for a, tok, ranks in ((4, 256, (16,)), (16, 1024, (8, 16, 64)), (32, 2048, (16,)),
                              (8, 128, (4, 8))):
            out.append(lora(a, tok, 4096, ranks, dt))
    out += zoo_sets() + variety()
    unique: dict[str, PackingWorkload] = {}
    for w in out:  # e.g. a skew of 0 over 64 experts equals a replica set: keep the first
        unique.setdefault(w.hash, w)
    return list(unique.values())


def interleave(cases: list[PackingWorkload]) -> list[PackingWorkload]:
    """Round-robin over families (suite order within each), so a time limit cuts every family."""
    fams: dict[str, list[PackingWorkload]] = {}
    for c in cases:
        fams.setdefault(c.family, []).append(c)
    out: list[PackingWorkload] = []
    while any(fams.values()):
        for lst in fams.values():
            if lst:
                out.append(lst.pop(0))
    return out

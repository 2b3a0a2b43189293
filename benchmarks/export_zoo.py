"""Export the model zoo under data/graphs/zoo (not run in CI; needs torch, torchvision,
transformers, onnx, onnxscript and onnxruntime).

    PYTHONPATH=. python benchmarks/export_zoo.py [--out DIR] [--only NAME ...]
        [--exporters torchscript,dynamo] [--dtypes float32,bfloat16]   # export
    PYTHONPATH=. python benchmarks/export_zoo.py --check [--only NAME ...]  # numerics
    PYTHONPATH=. python benchmarks/export_zoo.py --batch 8 --exporters dynamo  # data/graphs/zoo_b8

Every model is built from its library's default config with random weights (no downloads),
put in eval mode and exported as a user would: by the TorchScript exporter
(``torch.onnx.export(..., dynamo=False, opset_version=17)``) and by the ``torch.export``-based
one (``dynamo=True``, opset 18), in fp32 and in bf16 (``model.to(torch.bfloat16)``; fp16 with
``--dtypes float16`` where the TorchScript exporter cannot do bf16). Transformers take token
ids and an all-ones attention mask (batch 1, sequence 128; CLIP text 77, its maximum), vision
models one 224x224 image, Whisper's encoder 30 s of log-mel features. A pair the exporter
cannot do is recorded in the manifest with its one-line error instead of a file.

Files keep the graph and drop the weights: every float initializer over 1 KB becomes a graph
input listed in the model metadata (``strip_model``); ``import_onnx(path,
fill_initializers=True)`` fills them again. Per-node metadata (the dynamo exporter's stack
traces), doc strings and value_info are dropped too. ``manifest.json`` lists, per file, the
model, the exporter, the dtype, the config and layer count; ``--check`` adds how tunedb's
float64 reference compares with onnxruntime on each fp32 file with seeded weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from tunedb.graph.onnx_import import import_onnx, strip_model
from tunedb.graph.reference import run_reference

OUT = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
SEQ = 128
BATCH = 1  # --batch: the inputs' leading dim (the exports have static shapes)


def _hf(cls_name: str, cfg_name: str, inputs: str, **cfg: Any):
    """A transformers model from its config class (defaults + ``cfg``), fed ``inputs``."""
    def build():
        import transformers

        config = getattr(transformers, cfg_name)(**cfg)
        model = getattr(transformers, cls_name)(config)
        seq = min(SEQ, getattr(config, "max_position_embeddings", SEQ))  # CLIP text: 77
        if inputs == "ids":
            ids = torch.randint(0, min(config.vocab_size, 1000), (BATCH, seq))
            args = (ids, torch.ones(BATCH, seq, dtype=torch.int64))
            names = ["input_ids", "attention_mask"]
        elif inputs == "ids_only":
            args, names = (torch.randint(0, min(config.vocab_size, 1000), (BATCH, seq)),), ["input_ids"]
        elif inputs == "pixels":
            size = getattr(config, "image_size", 224)
            args, names = (torch.randn(BATCH, 3, size, size),), ["pixel_values"]
        else:  # log-mel features, 30 s of audio
            args, names = (torch.randn(BATCH, config.num_mel_bins, 3000),), ["input_features"]
        return model, args, names, config.to_dict()
    return build


def _tv(fn: str):
    def build():
        import torchvision

        model = getattr(torchvision.models, fn)(weights=None)
        return model, (torch.randn(BATCH, 3, 224, 224),), ["pixels"], {"torchvision": fn}
    return build


class _Encoder(torch.nn.Module):
    """The encoder of an encoder-decoder model, returning its last hidden state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder() if hasattr(model, "get_encoder") else model.encoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x).last_hidden_state


def _whisper():
    model, args, names, cfg = _hf("WhisperModel", "WhisperConfig", "audio")()
    return _Encoder(model), args, names, cfg


MODELS = {
    "bert_base": _hf("BertModel", "BertConfig", "ids"),
    "distilbert": _hf("DistilBertModel", "DistilBertConfig", "ids"),
    "gpt2": _hf("GPT2Model", "GPT2Config", "ids", use_cache=False),
    "llama_small": _hf("LlamaModel", "LlamaConfig", "ids", hidden_size=512,
                       intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000, use_cache=False),
    "t5_encoder": _hf("T5EncoderModel", "T5Config", "ids_only"),
    "vit": _hf("ViTModel", "ViTConfig", "pixels", add_pooling_layer=False),
    "clip_text": _hf("CLIPTextModel", "CLIPTextConfig", "ids_only"),
    "clip_vision": _hf("CLIPVisionModel", "CLIPVisionConfig", "pixels"),
    "whisper_encoder": _whisper,
    "resnet50": _tv("resnet50"),
    "mobilenet_v3": _tv("mobilenet_v3_large"),
    "efficientnet_b0": _tv("efficientnet_b0"),
    "convnext_tiny": _tv("convnext_tiny"),
}


class _FirstOutput(torch.nn.Module):
    """Returns a tensor, not a ModelOutput: the last hidden state / logits only."""

    def __init__(self, model: torch.nn.Module, names: list[str] | None = None) -> None:
        super().__init__()
        self.model = model
        self.names = names  # pass inputs by keyword (GPT-2's second parameter is the cache)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        y = self.model(**dict(zip(self.names, args))) if self.names else self.model(*args)
        if isinstance(y, torch.Tensor):
            return y
        return y["last_hidden_state"] if "last_hidden_state" in y else y[0]


def _layers(cfg: dict) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers"):
        if isinstance(cfg.get(k), int):
            return cfg[k]
    return None


def export(model: torch.nn.Module, args: tuple, names: list[str], path: Path, dynamo: bool) -> None:
    kw: dict[str, Any] = {"input_names": names, "output_names": ["output"]}
    with torch.no_grad():
        if dynamo:
            torch.onnx.export(model, args, str(path), dynamo=True, opset_version=18,
                              external_data=True, **kw)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, **kw)


def _structure_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop what the importer does not read: per-node metadata (the dynamo exporter records
    stack traces with the exporting machine's paths), doc strings and intermediate value_info."""
    g = model.graph
    for n in g.node:
        del n.metadata_props[:]
        n.doc_string = ""
    del g.value_info[:]
    g.doc_string = ""
    model.doc_string = ""
    return model


def check_file(path: Path, seed: int = 0) -> dict:
    """tunedb's float64 reference against onnxruntime (CPU, fp32 files) on the file with its
    stripped weights filled (``fill_model``, seed 0) and seeded inputs (token ids below 1000,
    an all-ones mask); returns the max abs difference relative to the reference's max abs."""
    import onnxruntime as ort

    from tunedb.graph.onnx_import import fill_model

    model = fill_model(onnx.load(str(path)), seed)
    graph = import_onnx(model)
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        t = graph.type_of(v)
        feeds[v] = (np.ones(t.shape, np.int64) if "mask" in v else
                    rng.integers(0, 1000, t.shape).astype(t.dtype) if t.dtype.startswith("int")
                    else rng.standard_normal(t.shape).astype(np.float32))
    t0 = time.perf_counter()
    ref = run_reference(graph, feeds)[graph.outputs[0]]
    ref_s = time.perf_counter() - t0
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)[0].astype(np.float64)
    scale = float(np.abs(ref).max()) or 1.0
    return {"ref_vs_ort": float(np.abs(ref - got).max()) / scale, "ref_s": round(ref_s, 1)}


def valid_for_onnxruntime(path: Path) -> None:
    """Raise where onnxruntime rejects the graph itself (types, shapes). A missing CPU kernel
    (bf16 Add ...) and bf16 where the opset's schema has none yet (Conv before opset 22, as every
    exporter writes it) pass. The TorchScript exporter's SDPA in fp16 writes a float32 softmax
    into an fp16 LayerNormalization, which only this catches."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:
        if not any(k in str(e) for k in ("Could not find an implementation", "Type 'tensor(bfloat16)'")):
            raise RuntimeError(f"onnxruntime rejects the exported model: {e}") from None


def _attn_eager(model: torch.nn.Module) -> bool:
    """Switch a transformers model from SDPA to its eager attention (False: not one)."""
    if not hasattr(model, "set_attn_implementation"):
        return False
    model.set_attn_implementation("eager")
    return True


def one(name: str, dynamo: bool, dtype: str, out: Path, attn_eager: bool = False) -> dict:
    if attn_eager:
        return _one(name, dynamo, dtype, out, attn_eager=True)
    entry = _one(name, dynamo, dtype, out, attn_eager=False)
    if "error" in entry and not dynamo:
        # The TorchScript exporter's SDPA fails in 16 bits (bf16: 'ScalarType ComplexDouble';
        # fp16: a float32 softmax into fp16 ops). The model's eager attention exports, but not
        # always in the process a failed export left behind: --attn-eager in a fresh one does.
        retry = _one(name, dynamo, dtype, out, attn_eager=True)
        if "error" not in retry:
            retry["sdpa_error"] = entry["error"]
            return retry
    return entry


def _one(name: str, dynamo: bool, dtype: str, out: Path, attn_eager: bool) -> dict:
    torch.manual_seed(0)
    model, args, names, cfg = MODELS[name]()
    if attn_eager and not _attn_eager(model if hasattr(model, "set_attn_implementation")
                                      else getattr(model, "encoder", model)):
        return {"error": "no eager attention to fall back to"}
    model = _FirstOutput(model, names if "input_ids" in names else None).eval()
    if dtype != "float32":
        low = getattr(torch, dtype)
        model = model.to(low)
        args = tuple(a.to(low) if a.is_floating_point() else a for a in args)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    file = f"{name}_{'dynamo' if dynamo else 'ts'}_{short}{f'_b{BATCH}' if BATCH != 1 else ''}.onnx"
    entry = {"file": file, "model": name, "exporter": "dynamo" if dynamo else "torchscript",
             "opset": 18 if dynamo else 17, "dtype": dtype, "batch": BATCH, "layers": _layers(cfg),
             **({"attn_implementation": "eager"} if attn_eager else {}),
             "config": {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool))
                        and k in _CONFIG_KEYS}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        try:
            export(model, args, names, path, dynamo)
            valid_for_onnxruntime(path)
            full = onnx.load(str(path))
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            return entry
        stripped = _structure_only(strip_model(full))
        onnx.save(stripped, str(out / file))
        entry["bytes"] = (out / file).stat().st_size
        entry["export_s"] = round(time.perf_counter() - t0, 1)
    return entry


_CONFIG_KEYS = {"hidden_size", "dim", "d_model", "n_embd", "num_hidden_layers", "n_layer",
                "n_layers", "num_layers", "encoder_layers", "num_attention_heads", "n_head",
                "n_heads", "num_key_value_heads", "intermediate_size", "d_ff", "hidden_dim",
                "image_size", "patch_size", "vocab_size", "max_position_embeddings",
                "num_mel_bins", "hidden_act", "activation_function", "torchvision"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="default: data/graphs/zoo, or data/graphs/zoo_bN for --batch N > 1")
    p.add_argument("--only", nargs="*", default=None, help="model names (default: all)")
    p.add_argument("--exporters", default="torchscript,dynamo")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="float32, bfloat16, float16 (comma-separated)")
    p.add_argument("--batch", type=int, default=1,
                   help="batch of the example inputs; files of batch N > 1 end in _bN")
    p.add_argument("--attn-eager", action="store_true",
                   help="transformers with their eager attention, not SDPA (the TorchScript "
                        "exporter's SDPA fails in bf16)")
    p.add_argument("--check", action="store_true",
                   help="only compare tunedb's reference with onnxruntime on the fp32 files")
    a = p.parse_args(argv)
    global BATCH
    BATCH = a.batch
    if a.out is None:
        a.out = OUT if BATCH == 1 else OUT.parent / f"zoo_b{BATCH}"
    a.out.mkdir(parents=True, exist_ok=True)
    manifest_path = a.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else []
    if a.check:
        for m in manifest:
            if m.get("bytes") and m["dtype"] == "float32" and (not a.only or m["model"] in a.only):
                try:
                    m["check"] = check_file(a.out / m["file"])
                except Exception as e:
                    m["check"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
                print(m["file"], m["check"], flush=True)
                manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        return 0
    for name in a.only or list(MODELS):
        for dynamo in [e == "dynamo" for e in a.exporters.split(",")]:
            for dtype in a.dtypes.split(","):
                try:
                    entry = one(name, dynamo, dtype, a.out, a.attn_eager)
                except Exception:
                    traceback.print_exc()
                    continue
                manifest = [m for m in manifest if m["file"] != entry["file"]] + [entry]
                print(json.dumps(entry), flush=True)
                manifest_path.write_text(json.dumps(sorted(manifest, key=lambda m: m["file"]),
                                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

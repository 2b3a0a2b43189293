"""The ``generalization`` suite (issue 21): every maximal memory-bound subgraph of 12+ real
models (CNNs with batch and group norm and depthwise convolutions, ViT, BERT, GPT-2, a
Llama-style decoder, T5, a diffusion UNet level, training backward passes), deduplicated, at
batch 1 and serving batches. They live as ONNX under ``data/graphs/generalization`` with a
``manifest.json`` naming each one's source models and shapes; ``benchmarks/export_fusion_suite.py``
writes them. ``$TUNEDB_GENERALIZATION_DIR`` points elsewhere (a wheel ships no ``data/``).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from tunedb.graph.ir import Graph

DIR_ENV = "TUNEDB_GENERALIZATION_DIR"


def suite_dir() -> Path:
    """Where the suite's manifest and ONNX files are."""
    env = os.environ.get(DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data" / "graphs" / "generalization"


def manifest(folder: Path | None = None) -> dict:
    """The suite's manifest (``workloads``: file, name, hash, kind, sources, ...)."""
    path = (folder or suite_dir()) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise ValueError(f"the generalization suite's manifest {path} is missing (a source checkout "
                         f"has it under data/graphs/generalization; or set ${DIR_ENV})") from None
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


@functools.lru_cache(maxsize=8)
def _load(folder: str, tier: str | None) -> tuple[tuple[str, str, Graph], ...]:
    # Imported here: onnx costs seconds to import, and every user of tunedb.kernels (workers,
    # the collect and bench CLIs) would pay it for a suite it may never load.
    from tunedb.graph.onnx_import import import_onnx

    out = []
    for w in manifest(Path(folder))["workloads"]:
        if tier is not None and w.get("tier") != tier:
            continue
        g = import_onnx(Path(folder) / w["file"])
        out.append((f"gen_{w['kind']}", w["name"],
                    Graph(g.inputs, g.outputs, g.nodes, g.types, g.constants, w["name"])))
    return tuple(out)


def generalization_cases(folder: Path | None = None, tier: str | None = None) -> list[tuple[str, str, Graph]]:
    """(family, name, graph) of every workload, in manifest order; family is ``gen_<kind>``.
    ``tier``: only ``"bandwidth"`` workloads (floor >= 16 MiB, where the bandwidth floor is the
    yardstick) or only ``"launch"`` ones (smaller: launch and tail dominate)."""
    if tier not in (None, "bandwidth", "launch"):
        raise ValueError(f"unknown tier {tier!r}; expected 'bandwidth' or 'launch'")
    return list(_load(str((folder or suite_dir()).resolve()), tier))

"""Whole-plan times of zoo models on the local GPU next to torch eager, torch.compile and
torch.compile reduce-overhead (``tunedb.bench.plan.run_bench``: the plan verified against the
float64 reference and onnxruntime, the peers translated from the same graph, same inputs).

    python benchmarks/bench_zoo_plan.py OUT.json [--time-limit S] MODEL.onnx ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tunedb.bench.plan import collect_entries, run_bench, summary_lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--time-limit", type=float, default=0.0, help="no new model starts after S s")
    p.add_argument("--peers", default="torch_eager,torch_compile,torch_compile_ro")
    a = p.parse_args(argv)
    entries = collect_entries(a.models, anchors=False)
    result = run_bench(entries, a.out, peers=tuple(x for x in a.peers.split(",") if x),
                       time_limit_s=a.time_limit, progress=lambda s: print(s, flush=True))
    for line in summary_lines(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

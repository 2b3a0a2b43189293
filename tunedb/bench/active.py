"""Active-learning curves: how fast each collection strategy finds every workload's best kernel.

    python -m tunedb.bench.active --data PATH [--budget-per-workload N] [--out result.json]

Over stored measurements (a Parquet export directory or a tunedb DuckDB file), on the replay
device (CPU only), each strategy of ``tunedb.collect.strategy`` runs a real ``Collector.run`` into a
fresh in-memory store, with the stored candidates of the replayed device as the suite. After
every measurement we know, per workload, the best latency measured so far; the curves report,
every ``--step`` measurements:

- ``within``: the fraction of workloads whose best so far is within ``--tolerance`` (3 %) of the
  workload's true best (the fastest ok measurement in the data);
- ``mean_ratio``: the mean of best_so_far / true_best over the workloads (null until every
  workload has an ok measurement: before that the ratio of the others is infinite);
- ``mean_score``: the mean of true_best / best_so_far, 0 for workloads without one (bounded).

and, per strategy, the number of measurements needed to get ``within`` to each target (90 % and
100 % of the workloads by default). Random and model strategies are run for ``--seeds`` seeds and
their curves averaged. ``--synthetic N`` first writes a synthetic dataset of N workloads to PATH
(real fusion graphs and configs, a learnable hidden latency) when PATH does not exist yet.
Writes JSON (``--out``) and, where matplotlib is installed, a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunedb.bench.provenance import provenance
from tunedb.collect import STRATEGIES, Collector, Job, make_strategy
from tunedb.costmodel.synthetic import synthetic_frame
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload, canonical_json
from tunedb.runtime import ReplayDevice
from tunedb.store import StoreError, TuningStore

SYNTHETIC_DEVICE = DeviceInfo("NVIDIA H200", "synthetic", "9.0", 132, 50 << 20, 141 << 30, "", "", "")
_SEEDED = ("random", "roofline", "model")  # strategies whose order depends on the seed


class ActiveError(ValueError):
    """The experiment cannot run on this data; the message is one line."""


# ---- data -----------------------------------------------------------------------------------

def write_synthetic(path: str | Path, n_workloads: int = 60, candidates_per_workload: int = 40,
                    seed: int = 0, noise: float = 0.03) -> dict[str, int]:
    """A synthetic dataset (``tunedb.costmodel.synthetic``) written as tuning-store records: a
    DuckDB file, or a Parquet export when ``path`` ends with a slash or has no suffix."""
    frame = synthetic_frame(n_workloads, candidates_per_workload, seed=seed, noise=noise)
    cols = {c: frame[c].to_pylist() for c in ("workload_hash", "family", "workload_name", "graph_json",
                                             "config_json", "status", "median_us")}
    run = Run("synthetic", "synthetic", "0", "", "synthetic", canonical_json({"seed": seed}),
              "2026-01-01T00:00:00+00:00", "2026-01-01T00:00:01+00:00")
    workloads: dict[str, Workload] = {}
    candidates: list[Candidate] = []
    measurements: list[Measurement] = []
    for wh, fam, name, gj, cfg, status, lat in zip(*cols.values()):
        if wh not in workloads:
            workloads[wh] = Workload(wh, fam, name, canonical_json(json.loads(gj)))
        c = Candidate(wh, "fusion", json.loads(cfg), "")
        candidates.append(c)
        if status == "ok":
            samples = (lat * 0.99, lat, lat * 1.01)  # median = the synthetic latency
            measurements.append(Measurement(c.hash, SYNTHETIC_DEVICE.id, run.id, "ok", samples))
        else:
            measurements.append(Measurement(c.hash, SYNTHETIC_DEVICE.id, run.id, status,
                                            error="synthetic failure"))
    p = Path(path)
    export = str(path).endswith("/") or not p.suffix
    db_path = ":memory:" if export else p
    if not export:
        p.parent.mkdir(parents=True, exist_ok=True)
    with TuningStore.open(db_path) as store:
        store.add_devices([SYNTHETIC_DEVICE])
        store.add_runs([run])
        store.add_workloads(list(workloads.values()))
        store.add_candidates(candidates)
        store.add_measurements(measurements)
        if export:
            store.export_parquet(p)
    return {"workloads": len(workloads), "candidates": len(candidates)}


@dataclass
class Dataset:
    device: Any                    # a ReplayDevice
    jobs: list[Job]
    kind: str
    true_best: dict[str, float]    # workload hash -> fastest ok median in the data
    candidates: int


def load_dataset(path: str | Path, kind: str = "fusion", device_id: str | None = None) -> Dataset:
    """The replayed device's stored candidates of ``kind``, as collector jobs."""
    dev = ReplayDevice(path, device_id=device_id)
    p = Path(path).expanduser()
    store = TuningStore.open(":memory:") if p.is_dir() else TuningStore.open(p, read_only=True)
    try:
        if p.is_dir():
            store.import_parquet(p)
        workloads = {w.hash: w for w in store.workloads()}
        cands = store.candidates(kind=kind)
    finally:
        store.close()
    specs: dict[str, list[tuple[dict, Any]]] = {}
    true_best: dict[str, float] = {}
    n = 0
    for c in cands:
        res = dev.lookup(c.hash)
        if res is None or c.workload_hash not in workloads:
            continue  # not measured on the replayed device
        specs.setdefault(c.workload_hash, []).append((c.config_dict, None))
        n += 1
        if res.status == "ok" and res.samples_us:
            t = float(np.median(res.samples_us))
            true_best[c.workload_hash] = min(true_best.get(c.workload_hash, math.inf), t)
    if not specs:
        raise ActiveError(f"{p} holds no {kind!r} measurements on device {dev.info.name} ({dev.info.id})")
    jobs = [Job(workloads[h], sorted(s, key=lambda x: canonical_json(x[0])))
            for h, s in sorted(specs.items())]
    return Dataset(dev, jobs, kind, true_best, n)


class DataCollector(Collector):
    """The stored candidates as a suite; nothing is generated (the replay device answers)."""

    name = "active-replay"

    def __init__(self, jobs: list[Job], kind: str) -> None:
        self._jobs = jobs
        self.kind = kind

    def jobs(self, suite: str) -> Any:
        return iter(self._jobs)

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        return "", {}


# ---- simulation and curves ------------------------------------------------------------------

History = list[tuple[str, str, str, float | None]]  # (workload, candidate, status, median µs)


def simulate(data: Dataset, strategy: str, seed: int = 0, per_round: int = 4,
             budget_per_workload: int | None = None, **options: Any) -> History:
    """One collection on the replay device; the strategy's history in measurement order."""
    strat = make_strategy(strategy, per_round=per_round, seed=seed, **options)
    budget = None if budget_per_workload is None else budget_per_workload * len(data.jobs)
    with TuningStore.open(":memory:") as store:
        DataCollector(data.jobs, data.kind).run(store, data.device, "stored", budget=budget, strategy=strat,
                                                flush_every=4096, flush_s=3600.0)
    return strat.history


def curves(history: History, true_best: dict[str, float],
           tolerance: float = 0.03) -> dict[str, np.ndarray]:
    """Per-measurement curves (index t = after t+1 measurements) over the workloads that have a
    true best."""
    W = len(true_best)
    best: dict[str, float] = {}
    within = np.zeros(len(history))
    ratio = np.full(len(history), np.nan)
    score = np.zeros(len(history))
    n_within = 0
    sum_ratio = sum_score = 0.0
    for t, (wh, _, _, lat) in enumerate(history):
        tb = true_best.get(wh)
        if tb is not None and lat is not None and lat < best.get(wh, math.inf):
            old = best.get(wh)
            if old is not None:
                n_within -= old <= tb * (1 + tolerance)
                sum_ratio -= old / tb
                sum_score -= tb / old
            best[wh] = lat
            n_within += lat <= tb * (1 + tolerance)
            sum_ratio += lat / tb
            sum_score += tb / lat
        within[t] = n_within / W
        ratio[t] = sum_ratio / W if len(best) == W else np.nan
        score[t] = sum_score / W
    return {"within": within, "mean_ratio": ratio, "mean_score": score}


def first_reach(within: np.ndarray, target: float) -> int | None:
    """Measurements needed until ``within`` >= target (1-based), None if never."""
    hit = np.flatnonzero(within >= target - 1e-12)
    return int(hit[0]) + 1 if len(hit) else None


def run_experiment(data: Dataset, strategies: tuple[str, ...] = STRATEGIES, seeds: int = 1,
                   per_round: int = 4, budget_per_workload: int | None = None, step: int | None = None,
                   tolerance: float = 0.03, targets: tuple[float, ...] = (0.9, 1.0),
                   **model_options: Any) -> dict[str, Any]:
    W = len(data.true_best)
    if W == 0:
        raise ActiveError("no workload has an ok measurement: there is no best to find")
    step = step or max(1, len(data.jobs))
    out: dict[str, Any] = {
        "workloads": len(data.jobs), "workloads_scored": W, "candidates": data.candidates,
        "device": data.device.info.name, "device_id": data.device.info.id,
        "budget_per_workload": budget_per_workload, "per_round": per_round, "step": step,
        "tolerance": tolerance, "targets": list(targets), "seeds": seeds, "model_options": model_options,
        "strategies": {},
    }
    for name in strategies:
        runs = []
        t0 = time.monotonic()
        for seed in range(seeds if name in _SEEDED else 1):
            opts = model_options if name == "model" else {}
            hist = simulate(data, name, seed, per_round, budget_per_workload, **opts)
            if len({h[1] for h in hist}) != len(hist):
                raise ActiveError(f"strategy {name} measured a candidate twice")  # a bug, never data
            runs.append(curves(hist, data.true_best, tolerance))
        n = min(len(r["within"]) for r in runs)
        mean = {k: np.mean([r[k][:n] for r in runs], axis=0) for k in ("within", "mean_ratio", "mean_score")}
        points = sorted(set(range(step, n + 1, step)) | ({n} if n else set()))
        reach = {}
        for target in targets:
            per_seed = [first_reach(r["within"], target) for r in runs]
            got = [x for x in per_seed if x is not None]
            reach[f"{target:g}"] = {"per_seed": per_seed,
                                    "mean": float(np.mean(got)) if len(got) == len(per_seed) else None}
        out["strategies"][name] = {
            "measurements": points,
            **{k: [_num(v[p - 1]) for p in points] for k, v in mean.items()},
            "to_target": reach,
            "total_measured": n,
            "seconds": round(time.monotonic() - t0, 2),
        }
    return out


def _num(v: float) -> float | None:
    return round(float(v), 5) if np.isfinite(v) else None


def plot(result: dict[str, Any], png: str | Path) -> bool:
    """Two panels (fraction within tolerance, mean best/true-best) against measurements.
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in result["strategies"].items():
        a.plot(s["measurements"], s["within"], label=name)
        b.plot(s["measurements"], [np.nan if v is None else v for v in s["mean_ratio"]], label=name)
    a.set_xlabel("measurements")
    a.set_ylabel(f"workloads within {result['tolerance']:.0%} of best")
    b.set_xlabel("measurements")
    b.set_ylabel("mean best so far / true best")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['workloads']} workloads, {result['candidates']} candidates, {result['device']}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def _table(result: dict[str, Any]) -> str:
    lines = []
    for name, s in result["strategies"].items():
        parts = []
        for t, r in s["to_target"].items():
            parts.append(f"{float(t):.0%}: {'-' if r['mean'] is None else round(r['mean'])}")
        lines.append(f"{name:<11} measurements to reach within {result['tolerance']:.0%} on "
                     + ", ".join(parts) + f"  ({s['seconds']}s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tunedb.bench.active", description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="Parquet export dir or tunedb DuckDB file")
    ap.add_argument("--budget-per-workload", type=int, default=None, help="stop each simulation after "
                    "N measurements per workload on average [default: all candidates]")
    ap.add_argument("--out", default=None, help="result JSON (a PNG is written next to it)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=4, help="candidates per workload per round")
    ap.add_argument("--step", type=int, default=None, help="curve point every N measurements "
                    "[default: the number of workloads]")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--explore", type=float, default=None, help="model strategy: exploration share")
    ap.add_argument("--allocate", choices=("even", "ei"), default=None,
                    help="model strategy: split each round evenly, or by expected improvement")
    ap.add_argument("--kind", default="fusion")
    ap.add_argument("--device-id", default=None)
    ap.add_argument("--synthetic", type=int, default=None, metavar="N",
                    help="write N synthetic workloads to --data first (when it does not exist)")
    args = ap.parse_args(argv)

    try:
        names = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
        bad = [s for s in names if s not in STRATEGIES]
        if bad or not names:
            raise ActiveError(f"unknown strategy {bad[0] if bad else '(none)'!r}; "
                              f"expected {', '.join(STRATEGIES)}")
        if args.synthetic and not Path(args.data).exists():
            write_synthetic(args.data, args.synthetic)
        data = load_dataset(args.data, args.kind, args.device_id)
        options = {k: v for k, v in (("explore", args.explore), ("allocate", args.allocate)) if v is not None}
        result = run_experiment(data, names, max(1, args.seeds), args.per_round, args.budget_per_workload,
                                args.step, args.tolerance, **options)
    except (ValueError, StoreError) as e:  # ActiveError, ReplayError, StoreError: one line
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    result["data"] = Path(args.data).name
    result.update(provenance(None if argv is None else [sys.argv[0], *argv]))
    print(_table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        if plot(result, out.with_suffix(".png")):
            print(f"wrote {out} and {out.with_suffix('.png')}")
        else:
            print(f"wrote {out} (matplotlib not installed: no plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

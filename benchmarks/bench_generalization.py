"""Issue 21 on one GPU: the 12 anchors as plans against the bandwidth floor, then the issue's
generator patterns and bandwidth-tier workloads of the generalization suite as plans next to
torch eager, torch.compile and JAX (``tunedb.bench.plan``: verified against the float64
reference first, throughput timing). Not run in CI; needs a GPU with CuPy.

    python benchmarks/bench_generalization.py OUT_DIR [--limit S] [--db DB]
    python benchmarks/bench_generalization.py OUT_DIR --tier bandwidth --workers 14 --limit 500
    python benchmarks/bench_generalization.py OUT_DIR --tier bandwidth --workers 2 --plan-only  # CPU
    python benchmarks/bench_generalization.py OUT_DIR --tier bandwidth --only NAME [NAME ...]
    python benchmarks/bench_generalization.py NEW.json --table --against OLD.json [OLDER.json]  # CPU
    python benchmarks/bench_generalization.py NEW.json --table --merge --against OLD.json ...  # CPU

Writes ``OUT_DIR/anchors_plan.json`` and ``OUT_DIR/generalization_plan.json`` (the ``tunedb
bench plan`` JSON plus ``floor_bytes``/``floor_us`` per entry and ``copy_TBps``: each input
read once and each output written once at the measured device-to-device copy bandwidth).
Suite workloads: the bandwidth tier of ``data/graphs/generalization/manifest.json`` without
the windowed kind (convolutions), interleaved by kind and model, largest floor first;
``--limit`` seconds after which no new graph starts.

``--tier bandwidth`` (next to ``--workers N``) runs the whole tier instead, every kind (the
windowed depthwise convolutions and pools too), 153 workloads, as ``OUT_DIR/generalization_tier.json``:
N worker processes (``benchmarks/bench_zoo_plan.py``'s ``run_parallel``) import, plan, build the
executors and compile the peers (TorchInductor, XLA) at once on the host's cores, while each
timing holds the GPU alone (a lock); every plan is verified against the float64 reference first.
``--limit`` there stops the run (the graphs not finished are recorded so), sized so that the JSON
is written inside one 9-minute device call. ``--plan-only`` does the same on the CPU without a
GPU (plans and floors only: the kernels each workload gets).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tunedb.bench.peers import copy_tbps  # noqa: E402
from tunedb.bench.plan import Entry, collect_entries, load_entry, run_bench  # noqa: E402
from tunedb.kernels.suites import ANCHOR_CASES  # noqa: E402
from tunedb.runtime.device import import_cupy  # noqa: E402

SUITE = ROOT / "data" / "graphs" / "generalization"
KINDS = ("norm", "softmax", "data_movement", "elementwise", "reduce")
TIER_KINDS = KINDS + ("windowed",)
TIER_PEERS = ("torch_eager", "torch_compile", "jax")
NOMINAL_TBPS = 4.8  # an H200's HBM3e, for floors planned without a GPU


def patterns() -> list[Entry]:
    import test_kernels_generalization as t

    cases = [("mid_mean_64x512x256", t.mid_mean(64, 512, 256)),
             ("rotary_8x32x512x128", t.rotary(8, 32, 512, 128)),
             ("groupnorm_16x128g32x56x56", t.groupnorm(16, 128, 32, 56, 56)),
             ("instnorm_16x128x56x56", t.instnorm(16, 128, 56, 56)),
             ("masked_softmax_heads_8x12x512", t.per_head_softmax(8, 12, 512)),
             ("swiglu_split_8x512x4096", t.glu_split(8, 512, 4096)),
             ("kv_append_8x32x1024x1x128", t.kv_append(8, 32, 1024, 1, 128)),
             ("mid_center_32x64x16x256", t.mid_center(32, 64, 16, 256))]
    return [Entry(n, "pattern", graph=g) for n, g in cases]


def suite_paths(kinds: tuple[str, ...] = KINDS) -> list[Path]:
    """Bandwidth-tier workloads of ``kinds``, one per (kind, model) a round, largest floor first
    (a run cut short still covers every kind and model)."""
    m = json.loads((SUITE / "manifest.json").read_text())
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for w in m["workloads"]:
        if w.get("tier") == "bandwidth" and w["kind"] in kinds:
            by[w["kind"]].append(w)
    for ws in by.values():
        ws.sort(key=lambda w: -w["floor_us_h200"])
    out: list[Path] = []
    used: collections.Counter = collections.Counter()
    for rnd in range(len(m["workloads"])):
        if not any(by.values()):
            break
        for k in kinds:  # one workload per (kind, model) a round: every model early
            for j, w in enumerate(by[k]):
                if used[(k, w["model"])] <= rnd:
                    out.append(SUITE / by[k].pop(j)["file"])
                    used[(k, w["model"])] += 1
                    break
    return out


def only_paths(names: list[str] | None) -> list[Path] | None:
    """The tier's workloads named in ``names``, in the tier's order; None for all of them. A name
    that is not a bandwidth-tier workload is an error (a typo would silently measure nothing)."""
    if names is None:
        return None
    tier = suite_paths(TIER_KINDS)
    known = {p.stem for p in tier}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"error: --only: not bandwidth-tier workloads: {', '.join(unknown)}")
    return [p for p in tier if p.stem in set(names)]


def add_floors(result: dict, entries: list[Entry], bw: float) -> None:
    named = {e.name: e for e in entries}
    for rec in result["entries"]:
        try:
            g, _ = load_entry(named[rec["name"]])
            rec["floor_bytes"] = g.floor_bytes()
            rec["floor_us"] = rec["floor_bytes"] / (bw * 1e12) * 1e6
        except Exception as e:  # noqa: BLE001 - recorded, the others still get theirs
            rec["floor_error"] = str(e)[:200]
    result["copy_TBps"] = bw


def _done(prev: Path | None) -> dict[str, dict]:
    """Entries of an earlier tier run that finished (timed, or planned with --plan-only)."""
    if prev is None:
        return {}
    try:
        old = json.loads(prev.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --resume {prev}: not a tier result ({e})") from None
    return {e["name"]: e for e in old
            if (e.get("tunedb") or {}).get("us") or ("plan" in e and not e.get("error"))}


def run_tier(out: Path, workers: int, limit: float, plan_only: bool, lock: Path,
             peers: tuple[str, ...] = TIER_PEERS, paths: list[Path] | None = None,
             resume: Path | None = None) -> dict:
    """The whole bandwidth tier in ``workers`` processes (module docstring); returns the result,
    also written to ``out`` with floors: at the measured copy bandwidth on the GPU, at the
    nominal H200 bandwidth with ``plan_only``. ``resume``: an earlier run's JSON whose finished
    workloads are kept, not run again (a second call finishes what the first could not)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_zoo_plan import run_parallel

    from tunedb.bench.plan import collect_entries, summarize

    kept = _done(resume)
    entries = [e for e in collect_entries(paths if paths is not None else suite_paths(TIER_KINDS),
                                          anchors=False) if e.name not in kept]
    if plan_only:
        bw = NOMINAL_TBPS
    else:
        cp = import_cupy()
        bw = copy_tbps(cp, cp.cuda.Stream.null.synchronize, 1 << 30)
        print(f"copy {bw:.3f} TB/s", flush=True)
    result = run_parallel(entries, out, workers, () if plan_only else peers, limit, lock,
                          plan_only=plan_only, say=lambda s: print(s, flush=True))
    add_floors(result, entries, bw)
    if kept:
        result["entries"] = list(kept.values()) + result["entries"]
        result["resumed_from"] = {"file": resume.name, "kept": len(kept)}
        result["summary"] = summarize(result)
    result["nominal_bandwidth"] = plan_only
    out.write_text(json.dumps(result, indent=1, default=str))
    return result


def tier_table(result: dict) -> list[str]:
    """Markdown: the verified, timed workloads worst fraction of the floor first (tunedb's and
    each peer's), then the geomeans and how many fall below 0.5 or behind a peer."""
    rows, frac, vs = [], {"tunedb": []}, {p: [] for p in TIER_PEERS}
    for e in result["entries"]:
        us, floor = (e.get("tunedb") or {}).get("us"), e.get("floor_us")
        ok = ((e.get("verify") or {}).get("reference") or {}).get("ok")
        if not us or not floor or not ok:
            continue
        peer = {p: ((e.get("peers") or {}).get(p) or {}).get("us") for p in TIER_PEERS}
        frac["tunedb"].append(floor / us)
        for p, t in peer.items():
            if t:
                vs[p].append(t / us)
        rows.append((floor / us, e["name"], (e.get("plan") or {}).get("kernels"), floor, us, peer))
    head = ("| workload | kernels | floor µs | tunedb µs | of floor | "
            + " | ".join(f"{p} µs" for p in TIER_PEERS) + " | vs torch.compile | vs JAX |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for f, name, k, floor, us, peer in sorted(rows):
        cells = [f"{peer[p]:.1f}" if peer[p] else "—" for p in TIER_PEERS]
        ratio = [f"{peer[p] / us:.2f}×" if peer[p] else "—" for p in ("torch_compile", "jax")]
        out.append(f"| {name} | {k} | {floor:.1f} | {us:.1f} | {f:.2f} | " + " | ".join(cells + ratio) + " |")

    def gm(xs: list[float]) -> str:
        return f"{math.exp(sum(map(math.log, xs)) / len(xs)):.3f}" if xs else "—"

    out.append(f"\n{len(rows)} of {len(result['entries'])} workloads verified and timed: geomean "
               f"{gm(frac['tunedb'])} "
               f"of the floor, {sum(f < 0.5 for f in frac['tunedb'])} below 0.5; "
               + "; ".join(f"{gm(v)}× {p} ({sum(x < 1 for x in v)} behind)" for p, v in vs.items()))
    return out


def _timed(e: dict) -> float | None:
    """tunedb's µs of a verified entry, else None."""
    ok = ((e.get("verify") or {}).get("reference") or {}).get("ok")
    return (e.get("tunedb") or {}).get("us") if ok else None


def against_table(result: dict, olds: list[dict]) -> list[str]:
    """Markdown: each verified workload of ``result`` beside its time in the first of ``olds``
    (earlier tier JSONs, newest first) that timed it, torch eager of both runs as the boards'
    yardstick, and the geomean of the floor over the workloads both have."""
    out = ["| workload | kernels (then, now) | then µs | now µs | now / then | of floor (then, now) "
           "| torch eager µs (then, now) |", "|---|---|---|---|---|---|---|"]
    then_f, now_f = [], []
    for e in result["entries"]:
        us, floor = _timed(e), e.get("floor_us")
        old = next((o for r in olds for o in r["entries"] if o["name"] == e["name"] and _timed(o)), None)
        if not us or not floor or old is None:
            continue
        was = _timed(old)
        then_f.append(floor / was)
        now_f.append(floor / us)
        eager = [((x.get("peers") or {}).get("torch_eager") or {}).get("us") for x in (old, e)]
        kernels = [(x.get("plan") or {}).get("kernels") for x in (old, e)]
        out.append(f"| {e['name']} | {kernels[0]}, {kernels[1]} | {was:.1f} | {us:.1f} | {us / was:.2f} "
                   f"| {floor / was:.2f}, {floor / us:.2f} | "
                   + ", ".join(f"{t:.1f}" if t else "—" for t in eager) + " |")

    def gm(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")

    out.append(f"\n{len(now_f)} workloads timed in both: geomean of the floor {gm(then_f):.3f} then, "
               f"{gm(now_f):.3f} now; below 0.5: {sum(f < 0.5 for f in then_f)} then, "
               f"{sum(f < 0.5 for f in now_f)} now")
    return out


def merged(results: list[dict]) -> dict:
    """One tier result holding each workload's newest verified timing among ``results`` (newest
    first): the tier as it stands when later runs re-timed only what they changed."""
    seen: dict[str, dict] = {}
    for r in results:
        for e in r["entries"]:
            if _timed(e) and e.get("floor_us") and e["name"] not in seen:
                seen[e["name"]] = e
    return {"entries": list(seen.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--limit", type=float, default=600.0)
    ap.add_argument("--db", default=None)
    ap.add_argument("--tier", choices=("bandwidth",), default=None,
                    help="the whole bandwidth tier in worker processes (generalization_tier.json)")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--plan-only", action="store_true", help="with --tier: plan on the CPU, no GPU")
    ap.add_argument("--gpu-lock", type=Path, default=Path(tempfile.gettempdir()) / "tunedb-gpu.lock")
    ap.add_argument("--table", action="store_true",
                    help="print the table of OUT/generalization_tier.json, or of OUT if it is a .json "
                         "file (CPU), and stop")
    ap.add_argument("--resume", type=Path, default=None,
                    help="with --tier: keep the finished workloads of this earlier result")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="with --tier: only these workloads of the tier (names of the manifest)")
    ap.add_argument("--against", nargs="+", type=Path, default=None, metavar="OLD.json",
                    help="with --table: each workload beside its time in the first of these earlier "
                         "tier JSONs that timed it (newest first)")
    ap.add_argument("--merge", action="store_true",
                    help="with --table and --against: the table over each workload's newest timing "
                         "among OUT.json and the --against JSONs (the tier as it stands)")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.table:  # OUT is the folder of a run or a tier JSON itself (data/bench/...json)
        path = args.out if args.out.suffix == ".json" else args.out / "generalization_tier.json"
        result = json.loads(path.read_text())
        olds = [json.loads(p.read_text()) for p in args.against or ()]
        if args.merge:
            print("\n".join(tier_table(merged([result] + olds))))
            return
        print("\n".join(against_table(result, olds) if olds else tier_table(result)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tier:
        res = run_tier(args.out / "generalization_tier.json", args.workers, args.limit, args.plan_only,
                       args.gpu_lock, paths=only_paths(args.only), resume=args.resume)
        print(f"done {len(res['entries'])} workloads, complete {res['complete']}, "
              f"{round(time.monotonic() - t0, 1)} s", flush=True)
        print("\n".join(tier_table(res)))
        return
    cp = import_cupy()
    bw = copy_tbps(cp, cp.cuda.Stream.null.synchronize, 1 << 30)
    print(f"copy {bw:.3f} TB/s", flush=True)
    runs = (("anchors_plan", [Entry(c.name, "anchor", graph=c.graph) for c in ANCHOR_CASES], ()),
            ("generalization_plan", patterns() + collect_entries(suite_paths()),
             ("torch_eager", "torch_compile", "jax")))
    for name, entries, peers in runs:
        path = args.out / f"{name}.json"
        left = max(10.0, args.limit - (time.monotonic() - t0)) if peers else 0.0
        result = run_bench(entries, path, db=args.db, peers=peers, time_limit_s=left, progress=print,
                           on_entry=lambda i, n, rec: print(i, n, rec["name"], rec["tunedb"].get("us"),
                                                            rec.get("speedup"), flush=True))
        add_floors(result, entries, bw)
        path.write_text(json.dumps(result, indent=1, default=str))
    print("done", round(time.monotonic() - t0, 1), flush=True)


if __name__ == "__main__":
    main()

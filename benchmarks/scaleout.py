"""Scale-out on Dask, on CPU with replay devices: a distributed collection's rows against one
process's, and an N-worker scaling curve from the H200 collector's recorded times.

rows:  the suite collected from the shipped replay data (``data/fusion_h200_v2``) by one process
       (``FusionCollector.run`` on a ``ReplayDevice``) and by a Dask LocalCluster of ``--workers``
       replay workers (each generates its candidates' code): counts and digests of the candidate
       hashes, measurement rows (hash, device, status, generated source hash) and samples.
       ``--shard I/K`` keeps every K-th workload from the I-th when the whole suite is too long.
curve: every candidate of the shipped data, served by replay workers that take for each the time
       the H200 collector took for it (its commit group's interval over the group's rows), on 1, 2,
       4, 8 workers; next to an event simulation of the same batches on N ideal workers.

    python benchmarks/scaleout.py rows --suite standard --json data/bench/scaleout_rows_cpu.json
    python benchmarks/scaleout.py curve --workers 1,2,4,8 --json data/bench/scaleout_curve_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import random
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors.fusion import FusionCollector  # noqa: E402
from tunedb.bench.provenance import git_commit, portable_argv  # noqa: E402
from tunedb.collect import Job  # noqa: E402
from tunedb.collect.dask_backend import ClusterSummary, open_client, run_cluster  # noqa: E402
from tunedb.collect.jobs import Summary, Task  # noqa: E402
from tunedb.records import Candidate, Workload  # noqa: E402
from tunedb.runtime import ReplayDevice  # noqa: E402
from tunedb.runtime.results import MeasureRequest  # noqa: E402
from tunedb.store import SharedWriter, TuningStore  # noqa: E402

SHIPPED = ROOT / "data" / "fusion_h200_v2"
SUMMARY = ROOT / "data" / "fusion_h200_v2_collect_summary.json"
CHUNK = 64  # run_cluster's batch size


# -- rows -----------------------------------------------------------------------------------------
class ShardedFusion(FusionCollector):
    """The fusion collector over every ``k``-th workload of a suite from the ``shard``-th
    (``k`` = 1: all), optionally only the first ``limit`` of those."""

    name = "fusion"

    def __init__(self, shard: int = 0, k: int = 1, limit: int | None = None) -> None:
        super().__init__()
        self.shard, self.k, self.limit = shard, k, limit

    def jobs(self, suite: str) -> Iterator[Job]:
        return itertools.islice(super().jobs(suite), self.shard, None if self.limit is None
                                else self.shard + self.k * self.limit, self.k)


def digest(items: list) -> str:
    """sha256 of the sorted items' canonical JSON lines: equal sets of rows, equal digests."""
    h = hashlib.sha256()
    for line in sorted(json.dumps(list(x) if isinstance(x, tuple) else x, allow_nan=True) for x in items):
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def contents(db: Path) -> dict:
    """What a comparison needs of a collected database: counts and digests."""
    with TuningStore.open(db, read_only=True) as store:
        con = store.con
        cands = [r[0] for r in con.execute("SELECT hash FROM candidates").fetchall()]
        rows = [tuple(r) for r in con.execute(
            "SELECT m.candidate_hash, m.device_id, m.status, c.source_hash FROM measurements m "
            "JOIN candidates c ON c.hash = m.candidate_hash").fetchall()]
        samples = [(h, list(s)) for h, s in con.execute(
            "SELECT candidate_hash, samples_us FROM measurements").fetchall()]
        statuses = dict(con.execute("SELECT status, count(*) FROM measurements GROUP BY 1").fetchall())
    keys = [(r[0], r[1]) for r in rows]
    return {"candidates": len(cands), "candidates_digest": digest(cands),
            "measurements": len(rows), "duplicates": len(keys) - len(set(keys)),
            "rows_digest": digest(rows), "samples_digest": digest(samples),
            "measured_hashes_digest": digest(sorted({r[0] for r in rows})),
            "without_source_hash": sum(1 for r in rows if not r[3]), "statuses": statuses}


class Progress:
    """A line every ``every_s`` seconds to stdout (the run's progress log)."""

    def __init__(self, label: str, every_s: float = 15.0) -> None:
        self.label, self.every_s, self.last = label, every_s, 0.0

    def __call__(self, s: Summary) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(f"[{self.label}] {s.measured + s.missing + s.already}/{s.total} candidates "
                  f"({s.measured} measured, {s.missing} not in the replay data) {s.elapsed_s:.0f}s",
                  flush=True)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rows_single(db: Path, suite: str, shard: int, k: int, limit: int | None = None,
                shipped: Path = SHIPPED) -> dict:
    coll = ShardedFusion(shard, k, limit)
    t, cpu = time.monotonic(), _cpu_s()
    with TuningStore.open(db) as store:
        s = coll.run(store, ReplayDevice(shipped), suite, progress=Progress("single"))
    return {"summary": s.to_json(), "wall_s": round(time.monotonic() - t, 1),
            "client_cpu_s": round(_cpu_s() - cpu, 1)}


def rows_cluster(db: Path, client: Any, suite: str, shard: int, k: int, limit: int | None = None,
                 shipped: Path = SHIPPED) -> dict:
    coll = ShardedFusion(shard, k, limit)
    t, cpu = time.monotonic(), _cpu_s()
    with SharedWriter(db) as store:
        s = run_cluster(coll, store, client, f"replay:{shipped}", suite,
                        progress=Progress(f"{len(client.scheduler_info()['workers'])} workers"))
    return {"summary": s.to_json(), "workers": s.workers, "remote_build": s.remote_build,
            "wall_s": round(time.monotonic() - t, 1), "client_cpu_s": round(_cpu_s() - cpu, 1)}


def compare_rows(suite: str, workers: int, tmp: Path, shard: int = 0, k: int = 1,
                 limit: int | None = None, out: dict | None = None, save: Any = None) -> dict:
    """One process, then ``workers`` Dask workers, on the same suite (shard); their contents."""
    out = out if out is not None else {}
    out["single"] = rows_single(tmp / "single.duckdb", suite, shard, k, limit)
    out["single"]["contents"] = contents(tmp / "single.duckdb")
    if save:
        save(out)
    client, lc = open_client("local", workers, f"replay:{SHIPPED}")
    try:
        out["cluster"] = rows_cluster(tmp / "cluster.duckdb", client, suite, shard, k, limit)
    finally:
        client.close()
        lc.close()
    out["cluster"]["contents"] = contents(tmp / "cluster.duckdb")
    a, b = out["single"]["contents"], out["cluster"]["contents"]
    out["equal"] = {key: a[key] == b[key] for key in a}
    if save:
        save(out)
    return out


# -- curve ----------------------------------------------------------------------------------------
def recorded_durations(committed: list[tuple[str, Any]]) -> dict[str, float]:
    """Seconds per candidate from ``(candidate_hash, measured_at)`` rows of one collection: the
    collector commits rows in groups as it goes, so a group's rows took the interval since the
    previous commit, shared equally; the first group gets the run's mean."""
    groups: dict[Any, list[str]] = {}
    for h, at in committed:
        groups.setdefault(at, []).append(h)
    stamps = sorted(groups)
    span = (stamps[-1] - stamps[0]).total_seconds() if len(stamps) > 1 else 0.0
    mean = span / max(1, len(committed) - len(groups[stamps[0]]))
    out = {h: mean for h in groups[stamps[0]]}
    for prev, at in itertools.pairwise(stamps):
        each = (at - prev).total_seconds() / len(groups[at])
        out.update((h, each) for h in groups[at])
    return out


class RecordedJobs(FusionCollector):
    """The candidates of a stored collection, workload by workload in the order they were
    measured, for a replay device: no code generation (the replay answers by hash)."""

    name = "fusion"
    spec_from_config = None  # nothing to generate: the client sends hashes

    def __init__(self, shipped: Path = SHIPPED, workloads: int | None = None) -> None:
        super().__init__()
        with TuningStore.open(":memory:") as store:
            store.import_parquet(shipped)
            con = store.con
            order = [r[0] for r in con.execute(
                "SELECT c.workload_hash FROM measurements m JOIN candidates c ON c.hash = m.candidate_hash "
                "GROUP BY 1 ORDER BY min(m.measured_at), 1").fetchall()][:workloads]
            wl = {r[0]: Workload(*r) for r in con.execute(
                "SELECT hash, family, name, graph_json FROM workloads").fetchall()}
            cands: dict[str, list[tuple[str, dict]]] = {}
            for h, w, cfg in con.execute("SELECT c.hash, c.workload_hash, c.config_json FROM candidates c "
                                         "WHERE c.hash IN (SELECT candidate_hash FROM measurements) "
                                         "ORDER BY c.hash").fetchall():
                cands.setdefault(w, []).append((h, json.loads(cfg)))
            self.committed = con.execute("SELECT candidate_hash, measured_at FROM measurements").fetchall()
        self._jobs = []
        for w in order:
            specs = []
            for h, cfg in cands[w]:
                if Candidate(w, self.kind, cfg).hash != h:
                    raise ValueError(f"candidate {h} of {shipped} does not hash to itself")
                specs.append((cfg, None))
            self._jobs.append(Job(wl[w], specs))

    def jobs(self, suite: str) -> Iterator[Job]:
        return iter(self._jobs)

    def task(self, workload: Workload, config: dict, spec: Any) -> Task:
        cand = Candidate(workload.hash, self.kind, config)
        return Task(cand, MeasureRequest(cand.hash))


def simulate(batches: list[float], workers: int) -> float:
    """Makespan of ``batches`` (seconds each, in submission order) on ``workers`` ideal workers,
    each batch going to the first free worker (what the Dask scheduler does with a queue)."""
    free = [0.0] * workers
    for d in batches:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def batch_times(jobs: list[Job], durations: dict[str, float], kind: str = "fusion") -> list[float]:
    """Seconds of each batch run_cluster submits (``CHUNK`` candidates of one workload)."""
    out = []
    for job in jobs:
        hashes = [Candidate(job.workload.hash, kind, cfg).hash for cfg, _ in job.specs]
        out += [sum(durations[h] for h in hashes[i:i + CHUNK]) for i in range(0, len(hashes), CHUNK)]
    return out


def curve_point(coll: RecordedJobs, workers: int, pace: dict[str, float], tmp: Path,
                shipped: Path = SHIPPED) -> ClusterSummary | dict:
    """One timed collection of ``coll``'s candidates on a fresh LocalCluster of ``workers``."""
    client, lc = open_client("local", workers, f"replay:{shipped}")
    try:
        with SharedWriter(tmp / f"warm_{workers}.duckdb") as store:  # imports and replay loads
            run_cluster(coll, store, client, f"replay:{shipped}", "recorded", budget=workers * CHUNK)
        db = tmp / f"curve_{workers}.duckdb"
        t, cpu = time.monotonic(), _cpu_s()
        with SharedWriter(db) as store:
            s = run_cluster(coll, store, client, f"replay:{shipped}", "recorded", pace_s=pace,
                            progress=Progress(f"curve {workers}"))
        wall, cpu = time.monotonic() - t, _cpu_s() - cpu
    finally:
        client.close()
        lc.close()
    c = contents(db)
    return {"workers": workers, "candidates": s.measured, "missing": s.missing, "wall_s": round(wall, 2),
            "rate_per_s": round(s.measured / wall, 1), "client_cpu_s": round(cpu, 1),
            "client_cpu_ms_per_candidate": round(1000 * cpu / max(1, s.measured), 3),
            "per_worker": sorted(s.workers.values()), "duplicates": c["duplicates"],
            "rows_digest": c["rows_digest"]}


def curve(workers: list[int], tmp: Path, time_scale: float = 1.0, workloads: int | None = None,
          out: dict | None = None, save: Any = None) -> dict:
    out = out if out is not None else {}
    coll = RecordedJobs(SHIPPED, workloads)
    jobs = list(coll.jobs("recorded"))
    keep = {Candidate(j.workload.hash, coll.kind, cfg).hash for j in jobs for cfg, _ in j.specs}
    pace = {h: d * time_scale for h, d in recorded_durations(coll.committed).items() if h in keep}
    batches = batch_times(jobs, pace)
    n = len(pace)
    out.update({"candidates": n, "workloads": len(jobs), "batches": len(batches), "time_scale": time_scale,
                "recorded_device_s": round(sum(pace.values()), 2), "points": []})
    for w in workers:
        point = curve_point(coll, w, pace, tmp)
        ideal = simulate(batches, w)
        point.update({"ideal_s": round(ideal, 2), "ideal_rate_per_s": round(n / ideal, 1),
                      "of_ideal": round(ideal / point["wall_s"], 3)})
        out["points"].append(point)
        base = out["points"][0]
        for p in out["points"]:
            p["speedup"] = round(p["rate_per_s"] / base["rate_per_s"] * base["workers"], 2)
            p["per_worker_rate_per_s"] = round(p["rate_per_s"] / p["workers"], 1)
        if save:
            save(out)
    return out


# -- smoke: rows of a collection on real GPUs ----------------------------------------------------
def check_collection(db: Path, suite: str = "quick", sample: int = 150) -> dict:
    """A cluster collection's rows against the suite as the client enumerates it on that board:
    counts, duplicates, statuses, devices, and the stored source hashes of a seeded sample of
    candidates against code generated here."""
    with TuningStore.open(db, read_only=True) as store:
        con = store.con
        devices = con.execute("SELECT id, name, sm_count FROM devices ORDER BY id").fetchall()
        cands = {h: sh for h, sh in con.execute("SELECT hash, source_hash FROM candidates").fetchall()}
        rows = con.execute("SELECT candidate_hash, device_id, status FROM measurements").fetchall()
        runs = con.execute("SELECT finished_at FROM runs").fetchall()
        commits = con.execute("SELECT measured_at, count(*) FROM measurements GROUP BY 1 "
                              "ORDER BY 1").fetchall()
    coll = FusionCollector()
    coll.device_info = type("Board", (), {"sm_count": devices[0][2]})()  # sizes the space
    expected = {Candidate(j.workload.hash, coll.kind, cfg).hash: (j.workload, spec)
                for j in coll.jobs(suite) for cfg, spec in j.specs}
    keys = [(h, d) for h, d, _ in rows]
    statuses: dict[str, int] = {}
    for _, _, st in rows:
        statuses[st] = statuses.get(st, 0) + 1
    picked = random.Random(0).sample(sorted(cands), min(sample, len(cands)))
    same = sum(1 for h in picked if h in expected and coll.build(*expected[h])[0] == cands[h])
    return {"devices": [list(d) for d in devices], "suite": suite, "suite_candidates": len(expected),
            "candidates": len(cands), "measurements": len(rows), "duplicates": len(keys) - len(set(keys)),
            "statuses": statuses, "not_in_suite": len(set(cands) - set(expected)),
            "measured_of_suite": len({h for h, _ in keys} & set(expected)),
            "candidates_without_measurement": len(set(cands) - {h for h, _ in keys}),
            "without_source_hash": sum(1 for v in cands.values() if not v),
            "source_hash_equal_to_local_build": f"{same}/{len(picked)}",
            "runs_finished": [bool(f) for (f,) in runs], **commit_rate(commits)}


def commit_rate(commits: list[tuple[Any, int]]) -> dict:
    """Measured rows per second between a collection's first and last commit (the rows of the
    first commit were measured before it: they are left out)."""
    if len(commits) < 2:
        return {}
    span = (commits[-1][0] - commits[0][0]).total_seconds()
    rows = sum(n for _, n in commits[1:])
    return {"commits": len(commits), "commit_span_s": round(span, 2),
            "rate_between_commits_per_s": round(rows / span, 1) if span > 0 else None}


# -- main -----------------------------------------------------------------------------------------
def print_rows(r: dict) -> None:
    print(f"{'collection':<14}{'candidates':>11}{'measured':>10}{'wall s':>9}{'client cpu s':>14}"
          "  rows digest")
    for name in ("single", "cluster"):
        if name in r:
            c = r[name]["contents"]
            print(f"{name:<14}{c['candidates']:>11}{c['measurements']:>10}{r[name]['wall_s']:>9}"
                  f"{r[name]['client_cpu_s']:>14}  {c['rows_digest'][:16]}")
    if "equal" in r:
        print("equal: " + ", ".join(f"{k}={v}" for k, v in r["equal"].items() if k != "statuses"))


def print_curve(r: dict) -> None:
    print(f"{r['candidates']} candidates, {r['recorded_device_s']} s of recorded device time "
          f"(x{r['time_scale']})")
    print(f"{'workers':>7}{'cand/s':>9}{'per worker':>11}{'speedup':>9}{'ideal cand/s':>13}{'of ideal':>9}"
          f"{'client ms/cand':>15}")
    for p in r["points"]:
        print(f"{p['workers']:>7}{p['rate_per_s']:>9}{p['per_worker_rate_per_s']:>11}{p['speedup']:>9}"
              f"{p['ideal_rate_per_s']:>13}{p['of_ideal']:>9}{p['client_cpu_ms_per_candidate']:>15}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=["rows", "curve", "smoke"])
    ap.add_argument("--suite", default="standard")
    ap.add_argument("--workers", default="4", help="rows: one count; curve: a list, e.g. 1,2,4,8")
    ap.add_argument("--shard", default="0/1", help="I/K: every K-th workload from the I-th")
    ap.add_argument("--workloads", type=int, default=None, help="only the first N workloads (of the shard)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="curve: recorded times x this")
    ap.add_argument("--db", type=Path, action="append", default=[], help="smoke: a database to check")
    ap.add_argument("--summary", type=Path, action="append", default=[],
                    help="smoke: a `tunedb collect --json` summary to keep beside the checks")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        shard, k = (int(x) for x in a.shard.split("/"))
        workers = [int(w) for w in a.workers.split(",")]
        if not (0 <= shard < k) or min(workers) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--shard {a.shard!r} / --workers {a.workers!r}: expected I/K with 0 <= I < K, counts >= 1")
    result: dict[str, Any] = {"argv": portable_argv(sys.argv if argv is None else ["scaleout.py", *argv]),
                              "git_commit": git_commit(ROOT), "section": a.section,
                              "source": "data/fusion_h200_v2"}

    def save(part: dict) -> None:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(result, indent=1, default=str) + "\n")

    if a.section == "smoke":
        for f in [*a.db, *a.summary]:
            if not f.is_file():
                ap.error(f"{f}: no such file")
        result["source"] = "the databases named"
        result["checks"] = {db.name: check_collection(db, a.suite) for db in a.db}
        # from its first brace: a replay device's DuckDB import may print a progress bar before it
        result["summaries"] = {f.name: json.loads(f.read_text()[f.read_text().find("{"):]) for f in a.summary}
        print(json.dumps(result["checks"], indent=1))
        save(result)
        return result
    tmp = Path(tempfile.mkdtemp(prefix="tunedb-scaleout-"))
    if a.section == "rows":
        result.update({"suite": a.suite, "shard": a.shard, "workloads_limit": a.workloads,
                       "workers": workers[0]})
        compare_rows(a.suite, workers[0], tmp, shard, k, a.workloads, result, save)
        print_rows(result)
    else:
        v2 = json.loads(SUMMARY.read_text())
        result["single_gpu_collector"] = {"rate_per_s": v2["rate_per_s"], "measured": v2["measured"],
                                          "elapsed_s": v2["elapsed_s"]}
        curve(workers, tmp, a.time_scale, a.workloads, result, save)
        print_curve(result)
    save(result)
    return result


if __name__ == "__main__":
    main()

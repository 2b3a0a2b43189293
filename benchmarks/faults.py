"""Reliability of a Dask collection under faults, and its simulated scaling, on CPU (replay devices).

Every trial collects the same small replay source (the first workloads of a suite replayed from the
shipped data) into a fresh database and checks the rows against a single-process collection:

- client SIGKILL: a client process (connected to a LocalCluster) is killed at a seeded random point,
  then run again to completion: committed rows lost, duplicates, rows equal to the single run;
- worker SIGKILL: a random worker process is killed at a seeded random point of an in-process
  collection: batches lost (rows missing), duplicates, batches given up;
- two collectors: a second collector opens the database while the first commits: its one-line
  error, and the first's rows.

Workers pace each candidate by ``--pace`` seconds (a replay device standing in for a GPU) so kill
points fall inside a collection. The scaling curve runs the same collection on 1..N workers paced
by the single-H200 collector's measured time per candidate (data/fusion_h200_v2_collect_summary.json).

    python benchmarks/faults.py --trials 20 --json data/bench/faults_cpu.json
    python benchmarks/faults.py client --scheduler tcp://... --source S --db D   (one client run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors.fusion import FusionCollector  # noqa: E402
from tunedb.bench.provenance import portable_argv  # noqa: E402
from tunedb.collect.dask_backend import open_client, run_cluster  # noqa: E402
from tunedb.collect.engine import git_sha  # noqa: E402
from tunedb.runtime import ReplayDevice  # noqa: E402
from tunedb.store import SharedWriter, TuningStore  # noqa: E402

SHIPPED = ROOT / "data" / "fusion_h200_v2"
ROW_QUERY = ("SELECT m.candidate_hash, m.device_id, m.status, c.source_hash FROM measurements m "
             "JOIN candidates c ON c.hash = m.candidate_hash ORDER BY 1, 2")


class FirstWorkloads(FusionCollector):
    """The fusion collector over the first ``n`` workloads of a suite (small trials)."""

    name = "fusion"
    n = 4

    def jobs(self, suite: str):  # noqa: ANN201 - same as the base class
        return itertools.islice(super().jobs(suite), self.n)


def make_source(path: Path, suite: str = "quick", n: int = 4, shipped: Path = SHIPPED) -> Path:
    """A replay source: the first ``n`` workloads of ``suite`` replayed from the shipped data."""
    coll = FirstWorkloads()
    coll.n = n
    with TuningStore.open(path) as db:
        coll.run(db, ReplayDevice(shipped), suite)
    return path


def single(db: Path, source: Path, suite: str = "quick", n: int = 4) -> Any:
    coll = FirstWorkloads()
    coll.n = n
    with TuningStore.open(db) as store:
        return coll.run(store, ReplayDevice(source), suite)


def rows(db: Path) -> list[tuple]:
    with TuningStore.open(db, read_only=True) as store:
        return [tuple(r) for r in store.con.execute(ROW_QUERY).fetchall()]


def duplicates(found: list[tuple]) -> int:
    keys = [(r[0], r[1]) for r in found]
    return len(keys) - len(set(keys))


def cluster_collect(client: Any, db: Path, source: Path, suite: str = "quick", n: int = 4,
                    pace_s: float = 0.0, chunk: int = 16, **kw: Any) -> Any:
    coll = FirstWorkloads()
    coll.n = n
    with SharedWriter(db) as store:
        return run_cluster(coll, store, client, f"replay:{source}", suite, chunk=chunk, pace_s=pace_s, **kw)


def _client_cmd(addr: str, source: Path, db: Path, suite: str, n: int, pace_s: float) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "client", "--scheduler", addr, "--source",
            str(source), "--db", str(db), "--suite", suite, "--workloads", str(n), "--pace", str(pace_s)]


def _start_client(cmd: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    for line in p.stdout:  # "collecting": the client holds the database and submits work
        if line.startswith("collecting"):
            break
    return p


def client_kill_trial(seed: int, addr: str, source: Path, tmp: Path, expected: list[tuple],
                      suite: str = "quick", n: int = 4, pace_s: float = 0.02, window_s: float = 6.0,
                      client: Any = None) -> dict:
    """Kill a client at a seeded point of its run, run it again: nothing committed lost, no duplicates."""
    db = tmp / f"client_kill_{seed}.duckdb"
    db.unlink(missing_ok=True)
    cmd = _client_cmd(addr, source, db, suite, n, pace_s)
    delay = random.Random(seed).uniform(0.0, window_s)
    p = _start_client(cmd)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait()
    committed = set(rows(db)) if db.exists() else set()
    if client is None:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=300)
    else:  # the resume in this process: the same code, without a second interpreter's start-up
        cluster_collect(client, db, source, suite, n, pace_s=pace_s)
    final = rows(db)
    return {"seed": seed, "kill_after_s": round(delay, 3), "committed_at_kill": len(committed),
            "lost": len(committed - set(final)), "duplicates": duplicates(final),
            "rows": len(final), "equal": sorted(set(final)) == sorted(expected)}


def worker_kill_trial(seed: int, client: Any, source: Path, tmp: Path, expected: list[tuple],
                      suite: str = "quick", n: int = 4, pace_s: float = 0.02, window_s: float = 2.0) -> dict:
    """SIGKILL one random worker at a seeded point of an in-process collection."""
    db = tmp / f"worker_kill_{seed}.duckdb"
    db.unlink(missing_ok=True)
    rng = random.Random(seed)
    delay = rng.uniform(0.2, window_s)
    pids = sorted(client.run(os.getpid).values())
    victim = rng.choice(pids)
    killed: list[float] = []

    def kill() -> None:
        time.sleep(delay)
        os.kill(victim, signal.SIGKILL)
        killed.append(delay)

    threading.Thread(target=kill, daemon=True).start()
    s = cluster_collect(client, db, source, suite, n, pace_s=pace_s)
    while not killed:  # the run may end before the kill: wait, so the next trial starts clean
        time.sleep(0.05)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the nanny restarts the victim: wait for its successor
        now = client.run(os.getpid, on_error="return").values()
        if victim not in now and sum(isinstance(x, int) for x in now) >= len(pids):
            break
        time.sleep(0.2)
    final = rows(db)
    return {"seed": seed, "kill_after_s": round(delay, 3), "during_run": delay < s.elapsed_s,
            "lost": len(set(expected) - set(final)), "duplicates": duplicates(final),
            "given_up_batches": s.killed_batches, "rows": len(final),
            "equal": sorted(set(final)) == sorted(expected)}


def two_collectors_trial(seed: int, addr: str, source: Path, tmp: Path, expected: list[tuple],
                         suite: str = "quick", n: int = 4, pace_s: float = 0.2,
                         window_s: float = 3.0) -> dict:
    """A second collector opens the database while the first is collecting."""
    db = tmp / f"two_{seed}.duckdb"
    db.unlink(missing_ok=True)
    delay = random.Random(seed).uniform(0.0, window_s)
    started, finished = threading.Event(), threading.Event()

    def first() -> None:
        from distributed import Client

        with Client(addr, timeout="30s") as c, SharedWriter(db) as store:
            started.set()
            coll = FirstWorkloads()
            coll.n = n
            run_cluster(coll, store, c, f"replay:{source}", suite, chunk=16, pace_s=pace_s)
        finished.set()

    t = threading.Thread(target=first, daemon=True)
    t.start()
    started.wait(120)
    time.sleep(delay)
    running = not finished.is_set()
    second = subprocess.run([str(Path(sys.executable).with_name("tunedb")), "collect", "--suite", suite,
                             "--db", str(db), "--device", f"replay:{source}", "--budget", "1", "--json"],
                            capture_output=True, text=True, timeout=300)
    error = second.stderr.strip() if second.returncode != 0 else ""
    running = running and not finished.is_set()  # the first still held the file after the second
    t.join(300)
    final = rows(db)
    return {"seed": seed, "second_after_s": round(delay, 3), "first_running": running,
            "refused": bool(error), "one_line": bool(error) and "\n" not in error, "error": error,
            "lost": len(set(expected) - set(final)), "duplicates": duplicates(final),
            "equal": sorted(set(final)) == sorted(expected)}


def scaling(source: Path, tmp: Path, workers: list[int], per_candidate_s: float, suite: str,
            n: int) -> list[dict]:
    """Candidates/s of the same collection on 1..N paced workers (fresh LocalCluster each)."""
    out = []
    for w in workers:
        client, lc = open_client("local", w, f"replay:{source}")
        try:
            db = tmp / f"scale_{w}.duckdb"
            db.unlink(missing_ok=True)
            cluster_collect(client, tmp / "warm.duckdb", source, suite, n)  # imports, device opens
            t = time.monotonic()
            s = cluster_collect(client, db, source, suite, n, pace_s=per_candidate_s)
            dt = time.monotonic() - t
            out.append({"workers": w, "candidates": s.measured, "seconds": round(dt, 2),
                        "rate_per_s": round(s.measured / dt, 1)})
        finally:
            client.close()
            lc.close()
            (tmp / "warm.duckdb").unlink(missing_ok=True)
    base = out[0]["rate_per_s"]
    for r in out:
        r["speedup"] = round(r["rate_per_s"] / base, 2)
    return out


def _client_main(a: argparse.Namespace) -> None:
    from distributed import Client

    client = Client(a.scheduler, timeout="30s")
    coll = FirstWorkloads()
    coll.n = a.workloads
    with SharedWriter(a.db) as store:
        print("collecting", flush=True)
        # A commit every batch, so that kill points fall between commits, not before the first.
        s = run_cluster(coll, store, client, f"replay:{a.source}", a.suite, chunk=16, pace_s=a.pace,
                        flush_every=16, flush_s=0.5)
    print(json.dumps(s.to_json()), flush=True)
    client.close()


def _summary(trials: list[dict], keys: list[str]) -> dict:
    return {k: sum(int(t[k]) for t in trials) for k in keys}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "client"])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--suite", default="quick")
    ap.add_argument("--workloads", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pace", type=float, default=0.02, help="seconds per candidate on a worker")
    ap.add_argument("--scale", default="1,2,4,8", help="worker counts of the scaling curve ('' skips)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sections", default="worker,two,client",
                    help="fault sections to run (worker, two, client), e.g. to spread them over processes")
    ap.add_argument("--scheduler", default="")
    ap.add_argument("--source", type=Path, default=None)
    ap.add_argument("--db", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.mode == "client":
        _client_main(a)
        return {}
    tmp = Path(tempfile.mkdtemp(prefix="tunedb-faults-"))
    source = make_source(tmp / "source.duckdb", a.suite, a.workloads)
    single(tmp / "single.duckdb", source, a.suite, a.workloads)
    expected = rows(tmp / "single.duckdb")
    client, lc = open_client("local", a.workers, f"replay:{source}")
    addr = client.scheduler.address
    result: dict[str, Any] = {"argv": portable_argv(sys.argv), "git_commit": git_sha(), "suite": a.suite,
                              "workloads": a.workloads, "workers": a.workers, "pace_s": a.pace,
                              "rows_expected": len(expected)}
    try:
        clean = tmp / "clean.duckdb"
        cluster_collect(client, clean, source, a.suite, a.workloads)
        got = rows(clean)
        result["distributed_equals_single"] = {"rows": len(got), "equal": got == expected}
        _save(a.json, result)
        sections = set(a.sections.split(","))
        trials = range(a.trials)
        wk = [worker_kill_trial(s, client, source, tmp, expected, a.suite, a.workloads, a.pace)
              for s in trials if "worker" in sections]
        result["worker_sigkill"] = {"trials": len(wk), **_summary(wk, ["lost", "duplicates", "equal",
                                                                       "given_up_batches", "during_run"]),
                                    "detail": wk}
        _save(a.json, result)
        tc = [two_collectors_trial(s, addr, source, tmp, expected, a.suite, a.workloads)
              for s in trials if "two" in sections]
        keys = ["refused", "one_line", "lost", "duplicates", "equal", "first_running"]
        result["two_collectors"] = {"trials": len(tc), **_summary(tc, keys),
                                    "errors": sorted({t["error"].replace(str(tmp), "<tmp>")
                                                      for t in tc if t["error"]}),
                                    "detail": [{k: v for k, v in t.items() if k != "error"} for t in tc]}
        _save(a.json, result)
        ck = [client_kill_trial(s, addr, source, tmp, expected, a.suite, a.workloads, a.pace, client=client)
              for s in trials if "client" in sections]
        result["client_sigkill"] = {"trials": len(ck), **_summary(ck, ["lost", "duplicates", "equal"]),
                                    "killed_mid_run": sum(0 < t["committed_at_kill"] < len(expected)
                                                          for t in ck),
                                    "detail": ck}
        _save(a.json, result)
    finally:
        client.close()
        lc.close()
    v2 = json.loads((ROOT / "data" / "fusion_h200_v2_collect_summary.json").read_text())
    per_candidate = v2["elapsed_s"] / v2["measured"]  # one H200's collector, wall time per candidate
    if a.scale:
        result["scaling"] = {"per_candidate_s": round(per_candidate, 5),
                             "single_gpu_rate_per_s": v2["rate_per_s"],
                             "curve": scaling(source, tmp, [int(w) for w in a.scale.split(",")],
                                              per_candidate, a.suite, a.workloads)}
    print_table(result)
    _save(a.json, result)
    return result


def print_table(result: dict) -> None:
    """The figures of a result (also of one merged from runs of separate sections)."""
    print(f"{'fault':<16}{'trials':>7}{'lost':>6}{'dups':>6}{'equal':>7}  notes")
    c, w, t = result["client_sigkill"], result["worker_sigkill"], result["two_collectors"]
    print(f"{'client SIGKILL':<16}{c['trials']:>7}{c['lost']:>6}{c['duplicates']:>6}{c['equal']:>7}  "
          f"{c['killed_mid_run']} kills with part committed")
    print(f"{'worker SIGKILL':<16}{w['trials']:>7}{w['lost']:>6}{w['duplicates']:>6}{w['equal']:>7}  "
          f"{w['during_run']} kills during the run, {w['given_up_batches']} batches given up")
    print(f"{'two collectors':<16}{t['trials']:>7}{t['lost']:>6}{t['duplicates']:>6}{t['equal']:>7}  "
          f"{t['refused']} refused with a one-line error ({t['first_running']} while the first ran)")
    for r in result.get("scaling", {}).get("curve", []):
        print(f"scaling: {r['workers']} workers {r['rate_per_s']:.1f} candidates/s ({r['speedup']}x)")


def _save(path: Path | None, result: dict) -> None:
    """Written after every section: a long run cut short keeps what it measured."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Scale-out on Dask (benchmarks/scaleout.py): workers generate the same code the client would, a
LocalCluster of 4 replay workers stores the quick suite's rows of one process, and the simulated
scaling curve's parts (recorded times per candidate, the ideal schedule, paced replay workers)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest
from bench_scripts import load_script

from collectors.fusion import FusionCollector

pytest.importorskip("distributed")
scaleout = load_script("scaleout")


def test_workers_rebuild_the_code_the_client_would() -> None:
    coll = FusionCollector()
    job = next(iter(coll.jobs("quick")))
    for config, spec in job.specs[:40]:
        assert coll.build(job.workload, coll.spec_from_config(job.workload, config)) == \
            coll.build(job.workload, spec)


def test_recorded_durations_share_each_commit_interval() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    at = [t0, t0 + dt.timedelta(seconds=4), t0 + dt.timedelta(seconds=4), t0 + dt.timedelta(seconds=10)]
    d = scaleout.recorded_durations([("a", at[0]), ("b", at[1]), ("c", at[2]), ("d", at[3])])
    assert d == {"a": pytest.approx(10 / 3), "b": 2.0, "c": 2.0, "d": 6.0}


def test_ideal_schedule_gives_each_batch_to_the_first_free_worker() -> None:
    assert scaleout.simulate([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert scaleout.simulate([1.0] * 8, 4) == 2.0
    assert scaleout.simulate([2.0, 2.0, 5.0], 1) == 9.0


def test_bad_shard_is_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        scaleout.main(["rows", "--shard", "3/2"])
    assert e.value.code == 2 and "--shard '3/2'" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_suite_on_four_workers_equals_one_process(tmp_path: Path) -> None:
    r = scaleout.compare_rows("quick", 4, tmp_path)
    single, cluster = r["single"]["contents"], r["cluster"]["contents"]
    assert all(r["equal"].values()), r["equal"]
    assert single["measurements"] > 200 and single["duplicates"] == 0 and single["without_source_hash"] == 0
    assert cluster["candidates"] == r["cluster"]["summary"]["total"]
    assert r["cluster"]["remote_build"] and len(r["cluster"]["workers"]) == 4


@pytest.mark.slow
def test_a_paced_worker_takes_each_candidates_time(tmp_path: Path) -> None:
    faults = load_script("faults")
    source = faults.make_source(tmp_path / "source.duckdb", "quick", 1)
    from tunedb.store import TuningStore

    with TuningStore.open(source, read_only=True) as store:
        wl = store.con.execute("SELECT hash, family, name, graph_json FROM workloads").fetchone()
        got = store.con.execute("SELECT candidate_hash FROM measurements LIMIT 6").fetchall()
    hashes = [h for (h,) in got]
    workload = json.dumps(dict(zip(["hash", "family", "name", "graph_json"], wl, strict=True)))
    requests = json.dumps([{"candidate_hash": h} for h in hashes])
    from tunedb.collect.dask_backend import measure_batch

    measure_batch(f"replay:{source}", workload, requests)  # opens the device
    t = time.monotonic()
    reply = json.loads(measure_batch(f"replay:{source}", workload, requests, [0.1, 0.0, 0.2, 0.0, 0.0, 0.1]))
    assert time.monotonic() - t >= 0.4  # a lower bound: the sleeps happened
    assert [r["status"] for r in reply["results"]] and all(r is not None for r in reply["results"])


@pytest.mark.slow
def test_recorded_curve_stores_the_same_rows_on_one_and_two_workers(tmp_path: Path) -> None:
    r = scaleout.curve([1, 2], tmp_path, time_scale=0.02, workloads=3)
    one, two = r["points"]
    assert r["candidates"] > 100 and r["workloads"] == 3
    for p in (one, two):
        assert p["candidates"] == r["candidates"] and p["missing"] == 0 and p["duplicates"] == 0
        assert p["ideal_s"] > 0 and p["client_cpu_ms_per_candidate"] > 0
    assert one["rows_digest"] == two["rows_digest"] and len(two["per_worker"]) == 2
    assert one["ideal_s"] == pytest.approx(r["recorded_device_s"], rel=1e-6)


DAEMON = "__import__('multiprocessing').current_process().daemon"


@pytest.mark.slow
def test_local_workers_may_start_processes_and_daemonic_ones_say_why_not(tmp_path: Path) -> None:
    import dask
    from distributed import Client, LocalCluster

    from tunedb.collect.dask_backend import ClusterError, open_client, run_cluster
    from tunedb.store import SharedWriter

    client, lc = open_client("local", 1, "emu")
    try:  # a GPU device runs its measurements and compiles in child processes
        assert list(client.run(eval, DAEMON).values()) == [False]
    finally:
        client.close()
        lc.close()
    with dask.config.set({"distributed.worker.daemon": True}), \
            LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as lc, Client(lc) as c:
        assert list(c.run(eval, DAEMON).values()) == [True]
        with SharedWriter(tmp_path / "x.duckdb") as store, pytest.raises(ClusterError) as e:
            run_cluster(FusionCollector(), store, c, "cuda", "quick")
    msg = str(e.value)
    assert "\n" not in msg and "daemonic" in msg and "DASK_DISTRIBUTED__WORKER__DAEMON=False" in msg


def test_a_batch_that_fails_on_the_cluster_is_one_line() -> None:
    from tunedb.collect.dask_backend import batch_error

    msg = batch_error(RuntimeError("Error during deserialization of the task graph. This frequently\n"
                                   "occurs if the Scheduler and Client have different environments."))
    assert "\n" not in msg and "install tunedb" in msg and "scheduler" in msg
    msg = batch_error(OSError("disk\nfull"))
    assert msg == "a batch failed on the Dask cluster: OSError: disk full"


@pytest.mark.slow
def test_two_batch_threads_per_worker_store_the_rows_of_one_process(tmp_path: Path) -> None:
    # GPU workers run two batches at once: one measures, the next generates code and compiles.
    faults = load_script("faults")
    source = faults.make_source(tmp_path / "source.duckdb", "quick", 3)
    faults.single(tmp_path / "single.duckdb", source, "quick", 3)
    expected = faults.rows(tmp_path / "single.duckdb")
    from tunedb.collect.dask_backend import open_client

    client, lc = open_client("local", 2, f"replay:{source}", threads=2)
    try:
        assert sorted(client.nthreads().values()) == [2, 2]
        s = faults.cluster_collect(client, tmp_path / "two.duckdb", source, "quick", 3, pace_s=0.002)
    finally:
        client.close()
        lc.close()
    assert faults.rows(tmp_path / "two.duckdb") == expected
    assert s.remote_build and s.killed_batches == 0 and s.measured == len(expected)

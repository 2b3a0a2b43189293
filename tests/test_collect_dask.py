"""Collection on a Dask LocalCluster of 4 worker processes, each a replay device over a source
replayed from the shipped data: the rows equal a single-process collection's; resume, a batch that
kills its workers, a worker and a client killed at seeded points (the 20x repetitions are in
benchmarks/faults.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_script
from cli_apps import collect_app
from typer.testing import CliRunner

pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
N_WORKLOADS = 3


def _faults() -> ModuleType:
    return load_script("faults")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    f = _faults()
    tmp = tmp_path_factory.mktemp("dask")
    source = f.make_source(tmp / "source.duckdb", "quick", N_WORKLOADS)
    f.single(tmp / "single.duckdb", source, "quick", N_WORKLOADS)
    expected = f.rows(tmp / "single.duckdb")
    assert expected, "the replay source yields rows"
    client, lc = f.open_client("local", 4, f"replay:{source}")
    yield f, tmp, source, expected, client
    client.close()
    lc.close()


@pytest.mark.slow
def test_four_workers_store_the_rows_of_one_process(setup) -> None:
    f, tmp, source, expected, client = setup
    db = tmp / "four.duckdb"
    s = f.cluster_collect(client, db, source, "quick", N_WORKLOADS)
    got = f.rows(db)
    assert got == expected  # candidate hashes, device, status and generated source hash
    assert s.measured == len(expected) and s.killed_batches == 0
    assert len(s.workers) == 4 and sum(s.workers.values()) == s.measured + s.missing


@pytest.mark.slow
def test_resume_after_a_budget_measures_nothing_twice(setup) -> None:
    f, tmp, source, expected, client = setup
    db = tmp / "resume.duckdb"
    first = f.cluster_collect(client, db, source, "quick", N_WORKLOADS, budget=40)
    assert first.measured + first.missing == 40
    second = f.cluster_collect(client, db, source, "quick", N_WORKLOADS)
    assert second.already == 40
    got = f.rows(db)
    assert f.duplicates(got) == 0 and sorted(got) == sorted(expected)


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_no_batch(setup) -> None:
    f, tmp, source, expected, client = setup
    r = f.worker_kill_trial(3, client, source, tmp, expected, "quick", N_WORKLOADS, pace_s=0.03,
                            window_s=1.0)
    assert r["lost"] == 0 and r["duplicates"] == 0 and r["equal"] and r["given_up_batches"] == 0


@pytest.mark.slow
def test_a_client_killed_mid_run_loses_no_committed_row(setup) -> None:
    f, tmp, source, expected, client = setup
    r = f.client_kill_trial(5, client.scheduler.address, source, tmp, expected, "quick", N_WORKLOADS)
    assert r["lost"] == 0 and r["duplicates"] == 0 and r["equal"]


@pytest.mark.slow
def test_a_batch_that_kills_two_workers_becomes_failure_rows(setup) -> None:
    f, tmp, source, expected, client = setup
    by_workload: dict[str, int] = {}
    from tunedb.store import TuningStore

    with TuningStore.open(source, read_only=True) as store:
        for (w,) in store.con.execute("SELECT c.workload_hash FROM measurements m JOIN candidates c "
                                      "ON c.hash = m.candidate_hash").fetchall():
            by_workload[w] = by_workload.get(w, 0) + 1
    poison = min(by_workload, key=by_workload.get)
    db = tmp / "poison.duckdb"
    s = f.cluster_collect(client, db, source, "quick", N_WORKLOADS, chunk=1024, kill_workloads=(poison,))
    assert s.killed_batches == 1
    with TuningStore.open(db, read_only=True) as store:
        bad = store.con.execute("SELECT m.status, m.error FROM measurements m JOIN candidates c ON "
                                "c.hash = m.candidate_hash WHERE c.workload_hash = ?", [poison]).fetchall()
        others = store.con.execute("SELECT count(*) FROM measurements m JOIN candidates c ON c.hash = "
                                   "m.candidate_hash WHERE c.workload_hash <> ?", [poison]).fetchone()
    assert bad and all(st == "runtime_error" and "killed" in err for st, err in bad)
    assert others[0] == len(expected) - by_workload[poison]
    client.wait_for_workers(4, timeout=120)


def test_cluster_option_errors_are_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(collect_app(), ["collect", "--suite", "quick", "--db", str(tmp_path / "x.duckdb"),
                                         "--device", "replay:nowhere", "--cluster", "nohost"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == ["error: --cluster 'nohost': expected 'local' or a scheduler "
                                             "address such as tcp://HOST:8786"]
    r = CliRunner().invoke(collect_app(), ["collect", "--suite", "quick", "--db", str(tmp_path / "x.duckdb"),
                                         "--device", "replay:nowhere", "--cluster", "local",
                                         "--strategy", "random"])
    assert r.exit_code == 2 and "exhaustive strategy only" in r.output

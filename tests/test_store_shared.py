"""SharedWriter (the collector's store: the file held only while it writes) and the runs
housekeeping of tunedb.store.runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_store_helpers import fill, make_data

from tunedb.records import Measurement, Run
from tunedb.store import SharedWriter, StoreError, TuningStore
from tunedb.store.runs import ABANDONED, close_abandoned_runs, drop_run_if_empty

ROOT = Path(__file__).resolve().parents[1]


def test_one_writer_and_readers_between_commits(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    with SharedWriter(path, linger_s=0.05) as w:
        fill(w, make_data(n_workloads=2, configs=3))
        holder = rf"being written by another tunedb process \(pid {os.getpid()} on "
        with pytest.raises(StoreError, match=holder):  # the refusal names the holder
            SharedWriter(path)
        time.sleep(0.3)  # past the linger: the file is free for another process
        code = ("import sys\nfrom tunedb.store import TuningStore\n"
                "print(TuningStore.open(sys.argv[1], read_only=True).counts()['measurements'])")
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        assert int(r.stdout) == w.counts()["measurements"] > 0
        with pytest.raises(AttributeError):
            w.con  # noqa: B018 - no connection outlives a call
    with SharedWriter(path) as again:  # free once the first writer closed
        assert again.path == path and not again.read_only


def test_abandoned_runs_are_closed_and_empty_ones_dropped(tmp_path: Path) -> None:
    path = tmp_path / "r.duckdb"
    data = make_data(n_workloads=1, configs=2)
    with TuningStore.open(path) as store:
        fill(store, data)
        store.add_runs([Run("killed", "fusion", "0.1.0", "", "h", "{}", "2026-01-01T00:00:00+00:00"),
                        Run("empty", "fusion", "0.1.0", "", "h", "{}", "2026-01-02T00:00:00+00:00"),
                        Run("nothing", "fusion", "0.1.0", "", "h", "{}", "2026-01-03T00:00:00+00:00",
                            "2026-01-03T00:01:00+00:00")])
        store.add_measurements([Measurement(data.candidates[0].hash, data.devices[0].id, "killed", "ok",
                                            (1.0, 2.0))])
        finished = {r.id: r for r in store.runs() if r.finished_at}
    with SharedWriter(path) as w:
        assert w.apply(close_abandoned_runs) == 2
        assert w.apply(drop_run_if_empty, "nothing") and not w.apply(drop_run_if_empty, "killed")
        runs = {r.id: r for r in w.runs()}
    assert "empty" not in runs and "nothing" not in runs
    assert runs["killed"].finished_at and runs["killed"].clocks_after == ABANDONED
    for rid, r in finished.items():
        if rid != "nothing":
            assert runs[rid] == r  # finished runs are untouched

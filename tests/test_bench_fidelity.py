"""``python -m tunedb.bench.fidelity`` on real DuckDB files: drift of candidates measured twice."""

from __future__ import annotations

import json
from dataclasses import replace

from test_store_helpers import fill, make_data

from tunedb.bench.fidelity import fidelity, main
from tunedb.bench.provenance import portable_argv
from tunedb.store import TuningStore


def _db(path, d):
    with TuningStore.open(path) as s:
        fill(s, d)
    return path


def test_drift_of_shared_candidates(tmp_path, capsys):
    d = make_data(n_workloads=2, configs=10, runs=range(1))
    stored = _db(tmp_path / "stored.duckdb", d)
    later = make_data(n_workloads=2, configs=10, runs=range(1))
    # the later run: 10 % slower on every candidate, and half of them not re-measured
    ms = [replace(m, samples_us=tuple(x * 1.1 for x in m.samples_us)) for m in later.measurements]
    later.measurements = ms[::2]
    r = fidelity(_db(tmp_path / "later.duckdb", later), stored)
    ok = [m for m in later.measurements if m.status == "ok"]
    assert r["pairs"] == len(ok) > 0
    g = r["groups"]["all"]
    assert abs(g["median_abs_drift_pct"] - 10.0) < 0.01 and abs(g["median_signed_drift_pct"] - 10.0) < 0.01
    assert r["groups"]["ge_20us"]["n"] + r["groups"]["lt_20us"]["n"] == r["pairs"]
    out = tmp_path / "fid.json"
    assert main([str(tmp_path / "later.duckdb"), str(stored), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["pairs"] == r["pairs"]
    given = [str(tmp_path / "later.duckdb"), str(stored), "--out", str(out)]
    assert written["argv"][1:] == portable_argv(given)  # no folder of this machine in the file
    assert "git_commit" in written
    capsys.readouterr()


def test_no_overlap_is_a_one_line_error(tmp_path, capsys):
    a = _db(tmp_path / "a.duckdb", make_data(n_workloads=1, configs=3, runs=range(1)))
    b = TuningStore.open(tmp_path / "b.duckdb")
    b.close()
    assert main([str(a), str(tmp_path / "b.duckdb")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no candidate is verified in both" in err[0]

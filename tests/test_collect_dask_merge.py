"""Databases collected on several hosts merge into one: ``tunedb db merge A B C`` and ``db import``
of several exports, de-duplicating on natural keys (a copy of a host's file adds nothing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bench_scripts import load_script
from typer.testing import CliRunner

from tunedb.cli import app
from tunedb.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]


def _faults():
    return load_script("faults")


def _counts(db: Path) -> dict[str, int]:
    with TuningStore.open(db, read_only=True) as s:
        return s.counts()


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_merge_and_import_of_several_hosts(tmp_path: Path) -> None:
    f = _faults()
    source = f.make_source(tmp_path / "source.duckdb", "quick", 4)
    host_a, host_b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    f.single(host_a, source, "quick", 1)  # host A: the first workload
    f.single(host_b, source, "quick", 4)  # host B: all four (another run)
    copy_a = tmp_path / "a_copy.duckdb"
    shutil.copy(host_a, copy_a)
    a, b = _counts(host_a), _counts(host_b)
    assert a["measurements"] > 0 and b["measurements"] > a["measurements"]

    merged = tmp_path / "all.duckdb"
    r = CliRunner().invoke(app, ["db", "merge", str(host_a), str(host_b), str(copy_a),
                                      "--db", str(merged), "--json"])
    assert r.exit_code == 0, r.output
    added = json.loads(r.output)
    m = _counts(merged)
    assert added["measurements"] == m["measurements"] == a["measurements"] + b["measurements"]
    assert m["candidates"] == b["candidates"] and m["workloads"] == b["workloads"]
    assert m["runs"] == a["runs"] + b["runs"]
    r = CliRunner().invoke(app, ["db", "merge", str(host_b), str(host_a), "--db", str(merged), "--json"])
    assert r.exit_code == 0 and sum(json.loads(r.output).values()) == 0  # nothing twice

    exports = []
    for host in (host_a, host_b):
        out = tmp_path / f"export_{host.stem}"
        with TuningStore.open(host, read_only=True) as s:
            s.export_parquet(out)
        exports.append(str(out))
    imported = tmp_path / "imported.duckdb"
    r = CliRunner().invoke(app, ["db", "import", *exports, exports[0], "--db", str(imported), "--json"])
    assert r.exit_code == 0, r.output
    assert _counts(imported) == m

    r = CliRunner().invoke(app, ["db", "merge", str(host_a), str(tmp_path / "nope.duckdb"),
                                      "--db", str(tmp_path / "fresh.duckdb")])
    assert r.exit_code == 1 and "nope.duckdb" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "fresh.duckdb").exists()  # checked before anything was written

"""Collection end to end on CPU: replay stored measurements into a fresh DuckDB file; resume,
budget, no duplicates; the ``collect`` command's errors without a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_apps import collect_app
from typer.testing import CliRunner

from tunedb.collect import Collector, Job, load_collector
from tunedb.graph.builder import GraphBuilder
from tunedb.records import Candidate, DeviceInfo, Measurement, Protocol, Run, Workload
from tunedb.runtime import ReplayDevice, ReplayError, open_device
from tunedb.runtime.results import MeasureRequest, MeasureResult
from tunedb.store import TuningStore

DEVICE = DeviceInfo("Replay H200", "abc123", "9.0", 132, 50 << 20, 141 << 30, "13.0", "13.0", "14.0.0")


def _graphs() -> list[tuple[str, Any]]:
    out = []
    for n in (64, 128):
        b = GraphBuilder(f"softmax_{n}")
        out.append(("softmax", b.build([b.softmax(b.input("x", (8, n)))])))
        b = GraphBuilder(f"bias_relu_{n}")
        out.append(("eltwise", b.build([b.relu(b.add(b.input("x", (8, n)), b.input("b", (n,))))])))
    return out


class ToyCollector(Collector):
    """Four workloads x three block sizes; the plans are never run (replay)."""

    name = "toy"
    kind = "fusion"

    def jobs(self, suite: str):
        for family, g in _graphs():
            w = Workload.from_graph(g, family, g.name)
            yield Job(w, [({"block": bs}, bs) for bs in (64, 128, 256)], pruned=2)

    def build(self, workload: Workload, spec: Any) -> tuple[str, dict]:
        if spec == 256 and workload.family == "eltwise":
            raise RuntimeError("unsupported")  # code-generation failure -> compile_error
        return f"src-{workload.hash[:8]}-{spec}", {"kernels": []}


def _seed_store(path: Path) -> dict[str, Measurement]:
    """A stored dataset: every toy candidate but the block-64 ones, mixed statuses."""
    coll = ToyCollector()
    run = Run("seedrun", "toy", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00+00:00")
    stored: dict[str, Measurement] = {}
    with TuningStore.open(path) as db:
        db.add_devices([DEVICE])
        db.add_runs([run])
        for job in coll.jobs("toy"):
            db.add_workloads([job.workload])
            cands = [Candidate(job.workload.hash, "fusion", cfg, f"src-{cfg['block']}")
                     for cfg, _ in job.specs]
            db.add_candidates(cands)
            ms = []
            for c in cands:
                if c.config_dict["block"] == 64:
                    continue
                if c.config_dict["block"] == 256 and job.workload.family == "softmax":
                    m = Measurement(c.hash, DEVICE.id, run.id, "incorrect", error="max abs error 1")
                else:
                    samples = tuple(10.0 + i + c.config_dict["block"] / 100 for i in range(10))
                    m = Measurement(c.hash, DEVICE.id, run.id, "ok", samples, registers=32, shared_bytes=0,
                                    local_bytes=0, protocol_json=Protocol(batch=4).to_json())
                ms.append(m)
                stored[c.hash] = m
            db.add_measurements(ms)
    return stored


@pytest.fixture()
def dataset(tmp_path: Path) -> tuple[Path, Path, dict[str, Measurement]]:
    db = tmp_path / "seed.duckdb"
    stored = _seed_store(db)
    export = tmp_path / "export"
    with TuningStore.open(db, read_only=True) as s:
        s.export_parquet(export)
    return db, export, stored


def test_replay_collection_round_trip_resume_and_budget(dataset, tmp_path: Path) -> None:
    _, export, stored = dataset
    dev = open_device(f"replay:{export}")
    assert isinstance(dev, ReplayDevice) and dev.info == DEVICE and len(dev) == len(stored) == 8
    coll = ToyCollector()
    seen: list[int] = []
    with TuningStore.open(tmp_path / "a.duckdb") as db:
        s = coll.run(db, dev, "toy", budget=5, progress=lambda s: seen.append(s.measured), flush_every=2)
        assert s.measured + s.missing == 5 and s.stopped == "budget"
        assert s.total == 12 and s.pruned == 8 and s.workloads == 4
        assert seen == sorted(seen) and seen[-1] == s.measured
        s2 = coll.run(db, dev, "toy")  # resume: only what the first run did not measure
        assert s2.already == s.measured and s2.measured == 8 - s.measured
        s3 = coll.run(db, dev, "toy")
        assert s3.measured == 0 and s3.already == 8 and s3.missing == 4
        rows = db.measurements(device_id=DEVICE.id)
        runs = db.runs()
        counts = db.counts()
    assert len(rows) == 8 and len({m.candidate_hash for m in rows}) == 8  # no duplicates
    for m in rows:
        old = stored[m.candidate_hash]
        assert (m.status, m.samples_us, m.error, m.registers, m.protocol_json) == \
               (old.status, old.samples_us, old.error, old.registers, old.protocol_json)
    assert {m.status for m in rows} == {"ok", "incorrect"}
    assert len(runs) == 3 and all(r.finished_at for r in runs) and runs[0].collector == "toy"
    assert counts["workloads"] == 4 and counts["devices"] == 1


def test_replay_from_a_database_file_and_time_limit(dataset, tmp_path: Path) -> None:
    db_path, _, stored = dataset
    dev = ReplayDevice(db_path)
    with TuningStore.open(tmp_path / "b.duckdb") as db:
        s = ToyCollector().run(db, dev, "toy", time_s=0.0)
        assert s.measured == 0 and s.stopped == "time"
        s = ToyCollector().run(db, dev, "toy", chunk=1)
        assert s.measured == len(stored) and s.ok == 6 and s.statuses["incorrect"] == 2


def test_replay_errors(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="does not exist"):
        ReplayDevice(tmp_path / "nope")
    with TuningStore.open(tmp_path / "empty.duckdb"):
        pass
    with pytest.raises(ReplayError, match="no devices"):
        ReplayDevice(tmp_path / "empty.duckdb")
    with pytest.raises(ValueError, match="unknown device"):
        open_device("tpu")


def test_bad_device_results_become_failures() -> None:
    p = Protocol()
    m = MeasureResult.from_wire({"status": "ok", "samples_us": []}).to_measurement("c", "d", "r", p)
    assert m.status == "runtime_error" and "no timing samples" in m.error
    m = MeasureResult.from_wire({"status": "weird"}).to_measurement("c", "d", "r", p)
    assert m.status == "runtime_error" and "weird" in m.error
    m = MeasureResult.from_wire({"status": "ok", "samples_us": [2.0, 1.0], "protocol": {
        "warmup": 1, "samples": 2, "flush_l2": True, "batch": 8}}).to_measurement("c", "d", "r", p)
    assert m.status == "ok" and json.loads(m.protocol_json)["batch"] == 8
    # Without a protocol of its own a result is recorded under the device's.
    m = MeasureResult("ok", (3.0,)).to_measurement("c", "d", "r", Protocol(samples=1))
    assert json.loads(m.protocol_json)["samples"] == 1
    # A failed result keeps no samples, and the error text is bounded.
    m = MeasureResult("incorrect", (1.0,), "x" * 10_000).to_measurement("c", "d", "r", p)
    assert m.samples_us == () and len(m.error) == 4000


def test_measure_records_cross_the_worker_pipe_unchanged() -> None:
    res = MeasureResult("ok", (1.5, 2.5), "", 32, 1024, 0, Protocol(batch=4).to_json(), {"time_s": 0.1})
    wire = json.loads(json.dumps(res.to_wire()))
    assert MeasureResult.from_wire(wire) == res
    assert MeasureResult.from_wire({**wire, "_restart": True}).restart
    req = MeasureRequest("h", {"kernels": [{"source": "k", "name": "f"}]})
    assert req.to_wire() == {"kernels": [{"source": "k", "name": "f"}], "candidate_hash": "h"}
    bad = req.failed("nvrtc: error")
    assert bad.to_wire()["error"] == "nvrtc: error" and bad.kernels == req.kernels


def test_unknown_collector_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="unknown collector 'nope'; known: .*fusion"):
        load_collector("nope")
    assert load_collector("fusion").name == "fusion"


def test_collect_without_gpu_is_a_one_line_error(tmp_path: Path) -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    r = CliRunner().invoke(collect_app(), ["collect", "--suite", "quick", "--db", str(tmp_path / "x.duckdb")])
    assert r.exit_code == 1
    out = r.output.strip()
    assert out.startswith("error: no CUDA device: CuPy is not installed") and "\n" not in out
    r = CliRunner().invoke(collect_app(), ["collect", "--suite", "quick", "--device",
                                           f"replay:{tmp_path / 'no'}", "--db", str(tmp_path / "x.duckdb")])
    # A --device value that names nothing usable is a usage error (exit 2, as click's own).
    assert r.exit_code == 2 and r.output.strip().startswith("error: replay data")
    assert "does not exist" in r.output


@pytest.mark.slow
def test_fusion_collect_replay_cli_on_the_quick_suite(tmp_path: Path) -> None:
    """Store synthetic-but-valid measurements for quick-suite candidates, export, then
    ``tunedb collect --device replay:DIR`` into a fresh database, twice (resume)."""
    coll = load_collector("fusion")
    jobs = list(coll.jobs("quick"))
    assert jobs and all(j.specs for j in jobs)
    seed = tmp_path / "seed.duckdb"
    n = 0
    with TuningStore.open(seed) as db:
        db.add_devices([DEVICE])
        db.add_runs([Run("r0", "fusion", "0.1.0", "", "h", "{}", "2026-01-01T00:00:00+00:00")])
        for job in jobs:
            db.add_workloads([job.workload])
            specs = job.specs[:3]
            cands = [Candidate(job.workload.hash, "fusion", cfg, coll.build(job.workload, spec)[0])
                     for cfg, spec in specs]
            db.add_candidates(cands)
            db.add_measurements([Measurement(c.hash, DEVICE.id, "r0", "ok", (5.0 + i, 5.5 + i, 6.0 + i))
                                 for i, c in enumerate(cands)])
            n += len(cands)
        db.export_parquet(tmp_path / "exp")
    args = ["collect", "--suite", "quick", "--device", f"replay:{tmp_path / 'exp'}",
            "--db", str(tmp_path / "fresh.duckdb"), "--json"]
    r = CliRunner().invoke(collect_app(), args)
    assert r.exit_code == 0, r.output
    first = json.loads(r.output.strip().splitlines()[-1])
    assert first["measured"] == n and first["ok"] == n
    assert first["missing"] == first["total"] - n
    r = CliRunner().invoke(collect_app(), args)
    second = json.loads(r.output.strip().splitlines()[-1])
    assert second["measured"] == 0 and second["already"] == n
    with TuningStore.open(tmp_path / "fresh.duckdb", read_only=True) as db:
        assert db.counts()["measurements"] == n

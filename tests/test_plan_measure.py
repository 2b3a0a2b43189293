"""``compile(..., measure_top=K)`` records what it measured: replay the shipped H200 measurements
(data/fusion_h200) into fresh DuckDB files, then plan again on them and get exact DB hits; failed
results are stored too; nothing is measured or stored twice; a read-only store is never written;
a corrupt database is a one-line error that leaves the file as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tunedb.graph.builder import GraphBuilder
from tunedb.plan import compile
from tunedb.plan.measure import renamed
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload
from tunedb.runtime import ReplayDevice
from tunedb.store import StoreError, TuningStore

ROOT = Path(__file__).resolve().parents[1]
H200_DATA = ROOT / "data" / "fusion_h200_v2"
REPLAY = f"replay:{H200_DATA}"
DEVICE = DeviceInfo("Replay H200", "uuid-m", "9.0", 132, 60 * 2**20, 141 * 2**30, "580", "13.0", "14.2")


def projected_softmax():
    """A projection, then the ``softmax_262144x128`` anchor (x * 0.125 + m, softmax): the fused
    step is a workload of the shipped H200 collection, named differently there."""
    b = GraphBuilder("proj_softmax")
    x, w, m = b.input("x", (262144, 64)), b.input("w", (64, 128)), b.input("m", (128,))
    return b.build([b.softmax(b.add(b.mul(b.matmul(x, w), 0.125), m))])


def fused(plan):
    steps = [s for s in plan.steps if s.kind == "fused"]
    assert len(steps) == 1
    return steps[0]


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_measurements_from_the_shipped_replay_are_stored_and_hit_next_time(tmp_path):
    g = projected_softmax()
    db = tmp_path / "fresh.duckdb"
    p = compile(g, db=db, measure_top=4, measure_device=REPLAY)
    search = dict(p.search)
    assert search["measured"] == search["stored"] == 4
    step = fused(p)
    replay = ReplayDevice(H200_DATA)
    with TuningStore.open(db, read_only=True) as s:
        counts = s.counts()
        (run,) = s.runs()
        rows = s.measurements()
        wl = s.workload(step.workload_hash)
        cands = {c.hash: c for c in s.candidates()}
    assert counts["devices"] == 1 and counts["workloads"] == 1 and counts["measurements"] == 4
    assert run.collector == "plan" and run.finished_at and run.host
    cfg = json.loads(run.config_json)
    assert cfg["measure_top"] == 4 and cfg["device"] == "replay" and cfg["graph"] == "proj_softmax"
    # The workload row is the collection's (its family and name), not a copy under new names.
    assert (wl.family, wl.name) == ("softmax", "softmax_262144x128")
    for m in rows:  # every stored row is the replayed one, on the replayed device, in this run
        old = replay.lookup(m.candidate_hash)
        assert old is not None and m.run_id == run.id and m.device_id == replay.info.id
        assert (m.status, m.samples_us) == (old.status, old.samples_us)
        assert cands[m.candidate_hash].source_hash  # the generated kernel's source hash
    medians = [sorted(m.samples_us)[len(m.samples_us) // 2] for m in rows if m.status == "ok"]
    assert step.measured_us == min(medians)

    again = compile(g, db=db, device=replay.info.id)  # the device of the stored rows
    hit = fused(again)
    assert hit.cost_source == "db" and hit.workload_hash == step.workload_hash
    assert hit.predicted_us == pytest.approx(min(m.median_us for m in rows if m.status == "ok"))
    assert dict(again.search)["db_hits"] >= 1

    third = compile(g, db=db, measure_top=4, measure_device=REPLAY)  # a DB hit: nothing to measure
    assert dict(third.search)["measured"] == dict(third.search)["stored"] == 0
    with TuningStore.open(db, read_only=True) as s:
        assert s.counts() == counts


def _replay_of_step(path: Path, step, statuses: dict[int, str]) -> dict[str, Measurement]:
    """Replay data for the step's top-ranked configs: ``statuses[rank]`` overrides ok."""
    from tunedb.plan.cost import Coster
    from tunedb.plan.subgraph import GraphIndex

    coster = Coster(GraphIndex(step.graph))
    nodes = tuple(range(len(step.graph.nodes)))
    ranked = coster.choose_schedule(nodes, coster.group(nodes)).ranked
    wl = Workload.from_graph(step.graph, "softmax", "replayed")
    run = Run("seed", "fusion", "0.1.0", "", "host", "{}", "2026-01-01T00:00:00Z")
    out = {}
    with TuningStore.open(path) as s:
        s.add_devices([DEVICE])
        s.add_runs([run])
        s.add_workloads([wl])
        cands = [Candidate(wl.hash, "fusion", cfg, "src") for _, cfg in ranked[:8]]
        s.add_candidates(cands)
        for rank, c in enumerate(cands):
            st = statuses.get(rank, "ok")
            if st == "ok":
                # Faster than the roofline of any split, so that a DB hit keeps the group whole.
                samples = tuple(1.0 + rank / 10 + i / 100 for i in range(5))
                m = Measurement(c.hash, DEVICE.id, run.id, "ok", samples)
            else:
                m = Measurement(c.hash, DEVICE.id, run.id, st, error=f"{st} at rank {rank}")
            out[c.hash] = m
        s.add_measurements(list(out.values()))
    return out


def small_softmax():
    b = GraphBuilder("small")
    x, w, bias = b.input("x", (32, 64)), b.input("w", (64, 128)), b.input("b", (128,))
    return b.build([b.softmax(b.add(b.matmul(x, w), bias))])


def test_failed_results_are_stored_and_nothing_is_measured_twice(tmp_path):
    g = small_softmax()
    step = fused(compile(g, device="generic"))
    replay = tmp_path / "replay.duckdb"
    seeded = _replay_of_step(replay, step, {0: "incorrect", 1: "compile_error", 2: "runtime_error"})
    db = tmp_path / "t.duckdb"
    p = compile(g, db=db, measure_top=4, measure_device=f"replay:{replay}")
    assert dict(p.search)["stored"] == 4
    # Ranks 0-2 failed: the one correct schedule measured (rank 3) is chosen.
    assert fused(p).measured_us == pytest.approx(1.32)
    with TuningStore.open(db, read_only=True) as s:
        rows = s.measurements()
    assert sorted(m.status for m in rows) == ["compile_error", "incorrect", "ok", "runtime_error"]
    for m in rows:
        assert (m.status, m.error, m.samples_us) == (seeded[m.candidate_hash].status,
                                                     seeded[m.candidate_hash].error,
                                                     seeded[m.candidate_hash].samples_us)
    # Rank 3 is an ok DB hit now: the search takes it, and there is nothing left to measure.
    q = compile(g, db=db, device=DEVICE.id, measure_top=6, measure_device=f"replay:{replay}")
    assert fused(q).cost_source == "db" and fused(q).predicted_us == pytest.approx(1.32)
    assert dict(q.search)["measured"] == 0
    with TuningStore.open(db, read_only=True) as s:
        assert len(s.measurements()) == 4 and len(s.runs()) == 1


def test_all_failed_top_k_is_not_measured_again(tmp_path):
    g = small_softmax()
    step = fused(compile(g, device="generic"))
    replay = tmp_path / "replay.duckdb"
    _replay_of_step(replay, step, {0: "incorrect", 1: "incorrect"})
    db = tmp_path / "t.duckdb"
    p = compile(g, db=db, measure_top=2, measure_device=f"replay:{replay}")
    assert dict(p.search)["stored"] == 2 and fused(p).measured_us is None
    assert "no measured schedule ran" in fused(p).note
    # No ok row: the next plan has no DB hit and ranks the same two again; both are known.
    q = compile(g, db=db, measure_top=2, measure_device=f"replay:{replay}")
    assert fused(q).cost_source != "db"
    assert dict(q.search)["measured"] == dict(q.search)["stored"] == 0
    with TuningStore.open(db, read_only=True) as s:
        assert s.counts()["measurements"] == 2 and len(s.runs()) == 1
    # Top 4: the two stored failures are reused, only ranks 2 and 3 are measured (in a new run).
    r = compile(g, db=db, measure_top=4, measure_device=f"replay:{replay}")
    assert dict(r.search)["measured"] == dict(r.search)["stored"] == 2
    assert fused(r).measured_us == pytest.approx(1.22)
    with TuningStore.open(db, read_only=True) as s:
        rows = s.measurements()
        assert len(rows) == len({m.candidate_hash for m in rows}) == 4 and len(s.runs()) == 2


def test_a_read_only_store_is_never_written(tmp_path):
    g = small_softmax()
    step = fused(compile(g, device="generic"))
    replay = tmp_path / "replay.duckdb"
    _replay_of_step(replay, step, {})
    db = tmp_path / "t.duckdb"
    with TuningStore.open(db):
        pass  # an initialised, empty database
    with TuningStore.open(db, read_only=True) as store:
        p = compile(g, db=store, measure_top=3, measure_device=f"replay:{replay}")
        assert fused(p).measured_us == pytest.approx(1.02)
        assert dict(p.search)["measured"] == 3 and dict(p.search)["stored"] == 0
        assert store.counts()["measurements"] == 0
    p = compile(g, measure_top=3, measure_device=f"replay:{replay}")  # no database at all
    assert dict(p.search)["stored"] == 0 and fused(p).measured_us == pytest.approx(1.02)


def test_renamed_maps_the_stitch_names_and_keeps_them_sorted():
    cfg = {"block": 128, "stitch": "v1:recompute;v2:shuffle;x0:register"}
    assert renamed(cfg, {"v1": "v2", "v2": "v3", "x0": "a"})["stitch"] == "a:register;v2:recompute;v3:shuffle"
    assert renamed(cfg, {}) is cfg
    assert renamed({"block": 64}, {"x": "y"}) == {"block": 64}


def _cli(*args: str, tmp_path: Path):
    from tunedb.cli import app

    env = {"TUNEDB_DB": None, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    return CliRunner().invoke(app, list(args), env=env)


@pytest.mark.slow
def test_cli_plan_measure_top_reports_what_it_stored(tmp_path):
    model = tmp_path / "proj_softmax.json"
    model.write_text(json.dumps(projected_softmax().to_json()))
    db = tmp_path / "cli.duckdb"
    args = ("plan", str(model), "--db", str(db), "--measure-top", "3", "--measure-device", REPLAY)
    res = _cli(*args, tmp_path=tmp_path)
    assert res.exit_code == 0, res.output
    assert res.stderr.strip() == f"measured 3 schedule(s); stored 3 measurement(s) in {db}"
    assert "fused" in res.stdout and "(meas " in res.stdout
    res = _cli(*args, tmp_path=tmp_path)
    assert res.exit_code == 0 and "stored 0 measurement(s)" in res.stderr
    res = _cli("plan", str(model), "--db", str(db), "--device", ReplayDevice(H200_DATA).info.id,
               tmp_path=tmp_path)
    assert res.exit_code == 0 and "db" in res.stdout.split("cost sources:")[1]
    # Without --db the measurements go to the default database, created like collect creates it.
    res = _cli("plan", str(model), "--measure-top", "2", "--measure-device", REPLAY, tmp_path=tmp_path)
    default = tmp_path / "xdg" / "tunedb" / "tunedb.duckdb"
    assert res.exit_code == 0 and res.stderr.strip().endswith(f"stored 2 measurement(s) in {default}")
    with TuningStore.open(default, read_only=True) as s:
        assert s.counts()["measurements"] == 2


def test_a_corrupt_database_is_a_one_line_error_and_stays_as_it_was(tmp_path):
    bad = tmp_path / "bad.duckdb"
    junk = b"this is not a database\n" * 512
    bad.write_bytes(junk)
    with pytest.raises(StoreError, match="not a tunedb database"):
        compile(small_softmax(), db=bad, measure_top=2, measure_device=REPLAY)
    model = tmp_path / "small.json"
    model.write_text(json.dumps(small_softmax().to_json()))
    res = _cli("plan", str(model), "--db", str(bad), "--measure-top", "2", "--measure-device", REPLAY,
               tmp_path=tmp_path)
    assert res.exit_code == 1
    assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1
    assert "not a tunedb database" in res.output and "Traceback" not in res.output
    assert bad.read_bytes() == junk

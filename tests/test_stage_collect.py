"""``tunedb collect --collector stage``: stage candidates on the collection engine, replayed on the
CPU from stored H200 rows into a real DuckDB file (failures and unmeasured stages included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collectors.stage import StageCollector, import_rows
from tunedb.cli import app
from tunedb.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]
H200_ROWS = ROOT / "data" / "bench" / "stages_h200_v2_rows.json"
ENV = {"TUNEDB_DB": None, "XDG_DATA_HOME": None}


def _collect(*args: str):
    return CliRunner().invoke(app, ["collect", "--collector", "stage", *args, "--json"], env=ENV)


def _by_candidate(db: Path) -> dict[str, tuple]:
    with TuningStore.open(db, read_only=True) as store:
        return {m.candidate_hash: (m.status, m.samples_us) for m in store.measurements()}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """SqueezeNet b1's stored stages as the suite; the stored data has one as a failure and
    lacks one (never measured)."""
    tmp = tmp_path_factory.mktemp("stage_collect")
    doc = json.loads(H200_ROWS.read_text())
    case = doc["cases"]["squeezenet1_1_b1"]
    suite = tmp / "candidates.json"
    suite.write_text(json.dumps({"cases": {"squeezenet1_1_b1": case}}))
    rows = [dict(r) for r in case["rows"]]
    rows[0] = {"groups": rows[0]["groups"], "key": rows[0]["key"], "status": "runtime_error",
               "message": "cudaErrorLaunchFailure: unspecified launch failure"}
    stored = tmp / "stored.json"
    stored.write_text(json.dumps({"device": doc["device"], "device_info": doc.get("device_info"),
                                  "cases": {"squeezenet1_1_b1": {"plan": case["plan"], "rows": rows[:-1]}}}))
    source = tmp / "h200.duckdb"
    import_rows(stored, source)
    return suite, source, tmp


def test_the_stage_collector_replays_stored_stages_into_a_database(suite):
    suite_file, source, tmp = suite
    jobs = list(StageCollector().jobs(str(suite_file)))
    n = sum(len(j.specs) for j in jobs)
    assert n > 10 and len(jobs) <= n  # one job per member set; its groupings are its candidates
    db = tmp / "replayed.duckdb"
    res = _collect("--suite", str(suite_file), "--device", f"replay:{source}", "--db", str(db))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["total"], out["measured"], out["missing"]) == (n, n - 1, 1)
    assert out["statuses"] == {"ok": n - 2, "runtime_error": 1}
    got, want = _by_candidate(db), _by_candidate(source)
    assert len(got) == n - 1 and all(got[h] == want[h] for h in got)  # every row, failure included
    with TuningStore.open(db, read_only=True) as store:
        kinds = store.con.execute("SELECT DISTINCT kind FROM candidates").fetchall()
        collectors = store.con.execute("SELECT DISTINCT collector FROM runs").fetchall()
    assert kinds == [("stage",)] and collectors == [("stage",)]
    # run again: resumed, nothing measured twice
    again = json.loads(_collect("--suite", str(suite_file), "--device", f"replay:{source}",
                                "--db", str(db)).stdout)
    assert (again["already"], again["measured"], again["missing"]) == (n - 1, 0, 1)


@pytest.mark.parametrize("args, says", [
    (["--suite", "no-such-file.json", "--device", "replay:{source}"], "not a file"),
    (["--suite", "{bad}", "--device", "replay:{source}"], "not a stage candidates file"),
    (["--suite", "{suite}", "--device", "emu"], "no CPU emulation"),
])
def test_the_stage_collector_refuses_bad_input_in_one_line(suite, args, says):
    suite_file, source, tmp = suite
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"cases": {"g": {"rows": []}}}))
    db = tmp / "refused.duckdb"
    args = [a.format(source=source, bad=bad, suite=suite_file) for a in args]
    res = _collect(*args, "--db", str(db))
    assert res.exit_code != 0
    err = res.stderr.strip()
    assert says in err and "\n" not in err, err
    if db.exists():
        assert _by_candidate(db) == {}

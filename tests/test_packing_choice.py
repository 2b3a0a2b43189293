"""tunedb.bench.packing_choice: the packing model's pick in a bench case, found among the rows
the bench timed (the shipped H200 bench JSON), and the CLI that re-reads a bench JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunedb.bench.packing_choice import main, model_choice, summarize_choice
from tunedb.kernels.packing import PackingWorkload

BENCH = Path(__file__).resolve().parent.parent / "data" / "bench" / "packing_extra_h200.json"


def _case(name: str) -> dict:
    return next(r for r in json.loads(BENCH.read_text())["results"] if r["case"] == name)


def likes(name: str):
    def predict(w, cands):
        return [10.0 if c.name == name else 100.0 for c in cands]
    return predict


def test_the_models_pick_is_timed_in_the_same_pass():
    res = _case("replicas_r20_256x128x1152_float32")
    w = PackingWorkload.from_json(res["workload"])
    row = next(r for r in res["rows"] if r["variant"] == "whole:splitk3")
    got = summarize_choice(res, model_choice(w, res["rows"], likes("whole:splitk3")))
    assert got["variant"] == "whole:splitk3" and got["median_us"] == row["median_us"]
    peer = min(r["median_us"] for r in res["rows"] if r["system"] != "tunedb" and r["status"] == "ok")
    assert got["speedup_vs_best_peer"] == pytest.approx(peer / row["median_us"])
    assert got["over_best_candidate"] >= 1.0
    # a pick predicted to gain under 5 % over serial is serial (what a plan would run)
    flat = model_choice(w, res["rows"],
                        lambda w, cs: [100.0 if c.name == "whole:serial" else 97.0 for c in cs])
    assert flat["variant"] == "whole:serial"


def test_the_cli_reads_a_bench_json_with_the_shipped_model(tmp_path, capsys):
    out = tmp_path / "choice.json"
    assert main(["--bench", str(BENCH), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert len(doc["cases"]) == len(json.loads(BENCH.read_text())["results"]) and "| case |" in table
    assert all("median_us" in c for c in doc["cases"])  # every pick was timed and verified
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["--bench", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


DATA = BENCH.parent.parent / "packing_h200"


@pytest.mark.slow  # reads the shipped export: about 5 s
def test_the_database_pick_takes_an_exact_hits_measured_best_else_the_model():
    """``db_choice``: the stored best of a workload the export has measured (R = 120 fp32: the
    model's regression order puts ``padded`` first, the stored rows ``chunks128``), timed in the
    bench's pass; a workload the export lacks gets the model's pick; a stored workload listing
    its members in another order offers only whole-set candidates."""
    from dataclasses import replace

    from tunedb.bench.packing import render
    from tunedb.bench.packing_choice import db_choice, export_times
    from tunedb.kernels.packing_suites import bench_cases

    times = export_times(DATA)
    res = _case("replicas_r120_256x128x1152_float32")
    w = PackingWorkload.from_json(res["workload"])
    stored = times(w)
    best = min(stored, key=stored.get)
    assert best.startswith("whole:") and stored[best] < 0.95 * stored["whole:padded"]
    got = db_choice(w, res["rows"], times, likes("whole:padded"))
    row = next(r for r in res["rows"] if r["variant"] == best)
    assert (got["variant"], got["source"], got["median_us"]) == (best, "db", row["median_us"])
    assert got["stored_us"] == stored[best]
    unseen = replace(w, members=w.members[:-1])  # R = 119: not in the database
    assert times(unseen) == {}
    assert db_choice(unseen, res["rows"], times, likes("whole:padded")) == {
        **model_choice(unseen, res["rows"], likes("whole:padded")), "source": "model"}
    wm = next(c for c in bench_cases() if c.name.startswith("resnet18_b1_t4"))
    flipped = replace(wm, members=wm.members[::-1])
    assert flipped.hash == wm.hash and any(not n.startswith("whole:") for n in times(wm))
    assert times(flipped) and all(n.startswith("whole:") for n in times(flipped))
    table = render([{**res, "db_choice": summarize_choice(res, got),
                     "duel": {"choices_over_best_peer": {best: 1.25}}}])
    assert f"{best} (db)" in table and "1.25x" in table

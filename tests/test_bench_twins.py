"""The knob A/B's choice of schedules (CPU side of ``tunedb.bench.twins``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tunedb.bench.twins import twin_jobs

BENCH = Path(__file__).resolve().parents[1] / "data" / "bench" / "fusion_h200_board5.json"


def test_twin_jobs_pair_each_case_s_fastest_distinct_finalists():
    bench = json.loads(BENCH.read_text())
    jobs = twin_jobs(bench, "stream")
    cases = [c["case"] for c in bench["cases"]]
    assert [c for c, _ in jobs[::4]] == cases  # two schedules, each off then on, per case
    for (c0, off), (c1, on) in zip(jobs[0::2], jobs[1::2]):
        assert c0 == c1 and not off.stream and on.stream and off == replace(on, stream=False)
    first = bench["cases"][0]["tunedb"]["finalists"]
    fastest = min((f for f in first if f.get("us")), key=lambda f: f["us"])
    assert jobs[0][1].to_config() == {k: v for k, v in fastest["config"].items()}
    # swizzled twins of one finalist collapse to one plain schedule when the knob is swizzle
    sw = twin_jobs(bench, "swizzle", per_case=5)
    for case in cases:
        offs = [s for c, s in sw[0::2] if c == case]
        assert offs and len(offs) == len(set(offs)) and not any(s.swizzle for s in offs)


def test_twin_jobs_refuse_a_knob_that_is_not_a_boolean_field():
    for knob in ("vec", "nonsense"):
        with pytest.raises(ValueError, match="not a boolean schedule knob"):
            twin_jobs({"cases": []}, knob)

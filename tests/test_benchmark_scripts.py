"""The CPU side of the one-off studies in benchmarks/ (run there as scripts, not shipped in the
wheel): the placement bench's pad sizes, summary and errors; the knob A/B's choice of schedules;
the col_center exploration kernel compiling for sm_90."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


placement = load_script("placement")
MIB, main, pad_sizes, spread = placement.MIB, placement.main, placement.pad_sizes, placement.spread
twin_jobs = load_script("twins").twin_jobs

def test_pad_sizes_are_distinct_unaligned_and_reproducible():
    pads = pad_sizes(8, seed=3)
    assert pads[0] == 0 and len(set(pads)) == 8
    assert all(MIB <= p < 769 * MIB and (p // 4096) % 2 == 1 for p in pads[1:])
    assert pads == pad_sizes(8, seed=3) and pads != pad_sizes(8, seed=4)


def test_spread():
    s = spread([100.0, 102.0, 101.0])
    assert (s["min"], s["median"], s["max"]) == (100.0, 101.0, 102.0)
    assert s["spread_pct"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        spread([])


def test_case_without_a_schedule_is_refused(tmp_path, capsys):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"cases": [{"case": "rmsnorm_8192x4096", "tunedb": {"us": None}}]}))
    assert main([str(bench), str(tmp_path / "out"), "--cases", "rmsnorm_8192x4096"]) == 2
    assert "no tunedb schedule for rmsnorm_8192x4096" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main([str(bench), str(tmp_path / "out"), "--placements", "1"])


def test_bad_inputs_get_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), str(tmp_path / "out")]) == 2
    assert "is not a readable `tunedb bench fusion` result" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "out")]) == 2
    assert "FileNotFoundError" in capsys.readouterr().err
    ok = tmp_path / "b.json"
    ok.write_text(json.dumps({"cases": []}))
    assert main([str(ok), str(tmp_path / "out"), "--cases", "nope_1x1"]) == 2
    assert "not an anchor case: nope_1x1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_col_center_stream_exploration_kernel_compiles_for_sm90(tmp_path):
    SRC = load_script("col_center_stream").SRC

    cu = tmp_path / "colc.cu"
    cu.write_text(SRC)
    for w, h, lag in ((128, 64, 2), (512, 32, 1)):
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", f"-DWW={w}", f"-DHH={h}", f"-DLL={lag}",
               "-cubin", "-o", str(tmp_path / "colc.cubin"), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

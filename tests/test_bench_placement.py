"""The placement bench's CPU side: pad sizes, the spread summary, bad arguments."""

import json

import pytest

from tunedb.bench.placement import MIB, main, pad_sizes, spread


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

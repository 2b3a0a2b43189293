"""benchmarks/kernel_source_digest.py: one line per generable schedule, the plan's source hash
on it, and a one-line error for an unknown suite."""

from __future__ import annotations

from bench_scripts import load_script

from tunedb.kernels.codegen import generate
from tunedb.kernels.suites import suite
from tunedb.runtime.emu import generable_schedules

digest = load_script("kernel_source_digest")


def test_one_line_per_schedule_with_its_source_hash(tmp_path, capsys):
    out = tmp_path / "lines.txt"
    assert digest.main(["--suites", "quick", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    cases = suite("quick")
    assert len(lines) == sum(len(generable_schedules(c.graph)) for c in cases)
    assert capsys.readouterr().out.startswith(f"{len(lines)} lines  sha256 ")
    first = cases[0]
    schedules = generable_schedules(first.graph)
    hashes = [generate(first.graph, s).source_hash for s in schedules]
    assert lines[:len(schedules)] == [ln for ln in lines if ln.startswith(f"quick {first.name} ")]
    for line, s, h in zip(lines, schedules, hashes):
        assert line.startswith(f"quick {first.name} {s!r} {h} ")
    assert len(set(hashes)) > 1  # the schedules of one case differ in their sources


def test_unknown_suite_is_a_one_line_error(capsys):
    assert digest.main(["--suites", "quick,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite(s) ['nope']" in err and err.count("\n") == 1

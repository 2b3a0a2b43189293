"""benchmarks/step_variants.py on the CPU: the variants it would time for a window step and a
GroupNorm step of the generalization suite, and its one-line refusals."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import ROOT, load_script

SCRIPT = str(ROOT / "benchmarks" / "step_variants.py")


def test_a_strided_window_step_gets_every_strip_and_the_rule_picks_one():
    sv = load_script("step_variants")
    (st,) = sv.step_variants("windowed_mobilenet_v2_b16_c67d3d81", "window")
    assert list(st["variants"]) == ["strip1", "strip2", "strip4", "strip2_rowbranch", "plane1", "plane4"]
    assert st["chosen"] == "strip1"  # the rule: one output a thread at stride 2
    assert len({p.source_hash for p in st["variants"].values()}) == 6
    # e5983d8's kernel re-made: the branch around each row instead of the row predicate
    rb = st["variants"]["strip2_rowbranch"].kernels[0].source
    assert "if (ih < 0 || ih >= 56) continue;" in rb and "const bool rin = true;" in rb
    assert "if (ih < 0" not in st["variants"]["strip2"].kernels[0].source
    assert st["variants"]["plane1"].kernels[0].shared_bytes == 56 * 56 * 4
    assert "float acc[4];" in st["variants"]["strip4"].kernels[0].source


@pytest.mark.slow  # plans a UNet GroupNorm and generates its schedules: ~6 s
def test_a_groupnorm_step_gets_distinct_row_schedules():
    sv = load_script("step_variants")
    (st,) = sv.step_variants("norm_unet_640x16_b8_2d0edf97", "rows")
    labels = list(st["variants"])
    # a variant equal to the planned kernel is not listed twice: since the row split needs
    # rows of 128 KB, this GroupNorm's planned kernel is the block-per-row one itself
    assert labels[0] == "planned"
    assert "block_per_row" in labels or st["config"]["mapping"] == "block_per_row"
    assert any(lbl.startswith("split_row") for lbl in labels) or st["config"]["mapping"] == "split_row"
    assert len({p.source_hash for p in st["variants"].values()}) == len(labels)
    # the planned kernel at other block sizes (it takes 512 threads since 4a9b89a): its block
    others = {lbl: p.kernels[0] for lbl, p in st["variants"].items() if lbl.startswith("planned_b")}
    assert st["config"]["block"] == 512 and "planned_b256" in others
    for lbl, k in others.items():
        b = int(lbl[len("planned_b"):])
        assert k.block == (b, 1, 1) and f"__launch_bounds__({b})" in k.source


@pytest.mark.parametrize("arg,why", [("no_such_workload", "no such workload"),
                                     ("norm_unet_640x16_b8_2d0edf97:cols", "expected :window")])
def test_bad_names_get_one_line_errors(tmp_path, monkeypatch, arg, why):
    sv = load_script("step_variants")
    monkeypatch.setattr(sys, "argv", [SCRIPT, str(tmp_path / "o.json"), arg])
    with pytest.raises(SystemExit) as e:
        sv.main()
    assert why in str(e.value) and "\n" not in str(e.value)  # sys.exit(text): exit status 1
    assert not (tmp_path / "o.json").exists()

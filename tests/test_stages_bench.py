"""The stage bench's command line: help, bad arguments and a missing GPU are one-line answers
before any GPU work; identical plans are recognised by their digest."""

from __future__ import annotations

import importlib.util

import pytest

from tunedb.bench.stages import main, plan_digest


@pytest.mark.parametrize("args, needle", [
    (["--peers=torch_compile,bogus"], "--peers names one of"),
    (["--oracle=some"], "--oracle must be"),
    (["--only=squeezenet1_1_b1,bogus"], "--only names a case of"),
    (["--refine=resnet"], "--refine names a case of"),
    (["--merge=ios_merge,all"], "--merge names one of"),
    (["--rounds=0"], "--rounds must be a positive int"),
    (["--budget-s=soon"], "--budget-s must be a positive float"),
    (["--peer"], "unknown argument '--peer'"),
    (["--peers-only"], "--peers-only needs --peers"),
])
def test_bad_arguments_are_refused_with_one_line(tmp_path, capsys, args, needle):
    out = tmp_path / "out.json"
    assert main([str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_without_a_gpu(capsys, flag):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert "python -m tunedb.bench.stages OUT.json" in out and "--rounds" in out


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="a GPU stack is installed")
def test_a_missing_gpu_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main([str(out), "--only=randwire_b1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no GPU") and "\n" not in err and "Traceback" not in err
    assert not out.exists() and not out.with_name("out_rows.json").exists()


def test_plan_digest_is_what_runs_not_how_the_weights_arrive():
    from tunedb.graph.multibranch import randwire_graph
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.plan.merge import bind_constants
    from tunedb.runtime.inputs import input_roles, make_inputs

    graph = randwire_graph(1)
    dev, _ = make_inputs(graph, 3)
    roles = input_roles(graph)
    bound = bind_constants(graph, dev, [v for v in graph.inputs if roles.get(v, ("data", 0))[0] != "data"])
    ios = compile_plan(graph, device="cuda", schedule="ios", bias_epilogue=True)
    ios_bound = compile_plan(bound, device="cuda", schedule="ios", bias_epilogue=True)
    sequential = compile_plan(graph, device="cuda", schedule="sequential", bias_epilogue=True)
    assert len(ios_bound.graph.inputs) < len(ios.graph.inputs)  # the weights are constants there
    assert plan_digest(ios_bound) == plan_digest(ios)
    assert plan_digest(sequential) != plan_digest(ios)
    # one stage split in two is another plan
    from tunedb.plan.stages import apply_stages

    wide = next(k for k, st in enumerate(ios.stages) if len(st) > 1)
    split = list(ios.stages[:wide]) + [(g,) for g in ios.stages[wide]] + list(ios.stages[wide + 1:])
    assert plan_digest(apply_stages(ios, split, {})) != plan_digest(ios)

"""``tunedb plan --schedule``."""

from __future__ import annotations

import json

from tunedb.graph.builder import GraphBuilder
from tunedb.plan.record import Plan


def _branchy_graph():
    b = GraphBuilder("branches")
    x = b.input("x", (1, 16, 12, 12))
    outs = []
    for k in range(3):
        w = b.input(f"w{k}", (16, 16, 3, 3))
        outs.append(b.relu(b.conv2d(x, w, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), groups=1)))
    return b.build([b.concat(*outs, axis=1)])


def test_cli_plan_schedule_option(tmp_path):
    from typer.testing import CliRunner

    from tunedb.cli import app

    path = tmp_path / "g.json"
    path.write_text(json.dumps(_branchy_graph().to_json()))
    env = {"TUNEDB_DB": None, "XDG_DATA_HOME": str(tmp_path / "xdg")}  # no default database
    res = CliRunner().invoke(app, ["plan", str(path), "--device", "generic", "--model", "none",
                                   "--schedule", "ios", "--json"], env=env)
    assert res.exit_code == 0, res.output
    assert Plan.from_json(res.output).stages
    bad = CliRunner().invoke(app, ["plan", str(path), "--schedule", "fast"], env=env)
    assert bad.exit_code != 0 and "--schedule" in bad.output


def test_cli_plan_merge_option_explains_the_merges(tmp_path):
    from typer.testing import CliRunner

    from tests.test_merge import fire
    from tunedb.cli import app

    path = tmp_path / "fire.json"
    path.write_text(json.dumps(fire().to_json()))
    env = {"TUNEDB_DB": None, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    args = ["plan", str(path), "--device", "generic", "--model", "none", "--schedule", "ios"]
    res = CliRunner().invoke(app, [*args, "--merge", "on"], env=env)
    assert res.exit_code == 0, res.output
    assert "merged convolutions: 1" in res.output
    plain = CliRunner().invoke(app, args, env=env)
    assert plain.exit_code == 0 and "merged convolutions" not in plain.output
    bad = CliRunner().invoke(app, [*args, "--merge", "maybe"], env=env)
    assert bad.exit_code != 0 and "--merge" in bad.output

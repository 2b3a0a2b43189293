"""The cost model a plan uses when it is given none: the registry's model for the device's GPU
(the shipped H200 model here), else roofline prices."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tunedb.cli import app
from tunedb.kernels.schedule import Schedule
from tunedb.kernels.suites import suite
from tunedb.plan import compile
from tunedb.records import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models"
ANCHORS = {c.name: c for c in suite("anchors")}
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", "uuid-a100", "8.0", 108, 40 * 2**20, 80 * 2**30, "580", "13.0",
                  "14.2")


@pytest.fixture
def shipped_default(monkeypatch):
    monkeypatch.delenv("TUNEDB_MODELS")


def _fused(plan):
    fused = [s for s in plan.steps if s.kind == "fused"]
    assert len(fused) == 1
    return fused[0]


def test_without_a_model_the_plan_uses_the_shipped_one(shipped_default):
    g = ANCHORS["transpose_add_8192x4096"].graph
    p = compile(g, device="generic")
    step = _fused(p)
    assert dict(p.search)["cost_model"] == "CostModel" and step.cost_source == "model"
    assert dict(step.config)["mapping"] == "transpose_tiled"
    r = compile(g, device="generic", cost_model=False)
    assert dict(r.search)["cost_model"] == "" and _fused(r).cost_source == "roofline"
    # a GPU the registry has no model for is priced by the roofline
    assert _fused(compile(g, device=A100)).cost_source == "roofline"


@pytest.mark.slow
def test_default_picks_are_near_the_best_measured_schedule(shipped_default):
    # every anchor's default pick against the best of its schedules as timed on the H200
    # (data/bench/fusion_h200.json: each case's whole space, one board). The model learnt from
    # these workloads: this guards the default path and the shipped model, it is no held-out score
    bench = json.loads((ROOT / "data/bench/fusion_h200.json").read_text())
    ratios = {}
    for case in bench["cases"]:
        measured = {label: us for label, status, us, _ in case["tunedb"]["attempts"] if status == "ok"}
        step = _fused(compile(ANCHORS[case["case"]].graph, device="generic"))
        picked = measured[Schedule.from_config(dict(step.config)).label()]
        ratios[case["case"]] = picked / min(measured.values())
    geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    assert len(ratios) == 12 and geomean <= 1.05 and max(ratios.values()) <= 1.15, ratios


def test_models_env_chooses_the_registry(monkeypatch, tmp_path):
    g = ANCHORS["rmsnorm_8192x4096"].graph
    monkeypatch.setenv("TUNEDB_MODELS", str(tmp_path))  # an empty registry: no model
    assert _fused(compile(g, device="generic")).cost_source == "roofline"
    shutil.copytree(SHIPPED / "nvidia-h200", tmp_path / "nvidia-h200")
    assert _fused(compile(g, device="generic")).cost_source == "model"
    # a stale default model (another feature schema) is skipped with a warning, not an error
    card = tmp_path / "nvidia-h200/fusion/card.json"
    data = json.loads(card.read_text())
    data["feature_schema_version"] = -1
    card.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="default cost model not used.*feature schema"):
        p = compile(g, device="generic")
    assert _fused(p).cost_source == "roofline"


def test_cli_plan_default_model_and_model_none(tmp_path):
    path = tmp_path / "rmsnorm.json"
    path.write_text(json.dumps(ANCHORS["rmsnorm_8192x4096"].graph.to_json()))
    env = {"TUNEDB_DB": None, "XDG_DATA_HOME": str(tmp_path / "xdg"), "TUNEDB_MODELS": None,
           "COLUMNS": "200"}
    res = CliRunner().invoke(app, ["plan", str(path), "--device", "generic"], env=env)
    assert res.exit_code == 0, res.output
    assert "cost sources: model 1" in res.output
    res = CliRunner().invoke(app, ["plan", str(path), "--device", "generic", "--model", "none"], env=env)
    assert res.exit_code == 0, res.output
    assert "cost sources: roofline 1" in res.output

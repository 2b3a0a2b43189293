"""The wheel is the library: built from the source tree, installed into a fresh virtual
environment, it plans a graph with the cost model it ships (no source tree, no $TUNEDB_MODELS)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# Studies and data tools that live outside the package (benchmarks/), not in the wheel.
NOT_SHIPPED = ("tunedb/bench/twins.py", "tunedb/bench/placement.py", "tunedb/bench/col_center_stream.py",
               "tunedb/costmodel/bench_train.py", "benchmarks/", "tests/", "data/")


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the fresh venv it is installed in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy: an in-tree build leaves build/ behind, whose stale files a later
    # build would ship.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("tunedb", "collectors", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(dist), str(src)])
    (whl,) = dist.glob("tunedb-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                   .stdout.strip())
    # The dependencies (numpy, duckdb, xgboost, ...) come from this environment, appended after
    # the venv's own site-packages; its .pth files (an editable tunedb) are not run.
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
          str(whl)])
    return whl, venv


def test_wheel_ships_the_models_and_no_studies(installed: tuple[Path, Path]) -> None:
    whl, _ = installed
    names = zipfile.ZipFile(whl).namelist()
    assert "tunedb/models/nvidia-h200/fusion/model.ubj" in names
    assert "tunedb/models/nvidia-h200/fusion/card.json" in names
    packing = {f"tunedb/models/nvidia-h200/packing/{f}" for f in ("card.json", "model.ubj", "rank.ubj")}
    assert packing <= set(names)
    assert "collectors/fusion.py" in names and "tunedb/collect/engine.py" in names
    shipped = [n for n in names if n.startswith(NOT_SHIPPED)]
    assert not shipped, f"one-off studies or test files in the wheel: {shipped}"


def test_installed_wheel_plans_with_its_shipped_model(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = installed
    work = tmp_path / "elsewhere"  # outside the source tree: nothing can be found next to it
    work.mkdir()
    graph = work / "bert_layer.onnx"
    shutil.copy2(ROOT / "data" / "graphs" / "bert_layer.onnx", graph)
    env = {k: v for k, v in os.environ.items() if k not in ("TUNEDB_MODELS", "TUNEDB_DB", "PYTHONPATH")}
    env.update(XDG_DATA_HOME=str(work / "xdg"), HOME=str(work))
    where = _run([str(venv / "bin" / "python"), "-c",
                  "import tunedb; from tunedb.costmodel.registry import default_models_root; "
                  "from tunedb.collect import load_collector; print(tunedb.__file__); "
                  "print(default_models_root()); print(load_collector('fusion').name)"],
                 cwd=work, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv) and Path(where[1]).is_relative_to(venv), where
    assert where[2] == "fusion"
    r = _run([str(venv / "bin" / "tunedb"), "plan", str(graph), "--device", "generic", "--json"],
             cwd=work, env=env)
    plan = json.loads(r.stdout)
    fused = [s for s in plan["steps"] if s["kind"] == "fused"]
    assert fused and all(s["cost_source"] == "model" for s in fused), [s["cost_source"] for s in fused]

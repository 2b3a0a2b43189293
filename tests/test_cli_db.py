"""`tunedb db ...` through typer's CliRunner and a real subprocess: output, exit codes, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import typer
from test_store_helpers import A100, H200, fill, make_data
from typer.testing import CliRunner

from tunedb import cli
from tunedb.cli import app
from tunedb.cli.common import default_db_path, resolve_db
from tunedb.store import SCHEMA_VERSION, TABLES, TuningStore

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str, env: dict[str, str | None] | None = None):
    # Never let the developer's own database leak into a test.
    base = {"TUNEDB_DB": None, "XDG_DATA_HOME": None}
    return runner.invoke(app, list(args), env={**base, **(env or {})})


@pytest.fixture()
def filled(tmp_path) -> Path:
    path = tmp_path / "a.duckdb"
    with TuningStore.open(path) as db:
        fill(db, make_data(n_workloads=3, configs=4, runs=range(2), devices=(H200, A100)))
    return path


def _expected_info(path: Path) -> dict:
    return {
        "path": str(path.resolve()),
        "schema_version": SCHEMA_VERSION,
        "counts": {"devices": 2, "runs": 2, "workloads": 3, "candidates": 12, "measurements": 48,
                   "models": 0},
        "devices": [{"id": d.id, **asdict(d)} for d in sorted((H200, A100), key=lambda d: d.id)],
    }


def test_info_json_is_exact(filled):
    r = invoke("db", "info", "--json", "--db", str(filled))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == json.dumps(_expected_info(filled)) + "\n"
    assert r.stderr == ""
    env = invoke("db", "info", "--json", env={"TUNEDB_DB": str(filled)})
    assert env.exit_code == 0 and json.loads(env.stdout) == _expected_info(filled)
    human = invoke("db", "info", "--db", str(filled))
    assert human.exit_code == 0
    assert "measurements" in human.stdout and "NVIDIA A100" in human.stdout


def test_default_path_follows_xdg_data_home(tmp_path, filled, monkeypatch):
    data_home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_DATA_HOME", str(data_home))
    monkeypatch.delenv("TUNEDB_DB", raising=False)
    assert default_db_path() == data_home / "tunedb" / "tunedb.duckdb"
    assert resolve_db(None) == data_home / "tunedb" / "tunedb.duckdb"
    assert (data_home / "tunedb").is_dir()  # parent created
    monkeypatch.setenv("TUNEDB_DB", str(tmp_path / "env.duckdb"))
    assert resolve_db(None) == tmp_path / "env.duckdb"
    assert resolve_db(tmp_path / "flag.duckdb") == tmp_path / "flag.duckdb"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "share" / "tunedb" / "tunedb.duckdb"

    r = invoke("db", "merge", str(filled), "--json", env={"XDG_DATA_HOME": str(data_home)})
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["measurements"] == 48
    with TuningStore.open(data_home / "tunedb" / "tunedb.duckdb", read_only=True) as db:
        assert db.counts()["measurements"] == 48


def test_export_import_merge_commands(tmp_path, filled):
    out = tmp_path / "exp"
    r = invoke("db", "export", str(out), "--db", str(filled), "--json")
    assert r.exit_code == 0, r.stderr
    counts = json.loads(r.stdout)
    assert counts == _expected_info(filled)["counts"]
    expected_files = sorted([f"{t}.parquet" for t in TABLES] + ["manifest.json"])
    assert sorted(p.name for p in out.iterdir()) == expected_files  # no temp files left behind

    dst = tmp_path / "sub" / "b.duckdb"
    r = invoke("db", "import", str(out), "--db", str(dst), "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == counts
    again = invoke("db", "import", str(out), "--db", str(dst), "--json")
    assert json.loads(again.stdout) == dict.fromkeys(TABLES, 0)
    merged = invoke("db", "merge", str(filled), "--db", str(dst))
    assert merged.exit_code == 0 and "new rows" in merged.stdout
    info = invoke("db", "info", "--json", "--db", str(dst))
    assert json.loads(info.stdout)["counts"] == counts


def test_errors_are_one_line_with_exit_1(tmp_path, filled):
    missing = tmp_path / "missing.duckdb"
    r = invoke("db", "info", "--db", str(missing))
    assert (r.exit_code, r.stdout) == (1, "")
    assert r.stderr.startswith(f"error: database {missing} does not exist (give --db")
    assert r.stderr.count("\n") == 1
    assert not missing.exists()

    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(os.urandom(4096))
    r = invoke("db", "info", "--json", "--db", str(junk))
    assert r.exit_code == 1
    assert r.stderr == f"error: {junk} is not a tunedb database (not a DuckDB file or corrupt)\n"

    r = invoke("db", "import", str(tmp_path / "nowhere"), "--db", str(tmp_path / "c.duckdb"))
    assert r.exit_code == 1 and r.stderr == f"error: {tmp_path / 'nowhere'} does not exist\n"
    assert not (tmp_path / "c.duckdb").exists()  # a failed import leaves no new database
    r = invoke("db", "merge", str(junk), "--db", str(filled))
    assert r.exit_code == 1 and "Traceback" not in r.output and r.stderr.count("\n") == 1


def test_every_command_has_help_with_an_example():
    for cmd in ("info", "export", "import", "merge"):
        r = invoke("db", cmd, "--help")
        assert r.exit_code == 0
        assert "Example: tunedb db " + cmd in r.stdout
        assert "--db" in r.stdout and "TUNEDB_DB" in r.stdout
    assert invoke("--version").stdout == "tunedb 0.1.0\n"


def _commands(target: typer.Typer, prefix: tuple[str, ...] = ()):
    for info in target.registered_commands:
        yield prefix + (info.name or info.callback.__name__.replace("_", "-"),), info
    for group in target.registered_groups:
        yield from _commands(group.typer_instance, prefix + (group.name,))


def test_help_paragraphs_are_reflowed_for_the_terminal():
    # typer keeps a docstring's line breaks; the CLI joins each paragraph's lines, so a wide
    # terminal shows every paragraph on one line and a narrow one wraps it evenly
    commands = list(_commands(app))
    assert {("plan",), ("db", "info"), ("bench", "fusion"), ("collect",)} <= {c for c, _ in commands}
    for cmd, info in commands:
        assert "\n" not in info.help.split("\n\n")[0], cmd
        r = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "3000"})
        assert r.exit_code == 0, cmd
        lines = [" ".join(line.split()) for line in r.stdout.splitlines()]
        for para in info.help.split("\n\n"):
            if not para.startswith(("- ", " ")):
                assert " ".join(para.split()) in lines, (cmd, para)
    assert cli.reflow_help("""One line.

        Two
        lines.

        - a bullet
        - another""") == "One line.\n\nTwo lines.\n\n- a bullet\n- another"


def test_every_command_module_registers_and_imports_nothing_heavy():
    # --help and --version pay for what registering the commands imports.
    code = ("import sys, tunedb.cli; "
            "print(sorted(m for m in ('xgboost', 'sklearn', 'duckdb', 'numpy', 'pyarrow', 'onnx') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    names = {c.name for c in cli.app.registered_commands} | {g.name for g in cli.app.registered_groups}
    assert {"db", "collect", "train", "plan", "bench", "report", "suites", "collectors", "models"} <= names
    assert len(cli._COMMAND_MODULES) == len(set(cli._COMMAND_MODULES))


def test_python_dash_m_tunedb(filled):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TUNEDB_DB", None)
    r = subprocess.run([sys.executable, "-m", "tunedb", "db", "info", "--json", "--db", str(filled)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == json.dumps(_expected_info(filled)) + "\n"
    bad = subprocess.run([sys.executable, "-m", "tunedb", "db", "info", "--db", str(filled) + ".nope"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 1 and bad.stderr.startswith(f"error: database {filled}.nope does not exist")
    assert bad.stderr.count("\n") == 1

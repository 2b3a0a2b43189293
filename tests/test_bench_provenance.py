"""Every bench JSON records the command line and the git commit that produced it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tunedb.bench.provenance import git_commit, provenance

ROOT = Path(__file__).resolve().parents[1]


def _head() -> str | None:
    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def test_commit_of_this_checkout(monkeypatch) -> None:
    monkeypatch.delenv("TUNEDB_GIT_COMMIT", raising=False)
    head = _head()
    if head is None:
        pytest.skip("not a git checkout (an sdist or a copy of the tree)")
    commit = git_commit()
    assert commit is not None and commit.removesuffix("-dirty") == head


def test_outside_a_checkout_is_none_or_the_named_commit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TUNEDB_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repo above tmp_path
    assert git_commit(tmp_path) is None
    monkeypatch.setenv("TUNEDB_GIT_COMMIT", "0123abc")
    assert git_commit(tmp_path) == "0123abc"
    assert git_commit() == "0123abc"  # named beats a checkout's own, which may be a stale copy
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all: still no exception
    assert git_commit(tmp_path) == "0123abc"


def test_argv_defaults_to_the_process_and_takes_a_main_argv() -> None:
    import sys

    from tunedb.bench.provenance import portable_argv

    assert provenance()["argv"] == portable_argv(sys.argv)
    p = provenance(["tunedb", "bench", "fusion", "--out", "x.json"])
    assert p["argv"] == ["tunedb", "bench", "fusion", "--out", "x.json"] and "git_commit" in p


def test_recorded_argv_names_no_folder_of_the_machine(tmp_path: Path) -> None:
    """``python -m tunedb`` is recorded as ``tunedb``; absolute paths become relative to the
    working folder, or their file name when outside it."""
    from tunedb.bench.provenance import portable_argv

    argv = [str(ROOT / "tunedb" / "__main__.py"), "bench", "fusion", "--out",
            str(tmp_path / "out" / "fusion.json"), "--db", "/elsewhere/h200.duckdb", "rel/x.onnx"]
    got = portable_argv(argv, cwd=tmp_path)
    assert got == ["tunedb", "bench", "fusion", "--out", "out/fusion.json", "--db", "h200.duckdb",
                   "rel/x.onnx"]

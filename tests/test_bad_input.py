"""Bad input through the real CLI: each case runs ``python -m tunedb`` in a subprocess against a
real DuckDB file and must exit non-zero (2 for usage errors), print exactly one line on stderr
naming the problem, print no traceback, and leave the database unchanged row for row.

The cases follow issue 18 (tracebacks, silent acceptance, destructive defaults, a user's day)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store_helpers import fill, make_data

from tunedb.store import TABLES, TuningStore

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "models" / "nvidia-h200" / "fusion"
GRAPH = ROOT / "data" / "graphs" / "bert_layer.onnx"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEDB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, "COLUMNS": "200", **extra}


def tunedb(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunedb", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=_env(**env), timeout=timeout)


def rows(db: Path) -> dict[str, list]:
    with TuningStore.open(db, read_only=True) as store:
        return {t: sorted(map(repr, store.con.execute(f"SELECT * FROM {t}").fetchall())) for t in TABLES}


def refused(r: subprocess.CompletedProcess, *words: str, code: int | None = None) -> str:
    """The checks every case shares; returns the one stderr line."""
    lines = r.stderr.splitlines()
    assert r.returncode != 0, (r.stdout, r.stderr)
    if code is not None:
        assert r.returncode == code, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr + r.stdout
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "tiny.duckdb"
    with TuningStore.open(path) as store:
        fill(store, make_data(n_workloads=2, configs=3, runs=range(1)))
    return path


@pytest.fixture(scope="module")
def before(db: Path) -> dict[str, list]:
    return rows(db)


@pytest.fixture()
def unchanged(db: Path, before: dict[str, list]):
    yield db
    assert rows(db) == before


@pytest.fixture(scope="module")
def export(db: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exp") / "exp"
    with TuningStore.open(db, read_only=True) as store:
        store.export_parquet(out)
    return out


def _graph_json(path: Path, shape: list, const: dict | None = None) -> Path:
    g = {"name": "g", "inputs": ["x"], "outputs": ["y"],
         "nodes": [{"op": "relu", "inputs": ["x"], "outputs": ["y"], "attrs": {}}],
         "types": {"x": {"shape": shape, "dtype": "float32"}, "y": {"shape": shape, "dtype": "float32"}},
         "constants": const or {}}
    path.write_text(json.dumps(g))
    return path


# -- crashes and tracebacks -----------------------------------------------------------------------
@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
@pytest.mark.parametrize("size", [0, 1000])
def test_empty_or_truncated_model_file(tmp_path: Path, size: int) -> None:
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(SHIPPED_MODEL / "card.json", model / "card.json")
    (model / "model.ubj").write_bytes((SHIPPED_MODEL / "model.ubj").read_bytes()[:size])
    r = tunedb("plan", GRAPH, "--device", "generic", "--model", model, cwd=tmp_path)
    refused(r, "cannot read booster", "model.ubj", code=1)


@pytest.mark.parametrize("cmd", [["train"], ["report"]])
def test_negative_seed_is_a_usage_error(tmp_path: Path, unchanged: Path, cmd: list[str]) -> None:
    r = tunedb(*cmd, "--db", unchanged, "--seed", "-1", cwd=tmp_path)
    refused(r, "--seed", code=2)


def test_unknown_measure_device(tmp_path: Path) -> None:
    r = tunedb("plan", GRAPH, "--measure-device", "nope", cwd=tmp_path)
    refused(r, "--measure-device", "nope", code=2)


def test_export_into_a_missing_parent(tmp_path: Path, unchanged: Path) -> None:
    r = tunedb("db", "export", tmp_path / "no" / "such" / "exp", "--db", unchanged, cwd=tmp_path)
    refused(r, "does not exist", code=1)
    assert not (tmp_path / "no").exists()


def test_export_under_a_file(tmp_path: Path, unchanged: Path) -> None:
    (tmp_path / "f").write_text("x")
    r = tunedb("db", "export", tmp_path / "f" / "exp", "--db", unchanged, cwd=tmp_path)
    refused(r, "cannot export", code=1)


@pytest.mark.parametrize("kind", ["file", "missing-parent"])
def test_train_out_checked_before_training(tmp_path: Path, unchanged: Path, kind: str) -> None:
    out = tmp_path / "file" if kind == "file" else tmp_path / "a-file" / "models"
    (tmp_path / ("file" if kind == "file" else "a-file")).write_text("x")
    t0 = time.monotonic()
    r = tunedb("train", "--db", unchanged, "--out", out, cwd=tmp_path)
    refused(r, "--out", code=2)
    assert time.monotonic() - t0 < 60  # refused up front, not after a training


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_outputs(tmp_path: Path, db: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    copy = tmp_path / "copy.duckdb"
    shutil.copy(db, copy)
    refused(tunedb("train", "--db", copy, "--out", ro / "m", cwd=tmp_path), "not writable", code=2)
    refused(tunedb("report", "--db", copy, "-o", ro / "r.html", cwd=tmp_path), "not writable", code=2)
    copy.chmod(0o444)
    refused(tunedb("train", "--db", copy, "--out", tmp_path / "m", cwd=tmp_path), "not writable", code=2)


def test_report_out_checked_before_the_evaluation(tmp_path: Path, unchanged: Path) -> None:
    r = tunedb("report", "--db", unchanged, "-o", tmp_path / "missing" / "r.html", cwd=tmp_path)
    refused(r, "--out", "does not exist", code=2)


def test_import_of_a_null_in_a_not_null_column(tmp_path: Path, export: Path) -> None:
    bad = tmp_path / "exp"
    shutil.copytree(export, bad)
    t = pq.read_table(bad / "workloads.parquet")
    col = t.schema.get_field_index("family")
    t = t.set_column(col, pa.field("family", pa.string()), pa.array([None] * t.num_rows, pa.string()))
    pq.write_table(t, bad / "workloads.parquet")
    target = tmp_path / "t.duckdb"
    with TuningStore.open(target) as store:
        store.add_devices(make_data(n_workloads=1, configs=1).devices)
    snapshot = rows(target)
    line = refused(tunedb("db", "import", bad, "--db", target, cwd=tmp_path), "workloads", code=1)
    assert "ROLLBACK" not in line and "NOT NULL" in line
    assert rows(target) == snapshot


@pytest.mark.slow
def test_plan_json_with_non_numeric_fields(tmp_path: Path) -> None:
    plan = json.loads(tunedb("plan", _graph_json(tmp_path / "g.json", [4, 8]), "--device", "generic",
                             "--model", "none", "--json", cwd=tmp_path).stdout)
    for field, value in (("predicted_us", "fast"), ("launches", 1.5), ("nodes", ["a"])):
        bad = json.loads(json.dumps(plan))
        bad["steps"][0][field] = value
        (tmp_path / "p.json").write_text(json.dumps(bad))
        refused(tunedb("plan-check", tmp_path / "p.json", cwd=tmp_path), "plan", code=1)


# -- silent acceptance ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape,words", [
    ([2**40, 2**40], ["elements"]),
    ([4, 0], ["zero-size"]),
    ([4, 1.5], ["1.5", "not an integer"]),
])
def test_graph_shapes_that_cannot_be_planned(tmp_path: Path, shape: list, words: list[str]) -> None:
    r = tunedb("plan", _graph_json(tmp_path / "g.json", shape), "--device", "generic", "--model", "none",
               cwd=tmp_path)
    refused(r, *words, code=1)


def test_constant_with_the_wrong_byte_length(tmp_path: Path) -> None:
    const = {"c": {"type": {"shape": [4], "dtype": "float32"}, "data": base64.b64encode(b"\0" * 12).decode()}}
    r = tunedb("plan", _graph_json(tmp_path / "g.json", [4], const), "--device", "generic", "--model",
               "none", cwd=tmp_path)
    refused(r, "16 bytes", "12", code=1)


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_onnx_opset_outside_the_range(tmp_path: Path) -> None:
    import onnx

    m = onnx.load(str(GRAPH))
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 24  # newer than the documented 11-23 (older ones fail the ONNX checker first)
    onnx.save(m, str(tmp_path / "new.onnx"))
    r = tunedb("plan", tmp_path / "new.onnx", "--device", "generic", "--model", "none", cwd=tmp_path)
    refused(r, "opset 24", "11-23", code=1)


def test_import_conflicting_with_stored_rows(tmp_path: Path, export: Path, unchanged: Path) -> None:
    bad = tmp_path / "exp"
    shutil.copytree(export, bad)
    t = pq.read_table(bad / "measurements.parquet")
    med = t.schema.get_field_index("median_us")
    values = [None if v is None else v + 1.0 for v in t["median_us"].to_pylist()]
    pq.write_table(t.set_column(med, t.schema.field(med), pa.array(values, pa.float64())),
                   bad / "measurements.parquet")
    r = tunedb("db", "import", bad, "--db", unchanged, cwd=tmp_path)
    refused(r, "differs from the stored row", code=1)


@pytest.mark.parametrize("name", ["../x.parquet", "/etc/passwd"])
def test_manifest_naming_files_outside_the_export(tmp_path: Path, export: Path, name: str) -> None:
    bad = tmp_path / "exp"
    shutil.copytree(export, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"]["devices"] = name
    (bad / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(bad / "devices.parquet", tmp_path / "x.parquet")
    target = tmp_path / "t.duckdb"
    refused(tunedb("db", "import", bad, "--db", target, cwd=tmp_path), "plain file names", code=1)
    assert not target.exists()  # a failed import leaves no new database


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_edited_plan_step_is_refused(tmp_path: Path) -> None:
    r = tunedb("plan", _graph_json(tmp_path / "g.json", [4, 8]), "--device", "generic", "--model", "none",
               "--json", cwd=tmp_path)
    plan = json.loads(r.stdout)
    (tmp_path / "ok.json").write_text(json.dumps(plan))
    assert tunedb("plan-check", tmp_path / "ok.json", cwd=tmp_path).returncode == 0
    plan["steps"][0]["subgraph"] = plan["steps"][0]["subgraph"].replace('"relu"', '"neg"')
    (tmp_path / "edited.json").write_text(json.dumps(plan))
    refused(tunedb("plan-check", tmp_path / "edited.json", cwd=tmp_path), "sub-graph differs", code=1)


@pytest.mark.slow
def test_plan_json_refers_to_the_model_instead_of_carrying_weights(tmp_path: Path) -> None:
    shutil.copy(GRAPH, tmp_path / "m.onnx")
    r = tunedb("plan", tmp_path / "m.onnx", "--device", "generic", "--model", "none", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) < 200_000  # the 5.5 KB model's filled-in weights alone are 37 MB
    (tmp_path / "p.json").write_text(r.stdout)
    assert tunedb("plan-check", tmp_path / "p.json", cwd=tmp_path).returncode == 0
    (tmp_path / "m.onnx").write_bytes(GRAPH.read_bytes() + b"\0")
    refused(tunedb("plan-check", tmp_path / "p.json", cwd=tmp_path), "changed since the plan", code=1)


# -- defaults that destroy ------------------------------------------------------------------------
def test_failed_import_leaves_no_new_database_nor_folders(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "t.duckdb"
    refused(tunedb("db", "import", tmp_path / "nothing", "--db", target, cwd=tmp_path), "nothing", code=1)
    assert not (tmp_path / "new").exists()


def test_reader_with_db_in_a_missing_folder_creates_nothing(tmp_path: Path) -> None:
    r = tunedb("db", "info", "--db", tmp_path / "no" / "t.duckdb", cwd=tmp_path)
    refused(r, "does not exist", "--db", code=1)  # with a hint
    assert not (tmp_path / "no").exists()


def test_defaults_never_name_shipped_files(tmp_path: Path) -> None:
    from tunedb.cli.bench import FUSION_OUT, PLAN_OUT
    from tunedb.cli.train import default_out

    for p in (FUSION_OUT, PLAN_OUT):
        assert "data" not in p.parts
    os.environ.pop("TUNEDB_MODELS", None)
    assert default_out().resolve() != (ROOT / "models").resolve()
    help_text = tunedb("train", "--help", cwd=tmp_path).stdout
    assert "TUNEDB_MODELS" in help_text


# -- a user's day ---------------------------------------------------------------------------------
def test_bind_speaks_shell(tmp_path: Path) -> None:
    r = tunedb("plan", GRAPH, "--bind", "batch", cwd=tmp_path)
    refused(r, "--bind", "NAME=INT", code=2)


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    refused(tunedb("plan", cwd=tmp_path), "Missing argument", code=2)
    refused(tunedb("no-such-command", cwd=tmp_path), "No such command", code=2)
    refused(tunedb("collect", "--suite", "quick", "--strategy", "nope", "--db", tmp_path / "c.duckdb",
                   cwd=tmp_path), "strategy", code=2)


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_lists_of_suites_collectors_models_and_ops(tmp_path: Path) -> None:
    from tunedb.cli.collect import SUITE_NAMES
    from tunedb.kernels.suites import SUITES

    assert tuple(SUITE_NAMES) == tuple(SUITES)
    suites = json.loads(tunedb("suites", "--json", cwd=tmp_path).stdout)
    assert [s["name"] for s in suites] == list(SUITES) and all(s["workloads"] > 0 for s in suites)
    assert "fusion" in [c["name"] for c in json.loads(tunedb("collectors", "--json", cwd=tmp_path).stdout)]
    models = json.loads(tunedb("models", SHIPPED_MODEL.parent.parent, "--json", cwd=tmp_path).stdout)
    assert any(m["kind"] == "fusion" for m in models)
    assert "Relu" in tunedb("onnx-ops", cwd=tmp_path).stdout
    assert "quick" in tunedb("collect", "--help", cwd=tmp_path).stdout


def test_help_keeps_the_workers_default(tmp_path: Path) -> None:
    out = tunedb("collect", "--help", cwd=tmp_path).stdout
    assert "CPU cores - 2" in " ".join(out.split())


def _replay_collect(db: Path, cwd: Path) -> subprocess.Popen:
    """The full suite from the replay device: measurements from about 20 s in and for about 100 s
    more on an idle 2-core machine, so that the callers' checks happen while it runs (the standard
    suite ended within 40 s of its first commit, and a Ctrl-C then met a process already exiting);
    the callers all stop it early."""
    data = ROOT / "data" / "fusion_h200_v2"
    return subprocess.Popen([sys.executable, "-m", "tunedb", "collect", "--suite", "full", "--device",
                             f"replay:{data}", "--db", str(db), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=_env(),
                            preexec_fn=_sigint_default)


def _sigint_default() -> None:
    """A runner started in the background (``cmd &``) ignores SIGINT, and Python keeps an ignored
    SIGINT ignored: give the child the default so that it installs its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_measurements(db: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        if db.exists():
            try:
                with TuningStore.open(db, read_only=True, wait_s=10) as store:
                    if store.counts()["measurements"] > 0:
                        return
            except Exception:  # noqa: BLE001 - not initialised yet
                pass
        time.sleep(1)
    raise AssertionError("the collection measured nothing in time")


@contextlib.contextmanager
def _collecting(db: Path, cwd: Path) -> Iterator[subprocess.Popen]:
    """A replay collect into ``db`` that has committed measurements; killed on the way out if the
    caller left it running."""
    proc = _replay_collect(db, cwd)
    try:
        _wait_for_measurements(db, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_db_info_works_while_collect_runs_and_ctrl_c_is_one_line(tmp_path: Path) -> None:
    db = tmp_path / "c.duckdb"
    with _collecting(db, tmp_path) as proc:
        r = tunedb("db", "info", "--db", db, "--json", cwd=tmp_path, TUNEDB_BUSY_TIMEOUT="30")
        assert proc.poll() is None  # db info came back while the collection ran
        assert r.returncode == 0, r.stderr
        seen = [json.loads(r.stdout)["counts"]["measurements"]]
        assert seen[0] > 0
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert '"stopped": ""' not in out, "the collection had finished before Ctrl-C"
    assert proc.returncode == 130, err
    assert err.splitlines() == [err.splitlines()[0]] and err.startswith("error: interrupted")
    with TuningStore.open(db, read_only=True) as store:
        runs = store.runs()
        assert len(runs) == 1 and runs[0].finished_at  # the interrupted run is closed
        assert store.counts()["measurements"] >= seen[-1]


@pytest.mark.slow
def test_a_collect_that_measures_nothing_adds_no_run_and_kill_9_runs_are_closed(tmp_path: Path) -> None:
    db = tmp_path / "c.duckdb"
    with _collecting(db, tmp_path) as proc:
        proc.kill()  # kill -9: the run stays open
        proc.wait()
    with TuningStore.open(db, read_only=True) as store:
        assert [r.finished_at for r in store.runs()] == [""]
        counted = store.counts()
    # a collect that measures nothing (an empty suite of a replay that has none of it) closes the
    # killed run and leaves no run of its own
    r = tunedb("collect", "--suite", "quick", "--device", f"replay:{tmp_path / 'nothing.duckdb'}",
               "--db", db, cwd=tmp_path)
    assert r.returncode != 0  # the replay source does not exist
    proc = subprocess.run([sys.executable, "-m", "tunedb", "collect", "--suite", "standard", "--device",
                           f"replay:{ROOT / 'data' / 'fusion_h200_v2'}", "--db", str(db), "--budget", "1",
                           "--time", "0", "--json"], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    with TuningStore.open(db, read_only=True) as store:
        runs = store.runs()
        assert counted["runs"] == 1 and all(r.finished_at for r in runs)
        assert len(runs) == 1 + (json.loads(proc.stdout)["measured"] > 0)


def test_errors_raised_while_ctrl_c_unwinds_count_as_the_interrupt() -> None:
    """DuckDB's own interrupt error and clean-up failing during Ctrl-C exit 130, not 1."""
    from tunedb.cli.common import _interrupted

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise OSError("flush failed") from None
    except OSError as e:
        assert _interrupted(e)  # `from None` hides the cause, the context still holds it
    assert _interrupted(RuntimeError("INTERRUPT Error: Query interrupted"))
    assert not _interrupted(RuntimeError("disk full"))

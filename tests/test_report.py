"""`tunedb report` on a small real DuckDB database: synthetic workloads plus two anchor cases,
two devices, failures and repeated runs; the page's tables are checked against the evaluation."""

from __future__ import annotations

import base64
import json
import statistics
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

from tunedb.cli import app  # noqa: E402
from tunedb.costmodel.evaluate import cross_validate  # noqa: E402
from tunedb.costmodel.features import DeviceFacts, feature_index, featurize, featurize_frame  # noqa: E402
from tunedb.costmodel.fit import clean_frame, fit_frame  # noqa: E402
from tunedb.costmodel.synthetic import synthetic_frame  # noqa: E402
from tunedb.costmodel.train import TrainParams  # noqa: E402
from tunedb.graph.hashing import graph_hash  # noqa: E402
from tunedb.kernels.schedule import schedule_space  # noqa: E402
from tunedb.kernels.suites import ANCHOR_CASES  # noqa: E402
from tunedb.records import Candidate, DeviceInfo, Measurement, Run, Workload, canonical_json  # noqa: E402
from tunedb.report import SECTIONS, ReportError, build_report  # noqa: E402
from tunedb.report.evaluation import FAMILY_KEYS  # noqa: E402
from tunedb.report.render import METRIC_LABELS  # noqa: E402
from tunedb.store import TuningStore  # noqa: E402

H200 = DeviceInfo("NVIDIA H200", "u1", "9.0", 132, 60 * 2**20, 141 * 2**30, "580.1", "13.0", "14.2")
A100 = DeviceInfo("NVIDIA A100", "u2", "8.0", 108, 40 * 2**20, 80 * 2**30, "580.1", "13.0", "14.2")
RUNS = [Run(f"run{i}", "fusion", "0.1.0", "", "host", "{}", f"2026-01-0{i + 1}T00:00:00Z") for i in range(2)]
ANCHORS = ("bias_gelu_8192x4096", "softmax_1024x32768")
# Small boosters: the report's evaluation trains one per fold.
FAST = TrainParams(objective="reg:squarederror", num_boost_round=40, max_depth=5, early_stopping_rounds=10,
                   nthread=1)
runner = CliRunner()


def _samples(lat: float, rng: np.random.Generator) -> tuple[float, ...]:
    return tuple(float(v) for v in lat * (1.0 + rng.normal(0.0, 0.01, 10)))


def make_db(path: Path) -> dict:
    """18 synthetic workloads + 2 anchor cases on the H200 (5 % failures, a second run for some
    candidates), a few measurements on an A100. Returns facts the tests check against."""
    rng = np.random.default_rng(7)
    f = synthetic_frame(18, 12, seed=3).to_pylist()
    workloads = {r["workload_hash"]: Workload(r["workload_hash"], r["family"], r["workload_name"],
                                              r["graph_json"]) for r in f}
    rows = [(r["workload_hash"], json.loads(r["config_json"]), r["median_us"]) for r in f]
    facts = DeviceFacts.from_device_info(H200)
    for case in ANCHOR_CASES:
        if case.name not in ANCHORS:
            continue
        h = graph_hash(case.graph)
        workloads[h] = Workload(h, case.family, case.name, canonical_json(case.graph.to_json()))
        configs = [s.to_config() for s in schedule_space(case.graph, H200.sm_count)[0][:10]]
        X = featurize({h: case.graph}, [h] * len(configs), configs, facts)
        # Never faster than the roofline time, which is never below the floor.
        lat = X[:, feature_index("roofline_us")] * np.exp(np.abs(rng.normal(0.3, 0.3, len(configs))))
        # The first schedule of each anchor fails to compile (no latency).
        rows += [(h, c, float(t) if j else None) for j, (c, t) in enumerate(zip(configs, lat))]
    cands, meas = [], []
    for i, (h, cfg, lat) in enumerate(rows):
        c = Candidate(h, "fusion", cfg)
        cands.append(c)
        if lat is None or rng.random() < 0.05:
            meas.append(Measurement(c.hash, H200.id, "run0", "compile_error", error="ptxas: no registers"))
            continue
        meas.append(Measurement(c.hash, H200.id, "run0", "ok", _samples(lat, rng), registers=32))
        if i % 7 == 0:  # measured again in a second run, a little slower
            meas.append(Measurement(c.hash, H200.id, "run1", "ok", _samples(lat * 1.1, rng), registers=32))
        if i % 25 == 0:
            meas.append(Measurement(c.hash, A100.id, "run1", "timeout"))
    with TuningStore.open(path) as db:
        db.add_devices([H200, A100])
        db.add_runs(RUNS)
        db.add_workloads(workloads.values())
        db.add_candidates(cands)
        db.add_measurements(meas)
    return {"measurements": len(meas), "workloads": len(workloads),
            "families": {w.family for w in workloads.values()}}


@pytest.fixture(scope="module")
def db_path(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("report") / "t.duckdb"
    return path, make_db(path)


class Tables(HTMLParser):
    """Collects every <table id=...> as rows of cell texts, and every <img src=...>."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self.headings: list[str] = []
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            self._cell = []
        elif tag == "img":
            self.images.append(a["src"])
        elif tag == "h2":
            self._h2 = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "h2":
            self._h2 = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._h2:
            self.headings.append(data)


def parse(html_text: str) -> Tables:
    p = Tables()
    p.feed(html_text)
    return p


def num(cell: str) -> float | None:
    return None if cell == "—" else float(cell.replace(",", ""))


def expected_dataset(path: Path, facts: DeviceFacts):
    """The H200's ok rows, one per candidate (median over runs), computed independently."""
    with TuningStore.open(path, read_only=True) as db:
        frame = db.training_frame(kind="fusion", device_id=H200.id)
    first: dict[str, int] = {}
    lat: dict[str, list[float]] = {}
    for i, c in enumerate(frame["candidate_hash"].to_pylist()):
        first.setdefault(c, i)
        lat.setdefault(c, []).append(frame["median_us"][i].as_py())
    keep = sorted(first.values())
    t = frame.take(keep)
    y = np.array([statistics.median(lat[c]) for c in t["candidate_hash"].to_pylist()])
    return featurize_frame(t, facts), y, np.array(t["workload_hash"].to_pylist()), t


def row_map(tables: Tables, table_id: str) -> dict[str, list[str]]:
    return {r[0]: r[1:] for r in tables.tables[table_id][1:]}


@pytest.mark.slow  # a CLI subprocess or several: seconds; the full tier runs it
def test_report_sections_plots_and_numbers(db_path, tmp_path):
    path, made = db_path
    with TuningStore.open(path, read_only=True) as db:
        rep = build_report(db, params=FAST, folds=4)
    out = rep.write(tmp_path / "r" / "report.html")
    text = out.read_text()
    page = parse(text)
    assert page.headings == list(SECTIONS.values())
    # Four PNG figures, each a real PNG: scatter, family bars, anchor strips, baseline bars.
    assert len(page.images) == 4
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"

    # The held-out numbers are cross_validate's for the same rows and parameters.
    X, y, groups, t = expected_dataset(path, DeviceFacts.from_device_info(H200))
    with TuningStore.open(path, read_only=True) as store:  # the spreads train keeps per candidate
        spread = clean_frame(store.training_frame(kind="fusion", device_id=H200.id))
    assert spread["candidate_hash"].to_pylist() == t["candidate_hash"].to_pylist()
    cv = cross_validate(X, y, groups, FAST, folds=4, lo=spread["p20_us"].to_numpy(),
                        hi=spread["p80_us"].to_numpy())
    ev = rep.data["evaluation"]
    assert ev["rows"] == len(y) and ev["workloads"] == len(set(groups)) == made["workloads"]
    for k in METRIC_LABELS:
        assert ev[k] == pytest.approx(cv[k], abs=1e-9), k
        for name in ("roofline", "random"):
            assert ev["baselines"][name][k] == pytest.approx(cv["baselines"][name][k], abs=1e-9, nan_ok=True)
    base = row_map(page, "baselines")
    header = page.tables["baselines"][0][1:]
    for col, k in enumerate(METRIC_LABELS):
        assert header[col] == METRIC_LABELS[k]
        assert num(base["XGBoost"][col]) == pytest.approx(cv[k], abs=5.1e-5)
        assert num(base["roofline"][col]) == pytest.approx(cv["baselines"]["roofline"][k], abs=5.1e-5)
        assert num(base["random"][col]) == pytest.approx(cv["baselines"]["random"][k], abs=5.1e-5)
    assert num(base["XGBoost, compile facts given"][list(METRIC_LABELS).index("pairwise_accuracy")]) == \
        pytest.approx(cv["with_measured"]["pairwise_accuracy"], abs=5.1e-5)

    # Per-family table: one row per family with rows that add up, metrics as in the JSON.
    fam = row_map(page, "families")
    assert set(fam) == made["families"]
    assert sum(int(r[0]) for r in fam.values()) == len(y)
    for name, r in fam.items():
        want = rep.data["families"][name]
        pw, mp = (2 + FAMILY_KEYS.index(k) for k in ("pairwise_accuracy", "mape"))
        assert num(r[pw]) == pytest.approx(want["pairwise_accuracy"], abs=5.1e-5, nan_ok=True) \
            or (r[pw] == "—" and want["pairwise_accuracy"] != want["pairwise_accuracy"])
        assert num(r[mp]) == pytest.approx(want["mape"], abs=5.1e-5)

    # Anchors: both cases found, floor = fewest bytes / bandwidth, best = fastest measured.
    anchors = row_map(page, "anchors")
    assert set(anchors) == {*ANCHORS, "geomean"}
    by_hash = dict(zip(t["candidate_hash"].to_pylist(), y))
    for a in rep.data["anchors"]:
        case = next(c for c in ANCHOR_CASES if c.name == a["case"])
        assert a["floor_us"] == pytest.approx(case.floor_bytes / 4.2e12 * 1e6)
        hashes = {c.hash for c in _anchor_candidates(path, graph_hash(case.graph))}
        mine = [v for h, v in by_hash.items() if h in hashes]
        assert a["candidates"] == len(mine) and a["best_us"] == pytest.approx(min(mine))
        assert a["failed"] == _failures(path, hashes) > 0
        assert num(anchors[a["case"]][3]) == pytest.approx(a["floor_us"], abs=5e-4)
        assert a["best_us"] >= a["floor_us"]  # no candidate beats the floor
        assert a["best_us"] <= a["model_pick_us"]

    # Data summary: every measurement of every device and status, failures included.
    summary = row_map(page, "summary")
    assert int(summary["measurements"][0].replace(",", "")) == made["measurements"]
    statuses = row_map(page, "statuses")
    assert {"ok", "compile_error", "timeout"} <= set(statuses)
    assert sum(int(v[0].replace(",", "")) for v in statuses.values()) == made["measurements"]
    assert set(row_map(page, "devices")) == {"NVIDIA H200", "NVIDIA A100"}
    assert set(row_map(page, "dtypes")) <= {"float32", "float16", "bfloat16"}

    # The embedded JSON is the report's data, strict JSON.
    blob = text.split('id="report-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(blob)["evaluation"]["pairwise_accuracy"] == pytest.approx(cv["pairwise_accuracy"])


def _failures(path: Path, candidate_hashes: set[str]) -> int:
    with TuningStore.open(path, read_only=True) as db:
        return sum(1 for h in candidate_hashes for m in db.measurements(candidate_hash=h, device_id=H200.id)
                   if m.status != "ok")


def _anchor_candidates(path: Path, workload_hash: str) -> list[Candidate]:
    with TuningStore.open(path, read_only=True) as db:
        return db.candidates(workload_hash=workload_hash)


def test_cli_with_model_card_matches_train_metrics(db_path, tmp_path):
    """A model saved by the training pipeline: the report cross-validates its card's parameters
    (objective pinned to the one it chose) and shows the card's own held-out metrics."""
    path, _ = db_path
    with TuningStore.open(path, read_only=True) as db:
        frame = db.training_frame(kind="fusion", device_id=H200.id)
    _, metrics, where = fit_frame(frame, out_root=tmp_path / "models", params=replace(FAST, objective="auto"),
                                  device=DeviceFacts.from_device_info(H200), folds=3, lofo=False)
    assert where is not None and (where / "card.json").is_file()
    out = tmp_path / "cli.html"
    res = runner.invoke(app, ["report", "--db", str(path), "--model", str(tmp_path / "models"),
                              "--out", str(out), "--folds", "3", "--json"], env={"TUNEDB_DB": None})
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["out"] == str(out) and out.is_file()
    assert data["params_from"] == "from the model card" and data["params"]["num_boost_round"] == 40
    assert data["params"]["objective"] == metrics["objective"]
    ev = data["evaluation"]
    assert ev["folds"] == metrics["folds"] == 3 and ev["rows"] == metrics["rows"]
    base = row_map(parse(out.read_text()), "baselines")
    for col, k in enumerate(METRIC_LABELS):
        assert ev[k] == pytest.approx(metrics[k], abs=1e-9), k
        assert num(base["XGBoost"][col]) == pytest.approx(metrics[k], abs=5.1e-5), k
    # The card keeps the baselines' headline metrics (METRIC_KEYS) only.
    for col, k in enumerate(METRIC_LABELS):
        for name in ("roofline", "random"):
            if k in metrics["baselines"][name]:
                assert num(base[name][col]) == pytest.approx(metrics["baselines"][name][k], abs=5.1e-5), k


def test_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty.duckdb"
    with TuningStore.open(empty) as db:
        db.add_devices([H200])
    res = runner.invoke(app, ["report", "--db", str(empty), "--out", str(tmp_path / "x.html")])
    assert res.exit_code == 1
    assert res.output.strip().startswith("error: ") and "no fusion measurements" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.html").exists()
    with TuningStore.open(empty, read_only=True) as db, pytest.raises(ReportError, match="unknown kind"):
        build_report(db, kind="fusoin")


def test_unknown_device_and_too_few_workloads(db_path, tmp_path):
    path, _ = db_path
    with TuningStore.open(path, read_only=True) as db:
        with pytest.raises(ReportError, match="no device 'V100'"):
            build_report(db, device="V100", params=FAST)
        # The A100 has only timeouts: nothing to evaluate on it.
        with pytest.raises(ReportError, match="no ok measurements"):
            build_report(db, device=A100.id, params=FAST)
    # Two workloads: the page is still written, the model sections say why they are empty.
    small = tmp_path / "small.duckdb"
    rng = np.random.default_rng(0)
    f = synthetic_frame(2, 5, seed=1, fail_fraction=0.0).to_pylist()
    with TuningStore.open(small) as db:
        db.add_devices([H200])
        db.add_runs(RUNS[:1])
        db.add_workloads({r["workload_hash"]: Workload(r["workload_hash"], r["family"], r["workload_name"],
                                                       r["graph_json"]) for r in f}.values())
        cands = [Candidate(r["workload_hash"], "fusion", json.loads(r["config_json"])) for r in f]
        db.add_candidates(cands)
        db.add_measurements([Measurement(c.hash, H200.id, "run0", "ok", _samples(r["median_us"], rng))
                             for c, r in zip(cands, f)])
        rep = build_report(db, params=FAST)
    page = parse(rep.html)
    assert page.headings == list(SECTIONS.values())
    assert rep.data["evaluation"] is None
    assert "needs at least 3 workloads" in rep.data["evaluation_note"]
    assert "needs at least 3 workloads" in rep.html
    assert int(row_map(page, "summary")["workloads"][0]) == 2


def test_missing_matplotlib_is_one_line(db_path, monkeypatch, tmp_path):
    path, _ = db_path
    # What an install without the [report] extra looks like to Python.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = runner.invoke(app, ["report", "--db", str(path), "--out", str(tmp_path / "x.html")])
    assert res.exit_code == 1
    assert res.output.strip() == "error: tunedb report needs matplotlib: pip install 'tunedb[report]'"

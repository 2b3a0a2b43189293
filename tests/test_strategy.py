"""Collection strategies on the replay device: coverage without repeats, rounds, budget, resume,
warm start from stored data, and ``tunedb collect --strategy``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_apps import collect_app
from typer.testing import CliRunner

from tunedb.bench.active import load_dataset, write_synthetic
from tunedb.collect import CollectError, Collector, engine
from tunedb.collect.strategy import STRATEGIES, ModelStrategy, RooflineStrategy, make_strategy
from tunedb.runtime import ReplayDevice
from tunedb.store import TuningStore

W, C = 6, 10  # workloads, candidates per workload (the synthetic module may give fewer)


class StoredCollector(Collector):
    """The suite is a stored dataset (its path): its workloads and candidate configs."""

    name = "stored"
    kind = "fusion"

    def jobs(self, suite: str) -> Any:
        return iter(load_dataset(suite).jobs)

    def build(self, workload: Any, spec: Any) -> tuple[str, dict]:
        return "", {}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A synthetic Parquet export and its number of candidates."""
    path = tmp_path_factory.mktemp("strategy") / "export"
    info = write_synthetic(path, W, C, seed=3)
    sizes = [len(j.specs) for j in load_dataset(path).jobs]
    assert info["workloads"] == W and min(sizes) >= 6, sizes  # the tests below take 6 of each
    return path, info["candidates"]


def _store_rows(db: TuningStore) -> list[str]:
    return [m.candidate_hash for m in db.measurements()]


@pytest.mark.parametrize("name,options", [(s, {}) for s in STRATEGIES]
                         + [("model", {"allocate": "ei", "min_train": 8, "explore": 0.5})])
def test_every_strategy_measures_each_candidate_once(stored: tuple[Path, int], name: str,
                                                      options: dict) -> None:
    data, n = stored
    dev = ReplayDevice(data)
    strat = make_strategy(name, per_round=3, seed=1, **options)
    with TuningStore.open(":memory:") as db:
        s = StoredCollector().run(db, dev, str(data), strategy=strat)
        rows = _store_rows(db)
        runs = db.runs()
    assert s.measured == n == len(rows) == len(set(rows)) and s.missing == 0 and s.stopped == ""
    hashes = [h[1] for h in strat.history]
    assert len(hashes) == len(set(hashes)) == n and set(hashes) == set(rows)
    assert json.loads(runs[0].config_json)["strategy"] == name
    if name == "exhaustive":  # suite order, workload by workload
        wl = [h[0] for h in strat.history]
        assert wl == sorted(wl, key=[j.workload.hash for j in load_dataset(data).jobs].index)
    else:  # round-robin: the first round touches every workload
        assert {h[0] for h in strat.history[:3 * W]} == {j.workload.hash for j in load_dataset(data).jobs}
    if options:
        assert strat.retrains >= 1 and len(strat.residuals) > 0 and strat.model_error() > 0


def test_rounds_budget_and_resume_never_repeat(stored: tuple[Path, int]) -> None:
    data, n = stored
    dev = ReplayDevice(data)
    coll = StoredCollector()
    with TuningStore.open(":memory:") as db:
        s1 = coll.run(db, dev, str(data), strategy=make_strategy("model", per_round=2, seed=0), rounds=2)
        assert s1.measured == 2 * 2 * W and s1.stopped == "rounds"
        s2 = coll.run(db, dev, str(data), strategy=make_strategy("random", per_round=4), budget=9)
        assert s2.already == s1.measured and s2.measured == 9 and s2.stopped == "budget"
        strat = make_strategy("model", per_round=5, seed=0, min_train=8)
        s3 = coll.run(db, dev, str(data), strategy=strat)
        assert s3.already == s1.measured + s2.measured and s3.measured == n - s3.already
        earlier_ok = {m.candidate_hash for m in db.measurements()
                      if m.status == "ok" and m.run_id in (s1.run_id, s2.run_id)}
        rows = _store_rows(db)
    assert len(rows) == len(set(rows)) == n
    # The earlier ok measurements were training rows from the start (warm start), never re-measured.
    assert strat.retrains >= 1 and not earlier_ok & {h[1] for h in strat.history}
    assert all(np.isfinite(strat.latency[strat.index[h]]) for h in earlier_ok)


def test_budget_is_spread_over_workloads(stored: tuple[Path, int]) -> None:
    data, _ = stored
    strat = make_strategy("random", per_round=8, seed=2)
    with TuningStore.open(":memory:") as db:
        s = StoredCollector().run(db, ReplayDevice(data), str(data), strategy=strat, budget=W * 2)
    assert s.measured == W * 2
    counts: dict[str, int] = {}
    for wh, *_ in strat.history:
        counts[wh] = counts.get(wh, 0) + 1
    assert sorted(counts.values()) == [2] * W


def test_roofline_order_and_model_exploration(stored: tuple[Path, int]) -> None:
    data, _ = stored
    ds = load_dataset(data)
    dev = ReplayDevice(data)
    r = RooflineStrategy(per_round=3, seed=0)
    r.start(ds.jobs, set(), dev.info, "fusion")
    first = r.propose()
    assert len(first) == W and all(len(j.specs) == 3 for j in first)
    for sub in first:  # the three lowest roofline times of each workload
        idx = r.by_job[[job.workload.hash for job in ds.jobs].index(sub.workload.hash)]
        best = sorted(r.roofline[idx])[:3]
        picked = [r.roofline[r.index[_hash(sub.workload.hash, cfg)]] for cfg, _ in sub.specs]
        assert picked == pytest.approx(best)
    m = ModelStrategy(per_round=4, seed=0, explore=0.5, min_train=4)
    m.start(ds.jobs, set(), dev.info, "fusion")
    m.propose()  # cold start: nothing to train on yet
    assert not m.boosters
    for h, status, lat in _replay(dev, m):
        m.observe(h, status, lat)
    before = ~m.done
    second = m.propose()  # trained on the first round; predicts every unmeasured candidate
    assert len(m.boosters) == 3 and np.isfinite(m.mu[before]).all()
    assert (m.sigma[before] >= 0).all() and m.sigma[before].max() > 0  # the members disagree
    job_of = {job.workload.hash: j for j, job in enumerate(ds.jobs)}
    for sub in second:  # exploitation share: the two best predicted come first
        j = job_of[sub.workload.hash]
        picked = [m.index[_hash(sub.workload.hash, cfg)] for cfg, _ in sub.specs]
        rem = [i for i in m.by_job[j] if before[i]]
        assert sorted(m.mu[picked[:2]]) == sorted(sorted(m.mu[rem])[:2])


def _hash(wh: str, cfg: dict) -> str:
    from tunedb.records import Candidate

    return Candidate(wh, "fusion", cfg).hash


def _replay(dev: ReplayDevice, strat: Any) -> list[tuple[str, str, float | None]]:
    """Stored results of every candidate the strategy has proposed so far."""
    out = []
    for i in np.flatnonzero(strat.done):
        h = strat.cand_hash[i]
        res = dev.lookup(h)
        lat = float(np.median(res.samples_us)) if res.status == "ok" else None
        out.append((h, res.status, lat))
    return out


def test_strategy_errors() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'best'; expected one of exhaustive"):
        make_strategy("best")
    with pytest.raises(ValueError, match="per_round must be >= 1"):
        make_strategy("random", per_round=0)
    with pytest.raises(ValueError, match="takes no options"):
        make_strategy("random", explore=0.5)
    with pytest.raises(ValueError, match="explore must be in"):
        make_strategy("model", explore=2.0)
    with pytest.raises(ValueError, match="allocate must be"):
        make_strategy("model", allocate="greedy")


def test_rounds_must_be_positive(stored: tuple[Path, int]) -> None:
    data, _ = stored
    with TuningStore.open(":memory:") as db, pytest.raises(CollectError, match="rounds must be >= 1"):
        StoredCollector().run(db, ReplayDevice(data), str(data), rounds=0)


def test_collect_cli_strategy_flag_with_replay(stored: tuple[Path, int], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data, n = stored
    monkeypatch.setitem(engine.BUILTIN_COLLECTORS, "stored-test", f"{__name__}:StoredCollector")
    db = tmp_path / "c.duckdb"
    common = ["collect", "--collector", "stored-test", "--suite", str(data), "--device", f"replay:{data}",
              "--db", str(db)]
    r = CliRunner().invoke(collect_app(), [*common, "--strategy", "model", "--rounds", "2",
                                           "--per-round", "3", "--json"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.output.strip().splitlines()[-1])
    assert first["measured"] == 2 * 3 * W and first["stopped"] == "rounds"
    r = CliRunner().invoke(collect_app(), [*common, "--strategy", "random", "--seed", "5"])
    assert r.exit_code == 0, r.output
    assert f"already measured {2 * 3 * W}" in r.output and f"measured {n - 2 * 3 * W} " in r.output
    r = CliRunner().invoke(collect_app(), [*common, "--strategy", "best"])
    assert r.exit_code == 2 and r.output.strip().startswith("error: unknown strategy 'best'")
    assert "\n" not in r.output.strip()
    with TuningStore.open(db, read_only=True) as s:
        rows = [m.candidate_hash for m in s.measurements()]
        configs = [json.loads(run.config_json) for run in s.runs()]
    assert len(rows) == len(set(rows)) == n
    assert sorted((c["strategy"], c["rounds"]) for c in configs) == [("model", 2), ("random", None)]


def test_model_strategy_goes_breadth_first_on_a_new_board(stored: tuple[Path, int]) -> None:
    """A second board of the same model starts from the first board's measurements: it does not
    measure those candidates again, and each round visits the workloads with the fewest known
    latencies first, the families taking turns (so a time limit cuts the best-known workloads)."""
    import dataclasses

    data, _ = stored
    dev = ReplayDevice(data)
    with TuningStore.open(":memory:") as db:
        StoredCollector().run(db, dev, str(data), strategy=make_strategy("model", per_round=2, seed=0),
                              budget=3)  # the budget spread: 1 candidate of 3 of the 6 workloads
        first_board = db.training_frame(kind="fusion", device_id=dev.info.id)
    known = set(first_board["candidate_hash"].to_pylist())
    assert len(known) == 3
    jobs = sorted(load_dataset(data).jobs, key=lambda j: j.workload.family)  # families in blocks
    second = dataclasses.replace(dev.info, uuid_hash="another board")
    strat = ModelStrategy(per_round=2, seed=0, min_train=4)
    strat.start(jobs, set(), second, "fusion", [first_board.slice(0, 0), first_board])
    assert {strat.cand_hash[i] for i in np.flatnonzero(strat.done)} == known
    order = strat.round_order(list(range(len(jobs))))
    counts = [int(np.isfinite(strat.latency[strat.by_job[j]]).sum()) for j in order]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] > 0
    round1 = strat.propose()
    assert [j.workload.hash for j in round1] == [jobs[j].workload.hash for j in order]
    proposed = {_hash(j.workload.hash, cfg) for j in round1 for cfg, _ in j.specs}
    assert not proposed & known


def test_model_strategy_families_take_turns(stored: tuple[Path, int]) -> None:
    import dataclasses

    from tunedb.collect import Job

    data, _ = stored
    jobs = [Job(dataclasses.replace(j.workload, family="a" if i < 4 else "b"), j.specs, j.pruned)
            for i, j in enumerate(load_dataset(data).jobs)]
    strat = ModelStrategy(per_round=2, seed=0)
    strat.start(jobs, set(), ReplayDevice(data).info, "fusion")
    assert strat.round_order(list(range(W))) == [0, 4, 1, 5, 2, 3]  # suite order within a family
    strat.rounds_done = 1  # the next round starts one workload later, the turns as before
    assert strat.round_order(list(range(W))) == [1, 4, 2, 5, 3, 0]
    strat.rounds_done = 0
    strat.latency[strat.by_job[0][0]] = 1.0  # a known workload goes last, and its family's
    assert strat.round_order(list(range(W))) == [1, 4, 2, 5, 3, 0]  # next one takes its turn

"""The breadth suite (off-grid shapes and dtypes for the cost model, issue 22) and the model
strategy that chooses which of its candidates to measure, warm-started from stored data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tunedb.collect import Job, make_strategy
from tunedb.kernels import FAMILIES, schedule_space, suite
from tunedb.kernels.suite_breadth import ALL_DTYPE_SHAPES, BREADTH_SHAPES, FLOAT_DTYPES
from tunedb.kernels.suites import BUILDERS
from tunedb.records import Workload
from tunedb.store import TuningStore

DATA = Path(__file__).resolve().parents[1] / "data" / "fusion_h200_v2"


_NAME = re.compile(r"^(?P<op>.+?)_(?P<shape>\d+(?:x\d+)+)(?:_(?P<dtype>[a-z][a-z0-9]*))?$")
_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", None: "float32"}


def _shape(c) -> tuple[int, ...]:
    return tuple(int(x) for x in _NAME.match(c.name)["shape"].split("x"))


def _dtype(c) -> str:
    return _DTYPE[_NAME.match(c.name)["dtype"]]


def _op(c) -> str:
    return _NAME.match(c.name)["op"]


def test_breadth_is_off_the_standard_grid() -> None:
    b, std = suite("breadth"), suite("full")
    ops = sum(len(v) for _, v in BUILDERS.values())
    assert len(b) == ops * (len(BREADTH_SHAPES) + 2 * len(ALL_DTYPE_SHAPES)) >= 700
    assert len({c.name for c in b}) == len(b)
    assert not {c.name for c in b} & {c.name for c in std}
    assert not {_shape(c) for c in b} & {_shape(c) for c in std}
    assert {c.family for c in b} == set(FAMILIES)
    # Every op in every float dtype; at the all-dtype shapes in all three at the same shape.
    by_op: dict[str, set[str]] = {}
    for c in b:
        by_op.setdefault(_op(c), set()).add(_dtype(c))
    assert len(by_op) == ops and all(v == set(FLOAT_DTYPES) for v in by_op.values())
    at = {(_op(c), _shape(c)): set() for c in b if _shape(c) in ALL_DTYPE_SHAPES}
    for c in b:
        if _shape(c) in ALL_DTYPE_SHAPES:
            at[(_op(c), _shape(c))].add(_dtype(c))
    assert all(v == set(FLOAT_DTYPES) for v in at.values())
    # From a single row to a million rows; no operand over 256 MB.
    rows = [_shape(c)[0] for c in b]
    assert min(rows) == 1 and max(rows) >= 2 ** 20
    assert max(c.floor_bytes for c in b) < 1.5 * 2 ** 30
    biggest = max(int(np.prod(c.graph.type_of(v).shape)) * 4 for c in b for v in c.graph.inputs)
    assert biggest <= 256 * 2 ** 20


def _jobs(cases, sm_count: int = 132) -> list[Job]:
    out = []
    for case in cases:
        legal, pruned = schedule_space(case.graph, sm_count=sm_count)
        specs = {json.dumps(s.to_config(), sort_keys=True): (s.to_config(), None) for s in legal}
        out.append(Job(Workload.from_graph(case.graph, case.family, case.name), list(specs.values()),
                       len(pruned)))
    return out


@pytest.fixture(scope="module")
def prior():
    with TuningStore.open(":memory:") as store:
        store.import_parquet(DATA)
        devices = store.devices()
        return store.training_frame(kind="fusion"), devices[0]


def _one_per_family(name: str) -> list:
    """A workload of each family the generator supports: breadth at one off-grid shape; the
    generalization suite's first supported region of each kind."""
    picks: dict[str, object] = {}
    for c in suite(name):
        if c.family in picks or (name == "breadth" and _shape(c) != (777, 1537)):
            continue
        try:
            schedule_space(c.graph, sm_count=132)
        except ValueError:  # outside the generator: the collector skips it too
            continue
        picks[c.family] = c
    return list(picks.values())


@pytest.mark.slow  # ~10 s a suite: featurises and learns the 40,223 stored rows
@pytest.mark.parametrize("name", ["breadth", "generalization"])
def test_model_strategy_plans_a_new_suite_from_stored_data(prior, name: str) -> None:
    frame, board = prior
    jobs = _jobs(_one_per_family(name))
    assert len(jobs) >= 3
    strat = make_strategy("model", per_round=6, seed=0)
    # The prior arrives as one frame per board of the device model, here the stored board and
    # an empty second one.
    assert strat.start(jobs, set(), board, "fusion", [frame, frame.slice(0, 0)]) == 0
    assert strat.has_features.all()  # the featuriser reads every new workload
    assert strat.prior_y is not None and len(strat.prior_y) == frame.num_rows
    round1 = strat.propose()
    assert strat.boosters, "the first round is already model-guided (warm start from the prior)"
    assert {j.workload.hash for j in round1} == {j.workload.hash for j in jobs}
    # 6 a workload (fewer where it has fewer candidates): the 4 best predicted, and 2 where
    # the bootstrap ensemble's optimistic bound (mean - kappa * spread) is lowest.
    for j in range(len(jobs)):
        idx = strat.by_job[j]
        picked = set(idx[strat.done[idx]].tolist())
        assert len(picked) == min(6, len(idx))
        order = idx[np.lexsort((strat.tiebreak[idx], strat.mu[idx]))]
        best, rest = order[:4], order[4:]
        assert set(best.tolist()) <= picked
        bound = strat.mu[rest] - strat.kappa * strat.sigma[rest]
        explore = rest[np.lexsort((strat.tiebreak[rest], bound))[:2]]
        assert picked == set(best.tolist()) | set(explore.tolist())
    spread = strat.sigma[np.concatenate(strat.by_job)]
    assert np.isfinite(spread).all() and spread.max() > 0

"""Boosters merged into one: a bag's members averaged, groups of members summed. Built through
XGBoost's JSON model format, so the result saves, loads and predicts like any booster."""

from __future__ import annotations

import json
from typing import Any

import xgboost as xgb

from tunedb.costmodel.errors import TrainError


def _leaf_scaled(tree: dict[str, Any], factor: float) -> dict[str, Any]:
    """A tree of XGBoost's JSON model with every leaf value (and node weight) times ``factor``."""
    t = dict(tree)
    leaf = [child == -1 for child in t["left_children"]]
    t["split_conditions"] = [v * factor if is_leaf else v for v, is_leaf in zip(t["split_conditions"], leaf)]
    t["base_weights"] = [v * factor for v in t["base_weights"]]
    return t


def _base_score(doc: dict[str, Any]) -> float:
    return float(str(doc["learner"]["learner_model_param"]["base_score"]).strip("[]"))


def average_boosters(boosters: list[xgb.Booster]) -> xgb.Booster:
    """One booster whose margin is the mean of the members' margins: every member's trees with
    leaf values divided by their number, and the mean intercept. Built through XGBoost's JSON
    model format, so the result saves, loads and predicts like any booster."""
    return combine_boosters([boosters])


def combine_boosters(groups: list[list[xgb.Booster]]) -> xgb.Booster:
    """One booster whose margin is the sum over ``groups`` of the mean margin of each group's
    members (``average_boosters`` is one group)."""
    if len(groups) == 1 and len(groups[0]) == 1:
        return groups[0][0]
    docs = [(json.loads(bytes(b.save_raw(raw_format="json"))), len(g)) for g in groups for b in g]
    out = docs[0][0]
    trees: list[dict[str, Any]] = []
    info: list[int] = []
    for d, n in docs:
        m = d["learner"]["gradient_booster"]["model"]
        if int(m["gbtree_model_param"]["num_parallel_tree"]) != 1:
            raise TrainError("cannot average boosters with parallel trees")
        for t in m["trees"]:
            t = _leaf_scaled(t, 1.0 / n)
            t["id"] = len(trees)
            trees.append(t)
        info += m["tree_info"]
    model = out["learner"]["gradient_booster"]["model"]
    model.update(trees=trees, tree_info=info, iteration_indptr=list(range(len(trees) + 1)))
    model["gbtree_model_param"]["num_trees"] = str(len(trees))
    base = float(sum(_base_score(d) / n for d, n in docs))
    out["learner"]["learner_model_param"]["base_score"] = f"[{base!r}]"
    # Early-stopping marks (best_iteration) of the first member would cut the others off.
    out["learner"]["attributes"] = {}
    merged = xgb.Booster()
    merged.load_model(bytearray(json.dumps(out).encode()))
    return merged

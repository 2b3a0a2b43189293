"""The cost model on the shipped H200 fusion measurements (a Parquet export under data/).

Held-out targets on real data: pairwise accuracy >= 0.95 and top-1 score >= 0.97 over
workloads the model never saw (GroupKFold by workload). Skipped until an export with H200
fusion measurements is shipped; set TUNEDB_H200_EXPORT to point at another export directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tunedb.costmodel.features import DeviceFacts
from tunedb.costmodel.fit import fit_frame
from tunedb.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]


def _h200_exports() -> list[Path]:
    given = os.environ.get("TUNEDB_H200_EXPORT")
    candidates = [Path(given)] if given else sorted((ROOT / "data").glob("**/manifest.json"))
    out = []
    for m in candidates:
        d = m if m.is_dir() else m.parent
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if manifest.get("counts", {}).get("measurements", 0) > 0:
            out.append(d)
    return out


EXPORTS = _h200_exports()


@pytest.mark.slow
@pytest.mark.skipif(not EXPORTS, reason="no shipped Parquet export with measurements under data/")
def test_h200_fusion_model_meets_held_out_targets(tmp_path):
    with TuningStore.open(tmp_path / "h200.duckdb") as store:
        for d in EXPORTS:
            store.import_parquet(d)
        h200 = [d for d in store.devices() if "H200" in d.name]
        if not h200:
            pytest.skip("the shipped exports hold no H200 measurements")
        frame = store.training_frame(kind="fusion", device_id=h200[0].id)
    if frame.num_rows == 0:
        pytest.skip("no ok fusion measurements on the H200")
    _, m, _ = fit_frame(frame, device=DeviceFacts.from_device_info(h200[0]), folds=5, lofo=False)
    assert m["pairwise_accuracy"] >= 0.95, m
    assert m["top1_score"] >= 0.97, m
    assert m["pairwise_accuracy"] > m["baselines"]["roofline"]["pairwise_accuracy"]
    assert m["top1_score"] > m["baselines"]["random"]["top1_score"]

"""Packing workloads, candidates and host-side checks (no GPU)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tunedb.kernels.packing import (
    Candidate,
    Member,
    PackingWorkload,
    candidate_waste,
    candidates,
    padding_waste,
    partitions,
)
from tunedb.kernels.packing_suites import RESNET18, ZOO_SETS, bench_cases, skewed, suite
from tunedb.runtime.pack import _lpt, bf16_bits, bf16_values, make_inputs, reference, values, worst_error


def _mix(order=(0, 1, 2, 3), tags=("a", "b")) -> PackingWorkload:
    ms = [Member(64, 32, 16, label="x"), Member(8, 32, 16, weight=tags[0]),
          Member(24, 32, 16, weight=tags[0]), Member(64, 128, 256, dtype="bfloat16", layout="nt")]
    return PackingWorkload("mix", "test", tuple(ms[i] for i in order))


def test_hash_ignores_order_labels_and_tag_names_but_not_shapes_or_sharing():
    base = _mix()
    assert _mix((3, 1, 0, 2)).hash == base.hash
    assert _mix(tags=("zz", "b")).hash == base.hash
    relabelled = PackingWorkload("other", "fam", tuple(Member(**{**m.to_json(), "label": "q"})
                                                       for m in base.members))
    assert relabelled.hash == base.hash
    unshared = PackingWorkload("mix", "test", tuple(Member(**{**m.to_json(), "weight": ""})
                                                    for m in base.members))
    assert unshared.hash != base.hash
    bigger = PackingWorkload("mix", "test", base.members[:3] + (Member(65, 128, 256, dtype="bfloat16",
                                                                       layout="nt"),))
    assert bigger.hash != base.hash


def test_hash_is_pinned():
    """The stored identity of a workload: changing it must be deliberate (bump SCHEME)."""
    w = PackingWorkload("r", "f", (Member(256, 128, 1152), Member(256, 128, 1152)))
    assert w.hash == "81cce82e5e6bc238740d5f49583d2ddd126fc341256cdc7849deee263dfc88af"


def test_bad_members_and_shared_weights_are_refused():
    with pytest.raises(ValueError, match="non-positive"):
        Member(0, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        Member(1, 1, 1, dtype="int8")
    with pytest.raises(ValueError, match="sharing weight"):
        PackingWorkload("w", "f", (Member(4, 8, 16, weight="a"), Member(4, 8, 32, weight="a")))
    with pytest.raises(ValueError, match="no members"):
        PackingWorkload("w", "f", ())


def test_json_round_trip_and_stale_hash_refused():
    w = _mix()
    d = json.loads(json.dumps(w.to_json()))
    assert PackingWorkload.from_json(d) == w
    d["members"][0]["m"] += 1
    with pytest.raises(ValueError, match="hash"):
        PackingWorkload.from_json(d)
    for c in candidates(w):
        assert Candidate.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_padding_waste():
    ms = [Member(100, 64, 32), Member(50, 64, 32)]
    # padded to 100 rows: 150 useful of 200 rows
    assert padding_waste(ms, "padded") == pytest.approx(0.25)
    assert padding_waste(ms, "pointer") == pytest.approx(0.25)
    assert padding_waste(ms, "grouped") == 0.0
    # concat: rows 100+50 against columns 64+64, half of the blocks off the diagonal
    assert padding_waste([Member(100, 64, 32), Member(50, 64, 32)], "concat") == pytest.approx(0.5)
    ms = [Member(8, 8, 8, batch=3), Member(4, 4, 4)]
    assert padding_waste(ms, "padded") == pytest.approx(1 - (3 * 512 + 64) / (4 * 512))


def test_partitions_and_candidates_cover_every_member_once():
    w = bench_cases()[-3]  # BERT q/k/v of eight tenants
    for name, parts in partitions(w).items():
        flat = sorted(i for p in parts for i in p)
        assert flat == list(range(len(w.members))), name
    cands = candidates(w)
    names = {c.name for c in cands}
    assert {"whole:serial", "whole:grouped", "shape:padded", "whole:streams8"} <= names
    for c in cands:
        assert sorted(i for cl in c.clusters for i in cl.members) == list(range(len(w.members)))
        assert 0.0 <= candidate_waste(w, c) <= 0.75
    # equal shapes within a cluster: no waste
    assert candidate_waste(w, next(c for c in cands if c.name == "shape:padded")) == 0.0


def test_concat_only_for_thin_outputs_of_one_k():
    lora = next(w for w in bench_cases() if w.family == "lora")
    assert "k:concat" in {c.name for c in candidates(lora)}
    moe = next(w for w in bench_cases() if w.family == "moe")  # 8 x 2816 columns: too wide
    assert not any(cl.backend == "concat" for c in candidates(moe) for cl in c.clusters)


def test_mixed_dtypes_are_not_grouped_or_padded_together():
    w = _mix()
    for c in candidates(w):
        for cl in c.clusters:
            if cl.backend in ("padded", "pointer", "grouped", "concat"):
                assert len({w.members[i].dtype for i in cl.members}) == 1, c.name


def test_suites():
    std = suite("standard")
    assert len(std) >= 200
    assert len({w.hash for w in std}) == len(std)
    fams = {w.family for w in std}
    assert {"replicas", "resnet18_tenants", "resnet50_tenants", "bert_tenants", "gpt2_tenants",
            "moe", "lora"} <= fams
    r18 = next(w for w in bench_cases() if w.family == "resnet18_tenants")
    assert len(r18.members) == 4 * len(RESNET18) == 44
    assert sum(skewed(2048, 8, 1.2)) == 2048
    assert {"zoo"} <= fams and sum(w.family == "zoo" for w in std) == len(ZOO_SETS)
    with pytest.raises(ValueError, match="unknown packing suite"):
        suite("huge")


def test_padded_t_stacks_the_weights_the_other_way_at_the_same_waste():
    lora = next(w for w in bench_cases() if w.family == "lora")
    by_name = {c.name: c for c in candidates(lora)}
    assert {"whole:padded", "whole:padded_t"} <= set(by_name)
    assert candidate_waste(lora, by_name["whole:padded_t"]) == candidate_waste(lora, by_name["whole:padded"])
    assert not any(c.concurrent > 1 for c in candidates(lora) if "padded_t" in c.name)


def test_bf16_rounding_is_nearest_even():
    a = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.0e38], dtype=np.float32)
    got = bf16_values(bf16_bits(a))
    assert got.tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5, np.float32(bf16_values(bf16_bits(a))[4])]
    assert got[2] == 1.0 + 2**-6  # halfway 1+3/256 rounds to even mantissa 1+4/256
    assert abs(got[4] - 3.0e38) / 3.0e38 < 2**-8


def test_reference_and_error_check_on_host():
    w = _mix()
    inputs = make_inputs(w, seed=1)
    assert inputs[1][1] is inputs[2][1]  # shared weight
    refs = reference(w, inputs)
    assert [r.shape for r in refs] == [(1, m.m, m.n) for m in w.members]
    # float32 products of the same values pass; a one-element slip fails
    got = []
    for mb, (x, wt) in zip(w.members, inputs):
        xv, wv = values(x, mb.dtype).astype(np.float32), values(wt, mb.dtype).astype(np.float32)
        got.append(xv @ (wv if mb.layout == "nn" else wv.transpose(0, 2, 1)))
    assert worst_error(w, got, refs) <= 1.0
    got[0] = got[0].copy()
    got[0][0, 3, 4] += 1.0
    assert worst_error(w, got, refs) > 1.0


def test_lpt_balances():
    cost = [9, 7, 6, 5, 4, 1].__getitem__
    bins = _lpt(range(6), cost, 2)
    assert sorted(i for b in bins for i in b) == list(range(6))
    # largest first onto the lighter branch: 9,5,1 | 7,6,4 (within LPT's 4/3 of the best 16/16)
    assert sorted(sum(cost(i) for i in b) for b in bins) == [15, 17]
    assert len(_lpt(range(2), cost, 8)) == 2  # no empty branches


def _cublas_header() -> Path | None:
    """cublas_api.h from $CUBLAS_INCLUDE, the CUDA toolkit of nvcc, or the nvidia-cublas wheel."""
    named = Path(os.environ.get("CUBLAS_INCLUDE", "/nonexistent")) / "cublas_api.h"
    if named.is_file():
        return named
    for root in [Path(p) for p in (shutil.which("nvcc") or "",) if p]:
        cand = root.resolve().parent.parent / "include" / "cublas_api.h"
        if cand.is_file():
            return cand
    try:
        import nvidia.cu13  # type: ignore[import-not-found]

        cand = Path(list(nvidia.cu13.__path__)[0]) / "include" / "cublas_api.h"
        return cand if cand.is_file() else None
    except ImportError:
        return None


# The older GEMMs have C++ overloads (compute type as cudaDataType) that decltype cannot pick.
CHECKED = ("cublasGemmGroupedBatchedEx",)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED)
def test_ctypes_signature_matches_cublas_header(tmp_path, name):
    """The argument kinds blas.py gives ctypes match cublas_api.h, position by position: a
    pointer where the header has a pointer (handles and arrays), a 4-byte integer or enum where
    it has int, an 8-byte integer for long long (checked by static_assert, compiled by nvcc)."""
    header = _cublas_header()
    if header is None or shutil.which("nvcc") is None:
        pytest.skip("no nvcc or cublas_api.h here")
    from tunedb.runtime import blas

    src = Path(blas.__file__).read_text()
    start = src.index(f'"{name}": [')
    text = src[start:src.index("]", start) + 1].split(":", 1)[1]
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    kinds = eval(text, {"vp": vp, "i": i, "ll": ll})  # noqa: S307 - our own source, known names
    checks = []
    for pos, k in enumerate(kinds):
        t = f"std::tuple_element_t<{pos}, Args<F>::tuple>"
        if k is vp:
            checks.append(f"static_assert(std::is_pointer_v<{t}>, \"arg {pos} is a pointer\");")
        else:
            size = 8 if k is ll else 4
            checks.append(f"static_assert((std::is_integral_v<{t}> || std::is_enum_v<{t}>) && "
                          f"!std::is_pointer_v<{t}> && sizeof({t}) == {size}, \"arg {pos}\");")
    (tmp_path / "sig.cpp").write_text(
        '#include <tuple>\n#include <type_traits>\n#include "cublas_api.h"\n'
        "template <class T> struct Args;\n"
        "template <class R, class... A> struct Args<R (*)(A...)> {\n"
        "  using tuple = std::tuple<A...>; static constexpr int n = sizeof...(A); };\n"
        f"using F = decltype(&{name});\n"
        f"static_assert(Args<F>::n == {len(kinds)}, \"argument count\");\n"
        + "\n".join(checks) + "\nint main() { return 0; }\n")
    res = subprocess.run(["nvcc", "-std=c++17", "-c", str(tmp_path / "sig.cpp"), "-o",
                          str(tmp_path / "sig.o"), f"-I{header.parent}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_cli_bench_packing_refuses_bad_suite_in_one_line():
    import sys

    res = subprocess.run([sys.executable, "-m", "tunedb", "bench", "packing", "--suite", "huge"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "unknown packing suite 'huge'" in res.stderr

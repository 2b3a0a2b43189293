"""Workload suites: sizes, families, dtypes, shapes, anchors, determinism."""

from __future__ import annotations

import pytest

from tunedb.graph.hashing import graph_hash
from tunedb.kernels import ANCHOR_CASES, FAMILIES, analyze, suite
from tunedb.kernels.suites import case

ANCHOR_NAMES = {
    "bias_gelu_8192x4096", "add_layernorm_8192x4096", "add_layernorm_65536x768",
    "scale_mask_softmax_8192x4096", "softmax_262144x128", "softmax_1024x32768", "rmsnorm_8192x4096",
    "transpose_add_8192x4096", "col_center_8192x4096", "eltwise_chain8_8192x4096",
    "softmax_xent_8192x4096", "swiglu_8192x4096",
}


def _dtypes(c) -> set[str]:
    return {c.graph.type_of(v).dtype for v in c.graph.inputs} - {"int64", "bool"}


def test_quick_covers_every_family_and_dtype():
    q = suite("quick")
    assert 12 <= len(q) <= 20
    assert {c.family for c in q} == set(FAMILIES)
    assert set().union(*(_dtypes(c) for c in q)) == {"float32", "float16", "bfloat16"}
    assert all(c.graph.floor_bytes() < 8 * 2 ** 20 for c in q)


def test_standard_size_families_shapes_dtypes():
    s = suite("standard")
    assert len(s) >= 300
    assert len({c.name for c in s}) == len(s)
    assert len(set(FAMILIES)) >= 8 and {c.family for c in s} == set(FAMILIES)
    for fam in FAMILIES:
        assert set().union(*(_dtypes(c) for c in s if c.family == fam)) == {"float32", "float16", "bfloat16"}
    fb = [c.floor_bytes for c in s]
    assert min(fb) <= 32 * 768 * 4 * 3 and max(fb) >= 128 * 2 ** 20
    inner = {c.graph.type_of(c.graph.outputs[0]).shape[-1] for c in s}
    assert any(d % 4 for d in inner) and any(d % 32 for d in inner)
    assert ANCHOR_NAMES <= {c.name for c in s}


def test_every_standard_case_is_supported():
    for c in suite("standard"):
        analyze(c.graph)  # raises UnsupportedFusion otherwise


def test_full_extends_standard():
    s, f = suite("standard"), suite("full")
    assert {c.name for c in s} < {c.name for c in f}


def test_anchor_definitions_and_floor_bytes():
    assert {c.name for c in ANCHOR_CASES} == ANCHOR_NAMES
    by = {c.name: c for c in ANCHOR_CASES}
    mb = 8192 * 4096 * 4
    assert by["bias_gelu_8192x4096"].floor_bytes == 2 * mb + 4096 * 4
    assert by["add_layernorm_8192x4096"].floor_bytes == 3 * mb + 2 * 4096 * 4
    assert by["softmax_xent_8192x4096"].floor_bytes == mb + 8192 * 8 + 8192 * 4
    assert by["transpose_add_8192x4096"].floor_bytes == 3 * mb
    assert by["col_center_8192x4096"].floor_bytes == 2 * mb
    assert by["softmax_1024x32768"].floor_bytes == 2 * mb + 32768 * 4  # x·0.125 + m[N]
    tr = by["transpose_add_8192x4096"].graph
    assert tr.type_of("x").shape == (8192, 4096) and tr.type_of("z").shape == (4096, 8192)
    assert {c.graph.type_of(c.graph.outputs[0]).dtype for c in ANCHOR_CASES} == {"float32"}
    patterns = {c.name: analyze(c.graph).pattern for c in ANCHOR_CASES}
    assert patterns["col_center_8192x4096"] == "col_reduce"
    assert patterns["transpose_add_8192x4096"] == "transpose"
    assert patterns["softmax_xent_8192x4096"] == "row_reduce"


def test_suites_are_deterministic():
    a = [(c.name, graph_hash(c.graph)) for c in suite("quick")]
    b = [(c.name, graph_hash(c.graph)) for c in suite("quick")]
    assert a == b


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown suite 'huge'"):
        suite("huge")
    with pytest.raises(ValueError, match="unknown softmax variant"):
        case("softmax", "sparsemax", 8, 8)


def test_anchors_suite_is_the_anchor_cases_alone():
    from tunedb.kernels.suites import ANCHOR_CASES

    assert [c.name for c in suite("anchors")] == [c.name for c in ANCHOR_CASES]
    assert {c.name for c in ANCHOR_CASES} <= {c.name for c in suite("standard")}

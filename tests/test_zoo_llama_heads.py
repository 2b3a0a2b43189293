"""Llama's attention heads in one fused step (the zoo's llama_small failure on the H200): the
planner had fused the query's rotary embedding with two copies its kernel cannot write on the
query's [B*H*S, D] domain, and the whole model came out wrong (and differently each run):

* the value heads [B, KV, S, D], a view of a smaller input, were stored at every index of the
  domain, twice past their end;
* the keys' repeated heads transposed (k^T of repeat_kv, expand -> reshape -> transpose) were
  read as if the input held every repeated head, past the end of the input.

The generator now refuses both (``UnsupportedFusion``), so the planner keeps them apart; the
emulated run of every fused step of the plan matches the float64 reference.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tunedb
from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.kernels import generate
from tunedb.kernels.analysis import UnsupportedFusion, analyze
from tunedb.kernels.schedule import Schedule
from tunedb.runtime.inputs import bf16_bits, make_inputs, storage_dtype
from tunedb.runtime.tolerance import compare_outputs

B, S, H, KV, D = 1, 16, 4, 2, 8


def _rotary(b: GraphBuilder, x: str, cos: str, sin: str) -> str:
    """x * cos + rotate_half(x) * sin, as the exported Llama computes it."""
    lo = b.slice(x, starts=(0,), ends=(D // 2,), axes=(3,))
    hi = b.slice(x, starts=(D // 2,), ends=(D,), axes=(3,))
    return b.add(b.mul(x, cos), b.mul(b.concat(b.neg(hi), lo, axis=3), sin))


def _heads(b: GraphBuilder, x: str, n: int) -> str:
    return b.transpose(b.reshape(x, shape=(B, S, n, D)), perm=(0, 2, 1, 3))


def llama_heads(values: bool = True, keys_t: bool = True) -> object:
    """The planned step of llama_small: the query's heads with their rotary embedding, beside
    (``values``) the value heads and (``keys_t``) the repeated key heads transposed."""
    b = GraphBuilder(f"llama_heads_{int(values)}{int(keys_t)}")
    q = b.input("q", (B, S, H * D))
    cos, sin = b.input("cos", (1, 1, S, D)), b.input("sin", (1, 1, S, D))
    outs = [_rotary(b, _heads(b, q, H), cos, sin)]
    if values:
        outs.insert(0, _heads(b, b.input("v", (B, S, KV * D)), KV))
    if keys_t:
        k = b.input("k", (B, KV, 1, S, D))  # rotated key heads, unsqueezed for repeat_kv
        rep = b.reshape(b.expand(k, shape=(B, KV, H // KV, S, D)), shape=(B * H, S, D))
        outs.append(b.reshape(b.transpose(rep, perm=(0, 2, 1)), shape=(B, H, D, S)))
    return b.build(outs)


def test_smaller_copies_beside_the_query_heads_are_refused():
    with pytest.raises(UnsupportedFusion, match="non-full-size output"):
        analyze(llama_heads(values=True, keys_t=False))
    with pytest.raises(UnsupportedFusion, match="read transposed"):
        analyze(llama_heads(values=False, keys_t=True))
    assert analyze(llama_heads(values=False, keys_t=False)).pattern == "elementwise"


def _stored(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits(np.asarray(a, np.float32))
    return np.ascontiguousarray(np.asarray(a).astype(storage_dtype(dtype)))


def emulated_step_errors(plan: object, inputs: dict, workdir: str) -> list[tuple[int, str, float]]:
    """Every fused step of ``plan`` generated with its schedule, run on the CPU emulator on the
    values the float64 reference walk gives its inputs: (step, worst output, error / tolerance)."""
    from tunedb.runtime import emu

    g = plan.graph
    env = {v: np.asarray(inputs[v]) for v in g.inputs}
    env.update({v: c.array for v, c in g.constants})
    errors = []
    for n, step in enumerate(plan.steps):
        sub = step.graph
        ins = {s: env[v] for s, v in zip(sub.inputs, step.inputs)}
        want = run_reference(sub, ins)
        if step.kind == "fused":
            kp = generate(sub, Schedule.from_config(step.config_dict), sm_count=2)
            bufs = {s: _stored(ins[s], sub.type_of(s).dtype) for s in sub.inputs}
            bufs.update({name: _stored(c.array, c.type.dtype) for name, c in sub.constants})
            # the outputs in one block with a poisoned margin: a store past an end shows
            pad = {v: emu.poisoned_outputs(sub)[v] for v in sub.outputs}
            guard = {v: np.concatenate([p.reshape(-1), p.reshape(-1)]) for v, p in pad.items()}
            bufs.update(guard)
            emu.run_plan(emu.build([k.source for k in kp.kernels], workdir), kp, bufs)
            got = {v: guard[v][:pad[v].size].reshape(pad[v].shape) for v in sub.outputs}
            worst, err = compare_outputs(sub, got, want)
            tail_ok = all(np.array_equal(guard[v][pad[v].size:], pad[v].reshape(-1), equal_nan=True)
                          for v in sub.outputs)
            errors.append((n, worst, err if tail_ok else float("inf")))
        env.update({v: want[s] for s, v in zip(sub.outputs, step.outputs)})
    return errors


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_the_planned_heads_match_the_reference_in_emulation(tmp_path):
    g = llama_heads()
    plan = tunedb.compile(g, cost_model=False, device=None)
    _, ref = make_inputs(g, 7)
    errors = emulated_step_errors(plan, ref, str(tmp_path))
    assert errors and all(err <= 1.0 for _, _, err in errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("file", ["llama_small_dynamo_fp32.onnx", "llama_small_dynamo_bf16.onnx"])
def test_llama_default_plan_matches_the_reference_on_the_gpu(file):
    # The whole default plan (no fold_grouped_kv) as the zoo benchmark runs it: one CUDA graph
    # whose replay equals the eager run, outputs within the reference's tolerance.
    from pathlib import Path

    from plan_checks import check_outputs

    from tunedb.bench.plan import weighted_model
    from tunedb.graph.onnx_import import import_onnx
    from tunedb.runtime.executor import PlanExecutor

    zoo = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
    plan = tunedb.compile(import_onnx(weighted_model(zoo / file)), device="cuda")
    ex = PlanExecutor(plan)
    assert ex.graph_capture, ex.capture_error
    dev, ref_in = make_inputs(plan.graph, 3)
    check_outputs(plan, {k: v.get() for k, v in ex.run(dev).items()}, ref_in)

"""Real-model inputs: weights at their fan-in scale keep whole CNNs finite and bounded.

ResNet-18 and MobileNetV2 built layer by layer (weights, batch-norm scales, shifts, means and
variances as graph inputs, 64x64 images to keep the float64 reference quick) run through the
reference on ``make_inputs``' values. Standard normal noise on every input, as before, grew
the activations by ~sqrt(fan_in) a convolution (ResNet-18 overflowed to 1e19) or put negative
variances under a root.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tunedb.graph.builder import GraphBuilder
from tunedb.graph.reference import run_reference
from tunedb.runtime.inputs import input_roles, make_inputs
from tunedb.runtime.tolerance import output_scale

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"


class _Net:
    def __init__(self, name: str) -> None:
        self.b = GraphBuilder(name)
        self.n = 0

    def param(self, shape: tuple[int, ...]) -> str:
        self.n += 1
        return self.b.input(f"p{self.n}", shape)

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
                act: str | None = "relu") -> str:
        w = self.param((cout, cin // groups, k, k))
        p = k // 2
        y = self.b.conv2d(x, w, strides=(stride, stride), pads=(p, p, p, p), groups=groups)
        y = self.b.batchnorm(y, self.param((cout,)), self.param((cout,)), self.param((cout,)),
                             self.param((cout,)))
        if act == "relu":
            return self.b.relu(y)
        if act == "relu6":
            return self.b.clip(y, min=0.0, max=6.0)
        return y

    def head(self, x: str, c: int) -> str:
        pooled = self.b.reshape(self.b.global_avg_pool(x), shape=(1, c))
        return self.b.gemm(pooled, self.param((1000, c)), self.param((1000,)), trans_b=True)


def resnet18(size: int = 64):
    net = _Net("resnet18")
    b = net.b
    x = net.conv_bn(b.input("image", (1, 3, size, size)), 3, 64, 7, stride=2)
    x = b.max_pool2d(x, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for i in range(2):
            s = stride if i == 0 else 1
            y = net.conv_bn(net.conv_bn(x, cin, cout, 3, s), cout, cout, 3, act=None)
            skip = x if s == 1 and cin == cout else net.conv_bn(x, cin, cout, 1, s, act=None)
            x, cin = b.relu(b.add(y, skip)), cout
    return b.build([net.head(x, 512)])


def mobilenet_v2(size: int = 64):
    net = _Net("mobilenet_v2")
    b = net.b
    x = net.conv_bn(b.input("image", (1, 3, size, size)), 3, 32, 3, stride=2, act="relu6")
    cin = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            stride, hidden = (s if i == 0 else 1), cin * t
            y = net.conv_bn(x, cin, hidden, 1, act="relu6") if t != 1 else x
            y = net.conv_bn(y, hidden, hidden, 3, stride, groups=hidden, act="relu6")
            y = net.conv_bn(y, hidden, c, 1, act=None)
            x, cin = (b.add(x, y) if stride == 1 and cin == c else y), c
    return b.build([net.head(net.conv_bn(x, cin, 1280, 1, act="relu6"), 1280)])


@pytest.fixture(scope="module", params=["resnet18", "mobilenet_v2"])
def net(request):
    return {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2}[request.param]()


def test_roles_of_a_cnn_s_inputs(net) -> None:
    roles = input_roles(net)
    convs = [n for n in net.nodes if n.op == "conv2d"]
    for n in convs:
        w = net.type_of(n.inputs[1]).shape
        assert roles[n.inputs[1]] == ("weight", w[1] * w[2] * w[3])
    assert roles["image"] == ("data", 0)
    kinds = [k for k, _ in roles.values()]
    # each batch norm: a scale, a shift, a mean (a shift) and a variance under the root
    assert kinds.count("positive") == len(convs) and kinds.count("scale") == len(convs)
    assert kinds.count("shift") == 2 * len(convs) + 1  # + the classifier's bias


def test_fan_in_scaled_inputs_keep_the_logits_finite_and_bounded(net) -> None:
    _, ref_in = make_inputs(net, 0)
    logits = run_reference(net, ref_in)[net.outputs[0]]
    assert np.isfinite(logits).all()
    assert 1e-2 < output_scale(logits) < 1e2 and np.abs(logits).max() < 1e3
    # the variances drawn are positive, the weights at 1/sqrt(fan_in)
    roles = input_roles(net)
    for v, (kind, fan_in) in roles.items():
        if kind == "positive":
            assert ref_in[v].min() > 0
        if kind == "weight":
            assert abs(float(np.std(ref_in[v])) * np.sqrt(fan_in) - 1) < 0.2


def test_uniform_noise_on_every_input_blows_up(net) -> None:
    rng = np.random.default_rng(0)
    noise = {v: rng.standard_normal(net.type_of(v).shape).astype(np.float32) for v in net.inputs}
    with np.errstate(all="ignore"):
        logits = run_reference(net, noise)[net.outputs[0]]
    assert not np.isfinite(logits).all() or np.abs(logits).max() > 1e6


def test_bench_plan_weights_agree_with_onnxruntime() -> None:
    """``tunedb bench plan``'s ONNX weights (fan-in scaled): reference and onnxruntime agree."""
    pytest.importorskip("onnxruntime")
    from tunedb.bench.plan import INPUT_SEED, Entry, load_entry, onnxruntime_outputs, rel_l2

    graph, model = load_entry(Entry("resnet_piece", "x", path=GRAPHS / "resnet_piece.onnx"))
    dev, ref_in = make_inputs(graph, INPUT_SEED)
    ref = run_reference(graph, ref_in)[graph.outputs[0]]
    ort = onnxruntime_outputs(model, graph, dev)[graph.outputs[0]]
    assert 0.1 < output_scale(ref) < 10  # a real network's logits, not 0.02-scaled noise
    assert rel_l2(ort, ref) < 1e-5

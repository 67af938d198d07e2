"""Inference tunes only the op a layer's forward runs (a convolution's fwd, a transposed
convolution's bwd_data, its convolution problem's): under ``torch.no_grad``,
``torch.inference_mode`` or with nothing requiring a gradient, on first sight of a shape. A
later training step tunes the missing ops then, and its gradients match ``torch.nn``. The
tuning cache itself shows what was measured (the tuner's ``missing`` tasks per op)."""

import copy
import json

import pytest
import torch
from torch import nn

import mucudnn.torch as mt
from mucudnn import _tuner
from mucudnn._lib import MucudnnError
from mucudnn.torch import _runtime
from converted import NATIVE, by_pytorch, converted_layers, name_of, plans_of, python_path_only

ALL = ("fwd", "bwd_data", "bwd_filter")

# name: (ours, theirs, input shape, layer arguments, the op its forward runs)
LAYERS = {
    "conv2d": (mt.Conv2d, nn.Conv2d, (2, 3, 6, 6), dict(out_channels=4, kernel_size=3,
                                                          padding=1), "fwd"),
    "conv3d": (mt.Conv3d, nn.Conv3d, (2, 2, 4, 5, 5), dict(out_channels=3, kernel_size=3,
                                                             padding=1), "fwd"),
    "conv_transpose3d": (mt.ConvTranspose3d, nn.ConvTranspose3d, (2, 3, 2, 3, 3),
                         dict(out_channels=2, kernel_size=3, stride=2, padding=1,
                              output_padding=1), "bwd_data"),
}


def make(kind, cache):
    ours_cls, theirs_cls, shape, kwargs, op = LAYERS[kind]
    torch.manual_seed(0)
    ours = ours_cls(shape[1], cache=str(cache), fallback=False, name=f"inference.{kind}",
                    **kwargs)
    theirs = theirs_cls(shape[1], **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs, torch.randn(shape), op


def assert_close(ours, theirs, what):
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * max(scale, 1e-30), msg=what)


def only_report(layer):
    reports = list(plans_of(layer).values())
    assert len(reports) == 1, reports
    assert reports[0].fallback is None
    return reports[0]


def problem_and_settings(layer):
    """The C ABI problem of the layer's one prepared plan set, and its tuning settings."""
    if NATIVE:
        (doc,) = mt._native.reports(layer._mucudnn.options, layer._mucudnn.signature)
        settings = json.loads(layer._mucudnn.options)["settings"]
        return doc["problem"], _tuner.Settings(**settings)
    (key,) = list(layer._mucudnn.prepared)
    return _runtime.problem_of(key), layer._mucudnn.settings


def cached_ops(layer, cache):
    """The ops whose measurements the cache file holds in full for the layer's one problem:
    those a fresh tuner on the same file lists no missing task for."""
    problem, settings = problem_and_settings(layer)
    tuner = _tuner.Tuner(cache=str(cache))
    try:
        tasks = tuner.missing([{"layer": "probe", "problem": problem}], settings)
    finally:
        tuner.close()
    missing = {task["op"] for task in tasks}
    return tuple(op for op in ALL if op not in missing)


def train_step(ours, theirs, x):
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [ours(xs[0])]
    grad = torch.randn_like(ys[0])
    ys[0].backward(grad)
    with by_pytorch():
        ys.append(theirs(xs[1]))
        ys[1].backward(grad)
    assert_close(ys[0], ys[1], "forward")
    assert_close(xs[0].grad, xs[1].grad, "input gradient")
    assert_close(ours.weight.grad, theirs.weight.grad, "weight gradient")
    assert_close(ours.bias.grad, theirs.bias.grad, "bias gradient")


INFERENCE = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.mark.python_smoke
@pytest.mark.parametrize("mode", list(INFERENCE))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_inference_tunes_only_the_forward_op_then_training_tunes_the_rest(
    kind, mode, tmp_path
):
    cache = tmp_path / "cache.sqlite"
    ours, theirs, x, op = make(kind, cache)
    with INFERENCE[mode]():
        y = ours(x)
        with by_pytorch():
            expected = theirs(x)
        assert_close(y, expected, f"{kind} inference forward")
    report = only_report(ours)
    assert report.tuned_ops == (op,)
    assert list(report.ops) == [op]
    assert report.measured > 0
    assert "not tuned (no backward yet)" in str(report)
    if not NATIVE:  # the prepared plan set itself (the native path reports what it prepared)
        (ready,) = list(ours._mucudnn.prepared.values())
        assert ready.has == tuple(name == op for name in ALL)
    # The cache holds the forward op's measurements, none of the others'.
    assert cached_ops(ours, cache) == (op,)
    forward_measured = report.measured
    # Inference again: nothing new.
    with INFERENCE[mode]():
        ours(x)
    assert only_report(ours).measured == forward_measured
    # A training step tunes the missing ops on its backward, and its gradients are right.
    train_step(ours, theirs, x)
    report = only_report(ours)
    assert report.tuned_ops == ALL
    assert report.measured > forward_measured
    assert cached_ops(ours, cache) == ALL
    if not NATIVE:
        (ready,) = list(ours._mucudnn.prepared.values())
        assert ready.has == (True, True, True)
    # And the next step only executes.
    measured = report.measured
    train_step(ours, theirs, x)
    assert only_report(ours).measured == measured


@pytest.mark.parametrize("kind", list(LAYERS))
def test_training_tunes_all_three_ops_on_its_forward(kind, tmp_path):
    cache = tmp_path / "cache.sqlite"
    ours, theirs, x, _ = make(kind, cache)
    y = ours(x.clone().requires_grad_())
    # Before any backward: the forward tuned all three (a backward is expected).
    assert only_report(ours).tuned_ops == ALL
    assert cached_ops(ours, cache) == ALL
    y.sum().backward()
    ours.zero_grad()
    train_step(ours, theirs, x)


@pytest.mark.xfail(NATIVE, strict=True, reason=(
    "native path: with gradients on, the kernel tunes all three ops whether or not anything "
    "requires a gradient (PyTorch's stable C interface has no requires_grad to read below "
    "autograd): a frozen layer measures backward ops it never runs"))
def test_frozen_weights_with_gradients_on_tune_only_the_forward(tmp_path):
    cache = tmp_path / "cache.sqlite"
    ours, theirs, x, _ = make("conv3d", cache)
    ours.requires_grad_(False)
    ours(x)  # gradients on, but neither the input nor the weight requires one
    assert only_report(ours).tuned_ops == ("fwd",)
    # The input requiring a gradient: the backward-data is needed, all ops tune.
    ours.requires_grad_(True)
    train_step(ours, theirs, x)
    assert only_report(ours).tuned_ops == ALL


@python_path_only  # its custom ops
def test_direct_op_calls_decide_from_their_tensors(tmp_path):
    """Without a layer to say so, an op call with gradients on reaches the kernel only when
    nothing requires one (inference); under no_grad a weight requiring a gradient cannot be
    told apart from autograd's own call, so all three ops tune."""
    cache = tmp_path / "cache.sqlite"
    settings = _tuner.Settings()
    x = torch.randn(2, 2, 5, 5)
    w = torch.randn(3, 2, 3, 3)
    plain = _runtime.config_text("direct.plain", settings, str(cache), False, False)
    mt._ops.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1, plain)
    config = _runtime.config_for(plain)
    (report,) = config.reports.values()
    assert report.tuned_ops == ("fwd",)
    hinted = _runtime.config_text("direct.grad", settings, str(cache), False, False)
    with torch.no_grad():
        mt._ops.conv2d(x, w.requires_grad_(), None, [1, 1], [1, 1], [1, 1], 1, hinted)
    (report,) = _runtime.config_for(hinted).reports.values()
    assert report.tuned_ops == ALL


def test_tune_for_inference_tunes_the_forward_ops_only(tmp_path):
    from test_torch_nd import Mixed, mixed_inputs

    torch.manual_seed(0)
    original = Mixed()
    forward = mt.convert_(copy.deepcopy(original), cache=str(tmp_path / "a.sqlite"),
                          fallback=False)
    full = mt.convert_(copy.deepcopy(original), cache=str(tmp_path / "b.sqlite"),
                       fallback=False)
    with pytest.raises(ValueError, match="give \"all\""):
        mt.tune(forward, *mixed_inputs(), verbose=False, ops="backward")
    inference = mt.tune(forward, *mixed_inputs(), verbose=False, ops="forward")
    training = mt.tune(full, *mixed_inputs(), verbose=False)
    assert inference.layers == training.layers == 9
    assert 0 < inference.measured < training.measured
    layers = converted_layers(forward)
    assert len(layers) == 9

    def problem(layer):
        report = only_report(layer)
        return report.shape, report.weight_shape, report.output_shape

    # The op each layer's forward runs. On the native path layers of one problem share one
    # plan set (Mixed's ConvTranspose3d mirrors the Conv3d before it: its forward is that
    # convolution's bwd_data), which holds the forward ops of them all.
    needed = {}
    for layer in layers:
        op = "bwd_data" if layer.transposed else "fwd"
        needed.setdefault(problem(layer) if NATIVE else name_of(layer), set()).add(op)
    assert not NATIVE or max(len(ops) for ops in needed.values()) == 2
    for layer in layers:
        expected = needed[problem(layer) if NATIVE else name_of(layer)]
        assert set(only_report(layer).tuned_ops) == expected, name_of(layer)
    for layer in converted_layers(full):
        assert only_report(layer).tuned_ops == ALL
    # Inference after it only executes; training tunes the backward ops, and matches.
    with torch.no_grad():
        before = [only_report(layer).measured for layer in layers]
        with by_pytorch():
            expected = original(*mixed_inputs())
        for ours, theirs in zip(forward(*mixed_inputs()), expected):
            assert_close(ours, theirs, "inference after tune")
        assert [only_report(layer).measured for layer in layers] == before
    torch.manual_seed(1)
    with by_pytorch():
        expected = original(*mixed_inputs())
    for ours, theirs in zip(forward(*mixed_inputs()), expected):
        grad = torch.randn_like(theirs)
        ours.backward(grad)
        with by_pytorch():
            theirs.backward(grad)
    for (name, ours), (_, theirs) in zip(forward.named_parameters(), original.named_parameters()):
        assert_close(ours.grad, theirs.grad, f"{name} gradient")
    for layer in layers:
        assert only_report(layer).tuned_ops == ALL


def test_tuner_settings_ops(tmp_path):
    tuner = _tuner.Tuner(cache=False)
    try:
        problem = _tuner.problem(n=2, c=2, h=4, w=4, k=2, r=3, s=3, padding=(1, 1))
        result = tuner.tune("t", problem, _tuner.Settings(ops=("bwd_filter", "fwd")))
        assert [plan["op"] for plan in result["plans"]] == ["fwd", "bwd_filter"]
        assert len(result["splits"]) == 2
        prepared = tuner.prepare(result["plans"])
        assert prepared.ops == ("fwd", "bwd_filter") and prepared.workspace[1] == 0
        prepared.release()
        with pytest.raises(MucudnnError, match="ops is empty") as error:
            tuner.tune("t", problem, _tuner.Settings(ops=()))
        assert error.value.status == "INVALID_ARGUMENT"
        with pytest.raises(MucudnnError, match="unknown op `forward`"):
            tuner.tune("t", problem, _tuner.Settings(ops=("forward",)))
    finally:
        tuner.close()


@python_path_only  # its runtime's key; the native path's refusal is tested on a GPU
def test_graph_capture_refuses_a_key_tuned_for_inference_only(monkeypatch):
    """Under CUDA graph capture a key (or an op of it) not tuned before is a clear error (no
    GPU needed: capture is reported by a stand-in, the refusal comes before any GPU call)."""
    config = _runtime.config_for(
        _runtime.config_text("capture", _tuner.Settings(), False, False, False)
    )
    key = ("cuda", 0) + _runtime.plan_key(
        torch.empty(2, 2, 5, 5), (3, 2, 3, 3), (1, 1), (1, 1), (1, 1), 1
    )[2:]

    class ForwardOnly:
        has = (True, False, False)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="was not tuned before CUDA graph capture"):
        _runtime.plans_for(config, key, (_tuner.FORWARD,))
    config.prepared[key] = ForwardOnly()
    try:
        assert _runtime.plans_for(config, key, (_tuner.FORWARD,)) is config.prepared[key]
        with pytest.raises(RuntimeError, match="has no bwd_data, bwd_filter plan .* before "
                                               "CUDA graph capture"):
            _runtime.plans_for(config, key, _runtime.ALL_OPS)
    finally:
        config.prepared.pop(key)

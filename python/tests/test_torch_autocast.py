"""Autocast: under ``torch.autocast`` a converted model runs its
convolutions in the autocast dtype like ``nn.Conv2d`` (output dtype, values and fp32
parameter gradients), and a convolution fed by an autocast op's lower-precision output runs
instead of raising."""

import copy

import pytest
import torch
import torch.nn as nn

import mucudnn.torch as mt
from converted import NATIVE, by_pytorch, converted_layers, fallbacks, name_of, plans_of, ran


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False),  # fed by a bf16 conv output
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 4),  # an autocast op too
    )


def linear_then_conv(seed=0):
    """A conv fed by an autocast op (``nn.Linear`` runs in bf16 under CPU autocast)."""
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 4 * 6 * 6)
            self.conv = nn.Conv2d(4, 6, 3)

        def forward(self, x):
            return self.conv(self.linear(x).view(-1, 4, 6, 6))

    return Net()


def rel_error(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(net, x, dtype):
    net.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        y = net(x)
    y.float().square().sum().backward()
    return y, [p.grad.clone() for p in net.parameters()]


def reference_run(net, x, dtype):
    with by_pytorch():
        return run(net, x, dtype)


def assert_ran_in(model, dtype):
    """Every converted layer ran its forward and weight gradient through mucudnn, in
    ``dtype``."""
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    for layer in converted_layers(model):
        counts = ran(name_of(layer))
        assert counts.get("fwd") == 1 and counts.get("bwd_filter") == 1, (name_of(layer), counts)
        assert {r.dtype for r in plans_of(layer).values()} == {dtype_name}
    assert fallbacks() == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_converted_model_under_cpu_autocast_matches_nn_conv2d(dtype):
    original = model()
    ours = mt.convert_(copy.deepcopy(original), cache=False)
    x = torch.randn(4, 3, 6, 6)
    y_ref, grads_ref = reference_run(original, x, dtype)
    y, grads = run(ours, x, dtype)
    assert_ran_in(ours, dtype)
    assert y.dtype == y_ref.dtype == dtype
    # Both sides round to the autocast dtype; they differ by their summation orders only.
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert rel_error(y, y_ref) < tolerance
    for ours_grad, ref_grad in zip(grads, grads_ref):
        assert ours_grad.dtype == ref_grad.dtype == torch.float32  # fp32 master parameters
        assert rel_error(ours_grad, ref_grad) < tolerance
    # The convs really ran in the lower precision: fp32 is measurably further away.
    with by_pytorch():
        y32 = original(x)
    assert rel_error(y.float(), y32) > 1e-4


def test_conv_fed_by_an_autocast_op_runs():
    original = linear_then_conv()
    ours = mt.convert_(copy.deepcopy(original), cache=False)
    x = torch.randn(3, 5)
    y_ref, grads_ref = reference_run(original, x, torch.bfloat16)
    y, grads = run(ours, x, torch.bfloat16)
    assert_ran_in(ours, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert rel_error(y, y_ref) < 2e-2
    for ours_grad, ref_grad in zip(grads, grads_ref):
        assert rel_error(ours_grad, ref_grad) < 2e-2


@pytest.mark.python_smoke
def test_without_autocast_a_dtype_mismatch_is_still_an_error():
    reference = nn.Conv2d(3, 4, 3)
    conv = mt.convert_(copy.deepcopy(reference), cache=False)
    x = torch.randn(1, 3, 5, 5, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16|BFloat16") as raised:
        conv(x)
    if NATIVE:  # PyTorch's own error, word for word
        with by_pytorch(), pytest.raises(RuntimeError) as expected:
            reference(x)
        assert str(raised.value) == str(expected.value)


def test_autocast_disabled_region_runs_in_fp32():
    conv = mt.convert_(nn.Conv2d(3, 4, 3), cache=False)
    x = torch.randn(2, 3, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            y = conv(x)
    assert y.dtype == torch.float32
    (report,) = plans_of(conv).values()
    assert report.dtype == "fp32" and ran(name_of(conv)) == {"fwd": 1}

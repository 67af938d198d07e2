"""mucudnn's Conv2d on CPU tensors against PyTorch's own convolution, for groups, depthwise,
dilation, stride 2 with odd sizes, 1x1, padding='same', no bias and channels_last; and on the
Python path, ``torch.library.opcheck`` of its custom ops (schema, fake tensors, autograd
registration, AOT dispatch with dynamic shapes)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import mucudnn.torch as mt
from converted import by_pytorch, fallbacks, python_path_only, ran

CASES = {
    # name: (N, C, H, W), Conv2d arguments, channels_last
    "plain": ((2, 3, 8, 8), dict(out_channels=4, kernel_size=3, padding=1), False),
    "groups": ((2, 4, 7, 6), dict(out_channels=6, kernel_size=3, groups=2), False),
    "depthwise": ((2, 4, 6, 6), dict(out_channels=4, kernel_size=3, padding=1, groups=4), False),
    "dilation": ((1, 2, 9, 9), dict(out_channels=3, kernel_size=3, dilation=2, padding=2), False),
    "stride2_odd": ((3, 3, 9, 7), dict(out_channels=2, kernel_size=3, stride=2, padding=1), False),
    "one_by_one": ((2, 5, 4, 4), dict(out_channels=3, kernel_size=1), False),
    "same_even": ((2, 2, 6, 5), dict(out_channels=3, kernel_size=(2, 4), padding="same"), False),
    "no_bias": ((2, 3, 5, 5), dict(out_channels=2, kernel_size=3, bias=False), False),
    "channels_last": ((2, 4, 6, 6), dict(out_channels=8, kernel_size=3, padding=1), True),
}


def make(case, seed=0):
    shape, kwargs, channels_last = CASES[case]
    torch.manual_seed(seed)
    conv = mt.Conv2d(shape[1], cache=False, name=f"test.{case}", **kwargs)
    x = torch.randn(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        conv = conv.to(memory_format=torch.channels_last)
    return conv, x


def op_args(conv, x):
    x, padding = conv._symmetric_input(x)
    return (
        x,
        conv.weight,
        conv.bias,
        list(conv.stride),
        padding,
        list(conv.dilation),
        conv.groups,
        conv._mucudnn_config,
    )


@python_path_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck_conv2d(case):
    conv, x = make(case)
    args = op_args(conv, x.requires_grad_())
    torch.library.opcheck(torch.ops.mucudnn.conv2d.default, args)


@python_path_only
@pytest.mark.parametrize("case", ["plain", "groups", "stride2_odd", "channels_last"])
def test_opcheck_backward_ops(case):
    conv, x = make(case)
    x, weight, _, stride, padding, dilation, groups, config = op_args(conv, x)
    y = F.conv2d(x, weight, None, stride, padding, dilation, groups)
    grad = torch.randn_like(y).requires_grad_()
    rest = (stride, padding, dilation, groups, config)
    torch.library.opcheck(
        torch.ops.mucudnn.conv2d_backward_data.default,
        (grad, x.detach(), weight.detach().requires_grad_(), *rest),
    )
    torch.library.opcheck(
        torch.ops.mucudnn.conv2d_backward_filter.default,
        (grad, x.detach().requires_grad_(), weight.detach(), *rest),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_match_pytorch(case):
    conv, x = make(case)
    reference = torch.nn.Conv2d(
        x.shape[1], conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.dilation, conv.groups, conv.bias is not None,
    )
    reference.load_state_dict(conv.state_dict())
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [conv(xs[0])]
    grad = torch.randn_like(ys[0])
    ys[0].backward(grad)
    with by_pytorch():
        ys.append(reference(xs[1]))
        ys[1].backward(grad)
    scale = ys[1].abs().max().item()
    assert ys[0].shape == ys[1].shape
    if case == "channels_last":  # the output keeps the input's memory format
        assert ys[0].is_contiguous(memory_format=torch.channels_last)
        assert not ys[0].is_contiguous()
    torch.testing.assert_close(ys[0], ys[1], rtol=0, atol=1e-4 * scale)
    assert ran(f"test.{case}") == {"fwd": 1, "bwd_data": 1, "bwd_filter": 1}
    assert fallbacks() == {}
    for ours, theirs in [(xs[0].grad, xs[1].grad), (conv.weight.grad, reference.weight.grad)] + (
        [(conv.bias.grad, reference.bias.grad)] if conv.bias is not None else []
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())


def test_double_backward_matches_pytorch():
    conv, x = make("stride2_odd")
    reference = torch.nn.Conv2d(3, 2, 3, stride=2, padding=1)
    reference.load_state_dict(conv.state_dict())
    results = []
    for module in (conv, reference):
        with by_pytorch() if module is reference else contextlib.nullcontext():
            xx = x.clone().requires_grad_()
            y = module(xx)
            (gx,) = torch.autograd.grad(y.pow(2).sum(), xx, create_graph=True)
            penalty = gx.pow(2).sum()
            results.append(torch.autograd.grad(penalty, [xx, module.weight]))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())
    # The forward, its backward and the backward's own derivatives: mucudnn's ops.
    counts = ran("test.stride2_odd")
    assert counts["fwd"] >= 1 and counts["bwd_data"] >= 1 and fallbacks() == {}, counts


def test_fp16_and_bf16_on_the_cpu():
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(1)
        conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, name=f"low.{dtype}", dtype=dtype)
        x = torch.randn(2, 3, 6, 6, dtype=dtype)
        y = conv(x)
        with by_pytorch():
            expected = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), padding=1)
        assert y.dtype == dtype
        assert ran(f"low.{dtype}") == {"fwd": 1}
        torch.testing.assert_close(y.float(), expected, rtol=0, atol=0.05 * expected.abs().max().item())

"""The custom ops ``mucudnn::conv2d``, ``mucudnn::conv2d_backward_data`` and
``mucudnn::conv2d_backward_filter`` (``torch.library.define`` and ``impl``), with fake (meta)
implementations for ``torch.compile`` and autograd formulas (``register_autograd``), as
torchvision registers its ops.

Every op takes the geometry as arguments and the layer's configuration last, as a string of
plain values (``_runtime.config_text``: name, tuning settings, cache), so a graph that holds
these ops means the same thing in every process. The backward ops take the forward input and
the weight (one of them only for its shape) and are linear in the others, so their own
gradients are the three ops again: double backward works too. The fake (meta) implementations
check operand agreement as the real ones do, so a mismatch fails at trace time with the same
message.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import _autocast, _runtime


def _empty_like_layout(input: Tensor, shape) -> Tensor:
    """An uninitialised tensor of ``shape`` with ``input``'s dtype, device and layout."""
    return torch.empty(
        shape, dtype=input.dtype, device=input.device, memory_format=_runtime.memory_format(input)
    )


_ARGS = "int[] stride, int[] padding, int[] dilation, int groups, str config"
torch.library.define(
    "mucudnn::conv2d", f"(Tensor input, Tensor weight, Tensor? bias, {_ARGS}) -> Tensor"
)
torch.library.define(
    "mucudnn::conv2d_backward_data",
    f"(Tensor grad_output, Tensor input, Tensor weight, {_ARGS}) -> Tensor",
)
torch.library.define(
    "mucudnn::conv2d_backward_filter",
    f"(Tensor grad_output, Tensor input, Tensor weight, {_ARGS}) -> Tensor",
)

# torch.library's define/impl, not custom_op: the same schema, fake and autograd registration,
# with about 5 us less dispatch per call (the per-call overhead, docs/pytorch.md).
torch.library.impl("mucudnn::conv2d", ("cpu", "cuda"))(_runtime.forward_op)
torch.library.impl("mucudnn::conv2d_backward_data", ("cpu", "cuda"))(_runtime.backward_data_op)
torch.library.impl("mucudnn::conv2d_backward_filter", ("cpu", "cuda"))(
    _runtime.backward_filter_op
)

#: The ops' overloads, as the layer and the autograd formulas call them.
conv2d_op = torch.ops.mucudnn.conv2d.default
backward_data_op = torch.ops.mucudnn.conv2d_backward_data.default
backward_filter_op = torch.ops.mucudnn.conv2d_backward_filter.default


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    config: str,
) -> Tensor:
    """``y = conv(input, weight) + bias``, tuned and executed by mucudnn (the op
    ``torch.ops.mucudnn.conv2d``)."""
    return conv2d_op(input, weight, bias, stride, padding, dilation, groups, config)


def conv2d_backward_data(
    grad_output: Tensor,
    input: Tensor,
    weight: Tensor,
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    config: str,
) -> Tensor:
    """The gradient of ``conv2d`` with respect to its input (``input`` gives only the shape)."""
    return backward_data_op(grad_output, input, weight, stride, padding, dilation, groups, config)


def conv2d_backward_filter(
    grad_output: Tensor,
    input: Tensor,
    weight: Tensor,
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
    config: str,
) -> Tensor:
    """The gradient of ``conv2d`` with respect to its weight (``weight`` gives only the
    shape)."""
    return backward_filter_op(
        grad_output, input, weight, stride, padding, dilation, groups, config
    )


def _check(config, input, weight, bias, stride, padding, dilation, groups, grad_output=None):
    name = _runtime.config_for(config).name
    _runtime.check_operands(
        name, input, weight, bias, stride, padding, dilation, groups, grad_output=grad_output
    )


@torch.library.register_fake("mucudnn::conv2d")
def _conv2d_fake(input, weight, bias, stride, padding, dilation, groups, config):
    _check(config, input, weight, bias, stride, padding, dilation, groups)
    n, _, h, w = input.shape
    k, _, r, s = weight.shape
    p, q = _runtime.output_hw(h, w, r, s, stride, padding, dilation)
    return _empty_like_layout(input, (n, k, p, q))


@torch.library.register_fake("mucudnn::conv2d_backward_data")
def _backward_data_fake(grad_output, input, weight, stride, padding, dilation, groups, config):
    _check(config, input, weight, None, stride, padding, dilation, groups, grad_output)
    return _empty_like_layout(input, input.shape)


@torch.library.register_fake("mucudnn::conv2d_backward_filter")
def _backward_filter_fake(grad_output, input, weight, stride, padding, dilation, groups, config):
    _check(config, input, weight, None, stride, padding, dilation, groups, grad_output)
    return _empty_like_layout(input, weight.shape)


def _geometry(ctx):
    return ctx.stride, ctx.padding, ctx.dilation, ctx.groups, ctx.config


def _conv2d_setup(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, config = inputs
    ctx.has_bias = bias is not None
    ctx.stride, ctx.padding, ctx.dilation, ctx.groups, ctx.config = (
        stride, padding, dilation, groups, config
    )
    ctx.save_for_backward(input, weight)


def _conv2d_backward(ctx, grad):
    input, weight = ctx.saved_tensors
    geometry = _geometry(ctx)
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = conv2d_backward_data(grad, input, weight, *geometry)
    if ctx.needs_input_grad[1]:
        grad_weight = conv2d_backward_filter(grad, input, weight, *geometry)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.sum(dim=(0, 2, 3))
    return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _backward_setup(ctx, inputs, output):
    grad_output, input, weight = inputs[0], inputs[1], inputs[2]
    ctx.stride, ctx.padding, ctx.dilation, ctx.groups, ctx.config = inputs[3:]
    ctx.save_for_backward(grad_output, input, weight)


def _backward_data_backward(ctx, grad):
    # dx = conv_transpose(dy, w) is linear in dy and in w:
    # d/d(dy) applied to grad is conv(grad, w); d/dw is the filter gradient of (grad, dy).
    grad_output, input, weight = ctx.saved_tensors
    geometry = _geometry(ctx)
    grad_grad_output = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_grad_output = conv2d(grad, weight, None, *geometry)
    if ctx.needs_input_grad[2]:
        grad_weight = conv2d_backward_filter(grad_output, grad, weight, *geometry)
    return grad_grad_output, None, grad_weight, None, None, None, None, None


def _backward_filter_backward(ctx, grad):
    # dw = correlate(x, dy) is linear in x and in dy:
    # d/d(dy) applied to grad is conv(x, grad); d/dx is the data gradient of (dy, grad).
    grad_output, input, weight = ctx.saved_tensors
    geometry = _geometry(ctx)
    grad_grad_output = grad_input = None
    if ctx.needs_input_grad[0]:
        grad_grad_output = conv2d(input, grad, None, *geometry)
    if ctx.needs_input_grad[1]:
        grad_input = conv2d_backward_data(grad_output, input, grad, *geometry)
    return grad_grad_output, grad_input, None, None, None, None, None, None


torch.library.register_autograd(
    "mucudnn::conv2d", _conv2d_backward, setup_context=_conv2d_setup
)
torch.library.register_autograd(
    "mucudnn::conv2d_backward_data", _backward_data_backward, setup_context=_backward_setup
)
torch.library.register_autograd(
    "mucudnn::conv2d_backward_filter", _backward_filter_backward, setup_context=_backward_setup
)

# Under torch.autocast the ops run in the autocast dtype, as nn.Conv2d does (see _autocast).
_autocast.register(
    ["mucudnn::conv2d", "mucudnn::conv2d_backward_data", "mucudnn::conv2d_backward_filter"]
)

"""The custom ops (``torch.library.define`` and ``impl``), with fake (meta) implementations for
``torch.compile`` and autograd formulas (``register_autograd``), as torchvision registers its
ops. For 2 and 3 spatial dims (4-D and 5-D tensors; 1-D layers run the 2-D ops with a unit
height), from one code path:

- ``mucudnn::conv2d`` / ``conv3d``: ``y = conv(input, weight) + bias``;
- ``mucudnn::conv2d_backward_data`` / ``conv3d_backward_data``: the input gradient;
- ``mucudnn::conv2d_backward_filter`` / ``conv3d_backward_filter``: the weight gradient;
- ``mucudnn::conv_transpose2d`` / ``conv_transpose3d``: the transposed convolution, run as the
  backward-data of its convolution problem; its gradients are the convolution ops (forward for
  the input, backward-filter with the roles of x and dy swapped for the weight), so all three
  share that problem's plans.

Every op takes the geometry as arguments and the layer's configuration last, as a string of
plain values (``_registry.config_text``: name, tuning settings, cache), so a graph that holds
these ops means the same thing in every process. The backward ops take the forward input and
the weight (one of them only for its shape) and are linear in the others, so their own
gradients are the ops again: double backward works too. The fake (meta) implementations
check operand agreement as the real ones do, so a mismatch fails at trace time with the same
message.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .._tuner import BACKWARD_DATA, BACKWARD_FILTER
from . import _autocast, _checks, _keys, _registry, _runtime


def _empty_like_layout(input: Tensor, shape) -> Tensor:
    """An uninitialised tensor of ``shape`` with ``input``'s dtype, device and layout."""
    return torch.empty(
        shape, dtype=input.dtype, device=input.device, memory_format=_keys.memory_format(input)
    )


_ARGS = "int[] stride, int[] padding, int[] dilation, int groups, str config"
_TRANSPOSED_ARGS = (
    "int[] stride, int[] padding, int[] output_padding, int[] dilation, int groups, str config"
)

#: Per spatial dims (2, 3): the ops' overloads, as the layers and the autograd formulas call them
#: (``conv``, ``backward_data``, ``backward_filter``, ``transpose``).
OPS: Dict[int, SimpleNamespace] = {}


def _name_of(config: str) -> str:
    return _registry.config_for(config).name


def _reduced_dims(spatial: int):
    return (0,) + tuple(range(2, 2 + spatial))


def _register(spatial: int) -> SimpleNamespace:
    """Defines, implements and registers the four ops of ``spatial`` dims."""
    conv_name = f"mucudnn::conv{spatial}d"
    data_name = f"{conv_name}_backward_data"
    filter_name = f"{conv_name}_backward_filter"
    transpose_name = f"mucudnn::conv_transpose{spatial}d"
    torch.library.define(conv_name, f"(Tensor input, Tensor weight, Tensor? bias, {_ARGS}) -> Tensor")
    torch.library.define(
        data_name, f"(Tensor grad_output, Tensor input, Tensor weight, {_ARGS}) -> Tensor"
    )
    torch.library.define(
        filter_name, f"(Tensor grad_output, Tensor input, Tensor weight, {_ARGS}) -> Tensor"
    )
    torch.library.define(
        transpose_name,
        f"(Tensor input, Tensor weight, Tensor? bias, {_TRANSPOSED_ARGS}) -> Tensor",
    )
    # torch.library's define/impl, not custom_op: the same schema, fake and autograd
    # registration, with about 5 us less dispatch per call (the per-call overhead,
    # docs/pytorch.md).
    devices = ("cpu", "cuda")
    torch.library.impl(conv_name, devices)(_runtime.forward_op(spatial))
    torch.library.impl(data_name, devices)(_runtime.backward_op(BACKWARD_DATA, spatial))
    torch.library.impl(filter_name, devices)(_runtime.backward_op(BACKWARD_FILTER, spatial))
    torch.library.impl(transpose_name, devices)(_runtime.transposed_op(spatial))

    ops = SimpleNamespace(
        conv=getattr(torch.ops.mucudnn, f"conv{spatial}d").default,
        backward_data=getattr(torch.ops.mucudnn, f"conv{spatial}d_backward_data").default,
        backward_filter=getattr(torch.ops.mucudnn, f"conv{spatial}d_backward_filter").default,
        transpose=getattr(torch.ops.mucudnn, f"conv_transpose{spatial}d").default,
    )

    def check(config, input, weight, bias, stride, padding, dilation, groups, grad_output=None):
        _checks.check_operands(
            _name_of(config), spatial, input, weight, bias, stride, padding, dilation, groups,
            grad_output=grad_output,
        )

    @torch.library.register_fake(conv_name)
    def _conv_fake(input, weight, bias, stride, padding, dilation, groups, config):
        check(config, input, weight, bias, stride, padding, dilation, groups)
        out = _keys.output_size(input.shape[2:], weight.shape[2:], stride, padding, dilation)
        return _empty_like_layout(input, (input.shape[0], weight.shape[0]) + out)

    @torch.library.register_fake(data_name)
    def _backward_data_fake(grad_output, input, weight, stride, padding, dilation, groups, config):
        check(config, input, weight, None, stride, padding, dilation, groups, grad_output)
        return _empty_like_layout(input, input.shape)

    @torch.library.register_fake(filter_name)
    def _backward_filter_fake(
        grad_output, input, weight, stride, padding, dilation, groups, config
    ):
        check(config, input, weight, None, stride, padding, dilation, groups, grad_output)
        return _empty_like_layout(input, weight.shape)

    @torch.library.register_fake(transpose_name)
    def _transpose_fake(
        input, weight, bias, stride, padding, output_padding, dilation, groups, config
    ):
        shape = _checks.check_transposed(
            _name_of(config), spatial, input, weight, bias, stride, padding, output_padding,
            dilation, groups,
        )
        return _empty_like_layout(input, shape)

    def conv_setup(ctx, inputs, output):
        input, weight, bias, stride, padding, dilation, groups, config = inputs
        ctx.has_bias = bias is not None
        ctx.geometry = (stride, padding, dilation, groups, config)
        ctx.save_for_backward(input, weight)

    def conv_backward(ctx, grad):
        input, weight = ctx.saved_tensors
        geometry = ctx.geometry
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = ops.backward_data(grad, input, weight, *geometry)
        if ctx.needs_input_grad[1]:
            grad_weight = ops.backward_filter(grad, input, weight, *geometry)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=_reduced_dims(spatial))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None

    def backward_setup(ctx, inputs, output):
        grad_output, input, weight = inputs[0], inputs[1], inputs[2]
        ctx.geometry = tuple(inputs[3:])
        ctx.save_for_backward(grad_output, input, weight)

    def backward_data_backward(ctx, grad):
        # dx = conv_transpose(dy, w) is linear in dy and in w:
        # d/d(dy) applied to grad is conv(grad, w); d/dw is the filter gradient of (grad, dy).
        grad_output, input, weight = ctx.saved_tensors
        geometry = ctx.geometry
        grad_grad_output = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_grad_output = ops.conv(grad, weight, None, *geometry)
        if ctx.needs_input_grad[2]:
            grad_weight = ops.backward_filter(grad_output, grad, weight, *geometry)
        return grad_grad_output, None, grad_weight, None, None, None, None, None

    def backward_filter_backward(ctx, grad):
        # dw = correlate(x, dy) is linear in x and in dy:
        # d/d(dy) applied to grad is conv(x, grad); d/dx is the data gradient of (dy, grad).
        grad_output, input, weight = ctx.saved_tensors
        geometry = ctx.geometry
        grad_grad_output = grad_input = None
        if ctx.needs_input_grad[0]:
            grad_grad_output = ops.conv(input, grad, None, *geometry)
        if ctx.needs_input_grad[1]:
            grad_input = ops.backward_data(grad_output, input, grad, *geometry)
        return grad_grad_output, grad_input, None, None, None, None, None, None

    def transpose_setup(ctx, inputs, output):
        input, weight, bias, stride, padding, _output_padding, dilation, groups, config = inputs
        ctx.has_bias = bias is not None
        # The convolution problem's geometry: output_padding only sized the output.
        ctx.geometry = (stride, padding, dilation, groups, config)
        ctx.save_for_backward(input, weight)

    def transpose_backward(ctx, grad):
        # y = conv_transpose(x, w) is the convolution's data gradient with dy = x: its input
        # gradient is conv(grad_y, w), its weight gradient the convolution's filter gradient
        # with x_conv = grad_y and dy_conv = x.
        input, weight = ctx.saved_tensors
        geometry = ctx.geometry
        # In the input's memory format, as the forward ran: the same problem, one plan set.
        grad = grad.contiguous(memory_format=_keys.memory_format(input))
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = ops.conv(grad, weight, None, *geometry)
        if ctx.needs_input_grad[1]:
            grad_weight = ops.backward_filter(input, grad, weight, *geometry)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=_reduced_dims(spatial))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None

    torch.library.register_autograd(conv_name, conv_backward, setup_context=conv_setup)
    torch.library.register_autograd(
        data_name, backward_data_backward, setup_context=backward_setup
    )
    torch.library.register_autograd(
        filter_name, backward_filter_backward, setup_context=backward_setup
    )
    torch.library.register_autograd(
        transpose_name, transpose_backward, setup_context=transpose_setup
    )
    # Under torch.autocast the ops run in the autocast dtype, as nn.Conv2d does (see _autocast).
    _autocast.register([conv_name, data_name, filter_name, transpose_name])
    return ops


for _spatial in (2, 3):
    OPS[_spatial] = _register(_spatial)

#: The 2-D ops' overloads (the names earlier versions exported).
conv2d_op = OPS[2].conv
backward_data_op = OPS[2].backward_data
backward_filter_op = OPS[2].backward_filter


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
    ``torch.ops.mucudnn.conv2d``; ``conv3d`` for 5-D tensors)."""
    return OPS[2].conv(input, weight, bias, stride, padding, dilation, groups, config)


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
    return OPS[2].backward_data(
        grad_output, input, weight, stride, padding, dilation, groups, config
    )


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
    return OPS[2].backward_filter(
        grad_output, input, weight, stride, padding, dilation, groups, config
    )


def conv3d(input, weight, bias, stride, padding, dilation, groups, config) -> Tensor:
    """:func:`conv2d` for 5-D tensors (the op ``torch.ops.mucudnn.conv3d``)."""
    return OPS[3].conv(input, weight, bias, stride, padding, dilation, groups, config)


def conv3d_backward_data(grad_output, input, weight, stride, padding, dilation, groups, config):
    """:func:`conv2d_backward_data` for 5-D tensors."""
    return OPS[3].backward_data(
        grad_output, input, weight, stride, padding, dilation, groups, config
    )


def conv3d_backward_filter(
    grad_output, input, weight, stride, padding, dilation, groups, config
):
    """:func:`conv2d_backward_filter` for 5-D tensors."""
    return OPS[3].backward_filter(
        grad_output, input, weight, stride, padding, dilation, groups, config
    )


def conv_transpose2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    stride: List[int],
    padding: List[int],
    output_padding: List[int],
    dilation: List[int],
    groups: int,
    config: str,
) -> Tensor:
    """``F.conv_transpose2d`` (``weight``: ``Cin x Cout/groups x R x S``; ``output_padding``
    smaller than the stride), tuned and executed by mucudnn as its convolution's backward-data
    (the op ``torch.ops.mucudnn.conv_transpose2d``)."""
    return OPS[2].transpose(
        input, weight, bias, stride, padding, output_padding, dilation, groups, config
    )


def conv_transpose3d(
    input, weight, bias, stride, padding, output_padding, dilation, groups, config
) -> Tensor:
    """:func:`conv_transpose2d` for 5-D tensors."""
    return OPS[3].transpose(
        input, weight, bias, stride, padding, output_padding, dilation, groups, config
    )


#: Per op overload: the Python function its CPU and CUDA kernels run (see :func:`call`).
_KERNELS = {}
for _spatial in (2, 3):
    _KERNELS[OPS[_spatial].conv] = _runtime.forward_op(_spatial)
    _KERNELS[OPS[_spatial].transpose] = _runtime.transposed_op(_spatial)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _needs_dispatch(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a call must go through PyTorch's dispatcher: a gradient to record, or anything
    that watches or transforms ops (autocast, a dispatch mode, tracing, functorch, tensor
    subclasses, a device other than the CPU or CUDA)."""
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return True
    return (
        type(x) not in _PLAIN_TYPES
        or type(weight) not in _PLAIN_TYPES
        or (bias is not None and type(bias) not in _PLAIN_TYPES)
        or x.device.type not in ("cpu", "cuda")
        or torch.is_autocast_enabled(x.device.type)
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._get_tracing_state() is not None
        or _functorch_wrapped(x)
        or _functorch_wrapped(weight)
    )


def call(x: Tensor, weight: Tensor, op, *args):
    """``op(*args)`` for a forward op (``conv{2,3}d`` or ``conv_transpose{2,3}d``; ``x``,
    ``weight`` and the bias are its first three arguments), telling the runtime whether a
    backward may follow (gradients on, and ``x`` or ``weight`` requiring one: a shape first
    seen without one tunes only the op its forward runs). Where nothing records, casts or
    watches the call (no gradient to record, no autocast, dispatch mode, tracing or functorch
    transform, plain CPU or CUDA tensors), the op's kernel runs directly: the same function
    the dispatcher would reach, without its per-call cost. Not while torch.compile traces: a
    compiled graph holds the op, whose kernel decides from its tensors."""
    if torch.compiler.is_compiling():
        return op(*args)
    kernel = _KERNELS.get(op)
    if kernel is not None and not _needs_dispatch(x, weight, args[2]):
        _runtime.expect_backward(False)
        try:
            return kernel(*args)
        finally:
            _runtime.expect_backward(None)
    _runtime.expect_backward(torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    try:
        return op(*args)
    finally:
        _runtime.expect_backward(None)

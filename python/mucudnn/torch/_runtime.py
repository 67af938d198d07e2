"""What the custom ops run: a call's operands checked and its plan key read
(:mod:`._checks`), the key's prepared plans found in the layer's configuration
(:mod:`._registry`) or tuned on first sight (:mod:`._plans`), and execution over tensor
pointers (:func:`run`).

One code path serves 2 and 3 spatial dims (4-D and 5-D tensors; ``spatial`` below); 1-D layers
run as 2-D with a unit height (views of their tensors). A transposed convolution is the
convolution problem whose input is the transposed layer's output (``n = N``, ``c = Cout``,
``k = Cin``, the same kernel and geometry): its forward runs that problem's backward-data plan,
its input gradient the forward plan and its weight gradient the backward-filter plan, so the
three share one plan set (:func:`transposed_forward`).

A key's plan set holds the ops tuned so far (:attr:`Ready.has`). A forward that no backward
will follow (gradients off, or neither the input nor the weight requires one;
:func:`backward_expected`) tunes and prepares only the op it runs: inference measures a third
of what training does. A backward that finds its op missing tunes the missing ops then,
prepares them with the others, and runs (:func:`plans_for`).
"""

from __future__ import annotations

import sys
import threading
from typing import List, Optional

import torch
import torch.nn.functional as F

from .._lib import MucudnnError
from .._tuner import BACKWARD_DATA, FORWARD
from . import _keys, _legacy_account
from ._checks import checked_key, transposed_key
from ._keys import ALL_OPS, PlanKey, memory_format, output_shape_of
from ._plans import MISSING, plans_for
from ._registry import LayerConfig, Ready, _configs, config_for

# The names tests and benchmarks reach through this module. The ops below call plans_for and
# run through this module's globals, so a test that replaces them here scripts or counts the
# ops' calls.
from ._keys import plan_key, problem_of  # noqa: F401
from ._plans import fall_back  # noqa: F401
from ._registry import config_text  # noqa: F401
from ._reports import format_bytes  # noqa: F401


def run(
    config: LayerConfig,
    ready: Ready,
    op: int,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out = op(a, b)`` with the prepared plan (on ``out``'s device and current stream). The
    operands are those of the plan's key (checked by the caller); the library checks their
    dims and extents against the plan once more."""
    while not ready.enter():
        # Another thread replaced the set since this call found it; the new one holds every
        # op the old one did.
        newer = config.prepared.get(ready.key)
        if newer is None and ready.key not in config.prepared:
            # Evicted (the bound of plan sets): prepared again from the cache, no measuring.
            newer = plans_for(config, ready.key, [op])
        if newer is None or newer is ready:
            raise RuntimeError(
                f"{config.name}: the plans of input shape {ready.key.input_shape} were released "
                "while a call was on its way to them"
            )
        ready = newer
    try:
        needed = ready.workspace[op]
        workspace = None
        stream = 0
        if out.is_cuda:
            if needed:
                workspace = torch.empty(needed, dtype=torch.uint8, device=out.device)
            stream = torch.cuda.current_stream(out.device).cuda_stream
        # On the CPU no workspace is passed: the tuner's own, shared by all its plan sets.
        _legacy_account.executed(config.name, _keys.OP_NAMES[op])
        ready.tuner.execute(
            ready.id,
            op,
            a.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            ready.extents[op],
            workspace=workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes=needed if workspace is not None else 0,
            stream=stream,
        )
    except MucudnnError as e:
        raise RuntimeError(f"{config.name}: {e}") from e
    finally:
        ready.leave()


#: Base alignment the GPU path asks of every operand: engine plans declare the alignment of the
#: offsets they run at (a micro-batch's, or a spatial chunk's first row: the library computes
#: both from the plan; nothing here depends on the split), relative to an aligned base
#: (PyTorch's caching allocator hands out 512-byte aligned blocks; a view into one may start
#: anywhere).
GPU_BASE_ALIGNMENT = 256


def aligned(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """``t``, or an aligned copy of it when it is a CUDA tensor starting at an unaligned
    address (a view with a storage offset)."""
    if t.is_cuda and t.data_ptr() % GPU_BASE_ALIGNMENT:
        return t.clone(memory_format=fmt)
    return t


#: PyTorch's functional convolutions by spatial dims (float64 and the fallbacks run them).
_CONV = {2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_INPUT = {2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
_CONV_WEIGHT = {2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def _warn_float64(config: LayerConfig) -> None:
    if not config.warned_float64:
        config.warned_float64 = True
        print(
            f"mucudnn: warning: {config.name}: float64 runs PyTorch's convolution (mucudnn's "
            "plans are fp32, fp16 and bf16)",
            file=sys.stderr,
        )


def _bias_view(bias: torch.Tensor, spatial: int) -> torch.Tensor:
    return bias.view((1, -1) + (1,) * spatial)


#: Per thread: what the layer calling an op said of its backward (see :func:`expect_backward`).
_backward_hint = threading.local()


def expect_backward(value: Optional[bool]) -> None:
    """Set by a converted layer around its op call: whether a backward may follow (gradients
    on, and its input or weight requires one); ``None`` after the call. Read only when a key
    is tuned; the op itself cannot tell (autograd runs it with gradients off either way)."""
    _backward_hint.value = value


def backward_expected(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a backward may follow a forward over ``x`` and ``weight``, so its first call
    tunes all three ops rather than the forward's alone. The calling layer's word when it gave
    one (:func:`expect_backward`); else (a direct op call, a compiled graph) inference mode, or
    gradients on in the op (autograd found nothing requiring one), means no; otherwise whether
    ``x`` or ``weight`` requires a gradient (under ``torch.no_grad`` a direct call cannot be
    told apart from autograd's, so it tunes all three: the old behaviour)."""
    hint = getattr(_backward_hint, "value", None)
    if hint is not None:
        return bool(hint)
    if torch.is_inference_mode_enabled() or torch.is_grad_enabled():
        return False
    return bool(x.requires_grad or weight.requires_grad)


def _ready(
    config: LayerConfig,
    key: PlanKey,
    op: int,
    x: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
) -> Optional[Ready]:
    """The prepared plans of ``key`` that run ``op``. A forward (``x`` and ``weight`` given)
    that finds none tunes ``op`` alone when no backward is expected, else all three ops; a
    backward (no tensors) tunes every op the key lacks."""
    ready = config.prepared.get(key, MISSING)
    if ready is MISSING or (ready is not None and not ready.has[op]):
        inference = x is not None and weight is not None and not backward_expected(x, weight)
        ready = plans_for(config, key, (op,) if inference else ALL_OPS)
    return ready


def forward(
    config_text: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = checked_key(config, spatial, x, weight, bias, stride, padding, dilation, groups, fmt)
    if x.dtype is torch.float64:
        _warn_float64(config)
        return _CONV[spatial](x, weight, bias, stride, padding, dilation, groups)
    given = (x, weight)  # the caller's: a copy made here never requires a gradient
    x = x.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    shape = output_shape_of(key)
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if y.numel() > 0 and x.shape[1] == 0:
        y.zero_()  # no input channels: the sum is empty (nn.Conv2d gives the bias)
    elif y.numel() > 0:
        x, weight = aligned(x, fmt), aligned(weight, fmt)
        ready = _ready(config, key, FORWARD, *given)
        if ready is None:
            y = _CONV[spatial](x, weight, None, stride, padding, dilation, groups)
            y = y.contiguous(memory_format=fmt)
        else:
            run(config, ready, FORWARD, x, weight, y)
    if bias is not None:
        y.add_(_bias_view(bias, spatial))
    return y


def _backward(
    op: int,
    config_text: str,
    spatial: int,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    """The data gradient (``op`` = BACKWARD_DATA: of ``x``'s shape, from ``weight`` and
    ``grad_output``) or the filter gradient (BACKWARD_FILTER: of ``weight``'s shape, from ``x``
    and ``grad_output``), in ``x``'s memory format."""
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = checked_key(
        config, spatial, x, weight, None, stride, padding, dilation, groups, fmt, grad_output
    )
    data = op == BACKWARD_DATA
    geometry = (stride, padding, dilation, groups)
    if x.dtype is torch.float64:
        _warn_float64(config)
        if data:
            return _CONV_INPUT[spatial](x.shape, weight, grad_output, *geometry)
        return _CONV_WEIGHT[spatial](x, weight.shape, grad_output, *geometry)
    shape = x.shape if data else weight.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if x.numel() == 0 or weight.numel() == 0:
        return out.zero_()
    grad_output = aligned(grad_output.contiguous(memory_format=fmt), fmt)
    # The operand the op reads besides dy: w for the data gradient, x for the filter's.
    other = aligned((weight if data else x).contiguous(memory_format=fmt), fmt)
    ready = _ready(config, key, op)
    if ready is None:
        if data:
            out = _CONV_INPUT[spatial](x.shape, other, grad_output, *geometry)
        else:
            out = _CONV_WEIGHT[spatial](other, weight.shape, grad_output, *geometry)
        return out.contiguous(memory_format=fmt)
    run(config, ready, op, other, grad_output, out)
    return out


def transposed_forward(
    config_text: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    output_padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    """``y = conv_transpose(x, weight) + bias``: the backward-data plan of the convolution
    problem whose input is ``y`` and whose output gradient is ``x``."""
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = transposed_key(
        config, spatial, x, weight, bias, stride, padding, output_padding, dilation, groups, fmt
    )
    if x.dtype is torch.float64:
        _warn_float64(config)
        return _CONV_TRANSPOSE[spatial](
            x, weight, bias, stride, padding, output_padding, groups, dilation
        )
    y = torch.empty(key.input_shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    given = (x, weight)
    if y.numel() > 0 and (x.numel() == 0 or weight.numel() == 0):
        y.zero_()  # no input channels or an empty batch: nothing to sum
    elif y.numel() > 0:
        x = aligned(x.contiguous(memory_format=fmt), fmt)
        weight = aligned(weight.contiguous(memory_format=fmt), fmt)
        ready = _ready(config, key, BACKWARD_DATA, *given)
        if ready is None:
            y = _CONV_TRANSPOSE[spatial](
                x, weight, None, stride, padding, output_padding, groups, dilation
            ).contiguous(memory_format=fmt)
        else:
            run(config, ready, BACKWARD_DATA, weight, x, y)
    if bias is not None:
        y.add_(_bias_view(bias, spatial))
    return y


def forward_op(spatial: int):
    """The op ``mucudnn::conv{spatial}d`` (arguments in its schema's order)."""

    def op(x, weight, bias, stride, padding, dilation, groups, config_text: str):
        return forward(config_text, spatial, x, weight, bias, stride, padding, dilation, groups)

    return op


def backward_op(kind: int, spatial: int):
    """The op ``mucudnn::conv{spatial}d_backward_data`` (``kind`` BACKWARD_DATA) or
    ``_backward_filter`` (BACKWARD_FILTER)."""

    def op(grad_output, x, weight, stride, padding, dilation, groups, config_text: str):
        return _backward(
            kind, config_text, spatial, grad_output, x, weight, stride, padding, dilation, groups
        )

    return op


def transposed_op(spatial: int):
    """The op ``mucudnn::conv_transpose{spatial}d``."""

    def op(x, weight, bias, stride, padding, output_padding, dilation, groups, config_text: str):
        return transposed_forward(
            config_text, spatial, x, weight, bias, stride, padding, output_padding, dilation,
            groups,
        )

    return op

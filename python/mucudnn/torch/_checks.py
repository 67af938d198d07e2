"""The checks a call's operands pass before any pointer leaves Python (ranks, dtypes, devices,
geometry, shapes that make one convolution), and the plan key of a call, both decided once per
call signature."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._keys import (
    DTYPES,
    PlanKey,
    layout_name,
    output_size,
    plan_key,
    signature,
    transposed_size,
)
from ._registry import LayerConfig


def _geometry(name: str, what: str, value: Any, spatial: int, least: int) -> None:
    if len(value) != spatial or any(int(v) < least for v in value):
        raise RuntimeError(
            f"{name}: {what} must be {spatial} numbers >= {least}, not {list(value)}"
        )


def _check_tensors(
    name: str, spatial: int, x: torch.Tensor, operands: List[Tuple[str, torch.Tensor]]
) -> None:
    """Ranks, dtypes and devices: every operand a ``spatial + 2``-D tensor (a bias aside) of
    ``x``'s dtype on ``x``'s device, and a dtype and device mucudnn runs."""
    rank = spatial + 2
    weight = operands[0][1]
    if x.dim() != rank or weight.dim() != rank:
        raise RuntimeError(
            f"{name}: expected a {rank}-D input and weight, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    for what, t in operands:
        if t.dtype != x.dtype:
            raise RuntimeError(
                f"{name}: the input is {x.dtype} but the {what} is {t.dtype}; convert one of "
                "them (e.g. model.to(dtype) or torch.autocast)"
            )
        if t.device != x.device:
            raise RuntimeError(f"{name}: the input is on {x.device} but the {what} is on {t.device}")
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"{name}: {x.device.type} tensors are not supported (cpu, cuda)")
    if x.dtype not in DTYPES and x.dtype is not torch.float64:
        raise RuntimeError(
            f"{name}: {x.dtype} is not supported (float32, float16 and bfloat16 run mucudnn's "
            "plans; float64 runs PyTorch's convolution)"
        )


def check_operands(
    name: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    grad_output: Optional[torch.Tensor] = None,
) -> None:
    """Checks that the operands make one convolution of ``spatial`` (2 or 3) dims before any
    pointer leaves Python: 4-D (5-D) tensors of one dtype on one device, a weight that fits the
    input's channels and groups, a bias of ``k`` values, a positive output, and (backward) a
    ``grad_output`` of the output's shape. A mismatch is a RuntimeError naming the layer."""
    operands = [("weight", weight)]
    if bias is not None:
        operands.append(("bias", bias))
    if grad_output is not None:
        operands.append(("grad_output", grad_output))
    _check_tensors(name, spatial, x, operands)
    _geometry(name, "stride", stride, spatial, 1)
    _geometry(name, "padding", padding, spatial, 0)
    _geometry(name, "dilation", dilation, spatial, 1)
    k, cg = weight.shape[0], weight.shape[1]
    if groups < 1 or k % groups or x.shape[1] != cg * groups:
        raise RuntimeError(
            f"{name}: a weight of shape {tuple(weight.shape)} with groups={groups} does not fit an "
            f"input of shape {tuple(x.shape)} (it needs {cg * groups} input channels and "
            "out_channels divisible by groups)"
        )
    if bias is not None and tuple(bias.shape) != (k,):
        raise RuntimeError(f"{name}: the bias has shape {tuple(bias.shape)}, expected ({k},)")
    out = output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    if any(v <= 0 for v in out):
        raise RuntimeError(
            f"{name}: input {tuple(x.shape)} is too small for kernel {tuple(weight.shape[2:])} "
            f"with padding {tuple(padding)} and dilation {tuple(dilation)} (output would be "
            f"{'x'.join(map(str, out))})"
        )
    if grad_output is not None and tuple(grad_output.shape) != (x.shape[0], k) + out:
        raise RuntimeError(
            f"{name}: grad_output has shape {tuple(grad_output.shape)}, the convolution's output "
            f"is {(x.shape[0], k) + out}"
        )


def check_transposed(
    name: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Tuple[int, ...]:
    """Checks a transposed convolution's operands as :func:`check_operands` does a
    convolution's (the weight is ``Cin x Cout/groups x kernel``; ``output_padding`` is smaller
    than the stride, so the output is exactly the convolution problem's input) and returns its
    output shape."""
    operands = [("weight", weight)]
    if bias is not None:
        operands.append(("bias", bias))
    _check_tensors(name, spatial, x, operands)
    _geometry(name, "stride", stride, spatial, 1)
    _geometry(name, "padding", padding, spatial, 0)
    _geometry(name, "output_padding", output_padding, spatial, 0)
    _geometry(name, "dilation", dilation, spatial, 1)
    if any(op >= st for op, st in zip(output_padding, stride)):
        raise RuntimeError(
            f"{name}: output_padding {list(output_padding)} must be smaller than the stride "
            f"{list(stride)} in every dim (mucudnn runs a transposed convolution as its "
            "convolution's backward-data)"
        )
    cin, cout_g = weight.shape[0], weight.shape[1]
    if groups < 1 or cin % groups or x.shape[1] != cin:
        raise RuntimeError(
            f"{name}: a transposed weight of shape {tuple(weight.shape)} with groups={groups} "
            f"does not fit an input of shape {tuple(x.shape)} (it needs {cin} input channels, "
            "divisible by groups)"
        )
    cout = cout_g * groups
    if bias is not None and tuple(bias.shape) != (cout,):
        raise RuntimeError(f"{name}: the bias has shape {tuple(bias.shape)}, expected ({cout},)")
    out = transposed_size(x.shape[2:], weight.shape[2:], stride, padding, output_padding, dilation)
    if any(v <= 0 for v in out):
        raise RuntimeError(
            f"{name}: input {tuple(x.shape)} with kernel {tuple(weight.shape[2:])}, padding "
            f"{tuple(padding)} and dilation {tuple(dilation)} gives no output (it would be "
            f"{'x'.join(map(str, out))})"
        )
    return (x.shape[0], cout) + out


def checked_key(
    config: LayerConfig,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
    grad_output: Optional[torch.Tensor] = None,
) -> PlanKey:
    """The plan key of a call whose operands agree (:func:`check_operands`, which raises
    otherwise), checked once per call signature."""
    call = signature(x, weight, bias, stride, padding, dilation, groups, fmt, grad_output)
    key = config.checked.get(call)
    if key is None:
        check_operands(
            config.name, spatial, x, weight, bias, stride, padding, dilation, groups, grad_output
        )
        layout = layout_name(fmt, spatial)
        key = plan_key(x, weight.shape, stride, padding, dilation, groups, layout)
        config.checked[call] = key
    return key


def transposed_key(
    config: LayerConfig,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
) -> PlanKey:
    """The plan key of a transposed convolution: its convolution problem's, whose input is the
    transposed output (checked once per call signature, as :func:`checked_key`)."""
    call = signature(
        x, weight, bias, stride, padding, dilation, groups, fmt, output_padding=output_padding
    )
    key = config.checked.get(call)
    if key is None:
        y_shape = check_transposed(
            config.name, spatial, x, weight, bias, stride, padding, output_padding, dilation,
            groups,
        )
        key = plan_key(
            x, weight.shape, stride, padding, dilation, groups, layout_name(fmt, spatial),
            x_shape=y_shape,
        )
        config.checked[call] = key
    return key

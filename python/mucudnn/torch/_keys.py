"""The plan key: everything that defines a prepared plan set, read from a call's tensors and
geometry (:func:`plan_key`), and what follows from it alone (the output shape, the C ABI's
problem); memory formats and layouts; the convolution size formulas; and the discovery pass
that records the keys each converted layer sees (for :func:`mucudnn.torch.tune`).

A key holds the device, dtype, layout, input and weight shapes, stride, padding, dilation,
groups, and PyTorch's TF32 and determinism switches. Anything that changes makes another key,
which is tuned through the cache; no plan ever runs over tensors of another problem (and the C
ABI checks each operand's dims and extent against the plan again).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _tuner
from .._tuner import BACKWARD_DATA, BACKWARD_FILTER, FORWARD

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: The ops' names by their numbers (FORWARD, BACKWARD_DATA, BACKWARD_FILTER).
OP_NAMES = _tuner.OPS
ALL_OPS = (FORWARD, BACKWARD_DATA, BACKWARD_FILTER)


class PlanKey(NamedTuple):
    """Everything that defines a prepared plan set (:func:`plan_key`). A tuple of plain values
    (equal to, and hashing as, the tuple of its fields in this order), so it keys dicts and
    caches across layers and threads."""

    #: ``"cuda"``, ``"cpu"`` or ``"meta"``.
    device_type: str
    #: The CUDA device's index; -1 off CUDA.
    device_index: int
    dtype: torch.dtype
    #: mucudnn's layout name (``nchw``, ``nhwc``, ``ncdhw``, ``ndhwc``).
    layout: str
    #: The convolution problem's input shape (for a transposed layer its output).
    input_shape: Tuple[int, ...]
    weight_shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int
    #: cuDNN's math mode: ``"fma"`` (fp32 with TF32 off) or ``"default"``.
    math: str
    #: Only deterministic candidates (PyTorch's determinism switches).
    deterministic: bool

    @property
    def device(self) -> str:
        """The device in words: ``cuda:0``, ``cpu``."""
        if self.device_index < 0:
            return self.device_type
        return f"{self.device_type}:{self.device_index}"


#: Spatial dims -> (PyTorch's channels-last memory format, the layout names of mucudnn).
_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
_LAYOUTS = {2: ("nchw", "nhwc"), 3: ("ncdhw", "ndhwc")}


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-D (5-D) tensor runs as NHWC (NDHWC): packed ``channels_last``
    (``channels_last_3d``) and not also plain contiguous (a tensor with one channel or one
    pixel is both; it runs as NCHW)."""
    last = _LAST.get(t.dim() - 2)
    return last is not None and t.is_contiguous(memory_format=last) and not t.is_contiguous()


def memory_format(t: torch.Tensor) -> torch.memory_format:
    return _LAST[t.dim() - 2] if is_channels_last(t) else torch.contiguous_format


def layout_name(fmt: torch.memory_format, spatial: int) -> str:
    """mucudnn's layout for a memory format at 2 or 3 spatial dims (``nhwc``, ``ndhwc``, ...)."""
    return _LAYOUTS[spatial][fmt is _LAST[spatial]]


def layout_of(t: torch.Tensor) -> str:
    return layout_name(memory_format(t), t.dim() - 2)


def output_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> Tuple[int, ...]:
    """A convolution's output spatial size, per dim (any number of spatial dims)."""
    return tuple(
        (i + 2 * p - d * (k - 1) - 1) // st + 1
        for i, k, st, p, d in zip(size, kernel, stride, padding, dilation)
    )


def output_hw(
    h: int, w: int, r: int, s: int, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Tuple[int, int]:
    p, q = output_size((h, w), (r, s), stride, padding, dilation)
    return p, q


def transposed_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
) -> Tuple[int, ...]:
    """A transposed convolution's output spatial size (PyTorch's formula), per dim."""
    return tuple(
        (i - 1) * st - 2 * p + d * (k - 1) + op + 1
        for i, k, st, p, op, d in zip(size, kernel, stride, padding, output_padding, dilation)
    )


def device_of(t: torch.Tensor) -> Tuple[str, int]:
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return "cuda", index
    return t.device.type, -1


_cudnn_flags = torch.backends.cudnn


def conv_allows_tf32() -> bool:
    """Whether PyTorch lets its cuDNN convolutions use TF32 for fp32 tensors.

    Read through the ``fp32_precision`` API where torch has it: the legacy getter
    ``torch.backends.cudnn.allow_tf32`` raises there once a user has set a precision through
    the new API (conv and RNN then differ, or differ from the legacy flag). A ``"none"``
    setting inherits from cuDNN's setting for all its ops, then from the generic one; none set
    anywhere is IEEE, as PyTorch resolves it."""
    try:
        precision = _cudnn_flags.conv.fp32_precision
    except AttributeError:  # a torch without the fp32_precision API
        return bool(_cudnn_flags.allow_tf32)
    if precision == "none":
        precision = getattr(_cudnn_flags, "fp32_precision", "none")
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def plan_key(
    x: torch.Tensor,
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    layout: Optional[str] = None,
    x_shape: Optional[Sequence[int]] = None,
) -> PlanKey:
    """Everything that defines the plans of a convolution of ``x`` (its device and dtype; its
    shape unless ``x_shape`` gives the problem's input shape, as for a transposed layer), read
    now: the device, dtype, layout and shapes, the geometry, and PyTorch's switches
    (``allow_tf32`` off maps fp32 to cuDNN's FMA math; ``deterministic`` or
    ``use_deterministic_algorithms`` admits only deterministic candidates)."""
    device = x.device
    if device.type == "cuda":
        device_type, index = device_of(x)
    else:
        device_type, index = device.type, -1
    dtype = x.dtype
    math = "fma" if dtype is torch.float32 and not conv_allows_tf32() else "default"
    deterministic = bool(
        _cudnn_flags.deterministic or torch.are_deterministic_algorithms_enabled()
    )
    shape = tuple(x.shape if x_shape is None else (int(v) for v in x_shape))
    return PlanKey(
        device_type, index, dtype, layout or layout_of(x), shape, tuple(weight_shape),
        tuple(stride), tuple(padding), tuple(dilation), groups, math, deterministic,
    )


def signature(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
    grad_output: Optional[torch.Tensor] = None,
    output_padding: Optional[Sequence[int]] = None,
) -> Tuple[Any, ...]:
    """Everything :func:`._checks.check_operands` and :func:`plan_key` read from one call, as a
    hashable tuple: shapes, dtypes and devices of every operand, the input's memory format,
    the geometry (a transposed call's ``output_padding`` too) and PyTorch's switches. Equal
    signatures pass the same checks and run the same plans, so both are decided once per
    signature."""
    return (
        x.shape, weight.shape, x.dtype, weight.dtype, x.device, weight.device,
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        None if grad_output is None
        else (grad_output.shape, grad_output.dtype, grad_output.device),
        fmt, tuple(stride), tuple(padding), tuple(dilation), groups,
        None if output_padding is None else tuple(output_padding),
        conv_allows_tf32(), _cudnn_flags.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )


@functools.lru_cache(maxsize=4096)
def output_shape_of(key: PlanKey) -> Tuple[int, ...]:
    """The convolution problem's output shape ``(n, k, *spatial)`` of a plan key (remembered
    per key: every forward asks)."""
    x_shape, w_shape = key.input_shape, key.weight_shape
    return (x_shape[0], w_shape[0]) + output_size(
        x_shape[2:], w_shape[2:], key.stride, key.padding, key.dilation
    )


def problem_of(key: PlanKey) -> Dict[str, Any]:
    """The C ABI's problem (JSON object) of a plan key, 2-D or 3-D (depth fields)."""
    x_shape, w_shape = key.input_shape, key.weight_shape
    n, c, h, w = x_shape[0], x_shape[1], x_shape[-2], x_shape[-1]
    k, r, s = w_shape[0], w_shape[-2], w_shape[-1]
    depth = {} if len(x_shape) == 4 else {"d": x_shape[2], "t": w_shape[2]}
    return _tuner.problem(
        n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=key.stride, padding=key.padding,
        dilation=key.dilation, groups=key.groups, dtype=DTYPES[key.dtype], layout=key.layout,
        math=key.math, **depth,
    )


@dataclass
class Discovery:
    """Records, while active, the inputs each converted layer sees (for
    :func:`mucudnn.torch.tune`)."""

    #: (layer, plan key) per call, in model order.
    seen: List[Tuple[Any, PlanKey]] = field(default_factory=list)


_discovery = threading.local()


def active_discovery() -> Optional[Discovery]:
    return getattr(_discovery, "value", None)


def set_discovery(value: Optional[Discovery]) -> None:
    _discovery.value = value

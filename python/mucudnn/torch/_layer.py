"""``Conv2d``: a ``torch.nn.Conv2d`` whose convolutions mucudnn tunes and executes, and
``convert_``, which swaps it in for every ``nn.Conv2d`` of a model."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import _lib
from .._lib import MucudnnError
from .._tuner import Settings
from . import _ops, _runtime


def parse_size(value: Union[int, str, None]) -> Optional[int]:
    """Bytes from an int, ``"64MiB"`` (or ``K``/``M``/``G``/``T``, powers of 1024; parsed by the
    library, as the CLI parses sizes), or ``None`` / ``"unlimited"`` for no limit. Decimal units
    (``"64MB"``) are refused as ambiguous."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"workspace_limit must be bytes or a size string, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"workspace_limit must be >= 0 bytes, not {value}")
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("unlimited", "none"):
            return None
        # A library that cannot be loaded (MUCUDNN_LIBRARY, a missing build) raises its own
        # error here, not one labelled as a bad workspace_limit.
        _lib.library()
        try:
            return _lib.parse_size(value)
        except MucudnnError as e:
            raise ValueError(f"workspace_limit: {e}") from None
    raise TypeError(f"workspace_limit must be bytes or a size string, not {type(value).__name__}")


_POLICIES = ("undivided", "power-of-two", "all")
_CANDIDATES = ("legacy", "engines", "all")


def make_settings(
    workspace_limit: Union[int, str, None] = "64MiB",
    policy: str = "power-of-two",
    candidates: str = "all",
    max_candidates: Optional[int] = None,
    prune_margin: Optional[float] = 1.5,
) -> Settings:
    if policy not in _POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(_POLICIES)}")
    if candidates not in _CANDIDATES:
        raise ValueError(f"candidates {candidates!r}: expected one of {', '.join(_CANDIDATES)}")
    if max_candidates is not None and (not isinstance(max_candidates, int) or max_candidates < 1):
        raise ValueError(f"max_candidates must be a whole number >= 1 or None, not {max_candidates!r}")
    if prune_margin is not None and not (float(prune_margin) > 1.0):
        raise ValueError(f"prune_margin must be > 1 or None, not {prune_margin!r}")
    return Settings(
        policy=policy,
        workspace_limit=parse_size(workspace_limit),
        candidates=candidates,
        max_candidates=max_candidates,
        prune_margin=None if prune_margin is None else float(prune_margin),
    )


class Conv2d(nn.Conv2d):
    """A drop-in ``torch.nn.Conv2d`` (same constructor, parameters, ``state_dict`` keys and
    semantics) whose forward and backward passes run mucudnn's plans: each new input shape is
    tuned on first sight through the tuning cache (the file the ``mucudnn`` CLI uses), then
    only executed.

    Keyword-only options: ``workspace_limit`` (bytes, ``"64MiB"``, or ``None`` for no limit;
    per layer and op), ``policy`` (``"power-of-two"``, ``"all"``, ``"undivided"``),
    ``candidates`` (``"all"``, ``"legacy"``, ``"engines"``), ``cache`` (a file path; ``None``:
    the default location; ``False``: in memory only), ``name`` (shown in plans and errors),
    ``max_candidates``, ``prune_margin``, ``verbose``, and ``fallback`` (default ``True``: an
    input shape that no candidate supports, or whose plans cannot fit the limit, runs PyTorch's
    own convolution, with a warning on stderr and the reason in :attr:`plans`; ``False``:
    raise instead). An input shape tuned on first use (not by :func:`mucudnn.torch.tune`) prints
    one line on stderr, unless the environment sets ``MUCUDNN_QUIET=1``.

    CPU tensors run mucudnn's CPU backend (fp32, fp16, bf16); CUDA tensors run cuDNN plans on
    the current stream with workspace from PyTorch's caching allocator. ``channels_last``
    inputs run as NHWC.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
        *,
        workspace_limit: Union[int, str, None] = "64MiB",
        policy: str = "power-of-two",
        candidates: str = "all",
        cache: Any = None,
        name: Optional[str] = None,
        max_candidates: Optional[int] = None,
        prune_margin: Optional[float] = 1.5,
        verbose: bool = False,
        fallback: bool = True,
    ):
        label = name or "mucudnn.torch.Conv2d"
        if padding_mode != "zeros":
            raise ValueError(
                f"{label}: padding_mode={padding_mode!r} is not supported by mucudnn (only "
                "'zeros'); keep this layer a torch.nn.Conv2d"
            )
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device=device, dtype=dtype,
        )
        try:
            settings = make_settings(workspace_limit, policy, candidates, max_candidates, prune_margin)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{label}: {e}") from None
        # The layer's only mucudnn state: a string of plain values (pickled with the module;
        # the ops take it as their last argument). Prepared plans live in the runtime's
        # process-wide table, rebuilt on first use in any process.
        self._mucudnn_config = _runtime.config_text(
            name or f"conv2d.{id(self):x}", settings, cache, verbose, fallback
        )
        _runtime.retain(self._mucudnn_config, self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # pickle, copy.deepcopy, torch.load: the runtime state is rebuilt on first use.
        super().__setstate__(state)
        _runtime.retain(self._mucudnn_config, self)

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"{self.mucudnn_name}: a mucudnn Conv2d cannot be compiled by torch.jit.script (its "
            "convolutions are Python custom ops); use torch.compile, torch.export or "
            "torch.jit.trace instead"
        )

    @property
    def _mucudnn(self) -> "_runtime.LayerConfig":
        """This layer's configuration in the runtime (its prepared plans and reports)."""
        return _runtime.config_for(self._mucudnn_config)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, **options: Any) -> "Conv2d":
        """A mucudnn ``Conv2d`` with ``conv``'s geometry that shares its parameters."""
        label = options.get("name") or type(conv).__name__
        if conv.padding_mode != "zeros":
            raise ValueError(
                f"{label}: padding_mode={conv.padding_mode!r} is not supported by mucudnn (only "
                "'zeros'); pass skip_unsupported=True to convert_ to keep such layers as they are"
            )
        if isinstance(conv.weight, nn.parameter.UninitializedParameter):
            raise ValueError(f"{label}: a lazy Conv2d must see an input before conversion")
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, device="meta", **options,
        )
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new

    @property
    def mucudnn_name(self) -> str:
        return self._mucudnn.name

    @property
    def plans(self) -> "_runtime.Plans":
        """Per input shape (n, c, h, w) tuned so far, a mapping to :class:`PlanReport`: each
        op's split, candidates, predicted time and workspace, where the plans came from and
        the tuning time. Prints as a table (one row per shape and op) with the peak measuring
        memory of the tuning. Where one input shape was tuned for several problems (another
        weight, geometry or PyTorch switch), the last one tuned."""
        config = self._mucudnn
        return _runtime.Plans(
            config.name, {report.shape: report for report in list(config.reports.values())}
        )

    def extra_repr(self) -> str:
        s = self._mucudnn.settings
        limit = "unlimited" if s.workspace_limit is None else f"{s.workspace_limit} B"
        return f"{super().extra_repr()}, mucudnn: {s.policy}, {limit}, {s.candidates}"

    def _check(self, input: torch.Tensor, weight: torch.Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(
                f"{self.mucudnn_name}: expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got "
                f"shape {tuple(input.shape)}"
            )
        # The weight, not in_channels: surgery may replace the weight alone, as nn.Conv2d allows.
        expected = weight.shape[1] * self.groups
        if input.shape[1] != expected:
            raise ValueError(
                f"{self.mucudnn_name}: input has {input.shape[1]} channels, the layer expects "
                f"{expected} (input shape {tuple(input.shape)})"
            )

    def _symmetric_input(self, input: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """The input and the symmetric padding mucudnn runs (``'same'`` with an even total
        pads the extra row and column at the end first, as PyTorch does). Read from the layer
        at each call, so a changed ``padding`` takes effect as in ``nn.Conv2d``."""
        padding = self.padding
        if not isinstance(padding, str):
            return input, _pair(padding)
        if padding == "valid":
            return input, (0, 0)
        kernel = (self.weight if weight is None else weight).shape[2:]
        pads = []
        extra = []
        for d, k in zip(_pair(self.dilation), kernel):
            total = d * (k - 1)
            pads.append(total // 2)
            extra.append(total - 2 * (total // 2))
        if any(extra):
            input = F.pad(input, (0, extra[1], 0, extra[0]))
        return input, tuple(pads)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{self.mucudnn_name}: expected a tensor, got {type(input).__name__}")
        unbatched = input.dim() == 3
        if unbatched:
            input = input.unsqueeze(0)
        # The geometry and the weight are read at every call (never a cached copy).
        weight = self.weight
        groups = self.groups
        self._check(input, weight)
        x, padding = self._symmetric_input(input, weight)
        stride = _pair(self.stride)
        dilation = _pair(self.dilation)
        r, s = weight.shape[2], weight.shape[3]
        p, q = _runtime.output_hw(x.shape[2], x.shape[3], r, s, stride, padding, dilation)
        if p <= 0 or q <= 0:
            raise ValueError(
                f"{self.mucudnn_name}: input {tuple(input.shape)} is too small for kernel "
                f"{(r, s)} with padding {tuple(padding)} and dilation {tuple(dilation)} (output "
                f"would be {p}x{q})"
            )
        discovery = _runtime.active_discovery()
        if weight.shape[1] == 0:
            # No input channels: whatever nn.Conv2d returns (an empty tensor in PyTorch 2.x).
            y = F.conv2d(x, weight, self.bias, stride, padding, dilation, groups)
        elif discovery is not None:
            discovery.seen.append((self, x.detach(), list(stride), list(padding), list(dilation), groups))
            y = F.conv2d(x, weight, self.bias, stride, padding, dilation, groups)
        else:
            y = _ops.conv2d_op(
                x, weight, self.bias, stride, padding, dilation, groups, self._mucudnn_config
            )
        return y.squeeze(0) if unbatched else y


def _pair(value: Any) -> Tuple[int, int]:
    """A layer's stride, padding or dilation as a pair of ints (nn.Conv2d keeps tuples; after
    surgery it may be an int or a list)."""
    if type(value) is tuple and len(value) == 2:
        return value
    if isinstance(value, int):
        return (value, value)
    return tuple(int(v) for v in value)


def convert_(model: nn.Module, *, skip_unsupported: bool = False, **options: Any) -> nn.Module:
    """Replaces every ``nn.Conv2d`` in ``model`` (in place) with a mucudnn :class:`Conv2d` that
    shares its parameters, so optimizers, ``state_dict`` keys and loaded weights keep working.
    Layers are named by their module path. ``options`` are :class:`Conv2d`'s keyword-only
    options. Layers with a ``padding_mode`` other than ``'zeros'`` are an error, or are left as
    they are with ``skip_unsupported=True``. Returns the model (a new module when ``model``
    itself is an ``nn.Conv2d``)."""
    if "name" in options:
        raise TypeError("convert_ names each layer by its module path; do not pass name=")
    if isinstance(model, nn.Conv2d) and not isinstance(model, Conv2d):
        return Conv2d.from_conv(model, name="conv", **options)
    targets = []
    # Every registration (not named_children(), which lists a module registered under two
    # names once): each reference must be replaced. A parent listed once is enough, since
    # replacing its attribute replaces it for every reference to the parent.
    for parent_name, parent in model.named_modules():
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, nn.Conv2d) and not isinstance(child, Conv2d):
                qualified = f"{parent_name}.{child_name}" if parent_name else child_name
                if child.padding_mode != "zeros" and skip_unsupported:
                    continue
                targets.append((parent, child_name, child, qualified))
    converted = {}
    for parent, child_name, child, qualified in targets:
        if id(child) not in converted:  # a module used twice stays one module
            converted[id(child)] = Conv2d.from_conv(child, name=qualified, **options)
        setattr(parent, child_name, converted[id(child)])
    return model

"""``Conv1d``, ``Conv2d``, ``Conv3d`` and ``ConvTranspose1d/2d/3d``: the ``torch.nn`` layers
whose convolutions mucudnn tunes and executes, and ``convert_``, which swaps them in for the
``torch.nn`` layers of a model.

One class, :class:`_MucudnnConv`, holds what they share (options, configuration, plans,
conversion); each layer says how its input maps to the ops: 2-D and 3-D layers call the ops of
their rank, 1-D layers the 2-D ops over unit-height views of their tensors, transposed layers
``conv_transpose{2,3}d`` (their convolution problem's backward-data)."""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import _keys, _ops, _registry, _reports, _routes
from ._options import (  # noqa: F401 (the names this module exported before)
    _OPTIONS_DOC,
    LAYER_OPTIONS,
    check_kinds,
    check_split,
    make_settings,
    parse_size,
)


def layer_config_text(name: str, options: Dict[str, Any], label: Optional[str] = None) -> str:
    """The configuration string (``_registry.config_text``) of a layer named ``name`` with the
    keyword-only ``options`` (others at their defaults). A bad option is a ``TypeError`` or
    ``ValueError`` naming ``label`` (default: ``name``)."""
    label = label or name
    unknown = sorted(set(options) - set(LAYER_OPTIONS))
    if unknown:
        raise TypeError(f"{label}: unknown option(s) {', '.join(unknown)}")
    o = {**LAYER_OPTIONS, **options}
    try:
        settings = make_settings(
            o["workspace_limit"], o["policy"], o["candidates"], o["max_candidates"],
            o["prune_margin"], o["split"], o["verify"],
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{label}: {e}") from None
    return _registry.config_text(name, settings, o["cache"], o["verbose"], o["fallback"])


def _tuple(value: Any, spatial: int) -> Tuple[int, ...]:
    """A layer's stride, padding or dilation as ``spatial`` ints (nn layers keep tuples; after
    surgery it may be an int or a list)."""
    if type(value) is tuple and len(value) == spatial:
        return value
    if isinstance(value, int):
        return (value,) * spatial
    return tuple(int(v) for v in value)


def _pair(value: Any) -> Tuple[int, int]:
    return _tuple(value, 2)  # type: ignore[return-value]


class _MucudnnConv:
    """What every mucudnn layer shares; mixed in before its ``torch.nn`` class."""

    #: ``convert_``'s name of the kind (``"conv2d"``, ``"conv_transpose3d"``, ...).
    kind: str = ""
    #: The layer's spatial dims (1, 2, 3) and whether it is transposed.
    spatial: int = 2
    transposed: bool = False

    def __init__(
        self,
        *args: Any,
        workspace_limit: Union[int, str, None] = "64MiB",
        policy: str = "power-of-two",
        candidates: str = "all",
        cache: Any = None,
        name: Optional[str] = None,
        max_candidates: Optional[int] = None,
        prune_margin: Optional[float] = 1.5,
        verbose: bool = False,
        fallback: bool = True,
        split: str = "auto",
        verify: bool = True,
        **kwargs: Any,
    ):
        label = name or f"mucudnn.torch.{type(self).__name__}"
        padding_mode = kwargs.get("padding_mode", "zeros")
        base = _TORCH_CLASSES[self.kind]
        if padding_mode != "zeros":
            raise ValueError(
                f"{label}: padding_mode={padding_mode!r} is not supported by mucudnn (only "
                f"'zeros'); keep this layer a torch.nn.{base.__name__}"
            )
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.padding_mode != "zeros":  # given by position
            raise ValueError(
                f"{label}: padding_mode={self.padding_mode!r} is not supported by mucudnn (only "
                f"'zeros'); keep this layer a torch.nn.{base.__name__}"
            )
        # The layer's only mucudnn state: a string of plain values (pickled with the module;
        # the ops take it as their last argument). Prepared plans live in the runtime's
        # process-wide table, rebuilt on first use in any process.
        self._mucudnn_config = layer_config_text(
            name or f"{self.kind}.{id(self):x}",
            dict(
                workspace_limit=workspace_limit, policy=policy, candidates=candidates,
                cache=cache, max_candidates=max_candidates, prune_margin=prune_margin,
                verbose=verbose, fallback=fallback, split=split, verify=verify,
            ),
            label,
        )
        _registry.retain(self._mucudnn_config, self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # pickle, copy.deepcopy, torch.load: the runtime state is rebuilt on first use.
        super().__setstate__(state)  # type: ignore[misc]
        _registry.retain(self._mucudnn_config, self)

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"{self.mucudnn_name}: a mucudnn {type(self).__name__} cannot be compiled by "
            "torch.jit.script (its convolutions are Python custom ops); use torch.compile, "
            "torch.export or torch.jit.trace instead"
        )

    @property
    def _mucudnn(self) -> "_registry.LayerConfig":
        """This layer's configuration in the runtime (its prepared plans and reports)."""
        return _registry.config_for(self._mucudnn_config)

    @classmethod
    def from_conv(cls, conv: nn.Module, **options: Any):
        """A mucudnn layer with ``conv``'s geometry that shares its parameters."""
        label = options.get("name") or type(conv).__name__
        if conv.padding_mode != "zeros":
            raise ValueError(
                f"{label}: padding_mode={conv.padding_mode!r} is not supported by mucudnn (only "
                "'zeros'); pass skip_unsupported=True to convert_ to keep such layers as they are"
            )
        if isinstance(conv.weight, nn.parameter.UninitializedParameter):
            raise ValueError(f"{label}: a lazy {cls.__name__} must see an input before conversion")
        geometry = dict(
            in_channels=conv.in_channels, out_channels=conv.out_channels,
            kernel_size=conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
        )
        if cls.transposed:
            geometry["output_padding"] = conv.output_padding
        new = cls(**geometry, device="meta", **options)
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new

    @property
    def mucudnn_name(self) -> str:
        return self._mucudnn.name

    def _layer_shape(self, report: "_reports.PlanReport") -> Tuple[int, ...]:
        """The input shape of this layer that a report's convolution problem serves."""
        shape = report.output_shape if self.transposed else report.shape
        return _runtime_shape_to_layer(shape, self.spatial)

    @property
    def plans(self) -> "_reports.Plans":
        """Per input shape tuned so far (this layer's input: ``(n, c, h, w)`` for a Conv2d,
        ``(n, c, l)`` for 1-D, ``(n, c, d, h, w)`` for 3-D layers), a mapping to
        :class:`PlanReport`: each op's split, candidates, predicted time and workspace, where
        the plans came from and the tuning time. Prints as a table (one row per shape and op)
        with the peak measuring memory of the tuning. Where one input shape was tuned for
        several problems (another weight, geometry or PyTorch switch), the last one tuned. A
        transposed layer's reports are its convolution problem's (its forward runs
        ``bwd_data``, its input gradient ``fwd``)."""
        config = self._mucudnn
        return _reports.Plans(
            config.name,
            {self._layer_shape(report): report for report in list(config.reports.values())},
        )

    def extra_repr(self) -> str:
        s = self._mucudnn.settings
        limit = "unlimited" if s.workspace_limit is None else f"{s.workspace_limit} B"
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, mucudnn: {s.policy}, {limit}, {s.candidates}, split {s.split}"

    def _check(self, input: torch.Tensor, weight: torch.Tensor) -> None:
        rank = self.spatial + 2
        if input.dim() != rank:
            dims = {1: "(C, L)", 2: "(C, H, W)", 3: "(C, D, H, W)"}[self.spatial]
            raise ValueError(
                f"{self.mucudnn_name}: expected a {rank - 1}-D {dims} or {rank}-D (N, "
                f"{dims[1:]} input, got shape {tuple(input.shape)}"
            )
        # The weight, not in_channels: surgery may replace the weight alone, as nn layers allow.
        expected = weight.shape[0] if self.transposed else weight.shape[1] * self.groups
        if input.shape[1] != expected:
            raise ValueError(
                f"{self.mucudnn_name}: input has {input.shape[1]} channels, the layer expects "
                f"{expected} (input shape {tuple(input.shape)})"
            )

    def _batched(self, input: Any) -> Tuple[torch.Tensor, bool]:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{self.mucudnn_name}: expected a tensor, got {type(input).__name__}")
        unbatched = input.dim() == self.spatial + 1
        return (input.unsqueeze(0) if unbatched else input), unbatched


def _runtime_shape_to_layer(shape: Tuple[int, ...], spatial: int) -> Tuple[int, ...]:
    """A convolution problem's (2-D or 3-D) shape as a layer of ``spatial`` dims sees it: a
    1-D layer's problem has a unit height, left out."""
    if spatial == 1 and len(shape) == 4:
        return (shape[0], shape[1], shape[3])
    return tuple(shape)


def _unit_height(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor (N, C, L) or weight (K, C/g, S) as 2-D with height 1 (a view)."""
    return t.unsqueeze(2)


class _Conv(_MucudnnConv):
    """A convolution layer (1-D, 2-D, 3-D)."""

    def _symmetric_input(self, input: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """The input and the symmetric padding mucudnn runs (``'same'`` with an even total
        pads the extra row and column at the end first, as PyTorch does). Read from the layer
        at each call, so a changed ``padding`` takes effect as in the nn layers."""
        padding = self.padding
        if not isinstance(padding, str):
            return input, _tuple(padding, self.spatial)
        if padding == "valid":
            return input, (0,) * self.spatial
        kernel = (self.weight if weight is None else weight).shape[2:]
        pads = []
        extra = []
        for d, k in zip(_tuple(self.dilation, self.spatial), kernel):
            total = d * (k - 1)
            pads.append(total // 2)
            extra.append(total - 2 * (total // 2))
        if any(extra):
            # F.pad takes the last dim first: (end of W) ... (end of D).
            pad_spec = []
            for e in reversed(extra):
                pad_spec += [0, e]
            input = F.pad(input, tuple(pad_spec))
        return input, tuple(pads)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if type(input) is torch.Tensor:
            y = _routes.fast_forward(self, input)
            if y is not None:
                return y
        input, unbatched = self._batched(input)
        # The geometry and the weight are read at every call (never a cached copy).
        weight = self.weight
        groups = self.groups
        spatial = self.spatial
        self._check(input, weight)
        x, padding = self._symmetric_input(input, weight)
        stride = _tuple(self.stride, spatial)
        dilation = _tuple(self.dilation, spatial)
        kernel = tuple(weight.shape[2:])
        out = _keys.output_size(x.shape[2:], kernel, stride, padding, dilation)
        if any(v <= 0 for v in out):
            raise ValueError(
                f"{self.mucudnn_name}: input {tuple(input.shape)} is too small for kernel "
                f"{kernel} with padding {tuple(padding)} and dilation {tuple(dilation)} (output "
                f"would be {'x'.join(map(str, out))})"
            )
        torch_conv = _TORCH_CONV[spatial]
        if spatial == 1:
            # 1-D runs as 2-D with a unit height: views, no copies.
            x4, w4 = _unit_height(x), _unit_height(weight)
            args = (x4, w4, (1,) + stride, (0,) + padding, (1,) + dilation)
            ops = _ops.OPS[2]
        else:
            args = (x, weight, stride, padding, dilation)
            ops = _ops.OPS[spatial]
        discovery = _keys.active_discovery()
        if weight.shape[1] == 0:
            # No input channels: whatever the nn layer returns (an empty tensor in PyTorch 2.x).
            y = torch_conv(x, weight, self.bias, stride, padding, dilation, groups)
        elif discovery is not None:
            xs, ws, st, pa, di = args
            key = _keys.plan_key(xs.detach(), ws.shape, st, pa, di, groups)
            discovery.seen.append((self, key))
            y = torch_conv(x, weight, self.bias, stride, padding, dilation, groups)
        else:
            xs, ws, st, pa, di = args
            y = _with_backward_hint(
                xs, ws, ops.conv, xs, ws, self.bias, list(st), list(pa), list(di), groups,
                self._mucudnn_config,
            )
            if spatial == 1:
                y = y.squeeze(2)
            elif not unbatched and x is input:
                _routes.remember(self, x, weight, self.bias, st, pa, di)
        return y.squeeze(0) if unbatched else y


class _ConvTranspose(_MucudnnConv):
    """A transposed convolution layer (1-D, 2-D, 3-D): its convolution problem's backward-data
    (docs/pytorch.md)."""

    transposed = True

    def forward(self, input: torch.Tensor, output_size: Optional[Sequence[int]] = None) -> torch.Tensor:
        input, unbatched = self._batched(input)
        weight = self.weight
        groups = self.groups
        spatial = self.spatial
        self._check(input, weight)
        stride = _tuple(self.stride, spatial)
        padding = _tuple(self.padding, spatial)
        dilation = _tuple(self.dilation, spatial)
        kernel = tuple(weight.shape[2:])
        if output_size is not None and len(output_size) > spatial:
            output_size = list(output_size)[-spatial:]  # (N, C, *size) or (C, *size)
        output_padding = tuple(
            self._output_padding(  # type: ignore[attr-defined]
                input, output_size, list(stride), list(padding), list(kernel), spatial,
                list(dilation),
            )
        )
        out = _keys.transposed_size(
            input.shape[2:], kernel, stride, padding, output_padding, dilation
        )
        if any(v <= 0 for v in out):
            raise ValueError(
                f"{self.mucudnn_name}: input {tuple(input.shape)} with kernel {kernel}, padding "
                f"{tuple(padding)} and dilation {tuple(dilation)} gives no output (it would be "
                f"{'x'.join(map(str, out))})"
            )
        torch_transpose = _TORCH_CONV_TRANSPOSE[spatial]

        def pytorch() -> torch.Tensor:
            return torch_transpose(
                input, weight, self.bias, stride, padding, output_padding, groups, dilation
            )

        if weight.shape[1] == 0 or weight.shape[0] == 0:
            y = pytorch()
        elif any(op >= st for op, st in zip(output_padding, stride)):
            # Allowed by PyTorch when smaller than the dilation: the output then has rows no
            # convolution reaches, outside the mapping to a convolution problem.
            _warn_output_padding(self, output_padding, stride)
            y = pytorch()
        else:
            if spatial == 1:
                x, w = _unit_height(input), _unit_height(weight)
                geometry = ((1,) + stride, (0,) + padding, (0,) + output_padding, (1,) + dilation)
                ops = _ops.OPS[2]
            else:
                x, w = input, weight
                geometry = (stride, padding, output_padding, dilation)
                ops = _ops.OPS[spatial]
            discovery = _keys.active_discovery()
            if discovery is not None:
                st, pa, op, di = geometry
                y_shape = (x.shape[0], w.shape[1] * groups) + _keys.transposed_size(
                    x.shape[2:], w.shape[2:], st, pa, op, di
                )
                layout = _keys.layout_of(x)
                key = _keys.plan_key(x.detach(), w.shape, st, pa, di, groups, layout, y_shape)
                discovery.seen.append((self, key))
                y = pytorch()
            else:
                st, pa, op, di = (list(g) for g in geometry)
                y = _with_backward_hint(
                    x, w, ops.transpose, x, w, self.bias, st, pa, op, di, groups,
                    self._mucudnn_config,
                )
                if spatial == 1:
                    y = y.squeeze(2)
        return y.squeeze(0) if unbatched else y


def _with_backward_hint(x: torch.Tensor, weight: torch.Tensor, op, *args) -> torch.Tensor:
    """``op(*args)`` through :func:`_ops.call` (the backward hint, and the op's kernel called
    directly where nothing records or watches the call)."""
    return _ops.call(x, weight, op, *args)


def _warn_output_padding(layer: _MucudnnConv, output_padding, stride) -> None:
    config = layer._mucudnn
    if not config.warned_output_padding:
        config.warned_output_padding = True
        print(
            f"mucudnn: warning: {config.name}: output_padding {list(output_padding)} is not "
            f"smaller than the stride {list(stride)}; PyTorch's transposed convolution runs",
            file=sys.stderr,
        )


def _doc(torch_name: str, extra: str = "") -> str:
    return (
        f"A drop-in ``torch.nn.{torch_name}`` (same constructor, parameters, ``state_dict`` keys "
        "and semantics) whose forward and backward passes run mucudnn's plans: each new input "
        "shape is tuned on first sight through the tuning cache (the file the ``mucudnn`` CLI "
        f"uses), then only executed.{extra}\n" + _OPTIONS_DOC
    )


class Conv1d(_Conv, nn.Conv1d):
    kind, spatial = "conv1d", 1
    __doc__ = _doc("Conv1d", " It runs as a 2-D convolution with a unit height (views of its "
                   "tensors; cuDNN runs 1-D convolutions the same way).")


class Conv2d(_Conv, nn.Conv2d):
    kind, spatial = "conv2d", 2
    __doc__ = _doc("Conv2d")


class Conv3d(_Conv, nn.Conv3d):
    kind, spatial = "conv3d", 3
    __doc__ = _doc("Conv3d")


class ConvTranspose1d(_ConvTranspose, nn.ConvTranspose1d):
    kind, spatial = "conv_transpose1d", 1
    __doc__ = _doc("ConvTranspose1d", " It runs as its convolution problem's backward-data at "
                   "a unit height. ``output_padding`` (or ``forward``'s ``output_size``) must be "
                   "smaller than the stride to run mucudnn's plans; else PyTorch's runs.")


class ConvTranspose2d(_ConvTranspose, nn.ConvTranspose2d):
    kind, spatial = "conv_transpose2d", 2
    __doc__ = _doc("ConvTranspose2d", " It runs as its convolution problem's backward-data "
                   "(the input gradient as its forward, the weight gradient as its "
                   "backward-filter: one plan set). ``output_padding`` (or ``forward``'s "
                   "``output_size``) must be smaller than the stride to run mucudnn's plans; "
                   "else PyTorch's runs.")


class ConvTranspose3d(_ConvTranspose, nn.ConvTranspose3d):
    kind, spatial = "conv_transpose3d", 3
    __doc__ = ConvTranspose2d.__doc__.replace("ConvTranspose2d", "ConvTranspose3d")


_TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TORCH_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

#: ``convert_``'s kinds: the torch.nn class each replaces, and the mucudnn class.
KINDS: Dict[str, Tuple[Type[nn.Module], Type[_MucudnnConv]]] = {
    cls.kind: (base, cls)
    for base, cls in (
        (nn.Conv1d, Conv1d),
        (nn.Conv2d, Conv2d),
        (nn.Conv3d, Conv3d),
        (nn.ConvTranspose1d, ConvTranspose1d),
        (nn.ConvTranspose2d, ConvTranspose2d),
        (nn.ConvTranspose3d, ConvTranspose3d),
    )
}
_TORCH_CLASSES = {kind: base for kind, (base, _) in KINDS.items()}


def _kinds(kinds: Union[str, Iterable[str], None]) -> Tuple[str, ...]:
    return check_kinds(kinds, KINDS)


def _adopt(module: nn.Module, name: str, options: Dict[str, Any]) -> Optional[str]:
    """Makes ``module`` (a subclass of an ``nn.Conv*d``) run its convolutions through mucudnn
    in place: its class becomes :func:`_dispatch.adopted_class` of its own. Returns why it
    cannot be (it is then left as it is), else ``None``."""
    from . import _dispatch

    if isinstance(getattr(module, "weight", None), nn.parameter.UninitializedParameter):
        return "a lazy module must see an input before conversion"
    try:
        text = layer_config_text(name, options)
        cls = _dispatch.adopted_class(type(module))
        module.__class__ = cls
    except TypeError as e:
        return f"its class cannot be given a mucudnn forward: {e}"
    module._mucudnn_config = text
    _registry.retain(text, module)
    return None


def _reconfigure(module: "_MucudnnConv", options: Dict[str, Any]) -> None:
    """Gives a mucudnn layer (or adopted module) new options under its own name: later calls
    tune and run under them (plans tuned under the old ones stay in the cache)."""
    text = layer_config_text(module.mucudnn_name, options)
    if text != module._mucudnn_config:
        module._mucudnn_config = text
        _registry.retain(text, module)


def convert_(
    model: nn.Module,
    *,
    kinds: Union[str, Iterable[str], None] = None,
    skip_unsupported: bool = False,
    **options: Any,
) -> nn.Module:
    """Makes every ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` and ``nn.ConvTranspose1d/2d/3d``
    of ``model`` (in place) run its convolutions through mucudnn, without changing what the
    model computes. ``kinds`` chooses which (names from ``"conv1d"``, ``"conv2d"``,
    ``"conv3d"``, ``"conv_transpose1d"``, ``"conv_transpose2d"``, ``"conv_transpose3d"``; one
    name or several; default all). ``options`` are the layers' keyword-only options; each
    layer is named by its module path.

    - A module of exactly a ``torch.nn`` class is replaced by the mucudnn layer of its kind,
      sharing its parameters (optimizers, ``state_dict`` keys and loaded weights keep working).
      One with a ``padding_mode`` other than ``'zeros'`` is an error, or is left as it is with
      ``skip_unsupported=True``.
    - A module of a subclass (timm's ``StdConv2d``, diffusers' ``WanCausalConv3d``) stays the
      same object, an instance of its class with its ``forward``, attributes, hooks and
      ``state_dict``: its class becomes a subclass of its own whose ``forward`` runs the
      user's with every convolution it performs (``super().forward``, ``_conv_forward``, or
      ``F.conv*d`` with a weight or padding it computed) through mucudnn. It reports
      ``plans`` as mucudnn's layers do. One that cannot be adopted is left as it is, with one
      warning on stderr naming it and why.

    A module that is mucudnn's already (converted before, or built as a mucudnn layer) keeps
    its name and takes the ``options`` given, the others at their defaults as for a fresh
    conversion; with no options it is left as it is.

    Returns the model (a new module when ``model`` itself is a ``torch.nn`` layer replaced)."""
    from . import _dispatch

    if "name" in options:
        raise TypeError("convert_ names each layer by its module path; do not pass name=")
    classes = [KINDS[kind] for kind in _kinds(kinds)]
    layer_config_text("convert_", options)  # a bad option fails before anything changes

    reconfigured = set()

    def replacement(module: nn.Module) -> Optional[Type[_MucudnnConv]]:
        if isinstance(module, _MucudnnConv):
            if options and id(module) not in reconfigured:
                reconfigured.add(id(module))
                _reconfigure(module, options)
            return None
        for base, cls in classes:
            if isinstance(module, base):
                return cls
        return None

    def is_exact(module: nn.Module) -> bool:
        return type(module) in _TORCH_CLASSES.values()

    top = replacement(model)
    if top is not None:
        if is_exact(model):
            return top.from_conv(model, name="conv", **options)
        reason = _adopt(model, "conv", options)
        if reason is not None:
            _dispatch.warn_unadopted(f"conv ({type(model).__name__})", reason)
        return model
    targets = []
    adopted = set()
    # Every registration (not named_children(), which lists a module registered under two
    # names once): each reference must be replaced. A parent listed once is enough, since
    # replacing its attribute replaces it for every reference to the parent.
    for parent_name, parent in model.named_modules():
        for child_name, child in list(parent._modules.items()):
            cls = replacement(child) if child is not None else None
            if cls is None:
                continue
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if not is_exact(child):
                if id(child) not in adopted:
                    adopted.add(id(child))
                    reason = _adopt(child, qualified, options)
                    if reason is not None:
                        _dispatch.warn_unadopted(f"{qualified} ({type(child).__name__})", reason)
                continue
            if child.padding_mode != "zeros" and skip_unsupported:
                continue
            targets.append((parent, child_name, child, qualified, cls))
    converted = {}
    for parent, child_name, child, qualified, cls in targets:
        if id(child) not in converted:  # a module used twice stays one module
            converted[id(child)] = cls.from_conv(child, name=qualified, **options)
        setattr(parent, child_name, converted[id(child)])
    return model

"""Convolutions of code mucudnn did not write: a torch function mode that sends PyTorch's
functional convolutions (``F.conv1d/2d/3d``, ``F.conv_transpose1d/2d/3d``) to mucudnn's ops.

Two users of one mode, :class:`ConvMode`:

- **Adopted modules.** ``convert_`` keeps a subclass of an ``nn.Conv*d`` (timm's ``StdConv2d``,
  diffusers' ``WanCausalConv3d``) as the same object: its class becomes a subclass of the user's
  class made here (:func:`adopted_class`) whose ``forward`` runs the user's ``forward`` inside a
  mode bound to the module. Whatever convolution that forward performs (``super().forward``,
  ``_conv_forward``, or ``F.conv2d`` with a weight or padding it computed) reaches the mode and
  runs mucudnn's op with the module's settings and name; everything else the forward does is
  the user's code, unchanged. ``isinstance``, attributes, hooks and ``state_dict`` are the
  object's own.
- **The process switch.** :func:`enable` / :func:`disable` / :func:`enabled` push a mode with
  the given options on the calling thread's torch function mode stack: every functional
  convolution runs mucudnn's ops, named by the module path of its weight when a model was
  given, else by its problem.

Data enters as the functional call's arguments and leaves as the op's output. A call mucudnn
does not run (float64, another device or layout, channels that do not fit, an
``output_padding`` not below the stride) calls PyTorch's function itself, so its result and
errors are PyTorch's. Inside the mode's handler the mode is popped, so the fallbacks of the ops
(PyTorch's convolution) never come back to it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import _keys, _ops, _registry

_PLAIN = (torch.Tensor, nn.Parameter)


def _tuple(value: Any, spatial: int) -> Tuple[int, ...]:
    if type(value) is tuple and len(value) == spatial:  # as nn layers keep them
        return value
    if isinstance(value, int):
        return (value,) * spatial
    value = tuple(int(v) for v in value)
    return value * spatial if len(value) == 1 else value


def _backward_hint(x: torch.Tensor, weight: torch.Tensor, op: Callable, *args: Any) -> torch.Tensor:
    """``op(*args)``, telling the runtime whether a backward may follow (as the layers do)."""
    return _ops.call(x, weight, op, *args)


def _runs_here(x: Any, weight: Any, bias: Any) -> bool:
    """Whether mucudnn runs a convolution of these operands (else PyTorch's function does):
    plain strided tensors of one dtype mucudnn has (or any dtypes under autocast) on the CPU
    or a CUDA device."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return False
    if x.layout is not torch.strided or weight.layout is not torch.strided:
        return False
    if x.device.type not in ("cpu", "cuda") or weight.device != x.device:
        return False
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.device != x.device):
        return False
    if x.dtype not in _keys.DTYPES or weight.dtype not in _keys.DTYPES:
        return False
    if x.dtype is not weight.dtype or (bias is not None and bias.dtype is not x.dtype):
        # PyTorch's error outside autocast; the op's autocast kernel casts inside.
        from . import _autocast

        return _autocast.enabled_for(x.device)
    return True


def convolution(
    spatial: int,
    config: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    layer: Any = None,
) -> Optional[torch.Tensor]:
    """``F.conv{spatial}d(x, weight, bias, stride, padding, dilation, groups)`` through
    mucudnn's op with the configuration ``config``; ``None`` where mucudnn does not run it
    (the caller then calls PyTorch's function). ``padding`` may be ``"same"`` or ``"valid"``;
    unbatched inputs and 1-D convolutions (the 2-D op at unit height) are handled here."""
    if not _runs_here(x, weight, bias) or x.dim() not in (spatial + 1, spatial + 2):
        return None
    if weight.dim() != spatial + 2 or not isinstance(groups, int) or groups < 1:
        return None
    unbatched = x.dim() == spatial + 1
    if unbatched:
        x = x.unsqueeze(0)
    if x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups or weight.shape[1] == 0:
        return None
    stride = _tuple(stride, spatial)
    dilation = _tuple(dilation, spatial)
    kernel = tuple(weight.shape[2:])
    if isinstance(padding, str):
        if padding == "valid":
            pads = (0,) * spatial
        elif padding == "same" and all(s == 1 for s in stride):
            totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
            pads = tuple(t // 2 for t in totals)
            extra = [t - 2 * (t // 2) for t in totals]
            if any(extra):
                spec: list = []
                for e in reversed(extra):
                    spec += [0, e]
                x = F.pad(x, tuple(spec))
        else:
            return None  # PyTorch's error ("same" with a stride)
    else:
        pads = _tuple(padding, spatial)
    out = _keys.output_size(x.shape[2:], kernel, stride, pads, dilation)
    if any(v <= 0 for v in out) or len(stride) != spatial or len(pads) != spatial:
        return None
    if spatial == 1:
        xs, ws = x.unsqueeze(2), weight.unsqueeze(2)
        stride, pads, dilation = (1,) + stride, (0,) + pads, (1,) + dilation
        ops = _ops.OPS[2]
    else:
        xs, ws = x, weight
        ops = _ops.OPS[spatial]
    if layer is not None and not torch.compiler.is_compiling():
        discovery = _keys.active_discovery()
        if discovery is not None:
            key = _keys.plan_key(xs.detach(), ws.shape, stride, pads, dilation, groups)
            discovery.seen.append((layer, key))
            return None
    y = _backward_hint(
        xs, ws, ops.conv, xs, ws, bias, list(stride), list(pads), list(dilation), groups, config
    )
    if spatial == 1:
        y = y.squeeze(2)
    return y.squeeze(0) if unbatched else y


def conv_transpose(
    spatial: int,
    config: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Any,
    padding: Any,
    output_padding: Any,
    groups: int,
    dilation: Any,
    layer: Any = None,
) -> Optional[torch.Tensor]:
    """``F.conv_transpose{spatial}d`` (its argument order) through mucudnn's transposed op;
    ``None`` where mucudnn does not run it (an ``output_padding`` not below the stride, among
    others)."""
    if not _runs_here(x, weight, bias) or x.dim() not in (spatial + 1, spatial + 2):
        return None
    if weight.dim() != spatial + 2 or not isinstance(groups, int) or groups < 1:
        return None
    if isinstance(padding, str):
        return None
    unbatched = x.dim() == spatial + 1
    if unbatched:
        x = x.unsqueeze(0)
    if x.shape[1] != weight.shape[0] or weight.shape[0] % groups or 0 in weight.shape[:2]:
        return None
    stride = _tuple(stride, spatial)
    pads = _tuple(padding, spatial)
    output_padding = _tuple(output_padding, spatial)
    dilation = _tuple(dilation, spatial)
    if any(op >= st for op, st in zip(output_padding, stride)):
        return None
    out = _keys.transposed_size(
        x.shape[2:], weight.shape[2:], stride, pads, output_padding, dilation
    )
    if any(v <= 0 for v in out):
        return None
    if spatial == 1:
        xs, ws = x.unsqueeze(2), weight.unsqueeze(2)
        geometry = ((1,) + stride, (0,) + pads, (0,) + output_padding, (1,) + dilation)
        ops = _ops.OPS[2]
    else:
        xs, ws = x, weight
        geometry = (stride, pads, output_padding, dilation)
        ops = _ops.OPS[spatial]
    st, pa, op, di = geometry
    if layer is not None and not torch.compiler.is_compiling():
        discovery = _keys.active_discovery()
        if discovery is not None:
            y_shape = (xs.shape[0], ws.shape[1] * groups) + _keys.transposed_size(
                xs.shape[2:], ws.shape[2:], st, pa, op, di
            )
            key = _keys.plan_key(
                xs.detach(), ws.shape, st, pa, di, groups, _keys.layout_of(xs), y_shape
            )
            discovery.seen.append((layer, key))
            return None
    y = _backward_hint(
        xs, ws, ops.transpose, xs, ws, bias, list(st), list(pa), list(op), list(di), groups,
        config,
    )
    if spatial == 1:
        y = y.squeeze(2)
    return y.squeeze(0) if unbatched else y


#: The functions the mode takes over: (spatial dims, transposed, parameter names in order).
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_TRANSPOSE_ARGS = (
    "input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation"
)
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1,
             "output_padding": 0}
FUNCTIONS: Dict[Callable, Tuple[int, bool]] = {
    F.conv1d: (1, False), F.conv2d: (2, False), F.conv3d: (3, False),
    F.conv_transpose1d: (1, True), F.conv_transpose2d: (2, True), F.conv_transpose3d: (3, True),
}


_FAST_FUNCTIONS = (F.conv2d, F.conv3d)


def _arguments(names: Tuple[str, ...], args: tuple, kwargs: Optional[dict]) -> list:
    values = list(args) + [None] * (len(names) - len(args))
    if kwargs:
        for i, name in enumerate(names):
            if name in kwargs:
                values[i] = kwargs[name]
    for i in range(len(args), len(names)):
        if (not kwargs or names[i] not in kwargs):
            values[i] = _DEFAULTS[names[i]]
    return values


def _name_of_problem(spatial: int, transposed: bool, weight: torch.Tensor, values: list) -> str:
    """A name for a convolution no module names: its kind, weight shape and geometry."""
    kind = f"conv_transpose{spatial}d" if transposed else f"conv{spatial}d"
    parts = [kind, "x".join(str(int(v)) for v in weight.shape)]
    for label, index in (("s", 3), ("p", 4), ("d", 7 if transposed else 5)):
        value = values[index]
        parts.append(label + (value if isinstance(value, str) else
                              "x".join(str(int(v)) for v in _tuple(value, spatial))))
    groups = values[6]
    if groups != 1:
        parts.append(f"g{groups}")
    return "_".join(parts)


class ConvMode(TorchFunctionMode):
    """Runs the functional convolutions called while it is active through mucudnn: with the
    configuration of one module (``layer``; an adopted module's forward) or with ``options``
    (the process switch), naming each convolution by ``names`` (weight id -> module path) or
    its problem."""

    def __init__(
        self,
        layer: Any = None,
        options: Optional[Dict[str, Any]] = None,
        names: Optional[Dict[int, str]] = None,
    ):
        super().__init__()
        self.layer = layer
        self.names = names or {}
        #: (config text's start, its end): the text of a name is start + name + end.
        self._template: Optional[Tuple[str, str]] = None
        #: Config texts made by this mode, by name (released by :func:`disable`).
        self.texts: Dict[str, str] = {}
        #: The common calls' routes by call signature (:meth:`_fast`).
        self._routes: Dict[Tuple[Any, ...], Tuple[Any, ...]] = {}
        #: Names of problems seen, by (spatial, transposed, weight shape, geometry as given).
        self._problem_names: Dict[Tuple[Any, ...], str] = {}
        if layer is None:
            from ._layer import layer_config_text

            marker = "\x00name\x00"
            text = layer_config_text(marker, options or {})
            start, end = text.split(json.dumps(marker))
            self._template = (start + '"', '"' + end)
        #: Runs with this mode: how many convolutions went to mucudnn's ops (for tests).
        self.calls = 0

    def _config(self, spatial: int, transposed: bool, weight: torch.Tensor, values: list) -> str:
        if self.layer is not None:
            return self.layer._mucudnn_config
        name = self.names.get(id(weight))
        if name is None:
            try:  # the geometry as the caller gave it: tuples from nn layers
                problem = (spatial, transposed, weight.shape, *values[3:])
                name = self._problem_names.get(problem)
            except TypeError:  # a list among them
                problem = None
            if name is None:
                name = _name_of_problem(spatial, transposed, weight, values)
                if problem is not None and not torch.compiler.is_compiling():
                    self._problem_names[problem] = name
        text = self.texts.get(name)
        if text is None:
            start, end = self._template  # type: ignore[misc]
            text = start + name + end
            if not torch.compiler.is_compiling():
                self.texts[name] = text
        return text

    def _fast(self, func, args: tuple) -> Optional[torch.Tensor]:
        """The common call, as ``nn.Conv2d``/``nn.Conv3d`` make it (seven positional
        arguments, a batched input, numeric padding), through a route remembered per call
        signature: the checks and the geometry of :func:`convolution` once per signature.
        ``None`` when the call is not that (the general path then runs)."""
        x, weight, bias, stride, padding, dilation, groups = args
        if type(x) not in _PLAIN or type(weight) not in _PLAIN or x.dim() not in (4, 5):
            return None
        try:
            key = (
                func, x.shape, x.dtype, x.device, x.layout, weight.shape, weight.dtype,
                weight.device, None if bias is None else (bias.dtype, bias.device),
                stride, padding, dilation, groups,
                id(weight) if self.names else None,
            )
            route = self._routes.get(key)
        except TypeError:  # a list in the geometry: not hashable
            return None
        if route is None:
            spatial = x.dim() - 2
            if (
                FUNCTIONS[func] != (spatial, False)
                or isinstance(padding, str)
                or x.dtype is not weight.dtype
                or (bias is not None and bias.dtype is not x.dtype)
                or not _runs_here(x, weight, bias)
                or weight.dim() != x.dim()
                or not isinstance(groups, int) or groups < 1
                or x.shape[1] != weight.shape[1] * groups
                or weight.shape[0] % groups or weight.shape[1] == 0
            ):
                return None
            st, pa, di = _tuple(stride, spatial), _tuple(padding, spatial), _tuple(dilation, spatial)
            out = _keys.output_size(x.shape[2:], weight.shape[2:], st, pa, di)
            if any(v <= 0 for v in out) or len(st) != spatial or len(pa) != spatial:
                return None
            config = self._config(spatial, False, weight, list(args))
            route = (_ops.OPS[spatial].conv, list(st), list(pa), list(di), config)
            if not torch.compiler.is_compiling():
                self._routes[key] = route
        op, st, pa, di, config = route
        return _ops.call(x, weight, op, x, weight, bias, st, pa, di, groups, config)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.layer is None and not kwargs and len(args) == 7 and func in _FAST_FUNCTIONS:
            y = self._fast(func, args)
            if y is not None:
                self.calls += 1
                return y
        route = FUNCTIONS.get(func)
        if route is not None and (not types or all(t in _PLAIN for t in types)):
            spatial, transposed = route
            values = _arguments(_TRANSPOSE_ARGS if transposed else _CONV_ARGS, args, kwargs)
            config = self._config(spatial, transposed, values[1], values)
            if transposed:
                y = conv_transpose(spatial, config, *values, layer=self.layer)
            else:
                y = convolution(spatial, config, *values, layer=self.layer)
            if y is not None:
                self.calls += 1
                return y
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------
# Adopted modules: the user's class, its forward inside a mode bound to the module


def adopted_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """An adopted module's forward: the user's class's, with its convolutions through
    mucudnn."""
    with ConvMode(layer=self):
        return self._mucudnn_user_class.forward(self, *args, **kwargs)


_ADOPTED: Dict[type, type] = {}
_adopted_lock = threading.Lock()


def adopted_class(user_class: type) -> type:
    """The class an adopted ``user_class`` module gets: a subclass of it (every ``isinstance``
    holds) whose ``forward`` runs the user's inside a :class:`ConvMode` bound to the module,
    with what mucudnn's layers report (``plans``, ``mucudnn_name``). One per user class."""
    with _adopted_lock:
        made = _ADOPTED.get(user_class)
        if made is not None:
            return made
        from ._layer import KINDS, _MucudnnConv

        kind = next(k for k, (base, _) in KINDS.items() if issubclass(user_class, base))
        _, layer_class = KINDS[kind]
        namespace = {
            "kind": kind,
            "spatial": layer_class.spatial,
            "transposed": layer_class.transposed,
            "forward": adopted_forward,
            "_mucudnn_user_class": user_class,
            "__reduce_ex__": _adopted_reduce_ex,
            "__module__": user_class.__module__,
            "__qualname__": user_class.__qualname__,
            "__doc__": user_class.__doc__,
        }
        made = type(user_class.__name__, (_MucudnnConv, user_class), namespace)
        _ADOPTED[user_class] = made
        return made


def _new_adopted(user_class: type) -> Any:
    """pickle's constructor of an adopted module (its state follows)."""
    cls = adopted_class(user_class)
    return cls.__new__(cls)


def _adopted_reduce_ex(self: Any, protocol: int) -> Any:
    # The class made here cannot be found by name in another process; the user's can.
    reduced = object.__reduce_ex__(self, protocol)
    return (_new_adopted, (self._mucudnn_user_class,)) + tuple(reduced[2:])


# ------------------------------------------------------------------------------------------
# The process switch


_switch_lock = threading.Lock()
_active: Optional[ConvMode] = None


def _weight_names(model: Optional[nn.Module]) -> Dict[int, str]:
    """Module paths by the id of each convolution-shaped weight (3-D to 5-D) of ``model``."""
    names: Dict[int, str] = {}
    if model is not None:
        for path, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() >= 3:
                names.setdefault(id(weight), path or type(module).__name__)
    return names


def enable(model: Optional[nn.Module] = None, **options: Any) -> None:
    """Runs every convolution PyTorch runs on this thread (``nn.Conv*d`` modules and
    ``F.conv1d/2d/3d``, ``F.conv_transpose1d/2d/3d``, forward and backward, CPU and CUDA
    tensors) through mucudnn, without touching a model: ``options`` are the layers'
    keyword-only options (``workspace_limit``, ``policy``, ``split``, ...). With ``model``,
    convolutions of its modules' weights are named by their module path, others by their
    problem (``conv2d_64x32x3x3_s1x1_p1x1_d1x1``). A second call replaces the options.
    :func:`disable` restores PyTorch's convolutions."""
    global _active
    if "name" in options:
        raise TypeError("enable names each convolution itself; do not pass name=")
    mode = ConvMode(options=options, names=_weight_names(model))
    with _switch_lock:
        if _active is not None:
            _pop(_active)
        mode.__enter__()
        _active = mode


def _pop(mode: ConvMode) -> None:
    try:
        mode.__exit__(None, None, None)
    except Exception as e:  # another mode pushed after ours and still active
        raise RuntimeError(
            "mucudnn.torch.disable: another torch function mode was entered after enable() "
            f"and is still active; leave it first ({e})"
        ) from None
    for text in mode.texts.values():
        config = _registry._configs.get(text)
        if config is not None and config.owners == 0:
            config.release()


def disable() -> None:
    """Undoes :func:`enable`: PyTorch's convolutions run again (no mucudnn call). A no-op when
    not enabled."""
    global _active
    with _switch_lock:
        if _active is not None:
            mode, _active = _active, None
            _pop(mode)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _active is not None


@contextlib.contextmanager
def enabled(model: Optional[nn.Module] = None, **options: Any) -> Iterator[ConvMode]:
    """``with mucudnn.torch.enabled(**options):`` runs the block's convolutions through
    mucudnn (as :func:`enable`) and restores what was in effect before (PyTorch's, or an
    earlier :func:`enable`'s) after it. Yields the mode (``mode.calls`` counts the
    convolutions it ran)."""
    if "name" in options:
        raise TypeError("enabled names each convolution itself; do not pass name=")
    mode = ConvMode(options=options, names=_weight_names(model))
    with mode:
        yield mode


def warn_unadopted(name: str, reason: str) -> None:
    """The one warning ``convert_`` gives for a module it leaves as it is."""
    print(f"mucudnn: warning: {name}: left as it is ({reason})", file=sys.stderr)

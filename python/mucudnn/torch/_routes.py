"""The Python path's fast route (torch < 2.10): a converted layer's forward that nothing
records or watches, for a call it has run before, in a few operations: one dict lookup by the
call's signature, ``torch.empty``, one ctypes call into the library, the bias add.

A route is made after the full path ran a call whose operands are packed (and aligned, on a
GPU) and whose layer's plans are prepared; it holds that plan set and what executing it takes
(the output's shape and format, the operand extents, the workspace), keyed by everything the
full path decides from: the input's shape, strides, dtype and device, the weight's and the
bias's, and the layer's geometry. Anything the route does not know (autograd, autocast, a mode,
tracing, functorch, a CUDA operand at an unaligned address, a plan set replaced since) takes
the full path, which is where every check and tuning happen."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

import torch

from . import _keys, _legacy_account, _ops, _registry

#: The most routes a layer keeps (one per input signature; a layer fed ever new shapes starts
#: over rather than grow).
MAX_ROUTES = 16

Route = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]

#: Each layer's routes, beside it (a runtime cache: not its state, not pickled or copied).
_ROUTES: "weakref.WeakKeyDictionary[Any, Dict[Any, Route]]" = weakref.WeakKeyDictionary()


def key_of(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """What a route is keyed by (hashable; TypeError when the layer's geometry is not)."""
    return (
        x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
        weight.device, None if bias is None else (bias.shape, bias.dtype, bias.device),
        layer.stride, layer.padding, layer.dilation, layer.groups,
    )


def fast_forward(layer: Any, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The layer's output through its route, or ``None`` (the full path runs)."""
    routes = _ROUTES.get(layer)
    if not routes:
        return None
    weight, bias = layer.weight, layer.bias
    if torch.compiler.is_compiling() or _ops._needs_dispatch(x, weight, bias):
        return None
    try:
        route = routes.get(key_of(layer, x, weight, bias))
    except TypeError:  # a list in the geometry
        return None
    return None if route is None else route(x, weight, bias)


def remember(layer: Any, x: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor], stride, padding, dilation) -> None:
    """After the full path ran ``layer`` on ``x``: a route for calls like it, when one can
    stand (a 2-D or 3-D convolution of packed operands with prepared plans)."""
    spatial = x.dim() - 2
    if torch.compiler.is_compiling() or spatial not in (2, 3) or x.dim() != weight.dim():
        return
    if isinstance(layer.padding, str):
        return
    fmt = _keys.memory_format(x)
    if not (x.is_contiguous(memory_format=fmt) and weight.is_contiguous(memory_format=fmt)):
        return
    config = _registry._configs.get(layer._mucudnn_config)
    if config is None:
        return
    key = _keys.plan_key(x, weight.shape, stride, padding, dilation, layer.groups)
    ready = config.prepared.get(key)
    if ready is None or not ready.has[0]:
        return
    try:
        route_key = key_of(layer, x, weight, bias)
    except TypeError:
        return
    routes = _ROUTES.setdefault(layer, {})
    if len(routes) >= MAX_ROUTES:
        routes.clear()
    routes[route_key] = _route(config, ready, key, fmt)


def _route(config: Any, ready: Any, key: Any, fmt: torch.memory_format) -> Route:
    shape = _keys.output_shape_of(key)
    extents = ready.extents[0]
    needed = ready.workspace[0]
    tuner = ready.tuner
    plan_set = ready.id
    cuda = key.device_type == "cuda"
    spatial = len(shape) - 2
    bias_shape = (1, -1) + (1,) * spatial
    name = config.name
    #: The last bias seen and its view over the channels (a bias replaced makes a new view).
    bias_view = [None, None]

    def run(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        if cuda and (x.data_ptr() % 256 or weight.data_ptr() % 256):
            return None
        if not ready.enter():  # replaced or released since: the full path finds the new set
            return None
        try:
            y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
            if cuda:
                workspace = torch.empty(needed, dtype=torch.uint8, device=x.device) if needed else None
                stream = torch.cuda.current_stream(x.device).cuda_stream
                pointer = workspace.data_ptr() if workspace is not None else 0
                tuner.execute(plan_set, 0, x.data_ptr(), weight.data_ptr(), y.data_ptr(), extents,
                              workspace=pointer, workspace_bytes=needed if pointer else 0,
                              stream=stream)
            else:  # the CPU tuner's own host workspace, shared by all its plan sets
                tuner.execute(plan_set, 0, x.data_ptr(), weight.data_ptr(), y.data_ptr(), extents)
        finally:
            ready.leave()
        _legacy_account.executed(name, "fwd")
        if bias is not None:
            if bias_view[0] is not bias:
                bias_view[:] = [bias, bias.view(bias_shape)]
            y.add_(bias_view[1])
        return y

    return run


__all__ = ["fast_forward", "remember", "MAX_ROUTES"]

"""What the tests read of converted layers on either path of ``mucudnn.torch``, through what a
user can reach: a layer's name, options and plans, and the account of what ran.

The native path adopts modules in place (``module._mucudnn``, an ``Adoption``); the Python
path replaces plain ``torch.nn`` modules by mucudnn's layers (``mucudnn_name``, ``plans``,
``_mucudnn_config``) and adopts subclasses by a class change. mucudnn's own layers
(``mt.Conv2d``, ...) have ``mucudnn_name`` and ``plans`` on both."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Dict, Iterator, List

import pytest
from torch import nn

import mucudnn.torch as mt

NATIVE = mt.PATH == "native"

#: The marks of a test of the Python path's own design (custom ops, replaced classes, the
#: function mode), which the native path does not have: skipped there, and marked
#: ``python_path`` (scripts/test.sh runs those again under MUCUDNN_TORCH_PATH=python).
PYTHON_PATH_MARKS = [
    pytest.mark.python_path,
    pytest.mark.skipif(
        NATIVE, reason="the Python path's design (MUCUDNN_TORCH_PATH=python runs it)"
    ),
]


def python_path_only(test):
    """Decorates a test of the Python path's own design (see PYTHON_PATH_MARKS)."""
    for mark in PYTHON_PATH_MARKS:
        test = mark(test)
    return test


def is_converted(module: nn.Module) -> bool:
    """Whether mucudnn runs ``module``'s convolutions (converted, or mucudnn's own layer)."""
    if NATIVE:
        return "_mucudnn" in module.__dict__
    return isinstance(module, mt._layer._MucudnnConv)


def converted_layers(model: nn.Module) -> List[nn.Module]:
    """The converted convolution modules of ``model``, in module order."""
    return [m for m in model.modules() if is_converted(m)]


def name_of(module: nn.Module) -> str:
    """The layer's name (its module path after ``convert_``)."""
    return module._mucudnn.name if NATIVE else module.mucudnn_name


def plans_of(module: nn.Module) -> "mt.Plans":
    """The layer's plans by input shape (a :class:`mucudnn.torch.Plans`)."""
    return module._mucudnn.plans if NATIVE else module.plans


def options_of(module: nn.Module) -> Dict[str, Any]:
    """The layer's options as plain values: ``settings`` (``workspace_limit``, ``split``,
    ...), ``cache``, ``fallback``, ``verbose``."""
    text = module._mucudnn.options if NATIVE else module._mucudnn_config
    return json.loads(text)


def ran(name: str) -> Dict[str, int]:
    """The account of one name: op -> calls mucudnn's plans ran."""
    return {op: count["mucudnn"] for op, count in mt.account().get(name, {}).items()}


def mucudnn_runs() -> int:
    """Convolution ops mucudnn's plans ran, over every name of the account."""
    return sum(c["mucudnn"] for ops in mt.account().values() for c in ops.values())


def fallbacks() -> Dict[str, int]:
    """Calls left to PyTorch's kernel by a converted layer or the switch, by reason, over
    every name and op (the native path's account; the Python path counts none there)."""
    out: Dict[str, int] = {}
    for ops in mt.account().values():
        for count in ops.values():
            for reason, n in count["pytorch"].items():
                out[reason] = out.get(reason, 0) + n
    return out


@contextlib.contextmanager
def by_pytorch() -> Iterator[None]:
    """PyTorch's own kernels compute the block, for a reference. On the native path a
    converted layer claims every call whose weight has its signature (weight shape, stride,
    dilation, groups), an unconverted model's of the same shapes too: a reference computed
    next to a converted copy would be mucudnn's. Within the block its kernels run tune()'s
    discovery pass instead, which records each call and leaves it to PyTorch's kernel
    (counting and running nothing of mucudnn's). The Python path runs no unconverted module's
    convolution (outside ``enable()``): nothing to do."""
    if not NATIVE:
        yield
        return
    native = mt._native
    native.set_discovery(True)
    try:
        yield
    finally:
        native.set_discovery(False)
        native.take_discovered()

"""What the real-client tests (diffusers, timm) share: counting the convolutions a model runs
and those mucudnn's plans ran, and comparing outputs and gradients."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mucudnn.torch as mt

CONVOLUTIONS = (
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
)

#: What the tests give every mucudnn layer: an in-memory cache (shared by every layer of the
#: process, so a problem is measured once), one undivided plan per op (at batch 1 or 2 a plan
#: has few sizes to try anyway), micro-batches only. fallback=False: a convolution mucudnn
#: cannot run is an error, never PyTorch's convolution in silence.
FAST = dict(cache=False, policy="undivided", split="batch", fallback=False)


class CountConvolutions(TorchFunctionMode):
    """Counts the functional convolutions PyTorch runs while active (nn.Conv*d modules call
    them too); entered on an unconverted model it counts every convolution of a pass."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in CONVOLUTIONS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_mucudnn_runs() -> Iterator[List[int]]:
    """Counts the convolution ops mucudnn's plans run while active (from the public account,
    :func:`mucudnn.torch.account`; a fallback to PyTorch's kernel counts nothing). Yields a
    one-element list, updated when the block ends."""

    def total() -> int:
        return sum(c["mucudnn"] for ops in mt.account().values() for c in ops.values())

    counter = [0]
    start = total()
    try:
        yield counter
    finally:
        counter[0] = total() - start


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for two zero tensors)."""
    scale = expected.detach().abs().max().item()
    diff = (actual.detach().float() - expected.detach().float()).abs().max().item()
    return diff / scale if scale else diff


def gradient_error(
    a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]
) -> float:
    """The largest error over parameters of their gradient in ``a`` against ``b``: max |a - b|
    over max |b| of that parameter, or over 1e-3 of the largest gradient of the model where
    that is larger (a parameter whose gradient cancels to rounding noise, as before a
    BatchNorm over two values, is not a relative comparison of noise)."""
    assert a.keys() == b.keys()
    floor = 1e-3 * max(g.abs().max().item() for g in b.values() if g is not None)
    worst = 0.0
    for name, expected in b.items():
        if expected is None:
            assert a[name] is None, name
            continue
        scale = max(expected.abs().max().item(), floor)
        diff = (a[name].float() - expected.float()).abs().max().item()
        worst = max(worst, diff / scale if scale else diff)
    return worst


def gradients(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One training step's parameter gradients (``loss_of()`` runs the model)."""
    model.zero_grad(set_to_none=True)
    loss_of().backward()
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``count`` for the block (the real clients run at 2,
    as CI's runners have), restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""mucudnn inside PyTorch's dispatcher (the native path, torch >= 2.10): what PyTorch itself
does with convolutions reaches mucudnn's kernels, with PyTorch's numbers, and everything mucudnn
does not run is PyTorch's own kernel, bit for bit.

- activation checkpointing (reentrant and not) around Conv1d/2d/3d: the recomputation runs
  mucudnn's plans too;
- ``torch.func``: ``grad``, ``vmap``, ``jvp``, ``jacfwd``; ``torch.autograd.forward_ad`` dual
  tensors; double backward; ``gradcheck`` in float64 (left to PyTorch, exactly);
- inductor ``torch.compile``;
- four threads calling one model while the switch is on;
- ``FlopCounterMode`` sees the convolutions; negative-bit views are resolved;
- bad arguments raise PyTorch's own errors;
- the switch is process-wide, and ``disable()`` restores PyTorch's kernels.

Counts come from the public account (:func:`mucudnn.torch.account`)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mucudnn.torch as mt

pytestmark = pytest.mark.skipif(mt.PATH != "native", reason="the native path needs torch >= 2.10")

FAST = dict(cache=False, policy="undivided", split="batch", fallback=True)


def totals():
    """(calls mucudnn ran, calls PyTorch ran) over every name and op of the account."""
    ran = fell = 0
    for ops in mt.account().values():
        for count in ops.values():
            ran += count["mucudnn"]
            fell += sum(count["pytorch"].values())
    return ran, fell


def op_totals():
    """Calls mucudnn ran per op, over every name."""
    out = {"fwd": 0, "bwd_data": 0, "bwd_filter": 0}
    for ops in mt.account().values():
        for op, count in ops.items():
            out[op] += count["mucudnn"]
    return out


def close(a, b, tol=1e-5):
    scale = max(b.detach().abs().max().item(), 1e-12)
    return (a.detach() - b.detach()).abs().max().item() / scale <= tol


def blocks(dims: int) -> nn.Module:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    torch.manual_seed(dims)
    return nn.Sequential(conv(3, 4, 3, padding=1), nn.Tanh(), conv(4, 4, 3, padding=1),
                         nn.Tanh(), conv(4, 2, 3, padding=1))


SHAPES = {1: (2, 3, 12), 2: (2, 3, 8, 8), 3: (1, 3, 4, 5, 6)}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_checkpoint_recomputation_runs_mucudnn(dims, reentrant):
    model = blocks(dims)
    x = torch.randn(SHAPES[dims], requires_grad=True)
    model(x).square().sum().backward()
    expected = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    mt.convert_(model, **FAST)
    x2 = x.detach().requires_grad_(True)
    out = checkpoint(model, x2, use_reentrant=reentrant)
    before = op_totals()
    out.square().sum().backward()  # the reentrant form takes no .grad()
    after = op_totals()
    got = [x2.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(got, expected):
        assert close(a, b)
    # The backward recomputed the forward (at least the convolutions whose outputs it needs)
    # through mucudnn, then ran every gradient through mucudnn; nothing fell back.
    assert after["fwd"] - before["fwd"] >= 2
    assert after["bwd_filter"] - before["bwd_filter"] == 3
    assert after["bwd_data"] - before["bwd_data"] == 3
    assert totals()[1] == 0


def reference(fn, *args):
    """``fn(*args)`` with the switch off (PyTorch's kernels)."""
    mt.disable()
    return fn(*args)


def test_func_grad_vmap_jvp_jacfwd_match_pytorch():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3)
    t = torch.randn_like(x)

    def loss(w):
        return F.conv2d(x, w, padding=1).tanh().sum()

    def f(x):
        return F.conv2d(x, w, padding=1)

    cases = {
        "grad": lambda: torch.func.grad(loss)(w),
        "vmap": lambda: torch.func.vmap(f)(x.unsqueeze(1)),
        "jvp": lambda: torch.func.jvp(f, (x,), (t,))[1],
        "jacfwd": lambda: torch.func.jacfwd(lambda v: F.conv2d(v, w).sum((0, 2, 3)))(x[:1]),
    }
    for name, case in cases.items():
        expected = reference(case)
        mt.enable(**FAST)
        mt.reset_account()
        got = case()
        assert close(got, expected), name
        assert expected.abs().max() > 0, name
        ran, fell = totals()
        assert ran > 0 and fell == 0, (name, mt.account())


def test_forward_ad_dual_tensors_keep_their_tangent():
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    x, t = torch.randn(1, 2, 5, 5), torch.randn(1, 2, 5, 5)
    w = torch.randn(3, 2, 3, 3)

    def tangent():
        with fwAD.dual_level():
            y = F.conv2d(fwAD.make_dual(x, t), w)
            return fwAD.unpack_dual(y).tangent

    expected = reference(tangent)
    mt.enable(**FAST)
    got = tangent()
    assert close(got, expected) and got.abs().max() > 0
    assert totals()[0] > 0


def test_double_backward_matches_pytorch():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)

    def second():
        y = F.conv2d(x, w, padding=1)
        (g,) = torch.autograd.grad(y.square().sum(), w, create_graph=True)
        return torch.autograd.grad(g.square().sum(), x)[0]

    expected = reference(second)
    mt.enable(**FAST)
    got = second()
    assert close(got, expected, 1e-4)
    assert totals()[0] > 0


def test_gradcheck_in_float64_falls_back_to_pytorch_exactly():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    mt.enable(**FAST)
    assert torch.autograd.gradcheck(lambda a, b: F.conv2d(a, b, padding=1), (x, w))
    assert torch.autograd.gradgradcheck(lambda a, b: F.conv2d(a, b, padding=1), (x, w))
    y = F.conv2d(x, w)
    mt.disable()
    assert torch.equal(y, F.conv2d(x, w))
    ran, fell = totals()
    assert ran == 0 and fell > 0
    reasons = {r for ops in mt.account().values() for c in ops.values() for r in c["pytorch"]}
    assert any("dtype" in r for r in reasons), reasons


def test_inductor_compile_runs_mucudnn():
    model = blocks(2)
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    mt.enable(**FAST)
    compiled = torch.compile(model)
    got = compiled(x)
    assert close(got, expected)
    assert op_totals()["fwd"] >= 3


def test_four_threads_share_one_switch():
    model = blocks(2)
    torch.manual_seed(1)
    inputs = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    mt.enable(model, **FAST)
    results = [None] * 4
    errors = []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(3):
                    results[i] = model(inputs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in zip(results, expected):
        assert close(got, want)
    assert op_totals()["fwd"] == 4 * 3 * 3
    assert set(mt.account()) == {"0", "2", "4"}


def test_the_switch_is_process_wide():
    torch.manual_seed(0)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    worker = threading.Thread(target=lambda: mt.enable(**FAST))
    worker.start()
    worker.join()
    assert mt.is_enabled()
    F.conv2d(x, w)
    assert totals()[0] == 1
    worker = threading.Thread(target=mt.disable)
    worker.start()
    worker.join()
    assert not mt.is_enabled()
    F.conv2d(x, w)
    assert totals()[0] == 1
    # Non-convolution ops see no mode of mucudnn's.
    mt.enable(**FAST)
    assert torch._C._len_torch_function_stack() == 0


def test_disable_restores_pytorch_bit_for_bit():
    model = blocks(2)
    x = torch.randn(2, 3, 8, 8)
    mt.enable(**FAST)
    model(x)
    mt.disable()
    assert not mt._native.state()["registered"]
    mt.reset_account()
    y = model(x)
    assert torch.equal(y, reference(model, x))
    assert mt.account() == {}


def test_flop_counter_sees_convolutions():
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    with FlopCounterMode(display=False) as counter:
        F.conv2d(x, w)
    expected = counter.get_total_flops()
    mt.enable(**FAST)
    with FlopCounterMode(display=False) as counter:
        F.conv2d(x, w)
    assert counter.get_total_flops() == expected > 0
    assert totals()[0] == 1


def test_negative_views_are_resolved():
    torch.manual_seed(0)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    expected = F.conv2d(-x, w)
    mt.enable(**FAST)
    got = F.conv2d(torch._neg_view(x), w)
    assert close(got, expected)
    # Complex (conjugate views included): PyTorch's kernel resolves the conjugate and runs
    # the product as real convolutions, which mucudnn's plans run (their summation order
    # is the tuned algorithm's, not always PyTorch's: close, not equal).
    xc = torch.randn(1, 2, 5, 5, dtype=torch.complex64)
    wc = torch.randn(3, 2, 3, 3, dtype=torch.complex64)
    mt.reset_account()
    got = F.conv2d(xc.conj(), wc)
    assert totals() == (3, 0), mt.account()
    mt.disable()
    assert close(got.real, F.conv2d(xc.conj(), wc).real)
    assert close(got.imag, F.conv2d(xc.conj(), wc).imag)


BAD_CALLS = {
    "channels": lambda x, w: F.conv2d(x, torch.randn(4, 2, 3, 3)),
    "zero stride": lambda x, w: F.conv2d(x, w, stride=0),
    "negative padding": lambda x, w: F.conv2d(x, w, padding=-1),
    "zero dilation": lambda x, w: F.conv2d(x, w, dilation=0),
    "groups": lambda x, w: F.conv2d(x, w, groups=2),
    "zero groups": lambda x, w: F.conv2d(x, w, groups=0),
    "kernel too large": lambda x, w: F.conv2d(x[:, :, :2, :2], w),
    "bias length": lambda x, w: F.conv2d(x, w, torch.randn(5)),
    "weight rank": lambda x, w: F.conv2d(x, w[0]),
    "stride length": lambda x, w: F.conv2d(x, w, stride=(1, 1, 1)),
    "dtype mix": lambda x, w: F.conv2d(x, w.double()),
    "zero out channels": lambda x, w: F.conv2d(x, torch.randn(0, 3, 3, 3)),
    "transposed channels": lambda x, w: F.conv_transpose2d(x, torch.randn(2, 4, 3, 3)),
    "output_padding": lambda x, w: F.conv_transpose2d(x, w.transpose(0, 1), stride=1, output_padding=2),
    "padding string": lambda x, w: F.conv2d(x, w, stride=2, padding="same"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_pytorchs_own_error(case):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)

    def outcome():
        try:
            y = BAD_CALLS[case](x, w)
            return ("no error", tuple(y.shape))
        except Exception as e:
            return (type(e).__name__, str(e))

    expected = reference(outcome)
    mt.enable(**FAST)
    assert outcome() == expected


def test_pytorchs_switches_are_read_at_each_call(fp32_precision_saved):
    """TF32 (through ``allow_tf32`` and ``conv.fp32_precision``) and determinism (through
    ``cudnn.deterministic`` and ``use_deterministic_algorithms``) are read from PyTorch's own
    context by the Rust kernels; determinism is part of a plan's key, so flipping it plans
    anew and flipping it back reuses the first plans."""
    state = mt._native.state()["switches"]
    assert state == {"allow_tf32": True, "deterministic": False, "resolved": True}
    cudnn = torch.backends.cudnn
    cudnn.allow_tf32 = False
    assert mt._native.state()["switches"]["allow_tf32"] is False
    cudnn.allow_tf32 = True
    assert mt._native.state()["switches"]["allow_tf32"] is True
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        cudnn.conv.fp32_precision = "ieee"
        assert mt._native.state()["switches"]["allow_tf32"] is False
        cudnn.conv.fp32_precision = "tf32"
        assert mt._native.state()["switches"]["allow_tf32"] is True
    with cudnn.flags(enabled=cudnn.enabled, deterministic=True):
        assert mt._native.state()["switches"]["deterministic"] is True
    assert mt._native.state()["switches"]["deterministic"] is False
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    mt.convert_(conv, **FAST)
    x = torch.randn(2, 3, 6, 6)
    expected = F.conv2d(x, conv.weight, conv.bias)
    with mt.enabled():
        torch.testing.assert_close(conv(x), expected)
        before = mt._native.state()["plan_sets"]
        torch.use_deterministic_algorithms(True)
        try:
            assert mt._native.state()["switches"]["deterministic"] is True
            torch.testing.assert_close(conv(x), expected)
            deterministic = mt._native.state()["plan_sets"]
        finally:
            torch.use_deterministic_algorithms(False)
        torch.testing.assert_close(conv(x), expected)
        after = mt._native.state()["plan_sets"]
    assert deterministic == before + 1, "a deterministic key plans anew"
    assert after == deterministic, "the first plans again"


@pytest.fixture
def fp32_precision_saved():
    cudnn = torch.backends.cudnn
    has_precision = hasattr(getattr(cudnn, "conv", None), "fp32_precision")
    saved = (torch.backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision,
             cudnn.rnn.fp32_precision) if has_precision else None
    tf32, deterministic = cudnn.allow_tf32, cudnn.deterministic
    yield
    if saved is not None:
        torch.backends.fp32_precision, cudnn.fp32_precision = saved[:2]
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[2:]
    cudnn.allow_tf32, cudnn.deterministic = tf32, deterministic
    torch.use_deterministic_algorithms(False)

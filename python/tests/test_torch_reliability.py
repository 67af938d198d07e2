"""A converted layer where it used to break (CPU).

Threads sharing one layer: a plan set is released only when no call can still use it.
Adopting new plans for a shape (another thread's first call of it, or a backward that tunes
the ops an inference forward lacked) used to release the set another thread was about to
execute, which raised "plan set N is not prepared (or was released)".

A stride of 2^31 or more, which PyTorch runs and mucudnn's problems cannot hold: with
``fallback=True`` the layer runs PyTorch's convolution, where it raised."""

import pytest

import sys
import threading

import torch
import torch.nn.functional as F

import mucudnn.torch as mt
from converted import NATIVE, by_pytorch, fallbacks, name_of, options_of, python_path_only, ran


def assert_close(ours, theirs):
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * max(scale, 1e-30))


def run_threads(count, work):
    """Runs ``work(i)`` in ``count`` threads started together; returns their exceptions."""
    start = threading.Barrier(count)
    errors = []

    def body(i):
        try:
            start.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001 - every failure is the test's
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_eight_threads_make_the_first_call_of_a_new_shape(tmp_path):
    torch.manual_seed(0)
    layer = mt.Conv2d(2, 3, 3, padding=1, cache=str(tmp_path / "cache.sqlite"),
                      fallback=False, name="threads.first_call")
    layer.requires_grad_(False)
    for trial in range(6):
        x = torch.randn(2, 2, 5 + trial, 6)  # a new shape each trial
        with by_pytorch():
            expected = F.conv2d(x, layer.weight, layer.bias, padding=1)
        results = {}

        def work(i):
            for _ in range(3):
                results[i] = layer(x)

        errors = run_threads(8, work)
        assert not errors, f"trial {trial}: {errors[0]!r}"
        for y in results.values():
            assert_close(y, expected)
    assert ran("threads.first_call") == {"fwd": 6 * 8 * 3} and fallbacks() == {}


def test_inference_threads_while_a_backward_tunes_the_missing_ops(tmp_path):
    # Threads switch often, so that inference calls are on their way while the backward
    # adopts its plans.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _inference_while_backward(tmp_path)
    finally:
        sys.setswitchinterval(previous)


def _inference_while_backward(tmp_path):
    torch.manual_seed(0)
    layer = mt.Conv2d(2, 3, 3, padding=1, cache=str(tmp_path / "cache.sqlite"),
                      fallback=False, name="threads.inference")
    for trial in range(8):
        x = torch.randn(2, 2, 6 + trial, 5)
        with torch.no_grad():
            with by_pytorch():
                expected = F.conv2d(x, layer.weight, layer.bias, padding=1)
            layer(x)  # the forward op alone is tuned for this shape
        stop = threading.Event()

        def work(i):
            if i == 0:
                try:
                    xx = x.clone().requires_grad_()
                    layer(xx).sum().backward()  # tunes bwd_data and bwd_filter, adopts
                finally:
                    stop.set()
            else:
                while not stop.is_set():
                    with torch.no_grad():
                        assert_close(layer(x), expected)

        errors = run_threads(6, work)
        assert not errors, f"trial {trial}: {errors[0]!r}"
        layer.zero_grad()


def test_a_stride_past_2_31_falls_back_to_pytorch(tmp_path, capfd):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4)
    layer = mt.Conv2d(2, 3, 1, stride=2**31, cache=str(tmp_path / "cache.sqlite"),
                      name="limits.stride")
    with torch.no_grad():
        with by_pytorch():
            expected = F.conv2d(x, layer.weight, layer.bias, stride=2**31)
        assert_close(layer(x), expected)
        layer(x)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "limits.stride" in warnings[0], warnings
    assert "2^31 - 1" in warnings[0], warnings
    strict = mt.Conv2d(2, 3, 1, stride=2**31, cache=str(tmp_path / "cache.sqlite"),
                       fallback=False, name="limits.strict")
    with torch.no_grad(), pytest.raises(RuntimeError, match="stride_h = 2147483648"):
        strict(x)


class StdConv(torch.nn.Conv2d):
    """A subclass with behaviour in forward (adopted, not replaced, by convert_)."""

    def forward(self, x):
        return F.conv2d(x, self.weight * 0.5, self.bias, self.stride, self.padding)


@pytest.mark.python_smoke
def test_convert_again_applies_new_options_and_keeps_names():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), StdConv(4, 4, 3))
    mt.convert_(model, workspace_limit="1MiB", cache=False)
    names = [name_of(m) for m in model]
    assert names == ["0", "1"]
    assert all(options_of(m)["settings"]["workspace_limit"] == 1 << 20 for m in model)
    # No options: left as it is (a layer built with its own options keeps them).
    mt.convert_(model)
    assert all(options_of(m)["settings"]["workspace_limit"] == 1 << 20 for m in model)
    mt.convert_(model, workspace_limit=4096, split="batch", cache=False)
    assert [name_of(m) for m in model] == names
    for m in model:
        assert options_of(m)["settings"]["workspace_limit"] == 4096
        assert options_of(m)["settings"]["split"] == "batch"
        if not NATIVE:  # the Python path's layers show their options
            assert "4096 B" in m.extra_repr()
    x = torch.randn(2, 3, 9, 9)
    with by_pytorch():
        reference = F.conv2d(F.conv2d(x, model[0].weight, model[0].bias),
                             model[1].weight * 0.5, model[1].bias)
    assert_close(model(x), reference)
    assert ran("0") == {"fwd": 1} and ran("1") == {"fwd": 1}
    with pytest.raises(TypeError, match="unknown option"):
        mt.convert_(model, no_such_option=1)


@python_path_only  # the Python path's own table of plan sets (the native one: test_torch_bounds)
def test_the_python_paths_plan_sets_are_bounded(monkeypatch):
    """At most the capacity of prepared plan sets over every layer; an evicted shape comes back
    from the cache without measuring, and its output is right."""
    from mucudnn._tuner import Tuner
    from mucudnn.torch import _registry

    measured = []
    real = Tuner.tune

    def tune(self, layer, problem, settings):
        result = real(self, layer, problem, settings)
        measured.append(result["measured"])
        return result

    monkeypatch.setattr(Tuner, "tune", tune)
    torch.manual_seed(0)
    conv = mt.Conv1d(1, 2, 3, cache=False, policy="undivided", split="batch", name="bounded")
    config = conv._mucudnn
    mt.set_plan_capacity(8)
    try:
        with torch.no_grad():
            for length in range(10, 40):
                conv(torch.randn(1, 1, length))
            live = [r for r in config.prepared.values() if r is not None]
            assert len(live) <= 8 and len(_registry._bound) <= 8
            assert sum(measured) > 0
            measured.clear()
            x = torch.randn(1, 1, 10)  # evicted long ago
            assert_close(conv(x), F.conv1d(x, conv.weight, conv.bias))
        assert measured and sum(measured) == 0, measured
        assert len([r for r in config.prepared.values() if r is not None]) <= 8
        with pytest.raises(ValueError):
            mt.set_plan_capacity(0)
    finally:
        mt.set_plan_capacity(1024)

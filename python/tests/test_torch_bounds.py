"""What a long-running process keeps on the native path: at most the plan capacity of prepared
plan sets (evicted problems come back from the cache without measuring), no tuner (nor its
cache file's descriptors) once nothing uses it, nothing of the switch's after ``disable()``;
and allocations that name their device, so a ``meta`` default device changes nothing."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn as nn

import mucudnn.torch as mt
from mucudnn.torch import _native

pytestmark = pytest.mark.skipif(mt.PATH != "native", reason="the native path needs torch >= 2.10")


@pytest.fixture(autouse=True)
def _clean():
    gc.collect()
    mt.disable()
    mt.reset_account()
    yield
    mt.disable()
    mt.set_plan_capacity(1024)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_plan_table_is_bounded_and_evicted_problems_need_no_measuring(capfd):
    conv = mt.convert_(nn.Conv1d(1, 2, 3), cache=False, policy="undivided", split="batch")
    mt.set_plan_capacity(8)
    with torch.no_grad():
        for length in range(10, 40):
            conv(torch.randn(1, 1, length))
    assert _native.state()["plan_sets"] <= 8
    capfd.readouterr()
    with torch.no_grad():
        conv(torch.randn(1, 1, 10))  # evicted long ago: prepared again from the cache
    err = capfd.readouterr().err
    assert "0 measured" in err or err == "", err
    assert _native.state()["plan_sets"] <= 8
    with pytest.raises(ValueError):
        mt.set_plan_capacity(0)


def test_tuners_close_with_the_last_layer_using_them(tmp_path):
    gc.collect()
    before = open_files()
    layers = []
    for i in range(20):
        conv = mt.convert_(nn.Conv2d(2, 2, 1), cache=str(tmp_path / f"c{i}.sqlite"),
                           policy="undivided", split="batch")
        with torch.no_grad():
            conv(torch.randn(1, 2, 3, 3))
        layers.append(conv)
    held = open_files()
    assert held >= before + 20  # each cache file open while its layer lives
    del layers, conv
    gc.collect()
    assert open_files() <= before + 2, (before, held, open_files())


def test_disable_releases_the_switchs_plans():
    mt.enable(cache=False, policy="undivided", split="batch")
    with torch.no_grad():
        for size in range(4, 12):
            nn.functional.conv2d(torch.randn(1, 2, size, size), torch.randn(3, 2, 3, 3))
    assert _native.state()["plan_sets"] >= 8
    mt.disable()
    gc.collect()
    state = _native.state()
    assert state["plan_sets"] == 0 and not state["switch"], state


def test_a_meta_default_device_changes_nothing():
    conv = mt.convert_(nn.Conv2d(2, 3, 3), cache=False, policy="undivided", split="batch")
    x = torch.randn(1, 2, 5, 5)
    # Another tensor than the layer's weight: PyTorch's kernel computes the reference.
    expected = nn.functional.conv2d(x, conv.weight.detach().clone(), conv.bias)
    torch.set_default_device("meta")
    try:
        got = conv(x)
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu"
    assert torch.allclose(got, expected, atol=1e-6)
    assert mt.account()["conv"]["fwd"]["mucudnn"] == 1


def test_option_errors_name_the_call_plainly():
    with pytest.raises(ValueError) as error:
        mt.enable(workspace_limit=-1)
    assert str(error.value).startswith("mucudnn.torch.enable: workspace_limit")
    with pytest.raises(ValueError) as error:
        with mt.enabled(policy="sometimes"):
            pass
    assert str(error.value).startswith("mucudnn.torch.enabled: policy")

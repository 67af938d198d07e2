"""The process switch: ``mucudnn.torch.enable()`` / ``disable()`` / ``enabled()`` run every
functional convolution (``nn.Conv*d`` modules call them) through mucudnn without touching the
model: 1-, 2- and 3-D, transposed, ``"same"`` padding, unbatched, other padding modes, forward
and backward; names from the module path or the problem; no recursion when mucudnn falls back
to PyTorch's convolution; ``torch.compile(fullgraph=True)``, autocast and DDP; after
``disable()`` PyTorch's results bit for bit and no mucudnn call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt
from mucudnn.torch import _runtime
from converted import (
    NATIVE, is_converted, name_of, options_of, plans_of, python_path_only, ran,
)
from real_clients import FAST, count_mucudnn_runs, relative_error


def every_kind():
    """A model of every kind of convolution the switch takes over."""
    torch.manual_seed(0)
    return nn.ModuleDict({
        "c1": nn.Conv1d(3, 4, 3, padding=1),
        "c2": nn.Conv2d(3, 4, 3, stride=2, padding=1, groups=1),
        "c2same": nn.Conv2d(3, 4, 4, padding="same", bias=False),
        "c2reflect": nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
        "c3": nn.Conv3d(3, 4, 3, padding=1),
        "t1": nn.ConvTranspose1d(3, 4, 4, stride=2, padding=1),
        "t2": nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1, groups=1),
        "t3": nn.ConvTranspose3d(3, 2, 2, stride=2),
    })


INPUTS = {"c1": (2, 3, 9), "c2": (2, 3, 7, 7), "c2same": (2, 3, 6, 6), "c2reflect": (3, 6, 6),
          "c3": (1, 3, 3, 4, 4), "t1": (2, 3, 5), "t2": (2, 3, 4, 4), "t3": (1, 3, 2, 2, 2)}


def run_all(model, inputs):
    """Outputs, input gradients and parameter gradients of every module."""
    results = {}
    for name, module in model.items():
        x = inputs[name].clone().requires_grad_(True)
        y = module(x)
        module.zero_grad(set_to_none=True)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results[name] = [y.detach(), x.grad] + [p.grad for p in module.parameters()]
    return results


@pytest.mark.python_smoke
def test_every_kind_forward_and_backward_runs_mucudnn_and_matches():
    model = every_kind()
    torch.manual_seed(1)
    inputs = {name: torch.randn(shape) for name, shape in INPUTS.items()}
    expected = run_all(model, inputs)
    with count_mucudnn_runs() as runs, mt.enabled(model, **FAST) as mode:
        got = run_all(model, inputs)
    # The switch counts functional convolutions on the Python path, the ops it ran (forward
    # and backward) on the native one.
    assert mode.calls == (runs[0] if NATIVE else len(INPUTS))
    # A forward, a data and a filter gradient per convolution, named by the module path.
    assert runs[0] == 3 * len(INPUTS)
    for name in INPUTS:
        for a, b in zip(got[name], expected[name]):
            assert relative_error(a, b) <= 1e-5, name
        assert ran(name) == {"fwd": 1, "bwd_data": 1, "bwd_filter": 1}, name


@pytest.mark.python_smoke
def test_names_come_from_the_problem_without_a_model():
    torch.manual_seed(0)
    x, w = torch.randn(1, 3, 5, 5), torch.randn(4, 3, 3, 3)
    with mt.enabled(**FAST) as mode:
        y = F.conv2d(x, w, padding=1)
    torch.testing.assert_close(y, F.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)
    assert mode.calls == 1
    assert ran("conv2d_4x3x3x3_s1x1_p1x1_d1x1") == {"fwd": 1}
    if not NATIVE:
        assert "conv2d_4x3x3x3_s1x1_p1x1_d1x1" in mode.texts


def test_disable_restores_pytorch_exactly():
    model = every_kind()
    torch.manual_seed(1)
    inputs = {name: torch.randn(shape) for name, shape in INPUTS.items()}
    before = run_all(model, inputs)
    mt.enable(**FAST)
    assert mt.is_enabled()
    with count_mucudnn_runs() as runs:
        run_all(model, inputs)
    assert runs[0] > 0
    mt.disable()
    assert not mt.is_enabled()
    with count_mucudnn_runs() as runs:
        after = run_all(model, inputs)
    assert runs[0] == 0
    for name in INPUTS:
        for a, b in zip(after[name], before[name]):
            assert torch.equal(a, b), name  # bit for bit
    mt.disable()  # a second disable is a no-op


def test_enable_twice_replaces_the_options():
    x, w = torch.randn(1, 2, 6, 6), torch.randn(2, 2, 3, 3)
    mt.enable(**FAST)
    mt.enable(**dict(FAST, split="spatial"))
    with count_mucudnn_runs() as runs:
        F.conv2d(x, w)
    assert runs[0] == 1
    if NATIVE:
        # The second options ran it: its plan splits rows (a batch of 1 at split="batch" has
        # nothing to split).
        (report,) = mt._native.reports(mt._modules._switch.options, None)
        assert report["name"].startswith("conv2d_2x2")
        assert report["plans"][0]["split"] == "spatial", report["plans"]
    else:
        assert any(c.settings.split == "spatial" for c in _runtime._configs.values() if c.name.startswith("conv2d_2x2"))
    mt.disable()
    with count_mucudnn_runs() as runs:
        F.conv2d(x, w)
    assert runs[0] == 0


@python_path_only  # its function mode's handler
def test_a_fallback_to_pytorch_does_not_recurse(monkeypatch):
    """With no plan, the op runs PyTorch's F.conv2d inside the mode's handler, where the mode is
    popped: it reaches PyTorch once, not the mode again."""
    def no_plan(config, key, ops=_runtime.ALL_OPS):
        _runtime.fall_back(config, key, "scripted: no plan", 0.0)
        return None

    monkeypatch.setattr(_runtime, "plans_for", no_plan)
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    with mt.enabled(cache=False) as mode:
        y = F.conv2d(x, w)
    assert mode.calls == 1
    torch.testing.assert_close(y, F.conv2d(x, w))


def test_what_mucudnn_does_not_run_is_pytorchs():
    x64, w64 = torch.randn(1, 2, 5, 5, dtype=torch.float64), torch.randn(2, 2, 3, 3, dtype=torch.float64)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3)
    with count_mucudnn_runs() as runs, mt.enabled(**FAST):
        assert torch.equal(F.conv2d(x64, w64), torch.ops.aten.convolution(
            x64, w64, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
        with pytest.raises(RuntimeError):  # PyTorch's own error for channels that do not fit
            F.conv2d(x, torch.randn(2, 3, 3, 3))
        with pytest.raises(RuntimeError):  # and for "same" with a stride
            F.conv2d(x, w, stride=2, padding="same")
    assert runs[0] == 0


def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with mt.enabled(**FAST):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        compiled(x)  # traced with the mode active
        with count_mucudnn_runs() as runs:
            y = compiled(x)
            y.sum().backward()
    # Two forwards, two filter gradients, the second layer's data gradient (x needs none):
    # the compiled graph runs mucudnn's ops.
    assert runs[0] == 2 + 2 + 1
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_autocast_bf16():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3, padding=1)
    x = torch.randn(2, 4, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = conv(x)
        with count_mucudnn_runs() as runs, mt.enabled(**FAST):
            y = conv(x)
    assert runs[0] == 1 and y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32


@pytest.mark.python_smoke
def test_adopted_module_under_enable_uses_its_own_name_and_settings():
    class Scaled(nn.Conv2d):
        def forward(self, x, scale=1.0):
            return F.conv2d(x, self.weight * scale, self.bias, self.stride, self.padding)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(2, 2, 3, padding=1))
    x = torch.randn(1, 2, 5, 5)
    expected = model[0](x, scale=0.5)
    mt.convert_(model, **dict(FAST, split="spatial"))
    with mt.enabled(**FAST) as mode:
        y = model[0](x, scale=0.5)
    # The layer took it, not the switch: the switch counts (on the native path) what ran
    # under any name, the layer's included.
    assert mode.calls == (1 if NATIVE else 0)
    assert ran("0") == {"fwd": 1} and set(mt.account()) == {"0"}
    assert name_of(model[0]) == "0" and len(plans_of(model[0])) == 1
    assert options_of(model[0])["settings"]["split"] == "spatial"
    (report,) = plans_of(model[0]).values()
    assert "fwd" in report.tuned_ops and report.spatial_ops == report.tuned_ops  # forced
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    import mucudnn.torch as mt
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mt.enable(cache=False, policy="undivided", split="batch", fallback=False)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    mt.disable()
    runs = sum(c["mucudnn"] for ops in mt.account().values() for c in ops.values())
    checksum = sum(p.double().sum().item() for p in model.parameters())
    json.dump({"runs": runs, "checksum": checksum}, open(sys.argv[1] + f"/rank{rank}.json", "w"))
    dist.destroy_process_group()
""")


def test_ddp_gloo_two_ranks(tmp_path):
    script = tmp_path / "ddp_enable.py"
    script.write_text(DDP_SCRIPT)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(30500 + os.getpid() % 1000), str(script), str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MUCUDNN_QUIET="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP's all-reduce kept them equal
    # 3 steps x 2 layers x (forward, data gradient of the second, filter gradients of both)
    assert all(r["runs"] == 3 * (2 + 1 + 2) for r in ranks), ranks


def test_an_adopted_module_compiles_fullgraph():
    """A conv subclass whose forward computes its weight (weight standardisation, as timm's
    StdConv2d) adopted by convert_: torch.compile traces its forward's mode, and the compiled
    call runs mucudnn's plan."""
    class Standardised(nn.Conv2d):
        def forward(self, x):
            w = self.weight
            w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    torch.manual_seed(0)
    model = nn.Sequential(Standardised(3, 4, 3, padding=1), nn.ReLU())
    x = torch.randn(1, 3, 6, 6)
    expected = model(x)
    mt.convert_(model, **FAST)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x)
    with count_mucudnn_runs() as runs:
        y = compiled(x)
    assert runs[0] == 1
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_a_module_convert_cannot_adopt_is_left_with_one_warning(capsys):
    """A lazy conv (a subclass of nn.Conv2d, uninitialized) cannot be adopted: convert_ leaves
    it as it is, says so once naming it, and the model computes exactly what it did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU())
    lazy = model[0]
    mt.convert_(model, skip_unsupported=True, **FAST)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "0 (LazyConv2d): left" in err and "lazy" in err
    assert model[0] is lazy and not is_converted(lazy)
    x = torch.randn(1, 2, 5, 5)
    reference = nn.Conv2d(2, 4, 3)
    y = model(x)  # materializes as PyTorch's nn.Conv2d
    reference.load_state_dict(model[0].state_dict())
    assert torch.equal(y, torch.relu(reference(x)))

"""Whole models: a converted copy computes what the original does (outputs and parameter
gradients), keeps its state_dict keys and optimizer, compiles with
``torch.compile(fullgraph=True)``, and bad input is a Python exception naming the layer."""

import contextlib
import copy
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt
from converted import (
    NATIVE, by_pytorch, converted_layers, fallbacks, is_converted, name_of, plans_of,
    python_path_only, ran,
)

REPO = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("torch_ddp", REPO / "examples" / "torch_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = load_example()


def net(seed=0):
    torch.manual_seed(seed)
    return EXAMPLE.Net(width=8)


def converted_pair(channels_last=False):
    original = net()
    ours = mt.convert_(copy.deepcopy(original), cache=False)
    x = torch.randn(4, 3, 12, 12)
    if channels_last:
        original = original.to(memory_format=torch.channels_last)
        ours = ours.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return original, ours, x


def computing(model, original):
    """Where ``model``'s steps run: PyTorch's kernels for the original (see by_pytorch)."""
    return by_pytorch() if model is original else contextlib.nullcontext()


def test_convert_converts_every_conv_and_keeps_the_state_dict():
    original = net()
    keys = list(original.state_dict())
    weight = original.stem.weight
    converted = mt.convert_(original, cache=False)
    assert converted is original
    convs = [m for m in converted.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(is_converted(m) for m in convs)
    assert converted_layers(converted) == convs
    assert converted.stem.weight is weight  # parameters are shared, not copied
    assert list(converted.state_dict()) == keys
    assert name_of(converted.block2.conv1) == "block2.conv1"
    converted.load_state_dict(net(seed=1).state_dict())


@pytest.mark.python_smoke
@pytest.mark.parametrize("channels_last", [False, True])
def test_converted_model_matches_the_original(channels_last):
    original, ours, x = converted_pair(channels_last)
    outputs, grads = [], []
    for model in (original, ours):
        model.train()
        with computing(model, original):
            y = model(x)
            loss = y.pow(2).sum()
            model.zero_grad()
            loss.backward()
        outputs.append(y.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    scale = outputs[0].abs().max().item()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-4 * scale)
    for name, expected in grads[0].items():
        torch.testing.assert_close(
            grads[1][name], expected, rtol=0, atol=1e-4 * expected.abs().max().item(),
            msg=lambda m: f"{name}: {m}",
        )
    # mucudnn's plans ran every convolution, forward and backward (the stem's input needs no
    # gradient: no bwd_data there), in the input's layout.
    for layer in converted_layers(ours):
        expected_ops = {"fwd": 1, "bwd_filter": 1}
        if name_of(layer) != "stem":
            expected_ops["bwd_data"] = 1
        assert ran(name_of(layer)) == expected_ops, name_of(layer)
        (report,) = plans_of(layer).values()
        assert report.layout == ("nhwc" if channels_last else "nchw")
    assert fallbacks() == {}


def test_a_training_step_matches_the_original():
    original, ours, x = converted_pair()
    target = torch.randint(0, 10, (x.shape[0],))
    for model in (original, ours):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            with computing(model, original):
                F.cross_entropy(model(x), target).backward()
            optimizer.step()
    for (name, a), (_, b) in zip(original.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_torch_compile_fullgraph():
    original, ours, x = converted_pair()
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    with by_pytorch():
        expected = original(x)
    torch.testing.assert_close(y.detach(), expected.detach(), rtol=0, atol=1e-4 * expected.abs().max().item())
    assert ours.stem.weight.grad is not None
    # The compiled graph ran mucudnn's plans.
    assert all(ran(name_of(layer))["fwd"] == 1 for layer in converted_layers(ours))


@pytest.mark.python_smoke
def test_plans_report_each_op():
    _, ours, x = converted_pair()
    ours(x)
    plans = plans_of(ours.stem)
    assert list(plans) == [(4, 3, 12, 12)]
    report = plans[(4, 3, 12, 12)]
    assert set(report.ops) == {"fwd", "bwd_data", "bwd_filter"}
    for info in report.ops.values():
        assert info["time_ms"] > 0 and info["workspace_bytes"] >= 0
        # COUNTxSIZE@ALGO runs, the CPU's algorithms by name.
        runs = info["split"].split("+")
        assert all(run.split("@")[1] in ("direct", "im2col-batched", "im2col-per-image") for run in runs), info
    assert "fwd" in str(report)


def test_workspace_limit_zero_uses_only_algorithms_without_workspace():
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, workspace_limit=0, name="tight")
    conv(torch.randn(4, 3, 8, 8))
    for info in next(iter(conv.plans.values())).ops.values():
        assert info["workspace_bytes"] == 0


@python_path_only
def test_bad_input_names_the_layer():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.conv9")
    with pytest.raises(ValueError, match="net.conv9.*3-D .* or 4-D"):
        conv(torch.randn(3, 4))
    with pytest.raises(ValueError, match="net.conv9: input has 5 channels"):
        conv(torch.randn(1, 5, 8, 8))
    with pytest.raises(RuntimeError, match="net.conv9: the input is torch.float64 but the weight"):
        conv(torch.randn(1, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="net.conv9: the input is on meta but the weight"):
        conv(torch.randn(1, 3, 8, 8, device="meta"))
    with pytest.raises(ValueError, match="net.conv9: padding_mode='reflect' is not supported"):
        mt.Conv2d(3, 4, 3, padding_mode="reflect", name="net.conv9")
    with pytest.raises(ValueError, match="net.conv9: .*64MB"):
        mt.Conv2d(3, 4, 3, workspace_limit="64MB", name="net.conv9")
    with pytest.raises(ValueError, match="net.conv9: input .* is too small for kernel"):
        conv(torch.randn(1, 3, 2, 2))
    assert conv(torch.randn(3, 8, 8)).shape == (4, 6, 6)  # unbatched input, as nn.Conv2d


@pytest.mark.skipif(not NATIVE, reason="the Python path names the layer (test above)")
def test_bad_input_raises_what_nn_conv2d_raises():
    """The native path leaves what mucudnn does not run to PyTorch's own kernel: its errors,
    word for word (a bad option is still mucudnn's, naming the layer)."""
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.conv9")
    reference = nn.Conv2d(3, 4, 3)
    reference.load_state_dict(conv.state_dict())

    def outcome(module, x):
        try:
            return tuple(module(x).shape)
        except Exception as e:
            return type(e).__name__, str(e)

    for x in (torch.randn(3, 4), torch.randn(1, 5, 8, 8), torch.randn(1, 3, 2, 2),
              torch.randn(1, 3, 8, 8, dtype=torch.float64), torch.randn(1, 3, 8, 8, device="meta")):
        assert outcome(conv, x) == outcome(reference, x), tuple(x.shape)
    with pytest.raises(ValueError, match="net.conv9: .*64MB"):
        mt.Conv2d(3, 4, 3, workspace_limit="64MB", name="net.conv9")
    assert conv(torch.randn(3, 8, 8)).shape == (4, 6, 6)  # unbatched input, as nn.Conv2d
    assert ran("net.conv9") == {"fwd": 1}


@python_path_only
def test_convert_refuses_or_skips_other_padding_modes():
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), nn.Conv2d(3, 3, 1))
    with pytest.raises(ValueError, match="0: padding_mode='reflect'.*skip_unsupported"):
        mt.convert_(copy.deepcopy(model), cache=False)
    converted = mt.convert_(model, cache=False, skip_unsupported=True)
    assert not isinstance(converted[0], mt.Conv2d) and isinstance(converted[1], mt.Conv2d)


def test_a_second_process_with_everything_cached_measures_nothing(tmp_path):
    cache = tmp_path / "shared.sqlite"
    script = textwrap.dedent(
        f"""
        import json, sys, time, torch
        sys.path.insert(0, {str(REPO / 'examples')!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch_ddp, mucudnn.torch as mt
        from converted import converted_layers, plans_of
        torch.manual_seed(0)
        model = mt.convert_(torch_ddp.Net(width=8), cache={str(cache)!r})
        x = torch.randn(8, 3, 16, 16)
        started = time.perf_counter()
        model(x).sum().backward()
        seconds = time.perf_counter() - started
        reports = [r for m in converted_layers(model) for r in plans_of(m).values()]
        print(json.dumps({{"measured": sum(r.measured for r in reports),
                           "tuning": sum(r.tuning_seconds for r in reports),
                           "first_step": seconds, "layers": len(reports)}}))
        """
    )
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        runs.append(__import__("json").loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["layers"] == second["layers"] == 8
    assert first["measured"] > 0
    assert second["measured"] == 0, second
    assert second["tuning"] < 1.0, second


# The tuner's failures are scripted by patching the Python tuner, which the native path's
# kernels do not call (they tune in the library).
@python_path_only
def test_a_shape_without_a_plan_falls_back_to_pytorch_or_raises(monkeypatch, capsys):
    from mucudnn import MucudnnError, Tuner

    def no_plan(self, layer, problem, settings):
        raise MucudnnError(f"{layer}: no plan fits 0 B (the smallest limit that works: 4 KiB)",
                           "SOLVER_ERROR")

    monkeypatch.setattr(Tuner, "tune", no_plan)
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, name="net.tight")
    reference = nn.Conv2d(3, 4, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    y = conv(x)
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    expected = reference(xr)
    expected.sum().backward()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad)
    report = conv.plans[(2, 3, 6, 6)]
    assert "smallest limit" in report.fallback
    assert "net.tight" in capsys.readouterr().err
    strict = mt.Conv2d(3, 4, 3, cache=False, name="net.strict", fallback=False)
    with pytest.raises(RuntimeError, match="net.strict: tuning input shape"):
        strict(torch.randn(2, 3, 6, 6))
    # tune() follows the same rule.
    model = mt.convert_(nn.Sequential(nn.Conv2d(3, 4, 3)), cache=False)
    summary = mt.tune(model, torch.randn(2, 3, 6, 6), verbose=False)
    assert summary.layers == summary["layers"] == 1 and model[0].plans[(2, 3, 6, 6)].fallback
    assert summary.fallbacks == 1


@python_path_only
def test_a_plan_cudnn_declines_to_prepare_falls_back_to_pytorch(monkeypatch, capsys):
    # PLAN_NOT_SUPPORTED: cuDNN refuses a tuned micro-batch at its real
    # offset. The layer, the forward's lazy tuning and tune() all fall back with a warning.
    from mucudnn import MucudnnError, Tuner

    def declines(self, plans):
        raise MucudnnError("net.offset forward: micro-batch 2 at sample 5: not supported",
                           "PLAN_NOT_SUPPORTED")

    monkeypatch.setattr(Tuner, "prepare", declines)
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, name="net.offset")
    reference = nn.Conv2d(3, 4, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(conv(x), reference(x))
    assert "cannot be prepared" in conv.plans[(2, 3, 6, 6)].fallback
    assert "net.offset" in capsys.readouterr().err
    model = mt.convert_(nn.Sequential(nn.Conv2d(3, 4, 3)), cache=False)
    mt.tune(model, torch.randn(2, 3, 6, 6), verbose=False)
    assert "cannot be prepared" in model[0].plans[(2, 3, 6, 6)].fallback
    strict = mt.Conv2d(3, 4, 3, cache=False, name="net.strict2", fallback=False)
    with pytest.raises(MucudnnError, match="not supported"):
        strict(torch.randn(2, 3, 6, 6))


def test_engines_on_the_cpu_is_an_error_not_a_fallback():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.eng", candidates="engines")
    with pytest.raises(RuntimeError, match="net.eng: tuning input shape .*engine"):
        conv(torch.randn(2, 3, 6, 6))

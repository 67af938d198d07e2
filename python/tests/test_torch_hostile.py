"""A converted layer treated as training code treats models (the scenarios a hostile user
runs): surgery after tuning, raw ops with operands that do not agree, graphs and models saved in
one process and loaded in a fresh one that converted other layers first, deepcopy, pickle,
torch.save. Each scenario (``torch_scenarios.py``) runs in its own process: it must give the
right answer or a clear exception, and no signal (a crash, a heap abort) may end any of them.
Also, in this process: float64, zero input channels, a module registered under two names, and
PyTorch's TF32 and determinism switches in the plan's key and settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn
import mucudnn.torch as mt
from converted import (
    NATIVE, PYTHON_PATH_MARKS, by_pytorch, fallbacks, is_converted, name_of, plans_of,
    python_path_only,
)
from mucudnn import Tuner
from mucudnn.torch import _keys as mt_keys

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch_scenarios  # noqa: E402

#: Surgery the native path does not follow: it identifies a layer's calls by its weight and
#: geometry as converted, so after a new weight parameter or another stride, kernel, dilation
#: or groups the calls run PyTorch's kernels (right numbers, no mucudnn) until the model is
#: converted again (surgery_then_convert_again). Padding is read per call: followed.
NATIVE_MISSES_SURGERY = {
    "surgery_dilation", "surgery_groups", "surgery_in_channels", "surgery_kernel",
    "surgery_out_channels_grow", "surgery_out_channels_shrink", "surgery_stride",
}


def single(name):
    if name in torch_scenarios.PYTHON_PATH_ONLY:
        return pytest.param(name, marks=PYTHON_PATH_MARKS)
    if not NATIVE and name in torch_scenarios.NATIVE_ONLY:
        return pytest.param(name, marks=pytest.mark.skip(reason="what the native path does"))
    if NATIVE and name in NATIVE_MISSES_SURGERY:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=(
            "native path: after surgery the layer's calls run PyTorch's kernels, not "
            "mucudnn's, until convert_ is called again")))
    return name


SINGLE = [
    single(name)
    for name, fn in sorted(torch_scenarios.SCENARIOS.items()) if fn.__code__.co_argcount == 0
]
IN_ONE_DIRECTORY = ["deepcopy_after_use", "pickle_after_use"]
SAVED_AND_LOADED = ["traced", "exported", "torch_save"]


def run_scenario(name, *args):
    # The child imports the mucudnn this process imported (installed, or a source tree).
    package_root = str(Path(mucudnn.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root] + sys.path))
    done = subprocess.run(
        [sys.executable, str(HERE / "torch_scenarios.py"), name, *map(str, args)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    # A negative return code is a signal: SIGSEGV, SIGABRT from a corrupted heap, ...
    assert done.returncode >= 0, f"{name} was killed by signal {-done.returncode}:\n{done.stderr}"
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert f"scenario {name}: ok" in done.stdout
    return done


@pytest.mark.parametrize("name", SINGLE)
def test_scenario_in_a_subprocess(name):
    run_scenario(name)


@pytest.mark.parametrize("name", IN_ONE_DIRECTORY)
def test_copy_scenario_in_a_subprocess(name, tmp_path):
    run_scenario(name, tmp_path)


@pytest.mark.parametrize("kind", SAVED_AND_LOADED)
def test_saved_in_one_process_runs_in_a_fresh_one(kind, tmp_path):
    run_scenario(f"{kind}_save", tmp_path)
    run_scenario(f"{kind}_load", tmp_path)


@pytest.mark.python_smoke
def test_the_layer_state_is_its_conv_state_plus_one_plain_value():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="state")
    conv(torch.randn(1, 3, 5, 5))
    mucudnn_state = {k: v for k, v in vars(conv).items() if "mucudnn" in k}
    if NATIVE:
        # One attribute, pickled as plain values (its name, options and signature).
        assert list(mucudnn_state) == ["_mucudnn"]
        constructor, values = conv._mucudnn.__reduce__()
        assert values[0] == "state" and json.loads(values[1])["cache"] is False
        assert json.loads(json.dumps(values)) == list(values)
    else:
        assert list(mucudnn_state) == ["_mucudnn_config"]
        assert json.loads(conv._mucudnn_config)["name"] == "state"


@pytest.mark.python_smoke
def test_float64_runs_pytorch_convolution_with_one_warning(capfd):
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, name="net.double").double()
    reference = nn.Conv2d(3, 4, 3, padding=1).double()
    reference.load_state_dict(conv.state_dict())
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        y = conv(x)
        y.sum().backward()
        with by_pytorch():
            expected = reference(xr)
            expected.sum().backward()
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(x.grad, xr.grad)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert "net.double" in warnings[0] and "PyTorch's convolution" in warnings[0], warnings
    assert not conv.plans, "no plan was tuned"


def test_zero_input_channels_behave_like_nn_conv2d():
    torch.manual_seed(0)
    conv = mt.Conv2d(0, 16, 3, cache=False, name="empty")
    reference = nn.Conv2d(0, 16, 3)
    reference.load_state_dict(conv.state_dict())
    for shape in ((2, 0, 5, 5), (0, 5, 5)):
        x = torch.randn(shape)
        with by_pytorch():
            expected = reference(x)
        torch.testing.assert_close(conv(x), expected)


@python_path_only
def test_the_op_computes_an_empty_sum():
    torch.manual_seed(0)
    conv = mt.Conv2d(0, 16, 3, cache=False, name="empty")
    # The op itself computes the empty sum: the bias alone.
    x = torch.randn(2, 0, 5, 5)
    y = torch.ops.mucudnn.conv2d(
        x, conv.weight, conv.bias, [1, 1], [0, 0], [1, 1], 1, conv._mucudnn_config
    )
    torch.testing.assert_close(y, conv.bias.view(1, -1, 1, 1).expand(2, 16, 3, 3))


def test_a_module_registered_under_two_names_is_converted_everywhere():
    shared = nn.Conv2d(3, 3, 3, padding=1)
    model = nn.Sequential()
    model.add_module("first", shared)
    model.add_module("again", shared)
    inner = nn.Sequential(shared)
    model.add_module("inner", inner)
    mt.convert_(model, cache=False)
    assert is_converted(model.first) and name_of(model.first) == "first"
    assert model.again is model.first and model.inner[0] is model.first
    assert model.first.weight is shared.weight


def recorded_tunes(monkeypatch):
    calls = []
    real = Tuner.tune

    def tune(self, layer, problem, settings):
        calls.append((problem, settings))
        return real(self, layer, problem, settings)

    monkeypatch.setattr(Tuner, "tune", tune)
    return calls


@python_path_only  # the tunes are recorded from the Python tuner
def test_tf32_and_determinism_switches_are_part_of_the_plan(monkeypatch):
    calls = recorded_tunes(monkeypatch)
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="flags")
    x = torch.randn(2, 3, 6, 6)
    expected = F.conv2d(x, conv.weight, conv.bias)
    tf32 = torch.backends.cudnn.allow_tf32
    try:
        torch.testing.assert_close(conv(x), expected)
        torch.backends.cudnn.allow_tf32 = False
        torch.testing.assert_close(conv(x), expected)
        torch.backends.cudnn.allow_tf32 = True
        with torch.backends.cudnn.flags(deterministic=True):
            torch.testing.assert_close(conv(x), expected)
        torch.use_deterministic_algorithms(True)
        torch.testing.assert_close(conv(x), expected)  # the same key as cudnn.deterministic
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(conv(x), expected)  # the first plans again, not re-tuned
    assert [(p["math"], s.deterministic) for p, s in calls] == [
        ("default", False), ("fma", False), ("default", True)
    ]
    assert '"deterministic": true' in calls[2][1].to_json()
    reports = conv._mucudnn.reports.values()
    assert sorted((r.math, r.deterministic) for r in reports) == [
        ("default", False), ("default", True), ("fma", False)
    ]


@pytest.fixture
def fp32_precision_restored():
    """PyTorch's TF32 settings as they were, after a test that sets them through the
    ``fp32_precision`` API (each setter also sets the settings below it)."""
    cudnn = torch.backends.cudnn
    if not hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    saved = (torch.backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision,
             cudnn.rnn.fp32_precision, cudnn.allow_tf32)
    yield
    torch.backends.fp32_precision, cudnn.fp32_precision = saved[:2]
    cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[2:4]
    cudnn.allow_tf32 = saved[4]
    assert cudnn.allow_tf32 == saved[4]  # readable again: the settings agree


@python_path_only  # the tunes are recorded from the Python tuner
def test_tf32_switch_set_through_fp32_precision(monkeypatch, fp32_precision_restored):
    """A precision set through PyTorch's newer API makes the legacy ``allow_tf32`` getter
    raise; the key reads the new API instead, with its inheritance ("none")."""
    calls = recorded_tunes(monkeypatch)
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="flags.precision")
    x = torch.randn(2, 3, 6, 6)
    expected = F.conv2d(x, conv.weight, conv.bias)
    cudnn = torch.backends.cudnn
    cudnn.conv.fp32_precision = "ieee"
    with pytest.raises(RuntimeError, match="TF32"):
        cudnn.allow_tf32  # noqa: B018 (the getter this test is about)
    torch.testing.assert_close(conv(x), expected)
    cudnn.conv.fp32_precision = "tf32"
    torch.testing.assert_close(conv(x), expected)
    # "none" inherits: from cuDNN's setting for all its ops, then from the generic one.
    cudnn.fp32_precision = "ieee"
    cudnn.conv.fp32_precision = "none"
    torch.testing.assert_close(conv(x), expected)  # the first key again: not re-tuned
    torch.backends.fp32_precision = "tf32"  # (sets every setting below it too)
    cudnn.fp32_precision = "none"
    cudnn.conv.fp32_precision = "none"
    torch.testing.assert_close(conv(x), expected)  # the second key again
    assert [p["math"] for p, _ in calls] == ["fma", "default"]
    assert mt_keys.conv_allows_tf32()
    torch.backends.fp32_precision = "none"
    cudnn.fp32_precision = "none"
    cudnn.conv.fp32_precision = "none"
    assert not mt_keys.conv_allows_tf32()  # none set anywhere: IEEE


@pytest.mark.skipif(not NATIVE, reason="the Python path's test is the one above")
def test_determinism_switches_are_part_of_the_plan():
    """PyTorch's determinism switches make another problem (deterministic candidates only),
    tuned once; TF32 is a GPU switch: on the CPU the fp32 plans stay."""
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="flags")
    x = torch.randn(2, 3, 6, 6)
    with by_pytorch():
        expected = F.conv2d(x, conv.weight, conv.bias)

    def report():
        torch.testing.assert_close(conv(x), expected)
        return plans_of(conv)[(2, 3, 6, 6)]

    tf32 = torch.backends.cudnn.allow_tf32
    try:
        first = report()
        assert (first.math, first.deterministic) == ("default", False) and first.measured > 0
        torch.backends.cudnn.allow_tf32 = False
        assert report() == first
        torch.backends.cudnn.allow_tf32 = True
        with torch.backends.cudnn.flags(deterministic=True):
            deterministic = report()
        assert deterministic.deterministic and deterministic.math == "default"
        torch.use_deterministic_algorithms(True)
        assert report() == deterministic  # the same key as cudnn.deterministic
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(False)
    assert report() == first  # the first plans again, not tuned again
    assert fallbacks() == {}


def test_half_precision_ignores_the_tf32_switch():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="flags.half", dtype=torch.bfloat16)
    tf32 = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        conv(torch.randn(1, 3, 5, 5, dtype=torch.bfloat16))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    (report,) = plans_of(conv).values()
    assert report.dtype == "bf16" and report.math == "default"

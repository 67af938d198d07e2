"""Hostile-user scenarios for the PyTorch package, each
run in its own process by ``test_torch_hostile.py`` so that a crash (a signal) is seen as one.

``python torch_scenarios.py NAME [DIR]`` runs one scenario. It exits 0 when mucudnn gave the
right answer (checked against PyTorch's own convolution) or raised the clear exception the
scenario expects, and prints ``scenario NAME: ok``; anything else is an assertion error (exit 1).
Scenarios that need a second, fresh process (a graph or a model saved by one process and loaded
by another) take a directory: ``NAME-save`` writes there, ``NAME-load`` reads.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt
from converted import NATIVE, by_pytorch, mucudnn_runs, name_of, plans_of, ran

SCENARIOS = {}
#: Scenarios of the Python path's design alone (its custom ops' checks, its errors naming the
#: layer where the native path raises PyTorch's own): the tests skip them on the native path.
PYTHON_PATH_ONLY = set()


def python_path_scenario(fn):
    PYTHON_PATH_ONLY.add(fn.__name__)
    return scenario(fn)


#: Scenarios of what the native path alone does: the tests skip them on the Python path.
NATIVE_ONLY = set()


def native_scenario(fn):
    NATIVE_ONLY.add(fn.__name__)
    return scenario(fn)


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def close(ours, theirs, what="output"):
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
    scale = max(theirs.abs().max().item(), 1e-3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * scale, msg=what)


def raises(kind, match, fn):
    try:
        fn()
    except kind as e:
        assert match in str(e), f"expected {match!r} in: {e}"
        return e
    raise AssertionError(f"expected {kind.__name__} with {match!r}, nothing raised")


def check_against_pytorch(conv, x):
    """Forward and backward of a mucudnn Conv2d against F.conv2d with the layer's current
    attributes (what nn.Conv2d computes with them), and mucudnn's plans ran all three."""
    before = ran(name_of(conv))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    w = conv.weight.detach().clone().requires_grad_()
    b = None if conv.bias is None else conv.bias.detach().clone().requires_grad_()
    ours = conv(xs[0])
    grad = torch.randn_like(ours)
    conv.zero_grad()
    ours.backward(grad)
    with by_pytorch():
        theirs = F.conv2d(xs[1], w, b, conv.stride, conv.padding, conv.dilation, conv.groups)
        theirs.backward(grad)
    close(ours, theirs)
    close(xs[0].grad, xs[1].grad, "input gradient")
    close(conv.weight.grad, w.grad, "weight gradient")
    after = ran(name_of(conv))
    for op in ("fwd", "bwd_data", "bwd_filter"):
        assert after.get(op, 0) == before.get(op, 0) + 1, (
            f"{name_of(conv)}: mucudnn did not run its {op} ({before} -> {after})"
        )


def raises_as_nn_conv2d(conv, x, match):
    """What a bad call of the layer raises: the Python path's own error naming the layer
    (``match`` in it); the native path's, PyTorch's own error, word for word what nn.Conv2d
    with the layer's attributes raises."""
    if not NATIVE:
        return raises((RuntimeError, ValueError), match, lambda: conv(x))
    reference = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                          conv.padding, conv.dilation, 1, conv.bias is not None)
    reference.groups = conv.groups
    reference.weight, reference.bias = conv.weight, conv.bias
    with by_pytorch():
        try:
            reference(x)
        except Exception as e:
            expected = e
        else:
            raise AssertionError("nn.Conv2d raised nothing")
    raised = raises(type(expected), str(expected), lambda: conv(x))
    assert str(raised) == str(expected), (raised, expected)
    return raised


def tuned(**kwargs):
    torch.manual_seed(0)
    args = dict(in_channels=4, out_channels=8, kernel_size=3, padding=1)
    args.update(kwargs)
    conv = mt.Conv2d(**args, cache=False, name="hostile.conv")
    x = torch.randn(3, args["in_channels"], 9, 9)
    check_against_pytorch(conv, x)  # tuned for this problem
    return conv, x


# --- surgery on a tuned layer ---------------------------------------------------------------


@scenario
def surgery_out_channels_shrink():
    conv, x = tuned()
    conv.weight = nn.Parameter(conv.weight.detach()[:4].clone())
    conv.bias = nn.Parameter(conv.bias.detach()[:4].clone())
    conv.out_channels = 4
    check_against_pytorch(conv, x)


@scenario
def surgery_out_channels_grow():
    conv, x = tuned()
    conv.weight = nn.Parameter(torch.randn(16, 4, 3, 3))
    conv.bias = nn.Parameter(torch.randn(16))
    conv.out_channels = 16
    check_against_pytorch(conv, x)


@scenario
def surgery_in_channels():
    conv, x = tuned()
    conv.weight = nn.Parameter(conv.weight.detach()[:, :2].clone())
    conv.in_channels = 2
    check_against_pytorch(conv, x[:, :2].contiguous())
    # The old input no longer fits: a clear error, as nn.Conv2d gives one.
    raises_as_nn_conv2d(conv, x, "hostile.conv: input has 4 channels, the layer expects 2")


@scenario
def surgery_kernel():
    conv, x = tuned()
    conv.weight = nn.Parameter(torch.randn(8, 4, 5, 5))
    conv.kernel_size = (5, 5)
    conv.padding = (2, 2)
    check_against_pytorch(conv, x)


@scenario
def surgery_stride():
    conv, x = tuned()
    conv.stride = (2, 2)
    check_against_pytorch(conv, x)


@scenario
def surgery_padding():
    conv, x = tuned()
    conv.padding = (3, 0)
    check_against_pytorch(conv, x)


@scenario
def surgery_dilation():
    conv, x = tuned()
    conv.dilation = (2, 3)
    check_against_pytorch(conv, x)


@scenario
def surgery_groups():
    conv, x = tuned()
    conv.groups = 2
    conv.weight = nn.Parameter(conv.weight.detach()[:, :2].clone())
    check_against_pytorch(conv, x)
    # Groups that do not divide the weight: PyTorch refuses, so does the layer (naming it).
    conv.groups = 3
    raises_as_nn_conv2d(conv, x, "hostile.conv")


@scenario
def surgery_then_convert_again():
    # A converted module after surgery: converting the model again picks up its geometry and
    # weight, under its name and options (the native path identifies calls by them).
    torch.manual_seed(0)
    model = mt.convert_(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1)), cache=False)
    x = torch.randn(3, 4, 9, 9)
    conv = model[0]
    check_against_pytorch(conv, x)
    conv.stride = (2, 2)
    conv.weight = nn.Parameter(torch.randn(8, 4, 3, 3))
    model = mt.convert_(model)
    conv = model[0]
    assert name_of(conv) == "0"
    check_against_pytorch(conv, x)


# --- raw ops with operands that do not agree -------------------------------------------------


def raw_args(conv, x):
    return [x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], 1, conv._mucudnn_config]


@python_path_scenario
def raw_op_weight_of_another_dtype():
    conv, x = tuned()
    args = raw_args(conv, x)
    args[1] = conv.weight.detach().half()
    raises(RuntimeError, "hostile.conv: the input is torch.float32 but the weight is torch.float16",
           lambda: torch.ops.mucudnn.conv2d(*args))
    args = raw_args(conv, x.bfloat16())
    raises(RuntimeError, "but the weight is torch.float32", lambda: torch.ops.mucudnn.conv2d(*args))
    args = raw_args(conv, x)
    args[2] = conv.bias.detach().double()
    raises(RuntimeError, "but the bias is torch.float64", lambda: torch.ops.mucudnn.conv2d(*args))


@python_path_scenario
def raw_op_weight_on_another_device():
    conv, x = tuned()
    args = raw_args(conv, x)
    args[1] = torch.empty(conv.weight.shape, device="meta")
    raises(RuntimeError, "hostile.conv: the input is on cpu but the weight is on meta",
           lambda: torch.ops.mucudnn.conv2d(*args))
    # A meta weight against a CPU input of another dtype: the dtype is named first.
    args[1] = torch.empty(conv.weight.shape, device="meta", dtype=torch.float16)
    raises(RuntimeError, "hostile.conv: the input is torch.float32 but the weight is torch.float16",
           lambda: torch.ops.mucudnn.conv2d(*args))


@python_path_scenario
def raw_op_weight_of_another_shape():
    conv, x = tuned()
    for weight in (torch.randn(8, 3, 3, 3), torch.randn(8, 4, 3), torch.randn(7, 4, 3, 3)):
        args = raw_args(conv, x)
        args[1] = weight
        if weight.shape[0] == 7:
            args[2] = None
            args[6] = 2  # 7 filters in 2 groups
        raises(RuntimeError, "hostile.conv", lambda: torch.ops.mucudnn.conv2d(*args))
    args = raw_args(conv, x)
    args[2] = torch.randn(5)
    raises(RuntimeError, "the bias has shape (5,), expected (8,)",
           lambda: torch.ops.mucudnn.conv2d(*args))
    # A larger weight than the plan's: re-tuned for its own problem, the right answer.
    args = raw_args(conv, x)
    args[1], args[2] = torch.randn(12, 4, 3, 3), None
    close(torch.ops.mucudnn.conv2d(*args), F.conv2d(x, args[1], None, 1, 1))


@python_path_scenario
def raw_backward_ops_with_a_wrong_grad():
    conv, x = tuned()
    rest = ([1, 1], [1, 1], [1, 1], 1, conv._mucudnn_config)
    w = conv.weight.detach()
    for grad in (torch.randn(3, 8, 5, 5), torch.randn(3, 8, 9, 9).half(), torch.randn(3, 8, 9, 9, device="meta")):
        for op in (torch.ops.mucudnn.conv2d_backward_data, torch.ops.mucudnn.conv2d_backward_filter):
            raises(RuntimeError, "hostile.conv", lambda: op(grad, x, w, *rest))


@python_path_scenario
def raw_op_with_a_config_no_layer_made():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
    for config in ("7", "{}", "not json"):
        raises(RuntimeError, "is not a mucudnn layer configuration",
               lambda: torch.ops.mucudnn.conv2d(x, w, None, [1, 1], [0, 0], [1, 1], 1, config))


@scenario
def layer_of_another_dtype_than_its_input():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.half", dtype=torch.bfloat16)
    raises_as_nn_conv2d(
        conv, torch.randn(1, 3, 6, 6),
        "net.half: the input is torch.float32 but the weight is torch.bfloat16",
    )


# --- graphs saved in one process, run in another ---------------------------------------------


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 4, 3, stride=2, dilation=2, padding=2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def small(directory):
    torch.manual_seed(0)
    reference = Small()
    model = mt.convert_(copy.deepcopy(reference), cache=str(Path(directory) / "cache.sqlite"))
    x = torch.randn(2, 3, 10, 10)
    with by_pytorch():
        expected = reference(x)
    close(model(x), expected)
    return model, x, expected


def runs_mucudnn(graph, x, expected):
    """A saved graph run in a fresh process: PyTorch's numbers, and mucudnn's plans under the
    switch (the Python path's graph holds mucudnn's ops, which run them anyway)."""
    close(graph(x), expected)
    with mt.enabled(cache=False):
        before = mucudnn_runs()
        close(graph(x), expected)
        assert mucudnn_runs() - before == 2, mt.account()


def convert_other_layers_first():
    """What a fresh process does before loading a graph: other layers, other geometries,
    converted and run (in the old design, they took the graph's numeric ids)."""
    torch.manual_seed(1)
    for c, k, kernel in ((3, 5, 1), (6, 4, 3), (3, 6, 5), (4, 8, 3)):
        conv = mt.Conv2d(c, k, kernel, cache=False, name=f"other.{c}.{k}.{kernel}")
        x = torch.randn(1, c, 8, 8)
        with by_pytorch():
            expected = F.conv2d(x, conv.weight, conv.bias)
        close(conv(x), expected)


@scenario
def traced_save(directory):
    model, x, expected = small(directory)
    before = mucudnn_runs()
    traced = torch.jit.trace(model, x)  # records, then checks the trace against the model
    if mt.PATH == "native":
        assert mucudnn_runs() > before, "the model's own run after recording is mucudnn's"
        names = [n.kind() for n in traced.inlined_graph.nodes()]
        assert names.count("aten::_convolution") == 2, names
    torch.jit.save(traced, str(Path(directory) / "traced.pt"))
    torch.save({"x": x, "expected": expected}, str(Path(directory) / "io.pt"))


@scenario
def traced_load(directory):
    convert_other_layers_first()
    io_ = torch.load(str(Path(directory) / "io.pt"))
    traced = torch.jit.load(str(Path(directory) / "traced.pt"))
    if mt.PATH == "native":
        # The native path leaves a call torch.jit.trace records to PyTorch, so the trace holds
        # PyTorch's aten::_convolution (not mucudnn's kernel's operations): PyTorch's numbers,
        # run by PyTorch's kernels, even under the switch.
        close(traced(io_["x"]), io_["expected"])
        with mt.enabled(cache=False):
            before = mucudnn_runs()
            close(traced(io_["x"]), io_["expected"])
            assert mucudnn_runs() == before, mt.account()
        return
    runs_mucudnn(traced, io_["x"], io_["expected"])


@scenario
def exported_save(directory):
    model, x, expected = small(directory)
    exported = torch.export.export(model, (x,))
    torch.export.save(exported, str(Path(directory) / "exported.pt2"))
    torch.save({"x": x, "expected": expected}, str(Path(directory) / "io.pt"))


@scenario
def exported_load(directory):
    convert_other_layers_first()
    io_ = torch.load(str(Path(directory) / "io.pt"))
    exported = torch.export.load(str(Path(directory) / "exported.pt2"))
    runs_mucudnn(exported.module(), io_["x"], io_["expected"])


# --- copies, pickles, saved models -----------------------------------------------------------


@scenario
def deepcopy_after_use(directory):
    model, x, expected = small(directory)
    model(x).sum().backward()
    twin = copy.deepcopy(model)  # as EMA and SWA implementations start
    close(twin(x), expected)
    twin.a.weight.data.mul_(2)  # the copy owns its parameters
    close(model(x), expected)
    assert name_of(twin.a) == "a" and plans_of(twin.a), "the copy reports its plans"


@scenario
def pickle_after_use(directory):
    model, x, expected = small(directory)
    model(x)
    again = pickle.loads(pickle.dumps(model))
    close(again(x), expected)


@scenario
def torch_save_save(directory):
    model, x, expected = small(directory)
    model(x).sum().backward()
    torch.save(model, str(Path(directory) / "model.pt"))
    torch.save({"x": x, "expected": expected}, str(Path(directory) / "io.pt"))


@scenario
def torch_save_load(directory):
    convert_other_layers_first()
    io_ = torch.load(str(Path(directory) / "io.pt"))
    model = torch.load(str(Path(directory) / "model.pt"), weights_only=False)
    assert name_of(model.a) == "a"
    close(model(io_["x"]), io_["expected"])
    model(io_["x"]).sum().backward()
    assert ran("a") == {"fwd": 2, "bwd_filter": 1}, mt.account()  # x needs no gradient


@python_path_scenario
def jit_script_says_to_use_compile():
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.scripted")
    raises(RuntimeError, "torch.compile", lambda: torch.jit.script(nn.Sequential(conv)))


@native_scenario
def jit_script_runs_mucudnn():
    # The native path's kernels sit in PyTorch's dispatcher, under TorchScript too.
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.scripted")
    model = mt.convert_(nn.Sequential(nn.Conv2d(4, 2, 3)), cache=False)
    x = torch.randn(2, 3, 8, 8)
    scripted = torch.jit.script(nn.Sequential(conv, model[0]))
    with by_pytorch():
        expected = model[0](conv(x))
    close(scripted(x), expected)
    assert ran("net.scripted") == {"fwd": 1} and ran("0") == {"fwd": 1}, mt.account()


def main(argv):
    name = argv[1]
    fn = SCENARIOS[name]
    if fn.__code__.co_argcount:
        fn(argv[2])
    else:
        fn()
    print(f"scenario {name}: ok")


if __name__ == "__main__":
    main(sys.argv)

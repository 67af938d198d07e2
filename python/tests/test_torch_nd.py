"""Conv1d, Conv3d and ConvTranspose1d/2d/3d on CPU tensors: forward and every
gradient against ``torch.nn`` over groups, depthwise, dilation, stride 2 with odd sizes,
asymmetric (causal) padding as an ``F.pad``-ed input, no bias and channels-last; ``opcheck`` of
every op the layers call; ``torch.compile``; a converted model mixing all kinds trained for
three SGD steps against the unconverted one; ``convert_``'s ``kinds``; state dicts, pickling,
autocast, float64, ``tune`` and ``plans``.

Every layer is made with ``fallback=False``, so a shape mucudnn cannot tune is an error, never a
silent run of PyTorch's convolution, and the tests check that plans were made.
"""

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mucudnn.torch as mt
from converted import (
    NATIVE, by_pytorch, converted_layers, fallbacks, is_converted, name_of, options_of,
    plans_of, python_path_only, ran,
)

OURS = {
    "conv1d": mt.Conv1d,
    "conv3d": mt.Conv3d,
    "conv_transpose1d": mt.ConvTranspose1d,
    "conv_transpose2d": mt.ConvTranspose2d,
    "conv_transpose3d": mt.ConvTranspose3d,
}
THEIRS = {
    "conv1d": nn.Conv1d,
    "conv3d": nn.Conv3d,
    "conv_transpose1d": nn.ConvTranspose1d,
    "conv_transpose2d": nn.ConvTranspose2d,
    "conv_transpose3d": nn.ConvTranspose3d,
}
SPATIAL = {"conv1d": 1, "conv3d": 3, "conv_transpose1d": 1, "conv_transpose2d": 2,
           "conv_transpose3d": 3}


def spatial_sizes(spatial, sizes):
    """The last ``spatial`` of (depth, height, width) sizes."""
    return tuple(sizes[-spatial:])


def causal_pad(spatial, amount):
    """F.pad's spec padding the first spatial dim (time) on its start only."""
    return (0, 0) * (spatial - 1) + (amount, 0)


# name: (N, C, (D, H, W) sizes, layer arguments, channels_last, F.pad spec or None)
GEOMETRIES = {
    "plain": (2, 3, (4, 5, 6), dict(out_channels=4, kernel_size=3, padding=1), False, None),
    "groups": (2, 4, (4, 5, 5), dict(out_channels=6, kernel_size=3, groups=2), False, None),
    "depthwise": (2, 4, (3, 5, 5), dict(out_channels=4, kernel_size=3, padding=1, groups=4),
                  False, None),
    "dilation": (1, 2, (5, 7, 7), dict(out_channels=3, kernel_size=3, dilation=2, padding=2),
                 False, None),
    "stride2_odd": (3, 3, (5, 7, 5), dict(out_channels=2, kernel_size=3, stride=2, padding=1),
                    False, None),
    "causal": (2, 3, (4, 5, 6), dict(out_channels=2, kernel_size=3), False, "causal"),
    "no_bias": (2, 3, (3, 5, 5), dict(out_channels=2, kernel_size=3, bias=False), False, None),
    "channels_last": (2, 4, (3, 4, 5), dict(out_channels=5, kernel_size=3, padding=1), True,
                      None),
}


def cases():
    for kind in OURS:
        for geometry in GEOMETRIES:
            yield kind, geometry


def make(kind, geometry, seed=0, name=None):
    """Our layer, the reference torch.nn layer with its state, the input, and the F.pad spec.
    Layers of one (kind, geometry) share a name, so their configuration and plans, unless
    ``name`` gives another."""
    n, c, sizes, kwargs, channels_last, pad = GEOMETRIES[geometry]
    spatial = SPATIAL[kind]
    kwargs = dict(kwargs)
    if kind.startswith("conv_transpose") and geometry == "stride2_odd":
        kwargs["output_padding"] = 1
    torch.manual_seed(seed)
    ours = OURS[kind](c, cache=False, fallback=False, name=name or f"nd.{kind}.{geometry}",
                        **kwargs)
    theirs = THEIRS[kind](c, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn((n, c) + spatial_sizes(spatial, sizes))
    if channels_last and spatial == 1:
        # PyTorch has no 1-D memory format: channels innermost (N, L, C) seen as (N, C, L),
        # which runs as NHWC at a unit height.
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif channels_last:
        fmt = torch.channels_last_3d if spatial == 3 else torch.channels_last
        x = x.contiguous(memory_format=fmt)
        ours = ours.to(memory_format=fmt)
        theirs = theirs.to(memory_format=fmt)
    return ours, theirs, x, (causal_pad(spatial, 2) if pad == "causal" else None)


def assert_close(ours, theirs, what):
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * max(scale, 1e-30), msg=what)


def computing(layer, ours):
    """Where a layer's steps run: PyTorch's kernels for the reference (see by_pytorch)."""
    return contextlib.nullcontext() if layer is ours else by_pytorch()


def assert_planned(layer):
    """The layer ran mucudnn's plans (at least one input shape, none on PyTorch's convolution)."""
    reports = list(plans_of(layer).values())
    assert reports, f"{name_of(layer)}: no plans"
    assert all(r.fallback is None for r in reports), [r.fallback for r in reports]


@pytest.mark.parametrize("kind,geometry", list(cases()))
def test_forward_and_gradients_match_torch_nn(kind, geometry):
    ours, theirs, x, pad = make(kind, geometry)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = []
    grad = None
    for layer, xx in zip((ours, theirs), xs):
        with computing(layer, ours):
            inp = F.pad(xx, pad) if pad is not None else xx
            y = layer(inp)
            if grad is None:
                grad = torch.randn_like(y)
            y.backward(grad)
        ys.append(y)
    assert ys[0].shape == ys[1].shape
    if geometry == "channels_last":  # the output keeps the input's memory format
        if SPATIAL[kind] == 1:
            assert ys[0].stride(1) == 1 and not ys[0].is_contiguous()
        else:
            fmt = torch.channels_last_3d if SPATIAL[kind] == 3 else torch.channels_last
            assert ys[0].is_contiguous(memory_format=fmt) and not ys[0].is_contiguous()
    assert_close(ys[0], ys[1], f"{kind} {geometry} forward")
    assert_close(xs[0].grad, xs[1].grad, f"{kind} {geometry} input gradient")
    assert_close(ours.weight.grad, theirs.weight.grad, f"{kind} {geometry} weight gradient")
    if ours.bias is not None:
        assert_close(ours.bias.grad, theirs.bias.grad, f"{kind} {geometry} bias gradient")
    else:
        assert theirs.bias is None
    assert_planned(ours)
    assert ran(name_of(ours)) == {"fwd": 1, "bwd_data": 1, "bwd_filter": 1}
    if geometry == "channels_last":  # a 1-D layer's is NWC (the Python path says NHWC)
        assert all(r.layout in ("nwc", "nhwc", "ndhwc") for r in ours.plans.values())
    # A transposed layer's three passes are one convolution problem's plan set.
    if kind.startswith("conv_transpose"):
        (report,) = ours.plans.values()
        assert report.tuned_ops == ("fwd", "bwd_data", "bwd_filter"), str(report)


def test_unbatched_inputs_and_output_size():
    torch.manual_seed(3)
    for kind in OURS:
        ours, theirs, x, _ = make(kind, "stride2_odd")
        single = x[0]
        with by_pytorch():
            expected = theirs(single)
        assert_close(ours(single), expected, f"{kind} unbatched")
    # output_size picks the output_padding, as in torch.nn.
    torch.manual_seed(3)
    ours = mt.ConvTranspose3d(3, 4, 3, stride=2, padding=1, cache=False, fallback=False,
                              name="nd.output_size")
    theirs = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 4, 5, 6)
    size = [8, 9, 12]  # output_padding (1, 0, 1)
    y = ours(x, output_size=size)
    assert tuple(y.shape[2:]) == tuple(size)
    with by_pytorch():
        expected = theirs(x, output_size=size)
    assert_close(y, expected, "output_size")
    assert ran(name_of(ours)) == {"bwd_data": 1}


@pytest.mark.parametrize("kind", ["conv1d", "conv3d"])
def test_padding_same_with_even_kernels(kind):
    # 'same' with an even kernel pads the extra element at the end of each dim, as PyTorch.
    torch.manual_seed(6)
    spatial = SPATIAL[kind]
    kernel = (2, 3, 4)[-spatial:]
    ours = OURS[kind](2, 3, kernel, padding="same", cache=False, fallback=False, name="nd.same")
    theirs = THEIRS[kind](2, 3, kernel, padding="same")
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn((2, 2) + (4, 5, 6)[-spatial:])
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = []
    for layer, xx in zip((ours, theirs), xs):
        with computing(layer, ours):
            ys.append(layer(xx))
            ys[-1].pow(2).sum().backward()
    assert_close(ys[0], ys[1], "same")
    assert_close(xs[0].grad, xs[1].grad, "same input gradient")
    assert_close(ours.weight.grad, theirs.weight.grad, "same weight gradient")
    assert_planned(ours)


@pytest.mark.parametrize("kind", ["conv3d", "conv_transpose3d", "conv_transpose1d"])
def test_double_backward_matches_torch_nn(kind):
    ours, theirs, x, _ = make(kind, "stride2_odd", name=f"nd.double.{kind}")
    results = []
    for module in (ours, theirs):
        with computing(module, ours):
            xx = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(module(xx).pow(2).sum(), xx, create_graph=True)
            results.append(torch.autograd.grad(gx.pow(2).sum(), [xx, module.weight]))
    for mine, reference in zip(*results):
        assert_close(mine, reference, f"{kind} double backward")


@pytest.mark.python_smoke
def test_output_padding_beyond_the_stride_runs_pytorch(capfd):
    # PyTorch allows output_padding < dilation even when it is not < stride; those output rows
    # are outside the convolution problem, so PyTorch's transposed convolution runs (warned).
    torch.manual_seed(4)
    ours = mt.ConvTranspose2d(3, 2, 3, stride=1, dilation=2, output_padding=1, cache=False,
                              fallback=False, name="nd.beyond")
    theirs = nn.ConvTranspose2d(3, 2, 3, stride=1, dilation=2, output_padding=1)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 4, 5)
    with by_pytorch():
        expected = theirs(x)
    assert_close(ours(x), expected, "output_padding >= stride")
    ours(x)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line and "nd.beyond" in line]
    assert len(warnings) == 1 and "output_padding" in warnings[0], warnings
    assert "PyTorch's" in warnings[0] and "stride" in warnings[0], warnings
    assert len(ours.plans) == 0


# ---------------------------------------------------------------------------------------------
# opcheck: every op the layers call, with the arguments they pass.


def op_calls(kind, geometry):
    """[(op, args)] the layer of ``kind`` runs on the case's input: its forward op and, for a
    convolution, both backward ops (a 1-D layer's are the 2-D ops at a unit height)."""
    ours, _, x, pad = make(kind, geometry)
    if pad is not None:
        x = F.pad(x, pad)
    spatial = SPATIAL[kind]
    ops = mt._ops.OPS[3 if spatial == 3 else 2]
    w = ours.weight
    geometry_of = [list(ours.stride), list(ours.padding), list(ours.dilation)]
    if spatial == 1:
        x, w = x.unsqueeze(2), w.unsqueeze(2)
        geometry_of = [[1] + geometry_of[0], [0] + geometry_of[1], [1] + geometry_of[2]]
    stride, padding, dilation = geometry_of
    config = ours._mucudnn_config
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    bias = ours.bias.detach().requires_grad_() if ours.bias is not None else None
    if kind.startswith("conv_transpose"):
        output_padding = list(ours.output_padding)
        if spatial == 1:
            output_padding = [0] + output_padding
        return [(ops.transpose, (x, w, bias, stride, padding, output_padding, dilation,
                                 ours.groups, config))]
    rest = (stride, padding, dilation, ours.groups, config)
    y = ops.conv(x.detach(), w.detach(), None, *rest)
    grad = torch.randn_like(y).requires_grad_()
    return [
        (ops.conv, (x, w, bias, *rest)),
        (ops.backward_data, (grad, x.detach(), w, *rest)),
        (ops.backward_filter, (grad, x, w.detach(), *rest)),
    ]


OPCHECK_CASES = [
    (kind, geometry)
    for kind in OURS
    for geometry in ("plain", "groups", "stride2_odd", "no_bias", "channels_last", "causal")
]


@python_path_only
@pytest.mark.parametrize("kind,geometry", OPCHECK_CASES)
def test_opcheck(kind, geometry):
    for op, args in op_calls(kind, geometry):
        torch.library.opcheck(op, args)


@python_path_only
def test_fake_ops_check_operands_as_the_real_ones():
    ours, _, x, _ = make("conv_transpose3d", "stride2_odd")
    op = mt._ops.OPS[3].transpose
    config = ours._mucudnn_config
    with pytest.raises(RuntimeError, match="output_padding .* smaller than the stride"):
        op(x, ours.weight, None, [2] * 3, [1] * 3, [2, 1, 1], [1] * 3, 1, config)
    with pytest.raises(RuntimeError, match="expected a 5-D input"):
        op(x[:, :, 0], ours.weight, None, [2] * 3, [1] * 3, [1] * 3, [1] * 3, 1, config)
    with pytest.raises(RuntimeError, match="stride must be 3 numbers"):
        mt._ops.OPS[3].conv(x, ours.weight.transpose(0, 1), None, [1, 1], [0] * 3, [1] * 3, 1,
                            config)


# ---------------------------------------------------------------------------------------------
# Models: torch.compile, a model of every kind trained against torch.nn, state and pickling.


class Mixed(nn.Module):
    """A small 3-D UNet (Conv3d down, ConvTranspose3d up, a skip), a Conv1d stack with a
    ConvTranspose1d, and a 2-D branch with a ConvTranspose2d: every kind of layer."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv3d(2, 4, 3, padding=1)
        self.down = nn.Conv3d(4, 6, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose3d(6, 4, 3, stride=2, padding=1, output_padding=1)
        self.dec = nn.Conv3d(8, 2, (3, 1, 1), padding=(1, 0, 0), bias=False)
        self.audio = nn.Sequential(
            nn.Conv1d(2, 4, 5, stride=2),
            nn.ReLU(),
            nn.Conv1d(4, 4, 3, dilation=2, groups=2),
            nn.ReLU(),
            nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1),
        )
        self.image = nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1, groups=1),
        )

    def forward(self, video, audio, image):
        e = F.relu(self.enc(video))
        d = F.relu(self.down(e))
        u = F.relu(self.up(d))
        v = self.dec(torch.cat([e, u], dim=1))
        return v, self.audio(audio), self.image(image)


def mixed_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 2, 4, 6, 6, generator=g),
        torch.randn(2, 2, 21, generator=g),
        torch.randn(2, 2, 6, 6, generator=g),
    )


def converted_mixed(**options):
    torch.manual_seed(0)
    original = Mixed()
    ours = mt.convert_(copy.deepcopy(original), cache=False, fallback=False, **options)
    return original, ours


def test_convert_converts_every_kind():
    original, ours = converted_mixed()
    kinds = {type(m).__name__ for m in converted_layers(ours)}
    assert kinds == {"Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                     "ConvTranspose3d"}
    for m in ours.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            assert is_converted(m), type(m)
    assert name_of(ours.up) == "up"
    assert name_of(ours.audio[4]) == "audio.4"
    assert list(ours.state_dict()) == list(original.state_dict())


@pytest.mark.python_smoke
def test_convert_kinds_chooses_which_layers():
    torch.manual_seed(0)
    model = mt.convert_(Mixed(), kinds=("conv3d", "conv_transpose1d"), cache=False)
    assert [name_of(m) for m in converted_layers(model)] == ["enc", "down", "dec", "audio.4"]
    assert not is_converted(model.up) and not is_converted(model.audio[0])
    assert not is_converted(model.image[0])
    # One name alone is one kind.
    model = mt.convert_(Mixed(), kinds="conv_transpose2d", cache=False)
    assert [name_of(m) for m in converted_layers(model)] == ["image.2"]
    with pytest.raises(ValueError, match="unknown 'conv4d'"):
        mt.convert_(Mixed(), kinds=("conv2d", "conv4d"))
    with pytest.raises(ValueError, match="kinds is empty"):
        mt.convert_(Mixed(), kinds=())
    with pytest.raises(TypeError, match="kinds must be names"):
        mt.convert_(Mixed(), kinds=3)
    # A layer given alone comes back converted (or as it is, when its kind is not chosen):
    # the same object on the native path, mucudnn's layer on the Python path.
    layer = nn.ConvTranspose3d(2, 3, 2)
    assert mt.convert_(layer, kinds="conv3d") is layer and not is_converted(layer)
    converted = mt.convert_(layer, cache=False)
    assert (converted is layer) if NATIVE else (type(converted) is mt.ConvTranspose3d)
    assert is_converted(converted) and name_of(converted) == "conv"


@python_path_only
def test_padding_modes_other_than_zeros_are_refused():
    with pytest.raises(ValueError, match="padding_mode='circular'"):
        mt.Conv3d(2, 2, 3, padding_mode="circular")
    model = nn.Sequential(nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"),
                          nn.Conv3d(2, 2, 3))
    mt.convert_(model, skip_unsupported=True, cache=False)
    assert type(model[0]) is nn.Conv1d and type(model[1]) is mt.Conv3d


@pytest.mark.skipif(not NATIVE, reason="the Python path refuses them (test above)")
def test_padding_modes_other_than_zeros_run_mucudnn():
    # The module pads its input itself and calls a convolution of padding 0: mucudnn runs it.
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "reflect": nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"),
        "replicate": nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="replicate"),
    })
    reference = copy.deepcopy(model)
    mt.convert_(model, cache=False, fallback=False)
    circular = mt.Conv3d(2, 2, 3, padding=1, padding_mode="circular", cache=False,
                         fallback=False, name="circular")
    plain = nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular")
    plain.load_state_dict(circular.state_dict())
    cases = [(model["reflect"], reference["reflect"], (2, 2, 9)),
             (model["replicate"], reference["replicate"], (2, 2, 5, 6)),
             (circular, plain, (1, 2, 3, 4, 5))]
    for ours, theirs, shape in cases:
        x = torch.randn(shape)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ys = []
        for layer, xx in zip((ours, theirs), xs):
            with computing(layer, ours):
                ys.append(layer(xx))
                ys[-1].pow(2).sum().backward()
        assert_close(ys[0], ys[1], f"{name_of(ours)} forward")
        assert_close(xs[0].grad, xs[1].grad, f"{name_of(ours)} input gradient")
        assert_close(ours.weight.grad, theirs.weight.grad, f"{name_of(ours)} weight gradient")
        assert_planned(ours)
        (report,) = plans_of(ours).values()
        assert report.tuned_ops == ("fwd", "bwd_data", "bwd_filter")


def test_a_mixed_model_trains_like_the_unconverted_one():
    original, ours = converted_mixed()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (original, ours)]
    names = [name for name, _ in original.named_parameters()]
    for step in range(3):
        inputs = mixed_inputs(step)
        outputs = []
        for model, optimizer in zip((original, ours), optimizers):
            optimizer.zero_grad()
            with computing(model, ours):
                out = model(*inputs)
                loss = sum(o.pow(2).mean() for o in out)
                loss.backward()
            outputs.append(out)
        for theirs, mine in zip(*outputs):
            assert_close(mine, theirs, f"step {step} output")
        params = [dict(m.named_parameters()) for m in (original, ours)]
        for name in names:
            assert_close(params[1][name].grad, params[0][name].grad, f"step {step} {name}.grad")
        for optimizer in optimizers:
            optimizer.step()
    for m in converted_layers(ours):
        assert_planned(m)


def test_torch_compile_runs_a_converted_3d_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(4, 4, 3, stride=2, padding=1, groups=2),
        nn.ReLU(),
        nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1, output_padding=1),
    )
    reference = copy.deepcopy(model)
    mt.convert_(model, cache=False, fallback=False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 2, 4, 6, 6)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [compiled(xs[0])]
    ys[0].pow(2).sum().backward()
    with by_pytorch():
        ys.append(reference(xs[1]))
        ys[1].pow(2).sum().backward()
    assert_close(ys[0], ys[1], "compiled forward")
    assert_close(xs[0].grad, xs[1].grad, "compiled input gradient")
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert_close(mine.grad, theirs.grad, "compiled parameter gradient")
    for layer in (model[0], model[2], model[4]):
        assert_planned(layer)


def test_state_dict_round_trip_and_pickling():
    original, ours = converted_mixed()
    inputs = mixed_inputs(5)
    with by_pytorch():
        expected = original(*inputs)
    # Converted -> plain and plain -> converted, same keys and values.
    fresh = Mixed()
    fresh.load_state_dict(ours.state_dict())
    with by_pytorch():
        for a, b in zip(fresh(*inputs), expected):
            assert_close(a, b, "state_dict into torch.nn")
    torch.manual_seed(7)
    other = mt.convert_(Mixed(), cache=False, fallback=False)
    other.load_state_dict(original.state_dict())
    for a, b in zip(other(*inputs), expected):
        assert_close(a, b, "state_dict into mucudnn")
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    assert set(torch.load(buffer)) == set(original.state_dict())
    # pickle and deepcopy: the layers come back with their settings, and run.
    clone = pickle.loads(pickle.dumps(ours))
    assert [name_of(m) for m in converted_layers(clone)] == [
        name_of(m) for m in converted_layers(ours)
    ]
    assert options_of(clone.up) == options_of(ours.up)
    for a, b in zip(clone(*inputs), expected):
        assert_close(a, b, "pickled")
    for a, b in zip(copy.deepcopy(ours)(*inputs), expected):
        assert_close(a, b, "deepcopy")


# ---------------------------------------------------------------------------------------------
# Switches and fallbacks: autocast, float64; tune() and plans.


@pytest.mark.parametrize("kind", sorted(OURS))
def test_autocast_runs_the_new_layers_in_bf16(kind):
    ours, theirs, x, _ = make(kind, "plain")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
        with by_pytorch():
            expected = theirs(x)
    assert y.dtype == torch.bfloat16 == expected.dtype
    torch.testing.assert_close(
        y.float(), expected.float(), rtol=0, atol=0.05 * expected.float().abs().max().item()
    )
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    # mucudnn ran the forward and the weight gradient, in bf16 (the input needs no gradient).
    assert sum(ran(name_of(ours)).values()) == 2 and fallbacks() == {}
    assert {r.dtype for r in plans_of(ours).values()} == {"bf16"}


@pytest.mark.python_smoke
@pytest.mark.parametrize("kind", sorted(OURS))
def test_float64_runs_pytorchs_convolution(kind, capfd):
    # A name of its own: the Python path keeps a name's plans for the process.
    ours, theirs, x, _ = make(kind, "stride2_odd", name=f"nd.float64.{kind}")
    ours, theirs, x = ours.double(), theirs.double(), x.double().requires_grad_()
    y = ours(x)
    with by_pytorch():
        torch.testing.assert_close(y, theirs(x))
    y.sum().backward()
    assert x.grad.dtype == torch.float64
    # One warning naming the layer (forward and backward are one layer's reason).
    name = name_of(ours)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line and name in line]
    assert len(warnings) == 1 and "PyTorch's convolution" in warnings[0], warnings
    assert not plans_of(ours)


def test_tune_and_plans_for_every_kind(capfd):
    original, ours = converted_mixed(verbose=False)
    summary = mt.tune(ours, *mixed_inputs(), verbose=False)
    layers = converted_layers(ours)
    assert summary.layers == len(layers) == 9
    assert summary.fallbacks == 0
    # Plans are keyed by each layer's own input shape.
    assert list(plans_of(ours.audio[0])) == [(2, 2, 21)]
    assert list(plans_of(ours.enc)) == [(2, 2, 4, 6, 6)]
    assert list(plans_of(ours.up)) == [(2, 6, 2, 3, 3)]
    assert list(plans_of(ours.image[2])) == [(2, 3, 3, 3)]
    # The transposed layer's report is its convolution problem's: input = its output.
    report = plans_of(ours.up)[(2, 6, 2, 3, 3)]
    assert report.shape == (2, 4, 4, 6, 6) and report.output_shape == (2, 6, 2, 3, 3)
    assert report.weight_shape == (6, 4, 3, 3, 3) and report.layout == "ncdhw"
    assert "2x6x2x3x3" in str(plans_of(ours.up))
    # Training after tune only executes (no new tuning lines).
    capfd.readouterr()
    for o in ours(*mixed_inputs()):
        o.sum().backward()
    assert "tuned input shape" not in capfd.readouterr().err
    for layer in layers:
        assert_planned(layer)


def test_channels_last_3d_runs_as_ndhwc():
    ours, theirs, x, _ = make("conv3d", "channels_last", name="nd.ndhwc")
    ours(x)
    (report,) = ours.plans.values()
    assert report.layout == "ndhwc"
    # The same shape contiguous (input and weight: a channels-last weight makes the call
    # channels-last, as PyTorch's kernels decide) is another problem, reported for the shape
    # now.
    ours.to(memory_format=torch.contiguous_format)
    ours(x.contiguous())
    (report,) = ours.plans.values()
    assert report.layout == "ncdhw" and report.fallback is None
    assert fallbacks() == {}

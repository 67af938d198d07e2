"""CUDA tensors (run on the GPU machine by `bash .gpu/accept.sh first-contact` (a named
selection) and `torch` (all); skipped without a GPU): cuDNN plans (legacy algorithms and
graph-API engines; spatial chunks at batch 1) against PyTorch's convolutions, on the current
stream, with no host synchronisation after tuning, inside CUDA graphs.

No false pass: every test asserts that mucudnn ran the convolution (no fallback to PyTorch's)
with the candidates it asked for, and a fallback warning from any layer fails the test. The
parameter ids are stable names (accept.sh selects tests by them)."""

import contextlib
import sys

import pytest
import torch

import mucudnn.torch as mt
from converted import by_pytorch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU (these run on the GPU machine)"
)

SHAPES = {
    "3x3": ((8, 16, 14, 14), dict(out_channels=32, kernel_size=3, padding=1)),
    "5x5-s2-g2": ((8, 16, 15, 15), dict(out_channels=32, kernel_size=5, padding=2, stride=2, groups=2)),
    "dil2": ((4, 16, 14, 14), dict(out_channels=16, kernel_size=3, padding=2, dilation=2)),
    "depthwise": ((8, 32, 14, 14), dict(out_channels=32, kernel_size=3, padding=1, groups=32)),
    "1x1": ((16, 64, 7, 7), dict(out_channels=64, kernel_size=1)),
}


#: The line mucudnn prints on stderr when a shape runs PyTorch's convolution instead.
FALLBACK_WARNING = "runs PyTorch's convolution"


@pytest.fixture(autouse=True)
def no_fallback_warning(capfd, request):
    """Fails a test during which any layer fell back to PyTorch's convolution (a test that
    may record one sets ``request.node.allows_fallback``). capfd: the native path's kernels
    write to the process's stderr."""
    yield
    err = capfd.readouterr().err
    sys.stderr.write(err)  # kept in the test's report
    if FALLBACK_WARNING in err and not getattr(request.node, "allows_fallback", False):
        pytest.fail(f"a layer fell back to PyTorch's convolution:\n{err}")


def ran_mucudnn(layer, candidates=None):
    """The layer's report for its one tuned shape, after asserting that mucudnn ran it (no
    fallback) with a non-empty list of plans per op, of `candidates` ("legacy": cuDNN's
    algorithm numbers; "engines": graph-API configurations) when given."""
    assert len(layer.plans) == 1, str(layer.plans)
    report = next(iter(layer.plans.values()))
    assert report.fallback is None, report.fallback
    assert report.ops, str(report)
    for op, info in report.ops.items():
        algorithms = info["algorithms"]
        assert algorithms, (op, info)
        if candidates == "engines":
            assert all(a.startswith("eng") for a in algorithms), (op, algorithms)
        elif candidates == "legacy":
            assert all(a.isdigit() for a in algorithms), (op, algorithms)
    return report


def pair(shape, kwargs, dtype, channels_last, **options):
    # Tuning bounded as in every test here (a GPU window is short): 8 engine configurations
    # per op and size, 8 MiB of workspace, unless the test says otherwise.
    options.setdefault("max_candidates", 8)
    options.setdefault("workspace_limit", "8MiB")
    torch.manual_seed(0)
    ours = mt.Conv2d(shape[1], cache=False, **kwargs, **options).cuda().to(dtype)
    reference = torch.nn.Conv2d(shape[1], **kwargs).cuda().to(dtype)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if channels_last:
        ours = ours.to(memory_format=torch.channels_last)
        reference = reference.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return ours, reference, x


def compare(ours, reference, x, tolerance):
    """Outputs and gradients of ``ours`` against the reference's, computed by PyTorch (see
    by_pytorch)."""
    results = []
    for module in (ours, reference):
        with by_pytorch() if module is reference else contextlib.nullcontext():
            xx = x.clone().requires_grad_()
            y = module(xx)
            grad = torch.ones_like(y)
            y.backward(grad)
        results.append([y.detach().float(), xx.grad.float(), module.weight.grad.float()])
        module.zero_grad()
    for mine, theirs in zip(*results):
        error = ((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item()
        assert error <= tolerance, error


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize(
    "dtype, channels_last", [(torch.float32, False), (torch.float16, True)],
    ids=["fp32-nchw", "fp16-nhwc"],
)
@pytest.mark.parametrize("candidates", ["legacy", "engines"])
def test_matches_pytorch(name, dtype, channels_last, candidates):
    shape, kwargs = SHAPES[name]
    ours, reference, x = pair(
        shape, kwargs, dtype, channels_last, candidates=candidates, workspace_limit="8MiB",
        max_candidates=8,
    )
    compare(ours, reference, x, 2e-2 if dtype == torch.float16 else 1e-2)
    report = ran_mucudnn(ours, candidates)
    assert report.tuned_ops == ("fwd", "bwd_data", "bwd_filter"), str(report)


def test_no_host_synchronisation_after_tuning_and_other_streams():
    shape, kwargs = SHAPES["3x3"]
    ours, reference, x = pair(shape, kwargs, torch.float16, True)
    ours(x).sum().backward()  # tunes
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            y = ours(x)
            y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with by_pytorch():
        expected = reference(x)
    error = ((y - expected).abs().max() / expected.abs().max()).item()
    assert error < 2e-2
    ran_mucudnn(ours)


def test_cuda_graph_capture_after_tuning():
    shape, kwargs = SHAPES["5x5-s2-g2"]
    ours, reference, x = pair(shape, kwargs, torch.float32, False)
    static_x = x.clone()
    ours(static_x)  # tune before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ours(static_x)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with by_pytorch():
        expected = reference(static_x)
    error = ((static_y - expected).abs().max() / expected.abs().max()).item()
    assert error < 1e-2
    ran_mucudnn(ours)


def test_untuned_shape_inside_capture_is_a_clear_error():
    shape, kwargs = SHAPES["1x1"]
    ours, _, x = pair(shape, kwargs, torch.float32, False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not tuned before CUDA graph capture"):
        with torch.cuda.graph(graph):
            ours(x)


ND_LAYERS = {
    # name: (mucudnn class, torch class, input shape, constructor keywords)
    "conv1d-s2": (mt.Conv1d, torch.nn.Conv1d, (8, 16, 101), dict(out_channels=32, kernel_size=5, stride=2, padding=2)),
    "conv3d": (mt.Conv3d, torch.nn.Conv3d, (2, 16, 9, 14, 14), dict(out_channels=32, kernel_size=3, padding=1)),
    "conv3d-s2-g2-causal": (
        mt.Conv3d, torch.nn.Conv3d, (2, 16, 9, 15, 15),
        dict(out_channels=16, kernel_size=3, stride=2, padding=(0, 1, 1), groups=2),
    ),
    "convT1d": (mt.ConvTranspose1d, torch.nn.ConvTranspose1d, (4, 16, 50), dict(out_channels=8, kernel_size=4, stride=2, padding=1)),
    "convT2d": (mt.ConvTranspose2d, torch.nn.ConvTranspose2d, (4, 16, 15, 15), dict(out_channels=8, kernel_size=3, stride=2, output_padding=1)),
    "convT3d": (mt.ConvTranspose3d, torch.nn.ConvTranspose3d, (2, 16, 5, 8, 8), dict(out_channels=8, kernel_size=(3, 4, 4), stride=(1, 2, 2), padding=(1, 1, 1))),
}


def may_have_no_candidate(name, dtype, candidates):
    """Whether cuDNN may have no candidate for the layer's problem: a grouped, strided 3-D half
    convolution, or a half 3-D one in channels_last_3d (NDHWC) with legacy algorithms alone
    (cuDNN may have no legacy algorithm for an op there, which the Rust suite exempts too:
    tests/gpu_cudnn.rs). There the layer may fall back, with the reason recorded in its report;
    the outputs are still compared. Every other case must run mucudnn."""
    if (name, dtype) == ("conv3d-s2-g2-causal", torch.float16):
        return True
    three_d = len(ND_LAYERS[name][2]) == 5
    return three_d and dtype == torch.float16 and candidates == "legacy"


@pytest.mark.parametrize("name", sorted(ND_LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("candidates", ["legacy", "engines"])
def test_nd_layers_match_pytorch(name, dtype, candidates, request):
    """Conv1d, Conv3d and the transposed layers on the GPU: outputs and gradients
    against torch.nn; fp16 runs 3-D tensors channels_last_3d (NDHWC)."""
    ours_class, torch_class, shape, kwargs = ND_LAYERS[name]
    may_fall_back = may_have_no_candidate(name, dtype, candidates)
    request.node.allows_fallback = may_fall_back
    torch.manual_seed(0)
    ours = ours_class(
        shape[1], cache=False, fallback=may_fall_back, candidates=candidates,
        workspace_limit="8MiB", max_candidates=8, **kwargs,
    ).cuda().to(dtype)
    reference = torch_class(shape[1], **kwargs).cuda().to(dtype)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if dtype == torch.float16 and len(shape) == 5:
        ours = ours.to(memory_format=torch.channels_last_3d)
        reference = reference.to(memory_format=torch.channels_last_3d)
        x = x.contiguous(memory_format=torch.channels_last_3d)
    compare(ours, reference, x, 2e-2 if dtype == torch.float16 else 1e-2)
    report = next(iter(ours.plans.values()))
    if may_fall_back and report.fallback is not None:
        # Recorded, not a failure: no candidate supports the problem (or fits the limit).
        assert report.fallback, str(report)
        assert not report.ops, str(report)
        print(f"{name} {dtype}: PyTorch's convolution, recorded reason: {report.fallback}")
        return
    ran_mucudnn(ours, candidates)


SPATIAL_LAYERS = {
    "conv2d": (mt.Conv2d, torch.nn.Conv2d, (1, 64, 96, 96), dict(out_channels=64, kernel_size=3, padding=1)),
    "conv2d-s2-dil2": (
        mt.Conv2d, torch.nn.Conv2d, (1, 32, 65, 65),
        dict(out_channels=32, kernel_size=3, stride=2, padding=3, dilation=2),
    ),
    "conv3d": (mt.Conv3d, torch.nn.Conv3d, (1, 32, 9, 32, 32), dict(out_channels=32, kernel_size=3, padding=1)),
    "convT2d": (mt.ConvTranspose2d, torch.nn.ConvTranspose2d, (1, 64, 33, 33), dict(out_channels=32, kernel_size=4, stride=2, padding=1)),
}


@pytest.mark.parametrize("name", sorted(SPATIAL_LAYERS))
def test_spatial_plans_at_batch_1_fp16_channels_last_match_pytorch(name):
    """Spatial splits: ``split="spatial"`` at batch 1, fp16 NHWC (NDHWC), engine configurations
    (legacy algorithms have no spatial plans): every op's plan is chunks along the outermost
    spatial dimension, and outputs and gradients match torch.nn."""
    ours_class, torch_class, shape, kwargs = SPATIAL_LAYERS[name]
    torch.manual_seed(0)
    ours = ours_class(
        shape[1], cache=False, fallback=False, candidates="engines", workspace_limit="1MiB",
        max_candidates=8, split="spatial", **kwargs,
    ).cuda().half()
    reference = torch_class(shape[1], **kwargs).cuda().half()
    reference.load_state_dict(ours.state_dict())
    fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    ours = ours.to(memory_format=fmt)
    reference = reference.to(memory_format=fmt)
    x = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    compare(ours, reference, x, 2e-2)
    report = ran_mucudnn(ours, "engines")
    assert report.layout in ("nhwc", "ndhwc"), report.layout
    assert report.spatial_ops == report.tuned_ops == ("fwd", "bwd_data", "bwd_filter"), str(report)
    axis = "d" if len(shape) == 5 else "h"
    for op, info in report.ops.items():
        assert info["split"].endswith(f" along {axis}"), (op, info)
        assert all(a.startswith("eng") for a in info["algorithms"]), (op, info)

"""``convert_`` adopts every convolution in place (the native path): the module stays the same
object of the same class, with its hooks of every kind, parametrizations, old-style weight
hooks, pruning masks, state-dict hooks, attributes and instance-level ``forward``; adoption
reads no weight and changes no buffer, parameter or RNG state; it is all or nothing; and the
account counts per layer what actually ran.

Each case runs the same model converted and unconverted (a deep copy taken first) and compares
outputs and gradients."""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune
from torch.nn.utils import parametrize

import mucudnn.torch as mt
from converted import by_pytorch, ran

pytestmark = pytest.mark.skipif(mt.PATH != "native", reason="the native path needs torch >= 2.10")

FAST = dict(cache=False, policy="undivided", split="batch", fallback=False)


def close(a, b, tol=1e-5):
    scale = max(b.detach().abs().max().item(), 1e-12)
    return (a.detach() - b.detach()).abs().max().item() / scale <= tol


def step(model: nn.Module, x: torch.Tensor):
    """Output, input gradient and every parameter's gradient of one step."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return [y.detach(), x.grad] + grads


def fell_back() -> int:
    return sum(sum(c["pytorch"].values()) for ops in mt.account().values() for c in ops.values())


def converted_matches(build, x: torch.Tensor, tol: float = 1e-5, **options) -> nn.Module:
    """Builds the model twice (the same seed), converts one, and checks one step of it
    against the other's."""
    torch.manual_seed(0)
    reference = build()
    expected = step(reference, x)
    torch.manual_seed(0)
    model = build()
    mt.convert_(model, **{**FAST, **options})
    got = step(model, x)
    for a, b in zip(got, expected):
        assert a is not None and b is not None
        assert close(a, b, tol)
    return model


def test_the_module_stays_the_same_object_of_the_same_class():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    objects = [(m, type(m), dict(m.__dict__)) for m in model]
    mt.convert_(model, **FAST)
    for (module, cls, attrs), now in zip(objects, model):
        assert now is module and type(now) is cls
        added = set(now.__dict__) - set(attrs)
        assert added <= {"_mucudnn"}
    assert type(model[0]) is nn.Conv2d and model[0]._mucudnn.name == "0"


def test_hooks_of_every_kind_keep_working():
    torch.manual_seed(0)
    fired = []

    def build():
        conv = nn.Conv2d(3, 4, 3, padding=1)
        conv.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        conv.register_forward_hook(lambda m, args, out: out + 1)
        conv.register_full_backward_pre_hook(lambda m, g: (g[0] * 3,))
        conv.register_full_backward_hook(lambda m, gi, go: fired.append("backward"))
        conv.register_state_dict_post_hook(lambda m, sd, prefix, local: sd.update(extra=torch.ones(1)))
        conv._register_load_state_dict_pre_hook(lambda *a: fired.append("load"))
        return conv

    torch.manual_seed(1)
    conv = build()
    reference = build()
    reference.load_state_dict({k: v for k, v in conv.state_dict().items() if k != "extra"}, strict=False)
    x = torch.randn(2, 3, 6, 6)
    expected = step(reference, x)
    fired.clear()
    mt.convert_(conv, **FAST)
    got = step(conv, x)
    for a, b in zip(got, expected):
        assert close(a, b)
    assert fired.count("backward") == 1
    assert "extra" in conv.state_dict()
    conv.load_state_dict(conv.state_dict(), strict=False)
    assert "load" in fired
    assert ran("conv") == {"fwd": 1, "bwd_data": 1, "bwd_filter": 1}


class Counted(nn.Module):
    """A parametrization that counts its evaluations."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, w):
        self.calls += 1
        return w * 0.5


def test_adoption_never_reads_a_parametrized_weight_nor_changes_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
    counter = Counted()
    parametrize.register_parametrization(model[0], "weight", counter)
    nn.utils.parametrizations.spectral_norm(model[1])
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    calls = counter.calls  # registering evaluates it once
    mt.convert_(model, **FAST)
    assert counter.calls == calls
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_spectral_norm_in_train_mode_matches_pytorch():
    def build():
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 2, 3))
        for conv in (model[0], model[2]):
            nn.utils.parametrizations.spectral_norm(conv)
        return model.train()

    converted_matches(build, torch.randn(2, 3, 8, 8), tol=1e-4)
    assert ran("0")["fwd"] == 1 and ran("2")["fwd"] == 1
    assert fell_back() == 0


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "prune"])
def test_old_style_weight_hooks_and_pruning(kind):
    def build():
        model = nn.Sequential(
            nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 3, 5, padding=2)
        )
        for conv in (model[0], model[2]):
            if kind == "weight_norm":
                nn.utils.weight_norm(conv)
            elif kind == "spectral_norm":
                nn.utils.spectral_norm(conv)
            else:
                torch.nn.utils.prune.l1_unstructured(conv, "weight", amount=0.3)
        return model.eval()

    torch.manual_seed(1)
    converted_matches(build, torch.randn(2, 2, 16), tol=1e-4)
    assert ran("0") == {"fwd": 1, "bwd_data": 1, "bwd_filter": 1}
    assert ran("2")["fwd"] == 1


def test_an_instance_level_forward_is_still_routed():
    calls = []

    def wrapped(original, x):
        calls.append(1)
        return original(x * 2) - 1

    def build():
        conv = nn.Conv2d(3, 4, 3)
        conv.forward = functools.partial(wrapped, conv.forward)
        return conv

    conv = converted_matches(build, torch.randn(1, 3, 6, 6))
    assert len(calls) == 2
    assert ran("conv")["fwd"] == 1
    # Set after conversion, too.
    conv.forward = functools.partial(wrapped, nn.Conv2d.forward.__get__(conv))
    mt.reset_account()
    conv(torch.randn(1, 3, 6, 6))
    assert ran("conv")["fwd"] == 1


def test_user_names_are_never_shadowed():
    class Causal(nn.Conv1d):
        kind = "causal"
        spatial = "time"

        def _check(self, x):
            return x.shape[-1] > 0

        def _batched(self):
            return "mine"

        def forward(self, x):
            if self.kind == "causal":
                x = F.pad(x, (self.kernel_size[0] - 1, 0))
            assert self._check(x) and self._batched() == "mine"
            return super().forward(x)

    model = converted_matches(lambda: Causal(2, 3, 3), torch.randn(2, 2, 10))
    assert model.kind == "causal" and model.spatial == "time"
    assert model(torch.randn(1, 2, 10)).shape == (1, 3, 10)


def test_parametrizations_can_be_added_and_removed_after_conversion():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    parametrize.register_parametrization(conv, "weight", Counted())
    mt.convert_(conv, **FAST)
    x = torch.randn(1, 3, 5, 5)
    before = conv(x)
    parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
    assert not parametrize.is_parametrized(conv)
    assert close(conv(x), before)
    parametrize.register_parametrization(conv, "weight", Counted())
    with by_pytorch():
        halved = F.conv2d(x, conv.weight, conv.bias)
    assert close(conv(x), halved)
    assert ran("conv")["fwd"] >= 3 and fell_back() == 0


def test_fuse_modules_after_conversion():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    mt.convert_(model, **FAST)
    fused = torch.ao.quantization.fuse_modules(model, [["0", "1", "2"]])
    x = torch.randn(1, 3, 6, 6)
    assert close(fused(x), model(x), 1e-4)


class Reduced(nn.Conv2d):
    """A class with its own ``__reduce__`` (its state by its own rules)."""

    def __reduce__(self):
        return (Reduced._rebuild, (self.in_channels, self.out_channels, self.state_dict()))

    @staticmethod
    def _rebuild(cin, cout, state):
        module = Reduced(cin, cout, 3)
        module.load_state_dict(state)
        return module


def test_a_class_reduce_keeps_working():
    torch.manual_seed(0)
    conv = Reduced(3, 4, 3)
    mt.convert_(conv, **FAST)
    copy_ = pickle.loads(pickle.dumps(conv))
    x = torch.randn(1, 3, 5, 5)
    assert torch.equal(copy_.weight, conv.weight)
    assert close(copy_(x), conv(x))


def test_pickle_and_deepcopy_keep_the_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
    mt.convert_(model, **FAST)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    x = torch.randn(1, 3, 7, 7)
    for other in (loaded, copied):
        assert other[0]._mucudnn.name == "0"
        assert close(other(x), model(x))
    assert ran("1")["fwd"] == 3


def test_conversion_is_all_or_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyConv2d(4, 3), nn.Conv2d(4, 4, 3))
    with pytest.raises(ValueError, match=r"1 \(LazyConv2d\).*lazy"):
        mt.convert_(model, **FAST)
    assert not any("_mucudnn" in m.__dict__ for m in model.modules())
    with pytest.raises(TypeError, match="workspace_limit"):
        mt.convert_(model, workspace_limit=[1])
    assert not any("_mucudnn" in m.__dict__ for m in model.modules())


def test_skip_unsupported_leaves_one_module_with_a_warning(capfd):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyConv2d(4, 3))
    mt.convert_(model, skip_unsupported=True, **FAST)
    assert "_mucudnn" in model[0].__dict__ and "_mucudnn" not in model[1].__dict__
    err = capfd.readouterr().err
    assert "1 (LazyConv2d)" in err and "lazy" in err


def test_excluded_kinds_stay_pytorchs():
    torch.manual_seed(0)
    model = nn.ModuleDict({"c1": nn.Conv1d(2, 3, 3), "c2": nn.Conv2d(2, 3, 3)})
    mt.convert_(model, kinds="conv2d", **FAST)
    model["c1"](torch.randn(1, 2, 8))
    model["c2"](torch.randn(1, 2, 6, 6))
    assert set(mt.account()) == {"c2"}


def test_each_layer_counts_its_own_calls():
    torch.manual_seed(0)
    # Two layers of one shape: told apart by their weights.
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1),
                          nn.Conv2d(4, 4, 3, padding=1))
    mt.convert_(model, **FAST)
    x = torch.randn(2, 4, 6, 6)
    model(x)
    model[1](x)
    assert ran("0") == {"fwd": 1} and ran("1") == {"fwd": 2} and ran("2") == {"fwd": 1}


def test_converting_again_changes_options_and_keeps_names():
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    mt.convert_(model, **FAST)
    first = model[0]._mucudnn
    mt.convert_(model)
    assert model[0]._mucudnn is first
    mt.convert_(model, workspace_limit="1MiB", cache=False)
    assert model[0]._mucudnn is not first and model[0]._mucudnn.name == "0"
    assert '"workspace_limit":1048576' in model[0]._mucudnn.options


def test_layerwise_casting_before_conversion():
    diffusers_hooks = pytest.importorskip("diffusers.hooks")

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 2, 3, padding=1)
        )
        diffusers_hooks.apply_layerwise_casting(
            model, storage_dtype=torch.bfloat16, compute_dtype=torch.float32
        )
        return model

    x = torch.randn(1, 3, 6, 6)
    expected = build()(x)
    model = build()
    mt.convert_(model, **FAST)
    got = model(x)
    assert close(got, expected)
    assert model[0].weight.dtype == torch.bfloat16  # stored as the hook left it
    assert ran("0")["fwd"] == 1 and ran("2")["fwd"] == 1


def test_an_unconverted_copy_stays_pytorchs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    copy_ = copy.deepcopy(model)  # before conversion: a plain model of the same shapes
    mt.convert_(model, **FAST)
    x = torch.randn(2, 3, 8, 8)
    expected = copy_(x)
    assert mt.account() == {}
    got = model(x)
    assert close(got, expected)
    assert ran("0") == {"fwd": 1} and ran("2") == {"fwd": 1}
    # A functional call of the same shape with another weight is PyTorch's too.
    F.conv2d(x, torch.randn(4, 3, 3, 3))
    assert ran("0") == {"fwd": 1}


def test_autocast_casts_are_the_layers_own():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    mt.convert_(model, **FAST)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(x)
        got.float().sum().backward()
    assert got.dtype == torch.bfloat16
    assert close(got.float(), expected.float(), 3e-2)  # bf16: a few of its 2^-8 steps
    assert ran("0") == {"fwd": 1, "bwd_filter": 1} and ran("2")["bwd_data"] == 1
    assert fell_back() == 0

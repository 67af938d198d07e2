"""Real clients whose convolution modules carry behaviour of their own (old-style and
parametrized weight norm, spectral norm in train mode, activation checkpointing, diffusers'
layerwise casting, hooks of every kind, accelerate's instance-level ``forward``, peft LoRA)
give the same outputs and gradients through ``convert_`` (adopted in place) and through
``enable(model)`` as unconverted, and mucudnn's plans run every convolution they perform.

Each case builds its model from a small config with random weights (nothing downloaded), runs
one step (forward, and backward where the client trains) on the unconverted model, then on a
second build of it converted or under the switch, and measures (:func:`measure`):

- outputs within 1e-5 relative of the unconverted model's; gradients too, or, where the model
  amplifies rounding, no further from float64's than PyTorch's own fp32 gradients are;
- every convolution op of the step (``aten::convolution`` and the ops of each
  ``aten::convolution_backward``, counted as mucudnn's account names them) run by mucudnn:
  the account's mucudnn counts equal that count per op, nothing went to PyTorch, and every
  convolution module the step called has a name in the account (its own, or its shape's
  group: "first (or N more of its shape)", for a weight computed per call).

python/benchmarks/real_clients_table.py runs the same cases and prints the table of errors
and counts."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mucudnn.torch as mt
from real_clients import FAST, gradient_error, relative_error, torch_threads

pytestmark = [
    pytest.mark.skipif(mt.PATH != "native", reason="the native path needs torch >= 2.10"),
    # The old-style weight norm real clients still use (diffusers' Oobleck, HiFi-GAN).
    pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning"),
]

OPS = ("fwd", "bwd_data", "bwd_filter")
PATHS = ("convert_", "enable")
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------------
# Measuring one case


class ConvolutionOps(TorchDispatchMode):
    """Counts the convolution ops PyTorch's dispatcher runs while active, as mucudnn's account
    names them (a transposed convolution's forward is its problem's ``bwd_data``, its input
    gradient the problem's ``fwd``), except those whose weight is one of ``left``'s (modules
    left to PyTorch)."""

    def __init__(self, left: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.left: collections.Counter = collections.Counter()
        self._left = {(w.data_ptr(), tuple(w.shape)) for w in left}

    def _count(self, weight: torch.Tensor, op: str) -> None:
        mine = (weight.data_ptr(), tuple(weight.shape)) in self._left
        (self.left if mine else self.ops)[op] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self._count(args[1], "bwd_data" if args[6] else "fwd")
        elif func is torch.ops.aten.convolution_backward.default:
            transposed, mask = args[7], args[10]
            if mask[0]:
                self._count(args[2], "fwd" if transposed else "bwd_data")
            if mask[1]:
                self._count(args[2], "bwd_filter")
        return func(*args, **(kwargs or {}))


def pattern(y: torch.Tensor) -> torch.Tensor:
    """A fixed weighting of an output's elements for the loss (every gradient differs)."""
    return torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)


@dataclasses.dataclass
class Step:
    outputs: List[torch.Tensor]
    #: Parameter gradients by name, and the inputs' as "input.N" (empty without backward).
    grads: Dict[str, Optional[torch.Tensor]]


def step(case: "Case", model: nn.Module, dtype: torch.dtype = torch.float32) -> Step:
    """One step of ``case`` on ``model``: its outputs and, for a training case, the gradients
    of a fixed weighting of them."""
    inputs = [x.to(dtype) if x.is_floating_point() else x for x in case.inputs()]
    if not case.backward:
        with torch.no_grad():
            return Step([y.detach() for y in case.forward(model, *inputs)], {})
    if case.input_grads:
        inputs = [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    model.zero_grad(set_to_none=True)
    outputs = case.forward(model, *inputs)
    sum((y * pattern(y)).sum() for y in outputs).backward()
    grads = {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters() if p.requires_grad
    }
    grads.update({f"input.{i}": x.grad for i, x in enumerate(inputs) if x.requires_grad})
    return Step([y.detach() for y in outputs], grads)


@dataclasses.dataclass
class Case:
    """A real client: how to build it (``build(adopt)`` calls ``adopt(model)`` where conversion
    belongs, by default last; seeded, so two builds are equal), its inputs, and one step."""

    build: Callable[[Callable[[nn.Module], nn.Module]], nn.Module]
    inputs: Callable[[], Sequence[torch.Tensor]]
    #: ``forward(model, *inputs)``: the outputs to compare (a tuple of tensors).
    forward: Callable[..., Tuple[torch.Tensor, ...]]
    backward: bool = True
    #: The inputs' gradients are compared too (a model that sets its input's requires_grad
    #: itself takes an input that does not).
    input_grads: bool = True
    #: Judge gradients against float64 (the model amplifies rounding).
    float64: bool = False


@dataclasses.dataclass
class Measured:
    """One case through one path, against the unconverted model."""

    output_error: float
    #: Gradients against PyTorch's fp32 (0 without backward).
    gradient_error: float
    #: Gradients against float64, mucudnn's and PyTorch's fp32 (None unless judged so).
    float64_error: Optional[float]
    pytorch_float64_error: Optional[float]
    #: The step's convolution ops (per op) and those mucudnn ran.
    expected: Dict[str, int]
    ran: Dict[str, int]
    #: Calls PyTorch's kernel ran, by reason (over the account).
    fell_back: Dict[str, int]
    #: The account's names that mucudnn ran calls for.
    names: List[str]
    #: Convolution modules the step called.
    called: int
    #: Convolution modules the step called that the account names nowhere (with mucudnn runs).
    uncounted: List[str]
    #: Convolution ops of modules left to PyTorch (not adopted), per op.
    left: Dict[str, int]
    reference: nn.Module
    model: nn.Module

    @property
    def gradients_ok(self) -> bool:
        if self.gradient_error <= TOLERANCE:
            return True
        return self.float64_error is not None and self.float64_error <= max(
            TOLERANCE, 2 * self.pytorch_float64_error
        )


def _group(name: str, layers: Dict[str, nn.Module]) -> List[str]:
    """The layers an account name stands for: one layer, or every registered layer of the
    first's shape ("first (or N more of its shape)", a weight computed per call)."""
    from mucudnn.torch._modules import signature_of

    grouped = re.fullmatch(r"(.*) \(or (\d+) more of its shape\)", name)
    if grouped is None:
        return [name] if name in layers else []
    first = layers[grouped.group(1)]
    group = [n for n, m in layers.items() if signature_of(m) == signature_of(first)]
    assert len(group) == int(grouped.group(2)) + 1, (name, group)
    return group


def measure(case: Case, path: str) -> Measured:
    """``case`` unconverted (and in float64 where judged so), then through ``path``
    (``"convert_"``: converted in place where its build says; ``"enable"``:
    ``mt.enable(model)``)."""
    gc.collect()  # earlier models' layers go (a shape's group spans every live layer)
    mt.disable()
    mt.reset_account()
    reference = case.build(lambda m: m)
    expected = step(case, reference)
    float64 = step(case, case.build(lambda m: m).double(), torch.float64) if case.float64 else None

    if path == "convert_":
        model = case.build(lambda m: mt.convert_(m, **FAST))
        layers = {
            m._mucudnn.name: m for m in model.modules() if "_mucudnn" in m.__dict__
        }
    else:
        model = case.build(lambda m: m)
        mt.enable(model, **FAST)
        layers = {name: m for name, m in model.named_modules() if _is_conv(m)}
    left = [m for m in model.modules() if _is_conv(m) and m not in layers.values()]
    called: List[nn.Module] = []
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: called.append(m) if _is_conv(m) else None
    )
    mt.reset_account()
    try:
        with ConvolutionOps(left=[m.weight for m in left]) as ops:
            got = step(case, model)
        account = mt.account()
    finally:
        hook.remove()
        mt.disable()

    ran = {op: sum(c.get(op, {}).get("mucudnn", 0) for c in account.values()) for op in OPS}
    fell_back: collections.Counter = collections.Counter()
    for counts in account.values():
        for count in counts.values():
            fell_back.update(count["pytorch"])
    named = sorted(n for n, counts in account.items() if any(c["mucudnn"] for c in counts.values()))
    counted = {member for name in named for member in _group(name, layers)}
    names = {id(m): n for n, m in layers.items()}
    uncounted = sorted({names[id(m)] for m in called if id(m) in names} - counted)

    def worst(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
        return max(relative_error(x, y) for x, y in zip(a, b))

    assert len(got.outputs) == len(expected.outputs)
    return Measured(
        output_error=worst(got.outputs, expected.outputs),
        gradient_error=gradient_error(got.grads, expected.grads) if case.backward else 0.0,
        float64_error=gradient_error(got.grads, float64.grads) if float64 else None,
        pytorch_float64_error=gradient_error(expected.grads, float64.grads) if float64 else None,
        expected={op: ops.ops[op] for op in OPS},
        ran=ran,
        fell_back=dict(fell_back),
        names=named,
        called=len({id(m) for m in called}),
        uncounted=uncounted,
        left={op: ops.left[op] for op in OPS},
        reference=reference,
        model=model,
    )


def _is_conv(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.conv._ConvNd)


def assert_matches(measured: Measured, name: str, left: bool = False) -> None:
    """The acceptance: the numbers of the unconverted model, every convolution op mucudnn's
    (with ``left``: but those of the modules not adopted, which must have run some)."""
    m = measured
    assert (sum(m.left.values()) > 0) == left, (name, m.left)
    assert m.output_error <= TOLERANCE, (name, m.output_error)
    assert m.gradients_ok, (name, m.gradient_error, m.float64_error, m.pytorch_float64_error)
    assert not m.fell_back, (name, m.fell_back)
    assert sum(m.expected.values()) > 0, name
    assert m.ran == m.expected, (name, m.ran, m.expected)
    assert not m.uncounted, (name, m.uncounted)


@pytest.fixture(autouse=True)
def _threads():
    with torch_threads(2):
        yield


# ------------------------------------------------------------------------------------------
# The clients


def _oobleck(adopt):
    """diffusers' Stable Audio VAE: old-style ``torch.nn.utils.weight_norm`` on every Conv1d
    and ConvTranspose1d (the weight a plain tensor, computed by a pre-forward hook)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderOobleck(
        encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
        decoder_channels=4, decoder_input_channels=4, audio_channels=2,
    )
    return adopt(vae.train())


def _oobleck_decode(vae, z):
    return (vae.decode(z).sample,)


OOBLECK = Case(
    build=_oobleck,
    inputs=lambda: (torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1)),),
    forward=_oobleck_decode,
)


class ResBlock(nn.Module):
    """HiFi-GAN's ResBlock1: dilated Conv1d pairs with residuals (weight norm by
    ``torch.nn.utils.parametrizations``, as newer vocoders write it)."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm

        def conv(dilation):
            return weight_norm(nn.Conv1d(
                channels, channels, kernel_size, dilation=dilation,
                padding=(kernel_size * dilation - dilation) // 2,
            ))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)

    def forward(self, x):
        for c1, c2 in zip(self.convs1, self.convs2):
            x = x + c2(F.leaky_relu(c1(F.leaky_relu(x, 0.1)), 0.1))
        return x


class Generator(nn.Module):
    """HiFi-GAN's generator: transposed-conv upsampling, each followed by the mean of
    residual blocks of several kernel sizes (multi-receptive-field fusion); the old-style
    ``torch.nn.utils.weight_norm`` on the outer convolutions, as HiFi-GAN's code has it."""

    def __init__(self, mels=8, channels=16, rates=(4, 4), kernels=(3, 5), dilations=(1, 3, 5)):
        super().__init__()
        weight_norm = nn.utils.weight_norm
        self.conv_pre = weight_norm(nn.Conv1d(mels, channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(
                channels >> i, channels >> (i + 1), 2 * rate, rate, padding=rate // 2,
            ))
            for i, rate in enumerate(rates)
        )
        self.resblocks = nn.ModuleList(
            ResBlock(channels >> (i + 1), k, dilations)
            for i in range(len(rates)) for k in kernels
        )
        self.kernels = len(kernels)
        self.conv_post = weight_norm(nn.Conv1d(channels >> len(rates), 1, 7, padding=3))

    def forward(self, mel):
        x = self.conv_pre(mel)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            blocks = self.resblocks[i * self.kernels:(i + 1) * self.kernels]
            x = sum(block(x) for block in blocks) / self.kernels
        return torch.tanh(self.conv_post(F.leaky_relu(x)))


class ScaleDiscriminator(nn.Module):
    """HiFi-GAN's DiscriminatorS (multi-scale, the first scale): grouped strided Conv1d with
    old-style ``torch.nn.utils.spectral_norm``."""

    def __init__(self):
        super().__init__()
        norm = nn.utils.spectral_norm
        self.convs = nn.ModuleList([
            norm(nn.Conv1d(1, 8, 15, 1, padding=7)),
            norm(nn.Conv1d(8, 16, 41, 4, groups=4, padding=20)),
            norm(nn.Conv1d(16, 16, 5, 1, padding=2)),
        ])
        self.conv_post = norm(nn.Conv1d(16, 1, 3, 1, padding=1))

    def forward(self, x):
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
        return torch.flatten(self.conv_post(x), 1)


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's DiscriminatorP (multi-period): audio folded by a period into 2-D, (k, 1)
    Conv2d over it; ``torch.nn.utils.parametrizations.spectral_norm`` here."""

    def __init__(self, period=3):
        super().__init__()
        norm = nn.utils.parametrizations.spectral_norm
        self.period = period
        self.convs = nn.ModuleList([
            norm(nn.Conv2d(1, 8, (5, 1), (3, 1), padding=(2, 0))),
            norm(nn.Conv2d(8, 16, (5, 1), (3, 1), padding=(2, 0))),
        ])
        self.conv_post = norm(nn.Conv2d(16, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        x = F.pad(x, (0, -t % self.period), "reflect")
        x = x.view(b, c, -1, self.period)
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
        return torch.flatten(self.conv_post(x), 1)


class Vocoder(nn.Module):
    """A HiFi-GAN training step's modules: the generator and a discriminator of each kind."""

    def __init__(self):
        super().__init__()
        self.generator = Generator()
        self.msd = ScaleDiscriminator()
        self.mpd = PeriodDiscriminator()

    def forward(self, mel):
        audio = self.generator(mel)
        return audio, self.msd(audio), self.mpd(audio)


def _vocoder(adopt):
    torch.manual_seed(0)
    return adopt(Vocoder().train())  # spectral norm's power iteration runs in train mode


HIFIGAN = Case(
    build=_vocoder,
    inputs=lambda: (torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1)),),
    forward=lambda model, mel: model(mel),
    float64=True,
)


def _wav2vec2(adopt):
    """transformers' wav2vec2 in training with activation checkpointing: the feature
    encoder's strided Conv1d stack (each layer checkpointed) and the grouped positional conv
    embedding (``parametrizations.weight_norm``, dim=2). No dropout or SpecAugment masking,
    so that every build computes the same."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8, 8), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, apply_spec_augment=False,
    )
    model = transformers.Wav2Vec2Model(config)
    enable_checkpointing = getattr(
        model, "activation_checkpointing_enable", None  # transformers >= 5.x's name
    ) or model.gradient_checkpointing_enable
    enable_checkpointing()
    return adopt(model.train())


def _wav2vec2_forward(model, audio):
    out = model(audio)
    return out.last_hidden_state, out.extract_features


WAV2VEC2 = Case(
    build=_wav2vec2,
    inputs=lambda: (torch.randn(2, 400, generator=torch.Generator().manual_seed(1)),),
    forward=_wav2vec2_forward,
    float64=True,
    input_grads=False,  # the feature encoder sets requires_grad on its input's view
)


def _wan_layerwise(adopt):
    """diffusers' Wan 2.1 VAE (``WanCausalConv3d``, a Conv3d subclass that pads and caches
    frames in its forward) with layerwise casting: weights stored in bfloat16, each layer
    cast to float32 around its forward by a hook that replaces the instance's ``forward``.
    Applied before conversion, as a user enabling it at load time would."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    vae.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    return adopt(vae.eval())


def _decoder_outputs(vae, z):
    """The decoder's outputs of ``vae.decode(z)``, frames concatenated (before the clamp that
    would hide differences)."""
    outputs = []
    hook = vae.decoder.register_forward_hook(
        lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        vae.decode(z)
    finally:
        hook.remove()
    return (torch.cat(outputs, 2),)


WAN_LAYERWISE = Case(
    build=_wan_layerwise,
    inputs=lambda: (torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(1)),),
    forward=_decoder_outputs,
    backward=False,  # layerwise casting is for inference (bfloat16 parameters)
)


class Hooked(nn.Module):
    """Three convolutions: the middle one carries a hook of every kind (see :func:`_hooked`),
    the last an accelerate hook (an instance-level ``forward``). ``fired`` counts the hooks
    that only observe."""

    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.hooked = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_out = nn.Conv2d(8, 4, 3, stride=2)
        self.fired: collections.Counter = collections.Counter()

    def forward(self, x):
        return self.conv_out(F.silu(self.hooked(F.silu(self.conv_in(x)))))


def _count(name: str, result=None):
    """A hook that counts its calls in its module's ``fired`` (the model's) and returns
    ``result``."""
    def hook(module, *args, **kwargs):
        module.fired[name] += 1
        return result
    return hook


def _hooked(adopt):
    torch.manual_seed(0)
    model = Hooked()
    conv = model.hooked
    conv.fired = model.fired
    conv.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    conv.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**kwargs}), with_kwargs=True
    )
    conv.register_forward_hook(lambda m, args, out: out + 1)
    conv.register_forward_hook(_count("forward, always"), always_call=True)
    conv.register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 0.5,))
    conv.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 3,))
    conv.weight.register_hook(lambda grad: grad * 2)
    conv.register_state_dict_pre_hook(_count("state_dict pre"))
    conv.register_state_dict_post_hook(
        lambda m, state, prefix, local: state.__setitem__(prefix + "extra", torch.ones(1))
    )
    conv.register_load_state_dict_pre_hook(
        lambda m, state, prefix, *rest: state.pop(prefix + "extra")
    )
    conv.register_load_state_dict_post_hook(_count("load_state_dict post"))
    _instance_forward(model.conv_out)
    return adopt(model.train())


def _instance_forward(module: nn.Module) -> None:
    """accelerate's ``add_hook_to_module`` (``module.forward`` replaced by a
    ``functools.partial`` of the hook around the class's), or the same by hand without
    accelerate."""
    try:
        from accelerate.hooks import ModelHook, add_hook_to_module
    except ImportError:
        original = module.forward

        def forward(x):
            return original(x * 0.5) - 1

        module.forward = functools.update_wrapper(functools.partial(forward), original)
        return

    class Shift(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] * 0.5,) + args[1:], kwargs

        def post_forward(self, module, output):
            return output - 1

    add_hook_to_module(module, Shift())


HOOKED = Case(
    build=_hooked,
    inputs=lambda: (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),),
    forward=lambda model, x: (model(x),),
)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(F.silu(self.conv2(F.silu(self.conv1(x)))))


def _lora(adopt, convert_first: bool):
    """peft LoRA on ``conv1`` and ``conv2`` (random B, so that the adapters contribute),
    applied to a converted model (``convert_first``), or converted after."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = SmallCNN()
    if convert_first:
        model = adopt(model)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["conv1", "conv2"], init_lora_weights=False,
    )
    model = peft.get_peft_model(model, config)
    return model.train() if convert_first else adopt(model.train())


def _lora_inputs():
    return (torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)


LORA_AFTER_CONVERT = Case(
    build=functools.partial(_lora, convert_first=True),
    inputs=_lora_inputs,
    forward=lambda model, x: (model(x),),
)
LORA_THEN_CONVERT = Case(
    build=functools.partial(_lora, convert_first=False),
    inputs=_lora_inputs,
    forward=lambda model, x: (model(x),),
)


#: The table's rows: a name, the case, and the paths it runs through.
CASES: Dict[str, Tuple[Case, Tuple[str, ...]]] = {
    "diffusers AutoencoderOobleck, decode + backward": (OOBLECK, PATHS),
    "HiFi-GAN-style vocoder (both weight norms, both spectral norms), train": (HIFIGAN, PATHS),
    "transformers Wav2Vec2Model, gradient checkpointing, train": (WAV2VEC2, PATHS),
    "diffusers AutoencoderKLWan 2.1, layerwise casting, decode": (WAN_LAYERWISE, PATHS),
    "hooks of every kind + accelerate instance forward, train": (HOOKED, PATHS),
    # Under enable() nothing is converted: the same run as the next case's.
    "peft LoRA applied after convert_, train": (LORA_AFTER_CONVERT, ("convert_",)),
    "peft LoRA, then convert_, train": (LORA_THEN_CONVERT, PATHS),
}


def _convs(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if _is_conv(m)]


def _same_classes(m: Measured) -> None:
    """Every module of the model is of its unconverted twin's class (a parametrized module's
    class is made for it by PyTorch: the class it was made from)."""
    def of(module):
        cls = type(module)
        return cls.__bases__[0] if nn.utils.parametrize.is_parametrized(module) else cls

    assert [of(a) for a in m.model.modules()] == [of(b) for b in m.reference.modules()]


@pytest.mark.parametrize("path", PATHS)
def test_oobleck_with_old_style_weight_norm(path):
    m = measure(OOBLECK, path)
    assert_matches(m, path)
    _same_classes(m)
    # Weight norm's pre-forward hook still computes the weight from weight_g and weight_v.
    for conv in _convs(m.model):
        assert "weight" not in conv._parameters and "weight_g" in conv._parameters
        assert any(type(h).__name__ == "WeightNorm" for h in conv._forward_pre_hooks.values())
    assert list(m.model.state_dict()) == list(m.reference.state_dict())


@pytest.mark.parametrize("path", PATHS)
def test_hifigan_vocoder_with_weight_norm_and_spectral_norm(path):
    m = measure(HIFIGAN, path)
    assert_matches(m, path)
    _same_classes(m)
    # Spectral norm's power iteration ran once per forward, as unconverted.
    state, expected = m.model.state_dict(), m.reference.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert relative_error(state[key], value) <= TOLERANCE, key
    assert nn.utils.parametrize.is_parametrized(m.model.mpd.convs[0], "weight")


@pytest.mark.parametrize("path", PATHS)
def test_wav2vec2_with_gradient_checkpointing(path):
    m = measure(WAV2VEC2, path)
    assert_matches(m, path)
    _same_classes(m)
    # The feature encoder's layers were recomputed in the backward, through mucudnn too.
    assert m.ran["fwd"] > len(_convs(m.model))
    conv = m.model.encoder.pos_conv_embed.conv
    assert nn.utils.parametrize.is_parametrized(conv, "weight")


@pytest.mark.parametrize("path", PATHS)
def test_wan_vae_with_layerwise_casting(path):
    m = measure(WAN_LAYERWISE, path)
    assert_matches(m, path)
    _same_classes(m)
    convs = _convs(m.model)
    assert len(convs) > 40
    for conv in convs:  # stored as the hook leaves them, the hook's instance forward kept
        assert conv.weight.dtype == torch.bfloat16 and "forward" in conv.__dict__


@pytest.mark.parametrize("path", PATHS)
def test_hooks_of_every_kind_and_an_instance_forward(path):
    m = measure(HOOKED, path)
    assert_matches(m, path)
    _same_classes(m)
    for model in (m.model, m.reference):
        state = model.state_dict()
        assert "hooked.extra" in state
        model.load_state_dict(state)
    assert m.model.fired == m.reference.fired
    assert set(m.model.fired) == {"forward, always", "state_dict pre", "load_state_dict post"}
    assert "forward" in m.model.conv_out.__dict__


def test_lora_applied_after_convert():
    """peft wraps converted convolutions: its ``type(base_layer)`` makes the adapters
    ``nn.Conv2d``, which run PyTorch's kernel (converted later, they run mucudnn's: the next
    test); the base layers keep running mucudnn's plans under their names at conversion."""
    m = measure(LORA_AFTER_CONVERT, "convert_")
    from peft.tuners.lora import Conv2d as LoraConv2d

    assert_matches(m, "convert_", left=True)
    _same_classes(m)
    inner = m.model.base_model.model
    for name in ("conv1", "conv2"):
        wrapper = getattr(inner, name)
        assert isinstance(wrapper, LoraConv2d)
        assert type(wrapper.base_layer) is nn.Conv2d and wrapper.base_layer._mucudnn.name == name
        assert type(wrapper.lora_A["default"]) is nn.Conv2d
        assert "_mucudnn" not in wrapper.lora_A["default"].__dict__
    assert set(m.names) == {"conv1", "conv2", "head"}


@pytest.mark.parametrize("path", PATHS)
def test_lora_then_convert(path):
    m = measure(LORA_THEN_CONVERT, path)
    assert_matches(m, path)
    _same_classes(m)
    # Merging writes the adapters into the base weights in place: the converted layers run
    # with the merged weights. (The reference merges in float64, which mucudnn leaves to
    # PyTorch: in fp32 a converted layer of its shape would claim its calls.)
    x = _lora_inputs()[0]
    switch = mt.enabled(**FAST) if path == "enable" else contextlib.nullcontext()
    with torch.no_grad(), switch:
        expected = m.reference.double().merge_and_unload()(x.double())
        merged = m.model.merge_and_unload()  # (its 3x3 adapters' delta is a convolution)
        mt.reset_account()
        got = merged(x)
        ran = sum(c["fwd"]["mucudnn"] for c in mt.account().values())
    assert relative_error(got, expected) <= TOLERANCE
    assert ran == 3


def test_an_unconverted_copy_runs_pytorchs_kernels():
    """timm's ``ModelEmaV3`` (and any training loop that keeps an evaluation copy) deep-copies
    the model; converting the model afterwards must leave the copy to PyTorch, exactly."""
    torch.manual_seed(0)
    model = SmallCNN()
    ema = copy.deepcopy(model)
    x = _lora_inputs()[0]
    with torch.no_grad():
        before = ema(x)
        mt.convert_(model, **FAST)
        mt.reset_account()
        after = ema(x)
    assert mt.account() == {}
    assert torch.equal(after, before)

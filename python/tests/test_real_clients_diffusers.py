"""Real clients: diffusers' VAEs, built from small configs with random weights (no download),
decode the same through ``convert_`` (their conv subclasses adopted: ``WanCausalConv3d``,
``QwenImageCausalConv3d``, ``CogVideoXSafeConv3d``) and through ``enabled()`` as unconverted,
within 1e-5 relative, compared before the final clamp (the decoder's own output), and
mucudnn's plans ran every convolution the decode used. At batch 1 with a tight limit and
``split="spatial"`` a decode equals the unsplit decode too."""

from __future__ import annotations

import copy
import gc
import json
import os
import re

import pytest
import torch

import mucudnn.torch as mt
from converted import NATIVE, converted_layers, fallbacks, plans_of
from real_clients import FAST, CountConvolutions, count_mucudnn_runs, relative_error
from test_torch_spatial import SCRIPTED_CACHE, scripted  # noqa: F401  (a fixture)

diffusers = pytest.importorskip("diffusers", reason="diffusers is in the test venv (scripts/test.sh)")


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _kl():
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    ), (1, 4, 8, 8)


def _wan21():
    return diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ), (1, 4, 2, 3, 3)


def _wan22():
    # Wan 2.2's 5B VAE topology: residual up blocks, a patchified 12-channel output.
    return diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ), (1, 4, 2, 2, 2)


def _qwen():
    return diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ), (1, 4, 1, 4, 4)


def _cogvideox():
    return diffusers.AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
        norm_num_groups=4, sample_height=32, sample_width=32,
    ), (1, 4, 2, 3, 3)


MODELS = {
    "AutoencoderKL": _kl,
    "AutoencoderKLWan-2.1": _wan21,
    "AutoencoderKLWan-2.2": _wan22,
    "AutoencoderKLQwenImage": _qwen,
    "AutoencoderKLCogVideoX": _cogvideox,
}
#: The conv subclass each VAE's convert_ adopts (None: plain nn.Conv2d only).
SUBCLASS = {
    "AutoencoderKL": None,
    "AutoencoderKLWan-2.1": "WanCausalConv3d",
    "AutoencoderKLWan-2.2": "WanCausalConv3d",
    "AutoencoderKLQwenImage": "QwenImageCausalConv3d",
    "AutoencoderKLCogVideoX": "CogVideoXSafeConv3d",
}


def build(name):
    torch.manual_seed(0)
    vae, latent_shape = MODELS[name]()
    return vae.eval(), torch.randn(latent_shape)


def decode(vae, z):
    """The decoder's outputs of ``vae.decode(z)`` (before any clamp), frames concatenated,
    with the number of convolutions the decode ran and of plans mucudnn executed."""
    outputs = []
    hook = vae.decoder.register_forward_hook(
        lambda module, args, out: outputs.append(
            (out[0] if isinstance(out, tuple) else out).detach().clone()
        )
    )
    try:
        with torch.no_grad(), count_mucudnn_runs() as runs, CountConvolutions() as seen:
            vae.decode(z)
    finally:
        hook.remove()
    out = torch.cat(outputs, 2) if outputs[0].dim() == 5 else outputs[0]
    return out, seen.calls, runs[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_through_convert_and_enable_matches_unconverted(name):
    vae, z = build(name)
    expected, total, none = decode(vae, z)
    assert total > 0 and none == 0

    converted = mt.convert_(copy.deepcopy(vae), **FAST)
    keys = list(vae.state_dict())
    assert list(converted.state_dict()) == keys
    subclass = SUBCLASS[name]
    adopted = [m for m in converted.modules() if type(m).__name__ == subclass]
    if subclass is not None:
        user_class = next(type(m) for m in vae.modules() if type(m).__name__ == subclass)
        assert adopted and all(isinstance(m, user_class) for m in adopted)
    out, counted, ran = decode(converted, z)
    assert relative_error(out, expected) <= 1e-5, name
    assert ran == total, f"{name}: mucudnn ran {ran} of {total} convolutions"
    # On the Python path the count mode sits under the converted modules' own, so it sees
    # the convolutions mucudnn did not take (the reference run counted every one); the native
    # path's account says what its layers left to PyTorch.
    if not NATIVE:
        assert counted == 0, f"{name}: {counted} convolutions reached PyTorch"
    assert fallbacks() == {}, f"{name}: {fallbacks()}"
    if subclass is not None:  # the adopted modules report their plans as mucudnn's layers
        assert any(len(plans_of(module)) for module in adopted)

    convert_error = relative_error(out, expected)
    convert_runs = ran
    # The switch alone from here: no converted layer left to claim the calls (native path).
    # A layer of the same options keeps their plans and in-memory measurements for it.
    keeper = mt.Conv2d(1, 1, 1, **FAST)  # noqa: F841
    del converted, adopted
    gc.collect()
    mt.reset_account()
    with mt.enabled(**FAST) as mode:
        out, _, ran = decode(vae, z)
    # Named by their problems: the switch ran them.
    assert all(re.match(r"conv(_transpose)?[123]d_\d", n) for n in mt.account()), mt.account()
    path = os.environ.get("MUCUDNN_CLIENTS_TABLE")
    if path:  # docs/pytorch.md's table
        with open(path, "a") as f:
            f.write(json.dumps({
                "model": name, "class": subclass, "output_error": convert_error,
                "enabled_output_error": relative_error(out, expected), "total": total,
                "convert_runs": convert_runs, "enabled_runs": ran,
            }) + "\n")
    assert relative_error(out, expected) <= 1e-5, name
    assert ran == total and mode.calls == total, f"{name}: {ran}, {mode.calls} of {total}"


class Decoding(torch.nn.Module):
    """``vae.decode`` as a module's forward (what tune()'s discovery pass runs)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z)


@pytest.mark.parametrize("name", ["AutoencoderKL", "AutoencoderKLWan-2.1"])
def test_spatial_split_decode_is_exact(name, scripted, tmp_path):  # noqa: F811
    """Batch 1, a workspace limit too small for any unsplit im2col, split="spatial" (with
    test_torch_spatial's scripted measurements, where small chunks win): the layers run in
    chunks of rows, and the decode equals the unsplit one."""
    vae, z = build(name)
    expected, total, _ = decode(vae, z)
    converted = mt.convert_(
        copy.deepcopy(vae), cache=str(tmp_path / SCRIPTED_CACHE), policy="power-of-two",
        split="spatial", workspace_limit="4KiB", fallback=False,
    )
    scripted(Decoding(converted), z)
    out, _, ran = decode(converted, z)
    assert ran == total
    assert relative_error(out, expected) <= 1e-5
    spatial = [
        report for m in converted_layers(converted)
        for report in plans_of(m).values() if report.spatial_ops
    ]
    assert spatial and all(r.ops["fwd"]["calls"] >= 1 for r in spatial)
    assert any(r.ops["fwd"]["calls"] >= 2 for r in spatial)

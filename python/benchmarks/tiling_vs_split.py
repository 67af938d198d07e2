#!/usr/bin/env python3
"""How far diffusers' ``enable_tiling()`` and mucudnn's spatial split are from the untiled,
unsplit decode (a measurement, not a test), on the CPU in fp32, random weights (no download).

- ``AutoencoderKL`` (SD/SDXL topology at small width: block_out_channels 32, 64, 64; 8
  channels per group; two upsamplers), ``sample_size=64``, so diffusers decodes a 32x32
  latent (128x128 image) in tiles of 16x16 latents with its overlap and blending;
- ``AutoencoderKLWan`` (Wan 2.1 topology, base_dim 16) decoding 3 latent frames of 32x32 with
  tiles of 128x128 pixels (stride 96).

mucudnn: ``convert_(split="spatial", workspace_limit=...)`` at batch 1, tuned on this machine;
every layer's forward runs chunks of rows where its plan chose them.

usage: python3 python/benchmarks/tiling_vs_split.py [--limit 64KiB]
Prints one line per model: max |tiled - untiled| / max |untiled| and the same for mucudnn,
with how many layers ran two or more chunks.
"""

from __future__ import annotations

import argparse
import copy

import torch

import mucudnn.torch as mt


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def split_layers(model) -> str:
    reports = [
        r for m in model.modules() if isinstance(m, mt._layer._MucudnnConv)
        for r in m.plans.values() if r.fallback is None
    ]
    chunked = sum(1 for r in reports if r.ops["fwd"]["dimension"] == "spatial" and r.ops["fwd"]["calls"] >= 2)
    return f"{chunked} of {len(reports)} layer shapes in >= 2 chunks"


def kl():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(32, 64, 64), norm_num_groups=8, latent_channels=4,
        layers_per_block=1, sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    ).eval()
    return vae, torch.randn(1, 4, 32, 32), {}


def wan():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()
    tiling = dict(tile_sample_min_height=128, tile_sample_min_width=128,
                  tile_sample_stride_height=96, tile_sample_stride_width=96)
    return vae, torch.randn(1, 4, 3, 32, 32), tiling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", default="64KiB")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name, make in (("AutoencoderKL", kl), ("AutoencoderKLWan 2.1", wan)):
        vae, z, tiling = make()
        with torch.no_grad():
            untiled = vae.decode(z).sample
            tiled_vae = copy.deepcopy(vae)
            tiled_vae.enable_tiling(**tiling)
            tiled = tiled_vae.decode(z).sample
            ours = mt.convert_(
                copy.deepcopy(vae), cache=False, split="spatial", workspace_limit=args.limit,
                fallback=False,
            )
            split = ours.decode(z).sample
        print(
            f"{name}: latent {tuple(z.shape)} -> {tuple(untiled.shape)}; enable_tiling() "
            f"{relative(tiled, untiled):.2e}; mucudnn split='spatial' at {args.limit} "
            f"{relative(split, untiled):.2e} ({split_layers(ours)})"
        )


if __name__ == "__main__":
    main()

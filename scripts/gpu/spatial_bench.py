#!/usr/bin/env python3
"""GPU acceptance of spatial splits at batch 1, one run, mucudnn against PyTorch:

1. sdxl: the convolutions of Stable Diffusion's / SDXL's image VAE decoder decoding a
   2048x2048 image untiled (the zoo's `sdxl_vae_decoder`: latent 256x256, 36 Conv2d, 13
   distinct; its full-resolution layers hold 128 or 256 channels of 2048x2048, 1 or 2 GiB in
   fp16 each), fp16 NHWC (channels_last).
2. wan: the convolutions of Wan 2.1's VAE decoder as diffusers decodes 17 frames of 480x832
   (the zoo's `wan21_vae_decoder`), fp16 NDHWC (channels_last_3d; its per-frame Conv2d layers
   channels_last).

Shapes come from `mucudnn tune --list --json` (one source for them). Batch 1, forward only
(inference, no_grad: each layer tunes its forward op alone). Each distinct layer is built as a
torch convolution and timed (CUDA events, median of 5 after warm-up), weighted by its count:
the decode's convolution time. Variants, in one process: PyTorch with
``torch.backends.cudnn.benchmark = True`` and its default workspace, then the same layers
converted with ``mucudnn.torch.convert_(model, workspace_limit=L, split="auto")`` for L = 64
MiB, 256 MiB and 1 GiB per layer (tuned first through one cache, tuning time reported).
Recorded per variant: the total time, the peak memory allocated beyond the inputs and weights
(``torch.cuda.max_memory_allocated``; per layer and the largest), the device's peak use
sampled with ``torch.cuda.mem_get_info``, the tuning time, which layers got spatial plans (the
forward's split string of the layer's plan report, `... along h` / `... along d`), and the
largest relative difference from PyTorch's outputs. The goal, reported, not a
failure: at 256 MiB per layer no slower than PyTorch, with peak memory below it.

usage: spatial_bench.py OUT_DIR [--parts sdxl,wan] [--mucudnn BIN] [--max-candidates N]
                        [--split auto|spatial|batch] [--smoke]
--smoke runs the same code on the CPU at a tiny size (the image decoder at 64x64, channels /
32; the video decoder at 5x16x16, channels / 24; fp32) to check the script itself.
Writes OUT_DIR/spatial_bench.json (after every variant, so a run cut short leaves what it
measured) and prints a table last; exits non-zero when a variant fails, tunes more than the
forward, or differs from PyTorch beyond the tolerance (2e-2 in fp16).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

import mucudnn.torch as mt

# The shared parts lie next to this script (scripts/gpu/ here, .gpu/ on the GPU machine).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Clock, add_arguments, device_setup, fallback_layers,  # noqa: E402
                          goal, layer_errors, layer_plans, limits_of, mib, mucudnn_binary,
                          report_header, time_layers, tune_forward, zoo_convolutions,
                          zoo_layers)

LIMITS = ("64MiB", "256MiB", "1GiB")
GOAL_LIMIT = "256MiB"
# (part, zoo model, layout, full-size extra arguments, smoke extra arguments)
PARTS = {
    "sdxl": ("sdxl_vae_decoder", "nhwc", [], ["--input", "64x64", "--channel-divisor", "32"]),
    "wan": ("wan21_vae_decoder", "ndhwc", [], ["--input", "5x16x16", "--channel-divisor", "24"]),
}
TITLES = {"sdxl": "SDXL VAE decoder convs (fwd)",
          "wan": "Wan VAE decoder convs (fwd)"}


def fwd_split(module):
    """The forward's split string of the module's (one) input shape, or its fallback."""
    for report in layer_plans(module).values():
        if report.fallback is not None:
            return f"fallback: {report.fallback}"
        if "fwd" in report.ops:
            return report.ops["fwd"]["split"]
    return None


def bench_part(args, part, device, dtype, clock, report, write):
    model_name, layout, full, smoke = PARTS[part]
    layers = zoo_layers(args.mucudnn, model_name, 1, args.dtype_name, layout,
                        smoke if args.smoke else full)
    # Layers of one input shape share one input (the 2048x2048 ones are 1-2 GiB each).
    modules, inputs, counts, names = zoo_convolutions(layers, device, dtype, share_inputs=True)
    rows, reference = [], None
    report[part] = dict(model=model_name, layers=len(layers), convolutions=sum(counts),
                        split=args.split, rows=rows)
    for variant in ("pytorch",) + args.limit_list:
        started_variant = time.perf_counter()
        model = modules if variant == "pytorch" else mt.convert_(
            copy.deepcopy(modules), workspace_limit=variant, split=args.split, cache=args.cache,
            max_candidates=args.max_candidates)
        model.eval()
        tuning, tuned_ops, splits = 0.0, [], [None] * len(layers)
        with torch.no_grad():
            if variant != "pytorch":
                tuning, tuned_ops = tune_forward(model, inputs, clock)
                splits = [fwd_split(m) for m in model]
            per_layer, peaks, peak, device_peak = time_layers(model, inputs, clock)
            # Outputs against PyTorch's (kept on the host), one layer at a time.
            error, reference = layer_errors(model, inputs, reference, device)
        total = sum(ms * count for ms, count in zip(per_layer, counts))
        spatial = [n for n, s in zip(names, splits) if s is not None and " along " in s]
        rows.append(dict(
            variant=variant, total_ms=total, peak_extra_mib=peak, device_peak_mib=device_peak,
            tuning_s=tuning, seconds=time.perf_counter() - started_variant, tuned_ops=tuned_ops,
            max_rel_err=error, spatial_layers=spatial,
            fallbacks=[] if variant == "pytorch" else fallback_layers(model),
            layers=[dict(layer=n, count=c, ms=ms, peak_extra_mib=p, split=s)
                    for n, c, ms, p, s in zip(names, counts, per_layer, peaks, splits)]))
        peak_text = "-" if peak is None else f"{peak:.0f} MiB"
        print(f"{part} {variant:<8} {total:10.2f} ms  peak {peak_text}  tuning {tuning:.1f} s  "
              f"spatial {len(spatial)}/{len(layers)}  err {error:.2e}", flush=True)
        if variant != "pytorch":
            del model
        write()
    report[part]["goal_at_256MiB"] = goal(rows, GOAL_LIMIT, "total_ms", True)
    write()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "sdxl,wan")
    parser.add_argument("--split", default="auto", choices=("auto", "spatial", "batch"),
                        help="convert_'s split (default auto, what the acceptance measures)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown} (expected some of {', '.join(PARTS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache = str(args.out / "spatial_bench_cache.sqlite")
    args.mucudnn = mucudnn_binary(args.mucudnn)
    # fp32 on the CPU for --smoke, else fp16 with cudnn.benchmark on.
    device, dtype, args.dtype_name, tolerance = device_setup(args.smoke)
    clock = Clock(device)
    args.limit_list = limits_of(args, LIMITS)
    report = {**report_header(device, args.smoke, args.limit_list), "goal_limit": GOAL_LIMIT,
              "max_candidates": args.max_candidates, "failures": []}
    path = args.out / "spatial_bench.json"

    def write():
        path.write_text(json.dumps(report, indent=1))

    started = time.perf_counter()
    for part in parts:
        bench_part(args, part, device, dtype, clock, report, write)
    failures = [f"{part} {r['variant']}: max_rel_err {r['max_rel_err']:.2e} > {tolerance}"
                for part in parts for r in report[part]["rows"] if r["max_rel_err"] > tolerance]
    # Inference: tuning the backward ops would triple the tuning time.
    failures += [f"{part} {r['variant']}: tuned {r['tuned_ops']}, not the forward alone"
                 for part in parts for r in report[part]["rows"]
                 if r["variant"] != "pytorch" and r["tuned_ops"] != ["fwd"]]
    failures += [f"{part} {r['variant']}: fallback to PyTorch's convolution: {f}"
                 for part in parts for r in report[part]["rows"] for f in r["fallbacks"]]
    report["failures"] = failures
    report["seconds"] = time.perf_counter() - started
    write()
    print()
    print(f"{'workload':<36} {'variant':<8} {'ms':>10} {'peak MiB':>9} {'device MiB':>10} "
          f"{'tuning s':>9} {'spatial':>8}")
    for part in parts:
        rows = report[part]["rows"]
        for r in rows:
            peak, dev = mib(r["peak_extra_mib"]), mib(r["device_peak_mib"])
            spatial = "-" if r["variant"] == "pytorch" else (
                f"{len(r['spatial_layers'])}/{report[part]['layers']}")
            print(f"{TITLES[part]:<36} {r['variant']:<8} {r['total_ms']:10.2f} {peak:>9} "
                  f"{dev:>10} {r['tuning_s']:9.1f} {spatial:>8}")
        g = report[part]["goal_at_256MiB"]
        if g is None:
            print("  goal at 256 MiB: not measured (--limits)")
        else:
            print(f"  goal at 256 MiB: not slower {g['not_slower']}, peak memory below "
                  f"{g['memory_below']}")
        for r in rows:
            for layer in r["layers"]:
                if layer["split"] is not None and " along " in layer["split"]:
                    print(f"  {r['variant']:<8} {layer['layer']}: {layer['split']}")
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

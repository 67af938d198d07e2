#!/usr/bin/env python3
"""GPU acceptance of 3-D convolutions, one run, mucudnn against PyTorch:

1. vae: the convolutions of Wan 2.1's VAE decoder as diffusers decodes 17 frames of 480x832
   (the zoo's `wan21_vae_decoder`, read from `mucudnn tune --list --json`: one source for the
   shapes), batch 1, fp16, NDHWC (channels_last_3d; its per-frame Conv2d layers channels_last),
   forward only (inference, no_grad: each layer tunes its forward op alone, a third of the
   training tuning; the rows record the ops tuned, `tuned_ops`). Each distinct layer is timed
   (CUDA events, median of 5 after warm-up) and weighted by its count: the decode's
   convolution time.
2. r3d: torchvision's r3d_18 training steps (batch 8, 3x16x112x112, fp16 channels_last_3d,
   forward + backward, cross-entropy), torchvision's model when it is installed, else the same
   network defined here.

Each runs as PyTorch with ``torch.backends.cudnn.benchmark = True`` and its default workspace,
then converted with ``mucudnn.torch.convert_(model, workspace_limit=L)`` for L = 256 MiB and
1 GiB per layer (tuned first through one cache, tuning time reported), in the same process.
Recorded: time, peak memory allocated beyond the inputs and weights
(``torch.cuda.max_memory_allocated``), the device's peak use sampled with
``torch.cuda.mem_get_info``, and the largest relative difference from PyTorch's outputs. The
goal: at 1 GiB per layer no slower than PyTorch, with peak memory at or below it.

usage: nd_bench.py OUT_DIR [--parts vae,r3d] [--mucudnn BIN] [--max-candidates N] [--smoke]
--smoke runs both on the CPU at a tiny size (the VAE decoder at 5x16x16, channels / 24; r3d_18
at 4x16x16, channels / 16, batch 2; fp32) to check the script itself.
Writes OUT_DIR/nd_bench.json and prints a table last; exits non-zero when a variant fails or
differs from PyTorch beyond the tolerance (a missed speed or memory goal is reported, not a
failure).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt

# The shared parts lie next to this script (scripts/gpu/ here, .gpu/ on the GPU machine).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (Clock, add_arguments, channels_last, device_setup,  # noqa: E402
                          fallback_layers, goal, layer_errors, limits_of, mib, mucudnn_binary,
                          relative_error, report_header, time_layers, tune_forward,
                          zoo_convolutions, zoo_layers)

LIMITS = ("256MiB", "1GiB")


# ------------------------------------------------------------------------------------------
# Shapes and models


class BasicBlock3d(nn.Module):
    """torchvision's video BasicBlock with Conv3DSimple (3x3x3, padding 1)."""

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv3d(cin, planes, 3, stride, 1, bias=False),
                                   nn.BatchNorm3d(planes), nn.ReLU(inplace=True))
        self.conv2 = nn.Sequential(nn.Conv3d(planes, planes, 3, 1, 1, bias=False),
                                   nn.BatchNorm3d(planes))
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv3d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm3d(planes))

    def forward(self, x):
        y = self.conv2(self.conv1(x))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class R3d18(nn.Module):
    """torchvision.models.video.r3d_18's structure at any width (64 is torchvision's)."""

    def __init__(self, width=64, classes=400):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, width, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                                  nn.BatchNorm3d(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for multiple, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            planes = width * multiple
            layers.append(nn.Sequential(BasicBlock3d(cin, planes, stride),
                                        BasicBlock3d(planes, planes, 1)))
            cin = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(x.mean(dim=(2, 3, 4)))


def r3d_18(width):
    if width == 64:
        try:
            from torchvision.models.video import r3d_18 as torchvision_r3d_18
            return torchvision_r3d_18(), "torchvision.models.video.r3d_18"
        except ImportError:
            pass
    return R3d18(width), f"R3d18(width={width}) defined in nd_bench.py"


# ------------------------------------------------------------------------------------------
# Measuring


def bench_vae(args, device, dtype, clock, report):
    layers = zoo_layers(args.mucudnn, "wan21_vae_decoder", 1, args.dtype_name, "ndhwc",
                        args.vae_extra)
    modules, inputs, counts, names = zoo_convolutions(layers, device, dtype)
    rows, reference = [], None
    for variant in ("pytorch",) + args.limit_list:
        # split="batch": batch 1 has no micro-batches, so these are the undivided plans; the
        # spatial part (spatial_bench.py) covers split="auto".
        model = modules if variant == "pytorch" else mt.convert_(
            copy.deepcopy(modules), workspace_limit=variant, split="batch", cache=args.cache,
            max_candidates=args.max_candidates)
        model.eval()
        tuning = 0.0
        tuned_ops = []
        with torch.no_grad():
            if variant != "pytorch":
                # Inference: the forward op alone (no backward tuning, nothing measured for it).
                tuning, tuned_ops = tune_forward(model, inputs, clock)
            per_layer, _, peak, device_peak = time_layers(model, inputs, clock)
            # Outputs against PyTorch's (kept on the host), one layer at a time.
            error, reference = layer_errors(model, inputs, reference, device)
        total = sum(ms * count for ms, count in zip(per_layer, counts))
        rows.append(dict(variant=variant, total_ms=total, peak_extra_mib=peak,
                         device_peak_mib=device_peak, tuning_s=tuning, tuned_ops=tuned_ops,
                         max_rel_err=error,
                         fallbacks=[] if variant == "pytorch" else fallback_layers(model),
                         layers=[dict(layer=n, count=c, ms=ms)
                                 for n, c, ms in zip(names, counts, per_layer)]))
        print(f"vae {variant:<8} {total:10.2f} ms  peak {peak} MiB  err {error:.2e}", flush=True)
        if variant != "pytorch":
            del model
    report["vae"] = dict(layers=len(layers), convolutions=sum(counts), rows=rows)


def bench_r3d(args, device, dtype, clock, report):
    torch.manual_seed(0)
    base, source = r3d_18(args.r3d_width)
    base = base.to(device=device, dtype=dtype).to(memory_format=torch.channels_last_3d)
    x = channels_last(torch.randn(args.r3d_batch, 3, *args.r3d_clip, device=device).to(dtype))
    target = torch.randint(0, 10, (args.r3d_batch,), device=device)
    rows, reference, reference_grads = [], None, None
    # A few weight gradients beside the loss: the stem, one in the middle, the last conv.
    convs = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Conv3d)]
    checked = [convs[0], convs[len(convs) // 2], convs[-1]]
    for variant in ("pytorch",) + args.limit_list:
        model = copy.deepcopy(base)
        tuning = 0.0
        if variant != "pytorch":
            mt.convert_(model, workspace_limit=variant, cache=args.cache,
                        max_candidates=args.max_candidates)
            started = time.perf_counter()
            mt.tune(model, x, verbose=False)
            tuning = time.perf_counter() - started
        model.train()
        # The first step's loss against PyTorch's, from the same weights.
        loss0 = F.cross_entropy(model(x).float()[:, :10], target)
        loss0.backward()
        modules = dict(model.named_modules())
        grads = [modules[n].weight.grad.detach().float().cpu() for n in checked]
        model.zero_grad(set_to_none=True)

        def step():
            loss = F.cross_entropy(model(x).float()[:, :10], target)
            loss.backward()

        clock.reset()
        ms = clock.time_ms(step, repeats=5, warmup=2)
        peak, device_peak = clock.memory()
        loss0 = loss0.item()
        error = 0.0 if reference is None else abs(loss0 - reference) / max(abs(reference), 1e-12)
        reference = loss0 if reference is None else reference
        grad_error = 0.0 if reference_grads is None else max(
            relative_error(g, r) for g, r in zip(grads, reference_grads))
        reference_grads = grads if reference_grads is None else reference_grads
        rows.append(dict(variant=variant, step_ms=ms, peak_extra_mib=peak,
                         device_peak_mib=device_peak, tuning_s=tuning, loss_rel_err=error,
                         grad_rel_err=grad_error, grads_checked=checked,
                         fallbacks=[] if variant == "pytorch" else fallback_layers(model)))
        print(f"r3d {variant:<8} {ms:10.2f} ms/step  peak {peak} MiB  loss err {error:.2e}  "
              f"weight-gradient err {grad_error:.2e}", flush=True)
        del model
    report["r3d"] = dict(model=source, batch=args.r3d_batch, clip=list(args.r3d_clip), rows=rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "vae,r3d")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache = str(args.out / "nd_bench_cache.sqlite")
    args.mucudnn = mucudnn_binary(args.mucudnn)
    # fp32 on the CPU for --smoke, else fp16 with cudnn.benchmark on.
    device, dtype, args.dtype_name, tolerance = device_setup(args.smoke)
    if args.smoke:
        args.vae_extra = ["--input", "5x16x16", "--channel-divisor", "24"]
        args.r3d_width, args.r3d_batch, args.r3d_clip = 4, 2, (4, 16, 16)
    else:
        args.vae_extra = []
        args.r3d_width, args.r3d_batch, args.r3d_clip = 64, 8, (16, 112, 112)
    clock = Clock(device)
    args.limit_list = limits_of(args, LIMITS)
    report = report_header(device, args.smoke, args.limit_list)
    parts = args.parts.split(",")
    if "vae" in parts:
        bench_vae(args, device, dtype, clock, report)
        report["vae"]["goal_at_1GiB"] = goal(report["vae"]["rows"], "1GiB", "total_ms", False)
    if "r3d" in parts:
        bench_r3d(args, device, dtype, clock, report)
        report["r3d"]["goal_at_1GiB"] = goal(report["r3d"]["rows"], "1GiB", "step_ms", False)
    failures = [f"{part} {r['variant']}: {key} {r[key]:.2e} > {tolerance}"
                for part, key in (("vae", "max_rel_err"), ("r3d", "loss_rel_err"),
                                  ("r3d", "grad_rel_err"))
                if part in report for r in report[part]["rows"] if r[key] > tolerance]
    failures += [f"{part} {r['variant']}: fallback to PyTorch's convolution: {f}"
                 for part in ("vae", "r3d") if part in report
                 for r in report[part]["rows"] for f in r["fallbacks"]]
    # The decoder runs under no_grad: tuning the backward ops would triple its tuning time.
    failures += [f"vae {r['variant']}: tuned {r['tuned_ops']}, not the forward alone"
                 for r in report.get("vae", {}).get("rows", [])
                 if r["variant"] != "pytorch" and r["tuned_ops"] != ["fwd"]]
    report["failures"] = failures
    (args.out / "nd_bench.json").write_text(json.dumps(report, indent=1))
    print()
    print(f"{'workload':<34} {'variant':<8} {'ms':>10} {'peak MiB':>9} {'device MiB':>10} "
          f"{'tuning s':>9}")
    for part, key, what in (("vae", "total_ms", "VAE decoder convs (fwd, per decode)"),
                            ("r3d", "step_ms", "r3d_18 training step")):
        if part not in report:
            continue
        for r in report[part]["rows"]:
            peak, dev = mib(r["peak_extra_mib"]), mib(r["device_peak_mib"])
            print(f"{what:<34} {r['variant']:<8} {r[key]:10.2f} {peak:>9} {dev:>10} "
                  f"{r['tuning_s']:9.1f}")
        g = report[part]["goal_at_1GiB"]
        if g is None:
            print("  goal at 1 GiB: not measured (--limits)")
            continue
        print(f"  goal at 1 GiB: not slower {g['not_slower']}, memory at or below "
              f"{g['memory_at_or_below']}")
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

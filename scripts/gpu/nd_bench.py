#!/usr/bin/env python3
"""GPU acceptance of 3-D convolutions (issue 26), one run, mucudnn against PyTorch:

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
goal (issue 26): at 1 GiB per layer no slower than PyTorch, with peak memory at or below it.

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
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt

LIMITS = ("256MiB", "1GiB")


# ------------------------------------------------------------------------------------------
# Shapes and models


def zoo_layers(binary, model, batch, dtype, layout, extra):
    """The zoo model's distinct layers, as `mucudnn tune --list --json` gives them."""
    command = [binary, "tune", "--model", model, "--batch", str(batch), "--dtype", dtype,
               "--layout", layout, "--list", "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)["layers"]


def conv_for(problem):
    """The torch layer of a problem: Conv3d when it has depth fields, else Conv2d."""
    three = any(key in problem for key in ("d", "t", "pad_d", "stride_d", "dilation_d"))
    if three:
        return nn.Conv3d(
            problem["c"], problem["k"], (problem.get("t", 1), problem["r"], problem["s"]),
            stride=(problem.get("stride_d", 1), problem["stride_h"], problem["stride_w"]),
            padding=(problem.get("pad_d", 0), problem["pad_h"], problem["pad_w"]),
            dilation=(problem.get("dilation_d", 1), problem["dilation_h"], problem["dilation_w"]),
            groups=problem["groups"], bias=False), (problem["n"], problem["c"], problem.get("d", 1),
                                                    problem["h"], problem["w"])
    return nn.Conv2d(
        problem["c"], problem["k"], (problem["r"], problem["s"]),
        stride=(problem["stride_h"], problem["stride_w"]),
        padding=(problem["pad_h"], problem["pad_w"]),
        dilation=(problem["dilation_h"], problem["dilation_w"]),
        groups=problem["groups"], bias=False), (problem["n"], problem["c"], problem["h"], problem["w"])


def channels_last(tensor):
    return tensor.contiguous(memory_format=torch.channels_last_3d if tensor.dim() == 5
                             else torch.channels_last)


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


class Clock:
    """CUDA events on a GPU, the host clock on the CPU; memory from the caching allocator and
    the device (mem_get_info), sampled at `sample()`."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.min_free = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, repeats=5, warmup=2):
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - started) * 1e3)
            self.sample()
        return statistics.median(samples)

    def reset(self):
        if self.cuda:
            self.sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        self.min_free = None

    def sample(self):
        if self.cuda:
            free, _ = torch.cuda.mem_get_info()
            self.min_free = free if self.min_free is None else min(self.min_free, free)

    def memory(self):
        """(peak allocated beyond what was allocated at reset, peak device use) in MiB."""
        if not self.cuda:
            return None, None
        self.sync()
        self.sample()
        _, total = torch.cuda.mem_get_info()
        return ((torch.cuda.max_memory_allocated() - self.base) / 2**20,
                (total - self.min_free) / 2**20)


def relative_error(ours, reference):
    ours, reference = ours.float(), reference.float()
    return ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()


def bench_vae(args, device, dtype, clock, report):
    layers = zoo_layers(args.mucudnn, "wan21_vae_decoder", 1, args.dtype_name, "ndhwc",
                        args.vae_extra)
    torch.manual_seed(0)
    modules, inputs, counts, names = nn.ModuleList(), [], [], []
    for layer in layers:
        conv, shape = conv_for(layer["problem"])
        modules.append(conv)
        inputs.append(channels_last(torch.randn(*shape, device=device).to(dtype)))
        counts.append(layer["count"])
        names.append(layer["layer"])
    modules = modules.to(device=device, dtype=dtype)
    for m, x in zip(modules, inputs):
        m.to(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
    rows, reference = [], None
    for variant in ("pytorch",) + LIMITS:
        model = modules if variant == "pytorch" else mt.convert_(
            copy.deepcopy(modules), workspace_limit=variant, cache=args.cache,
            max_candidates=args.max_candidates)
        model.eval()
        tuning = 0.0
        tuned_ops = []
        with torch.no_grad():
            if variant != "pytorch":
                started = time.perf_counter()
                for m, x in zip(model, inputs):  # tunes each shape's forward on first sight
                    m(x)
                clock.sync()
                tuning = time.perf_counter() - started
                # Inference: the forward op alone (no backward tuning, nothing measured for it).
                tuned_ops = sorted({op for m in model for r in m.plans.values()
                                    for op in r.tuned_ops})
            clock.reset()
            per_layer = []
            for m, x in zip(model, inputs):
                per_layer.append(clock.time_ms(lambda: m(x)))
            peak, device_peak = clock.memory()
            # Outputs against PyTorch's (kept on the host), one layer at a time.
            error = 0.0
            outputs = []
            for index, (m, x) in enumerate(zip(model, inputs)):
                out = m(x).cpu()
                if reference is None:
                    outputs.append(out)
                else:
                    error = max(error, relative_error(out, reference[index]))
            if reference is None:
                reference = outputs
        total = sum(ms * count for ms, count in zip(per_layer, counts))
        rows.append(dict(variant=variant, total_ms=total, peak_extra_mib=peak,
                         device_peak_mib=device_peak, tuning_s=tuning, tuned_ops=tuned_ops,
                         max_rel_err=error,
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
    rows, reference = [], None
    for variant in ("pytorch",) + LIMITS:
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
        rows.append(dict(variant=variant, step_ms=ms, peak_extra_mib=peak,
                         device_peak_mib=device_peak, tuning_s=tuning, loss_rel_err=error))
        print(f"r3d {variant:<8} {ms:10.2f} ms/step  peak {peak} MiB  loss err {error:.2e}",
              flush=True)
        del model
    report["r3d"] = dict(model=source, batch=args.r3d_batch, clip=list(args.r3d_clip), rows=rows)


def goal(rows, time_key):
    """At 1 GiB per layer: no slower than PyTorch, peak memory at or below it."""
    by = {r["variant"]: r for r in rows}
    ours, torch_row = by["1GiB"], by["pytorch"]
    faster = ours[time_key] <= torch_row[time_key]
    memory = (None if ours["peak_extra_mib"] is None
              else ours["peak_extra_mib"] <= torch_row["peak_extra_mib"])
    return dict(not_slower=faster, memory_at_or_below=memory,
                speedup=torch_row[time_key] / ours[time_key] if ours[time_key] else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", default="vae,r3d")
    parser.add_argument("--mucudnn", default=None,
                        help="the mucudnn binary (default: .gpu/mucudnn, else on PATH)")
    parser.add_argument("--max-candidates", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache = str(args.out / "nd_bench_cache.sqlite")
    if args.mucudnn is None:
        args.mucudnn = ".gpu/mucudnn" if os.path.exists(".gpu/mucudnn") else shutil.which("mucudnn")
    if args.mucudnn is None:
        raise SystemExit("no mucudnn binary: pass --mucudnn (build.sh puts one in .gpu/)")
    if args.smoke:
        device, dtype, args.dtype_name = torch.device("cpu"), torch.float32, "fp32"
        args.vae_extra = ["--input", "5x16x16", "--channel-divisor", "24"]
        args.r3d_width, args.r3d_batch, args.r3d_clip = 4, 2, (4, 16, 16)
        tolerance = 1e-3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on the CPU")
        device, dtype, args.dtype_name = torch.device("cuda"), torch.float16, "fp16"
        args.vae_extra = []
        args.r3d_width, args.r3d_batch, args.r3d_clip = 64, 8, (16, 112, 112)
        tolerance = 2e-2  # fp16: algorithms round differently
        torch.backends.cudnn.benchmark = True
    clock = Clock(device)
    report = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "smoke": args.smoke, "limits": list(LIMITS)}
    parts = args.parts.split(",")
    if "vae" in parts:
        bench_vae(args, device, dtype, clock, report)
        report["vae"]["goal_at_1GiB"] = goal(report["vae"]["rows"], "total_ms")
    if "r3d" in parts:
        bench_r3d(args, device, dtype, clock, report)
        report["r3d"]["goal_at_1GiB"] = goal(report["r3d"]["rows"], "step_ms")
    failures = [f"{part} {r['variant']}: {key} {r[key]:.2e} > {tolerance}"
                for part, key in (("vae", "max_rel_err"), ("r3d", "loss_rel_err"))
                if part in report for r in report[part]["rows"] if r[key] > tolerance]
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
            peak = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
            dev = "-" if r["device_peak_mib"] is None else f"{r['device_peak_mib']:.0f}"
            print(f"{what:<34} {r['variant']:<8} {r[key]:10.2f} {peak:>9} {dev:>10} "
                  f"{r['tuning_s']:9.1f}")
        g = report[part]["goal_at_1GiB"]
        print(f"  goal at 1 GiB: not slower {g['not_slower']}, memory at or below "
              f"{g['memory_at_or_below']}")
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

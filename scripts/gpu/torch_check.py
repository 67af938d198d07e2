#!/usr/bin/env python3
"""GPU acceptance of the PyTorch package (issue 15), one run:

1. correctness: converted AlexNet (conv part) and ResNet-50 against the same models with
   PyTorch's convolutions (outputs and parameter gradients), fp32 NCHW (TF32 off on both
   sides... mucudnn tunes in cuDNN's default math, so fp32 is compared within TF32 error) and
   fp16 channels_last;
2. speed and memory: the step time (forward + backward, CUDA events, median of 5 loops of 5
   steps after warm-up) of the converted model at 8, 64 and 256 MiB per layer against the
   same model with ``torch.backends.cudnn.benchmark = True`` and no limit, with peak memory
   from ``torch.cuda.max_memory_allocated``; and the tuning time.

usage: torch_check.py OUT_DIR [alexnet] [resnet50] [--batch-alexnet N] [--batch-resnet N]
       [--max-candidates N] [--mode correctness|speed|both]   (run by .gpu/accept.sh torch and
       torch-speed)
Writes OUT_DIR/torch_check.json and prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt


# ------------------------------------------------------------------------------------------
# Models (defined here: torchvision may be missing on the GPU machine)

class AlexNetConvs(nn.Module):
    """Caffe AlexNet's five conv layers (227x227, no groups) with ReLU and max-pool."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 96, 11, stride=4)
        self.conv2 = nn.Conv2d(96, 256, 5, padding=2)
        self.conv3 = nn.Conv2d(256, 384, 3, padding=1)
        self.conv4 = nn.Conv2d(384, 384, 3, padding=1)
        self.conv5 = nn.Conv2d(384, 256, 3, padding=1)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 3, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, 2)
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x))
        x = F.max_pool2d(F.relu(self.conv5(x)), 3, 2)
        return x.mean(dim=(2, 3))


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 (v1.5: the stride on the 3x3), 224x224."""

    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean(dim=(2, 3)))


MODELS = {"alexnet": (AlexNetConvs, 227), "resnet50": (ResNet50, 224)}


# ------------------------------------------------------------------------------------------


def inputs(name, batch, dtype, channels_last, seed=0):
    _, size = MODELS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=g).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def prepare(model, dtype, channels_last):
    model = model.cuda().to(dtype)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def correctness(name, dtype, channels_last, max_candidates, cache):
    torch.manual_seed(0)
    reference = prepare(MODELS[name][0](), dtype, channels_last)
    ours = mt.convert_(copy.deepcopy(reference), workspace_limit="64MiB", cache=cache,
                       max_candidates=max_candidates)
    x = inputs(name, 8, dtype, channels_last)
    results = []
    for model in (reference, ours):
        model.train()
        model.zero_grad()
        y = model(x)
        y.float().pow(2).sum().backward()
        results.append((y.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (y_ref, g_ref), (y_ours, g_ours) = results
    out_err = ((y_ours - y_ref).abs().max() / y_ref.abs().max().clamp_min(1e-12)).item()
    grad_err = max(
        ((g_ours[k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for k, g in g_ref.items()
    )
    return out_err, grad_err


def time_steps(model, x):
    target = torch.randint(0, 10, (x.shape[0],), device="cuda")

    def step():
        out = model(x)
        loss = F.cross_entropy(out.float()[:, :10], target)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 5)
    return statistics.median(samples), torch.cuda.max_memory_allocated() / 2**20


def speed(name, batch, dtype, channels_last, limits, max_candidates, cache):
    rows = []
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    baseline = prepare(MODELS[name][0](), dtype, channels_last)
    x = inputs(name, batch, dtype, channels_last)
    ms, peak = time_steps(baseline, x)
    rows.append(dict(model=name, dtype=str(dtype).split(".")[-1], channels_last=channels_last,
                     limit="pytorch (benchmark, unlimited)", ms=ms, peak_mib=peak, tuning_s=0.0))
    del baseline
    torch.cuda.empty_cache()
    for limit in limits:
        torch.manual_seed(0)
        model = prepare(MODELS[name][0](), dtype, channels_last)
        mt.convert_(model, workspace_limit=limit, cache=cache, max_candidates=max_candidates)
        started = time.perf_counter()
        mt.tune(model, x, verbose=False)
        tuning = time.perf_counter() - started
        ms, peak = time_steps(model, x)
        rows.append(dict(model=name, dtype=str(dtype).split(".")[-1], channels_last=channels_last,
                         limit=limit, ms=ms, peak_mib=peak, tuning_s=tuning))
        del model
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", nargs="*", default=["alexnet", "resnet50"])
    parser.add_argument("--batch-alexnet", type=int, default=256)
    parser.add_argument("--batch-resnet", type=int, default=64)
    parser.add_argument("--max-candidates", type=int, default=16)
    parser.add_argument("--mode", choices=("correctness", "speed", "both"), default="both",
                        help="accept.sh runs the two as separate parts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = str(args.out / "cache.sqlite")
    report = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "device": torch.cuda.get_device_name(), "correctness": [], "speed": []}
    failures = 0
    for name in args.parts:
        for dtype, channels_last in ((torch.float32, False), (torch.float16, True)):
            if args.mode == "speed":
                break
            out_err, grad_err = correctness(name, dtype, channels_last, args.max_candidates, cache)
            # TF32 (fp32) and fp16 round differently from one algorithm to another.
            tolerance = 2e-2 if dtype == torch.float16 else 1e-2
            ok = out_err <= tolerance and grad_err <= tolerance
            failures += not ok
            report["correctness"].append(dict(model=name, dtype=str(dtype), channels_last=channels_last,
                                              output_rel_err=out_err, grad_rel_err=grad_err, ok=ok))
            print(f"correctness {name} {dtype} cl={channels_last}: output {out_err:.2e}, "
                  f"grads {grad_err:.2e} -> {'ok' if ok else 'FAIL'}", flush=True)
        if args.mode == "correctness":
            (args.out / "torch_check.json").write_text(json.dumps(report, indent=1))
            continue
        batch = args.batch_alexnet if name == "alexnet" else args.batch_resnet
        report["speed"] += speed(name, batch, torch.float16, True, ["8MiB", "64MiB"],
                                 args.max_candidates, cache)
        report["speed"] += speed(name, batch, torch.float32, False, ["64MiB", "256MiB"],
                                 args.max_candidates, cache)
        (args.out / "torch_check.json").write_text(json.dumps(report, indent=1))
    print()
    print(f"{'model':<9} {'dtype':<8} {'layout':<6} {'limit':<32} {'ms/step':>9} {'peak MiB':>9} {'tuning s':>9}")
    for r in report["speed"]:
        print(f"{r['model']:<9} {r['dtype']:<8} {'nhwc' if r['channels_last'] else 'nchw':<6} "
              f"{r['limit']:<32} {r['ms']:9.2f} {r['peak_mib']:9.0f} {r['tuning_s']:9.1f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

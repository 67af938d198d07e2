#!/usr/bin/env python3
"""GPU acceptance of the PyTorch package, one run:

1. correctness: one training step (train mode) of converted AlexNet (conv part) and ResNet-50
   and of the same models with PyTorch's convolutions, fp32 NCHW and fp16 channels_last, both
   against a float64 copy of the model on the same input (outputs and parameter gradients):
   mucudnn's largest relative error must be at most twice PyTorch's own, or within 2^-10 (fp16
   and TF32 round differently from one algorithm to another; PyTorch's error is the
   yardstick);
2. speed and memory: the step time (forward + backward, CUDA events, median of 5 loops of 5
   steps after warm-up) of the converted model at the given limits per layer against the same
   model with ``torch.backends.cudnn.benchmark = True`` and no limit, with peak memory from
   ``torch.cuda.max_memory_allocated``; and the tuning time;
3. first-contact: both in one short run, AlexNet fp16 channels_last at 64 MiB per layer: the
   largest error against PyTorch's step, ms/step, peak memory and tuning time.

Any converted layer that fell back to PyTorch's convolution fails the run.

usage: torch_check.py OUT_DIR [alexnet] [resnet50] [--batch-alexnet N] [--batch-resnet N]
       [--max-candidates N] [--mode correctness|speed|both|first-contact] [--dtype fp16|fp32]
       [--limits 64MiB,...]   (run by .gpu/accept.sh first-contact, torch, torch-resnet50 and
       torch-speed-*)
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


# The shared parts lie next to this script (scripts/gpu/ here, .gpu/ on the GPU machine).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import fallback_layers  # noqa: E402


def train_step(model, x):
    """One train-mode forward and backward of a sum of squares: (output, gradients), float64
    on the device."""
    model.train()
    model.zero_grad()
    y = model(x)
    y.double().pow(2).sum().backward()
    return y.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def correctness(name, dtype, channels_last, max_candidates, cache):
    """One train step of PyTorch's model, the converted one and a float64 copy (same weights,
    same input): (PyTorch's errors, mucudnn's errors, fallbacks), each errors a pair (output,
    the largest over the parameter gradients) relative to float64."""
    torch.manual_seed(0)
    reference = prepare(MODELS[name][0](), dtype, channels_last)
    exact = copy.deepcopy(reference).double()
    ours = copy.deepcopy(reference)
    x = inputs(name, 8, dtype, channels_last)
    # PyTorch's steps before any layer is converted: a converted layer (torch >= 2.10) runs
    # every convolution of its shapes, an unconverted copy's too.
    y64, g64 = train_step(exact, x.double())
    errors = []
    for model in (reference, ours):
        if model is ours:
            mt.convert_(ours, workspace_limit="64MiB", cache=cache, max_candidates=max_candidates)
        y, g = train_step(model, x)
        errors.append((relative(y, y64), max(relative(g[k], v) for k, v in g64.items())))
    return errors[0], errors[1], fallback_layers(ours)


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


def first_contact(batch, max_candidates, cache):
    """AlexNet fp16 channels_last at 64 MiB per layer against the same model under
    cudnn.benchmark, in one process: the largest error of one step (output and gradients)
    against PyTorch's, ms/step, peak memory, tuning time; and the fallback layers."""
    dtype, limit = torch.float16, "64MiB"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    baseline = prepare(MODELS["alexnet"][0](), dtype, True)
    ours = copy.deepcopy(baseline)
    x = inputs("alexnet", batch, dtype, True)
    # PyTorch's step and timing before any layer is converted: a converted layer (torch >=
    # 2.10) runs every convolution of its shapes, an unconverted copy's too.
    y_ref, g_ref = train_step(baseline, x)
    rows = []
    torch.cuda.empty_cache()
    ms, peak = time_steps(baseline, x)
    rows.append(dict(model="alexnet", dtype="float16", channels_last=True,
                     limit="pytorch (benchmark, unlimited)", ms=ms, peak_mib=peak, tuning_s=0.0))
    mt.convert_(ours, workspace_limit=limit, cache=cache, max_candidates=max_candidates)
    started = time.perf_counter()
    mt.tune(ours, x, verbose=False)
    tuning = time.perf_counter() - started
    y_ours, g_ours = train_step(ours, x)
    error = max([relative(y_ours, y_ref)] + [relative(g_ours[k], g) for k, g in g_ref.items()])
    torch.cuda.empty_cache()
    ms, peak = time_steps(ours, x)
    rows.append(dict(model="alexnet", dtype="float16", channels_last=True, limit=limit, ms=ms,
                     peak_mib=peak, tuning_s=tuning))
    return error, rows, fallback_layers(ours)


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
                         limit=limit, ms=ms, peak_mib=peak, tuning_s=tuning,
                         fallbacks=fallback_layers(model)))
        del model
        torch.cuda.empty_cache()
    return rows


DTYPES = {"fp16": (torch.float16, True), "fp32": (torch.float32, False)}
#: Relative errors below this are as exact as fp16 and TF32 allow (see the correctness check).
PRECISION_FLOOR = 2.0 ** -10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", nargs="*", default=["alexnet", "resnet50"])
    parser.add_argument("--batch-alexnet", type=int, default=256)
    parser.add_argument("--batch-resnet", type=int, default=64)
    parser.add_argument("--max-candidates", type=int, default=16)
    parser.add_argument("--mode", choices=("correctness", "speed", "both", "first-contact"),
                        default="both", help="accept.sh runs them as separate parts")
    parser.add_argument("--dtype", choices=sorted(DTYPES), action="append",
                        help="speed: the dtypes (default both; fp16 runs channels_last)")
    parser.add_argument("--limits", default=None,
                        help="speed: comma-separated limits (default fp16 8MiB,64MiB; fp32 "
                             "64MiB,256MiB)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = str(args.out / "cache.sqlite")
    report = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "device": torch.cuda.get_device_name(), "correctness": [], "speed": [],
              "fallbacks": []}
    failures = []
    if args.mode == "first-contact":
        # Batch 128: tuning five layers' three ops and two timed models fit 80 s.
        error, rows, fallbacks = first_contact(128, args.max_candidates, cache)
        report["first_contact"] = dict(max_rel_err=error, rows=rows)
        report["speed"] += rows
        report["fallbacks"] += fallbacks
        print(f"first-contact alexnet fp16 nhwc 64MiB: largest error against PyTorch's step "
              f"{error:.2e}", flush=True)
        if error > 2e-2:  # fp16: algorithms round differently
            failures.append(f"error {error:.2e} > 2e-2")
    for name in args.parts if args.mode != "first-contact" else []:
        for dtype, channels_last in ((torch.float32, False), (torch.float16, True)):
            if args.mode == "speed":
                break
            theirs, ours, fallbacks = correctness(name, dtype, channels_last,
                                                  args.max_candidates, cache)
            report["fallbacks"] += fallbacks
            # PyTorch's own distance from float64 is the yardstick (fp16 and TF32 round
            # differently per algorithm). The floor, about one unit of fp16's and TF32's
            # precision (2^-10), keeps a PyTorch that happened to pick a more exact algorithm
            # (an FFT, full fp32) from failing a result that is as exact as the format.
            ok = all(o <= max(2 * t, PRECISION_FLOOR) for o, t in zip(ours, theirs))
            if not ok:
                failures.append(f"{name} {dtype}: mucudnn {ours} against PyTorch's {theirs}")
            report["correctness"].append(dict(
                model=name, dtype=str(dtype), channels_last=channels_last,
                reference="float64", output_rel_err=ours[0], grad_rel_err=ours[1],
                pytorch_output_rel_err=theirs[0], pytorch_grad_rel_err=theirs[1], ok=ok))
            print(f"correctness {name} {dtype} cl={channels_last} against float64: output "
                  f"{ours[0]:.2e} (PyTorch {theirs[0]:.2e}), grads {ours[1]:.2e} (PyTorch "
                  f"{theirs[1]:.2e}) -> {'ok' if ok else 'FAIL'}", flush=True)
        if args.mode == "correctness":
            continue
        batch = args.batch_alexnet if name == "alexnet" else args.batch_resnet
        for dtype_name in args.dtype or ["fp16", "fp32"]:
            dtype, channels_last = DTYPES[dtype_name]
            default = ["8MiB", "64MiB"] if dtype_name == "fp16" else ["64MiB", "256MiB"]
            limits = args.limits.split(",") if args.limits else default
            rows = speed(name, batch, dtype, channels_last, limits, args.max_candidates, cache)
            report["speed"] += rows
            report["fallbacks"] += [f for r in rows for f in r.get("fallbacks", [])]
    failures += [f"fallback to PyTorch's convolution: {f}" for f in report["fallbacks"]]
    report["failures"] = failures
    (args.out / "torch_check.json").write_text(json.dumps(report, indent=1))
    print()
    print(f"{'model':<9} {'dtype':<8} {'layout':<6} {'limit':<32} {'ms/step':>9} {'peak MiB':>9} {'tuning s':>9}")
    for r in report["speed"]:
        print(f"{r['model']:<9} {r['dtype']:<8} {'nhwc' if r['channels_last'] else 'nchw':<6} "
              f"{r['limit']:<32} {r['ms']:9.2f} {r['peak_mib']:9.0f} {r['tuning_s']:9.1f}")
    print(f"fallback layers: {len(report['fallbacks'])}")
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

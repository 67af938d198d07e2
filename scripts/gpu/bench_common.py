"""What the GPU acceptance's convolution benchmarks (nd_bench.py, spatial_bench.py) share: the
zoo's layers as torch convolutions, the clock (time and memory), the comparison with
PyTorch's outputs and the speed / memory goal.

The scripts import it as a sibling: it lies next to them in scripts/gpu/ and, copied there by
build.sh, in .gpu/.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn as nn

# ------------------------------------------------------------------------------------------
# Set-up


def add_arguments(parser, parts):
    """The options both scripts take: OUT_DIR, --parts (default `parts`), --limits (default:
    the script's LIMITS), --mucudnn and --max-candidates."""
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", default=parts)
    parser.add_argument("--limits", default=None,
                        help="comma-separated workspace limits per layer (accept.sh: one per "
                             "part, so that a part fits its call)")
    parser.add_argument("--mucudnn", default=None,
                        help="the mucudnn binary (default: .gpu/mucudnn, else on PATH)")
    parser.add_argument("--max-candidates", type=int, default=8)


def mucudnn_binary(given):
    """The mucudnn binary: `given`, else .gpu/mucudnn, else the one on PATH."""
    if given is None:
        given = ".gpu/mucudnn" if os.path.exists(".gpu/mucudnn") else shutil.which("mucudnn")
    if given is None:
        raise SystemExit("no mucudnn binary: pass --mucudnn (build.sh puts one in .gpu/)")
    return given


def device_setup(smoke):
    """(device, dtype, its zoo name, the tolerance against PyTorch's outputs): fp32 on the CPU
    for --smoke, else fp16 on the GPU with ``torch.backends.cudnn.benchmark = True``."""
    if smoke:
        return torch.device("cpu"), torch.float32, "fp32", 1e-3
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    torch.backends.cudnn.benchmark = True
    return torch.device("cuda"), torch.float16, "fp16", 2e-2  # fp16: algorithms round differently


def report_header(device, smoke, limits):
    """The report's first keys: the versions, the device, the size and the limits."""
    return {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "smoke": smoke, "limits": list(limits)}


# ------------------------------------------------------------------------------------------
# Shapes


def zoo_layers(binary, model, batch, dtype, layout, extra):
    """The zoo model's distinct layers, as `mucudnn tune --list --json` gives them."""
    command = [binary, "tune", "--model", model, "--batch", str(batch), "--dtype", dtype,
               "--layout", layout, "--list", "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)["layers"]


def conv_for(problem):
    """The torch layer of a problem and its input shape: Conv3d when it has depth fields, else
    Conv2d."""
    if any(key in problem for key in ("d", "t", "pad_d", "stride_d", "dilation_d")):
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


def memory_format(dim):
    """channels_last_3d for a 5-D tensor, channels_last for a 4-D one."""
    return torch.channels_last_3d if dim == 5 else torch.channels_last


def channels_last(tensor):
    return tensor.contiguous(memory_format=memory_format(tensor.dim()))


def zoo_convolutions(layers, device, dtype, share_inputs=False):
    """The layers as torch convolutions, channels-last, with a random input each (seeded):
    (modules, inputs, counts, names). With `share_inputs`, layers of one input shape share one
    input (a 2048x2048 one of 128 channels is 1 GiB in fp16)."""
    torch.manual_seed(0)
    modules, inputs, counts, names, shared = nn.ModuleList(), [], [], [], {}
    for layer in layers:
        conv, shape = conv_for(layer["problem"])
        modules.append(conv)
        if not share_inputs or shape not in shared:
            shared[shape] = channels_last(torch.randn(*shape, device=device).to(dtype))
        inputs.append(shared[shape])
        counts.append(layer["count"])
        names.append(layer["layer"])
    modules = modules.to(device=device, dtype=dtype)
    for m, x in zip(modules, inputs):
        m.to(memory_format=memory_format(x.dim()))
    return modules, inputs, counts, names


# ------------------------------------------------------------------------------------------
# Measuring


class Clock:
    """CUDA events on a GPU, the host clock on the CPU; memory from the caching allocator and
    the device (mem_get_info, sampled after every timed call)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.min_free = None
        self.base = 0

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
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
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
        """Forgets the peaks; what is allocated now (inputs, weights) is the base."""
        if self.cuda:
            self.sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        self.min_free = None

    def reset_peak(self):
        """Forgets the allocator's peak (not the device's, nor the base)."""
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def sample(self):
        if self.cuda:
            free, _ = torch.cuda.mem_get_info()
            self.min_free = free if self.min_free is None else min(self.min_free, free)

    def peak_extra_mib(self):
        """The peak allocated since the last reset / reset_peak beyond the base, in MiB; None
        on the CPU."""
        if not self.cuda:
            return None
        self.sync()
        return (torch.cuda.max_memory_allocated() - self.base) / 2**20

    def device_peak_mib(self):
        """The device's peak use since the last reset, in MiB; None on the CPU."""
        if not self.cuda:
            return None
        self.sync()
        self.sample()
        _, total = torch.cuda.mem_get_info()
        return (total - self.min_free) / 2**20

    def memory(self):
        """(peak allocated beyond the base, peak device use) since the last reset, in MiB."""
        return self.peak_extra_mib(), self.device_peak_mib()


def layer_plans(module):
    """A converted layer's plans by input shape (mucudnn.torch.Plans), None for a module
    mucudnn does not run (``mucudnn.torch.plans_of``, on either path)."""
    import mucudnn.torch as mt

    return mt.plans_of(module)


def tune_forward(model, inputs, clock):
    """Runs each converted layer once (under no_grad: it tunes its shape's forward on first
    sight): (the seconds it took, the ops tuned)."""
    started = time.perf_counter()
    for m, x in zip(model, inputs):
        m(x)
    clock.sync()
    tuning = time.perf_counter() - started
    return tuning, sorted({op for m in model for r in layer_plans(m).values() for op in r.tuned_ops})


def time_layers(model, inputs, clock):
    """Each layer's time (ms) and peak allocated beyond the base (MiB, None on the CPU), from a
    clock reset here: (times, peaks, the largest peak, the device's peak use)."""
    clock.reset()
    times, peaks = [], []
    for m, x in zip(model, inputs):
        clock.reset_peak()
        times.append(clock.time_ms(lambda: m(x)))
        peaks.append(clock.peak_extra_mib())
    peak = None if peaks[0] is None else max(peaks)
    return times, peaks, peak, clock.device_peak_mib()


def relative_error(ours, reference, device=None):
    """max |ours - reference| / max |reference|, in float32 on `device` (default: where `ours`
    is), a slice at a time (a 2048x2048 output of 256 channels is 1 Gi elements: no float32
    copy of it whole)."""
    device = ours.device if device is None else device
    ours = ours.reshape(-1)
    reference = reference.reshape(-1)
    step = 1 << 26
    diff, scale = 0.0, 0.0
    for start in range(0, ours.numel(), step):
        a = ours[start:start + step].to(device).float()
        b = reference[start:start + step].to(device).float()
        diff = max(diff, (a - b).abs().max().item())
        scale = max(scale, b.abs().max().item())
    return diff / max(scale, 1e-12)


def layer_errors(model, inputs, reference, device):
    """Runs each layer once: without a `reference` its outputs (on the host) become it, error
    0; else the largest relative_error against it. (error, reference)."""
    error, outputs = 0.0, []
    for index, (m, x) in enumerate(zip(model, inputs)):
        out = m(x)
        if reference is None:
            outputs.append(out.cpu())
        else:
            error = max(error, relative_error(out, reference[index], device))
        del out
    return error, outputs if reference is None else reference


def mib(value):
    """A table's MiB cell: whole MiB, or "-" where there is no figure (the CPU)."""
    return "-" if value is None else f"{value:.0f}"


def limits_of(args, default):
    """The limits to measure: --limits, else the script's `default`."""
    return tuple(args.limits.split(",")) if args.limits else tuple(default)


def fallback_layers(model):
    """The converted layers of `model` that run PyTorch's convolution for some shape, with the
    reason: a bench fails on any (it would time PyTorch against itself)."""
    return [f"{name}: {report.fallback}" for name, module in model.named_modules()
            if layer_plans(module) is not None for report in layer_plans(module).values()
            if report.fallback is not None]


def goal(rows, limit, time_key, strictly_below):
    """At `limit` per layer: no slower than PyTorch in `time_key`, with peak memory below
    PyTorch's (`strictly_below`, reported as memory_below) or at or below it
    (memory_at_or_below); None on the CPU. None where `limit` was not measured."""
    by = {r["variant"]: r for r in rows}
    if limit not in by:
        return None
    ours, torch_row = by[limit], by["pytorch"]
    faster = ours[time_key] <= torch_row[time_key]
    if ours["peak_extra_mib"] is None:
        memory = None
    elif strictly_below:
        memory = ours["peak_extra_mib"] < torch_row["peak_extra_mib"]
    else:
        memory = ours["peak_extra_mib"] <= torch_row["peak_extra_mib"]
    return {"not_slower": faster,
            "memory_below" if strictly_below else "memory_at_or_below": memory,
            "speedup": torch_row[time_key] / ours[time_key] if ours[time_key] else None}

#!/usr/bin/env python3
"""GPU benchmark of whole diffusers VAE decodes (random weights, no download), one process:

1. wan: a Wan 2.1-topology ``AutoencoderKLWan`` decoder at a third of its width (base_dim 32
   instead of 96) decoding 17 frames of 480x832 (a 5x60x104 latent), as diffusers decodes it
   (frame by frame with its causal cache);
2. sdxl1024, sdxl2048: an SDXL-topology ``AutoencoderKL`` (block_out_channels 128, 256, 512,
   512; two layers per block, 32 groups) decoding 1024x1024 and 2048x2048 images.

Per case, in fp16 (``cudnn.benchmark = True`` for PyTorch's own): untiled PyTorch,
``enable_tiling()`` (diffusers' defaults), and ``mucudnn.torch.convert_`` at 256 MiB and 1 GiB
per layer (``split="auto"``; tuned on its first decode, whose time is reported apart). Each
variant: the decode's time (CUDA events, one warm-up, the median of up to --repeats within the
case's time cap), peak memory (``torch.cuda.max_memory_allocated`` beyond the model and the
latent), and the largest error against the untiled fp32 decode (max |x - ref| / max |ref|).
mucudnn's layers that fall back to PyTorch's convolution are counted; any is a failure.

usage: vae_bench.py OUT_DIR [--cases wan,sdxl1024,sdxl2048] [--cap-s 90] [--repeats 3]
                    [--limits 256MiB,1GiB] [--smoke]
--smoke runs the same code on the CPU in fp32 at tiny sizes (widths / 16, latents of 4x4 to
8x8) to check the script itself. Writes OUT_DIR/vae_bench.json after every variant and
OUT_DIR/vae_bench.md (the table) at the end; exits non-zero on a failure or a fallback.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch


def wan_case(smoke: bool):
    from diffusers import AutoencoderKLWan

    base = 4 if smoke else 32  # Wan 2.1's is 96: a third of its width
    vae = AutoencoderKLWan(
        base_dim=base, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
        temperal_downsample=[False, True, True],
    )
    latent = (1, 16, 2, 4, 4) if smoke else (1, 16, 5, 60, 104)  # 17 x 480 x 832
    return vae, latent


def sdxl_case(size: int):
    def make(smoke: bool):
        from diffusers import AutoencoderKL

        widths = (8, 16, 32, 32) if smoke else (128, 256, 512, 512)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
            block_out_channels=widths, norm_num_groups=8 if smoke else 32,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            sample_size=1024,
        )
        side = 8 if smoke else size // 8
        return vae, (1, 4, side, side)

    return make


CASES: Dict[str, Callable] = {
    "wan": wan_case,
    "sdxl1024": sdxl_case(1024),
    "sdxl2048": sdxl_case(2048),
}


class Clock:
    """CUDA events and the allocator's peak on a GPU; the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> int:
        if self.cuda:
            self.sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return 0

    def peak_mib(self, base: int) -> Optional[float]:
        if not self.cuda:
            return None
        self.sync()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def once_ms(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in float32 a slice at a time."""
    a, b = ours.reshape(-1), reference.reshape(-1)
    diff = scale = 0.0
    step = 1 << 26
    for start in range(0, a.numel(), step):
        x = a[start:start + step].float()
        y = b[start:start + step].to(x.device).float()
        diff = max(diff, (x - y).abs().max().item())
        scale = max(scale, y.abs().max().item())
    return diff / max(scale, 1e-12)


def fallbacks(model) -> List[str]:
    """The mucudnn layers (and shapes) that run PyTorch's convolution."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import layer_plans

    found = []
    for name, module in model.named_modules():
        plans = layer_plans(module)
        for shape, report in (plans or {}).items():
            if report.fallback is not None:
                found.append(f"{plans.layer} {shape}: {report.fallback}")
    return found


def run_case(name: str, args, device: torch.device, dtype: torch.dtype, clock: Clock,
             report: Dict[str, Any], write: Callable[[], None]) -> None:
    import mucudnn.torch as mt

    torch.manual_seed(0)
    vae, latent_shape = CASES[name](args.smoke)
    vae = vae.eval().to(device)
    z = torch.randn(latent_shape, device=device)
    case = {"latent": list(latent_shape), "rows": []}
    report["cases"][name] = case
    started = time.perf_counter()

    def over_cap() -> bool:
        return time.perf_counter() - started > args.cap_s

    with torch.no_grad():
        reference = vae.decode(z).sample.float().cpu()  # untiled fp32
        case["output"] = list(reference.shape)
        model16 = vae.to(dtype)
        z16 = z.to(dtype)
        variants = [("pytorch", None, False), ("enable_tiling", None, True)]
        variants += [(f"mucudnn {limit}", limit, False) for limit in args.limits]
        for label, limit, tiled in variants:
            row: Dict[str, Any] = {"variant": label}
            case["rows"].append(row)
            if over_cap():
                row["skipped"] = f"over the case's time cap of {args.cap_s} s"
                write()
                continue
            model = copy.deepcopy(model16)
            if tiled:
                model.enable_tiling()
            if limit is not None:
                mt.convert_(model, workspace_limit=limit, split="auto", cache=args.cache)
                tuning = time.perf_counter()
                model.decode(z16)  # tunes each layer's forward on first sight
                clock.sync()
                row["tuning_s"] = time.perf_counter() - tuning
                row["fallbacks"] = fallbacks(model)
            try:
                base = clock.reset()
                out = model.decode(z16).sample  # warm-up (and the output compared)
                row["max_error_vs_fp32"] = relative_error(out, reference)
                del out
                times = []
                for _ in range(args.repeats):
                    times.append(clock.once_ms(lambda: model.decode(z16)))
                    if over_cap():
                        break
                row["time_ms"] = statistics.median(times)
                row["repeats"] = len(times)
                row["peak_mib"] = clock.peak_mib(base)
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0]}"
            del model
            write()
    case["seconds"] = time.perf_counter() - started


def table(report: Dict[str, Any]) -> str:
    lines = [
        "| case | variant | time (ms) | peak (MiB) | max error vs fp32 | tuning (s) | fallbacks |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case in report["cases"].items():
        for row in case["rows"]:
            def cell(key, fmt):
                value = row.get(key)
                return "-" if value is None else format(value, fmt)
            note = row.get("skipped") or row.get("error")
            lines.append(
                f"| {name} | {row['variant']} | {note or cell('time_ms', '.1f')} | "
                f"{cell('peak_mib', '.0f')} | {cell('max_error_vs_fp32', '.2e')} | "
                f"{cell('tuning_s', '.1f')} | {len(row.get('fallbacks', []))} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--cap-s", type=float, default=90.0, help="time cap per case (s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limits", default="256MiB,1GiB")
    parser.add_argument("--cache", default=None, help="mucudnn's cache file (default location)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.limits = [limit for limit in args.limits.split(",") if limit]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; expected some of {list(CASES)}")
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("vae_bench.py needs a GPU (or --smoke)")
        device, dtype = torch.device("cuda"), torch.float16
        torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "smoke": args.smoke, "limits": args.limits,
        "cap_s": args.cap_s, "cases": {}, "failures": [],
    }

    def write() -> None:
        (args.out / "vae_bench.json").write_text(json.dumps(report, indent=2))

    for name in cases:
        try:
            run_case(name, args, device, dtype, Clock(device), report, write)
        except Exception as e:  # one case failing leaves the others' numbers
            report["failures"].append(f"{name}: {type(e).__name__}: {e}")
        for row in report["cases"].get(name, {}).get("rows", []):
            for fallback in row.get("fallbacks", []):
                report["failures"].append(f"{name} {row['variant']}: fallback {fallback}")
            # PyTorch's own variants running out of memory is a measurement; mucudnn's is not.
            if "error" in row and row["variant"].startswith("mucudnn"):
                report["failures"].append(f"{name} {row['variant']}: {row['error']}")
            # A variant left out for time is a part that did not finish: say so and fail.
            if "skipped" in row:
                report["failures"].append(f"{name} {row['variant']}: {row['skipped']}")
        write()
    text = table(report)
    (args.out / "vae_bench.md").write_text(text + "\n")
    print(text)
    for failure in report["failures"]:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

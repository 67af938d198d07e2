#!/usr/bin/env python3
"""PyTorch's cuDNN convolutions, as a user would run them: `cudnn.benchmark = True`, no
workspace limit. For every distinct conv layer of a mucudnn profile (as written by
`mucudnn tune --save-profile`), times forward + backward (dx and dw) with CUDA events
(warm-up, then the median of 5 loops of 10 iterations) and records the peak memory PyTorch
allocates beyond the layer's own tensors.

usage: torch_bench.py PROFILE.json OUT.json
Writes {"torch": "...", "cudnn": N, "layers": [{"layer", "dtype", "layout", "ms", "extra_mib"}]}.
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True


def layers(profile):
    seen = {}
    for r in profile["records"]:
        key = (r["layer"], r["dtype"], r["layout"])
        seen.setdefault(key, r)
    return list(seen.values())


def bench(r):
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[r["dtype"]]
    fmt = torch.channels_last if r["layout"] == "nhwc" else torch.contiguous_format
    dev = "cuda"
    x = (torch.rand(r["n"], r["c"], r["h"], r["w"], device=dev) * 2 - 1).to(dtype).to(memory_format=fmt)
    w = (torch.rand(r["k"], r["c"] // r["groups"], r["r"], r["s"], device=dev) * 2 - 1).to(dtype)
    w = w.to(memory_format=fmt)
    x.requires_grad_()
    w.requires_grad_()
    args = dict(stride=(r["stride_h"], r["stride_w"]), padding=(r["pad_h"], r["pad_w"]),
                dilation=(r["dilation_h"], r["dilation_w"]), groups=r["groups"])
    y = F.conv2d(x, w, **args)
    dy = (torch.rand_like(y) * 2 - 1).contiguous(memory_format=fmt)

    def step():
        y = F.conv2d(x, w, **args)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        return dx, dw

    for _ in range(3):  # benchmark mode picks its algorithms on the first calls
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    # Outputs of one step (y, dx, dw) are the layer's own tensors; the rest is workspace.
    own = (y.numel() + x.numel() + w.numel()) * y.element_size()
    extra = max(0, torch.cuda.max_memory_allocated() - base - own)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 10)
    return statistics.median(samples), extra / 2**20


def main():
    profile = json.load(open(sys.argv[1]))
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "layers": []}
    for r in layers(profile):
        ms, extra = bench(r)
        out["layers"].append(dict(layer=r["layer"], dtype=r["dtype"], layout=r["layout"],
                                  ms=ms, extra_mib=extra))
        print(f'{r["layer"]:<32} {r["dtype"]} {r["layout"]} {ms:8.3f} ms  {extra:8.1f} MiB extra',
              file=sys.stderr)
    json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()

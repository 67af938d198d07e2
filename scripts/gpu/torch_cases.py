#!/usr/bin/env python3
"""Writes PyTorch reference cases for tests/gpu_cudnn.rs (cudnn_plans_match_pytorch).

For each case: random x, w, dy in the case's dtype; y = conv2d(x, w) and the gradients dx, dw
computed by PyTorch on the GPU (TF32 disabled for fp32). Every tensor is stored as raw
little-endian float32 in the case's memory layout (NHWC activations as n,h,w,c; NHWC filters
as k,r,s,c/g), plus cases.json describing the problems in mucudnn's ConvProblem form.

usage: torch_cases.py OUT_DIR
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False


def case(name, n, c, h, w, k, r, s, pad=1, stride=1, dilation=1, groups=1, dtype="fp32", layout="nchw"):
    return dict(name=name, problem=dict(
        n=n, c=c, h=h, w=w, k=k, r=r, s=s, pad_h=pad, pad_w=pad, stride_h=stride, stride_w=stride,
        dilation_h=dilation, dilation_w=dilation, groups=groups, dtype=dtype, layout=layout,
        math="fma" if dtype == "fp32" else "tensor-op"))


CASES = [
    case("fp32-nchw-3x3", 8, 16, 14, 14, 32, 3, 3),
    case("fp32-nchw-5x5-s2-g2", 8, 16, 15, 15, 32, 5, 5, pad=2, stride=2, groups=2),
    case("fp32-nhwc-3x3-dil2", 8, 16, 14, 14, 32, 3, 3, pad=2, dilation=2, layout="nhwc"),
    case("fp16-nhwc-3x3", 8, 16, 14, 14, 32, 3, 3, dtype="fp16", layout="nhwc"),
    case("fp16-nchw-1x1", 8, 64, 14, 14, 64, 1, 1, pad=0, dtype="fp16"),
]


def store(tensor, layout, path):
    if layout == "nhwc":
        tensor = tensor.permute(0, 2, 3, 1)
    tensor.detach().float().contiguous().cpu().numpy().astype("<f4").tofile(path)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    cases = []
    for spec in CASES:
        p = spec["problem"]
        dtype = {"fp32": torch.float32, "fp16": torch.float16}[p["dtype"]]
        dev = "cuda"
        uniform = lambda *shape: (torch.rand(*shape, device=dev) * 2 - 1).to(dtype)
        x = uniform(p["n"], p["c"], p["h"], p["w"]).requires_grad_()
        w = uniform(p["k"], p["c"] // p["groups"], p["r"], p["s"]).requires_grad_()
        y = F.conv2d(x, w, stride=p["stride_h"], padding=p["pad_h"], dilation=p["dilation_h"], groups=p["groups"])
        dy = uniform(*y.shape)
        y.backward(dy)
        files = {}
        for key, tensor in [("x", x), ("w", w), ("dy", dy), ("y", y), ("dx", x.grad), ("dw", w.grad)]:
            files[key] = f"{spec['name']}.{key}.f32"
            store(tensor, p["layout"], os.path.join(out, files[key]))
        cases.append(dict(name=spec["name"], problem=p, files=files))
        print(f"{spec['name']}: y {tuple(y.shape)} written")
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()

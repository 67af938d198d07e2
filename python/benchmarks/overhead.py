#!/usr/bin/env python3
"""Per-call overhead of mucudnn's PyTorch path on a tiny CPU convolution (a benchmark, not a
test): forward calls of a tuned ``mucudnn.torch.Conv2d`` against ``torch.nn.Conv2d``, and the
parts of the path (the custom op's dispatch, the ctypes call into the library).

usage: python3 python/benchmarks/overhead.py [--calls N] [--repeats R]
With ``mucudnn.torch.enabled`` (the process switch), also ``torch.nn.Conv2d`` under it.
Prints the median over R repeats of N calls, in microseconds per call.
"""

import argparse
import statistics
import time

import torch

import mucudnn.torch as mt
from mucudnn.torch import _runtime


def per_call(fn, calls, repeats):
    for _ in range(calls // 10 + 1):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(1, 4, 4, 4)
    ours = mt.Conv2d(4, 4, 1, cache=False, name="tiny")
    theirs = torch.nn.Conv2d(4, 4, 1)
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ours(x)  # tune
        key = _runtime.plan_key(x, ours.weight.shape, [1, 1], [0, 0], [1, 1], 1)
        prepared = ours._mucudnn.prepared[key]
        y = torch.empty(1, 4, 4, 4)
        w = ours.weight.detach()
        workspace = torch.empty(max(prepared.workspace) + 1, dtype=torch.uint8)
        rows = [
            ("torch.nn.Conv2d forward", per_call(lambda: theirs(x), args.calls, args.repeats)),
            ("mucudnn Conv2d forward", per_call(lambda: ours(x), args.calls, args.repeats)),
        ]
        if hasattr(mt, "enabled"):
            with mt.enabled(cache=False):
                theirs(x)  # tune
                rows.append((
                    "torch.nn.Conv2d forward under mucudnn.torch.enabled()",
                    per_call(lambda: theirs(x), args.calls, args.repeats),
                ))
        rows += [
            (
                "  the op alone (torch.ops.mucudnn.conv2d)",
                per_call(
                    lambda: torch.ops.mucudnn.conv2d(x, w, None, [1, 1], [0, 0], [1, 1], 1, ours._mucudnn_config),
                    args.calls, args.repeats,
                ),
            ),
            (
                "  the library call alone (ctypes)",
                per_call(
                    lambda: prepared.tuner.execute(
                        prepared.id, 0, x.data_ptr(), w.data_ptr(), y.data_ptr(),
                        prepared.extents[0],
                        workspace=workspace.data_ptr(), workspace_bytes=prepared.workspace[0],
                    ),
                    args.calls, args.repeats,
                ),
            ),
        ]
    width = max(len(name) for name, _ in rows)
    for name, micros in rows:
        print(f"{name:<{width}}  {micros:8.1f} us/call")
    print(f"{'added per call (Conv2d)':<{width}}  {rows[1][1] - rows[0][1]:8.1f} us")
    if rows[2][0].startswith("torch.nn.Conv2d forward under"):
        print(f"{'added per call (enabled())':<{width}}  {rows[2][1] - rows[0][1]:8.1f} us")


if __name__ == "__main__":
    main()

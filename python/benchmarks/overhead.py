#!/usr/bin/env python3
"""Per-call host overhead of mucudnn.torch on the CPU (a benchmark, not a test).

Rows, each against the same thing without mucudnn, alternated in one sitting (baseline and
mucudnn measured in turns, so that drift and the machine's load hit both alike):

- forward of a tuned tiny ``Conv2d`` (converted with ``convert_``) under ``torch.no_grad()``;
- forward + backward of that layer (one layer-step);
- ``torch.relu`` while the switch is on (``mucudnn.torch.enabled()``): what non-convolution
  ops pay;
- a training step (forward, backward, SGD) of a ResNet-50 topology at 1/16 width, batch 2 at
  64x64: its host time against PyTorch's, as a ratio.

Prints per row the median added microseconds (mucudnn's median minus the baseline's) with the
spread (the 25th-75th percentile of the per-round differences), the load average, and which
path ran (``MUCUDNN_TORCH_PATH=python`` measures the Python path). ``--json`` prints the rows
as JSON.

usage: python3 python/benchmarks/overhead.py [--rounds R] [--calls N] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.nn as nn

import mucudnn.torch as mt

OPTIONS = dict(cache=False, policy="undivided", split="batch")


def per_call(fn, calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def alternated(baseline, ours, calls: int, rounds: int):
    """(baseline median, ours median, per-round differences) in microseconds per call."""
    for fn in (baseline, ours):
        per_call(fn, max(calls // 10, 1))  # warm up (and tune)
    base, mine, diffs = [], [], []
    for _ in range(rounds):
        b = per_call(baseline, calls)
        m = per_call(ours, calls)
        base.append(b)
        mine.append(m)
        diffs.append(m - b)
    return statistics.median(base), statistics.median(mine), diffs


def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def bottleneck(cin: int, width: int, stride: int) -> nn.Module:
    out = width * 4

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out),
            )
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                if stride != 1 or cin != out else nn.Identity()
            )

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    return Block()


def resnet50_topology(divisor: int = 16) -> nn.Module:
    """ResNet-50's layers (3, 4, 6, 3 bottlenecks) with every width divided by ``divisor``."""
    stem = 64 // divisor
    layers = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = stem
    for blocks, width, stride in ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)):
        width //= divisor
        for i in range(blocks):
            layers.append(bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MUCUDNN_QUIET", "1")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []

    def row(name, baseline, ours, calls, ratio=False):
        base, mine, diffs = alternated(baseline, ours, calls, args.rounds)
        low, high = quartiles(diffs)
        rows.append({
            "row": name, "baseline_us": base, "mucudnn_us": mine,
            "added_us": statistics.median(diffs), "spread_us": [low, high],
            "ratio": mine / base if ratio else None,
        })

    x = torch.randn(1, 4, 4, 4)
    plain = nn.Conv2d(4, 4, 3, padding=1)
    converted = mt.convert_(copy.deepcopy(plain), **OPTIONS)
    with torch.no_grad():
        row("forward, added over nn.Conv2d", lambda: plain(x), lambda: converted(x), args.calls)

        if mt.PATH == "native":
            # What a convolution mucudnn does not run pays while its kernel is registered: the
            # kernel reads the call, finds no layer, and calls PyTorch's own kernel.
            other = nn.Conv2d(4, 4, 3, padding=1)
            mt.disable()
            row("an unconverted conv while mucudnn's kernels are registered",
                lambda: plain(x), lambda: other(x), args.calls)

    xg = x.clone().requires_grad_(True)

    def step(layer):
        def run():
            layer(xg).sum().backward()
        return run

    row("forward + backward per layer-step", step(plain), step(converted), args.calls // 4)

    t = torch.randn(64)
    with mt.enabled(**OPTIONS):
        on = per_call(lambda: torch.relu(t), args.calls)  # noqa: F841 (warm)
    relu_rounds = []
    for _ in range(args.rounds):
        off = per_call(lambda: torch.relu(t), args.calls)
        with mt.enabled(**OPTIONS):
            on = per_call(lambda: torch.relu(t), args.calls)
        relu_rounds.append((off, on))
    diffs = [on - off for off, on in relu_rounds]
    low, high = quartiles(diffs)
    rows.append({
        "row": "a non-conv op (relu) while enabled, added",
        "baseline_us": statistics.median(o for o, _ in relu_rounds),
        "mucudnn_us": statistics.median(o for _, o in relu_rounds),
        "added_us": statistics.median(diffs), "spread_us": [low, high], "ratio": None,
    })

    torch.manual_seed(0)
    net = resnet50_topology()
    ours = mt.convert_(copy.deepcopy(net), **OPTIONS)
    batch = torch.randn(2, 3, 64, 64)
    target = torch.randint(0, 10, (2,))

    def train(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def run():
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(batch), target).backward()
            optimizer.step()
        return run

    row("ResNet-50 topology (1/16 width) training step", train(net), train(ours),
        max(args.calls // 200, 3), ratio=True)

    load = os.getloadavg()
    if args.json:
        print(json.dumps({"path": mt.PATH, "torch": torch.__version__, "load": load,
                          "rounds": args.rounds, "rows": rows}, indent=1))
        return
    print(f"mucudnn.torch path: {mt.PATH}; torch {torch.__version__}; {args.rounds} rounds; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for r in rows:
        low, high = r["spread_us"]
        extra = f", x{r['ratio']:.2f} of PyTorch's" if r["ratio"] else ""
        print(f"{r['row']:<48} {r['added_us']:+9.1f} us (IQR {low:+.1f} .. {high:+.1f}; "
              f"PyTorch {r['baseline_us']:.1f} us{extra})")


if __name__ == "__main__":
    main()

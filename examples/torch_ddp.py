"""Train a small ResNet-style CNN with DistributedDataParallel, its convolutions converted to
mucudnn's micro-batched Conv2d.

    torchrun --nproc_per_node 2 examples/torch_ddp.py            # CPU (gloo) or GPUs (nccl)
    python3 examples/torch_ddp.py                                # one process

The data is generated (a fixed random "teacher" network labels Gaussian images), so nothing is
downloaded. Every rank tunes with ``mucudnn.torch.tune`` before the first step: under
torchrun the measuring is dealt out over the ranks and the measurements shared, so every rank
runs the same plans. Rank 0 prints the loss per step, the tuning time and the plans.
``--report DIR`` writes one JSON file per rank (loss curve, a parameter checksum, the plans,
the tasks this rank measured), which the tests read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mucudnn.torch as mt


class Block(nn.Module):
    """A residual block: 3x3 (optionally strided), a depthwise 3x3 with dilation 2, a grouped
    1x1 without bias; a strided 1x1 shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=2, dilation=2, groups=cout)
        self.conv3 = nn.Conv2d(cout, cout, 1, groups=2, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.conv2(y))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


class Net(nn.Module):
    def __init__(self, channels: int = 3, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding="same")
        self.block1 = Block(width, width, 1)
        self.block2 = Block(width, 2 * width, 2)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = self.block2(self.block1(x))
        return self.head(x.mean(dim=(2, 3)))


def make_data(samples: int, image: int, channels: int, classes: int, seed: int):
    """Gaussian images labelled by a fixed random network (learnable, and the same on every
    rank for a seed)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, channels, image, image, generator=generator)
    teacher = torch.randn(classes, channels * 4, generator=generator)
    pooled = F.adaptive_avg_pool2d(x, 2).flatten(1)
    y = (pooled @ teacher.t()).argmax(dim=1)
    return x, y


def converted_layers(model: nn.Module):
    """(name, plans) of each converted convolution: adopted in place (``module._mucudnn``,
    torch >= 2.10), or replaced by mucudnn's layer (the Python path, older torch)."""
    for module in model.modules():
        if isinstance(module, mt.Conv2d):
            yield module.mucudnn_name, module.plans
        elif hasattr(module.__dict__.get("_mucudnn"), "plans"):
            yield module._mucudnn.name, module._mucudnn.plans


def checksum(model: nn.Module) -> str:
    """A digest of the parameters (BatchNorm's running statistics are per rank under DDP)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--image", type=int, default=16)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workspace-limit", default="64MiB")
    parser.add_argument(
        "--cache", default=None,
        help="tuning cache file (default: mucudnn's); {rank} is replaced by the rank",
    )
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--report", type=Path, default=None, help="write rank<R>.json here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    use_cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Net(width=args.width)
    cache = args.cache.format(rank=rank) if args.cache else None
    mt.convert_(model, workspace_limit=args.workspace_limit, cache=cache)
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    x_all, y_all = make_data(args.batch * world * 4, args.image, 3, 10, args.seed + 1)
    shard = slice(rank * args.batch, (rank + 1) * args.batch)

    def batch(step: int):
        start = (step % 4) * args.batch * world
        x = x_all[start : start + args.batch * world][shard].to(device)
        y = y_all[start : start + args.batch * world][shard].to(device)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    tuned = mt.tune(model, batch(0)[0], verbose=rank == 0)
    if rank == 0:
        print(f"tuning: {tuned.seconds:.2f} s for {tuned.layers} layer(s), {tuned.shapes} shape(s) "
              f"({tuned.tasks_dealt} measuring task(s) dealt over {world} rank(s): "
              f"{tuned.measured} measured here, {tuned.shared} shared, {tuned.cached} cached)")

    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step)
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - started
    plans = {
        name: {
            "x".join(map(str, shape)): {op: info["split"] for op, info in report.ops.items()}
            for shape, report in layer_plans.items()
        }
        for name, layer_plans in converted_layers(model)
    }
    if rank == 0:
        print(f"{args.steps} steps in {seconds:.2f} s on {world} rank(s) ({device.type})")
        for layer, shapes in plans.items():
            for shape, ops in shapes.items():
                print(f"  {layer:<18} {shape:<12} " + "  ".join(f"{op} {s}" for op, s in ops.items()))
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "world_size": world,
                    "losses": losses,
                    "checksum": checksum(model),
                    "plans": plans,
                    "tasks_dealt": tuned.tasks_dealt,
                    "tasks_here": tuned.tasks_here,
                    "measured": tuned.measured,
                    "shared": tuned.shared,
                    "cached": tuned.cached,
                    "tuning_seconds": tuned.seconds,
                },
                indent=1,
            )
        )
    if distributed:
        # Every rank is done (and has written its report) before the group is torn down:
        # gloo aborts a process whose peer closed the connection first.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

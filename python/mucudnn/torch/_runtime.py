"""What the custom ops run: per-layer configurations, tuners per device, tuning on first sight
of an input shape, and execution over tensor pointers.

The ops take the layer's configuration as an integer id (schemas hold no Python objects, and an
int keeps ``torch.compile`` graphs free of them); :func:`register` hands one out per layer.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import _tuner
from .._lib import MucudnnError
from .._tuner import BACKWARD_DATA, BACKWARD_FILTER, FORWARD, PreparedSet, Settings, Tuner

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

#: (device type, device index, dtype, layout, input shape): one prepared plan set.
ShapeKey = Tuple[str, int, torch.dtype, str, Tuple[int, int, int, int]]


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor runs as NHWC: packed channels-last and not also plain contiguous
    (a tensor with one channel or 1x1 pixels is both; it runs as NCHW)."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def memory_format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if is_channels_last(t) else torch.contiguous_format


def layout_of(t: torch.Tensor) -> str:
    return "nhwc" if is_channels_last(t) else "nchw"


def output_hw(
    h: int, w: int, r: int, s: int, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Tuple[int, int]:
    p = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    q = (w + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return p, q


@dataclass
class PlanReport:
    """How one input shape of a layer runs: per op, the split (``COUNTxSIZE@algo`` runs), the
    candidates used, the predicted time and the workspace; how long tuning took and how many
    measurements came from the cache or were measured."""

    shape: Tuple[int, int, int, int]
    dtype: str
    layout: str
    device: str
    ops: Dict[str, Dict[str, Any]]
    tuning_seconds: float
    cached: int
    measured: int
    #: Why this shape runs PyTorch's convolution instead (no plan), else None.
    fallback: Optional[str] = None

    def __str__(self) -> str:
        n, c, h, w = self.shape
        lines = [f"{n}x{c}x{h}x{w} {self.dtype} {self.layout} on {self.device}:"]
        if self.fallback is not None:
            lines.append(f"  PyTorch's convolution (no mucudnn plan: {self.fallback})")
        for op, info in self.ops.items():
            lines.append(
                f"  {op:<10} {info['split']:<40} predicted {info['time_ms']:9.3f} ms  "
                f"workspace {info['workspace_bytes']} B"
            )
        return "\n".join(lines)


def report_of(key: ShapeKey, result: Dict[str, Any], seconds: float) -> PlanReport:
    device_type, index, dtype, layout, shape = key
    ops = {}
    for plan, split in zip(result["plans"], result["splits"]):
        micro = plan["micro_batches"]
        ops[plan["op"]] = {
            "split": split,
            "algorithms": sorted({str(m["algo"]) for m in micro}),
            "time_ms": sum(m["time_ms"] for m in micro),
            "workspace_bytes": max((m["workspace_bytes"] for m in micro), default=0),
        }
    return PlanReport(
        shape=shape,
        dtype=DTYPES[dtype],
        layout=layout,
        device=device_type if index < 0 else f"{device_type}:{index}",
        ops=ops,
        tuning_seconds=seconds,
        cached=int(result.get("cached", 0)),
        measured=int(result.get("measured", 0)),
    )


class LayerConfig:
    """A layer's name, tuning settings and cache, and its prepared plan sets by input shape."""

    def __init__(
        self, name: str, settings: Settings, cache: Any, verbose: bool, fallback: bool = True
    ):
        self.name = name
        self.settings = settings
        self.cache = cache
        self.verbose = verbose
        self.fallback = fallback
        self.prepared: Dict[ShapeKey, Optional[PreparedSet]] = {}
        self.reports: Dict[ShapeKey, PlanReport] = {}
        self.workspaces: Dict[ShapeKey, torch.Tensor] = {}
        self.lock = threading.Lock()

    def release(self) -> None:
        for prepared in self.prepared.values():
            try:
                if prepared is not None:
                    prepared.release()
            except MucudnnError:
                pass
        self.prepared.clear()
        self.workspaces.clear()

    def adopt(self, key: ShapeKey, result: Dict[str, Any], seconds: float) -> PreparedSet:
        """Prepares plans tuned elsewhere (or just now) for ``key``."""
        device_type, index, _, _, _ = key
        tuner = tuner_for(device_type, index, self.cache, self.verbose)
        prepared = tuner.prepare(result["plans"])
        with self.lock:
            old = self.prepared.pop(key, None)
            if old is not None:
                old.release()
            self.prepared[key] = prepared
            self.reports[key] = report_of(key, result, seconds)
            if device_type == "cpu" and max(prepared.workspace) > 0:
                self.workspaces[key] = torch.empty(max(prepared.workspace), dtype=torch.uint8)
        return prepared


_configs: Dict[int, LayerConfig] = {}
_ids = itertools.count(1)
_registry_lock = threading.Lock()


def register(config: LayerConfig, owner: Any) -> int:
    """Registers ``config`` under a new id, released when ``owner`` is garbage-collected."""
    with _registry_lock:
        config_id = next(_ids)
        _configs[config_id] = config
    weakref.finalize(owner, _forget, config_id)
    return config_id


def _forget(config_id: int) -> None:
    with _registry_lock:
        config = _configs.pop(config_id, None)
    if config is not None:
        config.release()


def lookup(config_id: int) -> LayerConfig:
    config = _configs.get(config_id)
    if config is None:
        raise RuntimeError(
            f"mucudnn: layer configuration {config_id} does not exist (the layer was deleted, "
            "or the op was called with an id no mucudnn Conv2d made)"
        )
    return config


_tuners: Dict[Tuple[str, int, str], Tuner] = {}
_tuners_lock = threading.Lock()


def tuner_for(device_type: str, index: int, cache: Any, verbose: bool = False) -> Tuner:
    """The process's tuner for a device and cache (made on first use)."""
    cache_key = "default" if cache is None else ("memory" if cache is False else str(cache))
    key = (device_type, index, cache_key)
    with _tuners_lock:
        tuner = _tuners.get(key)
        if tuner is None:
            device = -1 if device_type == "cpu" else index
            if device_type == "cuda":
                # torch loads its libcudnn on import; mucudnn must use that same copy (_lib).
                torch.backends.cudnn.version()
            tuner = Tuner(device=device, cache=cache, verbose=verbose)
            _tuners[key] = tuner
        return tuner


def device_of(t: torch.Tensor) -> Tuple[str, int]:
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return "cuda", index
    return t.device.type, -1


def shape_key(x: torch.Tensor) -> ShapeKey:
    device = x.device
    if device.type == "cpu":
        return ("cpu", -1, x.dtype, layout_of(x), tuple(x.shape))
    device_type, index = device_of(x)
    return (device_type, index, x.dtype, layout_of(x), tuple(x.shape))


def problem_for(
    x: torch.Tensor,
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Dict[str, Any]:
    n, c, h, w = (int(d) for d in x.shape)
    k, _, r, s = (int(d) for d in weight_shape)
    return _tuner.problem(
        n=n, c=c, h=h, w=w, k=k, r=r, s=s, padding=padding, stride=stride, dilation=dilation,
        groups=groups, dtype=DTYPES[x.dtype], layout=layout_of(x),
    )


_warned_distributed = False

#: Tuning failures that leave a shape to PyTorch's convolution (with ``fallback=True``): no
#: candidate supports the problem, or no plan fits the workspace limit.
FALLBACK_STATUSES = ("SOLVER_ERROR", "NOT_SUPPORTED")


def plans_for(
    config: LayerConfig,
    x: torch.Tensor,
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Tuple[ShapeKey, PreparedSet]:
    """The prepared plans for input ``x``: tuned through the cache on first sight."""
    key = shape_key(x)
    if key in config.prepared:
        return key, config.prepared[key]
    device_type, index, _, _, _ = key
    if device_type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{config.name}: input shape {tuple(x.shape)} was not tuned before CUDA graph "
                "capture; run the model once (or mucudnn.torch.tune(model, example)) before "
                "capturing"
            )
        torch.cuda.synchronize(index)  # measure on a quiet GPU
    global _warned_distributed
    if (
        not _warned_distributed
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        _warned_distributed = True
        print(
            f"mucudnn: {config.name} tunes input shape {tuple(x.shape)} on this rank alone; call "
            "mucudnn.torch.tune(model, example_inputs) before training to deal tuning out over "
            "the ranks and run identical plans on every rank",
            file=sys.stderr,
        )
    tuner = tuner_for(device_type, index, config.cache, config.verbose)
    problem = problem_for(x, weight_shape, stride, padding, dilation, groups)
    started = time.perf_counter()
    try:
        result = tuner.tune(config.name, problem, config.settings)
    except MucudnnError as e:
        if config.fallback and e.status in FALLBACK_STATUSES:
            fall_back(config, key, str(e), time.perf_counter() - started)
            return key, None
        raise RuntimeError(f"{config.name}: tuning input shape {tuple(x.shape)} failed: {e}") from e
    prepared = config.adopt(key, result, time.perf_counter() - started)
    return key, prepared


def fall_back(config: LayerConfig, key: ShapeKey, reason: str, seconds: float) -> None:
    """Leaves ``key`` to PyTorch's convolution, saying so once on stderr."""
    device_type, index, dtype, layout, shape = key
    with config.lock:
        config.prepared[key] = None
        config.reports[key] = PlanReport(
            shape=shape, dtype=DTYPES[dtype], layout=layout,
            device=device_type if index < 0 else f"{device_type}:{index}", ops={},
            tuning_seconds=seconds, cached=0, measured=0, fallback=reason,
        )
    print(
        f"mucudnn: warning: {config.name}: input shape {shape} ({DTYPES[dtype]} {layout}) runs "
        f"PyTorch's convolution: {reason}",
        file=sys.stderr,
    )


def run(
    config: LayerConfig,
    key: ShapeKey,
    prepared: PreparedSet,
    op: int,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out = op(a, b)`` with the prepared plan (on ``out``'s device and current stream)."""
    needed = prepared.workspace[op]
    workspace = None
    stream = 0
    if out.device.type == "cuda":
        if needed:
            workspace = torch.empty(needed, dtype=torch.uint8, device=out.device)
        stream = torch.cuda.current_stream(out.device).cuda_stream
    elif needed:
        workspace = config.workspaces.get(key)
    try:
        prepared.tuner.execute(
            prepared.id,
            op,
            a.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            workspace=workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes=needed if workspace is not None else 0,
            stream=stream,
        )
    except MucudnnError as e:
        raise RuntimeError(f"{config.name}: {e}") from e


#: Base alignment the GPU path asks of every operand: engine plans declare the alignment of the
#: micro-batch offsets they run at, relative to an aligned base (PyTorch's caching allocator
#: hands out 512-byte aligned blocks; a view into one may start anywhere).
GPU_BASE_ALIGNMENT = 256


def aligned(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """``t``, or an aligned copy of it when it is a CUDA tensor starting at an unaligned
    address (a view with a storage offset)."""
    if t.is_cuda and t.data_ptr() % GPU_BASE_ALIGNMENT:
        return t.clone(memory_format=fmt)
    return t


def forward(
    config_id: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    config = lookup(config_id)
    fmt = memory_format(x)
    x = x.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    p, q = output_hw(h, w, r, s, stride, padding, dilation)
    y = torch.empty((n, k, p, q), dtype=x.dtype, device=x.device, memory_format=fmt)
    if y.numel() > 0:
        x, weight = aligned(x, fmt), aligned(weight, fmt)
        key, prepared = plans_for(config, x, weight.shape, stride, padding, dilation, groups)
        if prepared is None:
            y = F.conv2d(x, weight, None, stride, padding, dilation, groups)
            y = y.contiguous(memory_format=fmt)
        else:
            run(config, key, prepared, FORWARD, x, weight, y)
    if bias is not None:
        y.add_(bias.view(1, -1, 1, 1))
    return y


def _backward(
    op: int,
    config_id: int,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    """The data gradient (``op`` = BACKWARD_DATA: of ``x``'s shape, from ``weight`` and
    ``grad_output``) or the filter gradient (BACKWARD_FILTER: of ``weight``'s shape, from ``x``
    and ``grad_output``), in ``x``'s memory format."""
    config = lookup(config_id)
    fmt = memory_format(x)
    data = op == BACKWARD_DATA
    shape = x.shape if data else weight.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if x.numel() == 0 or weight.numel() == 0:
        return out.zero_()
    grad_output = aligned(grad_output.contiguous(memory_format=fmt), fmt)
    # The operand the op reads besides dy: w for the data gradient, x for the filter's.
    other = aligned((weight if data else x).contiguous(memory_format=fmt), fmt)
    key, prepared = plans_for(config, x, weight.shape, stride, padding, dilation, groups)
    if prepared is None:
        geometry = (stride, padding, dilation, groups)
        if data:
            out = torch.nn.grad.conv2d_input(x.shape, other, grad_output, *geometry)
        else:
            out = torch.nn.grad.conv2d_weight(other, weight.shape, grad_output, *geometry)
        return out.contiguous(memory_format=fmt)
    run(config, key, prepared, op, other, grad_output, out)
    return out


def backward_data(config_id: int, grad_output, x, weight, stride, padding, dilation, groups):
    return _backward(
        BACKWARD_DATA, config_id, grad_output, x, weight, stride, padding, dilation, groups
    )


def backward_filter(config_id: int, grad_output, x, weight, stride, padding, dilation, groups):
    return _backward(
        BACKWARD_FILTER, config_id, grad_output, x, weight, stride, padding, dilation, groups
    )


@dataclass
class Discovery:
    """Records, while active, the inputs each converted layer sees (for :func:`tune`)."""

    seen: List[Tuple[Any, torch.Tensor, List[int], List[int], List[int], int]] = field(
        default_factory=list
    )


_discovery = threading.local()


def active_discovery() -> Optional[Discovery]:
    return getattr(_discovery, "value", None)


def set_discovery(value: Optional[Discovery]) -> None:
    _discovery.value = value

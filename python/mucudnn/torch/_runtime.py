"""What the custom ops run: layer configurations, tuners per device, tuning on first sight of a
problem, and execution over tensor pointers.

The ops take the layer's configuration as a string: the canonical JSON of its name, tuning
settings, cache, ``verbose`` and ``fallback`` (:func:`config_text`). It is a plain value that
means the same thing in every process, so a traced, exported or compiled graph runs anywhere:
the process-wide table :data:`_configs` finds (or makes) the configuration by that string, and
the configuration finds its prepared plans by the full problem read from the tensors and the
geometry at each call (:func:`plan_key`: device, dtype, layout, input and weight shapes, stride,
padding, dilation, groups, and PyTorch's TF32 and determinism switches). Anything that changes
makes another key, which is tuned through the cache; no plan ever runs over tensors of another
problem (and the C ABI checks each operand's dims and extent against the plan again).

One code path serves 2 and 3 spatial dims (4-D and 5-D tensors; ``spatial`` below); 1-D layers
run as 2-D with a unit height (views of their tensors). A transposed convolution is the
convolution problem whose input is the transposed layer's output (``n = N``, ``c = Cout``,
``k = Cin``, the same kernel and geometry): its forward runs that problem's backward-data plan,
its input gradient the forward plan and its weight gradient the backward-filter plan, so the
three share one plan set (:func:`transposed_forward`).

A key's plan set holds the ops tuned so far (:attr:`Ready.has`). A forward that no backward
will follow (gradients off, or neither the input nor the weight requires one;
:func:`backward_expected`) tunes and prepares only the op it runs: inference measures a third
of what training does. A backward that finds its op missing tunes the missing ops then,
prepares them with the others, and runs (:func:`plans_for`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import _tuner
from .._lib import MucudnnError
from .._tuner import BACKWARD_DATA, BACKWARD_FILTER, FORWARD, PreparedSet, Settings, Tuner

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

class PlanKey(NamedTuple):
    """Everything that defines a prepared plan set (:func:`plan_key`). A tuple of plain values
    (equal to, and hashing as, the tuple of its fields in this order), so it keys dicts and
    caches across layers and threads."""

    #: ``"cuda"``, ``"cpu"`` or ``"meta"``.
    device_type: str
    #: The CUDA device's index; -1 off CUDA.
    device_index: int
    dtype: torch.dtype
    #: mucudnn's layout name (``nchw``, ``nhwc``, ``ncdhw``, ``ndhwc``).
    layout: str
    #: The convolution problem's input shape (for a transposed layer its output).
    input_shape: Tuple[int, ...]
    weight_shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int
    #: cuDNN's math mode: ``"fma"`` (fp32 with TF32 off) or ``"default"``.
    math: str
    #: Only deterministic candidates (PyTorch's determinism switches).
    deterministic: bool

    @property
    def device(self) -> str:
        """The device in words: ``cuda:0``, ``cpu``."""
        if self.device_index < 0:
            return self.device_type
        return f"{self.device_type}:{self.device_index}"


#: Spatial dims -> (PyTorch's channels-last memory format, the layout names of mucudnn).
_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
_LAYOUTS = {2: ("nchw", "nhwc"), 3: ("ncdhw", "ndhwc")}


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-D (5-D) tensor runs as NHWC (NDHWC): packed ``channels_last``
    (``channels_last_3d``) and not also plain contiguous (a tensor with one channel or one
    pixel is both; it runs as NCHW)."""
    last = _LAST.get(t.dim() - 2)
    return last is not None and t.is_contiguous(memory_format=last) and not t.is_contiguous()


def memory_format(t: torch.Tensor) -> torch.memory_format:
    return _LAST[t.dim() - 2] if is_channels_last(t) else torch.contiguous_format


def layout_name(fmt: torch.memory_format, spatial: int) -> str:
    """mucudnn's layout for a memory format at 2 or 3 spatial dims (``nhwc``, ``ndhwc``, ...)."""
    return _LAYOUTS[spatial][fmt is _LAST[spatial]]


def layout_of(t: torch.Tensor) -> str:
    return layout_name(memory_format(t), t.dim() - 2)


def output_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> Tuple[int, ...]:
    """A convolution's output spatial size, per dim (any number of spatial dims)."""
    return tuple(
        (i + 2 * p - d * (k - 1) - 1) // st + 1
        for i, k, st, p, d in zip(size, kernel, stride, padding, dilation)
    )


def output_hw(
    h: int, w: int, r: int, s: int, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Tuple[int, int]:
    p, q = output_size((h, w), (r, s), stride, padding, dilation)
    return p, q


def transposed_size(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
) -> Tuple[int, ...]:
    """A transposed convolution's output spatial size (PyTorch's formula), per dim."""
    return tuple(
        (i - 1) * st - 2 * p + d * (k - 1) + op + 1
        for i, k, st, p, op, d in zip(size, kernel, stride, padding, output_padding, dilation)
    )


def format_bytes(value: Optional[int]) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of 1024, as sizes are given to ``workspace_limit``)."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


#: The ops' names by their numbers (FORWARD, BACKWARD_DATA, BACKWARD_FILTER).
OP_NAMES = _tuner.OPS
ALL_OPS = (FORWARD, BACKWARD_DATA, BACKWARD_FILTER)


@dataclass
class PlanReport:
    """How one input shape of a layer runs: per op, the split (``COUNTxSIZE@algo`` runs), the
    candidates used, the predicted time and the workspace; how long tuning took and how many
    measurements came from the cache or were measured."""

    #: The convolution problem's input shape (n, c, h, w) or (n, c, d, h, w); for a
    #: transposed layer that is the layer's output (see the module docs), for a 1-D layer the
    #: 2-D shape with unit height.
    shape: Tuple[int, ...]
    dtype: str
    layout: str
    device: str
    #: Per op tuned so far (``"fwd"``, ``"bwd_data"``, ``"bwd_filter"``; inference tunes only
    #: the op the layer's forward runs): ``split`` (its ``COUNTxSIZE@algo`` runs, then
    #: ``along h`` (``d``, ``w``) when it splits a spatial dimension), ``dimension``
    #: (``"batch"``: micro-batches; ``"spatial"``: chunks of rows along the outermost spatial
    #: dimension of the op's split tensor), ``calls`` (micro-batches or chunks), ``algorithms``,
    #: ``time_ms`` (predicted) and ``workspace_bytes``.
    ops: Dict[str, Dict[str, Any]]
    tuning_seconds: float
    cached: int
    measured: int
    #: Why this shape runs PyTorch's convolution instead (no plan), else None.
    fallback: Optional[str] = None
    #: The weight's shape (k, c/groups, r, s), or (k, c/groups, t, r, s), the plans are for.
    weight_shape: Tuple[int, ...] = ()
    #: The convolution problem's output shape (n, k, p, q) or (n, k, o, p, q).
    output_shape: Tuple[int, ...] = ()
    #: cuDNN's math mode (``"fma"`` when ``torch.backends.cudnn.allow_tf32`` is off for fp32).
    math: str = "default"
    #: Whether only deterministic candidates were used (PyTorch's determinism switches).
    deterministic: bool = False
    #: Timings the tuning skipped because the candidate's workspace exceeded the limit.
    skipped: int = 0
    #: The most memory the tuning's measuring held at once (operands plus workspace; device
    #: memory on a GPU, host memory on the CPU); 0 when nothing was measured.
    peak_measuring_memory_bytes: int = 0
    #: The layer whose plans this shape reuses (same problem, tuned first by that layer).
    same_as: Optional[str] = None

    @property
    def spatial_ops(self) -> Tuple[str, ...]:
        """The names of the ops whose plans split a spatial dimension (chunks of rows, not
        micro-batches), in ``fwd, bwd_data, bwd_filter`` order."""
        return tuple(op for op, info in self.ops.items() if info.get("dimension") == "spatial")

    @property
    def tuned_ops(self) -> Tuple[str, ...]:
        """The names of the ops this shape has plans for, in ``fwd, bwd_data, bwd_filter``
        order (all three after training saw it; the forward's op alone after inference)."""
        return tuple(op for op in OP_NAMES if op in self.ops)

    @property
    def source(self) -> str:
        """Where the plans came from, in words: measured here, from the cache, or another
        layer's."""
        if self.same_as is not None:
            return f"plans of {self.same_as}"
        if self.measured == 0 and self.cached == 0:
            return "plans cached"
        return f"{self.measured} measured, {self.cached} cached"

    def rows(self) -> List[Tuple[str, str, str, str, str]]:
        """(op, split, predicted, workspace, source) per op; one row for a fallback."""
        if self.fallback is not None:
            return [("-", "PyTorch's convolution", "-", "-", f"no plan: {self.fallback}")]
        source = f"{self.source}, {self.tuning_seconds:.2f} s"
        return [
            (
                op,
                info["split"],
                f"{info['time_ms']:.3f} ms",
                format_bytes(info["workspace_bytes"]),
                source,
            )
            for op, info in self.ops.items()
        ]

    def __str__(self) -> str:
        lines = [f"{'x'.join(map(str, self.shape))} {self.dtype} {self.layout} on {self.device}:"]
        if self.fallback is not None:
            lines.append(f"  PyTorch's convolution (no mucudnn plan: {self.fallback})")
        for op, info in self.ops.items():
            lines.append(
                f"  {op:<10} {info['split']:<40} predicted {info['time_ms']:9.3f} ms  "
                f"workspace {info['workspace_bytes']} B"
            )
        untuned = [op for op in OP_NAMES if op not in self.ops]
        if self.fallback is None and untuned:
            lines.append(f"  {', '.join(untuned)} not tuned (no backward yet)")
        lines.append(
            f"  {self.source} in {self.tuning_seconds:.2f} s, peak measuring memory "
            f"{format_bytes(self.peak_measuring_memory_bytes)}"
        )
        return "\n".join(lines)


class Plans(Mapping):
    """A layer's plans by its input shape (``(n, c, h, w)`` for a Conv2d; ``(n, c, l)``,
    ``(n, c, d, h, w)`` for the other ranks; a transposed layer's input too) (a read-only mapping to
    :class:`PlanReport`) that prints as a table: one row per shape and op with the split
    (micro-batch counts, sizes and algorithm names), the predicted time, the workspace and where
    the plans came from, then the peak measuring memory of the tuning."""

    def __init__(self, layer: str, reports: Dict[Tuple[int, ...], PlanReport]):
        self.layer = layer
        self._reports = reports

    def __getitem__(self, shape: Tuple[int, ...]) -> PlanReport:
        return self._reports[tuple(shape)]

    def __iter__(self) -> Iterator[Tuple[int, ...]]:
        return iter(self._reports)

    def __len__(self) -> int:
        return len(self._reports)

    @property
    def peak_measuring_memory_bytes(self) -> int:
        """The most memory any of these shapes' tuning held at once while measuring."""
        return max((r.peak_measuring_memory_bytes for r in self._reports.values()), default=0)

    def __str__(self) -> str:
        if not self._reports:
            return f"{self.layer}: no input shape tuned yet"
        header = ("shape", "dtype", "op", "split", "predicted", "workspace", "plans from")
        rows = []
        for shape, report in self._reports.items():
            first = True
            for op, split, predicted, workspace, source in report.rows():
                label = "x".join(map(str, shape)) if first else ""
                kind = f"{report.dtype} {report.layout}" if first else ""
                rows.append((label, kind, op, split, predicted, workspace, source if first else ""))
                first = False
        widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
        right = {4, 5}  # numbers align right

        def line(row) -> str:
            cells = [
                str(v).rjust(widths[i]) if i in right else str(v).ljust(widths[i])
                for i, v in enumerate(row)
            ]
            return "  ".join(cells).rstrip()

        devices = sorted({r.device for r in self._reports.values()})
        lines = [f"{self.layer} on {', '.join(devices)}:", line(header)]
        lines.extend(line(row) for row in rows)
        lines.append(
            f"peak measuring memory {format_bytes(self.peak_measuring_memory_bytes)}"
        )
        return "\n".join(lines)

    __repr__ = __str__


@functools.lru_cache(maxsize=4096)
def output_shape_of(key: PlanKey) -> Tuple[int, ...]:
    """The convolution problem's output shape ``(n, k, *spatial)`` of a plan key (remembered
    per key: every forward asks)."""
    x_shape, w_shape = key.input_shape, key.weight_shape
    return (x_shape[0], w_shape[0]) + output_size(
        x_shape[2:], w_shape[2:], key.stride, key.padding, key.dilation
    )


def report_of(
    key: PlanKey,
    result: Dict[str, Any],
    seconds: float,
    earlier: Optional[PlanReport] = None,
) -> PlanReport:
    """The report of ``key``'s plans in ``result``; with ``earlier`` (the report of the ops the
    key had before, e.g. the forward's when a backward tunes the others) the two are merged:
    every op's row, the tuning times and counts summed."""
    ops: Dict[str, Dict[str, Any]] = {}
    if earlier is not None and earlier.fallback is None:
        ops.update(earlier.ops)
    for plan, split in zip(result["plans"], result["splits"]):
        micro = plan["micro_batches"]
        ops[plan["op"]] = {
            "split": split,
            "dimension": str(plan.get("split", "batch")),
            "calls": len(micro),
            "algorithms": sorted({str(m["algo"]) for m in micro}),
            "time_ms": sum(m["time_ms"] for m in micro),
            "workspace_bytes": max((m["workspace_bytes"] for m in micro), default=0),
        }
    ops = {op: ops[op] for op in OP_NAMES if op in ops}
    report = PlanReport(
        shape=key.input_shape,
        dtype=DTYPES[key.dtype],
        layout=key.layout,
        device=key.device,
        ops=ops,
        tuning_seconds=seconds,
        cached=int(result.get("cached", 0)),
        measured=int(result.get("measured", 0)),
        weight_shape=key.weight_shape,
        output_shape=output_shape_of(key),
        math=key.math,
        deterministic=key.deterministic,
        skipped=int(result.get("skipped", 0)),
        peak_measuring_memory_bytes=int(result.get("peak_measuring_memory_bytes", 0)),
        same_as=result.get("same_as"),
    )
    if earlier is not None and earlier.fallback is None:
        report.tuning_seconds += earlier.tuning_seconds
        report.cached += earlier.cached
        report.measured += earlier.measured
        report.skipped += earlier.skipped
        report.peak_measuring_memory_bytes = max(
            report.peak_measuring_memory_bytes, earlier.peak_measuring_memory_bytes
        )
        if report.same_as != earlier.same_as:
            report.same_as = None
    return report


class Ready:
    """A prepared plan set and what running it needs: which ops it holds (``has[op]``), the
    operand extents of each op (ctypes arrays, made once from the key's shapes) and, on the
    CPU, the workspace.

    Threads share a layer's sets: a call may hold one that another thread has just replaced
    (:meth:`LayerConfig.adopt`) or that the layer's collection is dropping. So a set counts
    the calls running it, and a retired set is released by the last of them, never under a
    call: :func:`run` enters it or takes the set that replaced it."""

    __slots__ = (
        "prepared", "tuner", "id", "workspace", "extents", "host_workspace", "has", "key",
        "guard", "uses", "retired",
    )

    def __init__(self, prepared: PreparedSet, key: PlanKey):
        self.prepared = prepared
        self.tuner = prepared.tuner
        self.id = prepared.id
        self.workspace = prepared.workspace
        names = prepared.ops
        #: Per op number: whether the set holds its plan.
        self.has = tuple(name in names for name in OP_NAMES)
        x_shape, w_shape, y_shape = key.input_shape, key.weight_shape, output_shape_of(key)
        itemsize = key.dtype.itemsize
        self.extents = [
            _tuner.operand_extents(op, x_shape, w_shape, y_shape, itemsize)
            for op in (FORWARD, BACKWARD_DATA, BACKWARD_FILTER)
        ]
        self.host_workspace: Optional[torch.Tensor] = None
        if key.device_type == "cpu" and max(prepared.workspace) > 0:
            self.host_workspace = torch.empty(max(prepared.workspace), dtype=torch.uint8)
        self.key = key
        self.guard = threading.Lock()
        #: Calls running the set now.
        self.uses = 0
        #: Replaced or dropped: released when no call uses it.
        self.retired = False

    def enter(self) -> bool:
        """Counts a call that runs the set; ``False`` once it is retired."""
        with self.guard:
            if self.retired:
                return False
            self.uses += 1
            return True

    def leave(self) -> None:
        with self.guard:
            self.uses -= 1
            last = self.retired and self.uses == 0
        if last:
            self._release()

    def retire(self) -> None:
        """No new call may run the set; it is released now, or by the last call running it."""
        with self.guard:
            if self.retired:
                return
            self.retired = True
            idle = self.uses == 0
        if idle:
            self._release()

    def _release(self) -> None:
        try:
            self.prepared.release()
        except MucudnnError:
            pass  # a set that cannot be released is only memory; the call that ran it is done


class LayerConfig:
    """A layer's name, tuning settings and cache, and its prepared plan sets by problem
    (:func:`plan_key`). Found by its :func:`config_text` in the process-wide table."""

    def __init__(
        self, name: str, settings: Settings, cache: Any, verbose: bool, fallback: bool = True
    ):
        self.name = name
        self.settings = settings
        self.deterministic_settings = replace(settings, deterministic=True)
        self.cache = cache
        self.verbose = verbose
        self.fallback = fallback
        self.prepared: Dict[PlanKey, Optional[Ready]] = {}
        self.reports: Dict[PlanKey, PlanReport] = {}
        #: Call signatures (:func:`signature`) whose operands passed :func:`check_operands`,
        #: and their plan keys: a call seen before needs one tuple and two dict lookups.
        self.checked: Dict[Tuple[Any, ...], PlanKey] = {}
        self.lock = threading.Lock()
        self.owners = 0
        self.warned_float64 = False
        #: A transposed layer whose output_padding is not below its stride said so once.
        self.warned_output_padding = False
        #: Input shapes whose lazy tuning was announced on stderr (once per shape).
        self.announced: set = set()

    def settings_for(self, key: PlanKey) -> Settings:
        return self.deterministic_settings if key.deterministic else self.settings

    def release(self) -> None:
        with self.lock:
            prepared = [p for p in self.prepared.values() if p is not None]
            self.prepared.clear()
        for ready in prepared:
            ready.retire()

    def adopt(self, key: PlanKey, result: Dict[str, Any], seconds: float) -> Ready:
        """Prepares plans tuned elsewhere (or just now) for ``key``: ``result``'s plans, and
        those of the other ops ``key`` had prepared before (one set holds every op tuned so
        far; ``result``'s replace the earlier plans of its ops)."""
        tuner = tuner_for(key.device_type, key.device_index, self.cache, self.verbose)
        earlier = self.prepared.get(key)
        plans = list(result["plans"])
        earlier_report = None
        if earlier is not None:
            given = {plan["op"] for plan in plans}
            kept = [p for p in earlier.prepared.plans if p["op"] not in given]
            if kept:
                plans = kept + plans
                earlier_report = self.reports.get(key)
        ready = Ready(tuner.prepare(plans), key)
        with self.lock:
            old = self.prepared.pop(key, None)
            self.prepared[key] = ready
            self.reports[key] = report_of(key, result, seconds, earlier_report)
        if old is not None:
            old.retire()
        return ready


_CONFIG_KEYS = ("cache", "fallback", "name", "settings", "verbose")


def config_text(name: str, settings: Settings, cache: Any, verbose: bool, fallback: bool) -> str:
    """The op argument that stands for a layer's configuration: canonical JSON of plain values
    (``cache``: a path, ``null`` for the default location, ``false`` for memory only)."""
    if cache is not None and cache is not False:
        cache = str(cache)
    settings_dict = settings.to_dict()
    settings_dict.pop("deterministic")  # read from PyTorch's switches at each call
    settings_dict.pop("ops", None)  # decided per call: whether a backward may follow
    return json.dumps(
        {
            "cache": cache,
            "fallback": bool(fallback),
            "name": str(name),
            "settings": settings_dict,
            "verbose": bool(verbose),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _parse_config(text: str) -> LayerConfig:
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or sorted(doc) != list(_CONFIG_KEYS):
            raise ValueError(f"expected an object with keys {', '.join(_CONFIG_KEYS)}")
        settings = Settings(**doc["settings"])
        if settings.split not in _tuner.SPLITS:
            raise ValueError(f"split {settings.split!r} is not one of {', '.join(_tuner.SPLITS)}")
        if not isinstance(doc["name"], str):
            raise ValueError("name is not a string")
        if doc["cache"] is not None and doc["cache"] is not False and not isinstance(doc["cache"], str):
            raise ValueError("cache is not a path, null or false")
    except (ValueError, TypeError, KeyError) as e:
        raise RuntimeError(
            f"mucudnn: {text[:200]!r} is not a mucudnn layer configuration ({e}); the op's last "
            "argument is what a mucudnn.torch.Conv2d passes (its _mucudnn_config)"
        ) from None
    return LayerConfig(doc["name"], settings, doc["cache"], bool(doc["verbose"]), bool(doc["fallback"]))


#: The process's layer configurations by their text (see the module docs).
_configs: Dict[str, LayerConfig] = {}
_registry_lock = threading.Lock()


def config_for(text: str) -> LayerConfig:
    """The configuration a layer (or a graph) names by ``text``, made on first use."""
    config = _configs.get(text)
    if config is None:
        if not isinstance(text, str):
            raise RuntimeError(f"mucudnn: the layer configuration must be a string, not {text!r}")
        made = _parse_config(text)
        with _registry_lock:
            config = _configs.setdefault(text, made)
    return config


def retain(text: str, owner: Any) -> LayerConfig:
    """Counts ``owner`` (a layer) as a user of the configuration ``text``; when its last layer
    is garbage-collected, the prepared plans are released (a graph that still names it
    prepares them again, from the cache)."""
    config = config_for(text)
    with _registry_lock:
        config.owners += 1
    weakref.finalize(owner, _disown, text)
    return config


def _disown(text: str) -> None:
    with _registry_lock:
        config = _configs.get(text)
        if config is None:
            return
        config.owners -= 1
        if config.owners > 0:
            return
        del _configs[text]
    config.release()


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


_cudnn_flags = torch.backends.cudnn


def plan_key(
    x: torch.Tensor,
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    layout: Optional[str] = None,
    x_shape: Optional[Sequence[int]] = None,
) -> PlanKey:
    """Everything that defines the plans of a convolution of ``x`` (its device and dtype; its
    shape unless ``x_shape`` gives the problem's input shape, as for a transposed layer), read
    now: the device, dtype, layout and shapes, the geometry, and PyTorch's switches
    (``allow_tf32`` off maps fp32 to cuDNN's FMA math; ``deterministic`` or
    ``use_deterministic_algorithms`` admits only deterministic candidates)."""
    device = x.device
    if device.type == "cuda":
        device_type, index = device_of(x)
    else:
        device_type, index = device.type, -1
    dtype = x.dtype
    math = "fma" if dtype is torch.float32 and not _cudnn_flags.allow_tf32 else "default"
    deterministic = bool(
        _cudnn_flags.deterministic or torch.are_deterministic_algorithms_enabled()
    )
    shape = tuple(x.shape if x_shape is None else (int(v) for v in x_shape))
    return PlanKey(
        device_type, index, dtype, layout or layout_of(x), shape, tuple(weight_shape),
        tuple(stride), tuple(padding), tuple(dilation), groups, math, deterministic,
    )


def signature(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
    grad_output: Optional[torch.Tensor] = None,
    output_padding: Optional[Sequence[int]] = None,
) -> Tuple[Any, ...]:
    """Everything :func:`check_operands` and :func:`plan_key` read from one call, as a
    hashable tuple: shapes, dtypes and devices of every operand, the input's memory format,
    the geometry (a transposed call's ``output_padding`` too) and PyTorch's switches. Equal
    signatures pass the same checks and run the same plans, so both are decided once per
    signature."""
    return (
        x.shape, weight.shape, x.dtype, weight.dtype, x.device, weight.device,
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        None if grad_output is None
        else (grad_output.shape, grad_output.dtype, grad_output.device),
        fmt, tuple(stride), tuple(padding), tuple(dilation), groups,
        None if output_padding is None else tuple(output_padding),
        _cudnn_flags.allow_tf32, _cudnn_flags.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )


def checked_key(
    config: LayerConfig,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
    grad_output: Optional[torch.Tensor] = None,
) -> PlanKey:
    """The plan key of a call whose operands agree (:func:`check_operands`, which raises
    otherwise), checked once per call signature."""
    call = signature(x, weight, bias, stride, padding, dilation, groups, fmt, grad_output)
    key = config.checked.get(call)
    if key is None:
        check_operands(
            config.name, spatial, x, weight, bias, stride, padding, dilation, groups, grad_output
        )
        layout = layout_name(fmt, spatial)
        key = plan_key(x, weight.shape, stride, padding, dilation, groups, layout)
        config.checked[call] = key
    return key


def problem_of(key: PlanKey) -> Dict[str, Any]:
    """The C ABI's problem (JSON object) of a plan key, 2-D or 3-D (depth fields)."""
    x_shape, w_shape = key.input_shape, key.weight_shape
    n, c, h, w = x_shape[0], x_shape[1], x_shape[-2], x_shape[-1]
    k, r, s = w_shape[0], w_shape[-2], w_shape[-1]
    depth = {} if len(x_shape) == 4 else {"d": x_shape[2], "t": w_shape[2]}
    return _tuner.problem(
        n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=key.stride, padding=key.padding,
        dilation=key.dilation, groups=key.groups, dtype=DTYPES[key.dtype], layout=key.layout,
        math=key.math, **depth,
    )


_warned_distributed = False

#: Tuning failures that leave a shape to PyTorch's convolution (with ``fallback=True``): no
#: candidate supports the problem, or no plan fits the workspace limit.
FALLBACK_STATUSES = ("SOLVER_ERROR", "NOT_SUPPORTED")


def plans_for(
    config: LayerConfig, key: PlanKey, ops: Sequence[int] = ALL_OPS
) -> Optional[Ready]:
    """The prepared plans of ``key`` holding at least ``ops`` (op numbers): the ops it lacks
    are tuned through the cache (on first sight, or when a backward follows an inference
    forward) and prepared with those it had; ``None`` when the problem runs PyTorch's
    convolution instead (no plan, with ``fallback``)."""
    earlier = config.prepared.get(key, _MISSING)
    if earlier is None:
        return None
    missing = [op for op in ops if earlier is _MISSING or not earlier.has[op]]
    if not missing:
        return earlier
    # A key may come as the plain tuple of its fields (equal to the PlanKey): read it by name.
    key = PlanKey._make(key)
    device_type, index = key.device_type, key.device_index
    shape = key.input_shape
    if device_type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            what = (
                f"input shape {shape} was not tuned" if earlier is _MISSING
                else f"input shape {shape} has no {', '.join(OP_NAMES[op] for op in missing)} "
                "plan (its forward was tuned for inference)"
            )
            raise RuntimeError(
                f"{config.name}: {what} before CUDA graph capture; run the model once (a "
                "training step, to capture one) or mucudnn.torch.tune(model, example) before "
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
            f"mucudnn: {config.name} tunes input shape {shape} on this rank alone; call "
            "mucudnn.torch.tune(model, example_inputs) before training to deal tuning out over "
            "the ranks and run identical plans on every rank",
            file=sys.stderr,
        )
    # A value past what mucudnn's problems hold (a stride of 2^31) is PyTorch's to run, as an
    # unsupported problem is: with fallback, not an error.
    problem = problem_of(key)
    too_large = [f"{name} = {value}" for name, value in problem.items()
                 if isinstance(value, int) and value > 2**31 - 1]
    if too_large:
        reason = f"{', '.join(too_large)} is more than 2^31 - 1, which mucudnn's problems hold"
        if config.fallback:
            fall_back(config, key, reason, 0.0)
            return None
        raise RuntimeError(f"{config.name}: input shape {shape}: {reason}")
    tuner = tuner_for(device_type, index, config.cache, config.verbose)
    settings = config.settings_for(key)
    if len(missing) < len(ALL_OPS):
        settings = replace(settings, ops=tuple(OP_NAMES[op] for op in missing))
    started = time.perf_counter()
    try:
        result = tuner.tune(config.name, problem, settings)
    except MucudnnError as e:
        if config.fallback and e.status in FALLBACK_STATUSES:
            fall_back(config, key, str(e), time.perf_counter() - started)
            return None
        raise RuntimeError(f"{config.name}: tuning input shape {shape} failed: {e}") from e
    if result.get("measured", 0) == 0 and result.get("cached", 0) == 0:
        result = dict(result, same_as=_tuned_by_another(config, key))
    ready = adopt_or_fall_back(config, key, result, time.perf_counter() - started)
    _announce_lazy(config, key, time.perf_counter() - started)
    return ready


def quiet() -> bool:
    """Whether the user asked for quiet (``MUCUDNN_QUIET=1``): no line per lazily tuned shape."""
    return os.environ.get("MUCUDNN_QUIET", "").strip().lower() not in ("", "0", "false", "no")


def _announce_lazy(config: LayerConfig, key: PlanKey, seconds: float) -> None:
    """One line on stderr per new input shape a layer tunes on first use (not under
    :func:`mucudnn.torch.tune`, which prints its own), unless :func:`quiet`."""
    shape = key.input_shape
    if quiet() or shape in config.announced:
        return
    config.announced.add(shape)
    report = config.reports.get(key)
    source = f", {report.source}" if report is not None and report.fallback is None else ""
    print(
        f"mucudnn: {config.name}: tuned input shape {'x'.join(map(str, shape))} "
        f"({DTYPES[key.dtype]} {key.layout}) on first use in {seconds:.2f} s{source}; call "
        "mucudnn.torch.tune(model, example_inputs) ahead of training to tune before the first "
        "step (MUCUDNN_QUIET=1 silences this)",
        file=sys.stderr,
        flush=True,
    )


def _tuned_by_another(config: LayerConfig, key: PlanKey) -> Optional[str]:
    """The name of another layer of this process with plans for the same problem and settings
    (whose solved plans the cache just returned), if any."""
    for other in list(_configs.values()):
        if (
            other is not config
            and other.cache == config.cache
            and other.settings_for(key) == config.settings_for(key)
            and other.prepared.get(key) is not None
        ):
            return other.name
    return None


def adopt_or_fall_back(
    config: LayerConfig, key: PlanKey, result: Dict[str, Any], seconds: float
) -> Optional[Ready]:
    """Prepares the tuned plans; a plan cuDNN declines to build at its real offsets
    (``PLAN_NOT_SUPPORTED``) leaves the shape to PyTorch's convolution with a warning, unless
    the layer was made with ``fallback=False``."""
    try:
        return config.adopt(key, result, seconds)
    except MucudnnError as e:
        if not config.fallback or e.status != "PLAN_NOT_SUPPORTED":
            raise
        fall_back(config, key, f"the tuned plan cannot be prepared here: {e}", seconds)
        return None


def fall_back(config: LayerConfig, key: PlanKey, reason: str, seconds: float) -> None:
    """Leaves ``key`` to PyTorch's convolution, saying so once on stderr."""
    with config.lock:
        config.prepared[key] = None
        config.reports[key] = PlanReport(
            shape=key.input_shape, dtype=DTYPES[key.dtype], layout=key.layout,
            device=key.device, ops={}, tuning_seconds=seconds, cached=0, measured=0,
            fallback=reason, weight_shape=key.weight_shape, output_shape=output_shape_of(key),
            math=key.math, deterministic=key.deterministic,
        )
    print(
        f"mucudnn: warning: {config.name}: input shape {key.input_shape} "
        f"({DTYPES[key.dtype]} {key.layout}) runs "
        f"PyTorch's convolution: {reason}",
        file=sys.stderr,
    )


def run(
    config: LayerConfig,
    ready: Ready,
    op: int,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out = op(a, b)`` with the prepared plan (on ``out``'s device and current stream). The
    operands are those of the plan's key (checked by the caller); the library checks their
    dims and extents against the plan once more."""
    while not ready.enter():
        # Another thread replaced the set since this call found it; the new one holds every
        # op the old one did.
        newer = config.prepared.get(ready.key)
        if newer is None or newer is ready:
            raise RuntimeError(
                f"{config.name}: the plans of input shape {ready.key.input_shape} were released "
                "while a call was on its way to them"
            )
        ready = newer
    try:
        needed = ready.workspace[op]
        workspace = None
        stream = 0
        if out.is_cuda:
            if needed:
                workspace = torch.empty(needed, dtype=torch.uint8, device=out.device)
            stream = torch.cuda.current_stream(out.device).cuda_stream
        elif needed:
            workspace = ready.host_workspace
        ready.tuner.execute(
            ready.id,
            op,
            a.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            ready.extents[op],
            workspace=workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes=needed if workspace is not None else 0,
            stream=stream,
        )
    except MucudnnError as e:
        raise RuntimeError(f"{config.name}: {e}") from e
    finally:
        ready.leave()


#: Base alignment the GPU path asks of every operand: engine plans declare the alignment of the
#: offsets they run at (a micro-batch's, or a spatial chunk's first row: the library computes
#: both from the plan; nothing here depends on the split), relative to an aligned base
#: (PyTorch's caching allocator hands out 512-byte aligned blocks; a view into one may start
#: anywhere).
GPU_BASE_ALIGNMENT = 256


def aligned(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """``t``, or an aligned copy of it when it is a CUDA tensor starting at an unaligned
    address (a view with a storage offset)."""
    if t.is_cuda and t.data_ptr() % GPU_BASE_ALIGNMENT:
        return t.clone(memory_format=fmt)
    return t


def _geometry(name: str, what: str, value: Any, spatial: int, least: int) -> None:
    if len(value) != spatial or any(int(v) < least for v in value):
        raise RuntimeError(
            f"{name}: {what} must be {spatial} numbers >= {least}, not {list(value)}"
        )


#: PyTorch's functional convolutions by spatial dims (float64 and the fallbacks run them).
_CONV = {2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_INPUT = {2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
_CONV_WEIGHT = {2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def _check_tensors(
    name: str, spatial: int, x: torch.Tensor, operands: List[Tuple[str, torch.Tensor]]
) -> None:
    """Ranks, dtypes and devices: every operand a ``spatial + 2``-D tensor (a bias aside) of
    ``x``'s dtype on ``x``'s device, and a dtype and device mucudnn runs."""
    rank = spatial + 2
    weight = operands[0][1]
    if x.dim() != rank or weight.dim() != rank:
        raise RuntimeError(
            f"{name}: expected a {rank}-D input and weight, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    for what, t in operands:
        if t.dtype != x.dtype:
            raise RuntimeError(
                f"{name}: the input is {x.dtype} but the {what} is {t.dtype}; convert one of "
                "them (e.g. model.to(dtype) or torch.autocast)"
            )
        if t.device != x.device:
            raise RuntimeError(f"{name}: the input is on {x.device} but the {what} is on {t.device}")
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"{name}: {x.device.type} tensors are not supported (cpu, cuda)")
    if x.dtype not in DTYPES and x.dtype is not torch.float64:
        raise RuntimeError(
            f"{name}: {x.dtype} is not supported (float32, float16 and bfloat16 run mucudnn's "
            "plans; float64 runs PyTorch's convolution)"
        )


def check_operands(
    name: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    grad_output: Optional[torch.Tensor] = None,
) -> None:
    """Checks that the operands make one convolution of ``spatial`` (2 or 3) dims before any
    pointer leaves Python: 4-D (5-D) tensors of one dtype on one device, a weight that fits the
    input's channels and groups, a bias of ``k`` values, a positive output, and (backward) a
    ``grad_output`` of the output's shape. A mismatch is a RuntimeError naming the layer."""
    operands = [("weight", weight)]
    if bias is not None:
        operands.append(("bias", bias))
    if grad_output is not None:
        operands.append(("grad_output", grad_output))
    _check_tensors(name, spatial, x, operands)
    _geometry(name, "stride", stride, spatial, 1)
    _geometry(name, "padding", padding, spatial, 0)
    _geometry(name, "dilation", dilation, spatial, 1)
    k, cg = weight.shape[0], weight.shape[1]
    if groups < 1 or k % groups or x.shape[1] != cg * groups:
        raise RuntimeError(
            f"{name}: a weight of shape {tuple(weight.shape)} with groups={groups} does not fit an "
            f"input of shape {tuple(x.shape)} (it needs {cg * groups} input channels and "
            "out_channels divisible by groups)"
        )
    if bias is not None and tuple(bias.shape) != (k,):
        raise RuntimeError(f"{name}: the bias has shape {tuple(bias.shape)}, expected ({k},)")
    out = output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    if any(v <= 0 for v in out):
        raise RuntimeError(
            f"{name}: input {tuple(x.shape)} is too small for kernel {tuple(weight.shape[2:])} "
            f"with padding {tuple(padding)} and dilation {tuple(dilation)} (output would be "
            f"{'x'.join(map(str, out))})"
        )
    if grad_output is not None and tuple(grad_output.shape) != (x.shape[0], k) + out:
        raise RuntimeError(
            f"{name}: grad_output has shape {tuple(grad_output.shape)}, the convolution's output "
            f"is {(x.shape[0], k) + out}"
        )


def check_transposed(
    name: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> Tuple[int, ...]:
    """Checks a transposed convolution's operands as :func:`check_operands` does a
    convolution's (the weight is ``Cin x Cout/groups x kernel``; ``output_padding`` is smaller
    than the stride, so the output is exactly the convolution problem's input) and returns its
    output shape."""
    operands = [("weight", weight)]
    if bias is not None:
        operands.append(("bias", bias))
    _check_tensors(name, spatial, x, operands)
    _geometry(name, "stride", stride, spatial, 1)
    _geometry(name, "padding", padding, spatial, 0)
    _geometry(name, "output_padding", output_padding, spatial, 0)
    _geometry(name, "dilation", dilation, spatial, 1)
    if any(op >= st for op, st in zip(output_padding, stride)):
        raise RuntimeError(
            f"{name}: output_padding {list(output_padding)} must be smaller than the stride "
            f"{list(stride)} in every dim (mucudnn runs a transposed convolution as its "
            "convolution's backward-data)"
        )
    cin, cout_g = weight.shape[0], weight.shape[1]
    if groups < 1 or cin % groups or x.shape[1] != cin:
        raise RuntimeError(
            f"{name}: a transposed weight of shape {tuple(weight.shape)} with groups={groups} "
            f"does not fit an input of shape {tuple(x.shape)} (it needs {cin} input channels, "
            "divisible by groups)"
        )
    cout = cout_g * groups
    if bias is not None and tuple(bias.shape) != (cout,):
        raise RuntimeError(f"{name}: the bias has shape {tuple(bias.shape)}, expected ({cout},)")
    out = transposed_size(x.shape[2:], weight.shape[2:], stride, padding, output_padding, dilation)
    if any(v <= 0 for v in out):
        raise RuntimeError(
            f"{name}: input {tuple(x.shape)} with kernel {tuple(weight.shape[2:])}, padding "
            f"{tuple(padding)} and dilation {tuple(dilation)} gives no output (it would be "
            f"{'x'.join(map(str, out))})"
        )
    return (x.shape[0], cout) + out


def _warn_float64(config: LayerConfig) -> None:
    if not config.warned_float64:
        config.warned_float64 = True
        print(
            f"mucudnn: warning: {config.name}: float64 runs PyTorch's convolution (mucudnn's "
            "plans are fp32, fp16 and bf16)",
            file=sys.stderr,
        )


def _bias_view(bias: torch.Tensor, spatial: int) -> torch.Tensor:
    return bias.view((1, -1) + (1,) * spatial)


#: Per thread: what the layer calling an op said of its backward (see :func:`expect_backward`).
_backward_hint = threading.local()


def expect_backward(value: Optional[bool]) -> None:
    """Set by a converted layer around its op call: whether a backward may follow (gradients
    on, and its input or weight requires one); ``None`` after the call. Read only when a key
    is tuned; the op itself cannot tell (autograd runs it with gradients off either way)."""
    _backward_hint.value = value


def backward_expected(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a backward may follow a forward over ``x`` and ``weight``, so its first call
    tunes all three ops rather than the forward's alone. The calling layer's word when it gave
    one (:func:`expect_backward`); else (a direct op call, a compiled graph) inference mode, or
    gradients on in the op (autograd found nothing requiring one), means no; otherwise whether
    ``x`` or ``weight`` requires a gradient (under ``torch.no_grad`` a direct call cannot be
    told apart from autograd's, so it tunes all three: the old behaviour)."""
    hint = getattr(_backward_hint, "value", None)
    if hint is not None:
        return bool(hint)
    if torch.is_inference_mode_enabled() or torch.is_grad_enabled():
        return False
    return bool(x.requires_grad or weight.requires_grad)


def _ready(
    config: LayerConfig,
    key: PlanKey,
    op: int,
    x: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
) -> Optional[Ready]:
    """The prepared plans of ``key`` that run ``op``. A forward (``x`` and ``weight`` given)
    that finds none tunes ``op`` alone when no backward is expected, else all three ops; a
    backward (no tensors) tunes every op the key lacks."""
    ready = config.prepared.get(key, _MISSING)
    if ready is _MISSING or (ready is not None and not ready.has[op]):
        inference = x is not None and weight is not None and not backward_expected(x, weight)
        ready = plans_for(config, key, (op,) if inference else ALL_OPS)
    return ready


def forward(
    config_text: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = checked_key(config, spatial, x, weight, bias, stride, padding, dilation, groups, fmt)
    if x.dtype is torch.float64:
        _warn_float64(config)
        return _CONV[spatial](x, weight, bias, stride, padding, dilation, groups)
    given = (x, weight)  # the caller's: a copy made here never requires a gradient
    x = x.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    shape = output_shape_of(key)
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if y.numel() > 0 and x.shape[1] == 0:
        y.zero_()  # no input channels: the sum is empty (nn.Conv2d gives the bias)
    elif y.numel() > 0:
        x, weight = aligned(x, fmt), aligned(weight, fmt)
        ready = _ready(config, key, FORWARD, *given)
        if ready is None:
            y = _CONV[spatial](x, weight, None, stride, padding, dilation, groups)
            y = y.contiguous(memory_format=fmt)
        else:
            run(config, ready, FORWARD, x, weight, y)
    if bias is not None:
        y.add_(_bias_view(bias, spatial))
    return y


_MISSING = object()


def _backward(
    op: int,
    config_text: str,
    spatial: int,
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
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = checked_key(
        config, spatial, x, weight, None, stride, padding, dilation, groups, fmt, grad_output
    )
    data = op == BACKWARD_DATA
    geometry = (stride, padding, dilation, groups)
    if x.dtype is torch.float64:
        _warn_float64(config)
        if data:
            return _CONV_INPUT[spatial](x.shape, weight, grad_output, *geometry)
        return _CONV_WEIGHT[spatial](x, weight.shape, grad_output, *geometry)
    shape = x.shape if data else weight.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if x.numel() == 0 or weight.numel() == 0:
        return out.zero_()
    grad_output = aligned(grad_output.contiguous(memory_format=fmt), fmt)
    # The operand the op reads besides dy: w for the data gradient, x for the filter's.
    other = aligned((weight if data else x).contiguous(memory_format=fmt), fmt)
    ready = _ready(config, key, op)
    if ready is None:
        if data:
            out = _CONV_INPUT[spatial](x.shape, other, grad_output, *geometry)
        else:
            out = _CONV_WEIGHT[spatial](other, weight.shape, grad_output, *geometry)
        return out.contiguous(memory_format=fmt)
    run(config, ready, op, other, grad_output, out)
    return out


def transposed_key(
    config: LayerConfig,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    fmt: torch.memory_format,
) -> PlanKey:
    """The plan key of a transposed convolution: its convolution problem's, whose input is the
    transposed output (checked once per call signature, as :func:`checked_key`)."""
    call = signature(
        x, weight, bias, stride, padding, dilation, groups, fmt, output_padding=output_padding
    )
    key = config.checked.get(call)
    if key is None:
        y_shape = check_transposed(
            config.name, spatial, x, weight, bias, stride, padding, output_padding, dilation,
            groups,
        )
        key = plan_key(
            x, weight.shape, stride, padding, dilation, groups, layout_name(fmt, spatial),
            x_shape=y_shape,
        )
        config.checked[call] = key
    return key


def transposed_forward(
    config_text: str,
    spatial: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: List[int],
    padding: List[int],
    output_padding: List[int],
    dilation: List[int],
    groups: int,
) -> torch.Tensor:
    """``y = conv_transpose(x, weight) + bias``: the backward-data plan of the convolution
    problem whose input is ``y`` and whose output gradient is ``x``."""
    config = _configs.get(config_text) or config_for(config_text)
    fmt = memory_format(x)
    key = transposed_key(
        config, spatial, x, weight, bias, stride, padding, output_padding, dilation, groups, fmt
    )
    if x.dtype is torch.float64:
        _warn_float64(config)
        return _CONV_TRANSPOSE[spatial](
            x, weight, bias, stride, padding, output_padding, groups, dilation
        )
    y = torch.empty(key.input_shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    given = (x, weight)
    if y.numel() > 0 and (x.numel() == 0 or weight.numel() == 0):
        y.zero_()  # no input channels or an empty batch: nothing to sum
    elif y.numel() > 0:
        x = aligned(x.contiguous(memory_format=fmt), fmt)
        weight = aligned(weight.contiguous(memory_format=fmt), fmt)
        ready = _ready(config, key, BACKWARD_DATA, *given)
        if ready is None:
            y = _CONV_TRANSPOSE[spatial](
                x, weight, None, stride, padding, output_padding, groups, dilation
            ).contiguous(memory_format=fmt)
        else:
            run(config, ready, BACKWARD_DATA, weight, x, y)
    if bias is not None:
        y.add_(_bias_view(bias, spatial))
    return y


def forward_op(spatial: int):
    """The op ``mucudnn::conv{spatial}d`` (arguments in its schema's order)."""

    def op(x, weight, bias, stride, padding, dilation, groups, config_text: str):
        return forward(config_text, spatial, x, weight, bias, stride, padding, dilation, groups)

    return op


def backward_op(kind: int, spatial: int):
    """The op ``mucudnn::conv{spatial}d_backward_data`` (``kind`` BACKWARD_DATA) or
    ``_backward_filter`` (BACKWARD_FILTER)."""

    def op(grad_output, x, weight, stride, padding, dilation, groups, config_text: str):
        return _backward(
            kind, config_text, spatial, grad_output, x, weight, stride, padding, dilation, groups
        )

    return op


def transposed_op(spatial: int):
    """The op ``mucudnn::conv_transpose{spatial}d``."""

    def op(x, weight, bias, stride, padding, output_padding, dilation, groups, config_text: str):
        return transposed_forward(
            config_text, spatial, x, weight, bias, stride, padding, output_padding, dilation,
            groups,
        )

    return op


@dataclass
class Discovery:
    """Records, while active, the inputs each converted layer sees (for :func:`tune`)."""

    #: (layer, plan key) per call, in model order.
    seen: List[Tuple[Any, PlanKey]] = field(default_factory=list)


_discovery = threading.local()


def active_discovery() -> Optional[Discovery]:
    return getattr(_discovery, "value", None)


def set_discovery(value: Optional[Discovery]) -> None:
    _discovery.value = value

"""What a layer's plans say of themselves: a :class:`PlanReport` per input shape (the split,
algorithms, predicted time and workspace of each op, where the plans came from) and
:class:`Plans`, a layer's reports by input shape that print as a table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ._keys import DTYPES, OP_NAMES, PlanKey, output_shape_of


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


def _problem_spatial(problem: Dict[str, Any]) -> int:
    """3 for a problem with depth, else 2 (a 1-D problem is 2-D with unit height)."""
    depth = (("d", 1), ("t", 1), ("pad_d", 0), ("stride_d", 1), ("dilation_d", 1))
    return 3 if any(problem.get(k, v) != v for k, v in depth) else 2


def _output_size(size: int, pad: int, kernel: int, stride: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def shape_of(doc: Dict[str, Any]) -> Tuple[int, ...]:
    """A native report's problem input shape (n, c, h, w) or (n, c, d, h, w)."""
    p = doc["problem"]
    if _problem_spatial(p) == 3:
        return (p["n"], p["c"], p.get("d", 1), p["h"], p["w"])
    return (p["n"], p["c"], p["h"], p["w"])


def layer_shape(report: PlanReport, signature: Dict[str, Any]) -> Tuple[int, ...]:
    """The input shape, as a layer of ``signature`` (its weight shape, ``transposed``) calls
    it, that a native report's problem serves: a transposed layer's input is its problem's
    output, and a 1-D layer's shapes have no unit height."""
    shape = report.output_shape if signature["transposed"] else report.shape
    if len(signature["weight"]) == 3 and len(shape) == 4:
        return (shape[0], shape[1], shape[3])
    return tuple(shape)


def _layout_name(problem: Dict[str, Any]) -> str:
    spatial = _problem_spatial(problem)
    one_d = spatial == 2 and problem["h"] == 1 and problem["r"] == 1 and problem["pad_h"] == 0
    last = problem["layout"] == "nhwc"
    if one_d:
        return "nwc" if last else "ncw"
    if spatial == 3:
        return "ndhwc" if last else "ncdhw"
    return "nhwc" if last else "nchw"


def from_native(doc: Dict[str, Any]) -> PlanReport:
    """A :class:`PlanReport` of the native runtime's report of one problem."""
    p = doc["problem"]
    spatial = _problem_spatial(p)
    ops: Dict[str, Dict[str, Any]] = {}
    for plan, split in zip(doc.get("plans") or [], doc.get("splits") or []):
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
    groups = p.get("groups", 1)
    if spatial == 3:
        weight = (p["k"], p["c"] // groups, p.get("t", 1), p["r"], p["s"])
        out = (
            _output_size(p.get("d", 1), p.get("pad_d", 0), p.get("t", 1), p.get("stride_d", 1),
                         p.get("dilation_d", 1)),
        )
    else:
        weight = (p["k"], p["c"] // groups, p["r"], p["s"])
        out = ()
    out += (
        _output_size(p["h"], p["pad_h"], p["r"], p["stride_h"], p["dilation_h"]),
        _output_size(p["w"], p["pad_w"], p["s"], p["stride_w"], p["dilation_w"]),
    )
    return PlanReport(
        shape=shape_of(doc),
        dtype=p["dtype"],
        layout=_layout_name(p),
        device=doc.get("device") or "-",
        ops=ops,
        tuning_seconds=float(doc.get("tuning_seconds", 0.0)),
        cached=int(doc.get("cached", 0)),
        measured=int(doc.get("measured", 0)),
        fallback=doc.get("fallback"),
        weight_shape=weight,
        output_shape=(p["n"], p["k"]) + out,
        math="fma" if p.get("math") == "fma" else "default",
        deterministic=bool(doc.get("deterministic", False)),
        skipped=int(doc.get("skipped", 0)),
        peak_measuring_memory_bytes=int(doc.get("peak_measuring_memory_bytes", 0)),
    )

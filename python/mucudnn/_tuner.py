"""The tuner: one device (CPU or a GPU), the tuning cache, and prepared plan sets.

A thin wrapper over the C ABI's ``mucudnnTuner*`` functions. Problems, settings, tasks and
plans cross as JSON (their shapes are in docs/C_ABI.md and docs/PROFILE_FORMAT.md); execution
takes raw pointers and is the only call on a training step's path.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _lib

#: Op numbers of the C ABI (MUCUDNN_OP_*), in the order plans are returned.
OPS = ("fwd", "bwd_data", "bwd_filter")
FORWARD, BACKWARD_DATA, BACKWARD_FILTER = 0, 1, 2
DEVICE_CPU = -1
#: The values of :attr:`Settings.split` (the C ABI's settings key ``"split"``).
SPLITS = ("batch", "spatial", "auto")


@dataclass(frozen=True)
class Settings:
    """How a layer tunes: micro-batch ``policy``, per-layer ``workspace_limit`` (bytes, or
    ``None`` for none), ``candidates`` (``"legacy"``, ``"engines"``, ``"all"``), an optional
    bound on engine configurations timed per size, the pruning margin (``None``: time
    every configuration at every size), ``deterministic`` (plans from candidates the
    backend marks deterministic only; cached apart from the others) and ``ops`` (the ops to
    tune, measure and return, names of :data:`OPS`; ``None``: all three; e.g. ``("fwd",)``
    for inference) and ``split`` (what a plan splits, one of :data:`SPLITS`: ``"batch"``
    micro-batches only, ``"spatial"`` chunks along the outermost spatial dimension of the
    output only (D for 3-D, H for 2-D, W for 1-D), ``"auto"`` (the default) micro-batches,
    and chunks too at a batch of at most 4 when the batch sizes skipped a candidate over the
    workspace limit, the faster plan kept; plans are cached per setting) and ``verify``
    (``True``, the default: each candidate's output is compared with the reference
    candidate's while measuring, and one that computes wrong numbers is rejected, never
    planned; ``False`` skips the comparison; plans are cached per setting)."""

    policy: str = "power-of-two"
    workspace_limit: Optional[int] = 64 << 20
    candidates: str = "all"
    max_candidates: Optional[int] = None
    prune_margin: Optional[float] = 1.5
    deterministic: bool = False
    ops: Optional[Tuple[str, ...]] = None
    split: str = "auto"
    verify: bool = True

    def to_dict(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {
            "policy": self.policy,
            "workspace_limit": self.workspace_limit,
            "candidates": self.candidates,
            "max_candidates": self.max_candidates,
            "prune_margin": self.prune_margin,
            "deterministic": self.deterministic,
            "split": self.split,
            "verify": self.verify,
        }
        if self.ops is not None:
            doc["ops"] = list(self.ops)
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def problem(
    *,
    n: int,
    c: int,
    h: int,
    w: int,
    k: int,
    r: int,
    s: int,
    padding: Sequence[int] = (0, 0),
    stride: Sequence[int] = (1, 1),
    dilation: Sequence[int] = (1, 1),
    groups: int = 1,
    dtype: str = "fp32",
    layout: str = "nchw",
    math: str = "default",
    d: Optional[int] = None,
    t: Optional[int] = None,
) -> Dict[str, Any]:
    """A convolution problem as the C ABI reads it (docs/PROFILE_FORMAT.md, "problem");
    ``math`` is cuDNN's math mode (``"default"``, or ``"fma"``: no tensor cores, no TF32).

    A 3-D problem gives the input depth ``d`` and the filter depth ``t``, and ``padding``,
    ``stride`` and ``dilation`` as three values (depth, height, width); a 2-D one leaves ``d``
    and ``t`` out and gives two. A 1-D problem is 2-D with ``h = r = 1``."""
    spatial = 2 if d is None and t is None else 3
    for name, value in (("padding", padding), ("stride", stride), ("dilation", dilation)):
        if len(value) != spatial:
            raise ValueError(
                f"a {spatial}-D problem takes {spatial} {name} values, not {list(value)}"
            )
    doc = {
        "n": int(n),
        "c": int(c),
        "h": int(h),
        "w": int(w),
        "k": int(k),
        "r": int(r),
        "s": int(s),
        "pad_h": int(padding[-2]),
        "pad_w": int(padding[-1]),
        "stride_h": int(stride[-2]),
        "stride_w": int(stride[-1]),
        "dilation_h": int(dilation[-2]),
        "dilation_w": int(dilation[-1]),
        "groups": int(groups),
        "dtype": dtype,
        "layout": layout,
        "math": math,
    }
    if spatial == 3:
        doc.update(
            d=int(1 if d is None else d),
            t=int(1 if t is None else t),
            pad_d=int(padding[0]),
            stride_d=int(stride[0]),
            dilation_d=int(dilation[0]),
        )
    return doc


#: An operand's dims: (N, C, H, W) or (N, C, D, H, W); a filter (K, C/groups[, T], R, S).
Dims = Tuple[int, ...]


def _five(shape: Sequence[int]) -> Tuple[int, int, int, int, int]:
    """``shape`` as the C ABI's five dims: a 2-D (4-value) shape gains a unit depth."""
    if len(shape) == 4:
        return (int(shape[0]), int(shape[1]), 1, int(shape[2]), int(shape[3]))
    if len(shape) == 5:
        return tuple(int(v) for v in shape)  # type: ignore[return-value]
    raise ValueError(f"an operand has 4 dims (2-D) or 5 (3-D), not {list(shape)}")


def operand_extents(
    op: int, x: Sequence[int], w: Sequence[int], y: Sequence[int], itemsize: int
) -> Tuple[Any, Any]:
    """What :meth:`Tuner.execute` passes for ``op``'s operands ``a``, ``b``, ``out``: their
    dims as 15 ``int64`` (N, C, D, H, W each; a filter K, C/groups, T, R, S; a 2-D shape of
    four values gets D = T = 1) and their bytes as 3 ``uint64``, from the input ``x``, filter
    ``w`` and output ``y`` dims (the C ABI checks them against the plan before it reads a
    pointer). Build them once per shape: ctypes arrays are slow to make and fast to pass."""
    roles = {FORWARD: (x, w, y), BACKWARD_DATA: (w, y, x), BACKWARD_FILTER: (x, y, w)}[op]
    five = [_five(shape) for shape in roles]
    dims = (ctypes.c_int64 * 15)(*(d for shape in five for d in shape))
    nbytes = (ctypes.c_uint64 * 3)(*(itemsize * _product(shape) for shape in five))
    return dims, nbytes


def _product(values: Sequence[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result


@dataclass
class PreparedSet:
    """The plans of one input shape (one per op, for one to three ops), prepared on a tuner."""

    tuner: "Tuner"
    id: int
    #: Workspace bytes each op needs, in :data:`OPS` order (0 for an op not prepared).
    workspace: Tuple[int, int, int]
    #: The plans as mucudnn returned them, in :data:`OPS` order (only the prepared ops').
    plans: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def ops(self) -> Tuple[str, ...]:
        """The names of the ops this set runs, in :data:`OPS` order."""
        return tuple(plan["op"] for plan in self.plans)

    def release(self) -> None:
        self.tuner.release(self.id)


#: Handles of tuners the garbage collector took, destroyed when the next tuner is made.
_collected: List[ctypes.c_void_p] = []


def _destroy_collected(lib: Any) -> None:
    while _collected:
        lib.mucudnnTunerDestroy(_collected.pop())


class Tuner:
    """A mucudnn tuner on the CPU (``device=-1``) or a GPU (its CUDA ordinal).

    ``cache``: the tuning cache file (``None``: mucudnn's default location, shared with the
    ``mucudnn`` CLI; ``False``: in memory only)."""

    def __init__(self, device: int = DEVICE_CPU, cache: Any = None, verbose: bool = False):
        options: Dict[str, Any] = {"verbose": bool(verbose)}
        if cache is False:
            options["no_cache"] = True
        elif cache is not None:
            options["cache"] = str(cache)
        lib = _lib.library()
        _destroy_collected(lib)
        handle = ctypes.c_void_p()
        _lib.check(
            lib.mucudnnTunerCreate(
                ctypes.byref(handle), int(device), json.dumps(options).encode()
            )
        )
        self._handle = handle
        self._lib = lib
        self.device = int(device)
        self._fingerprint: Optional[Dict[str, Any]] = None

    def close(self) -> None:
        if self._handle.value:
            _lib.check(self._lib.mucudnnTunerDestroy(self._handle))
            self._handle = ctypes.c_void_p()

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        # Not destroyed here: the garbage collector may run this between another call's
        # failure and the reading of its error message, which a successful destroy would
        # clear. The next tuner made destroys it (or the process's exit frees it).
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            _collected.append(handle)
            self._handle = ctypes.c_void_p()

    def fingerprint(self) -> Dict[str, Any]:
        """The device fingerprint measurements are stored under."""
        if self._fingerprint is None:
            self._fingerprint = _lib.call_json("mucudnnTunerGetFingerprint", self._handle)
        return self._fingerprint

    def tune(self, layer: str, problem: Dict[str, Any], settings: Settings) -> Dict[str, Any]:
        """Tunes one layer through the cache: ``{"plans": [...], "splits": [...], "cached": n,
        "measured": n}`` (each split a plan's ``COUNTxSIZE@algo`` runs, followed by
        ``along h`` (``d``, ``w``) for a plan of chunks along a spatial dimension, whose plan
        has ``"split": "spatial"``; the plans of ``settings.ops``, all three by default, in
        :data:`OPS` order)."""
        return _lib.call_json(
            "mucudnnTunerTune",
            self._handle,
            layer.encode(),
            json.dumps(problem).encode(),
            settings.to_json().encode(),
        )

    def missing(self, layers: List[Dict[str, Any]], settings: Settings) -> List[Dict[str, Any]]:
        """The measuring tasks the cache lacks for ``[{"layer", "problem"}]``, anchors first."""
        return _lib.call_json(
            "mucudnnTunerMissing",
            self._handle,
            json.dumps(layers).encode(),
            settings.to_json().encode(),
        )

    def measure(self, tasks: List[Dict[str, Any]], settings: Settings) -> Dict[str, Any]:
        """Measures ``tasks`` (storing them); returns ``{"fingerprint", "measured"}``."""
        return _lib.call_json(
            "mucudnnTunerMeasure",
            self._handle,
            json.dumps(tasks).encode(),
            settings.to_json().encode(),
        )

    def store(self, measured: Dict[str, Any]) -> int:
        """Stores another tuner's :meth:`measure` document; returns the records stored."""
        stored = ctypes.c_uint64()
        _lib.check(
            self._lib.mucudnnTunerStore(
                self._handle, json.dumps(measured).encode(), ctypes.byref(stored)
            )
        )
        return stored.value

    def prepare(self, plans: List[Dict[str, Any]]) -> PreparedSet:
        plan_set = ctypes.c_uint64()
        workspace = (ctypes.c_uint64 * 3)()
        _lib.check(
            self._lib.mucudnnTunerPrepare(
                self._handle, json.dumps(plans).encode(), ctypes.byref(plan_set), workspace
            )
        )
        by_op = {plan["op"]: plan for plan in plans}
        return PreparedSet(
            tuner=self,
            id=plan_set.value,
            workspace=(workspace[0], workspace[1], workspace[2]),
            plans=[by_op[op] for op in OPS if op in by_op],
        )

    def release(self, plan_set: int) -> None:
        if self._handle.value:
            _lib.check(self._lib.mucudnnTunerRelease(self._handle, plan_set))

    def execute(
        self,
        plan_set: int,
        op: int,
        a: int,
        b: int,
        out: int,
        extents: Tuple[Any, Any],
        *,
        alpha: float = 1.0,
        beta: float = 0.0,
        workspace: int = 0,
        workspace_bytes: int = 0,
        stream: int = 0,
    ) -> None:
        """``out = alpha * op(a, b) + beta * out`` over raw pointers (see mucudnnTunerExecute);
        ``extents`` says what the operands are (:func:`operand_extents`), and a plan prepared
        for other shapes, or a buffer too small, is refused before any pointer is read."""
        dims, nbytes = extents
        status = self._lib.mucudnnTunerExecute(
            self._handle, plan_set, op, alpha, a, b, beta, out, dims, nbytes,
            workspace or None, workspace_bytes, stream or None,
        )
        if status:
            _lib.check(status)


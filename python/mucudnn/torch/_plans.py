"""A key's prepared plans on first sight: tuned through the cache (only the ops a call needs,
the others when a backward follows) and prepared, or left to PyTorch's convolution (no plan,
with ``fallback``), said once on stderr either way."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence

import torch

from .._lib import MucudnnError
from ._keys import ALL_OPS, DTYPES, OP_NAMES, PlanKey, output_shape_of, problem_of
from ._registry import LayerConfig, Ready, _configs, tuner_for
from ._reports import PlanReport

#: The default of ``LayerConfig.prepared.get`` that tells a key not seen yet from one left to
#: PyTorch's convolution (which holds None).
MISSING = object()

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
    earlier = config.prepared.get(key, MISSING)
    if earlier is None:
        return None
    missing = [op for op in ops if earlier is MISSING or not earlier.has[op]]
    if not missing:
        return earlier
    # A key may come as the plain tuple of its fields (equal to the PlanKey): read it by name.
    key = PlanKey._make(key)
    device_type, index = key.device_type, key.device_index
    shape = key.input_shape
    if device_type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            what = (
                f"input shape {shape} was not tuned" if earlier is MISSING
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

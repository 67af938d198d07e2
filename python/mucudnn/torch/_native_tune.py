"""``tune(model, *example_inputs)`` on the native path: the model runs once with the runtime
recording every convolution a layer (or the switch) claims, and each distinct problem is tuned
and prepared now, so that training then only executes plans. Under ``torch.distributed`` the
measuring is dealt out over the ranks as on the Python path (:mod:`._tune`'s module docs), and
every rank prepares the plans of its group's lowest rank."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from .._tuner import Settings
from . import _native, _registry, _reports
from ._tune import TUNE_OPS, TuneSummary, _all_gather, _progress, _rank_info, deal_twice


def _discover(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: Dict[str, Any]):
    """Runs the model once (eval mode, no grad; PyTorch's kernels compute) and returns the
    convolution calls the runtime recorded."""
    modes = {module: module.training for module in model.modules()}
    _native.take_discovered()
    _native.set_discovery(True)
    try:
        model.eval()
        with torch.no_grad():
            model(*example_inputs, **example_kwargs)
    finally:
        _native.set_discovery(False)
        for module, training in modes.items():
            module.training = training
    return _native.take_discovered()


def _settings(call: Dict[str, Any], ops: str) -> Settings:
    """The C ABI settings a call's options tune with (for dealing measuring tasks out)."""
    doc = json.loads(call["options"])["settings"]
    forward = "bwd_data" if call["transposed"] else "fwd"
    return Settings(
        **doc,
        deterministic=bool(call["deterministic"]),
        ops=(forward,) if ops == "forward" else None,
    )


def _prepared(call: Dict[str, Any]) -> Any:
    """Prepares a discovered call's plans (:func:`_native.prepare`); its report with
    ``measured``, ``cached`` and the peak memory of this preparation alone (none for a problem
    prepared before: its plans are kept, and another layer of the options may have tuned it),
    or None when PyTorch runs the problem."""

    def slot_report() -> Dict[str, Any]:
        for doc in _native.reports(call["options"], call["signature"]):
            if (doc.get("problem"), doc.get("device"), doc.get("deterministic")) == (
                call["problem"], call["device"], call["deterministic"]
            ):
                return doc
        return {}

    before = slot_report()
    report = _native.prepare(call)
    if report is None:
        return None
    counts = {
        field: max(0, int(report.get(field, 0)) - int(before.get(field, 0)))
        for field in ("measured", "cached")
    }
    peak = report.get("peak_measuring_memory_bytes", 0) if counts["measured"] else 0
    return dict(report, **counts, peak_measuring_memory_bytes=peak)


def _count(summary: TuneSummary, report: Dict[str, Any]) -> None:
    summary.measured += int(report["measured"])
    summary.cached += int(report["cached"])
    if summary.peak_measuring_memory_bytes is not None:
        summary.peak_measuring_memory_bytes = max(
            summary.peak_measuring_memory_bytes, int(report["peak_measuring_memory_bytes"])
        )


def _say(call: Dict[str, Any], report: Any, seconds: float, shared_with: str, verbose: bool):
    if report is None:
        _progress(f"{call['name']}: runs PyTorch's convolution (see mucudnn.torch.account())", verbose)
        return
    plan_report = _reports.from_native(report)
    shape = "x".join(map(str, call["input"]))
    source = f"plans of {shared_with}" if shared_with else plan_report.source
    _progress(
        f"{call['name']} ({shape} {plan_report.dtype} {plan_report.layout}): "
        + ", ".join(f"{op} {info['split']}" for op, info in plan_report.ops.items())
        + f" ({seconds:.2f} s, {source})",
        verbose,
    )


def tune(
    model: nn.Module,
    *example_inputs: Any,
    verbose: bool = True,
    ops: str = "all",
    **example_kwargs: Any,
) -> TuneSummary:
    """Tunes every convolution of ``model`` that mucudnn runs (converted layers, or every one
    under :func:`mucudnn.torch.enable`) for the shapes it sees on ``example_inputs`` (one
    forward pass in eval mode without gradients, computed by PyTorch), so that training then
    only executes plans. Under an initialized ``torch.distributed`` process group the measuring
    is dealt out over the ranks and every rank runs the plans of its group's lowest rank; call
    it on every rank with the per-rank batch. ``ops="all"`` (default) tunes the three ops of
    every problem, for training; ``ops="forward"`` only the op each forward runs, for
    inference. Prints a line per problem on stderr unless ``verbose=False``. Returns a
    :class:`TuneSummary`."""
    if ops not in TUNE_OPS:
        raise ValueError(
            f"mucudnn.torch.tune: ops is {ops!r}; give \"all\" (training: the three ops) or "
            "\"forward\" (inference: the op each layer's forward runs)"
        )
    started = time.perf_counter()
    calls = _discover(model, example_inputs, example_kwargs)
    rank, world = _rank_info()
    # Distinct (options, problem) pairs in model order, tuned once each, and the calls of
    # every other layer that shares one (its plans, and the op its forward runs: a transposed
    # layer mirrors the convolution whose backward-data it runs).
    entries: Dict[Tuple[str, str, str, bool], Dict[str, Any]] = {}
    sharing: Dict[Tuple[str, str, str, bool], List[Dict[str, Any]]] = {}
    for call in calls:
        key = (call["options"], json.dumps(call["problem"], sort_keys=True), call["device"],
               call["deterministic"])
        call = dict(call, training=ops == "all")
        if key not in entries:
            entries[key] = call
            sharing[key] = []
        elif all(call["name"] != other["name"] for other in [entries[key]] + sharing[key]):
            sharing[key].append(call)
    summary = TuneSummary(
        layers=len({call["name"] for call in calls}),
        shapes=len(entries),
        world_size=world,
        peak_measuring_memory_bytes=0 if world == 1 else None,
    )
    ordered = list(entries.items())
    if world > 1:
        counts = _all_gather(len(ordered))
        if len(set(counts)) != 1:
            raise RuntimeError(
                f"mucudnn.torch.tune: the ranks see different numbers of problems ({counts}); "
                "call tune with the same model and example shapes on every rank"
            )
        dealt = _deal_out(ordered, ops, rank, world, summary, verbose)
    reports = []
    for key, call in ordered:
        if call["device"].startswith("cuda"):
            torch.cuda.synchronize(int(call["device"].split(":")[1]))
        problem_started = time.perf_counter()
        report = _prepared(call)
        reports.append(report)
        if world == 1:
            _say(call, report, time.perf_counter() - problem_started, "", verbose)
        if report is not None:
            _count(summary, report)
        else:
            summary.fallbacks += 1
    if world > 1:
        # Every rank runs the plans of the lowest rank (fingerprints are dealt with in the
        # measuring; plans of one device kind are the same kind's).
        everyone = _all_gather([None if r is None else r["plans"] for r in reports])
        for (key, call), plans in zip(ordered, everyone[0]):
            if plans is not None and rank != 0:
                _native.prepare(call, plans)
        # What was dealt out was stored before the tuning above, which read it from the
        # cache: counted as measured here or shared, not cached.
        summary.cached = max(0, summary.cached - dealt)
    for (key, call), report in zip(ordered, reports):
        for other in sharing[key]:
            # The shared plans, and the op this layer's forward runs when they lack it.
            other_started = time.perf_counter()
            shared = _prepared(other) if report is not None else None
            if shared is not None:
                _count(summary, shared)
            if world == 1:
                _say(other, shared, time.perf_counter() - other_started, call["name"], verbose)
    summary.seconds = time.perf_counter() - started
    _progress(
        str(summary) + (f" on {world} ranks" if world > 1 else ""),
        verbose and rank == 0,
    )
    return summary


def _deal_out(
    ordered, ops: str, rank: int, world: int, summary: TuneSummary, verbose: bool
) -> int:
    """Measuring dealt over the ranks, per group of (device, cache, settings). Returns the
    measurements this rank made or stored from the others."""
    dealt = 0
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
    for _, call in ordered:
        options = json.loads(call["options"])
        settings = _settings(call, ops)
        cache = options["cache"]
        cache_key = "default" if cache is None else ("memory" if cache is False else str(cache))
        groups.setdefault((call["device"], cache_key, settings), []).append(call)
    for (device, _, settings), members in groups.items():
        options = json.loads(members[0]["options"])
        device_type, _, index = device.partition(":")
        tuner = _registry.tuner_for(
            device_type, int(index or -1), options["cache"], options["verbose"]
        )
        if device_type == "cuda":
            torch.cuda.synchronize(int(index))
        mine, shared = deal_twice(
            tuner, settings,
            [{"layer": call["name"], "problem": call["problem"]} for call in members],
            rank, world, summary, verbose,
        )
        summary.measured += mine
        summary.shared += shared
        dealt += mine + shared
    if summary.shared and rank == 0:
        print(f"mucudnn: {summary.shared} measurement(s) shared between ranks", file=sys.stderr)
    return dealt

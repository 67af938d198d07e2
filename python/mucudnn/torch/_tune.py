"""``tune(model, *example_inputs)``: tune every converted layer ahead of the first step, and
under ``torch.distributed`` deal the measuring out over the ranks.

Distributed tuning, per group of layers with the same settings:

1. Every rank lists the measuring tasks (layer problem, op, micro-batch size or chunk rows,
   candidate kind) its cache lacks, and the ranks all-gather their device fingerprints and
   lists. Ranks whose fingerprints differ (another GPU model, driver or cuDNN version) form
   separate groups and never share measurements.
2. Within a group the union of the missing tasks is dealt out round-robin; each rank measures
   its share on its own device and the group all-gathers the measurements (not just plans),
   which every rank stores in its local cache. Anchor sizes go first, then the sizes between
   them (whose engine pruning reads the anchors), as two such rounds.
3. Every rank then tunes from its cache (measuring nothing) and the ranks adopt the plans of
   the group's lowest rank, so every rank runs identical plans even when their caches held
   different older measurements.

When no rank misses anything, step 2 is skipped: the only collectives are the two small
all-gathers of steps 1 and 3. Layers with ``split="auto"`` repeat steps 1 and 2 once: the
chunk sizes along a spatial dimension are listed only after the batch sizes are stored (auto
tunes them where those skipped a candidate over the workspace limit). No shared filesystem is
needed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._lib import MucudnnError
from .._tuner import Settings
from . import _keys, _plans, _registry, _reports
from ._layer import _MucudnnConv as Conv


@dataclass
class TuneSummary:
    """What :func:`tune` did on this rank. Measurement counts are (micro-batch size, candidate
    kind) timings of one op of one problem."""

    #: Converted layers the example inputs reached.
    layers: int = 0
    #: Distinct problems (input shape, weight, geometry, dtype, layout) among them; layers
    #: with the same problem share one tuning and one set of plans.
    shapes: int = 0
    #: Measurements timed on this rank.
    measured: int = 0
    #: Measurements read from the cache, stored there before this call.
    cached: int = 0
    #: Measurements other ranks timed and this rank stored (``torch.distributed`` only).
    shared: int = 0
    #: Wall-clock seconds of the whole call.
    seconds: float = 0.0
    #: Ranks in the process group (1 without ``torch.distributed``).
    world_size: int = 1
    #: Shapes that run PyTorch's convolution (no plan; see each layer's ``plans``).
    fallbacks: int = 0
    #: Measuring tasks missing in this rank's group and dealt out over its ranks (0 alone).
    tasks_dealt: int = 0
    #: The ids of the tasks this rank measured of those.
    tasks_here: List[str] = field(default_factory=list, repr=False)
    #: The most memory one layer's tuning held at once while measuring (device memory on a
    #: GPU, host memory on the CPU); None under ``torch.distributed``, whose dealt measuring
    #: does not report it.
    peak_measuring_memory_bytes: Optional[int] = 0

    #: The keys of the dict ``tune`` returned before, for ``summary["layers"]`` and the like.
    _OLD_KEYS = {"tasks": "tasks_dealt", "measured_here": "tasks_here"}

    def __getitem__(self, key: str) -> Any:
        name = self._OLD_KEYS.get(key, key)
        if name.startswith("_") or name not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, name)

    def __str__(self) -> str:
        parts = [
            f"{self.layers} layer(s), {self.shapes} shape(s) in {self.seconds:.2f} s",
            f"{self.measured} measured, {self.cached} cached",
        ]
        if self.world_size > 1:
            parts.append(f"{self.shared} shared by other ranks of {self.world_size}")
        if self.fallbacks:
            parts.append(f"{self.fallbacks} on PyTorch's convolution")
        if self.peak_measuring_memory_bytes is not None:
            peak = _reports.format_bytes(self.peak_measuring_memory_bytes)
            parts.append(f"peak measuring memory {peak}")
        return "tuned " + "; ".join(parts)


def _progress(message: str, verbose: bool) -> None:
    if verbose:
        print(f"mucudnn: {message}", file=sys.stderr, flush=True)


def _discover(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: Dict[str, Any]):
    """Runs the model once (eval mode, no grad, PyTorch's own convolutions) and records the
    input every converted layer sees."""
    discovery = _keys.Discovery()
    modes = {module: module.training for module in model.modules()}
    _keys.set_discovery(discovery)
    try:
        model.eval()
        with torch.no_grad():
            model(*example_inputs, **example_kwargs)
    finally:
        _keys.set_discovery(None)
        for module, training in modes.items():
            module.training = training
    return discovery.seen


def _rank_info():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(value: Any) -> List[Any]:
    world = torch.distributed.get_world_size()
    out: List[Any] = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def _task_id(task: Dict[str, Any]) -> str:
    import json

    # A chunk's rows and a micro-batch of the same size are different tasks (measured apart:
    # one splits a spatial dimension, the other the batch), so the split is part of the id.
    return json.dumps(
        [task["problem"], task["op"], task.get("split", "batch"), task["micro"], task["kind"]],
        sort_keys=True,
    )


#: What ``tune(..., ops=...)`` accepts.
TUNE_OPS = ("all", "forward")


def _layer_settings(layer: Conv, key, ops: str) -> Settings:
    """The settings ``layer`` tunes ``key`` with under ``tune(..., ops=ops)``: all three ops, or
    for ``"forward"`` only the op its forward runs (a convolution's fwd, a transposed
    convolution's bwd_data)."""
    settings = layer._mucudnn.settings_for(key)
    if ops == "forward":
        settings = replace(settings, ops=("bwd_data",) if layer.transposed else ("fwd",))
    return settings


def tune(
    model: nn.Module,
    *example_inputs: Any,
    verbose: bool = True,
    ops: str = "all",
    **example_kwargs: Any,
) -> TuneSummary:
    """Tunes every converted layer (:class:`Conv2d`, :class:`Conv3d`, ...) of ``model`` for the shapes it sees on
    ``example_inputs`` (one forward pass in eval mode without gradients, with PyTorch's own
    convolutions), so that training then only executes plans. Under an initialized
    ``torch.distributed`` process group (torchrun, DDP) the measuring is dealt out over the
    ranks and the measurements shared (see the module docs); call it on every rank with the
    per-rank batch. Prints a line per layer on stderr unless ``verbose=False``; a layer whose
    problem an earlier layer tuned says whose plans it shares.

    ``ops="all"`` (the default) tunes the three ops of every layer, for training;
    ``ops="forward"`` tunes only the op each layer's forward runs (a convolution's ``fwd``, a
    transposed convolution's ``bwd_data``), for inference: a third of the measuring. A
    backward after it tunes the missing ops on its first call.

    Returns a :class:`TuneSummary` (``layers``, ``shapes``, ``measured``, ``cached``,
    ``shared``, ``seconds``, ...); ``summary["layers"]`` and the old keys ``"tasks"`` and
    ``"measured_here"`` still read its fields.
    """
    if ops not in TUNE_OPS:
        raise ValueError(
            f"mucudnn.torch.tune: ops is {ops!r}; give \"all\" (training: the three ops) or "
            "\"forward\" (inference: the op each layer's forward runs)"
        )
    started = time.perf_counter()
    seen = _discover(model, example_inputs, example_kwargs)
    rank, world = _rank_info()
    # Distinct (layer config, input shape) pairs, in model order.
    entries: List[Tuple[Conv, _keys.PlanKey, Dict[str, Any]]] = []
    keys = set()
    for layer, key in seen:
        if (layer._mucudnn_config, key) in keys or key.dtype not in _keys.DTYPES:
            continue  # seen already, or float64 (PyTorch's convolution)
        if 0 in key.input_shape or 0 in key.weight_shape:
            continue  # nothing to tune: an empty convolution
        keys.add((layer._mucudnn_config, key))
        entries.append((layer, key, _keys.problem_of(key)))
    # Group by (device, cache, settings): one tuner and one dealing per group.
    groups: Dict[Tuple[Any, ...], List[Tuple[Conv, _keys.PlanKey, Dict[str, Any]]]] = {}
    for layer, key, problem in entries:
        config = layer._mucudnn
        cache_key = "default" if config.cache is None else str(config.cache)
        group_key = (
            key.device_type, key.device_index, cache_key, _layer_settings(layer, key, ops)
        )
        groups.setdefault(group_key, []).append((layer, key, problem))
    summary = TuneSummary(
        layers=len({id(layer) for layer, _, _ in entries}),
        shapes=sum(len({key for _, key, _ in members}) for members in groups.values()),
        world_size=world,
        peak_measuring_memory_bytes=0 if world == 1 else None,
    )
    # Every rank must enter the same collectives in the same order: groups go in the model
    # order of their first layer, which is the same on every rank (cache paths and device
    # indices may differ between ranks; dicts keep insertion order).
    ordered = list(groups.items())
    if world > 1:
        counts = _all_gather(len(ordered))
        if len(set(counts)) != 1:
            raise RuntimeError(
                f"mucudnn.torch.tune: the ranks see different numbers of layer groups "
                f"({counts}); call tune with the same model and example shapes on every rank"
            )
    for (device_type, index, _, settings), members in ordered:
        config = members[0][0]._mucudnn
        tuner = _registry.tuner_for(device_type, index, config.cache, config.verbose)
        if device_type == "cuda":
            torch.cuda.synchronize(index)
        dealt = (0, 0)
        if world > 1:
            dealt = deal_twice(
                tuner, settings,
                [{"layer": layer._mucudnn.name, "problem": problem} for layer, _, problem in members],
                rank, world, summary, verbose,
            )
        results = []
        # The first layer to tune each problem; later layers with it share its result.
        first: Dict[Any, Tuple[str, Dict[str, Any]]] = {}
        cached = measured = 0
        for layer, key, problem in members:
            layer_started = time.perf_counter()
            if key in first:
                name, earlier = first[key]
                if earlier["plans"] is None and not layer._mucudnn.fallback:
                    raise RuntimeError(
                        f"{layer._mucudnn.name}: tuning failed: {earlier.get('fallback')}"
                    )
                result = dict(earlier, cached=0, measured=0, skipped=0,
                              peak_measuring_memory_bytes=0, same_as=name)
            else:
                try:
                    result = tuner.tune(layer._mucudnn.name, problem, settings)
                except MucudnnError as e:
                    if not (layer._mucudnn.fallback and e.status in _plans.FALLBACK_STATUSES):
                        raise RuntimeError(f"{layer._mucudnn.name}: tuning failed: {e}") from e
                    result = {"plans": None, "cached": 0, "measured": 0, "fallback": str(e)}
                first[key] = (layer._mucudnn.name, result)
            seconds = time.perf_counter() - layer_started
            cached += result["cached"]
            measured += result["measured"]
            if summary.peak_measuring_memory_bytes is not None:
                summary.peak_measuring_memory_bytes = max(
                    summary.peak_measuring_memory_bytes,
                    int(result.get("peak_measuring_memory_bytes", 0)),
                )
            results.append((layer, key, result, seconds))
            if world == 1:
                _adopt(layer, key, result, seconds, verbose)
        if world > 1:
            _agree(tuner, results, rank, verbose)
        # Dealt out, this rank's share and the other ranks' were stored before the final
        # tuning, which reads them from the cache: count them as measured and shared.
        mine, shared = dealt
        summary.measured += measured + mine
        summary.shared += shared
        summary.cached += max(0, cached - mine - shared)
    summary.fallbacks = sum(
        1
        for layer, key, _ in entries
        if layer._mucudnn.reports.get(key) is not None
        and layer._mucudnn.reports[key].fallback is not None
    )
    summary.seconds = time.perf_counter() - started
    _progress(
        str(summary) + (f" on {world} ranks" if world > 1 else ""),
        verbose and rank == 0,
    )
    return summary


def _adopt(layer: Conv, key, result, seconds: float, verbose: bool) -> None:
    if result["plans"] is None:
        _plans.fall_back(layer._mucudnn, key, result.get("fallback", "no plan"), seconds)
        return
    if _plans.adopt_or_fall_back(layer._mucudnn, key, result, seconds) is None:
        return
    report = layer._mucudnn.reports[key]
    shape = "x".join(map(str, layer._layer_shape(report)))
    _progress(
        f"{layer._mucudnn.name} ({shape} {report.dtype} {report.layout}): "
        + ", ".join(f"{op} {info['split']}" for op, info in report.ops.items())
        + f" ({seconds:.2f} s, {report.source})",
        verbose,
    )


def _deal(
    tuner, settings: Settings, layers: List[Dict[str, Any]], rank: int, world: int,
    summary: TuneSummary, verbose: bool,
) -> Tuple[int, int]:
    """Steps 1 and 2 of the module docs for one group of layers (``[{"layer": name,
    "problem": problem}]``). Returns the tasks this rank measured and those it stored from the
    other ranks."""
    fingerprint = tuner.fingerprint()
    missing = tuner.missing(layers, settings)
    everyone = _all_gather({"fingerprint": fingerprint, "missing": missing})
    peers = [r for r, info in enumerate(everyone) if info["fingerprint"] == fingerprint]
    if len(peers) != world and rank == peers[0]:
        print(
            f"mucudnn: ranks {peers} share a device fingerprint ({fingerprint.get('name')}); "
            "other ranks tune among their own kind",
            file=sys.stderr,
        )
    # The union of the group's missing tasks, in a deterministic order: anchors first.
    union: Dict[str, Dict[str, Any]] = {}
    for r in peers:
        for task in everyone[r]["missing"]:
            union.setdefault(_task_id(task), task)
    tasks = list(union.values())
    summary.tasks_dealt += len(tasks)
    if not any(info["missing"] for info in everyone):
        return 0, 0
    mine_count = shared = 0
    position = peers.index(rank)
    for between in (False, True):
        round_tasks = [t for t in tasks if (t.get("between") is not None) == between]
        mine = round_tasks[position :: len(peers)]
        started = time.perf_counter()
        measured = tuner.measure(mine, settings) if mine else {"fingerprint": fingerprint, "measured": []}
        summary.tasks_here.extend(_task_id(t) for t in mine)
        mine_count += len(mine)
        gathered = _all_gather(measured)
        for r in peers:
            if r != rank and gathered[r]["measured"]:
                tuner.store(gathered[r])
                shared += len(gathered[r]["measured"])
        _progress(
            f"rank {rank}: measured {len(mine)} of {len(round_tasks)} "
            f"{'between' if between else 'anchor'} task(s) in {time.perf_counter() - started:.2f} s",
            verbose,
        )
    return mine_count, shared


def deal_twice(
    tuner, settings: Settings, layers: List[Dict[str, Any]], rank: int, world: int,
    summary: TuneSummary, verbose: bool,
) -> Tuple[int, int]:
    """:func:`_deal`, and under ``split="auto"`` a second round: the chunk tasks are listed
    only once the batch sizes are stored (they show whether the limit skipped a candidate)."""
    dealt = _deal(tuner, settings, layers, rank, world, summary, verbose)
    if settings.split == "auto":
        more = _deal(tuner, settings, layers, rank, world, summary, verbose)
        dealt = (dealt[0] + more[0], dealt[1] + more[1])
    return dealt


def _agree(tuner, results, rank: int, verbose: bool) -> None:
    """Step 3: adopt the plans of the lowest rank with this rank's fingerprint."""
    fingerprint = tuner.fingerprint()
    mine = [(result["plans"], result.get("splits")) for _, _, result, _ in results]
    everyone = _all_gather({"fingerprint": fingerprint, "plans": mine})
    leader = next(r for r, info in enumerate(everyone) if info["fingerprint"] == fingerprint)
    for (layer, key, result, seconds), (plans, splits) in zip(results, everyone[leader]["plans"]):
        agreed = dict(result, plans=plans, splits=splits)
        if plans is None:
            agreed.setdefault("fallback", "no plan on the group's lowest rank")
        _adopt(layer, key, agreed, seconds, verbose and rank == 0)

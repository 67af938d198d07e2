"""Layer configurations, the process-wide table that finds them, their prepared plan sets, and
the tuners per device and cache.

The ops take the layer's configuration as a string: the canonical JSON of its name, tuning
settings, cache, ``verbose`` and ``fallback`` (:func:`config_text`). It is a plain value that
means the same thing in every process, so a traced, exported or compiled graph runs anywhere:
the process-wide table :data:`_configs` finds (or makes) the configuration by that string, and
the configuration finds its prepared plans by the full problem read from the tensors and the
geometry at each call (:func:`._keys.plan_key`).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import OrderedDict
import weakref
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch

from .. import _tuner
from .._lib import MucudnnError
from .._tuner import BACKWARD_DATA, BACKWARD_FILTER, FORWARD, PreparedSet, Settings, Tuner
from ._keys import OP_NAMES, PlanKey, output_shape_of
from ._reports import PlanReport, report_of


class Ready:
    """A prepared plan set and what running it needs: which ops it holds (``has[op]``), the
    operand extents of each op (ctypes arrays, made once from the key's shapes) and, on the
    CPU, the workspace.

    Threads share a layer's sets: a call may hold one that another thread has just replaced
    (:meth:`LayerConfig.adopt`) or that the layer's collection is dropping. So a set counts
    the calls running it, and a retired set is released by the last of them, never under a
    call: :func:`._runtime.run` enters it or takes the set that replaced it."""

    __slots__ = (
        "prepared", "tuner", "id", "workspace", "extents", "has", "key",
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
    (:func:`._keys.plan_key`). Found by its :func:`config_text` in the process-wide table."""

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
        #: Call signatures (:func:`._keys.signature`) whose operands passed the checks
        #: (:func:`._checks.check_operands`), and their plan keys: a call seen before needs
        #: one tuple and two dict lookups.
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
        _bound.forget(self)
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
        _bound.added(self, key)
        return ready

    def evict(self, key: PlanKey) -> None:
        """Drops ``key``'s plan set (the bound of plan sets): a later call prepares it again
        from the cache, without measuring."""
        with self.lock:
            ready = self.prepared.get(key)
            if ready is None:
                return
            del self.prepared[key]
        ready.retire()


class PlanBound:
    """At most ``capacity`` prepared plan sets over every layer of the process (default 1024,
    or ``MUCUDNN_TORCH_PLAN_SETS``; :func:`set_capacity`): beyond it the set prepared longest
    ago is evicted and prepared again from the cache, without measuring, when a call needs it.
    The order is of preparation, not of use: the calls' fast route does not pay to record
    each use, so a hot shape may be evicted once and prepared again (milliseconds, no
    measuring)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.order: "OrderedDict[Tuple[int, PlanKey], Tuple[Any, PlanKey]]" = OrderedDict()
        self.lock = threading.Lock()

    def added(self, config: "LayerConfig", key: PlanKey) -> None:
        with self.lock:
            entry = (id(config), key)
            self.order[entry] = (weakref.ref(config), key)
            self.order.move_to_end(entry)
            evicted = self._over()
        for config_ref, old_key in evicted:
            owner = config_ref()
            if owner is not None:
                owner.evict(old_key)

    def forget(self, config: "LayerConfig") -> None:
        with self.lock:
            for entry in [e for e in self.order if e[0] == id(config)]:
                del self.order[entry]

    def set_capacity(self, capacity: int) -> None:
        with self.lock:
            self.capacity = capacity
            evicted = self._over()
        for config_ref, old_key in evicted:
            owner = config_ref()
            if owner is not None:
                owner.evict(old_key)

    def _over(self) -> list:
        evicted = []
        while len(self.order) > self.capacity:
            _, value = self.order.popitem(last=False)
            evicted.append(value)
        return evicted

    def __len__(self) -> int:
        return len(self.order)


def _capacity_from_environment() -> int:
    text = os.environ.get("MUCUDNN_TORCH_PLAN_SETS")
    if text is None or not text.strip():
        return 1024
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        warnings.warn(
            f"mucudnn: MUCUDNN_TORCH_PLAN_SETS must be a whole number >= 1, not {text!r}; "
            "keeping at most 1024 plan sets", stacklevel=2,
        )
        return 1024
    return value


_bound = PlanBound(_capacity_from_environment())


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

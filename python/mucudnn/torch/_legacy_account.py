"""The account of what ran, on the Python path: the plans :func:`._runtime.run` executed and
the convolutions left to PyTorch, per layer name and op (the native path keeps it in the
library: :func:`mucudnn.torch.account`)."""

from __future__ import annotations

import threading

from typing import Any, Dict

_lock = threading.Lock()
_counts: Dict[str, Dict[str, Dict[str, Any]]] = {}


def executed(name: str, op: str) -> None:
    with _lock:
        entry = _counts.setdefault(name, {}).setdefault(op, {"mucudnn": 0, "pytorch": {}})
        entry["mucudnn"] += 1


def fell_back(name: str, op: str, reason: str) -> None:
    with _lock:
        entry = _counts.setdefault(name, {}).setdefault(op, {"mucudnn": 0, "pytorch": {}})
        entry["pytorch"][reason] = entry["pytorch"].get(reason, 0) + 1


def account() -> Dict[str, Dict[str, Dict[str, Any]]]:
    """What ran since the last :func:`reset_account` (see the native path's docs)."""
    with _lock:
        return {
            name: {op: {"mucudnn": c["mucudnn"], "pytorch": dict(c["pytorch"])}
                   for op, c in ops.items()}
            for name, ops in _counts.items()
        }


def reset_account() -> None:
    with _lock:
        _counts.clear()


def set_plan_capacity(capacity: int) -> None:
    """Keeps at most ``capacity`` prepared plan sets over every layer (default 1024, or
    ``MUCUDNN_TORCH_PLAN_SETS``), evicting the one prepared longest ago: an evicted problem
    is prepared again from the cache, without measuring."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a whole number >= 1, not {capacity!r}")
    from . import _registry

    _registry._bound.set_capacity(capacity)


def plans_of(module: Any) -> Any:
    """The plans of a mucudnn layer or adopted module (a :class:`Plans`), or ``None``."""
    from ._layer import _MucudnnConv

    return module.plans if isinstance(module, _MucudnnConv) else None


__all__ = ["account", "plans_of", "reset_account", "set_plan_capacity", "executed", "fell_back"]


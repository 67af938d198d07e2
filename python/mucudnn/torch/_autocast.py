"""Autocast for mucudnn's ops: under ``torch.autocast`` they run in the autocast dtype, as
``nn.Conv2d`` does (convolutions are on autocast's lower-precision list for CPU and CUDA).

Each op gets a kernel at the ``AutocastCPU`` and ``AutocastCUDA`` dispatch keys (which run
before autograd): it casts every floating-point tensor argument on that device type (float64
excepted, as autocast does) to the dtype of the enclosing ``torch.autocast`` region and calls
the op again with autocast excluded. The casts are ordinary ops, so autograd records them and
gradients reach fp32 parameters in fp32. Unlike ``torch.library.register_autocast``, which casts
to one dtype fixed at registration, the dtype is read at each call
(``autocast("cuda", dtype=torch.float16)`` and ``autocast("cpu", dtype=torch.bfloat16)`` both
behave). The kernel does not look at the op's argument list beyond its tensors, so it serves
every op the package defines.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["register", "enabled_for"]

_DISPATCH_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_libraries = []  # kept alive: dropping a Library removes its registrations


def _autocast_dtype(device_type: str) -> torch.dtype:
    getter = getattr(torch, "get_autocast_dtype", None)  # torch >= 2.4
    if getter is not None:
        return getter(device_type)
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype()
    return torch.get_autocast_gpu_dtype()


def _is_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))  # torch >= 2.4
    except TypeError:
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def enabled_for(device: torch.device) -> bool:
    """Whether a ``torch.autocast`` region for ``device``'s type is active on this thread."""
    return device.type in _DISPATCH_KEYS and _is_enabled(device.type)


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = (
            value.is_floating_point()
            and value.device.type == device_type
            and value.dtype is not torch.float64
        )
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device_type, dtype) for v in value)
    return value


def _kernel(op: Any, device_type: str):
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutocastCUDA
    )

    def kernel(_keyset: Any, *args: Any, **kwargs: Any) -> Any:
        dtype = _autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(
                *_cast(args, device_type, dtype),
                **{k: _cast(v, device_type, dtype) for k, v in kwargs.items()},
            )

    return kernel


def register(qualified_names: Iterable[str]) -> None:
    """Registers the autocast kernels of the ops ``namespace::name`` (call once, after the ops
    are defined)."""
    for qualified in qualified_names:
        namespace, name = qualified.split("::")
        op = getattr(getattr(torch.ops, namespace), name).default
        library = torch.library.Library(namespace, "IMPL")
        for device_type, key in _DISPATCH_KEYS.items():
            library.impl(name, _kernel(op, device_type), key, with_keyset=True)
        _libraries.append(library)

"""The native path: mucudnn's kernels inside PyTorch's dispatcher (torch >= 2.10), driven
through the C ABI's ``mucudnnTorch*`` functions (``src/torch/`` in the library).

PyTorch's ``aten::convolution`` and ``aten::convolution_backward`` run mucudnn's kernels at
the CPU and CUDA dispatch keys while a converted layer exists or the switch is on; the kernels
find the layer of each call, tune and run its plans, and count what ran, with no Python per
call. This module loads that runtime (:func:`active`) and wraps its calls: layers
(:class:`Layer`), the switch, the account, plan reports and the discovery pass of ``tune()``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch

from .. import _lib

#: The oldest torch whose stable C interface the kernels stand on.
MIN_TORCH = (2, 10)

#: ``MUCUDNN_TORCH_PATH=python`` keeps the Python path on a torch that has the native one.
PATH_VARIABLE = "MUCUDNN_TORCH_PATH"


def torch_version() -> tuple:
    """torch's (major, minor) version."""
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


_state_lock = threading.Lock()
_active: Optional[bool] = None
#: Why the native path is not used (None when it is).
why_not: Optional[str] = None


def active() -> bool:
    """Whether the native path is used in this process (decided and loaded once)."""
    global _active, why_not
    if _active is not None:
        return _active
    with _state_lock:
        if _active is not None:
            return _active
        choice = os.environ.get(PATH_VARIABLE, "").strip().lower()
        if choice not in ("", "native", "python"):
            raise ValueError(f"{PATH_VARIABLE}={choice!r}: give 'native' or 'python'")
        if choice == "python":
            why_not = f"{PATH_VARIABLE}=python"
        elif torch_version() < MIN_TORCH:
            why_not = (
                f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, whose "
                "stable C interface mucudnn's native kernels need"
            )
        else:
            try:
                _init()
            except (OSError, _lib.MucudnnError) as e:
                if choice == "native":
                    raise
                why_not = f"the native runtime could not be loaded ({e})"
        _active = why_not is None
        return _active


def _init() -> None:
    lib = _lib.library()
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    cpu = os.path.join(folder, "libtorch_cpu.so")
    cuda = os.path.join(folder, "libtorch_cuda.so")
    cuda_path = None
    if os.path.exists(cuda) and torch.cuda.is_available():
        cuda_path = cuda
        # mucudnn must use torch's libcudnn (see mucudnn._lib): loaded now, and linked where
        # mucudnn's lookup finds it before the kernels make their first CUDA tuner.
        torch.backends.cudnn.version()
        _lib.use_loaded_cudnn()
    _lib.check(
        lib.mucudnnTorchInit(cpu.encode(), None if cuda_path is None else cuda_path.encode())
    )


def _text(value: Optional[str]) -> Optional[bytes]:
    return None if value is None else value.encode("utf-8")


def set_switch(options: Optional[str]) -> None:
    """Turns the process-wide switch on with ``options`` (a config text), or off."""
    _lib.check(_lib.library().mucudnnTorchSetSwitch(_text(options)))


def state() -> Dict[str, Any]:
    """The runtime's state (kernels registered, layers, plan sets, PyTorch's switches)."""
    return _lib.call_json("mucudnnTorchGetState")


def account() -> Dict[str, Dict[str, Dict[str, Any]]]:
    """What ran, by name and op (see :func:`mucudnn.torch.account`)."""
    return _lib.call_json("mucudnnTorchGetAccount")


def reset_account() -> None:
    _lib.check(_lib.library().mucudnnTorchResetAccount())


def set_plan_capacity(capacity: int) -> None:
    _lib.check(_lib.library().mucudnnTorchSetPlanCapacity(int(capacity)))


def reports(options: str, signature: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The native plan reports of a config (and a layer's signature)."""
    doc = None if signature is None else json.dumps(signature)
    return _lib.call_json("mucudnnTorchGetReports", _text(options), _text(doc))


def set_discovery(on: bool) -> None:
    _lib.check(_lib.library().mucudnnTorchSetDiscovery(1 if on else 0))


def take_discovered() -> List[Dict[str, Any]]:
    return _lib.call_json("mucudnnTorchTakeDiscovered")


def prepare(call: Dict[str, Any], plans: Optional[List[Dict[str, Any]]] = None) -> Any:
    """Prepares a discovered call's plans now (tuned, or ``plans`` given); its report, or None
    when PyTorch runs the problem."""
    plans_text = None if plans is None else json.dumps(plans)
    return _lib.call_json("mucudnnTorchPrepare", _text(json.dumps(call)), _text(plans_text))


def _remove_layer(layer_id: int) -> None:
    """A layer's finalizer: unregisters it (quietly at interpreter exit)."""
    try:
        _lib.check(_lib.library().mucudnnTorchRemoveLayer(layer_id))
    except Exception:  # pragma: no cover - interpreter shutdown order varies
        if not sys.is_finalizing():
            raise


def _owning_handle(weight: torch.Tensor) -> int:
    """A new owning ``AtenTensorHandle`` of ``weight`` (handed over to the runtime), or 0 where
    this torch cannot make one."""
    make = getattr(getattr(torch._C, "_aoti", None), "unsafe_alloc_void_ptr_from_tensor", None)
    if make is None:
        return 0
    capsule = make(weight)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return int(get(capsule, None) or 0)


class Layer:
    """One registration of a layer with the runtime: its name, options (a config text),
    signature (what identifies its calls, and whether the module computes its weight), and its
    weight parameter (the runtime keeps a reference to it while registered). Unregistered when
    collected."""

    __slots__ = ("name", "options", "signature", "id", "__weakref__")

    def __init__(
        self, name: str, options: str, signature: Dict[str, Any], weight: Any = None
    ):
        self.name = name
        self.options = options
        self.signature = signature
        handle = identity = 0
        if isinstance(weight, torch.Tensor):
            handle = _owning_handle(weight)
            identity = int(weight._cdata)
        layer_id = ctypes.c_uint64()
        _lib.check(
            _lib.library().mucudnnTorchAddLayer(
                name.encode("utf-8"),
                options.encode("utf-8"),
                json.dumps(signature).encode("utf-8"),
                handle,
                identity,
                ctypes.byref(layer_id),
            )
        )
        self.id = layer_id.value
        weakref.finalize(self, _remove_layer, self.id)

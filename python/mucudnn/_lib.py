"""Loading libmucudnn.so (the C ABI, include/mucudnn.h) and calling it through ctypes.

Every call returns a status; a failure raises :class:`MucudnnError` with mucudnn's message
(which names the function, the argument or layer, and the cause). Strings mucudnn hands back
are copied and freed at once.

Which libcudnn mucudnn uses: mucudnn loads cuDNN at run time by name, trying ``libcudnn.so``
before ``libcudnn.so.9``, and only when it first needs it (a CUDA tuner, the probe, the cuDNN
version), not when the library is loaded. In a process where torch has loaded its own
``libcudnn.so.9`` (the pip wheels' copy), a system ``libcudnn.so`` elsewhere would be a second,
different cuDNN, and handles could not be shared with torch. So the library is loaded from a
folder of this process (under the user's cache) holding a link ``libmucudnn.so`` -> the installed
library; the library is built with ``RUNPATH=$ORIGIN``. Just before each call that may load
cuDNN (:func:`use_loaded_cudnn`), the folder gains a link ``libcudnn.so`` to the libcudnn
already mapped into the process, if there is one, so that mucudnn's lookup finds that link first
and the dynamic loader hands back the copy torch loaded, whether torch was imported before or
after the library was loaded. A CUDA tuner refuses to work when two different libcudnn files
are mapped anyway (an ``LD_LIBRARY_PATH`` naming another cuDNN is searched first).
``MUCUDNN_LIBRARY`` names a library to load instead of the installed one.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

__all__ = ["MucudnnError", "library", "library_path", "call_json", "check"]

_LIBRARY_NAME = "libmucudnn.so"

#: Status codes of include/mucudnn.h.
STATUS_NAMES = {
    0: "SUCCESS",
    1: "INVALID_ARGUMENT",
    2: "NOT_AVAILABLE",
    3: "NOT_SUPPORTED",
    4: "CUDNN_ERROR",
    5: "CUDA_ERROR",
    6: "OUT_OF_MEMORY",
    7: "SOLVER_ERROR",
    8: "BAD_PROFILE",
    9: "INTERNAL_ERROR",
    10: "PLAN_NOT_SUPPORTED",
}


class MucudnnError(RuntimeError):
    """A mucudnn call failed. ``status`` is the name of the C status (e.g. ``NOT_AVAILABLE``)."""

    def __init__(self, message: str, status: str = "INTERNAL_ERROR"):
        super().__init__(message)
        self.status = status


_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_library_path: Optional[Path] = None


def _installed_library() -> Path:
    explicit = os.environ.get("MUCUDNN_LIBRARY")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise MucudnnError(f"MUCUDNN_LIBRARY={explicit} is not a file", "NOT_AVAILABLE")
        return path
    path = Path(__file__).resolve().parent / _LIBRARY_NAME
    if not path.is_file():
        raise MucudnnError(
            f"{path} is missing: install the package with `python3 -m pip install ./python` "
            "from the repository (it builds the library with cargo)",
            "NOT_AVAILABLE",
        )
    return path


def loaded_libcudnn() -> Optional[Path]:
    """The file of the libcudnn already mapped into this process (e.g. torch's), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    name = os.path.basename(parts[5].strip())
                    if name == "libcudnn.so" or name.startswith("libcudnn.so."):
                        return Path(parts[5].strip())
    except OSError:
        return None
    return None


_runtime_folder: Optional[Path] = None  # the folder the library was loaded from
_cudnn_linked = False  # the folder's libcudnn.so link exists (set once)

#: The C functions that may load libcudnn (the first time one runs, mucudnn's lookup happens).
_CUDNN_LOADERS = ("mucudnnProbe", "mucudnnGetCudnnVersion", "mucudnnTunerCreate")


def _runtime_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mucudnn" / "runtime"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _remove_folder(folder: Path) -> None:
    for entry in (folder / _LIBRARY_NAME, folder / "libcudnn.so"):
        try:
            entry.unlink()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        pass


def _process_runtime_dir(library: Path) -> Path:
    """This process's folder holding ``libmucudnn.so`` -> ``library`` (removed at exit; the
    folders of processes that died without removing theirs are removed here)."""
    base = _runtime_base()
    base.mkdir(parents=True, exist_ok=True)
    # Named by host too: a process of another machine or container sharing this cache is
    # never judged dead by its pid here.
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40] or "host"
    for stale in base.glob(f"pid-*-{host}-*"):
        try:
            pid = int(stale.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            _remove_folder(stale)
    folder = Path(tempfile.mkdtemp(prefix=f"pid-{os.getpid()}-{host}-", dir=base))
    atexit.register(_remove_folder, folder)
    (folder / _LIBRARY_NAME).symlink_to(library.resolve())
    return folder


def use_loaded_cudnn() -> None:
    """Makes mucudnn's coming lookup of ``libcudnn.so`` find the libcudnn already mapped into
    this process (torch's), if any: a link in the folder the library was loaded from. Runs
    before every C function that may load cuDNN; once the link exists it does nothing (after
    mucudnn has loaded a libcudnn, a later link would not change which one it uses)."""
    global _cudnn_linked
    if _cudnn_linked or _runtime_folder is None:
        return
    cudnn = loaded_libcudnn()
    if cudnn is None:
        return
    link = _runtime_folder / "libcudnn.so"
    try:
        link.symlink_to(cudnn.resolve())
    except FileExistsError:
        pass
    except OSError:
        return  # mucudnn finds cuDNN by its own search (and a tuner refuses two copies)
    _cudnn_linked = True


def _loading_cudnn(function: Any) -> Any:
    def call(*args: Any) -> Any:
        use_loaded_cudnn()
        return function(*args)

    call.__name__ = function.__name__
    return call


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    p = c.c_void_p
    s = c.c_char_p
    out_s = c.POINTER(c.c_void_p)
    signatures = {
        "mucudnnGetVersion": (c.c_uint32, []),
        "mucudnnGetAbiVersion": (c.c_uint32, []),
        "mucudnnGetLastError": (s, []),
        "mucudnnFreeString": (None, [p]),
        "mucudnnProbe": (c.c_int, [out_s]),
        "mucudnnGetCudnnVersion": (c.c_int, [c.POINTER(c.c_uint64)]),
        "mucudnnParseSize": (c.c_int, [s, c.POINTER(c.c_uint64)]),
        "mucudnnSolveProfile": (c.c_int, [s, s, out_s]),
        "mucudnnTunerCreate": (c.c_int, [c.POINTER(p), c.c_int32, s]),
        "mucudnnTunerDestroy": (c.c_int, [p]),
        "mucudnnTunerGetFingerprint": (c.c_int, [p, out_s]),
        "mucudnnTunerTune": (c.c_int, [p, s, s, s, out_s]),
        "mucudnnTunerMissing": (c.c_int, [p, s, s, out_s]),
        "mucudnnTunerMeasure": (c.c_int, [p, s, s, out_s]),
        "mucudnnTunerStore": (c.c_int, [p, s, c.POINTER(c.c_uint64)]),
        "mucudnnTunerPrepare": (c.c_int, [p, s, c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]),
        "mucudnnTunerRelease": (c.c_int, [p, c.c_uint64]),
        "mucudnnTunerExecute": (
            c.c_int,
            [p, c.c_uint64, c.c_int32, c.c_float, p, p, c.c_float, p,
             c.POINTER(c.c_int64), c.POINTER(c.c_uint64), p, c.c_uint64, p],
        ),
        # mucudnn inside PyTorch's dispatcher (mucudnn.torch, torch >= 2.10).
        "mucudnnTorchInit": (c.c_int, [s, s]),
        "mucudnnTorchSetSwitch": (c.c_int, [s]),
        "mucudnnTorchAddLayer": (c.c_int, [s, s, s, c.c_uint64, c.c_uint64, c.POINTER(c.c_uint64)]),
        "mucudnnTorchRemoveLayer": (c.c_int, [c.c_uint64]),
        "mucudnnTorchGetAccount": (c.c_int, [out_s]),
        "mucudnnTorchResetAccount": (c.c_int, []),
        "mucudnnTorchGetReports": (c.c_int, [s, s, out_s]),
        "mucudnnTorchSetPlanCapacity": (c.c_int, [c.c_uint64]),
        "mucudnnTorchGetState": (c.c_int, [out_s]),
        "mucudnnTorchSetDiscovery": (c.c_int, [c.c_int32]),
        "mucudnnTorchTakeDiscovered": (c.c_int, [out_s]),
        "mucudnnTorchPrepare": (c.c_int, [s, s, out_s]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
        if name in _CUDNN_LOADERS:
            setattr(lib, name, _loading_cudnn(function))


def _check_abi(lib: ctypes.CDLL, path: Path) -> None:
    """Refuses a library whose C ABI is not the one this package calls (its functions may read
    other arguments: ABI 1 read 12 operand dims where this package passes 15)."""
    from ._version import __abi_version__

    found = int(lib.mucudnnGetAbiVersion())
    if found != __abi_version__:
        raise MucudnnError(
            f"{path.resolve()} implements mucudnn's C ABI version {found}, but this package "
            f"calls version {__abi_version__}: install the package and its library from one "
            "build (or point MUCUDNN_LIBRARY at a matching library)",
            "NOT_AVAILABLE",
        )


def library() -> ctypes.CDLL:
    """The loaded library (loaded on first use; see the module docs for which libcudnn)."""
    global _library, _library_path, _runtime_folder
    with _lock:
        if _library is None:
            path = _installed_library()
            try:
                folder = _process_runtime_dir(path)
                path = folder / _LIBRARY_NAME
            except OSError:
                folder = None  # no writable cache: mucudnn finds cuDNN by its own search
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            _check_abi(lib, path)
            _library, _library_path, _runtime_folder = lib, path, folder
        return _library


def library_path() -> Path:
    """The path the library was loaded from."""
    library()
    assert _library_path is not None
    return _library_path


def cudnn_version() -> int:
    """The version of the libcudnn mucudnn uses (e.g. 92600), loading it if needed; raises
    :class:`MucudnnError` (``NOT_AVAILABLE``) when there is none."""
    version = ctypes.c_uint64()
    check(library().mucudnnGetCudnnVersion(ctypes.byref(version)))
    return version.value


def parse_size(text: str) -> int:
    """Bytes from ``"64MiB"`` and the like, as the CLI reads sizes (mucudnnParseSize)."""
    value = ctypes.c_uint64()
    check(library().mucudnnParseSize(text.encode("utf-8"), ctypes.byref(value)))
    return value.value


def check(status: int) -> None:
    """Raises :class:`MucudnnError` for a failed status, with mucudnn's last error message."""
    if status != 0:
        message = library().mucudnnGetLastError()
        text = message.decode("utf-8", "replace") if message else ""
        raise MucudnnError(text or f"mucudnn status {status}", STATUS_NAMES.get(status, str(status)))


def take_string(pointer: ctypes.c_void_p) -> str:
    """Copies a string mucudnn returned and frees it."""
    if not pointer.value:
        return ""
    try:
        return ctypes.string_at(pointer.value).decode("utf-8")
    finally:
        library().mucudnnFreeString(pointer)


def call_json(function: str, *args: Any) -> Any:
    """Calls ``function(*args, &out)`` and returns the JSON document it wrote to ``out``."""
    out = ctypes.c_void_p()
    check(getattr(library(), function)(*args, ctypes.byref(out)))
    return json.loads(take_string(out))

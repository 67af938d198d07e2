"""Loading libmucudnn.so (the C ABI, include/mucudnn.h) and calling it through ctypes.

Every call returns a status; a failure raises :class:`MucudnnError` with mucudnn's message
(which names the function, the argument or layer, and the cause). Strings mucudnn hands back
are copied and freed at once.

Which libcudnn mucudnn uses: mucudnn loads cuDNN at run time by name, trying ``libcudnn.so``
before ``libcudnn.so.9``. In a process where torch has already loaded its own
``libcudnn.so.9`` (the pip wheels' copy), a system ``libcudnn.so`` elsewhere would be a second,
different cuDNN, and handles could not be shared with torch. So when a libcudnn is already
mapped into the process, the library is loaded from a small folder in the user's cache holding
two links: ``libmucudnn.so`` (to the installed library) and ``libcudnn.so`` (to the libcudnn
already loaded). The library is built with ``RUNPATH=$ORIGIN``, so its lookup of
``libcudnn.so`` finds that link first and the dynamic loader hands back the copy torch loaded.
``MUCUDNN_LIBRARY`` names a library to load instead of the installed one.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
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


def _runtime_dir(library: Path, cudnn: Path) -> Path:
    """A folder with ``libmucudnn.so`` -> ``library`` and ``libcudnn.so`` -> ``cudnn``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mucudnn" / "runtime"
    key = hashlib.sha256(f"{library.resolve()}\0{cudnn.resolve()}".encode()).hexdigest()[:16]
    folder = base / key
    folder.mkdir(parents=True, exist_ok=True)
    for name, target in ((_LIBRARY_NAME, library.resolve()), ("libcudnn.so", cudnn.resolve())):
        link = folder / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        temporary = folder / f".{name}.{os.getpid()}"
        if temporary.is_symlink() or temporary.exists():
            temporary.unlink()
        temporary.symlink_to(target)
        os.replace(temporary, link)  # atomic: concurrent processes agree
    return folder


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
            [p, c.c_uint64, c.c_int32, c.c_float, p, p, c.c_float, p, p, c.c_uint64, p],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


def library() -> ctypes.CDLL:
    """The loaded library (loaded on first use; see the module docs for which libcudnn)."""
    global _library, _library_path
    with _lock:
        if _library is None:
            path = _installed_library()
            cudnn = loaded_libcudnn()
            if cudnn is not None:
                try:
                    path = _runtime_dir(path, cudnn) / _LIBRARY_NAME
                except OSError:
                    pass  # no writable cache: mucudnn finds cuDNN by its own search
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            _library, _library_path = lib, path
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

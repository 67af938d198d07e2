"""The package's status names agree with the library's (mucudnnGetStatusString): a status the
package does not know would reach callers as a bare number, and a fallback that tests
``MucudnnError.status`` (such as ``PLAN_NOT_SUPPORTED`` when a tuned plan cannot be prepared)
would never match."""

import ctypes

from mucudnn import _lib


def library_name(status: int) -> str:
    lib = _lib.library()
    lib.mucudnnGetStatusString.restype = ctypes.c_char_p
    lib.mucudnnGetStatusString.argtypes = [ctypes.c_int32]
    return lib.mucudnnGetStatusString(status).decode("ascii")


def test_every_library_status_has_its_name():
    known = {status: library_name(status) for status in range(0, 64)}
    named = {s: n for s, n in known.items() if n != "MUCUDNN_STATUS_UNKNOWN"}
    assert named, "the library names no status"
    assert {s: "MUCUDNN_STATUS_" + n for s, n in _lib.STATUS_NAMES.items()} == named
    assert _lib.STATUS_NAMES[10] == "PLAN_NOT_SUPPORTED"

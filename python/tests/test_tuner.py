"""The tuner API (the C ABI's mucudnnTuner* through ctypes) on the CPU backend, without torch:
tune, prepare and execute against a NumPy reference; measurements shared between tuners; errors
as exceptions with mucudnn's message."""

import ctypes
import json

import numpy as np
import pytest

import mucudnn
from mucudnn import MucudnnError, Settings, Tuner, problem
from mucudnn import operand_extents

SETTINGS = Settings(workspace_limit=1 << 20)


def reference_conv(x, w, stride, padding, dilation, groups):
    """Cross-correlation in float64, NCHW."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    p = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    q = (wd + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    y = np.zeros((n, k, p, q))
    kg = k // groups
    for g in range(groups):
        for i in range(r):
            for j in range(s):
                patch = xp[
                    :,
                    g * cg : (g + 1) * cg,
                    i * dilation[0] : i * dilation[0] + stride[0] * (p - 1) + 1 : stride[0],
                    j * dilation[1] : j * dilation[1] + stride[1] * (q - 1) + 1 : stride[1],
                ]
                y[:, g * kg : (g + 1) * kg] += np.einsum(
                    "nchw,kc->nkhw", patch, w[g * kg : (g + 1) * kg, :, i, j]
                )
    return y


def ptr(array):
    return array.ctypes.data_as(ctypes.c_void_p).value


def run_forward(tuner, prepared, x, w, out):
    workspace = np.zeros(max(prepared.workspace) + 16, dtype=np.uint8)
    extents = operand_extents(0, x.shape, w.shape, out.shape, x.itemsize)
    tuner.execute(
        prepared.id, 0, ptr(x), ptr(w), ptr(out), extents,
        workspace=ptr(workspace), workspace_bytes=prepared.workspace[0],
    )


def test_version_and_library():
    # The loaded library is the package's own build, and says its version as the package does.
    assert mucudnn.version() == mucudnn.__version__
    assert mucudnn.abi_version() == mucudnn.__abi_version__ == 3
    assert mucudnn.library_path().name == "libmucudnn.so"


def test_tune_prepare_execute_matches_reference():
    tuner = Tuner(cache=False)
    geometry = dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
    spec = problem(n=3, c=4, h=9, w=8, k=6, r=3, s=3, **geometry)
    result = tuner.tune("test.conv", spec, SETTINGS)
    assert [p["op"] for p in result["plans"]] == ["fwd", "bwd_data", "bwd_filter"]
    assert result["measured"] > 0 and result["cached"] == 0
    for plan in result["plans"]:
        assert sum(m["size"] for m in plan["micro_batches"]) == 3
    prepared = tuner.prepare(result["plans"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 9, 8)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    expected = reference_conv(x.astype(np.float64), w.astype(np.float64), **geometry)
    out = np.full(expected.shape, np.nan, dtype=np.float32)
    run_forward(tuner, prepared, x, w, out)
    assert np.allclose(out, expected, rtol=1e-4, atol=1e-4)
    # Operands of other shapes than the plan's are refused before a pointer is read.
    small = np.zeros((1, 4, 9, 8), dtype=np.float32)
    out[...] = 7.0
    with pytest.raises(MucudnnError, match=r"x is \[1, 4, 1, 9, 8\] but the plan is for \[3, 4, 1, 9, 8\]"):
        run_forward(tuner, prepared, small, w, out)
    half = x.astype(np.float16)
    dims, _ = operand_extents(0, x.shape, w.shape, out.shape, 4)
    nbytes = (ctypes.c_uint64 * 3)(half.nbytes, w.nbytes, out.nbytes)
    with pytest.raises(MucudnnError, match="x holds 1728 bytes"):
        tuner.execute(prepared.id, 0, ptr(half), ptr(w), ptr(out), (dims, nbytes))
    assert (out == 7.0).all()


def test_shared_measurements_make_tuning_free():
    spec = problem(n=4, c=3, h=6, w=6, k=4, r=3, s=3, padding=(1, 1))
    layers = [{"layer": "a", "problem": spec}]
    first, second = Tuner(cache=False), Tuner(cache=False)
    tasks = first.missing(layers, SETTINGS)
    # 3 ops x sizes 1, 2, 4, one kind on the CPU: anchors (1, 4) before the size between (2).
    assert len(tasks) == 9
    assert [t["between"] is not None for t in tasks] == [False] * 6 + [True] * 3
    # Deal the tasks out over two "ranks" and exchange the results.
    half_a = first.measure(tasks[0::2], SETTINGS)
    half_b = second.measure(tasks[1::2], SETTINGS)
    assert first.store(half_b) == len(tasks[1::2])
    assert second.store(half_a) == len(tasks[0::2])
    for tuner in (first, second):
        assert tuner.missing(layers, SETTINGS) == []
        result = tuner.tune("a", spec, SETTINGS)
        assert result["measured"] == 0 and result["cached"] == 9


def test_verification_is_on_by_default_and_counted():
    spec = problem(n=4, c=3, h=6, w=6, k=4, r=3, s=3, padding=(1, 1))
    assert Settings().verify and json.loads(Settings().to_json())["verify"] is True
    verified = Tuner(cache=False).tune("a", spec, SETTINGS)
    # 3 ops x 3 sizes x 3 CPU algorithms, each output compared with the reference's.
    assert verified["verified"] == 27 and verified["rejected"] == 0
    off = Settings(workspace_limit=1 << 20, verify=False)
    assert json.loads(off.to_json())["verify"] is False
    unverified = Tuner(cache=False).tune("a", spec, off)
    assert unverified["measured"] == 9 and unverified["verified"] == 0
    assert len(unverified["plans"]) == 3


def test_store_refuses_another_fingerprint():
    tuner = Tuner(cache=False)
    spec = problem(n=2, c=2, h=4, w=4, k=2, r=1, s=1)
    measured = tuner.measure(tuner.missing([{"layer": "x", "problem": spec}], SETTINGS), SETTINGS)
    measured["fingerprint"] = dict(measured["fingerprint"], name="Some Other CPU")
    with pytest.raises(MucudnnError, match="measurements are shared only between devices") as e:
        tuner.store(measured)
    assert e.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "settings, message",
    [
        ('{"polcy": "all"}', "unknown key `polcy`"),
        ('{"workspace_limit": "64MB"}', "workspace_limit"),
        ('{"candidates": "engines"}', "engine"),
        ('{"prune_margin": 0.5}', "prune_margin"),
        ('{"verify": "no"}', "verify is \"no\"; give a boolean"),
    ],
)
def test_bad_settings_are_clear_errors(settings, message):
    tuner = Tuner(cache=False)
    spec = problem(n=2, c=2, h=4, w=4, k=2, r=1, s=1)
    lib = mucudnn._lib.library()
    out = ctypes.c_void_p()
    status = lib.mucudnnTunerTune(
        tuner._handle, b"x", json.dumps(spec).encode(), settings.encode(), ctypes.byref(out)
    )
    assert status != 0
    with pytest.raises(MucudnnError, match=message):
        mucudnn._lib.check(status)


def test_bad_problem_names_the_layer():
    tuner = Tuner(cache=False)
    spec = problem(n=2, c=3, h=4, w=4, k=2, r=5, s=5)  # kernel larger than the input
    with pytest.raises(MucudnnError, match="my.layer"):
        tuner.tune("my.layer", spec, SETTINGS)


def test_destroyed_tuner_is_refused():
    tuner = Tuner(cache=False)
    handle = ctypes.c_void_p(tuner._handle.value)
    tuner.close()
    status = mucudnn._lib.library().mucudnnTunerDestroy(handle)
    with pytest.raises(MucudnnError, match="not a live mucudnn tuner"):
        mucudnn._lib.check(status)


def test_a_file_that_is_not_a_cache_is_refused_untouched(tmp_path):
    other = tmp_path / "notes.json"
    other.write_text('{"mine": true}')
    before = other.read_bytes()
    with pytest.raises(MucudnnError, match="not a mucudnn cache|not a cache"):
        Tuner(cache=other)
    assert other.read_bytes() == before


def test_gpu_tuner_without_gpu_is_not_available():
    try:
        Tuner(device=0, cache=False)
    except MucudnnError as e:
        assert e.status == "NOT_AVAILABLE", e
    else:  # a machine with a GPU: nothing to check here
        pass


def test_a_library_of_another_abi_version_is_refused(monkeypatch):
    from mucudnn import _lib, _version

    lib = _lib.library()
    _lib._check_abi(lib, _lib.library_path())  # the loaded one is this package's
    monkeypatch.setattr(_version, "__abi_version__", 1)
    with pytest.raises(MucudnnError, match="C ABI version 3, but this package calls version 1"):
        _lib._check_abi(lib, _lib.library_path())


def test_operand_extents_give_five_dims_per_operand():
    # 2-D shapes gain a unit depth; 3-D ones pass as they are; in the op's operand order.
    dims, nbytes = operand_extents(1, (2, 3, 5, 6, 7), (4, 3, 3, 2, 2), (2, 4, 3, 5, 6), 2)
    assert list(dims) == [4, 3, 3, 2, 2, 2, 4, 3, 5, 6, 2, 3, 5, 6, 7]
    assert list(nbytes) == [2 * 4 * 3 * 12, 2 * 2 * 4 * 90, 2 * 2 * 3 * 210]
    dims, _ = operand_extents(0, (2, 3, 5, 6), (4, 3, 2, 2), (2, 4, 4, 5), 4)
    assert list(dims) == [2, 3, 1, 5, 6, 4, 3, 1, 2, 2, 2, 4, 1, 4, 5]
    with pytest.raises(ValueError, match="4 dims .* or 5"):
        operand_extents(0, (2, 3, 5), (4, 3, 2), (2, 4, 4), 4)
    spec = problem(n=1, c=2, h=3, w=4, k=5, r=1, s=1, d=6, t=3, padding=(1, 0, 0),
                   stride=(2, 1, 1), dilation=(1, 1, 1))
    assert (spec["d"], spec["t"], spec["pad_d"], spec["stride_d"], spec["dilation_d"]) == (
        6, 3, 1, 2, 1)
    assert "d" not in problem(n=1, c=2, h=3, w=4, k=5, r=1, s=1)
    with pytest.raises(ValueError, match="3-D problem takes 3 padding values"):
        problem(n=1, c=2, h=3, w=4, k=5, r=1, s=1, d=2, t=1)

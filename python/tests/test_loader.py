"""Which libcudnn mucudnn uses inside a torch process: the one torch loaded, never a second
copy (whose handles could not be shared with torch), whether torch or mucudnn was loaded first
(checked both ways); and a CUDA tuner refuses two different libcudnn files. Runs in a fresh
interpreter each, since a process loads the library once."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TORCH_FIRST = "import torch  # loads torch's libcudnn.so.9 (pip wheels) on import\nimport mucudnn\n"
MUCUDNN_FIRST = "import mucudnn\nmucudnn.version()  # the library is loaded before torch\nimport torch\n"

SCRIPT = r"""
import json, os
from mucudnn import _lib
path = _lib.library_path()
try:
    version = _lib.cudnn_version()
except _lib.MucudnnError as e:
    version = str(e)
files = sorted({line.split()[-1] for line in open("/proc/self/maps")
                if os.path.basename(line.split()[-1]).startswith("libcudnn.so")})
print(json.dumps({"library": str(path), "link": os.readlink(path) if os.path.islink(path) else None,
                  "cudnn_link": os.readlink(path.parent / "libcudnn.so")
                      if (path.parent / "libcudnn.so").is_symlink() else None,
                  "mucudnn_cudnn": version, "torch_cudnn": torch.backends.cudnn.version(),
                  "libcudnn_files": [os.path.realpath(f) for f in files]}))
"""


def run(tmp_path, script, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k != "MUCUDNN_LIBRARY"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.update(extra_env or {})
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", [TORCH_FIRST, MUCUDNN_FIRST], ids=["torch-first", "mucudnn-first"])
def test_mucudnn_uses_the_libcudnn_torch_loaded(tmp_path, order):
    info = run(tmp_path, order + SCRIPT)
    if not info["libcudnn_files"]:
        pytest.skip("this torch build loads no libcudnn")
    # Loaded through the runtime folder: links to the installed library and torch's libcudnn.
    assert info["link"] and info["link"].endswith("libmucudnn.so"), info
    assert info["cudnn_link"] in info["libcudnn_files"], info
    # One libcudnn file in the process, and mucudnn reports torch's version.
    assert len(set(info["libcudnn_files"])) == 1, info
    assert info["mucudnn_cudnn"] == info["torch_cudnn"], info


def test_library_loaded_before_torch_runs_a_tuned_cpu_conv(tmp_path):
    script = MUCUDNN_FIRST + r"""
import json
import torch.nn as nn, torch.nn.functional as F
import mucudnn.torch as mt
torch.manual_seed(0)
conv = nn.Conv2d(3, 4, 3, padding=1)
x = torch.randn(2, 3, 6, 6, requires_grad=True)
expected = conv(x)  # PyTorch's, before a layer of its shape exists
ours = mt.Conv2d(3, 4, 3, padding=1, cache=False)
ours.load_state_dict(conv.state_dict())
y = ours(x)
y.sum().backward()
print(json.dumps({"error": (y - expected).abs().max().item(), "grad": x.grad is not None,
                  "tuned": [list(shape) for shape in ours.plans]}))
"""
    info = run(tmp_path, script)
    assert info["error"] < 1e-4, info
    assert info["grad"] and info["tuned"] == [[2, 3, 6, 6]], info


# -- a real libcudnn without torch's: the cuDNN host tier's wheels and stub libcuda -----------


def host_libraries():
    """(cuDNN lib dir, cuBLAS lib dir, stub libcuda dir) of the cuDNN host tier
    (scripts/cudnn_host_env.sh), from its exported variables or its cache; never downloads."""
    dirs = [os.environ.get(f"MUCUDNN_HOST_{name}_DIR") for name in ("CUDNN", "CUBLAS", "STUB")]
    if all(dirs):
        return dirs
    cache = Path(os.environ.get("MUCUDNN_TEST_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mucudnn-test")
    wheels = sorted(glob.glob(str(cache / "host" / "wheels-*" / "nvidia")))
    stubs = sorted(glob.glob(str(cache / "host" / "stub-*" / "libcuda.so.1")))
    for nvidia in wheels:
        cudnn, cublas = Path(nvidia) / "cudnn" / "lib", Path(nvidia) / "cu13" / "lib"
        if (cudnn / "libcudnn.so.9").exists() and cublas.is_dir() and stubs:
            return [str(cudnn), str(cublas), str(Path(stubs[-1]).parent)]
    pytest.skip("no libcudnn to load: run scripts/cudnn_host_env.sh (the cuDNN host tier) first")


def host_env(tmp_path):
    """The host tier's libraries on the library path, and a second copy of libcudnn.so.9 (a
    different file, as torch's wheel and a system cuDNN are) standing in for torch's."""
    cudnn, cublas, stub = host_libraries()
    other = tmp_path / "torch_cudnn"
    other.mkdir()
    shutil.copy2(Path(cudnn) / "libcudnn.so.9", other / "libcudnn.so.9")
    for library in Path(cudnn).glob("libcudnn_*.so*"):  # its sub-libraries, shared
        (other / library.name).symlink_to(library)
    env = {"LD_LIBRARY_PATH": os.pathsep.join([stub, cudnn, cublas])}
    return env, str(other / "libcudnn.so.9"), str(Path(cudnn) / "libcudnn.so.9")


HOST_SCRIPT = r"""
import ctypes, json, os, sys
order, torch_copy, system_copy = sys.argv[1:4]
if order == "mucudnn-first":
    import mucudnn
    mucudnn.version()
ctypes.CDLL(torch_copy)  # what `import torch` does with its wheel's libcudnn.so.9
if order == "two-copies":
    ctypes.CDLL(system_copy)
import mucudnn
from mucudnn import _lib
result = {}
try:
    result["cudnn"] = _lib.cudnn_version()
except _lib.MucudnnError as e:
    result["cudnn"] = str(e)
try:
    mucudnn.Tuner(device=0)
    result["tuner"] = "created"
except _lib.MucudnnError as e:
    result["tuner"] = f"{e.status}: {e}"
link = _lib.library_path().parent / "libcudnn.so"
result["cudnn_link"] = os.path.realpath(link) if link.is_symlink() else None
result["libcudnn_files"] = sorted({os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps")
    if os.path.basename(line.split()[-1]).startswith("libcudnn.so")})
print(json.dumps(result))
"""


def run_host(tmp_path, order):
    env, torch_copy, system_copy = host_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", HOST_SCRIPT, order, torch_copy, system_copy],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), torch_copy


@pytest.mark.parametrize("order", ["torch-first", "mucudnn-first"])
def test_either_load_order_uses_the_libcudnn_already_loaded(tmp_path, order):
    info, torch_copy = run_host(tmp_path, order)
    # mucudnn's lookup of libcudnn.so found the link to the copy already loaded: one file.
    assert info["cudnn_link"] == os.path.realpath(torch_copy), info
    assert info["libcudnn_files"] == [os.path.realpath(torch_copy)], info
    assert isinstance(info["cudnn"], int) and info["cudnn"] >= 90000, info
    # No GPU here (a stub libcuda): the tuner fails on the device, not on the library.
    assert info["tuner"] != "created" and "different libcudnn" not in info["tuner"], info


def test_a_cuda_tuner_refuses_two_libcudnn_copies(tmp_path):
    info, _ = run_host(tmp_path, "two-copies")
    assert len(info["libcudnn_files"]) == 2, info
    assert info["tuner"].startswith("NOT_AVAILABLE"), info
    assert "2 different libcudnn libraries are loaded" in info["tuner"], info
    for path in info["libcudnn_files"]:
        assert path in info["tuner"] or os.path.basename(path) in info["tuner"], info


def test_runtime_folders_are_removed_at_exit_and_swept_when_stale(tmp_path):
    import socket

    base = tmp_path / "xdg" / "mucudnn" / "runtime"
    base.mkdir(parents=True)
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40] or "host"
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    stale = base / f"pid-{dead}-{host}-abc"
    stale.mkdir()
    (stale / "libmucudnn.so").symlink_to("/nonexistent")
    other_host = base / f"pid-{dead}-another_machine-abc"
    other_host.mkdir()
    script = "import json, mucudnn\nfrom mucudnn import _lib\nmucudnn.version()\n" \
             "print(json.dumps({'folder': str(_lib.library_path().parent)}))"
    info = run(tmp_path, script)
    assert Path(info["folder"]).parent == base, info
    assert not Path(info["folder"]).exists(), "the process's own folder outlived it"
    assert not stale.exists(), "a dead process's folder was not swept"
    assert other_host.exists(), "another host's folder was judged by a local pid"

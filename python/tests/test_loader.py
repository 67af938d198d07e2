"""Which libcudnn mucudnn uses inside a torch process: the one torch loaded, never a second
copy (whose handles could not be shared with torch). Runs in a fresh interpreter each, since a
process loads the library once."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os
import torch  # loads torch's libcudnn.so.9 (pip wheels) on import
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


def run(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "MUCUDNN_LIBRARY"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mucudnn_uses_the_libcudnn_torch_loaded(tmp_path):
    info = run(tmp_path)
    if not info["libcudnn_files"]:
        pytest.skip("this torch build loads no libcudnn")
    # Loaded through the runtime folder: links to the installed library and torch's libcudnn.
    assert info["link"] and info["link"].endswith("libmucudnn.so"), info
    assert info["cudnn_link"] in info["libcudnn_files"], info
    # One libcudnn file in the process, and mucudnn reports torch's version.
    assert len(set(info["libcudnn_files"])) == 1, info
    assert info["mucudnn_cudnn"] == info["torch_cudnn"], info

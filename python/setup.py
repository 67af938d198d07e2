"""Builds the Rust library (libmucudnn.so, the C ABI the package calls through ctypes) with
cargo and puts it inside the `mucudnn` package.

The package is pure Python over that one shared library, which holds the tuner, the cache, the
CPU backend and the cuDNN wall; it does not link libtorch or libpython, so one wheel serves every
Python >= 3.9 and every torch >= 2.4 (tagged py3-none-<platform>).

Environment:
- MUCUDNN_CARGO_PROFILE: cargo profile to build (default "release").
- CARGO_TARGET_DIR: where cargo builds (default: the repository's target/).
- MUCUDNN_PREBUILT_LIBRARY: use this libmucudnn.so instead of building one.
- MUCUDNN_WHEEL_PLATFORM: the wheel's platform tag (scripts/build_wheel.sh sets
  manylinux_2_28_x86_64 for a library it built and checked against glibc 2.28).

The Rust workspace is the repository around this folder, or, in an sdist, its copy in rust/
(scripts/build_wheel.sh makes both).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70 ships bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - older setuptools
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
# An sdist carries the workspace in rust/; a checkout has it one level up.
ROOT = HERE / "rust" if (HERE / "rust" / "Cargo.toml").is_file() else HERE.parent
LIBRARY = "libmucudnn.so"


def build_library() -> Path:
    prebuilt = os.environ.get("MUCUDNN_PREBUILT_LIBRARY")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            sys.exit(f"mucudnn: MUCUDNN_PREBUILT_LIBRARY={prebuilt} is not a file")
        return path
    if not (ROOT / "Cargo.toml").is_file():
        sys.exit(
            f"mucudnn: cannot find the Rust workspace (expected {ROOT / 'Cargo.toml'}): install "
            "from a checkout of the repository with `python3 -m pip install ./python`"
        )
    if shutil.which("cargo") is None:
        sys.exit("mucudnn: building needs a Rust toolchain (cargo 1.85 or newer); see README.md")
    profile = os.environ.get("MUCUDNN_CARGO_PROFILE", "release")
    target_dir = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    # The library core only (no CLI, plotting or training crates). `-rpath $ORIGIN` lets the
    # package point mucudnn at the libcudnn that torch loaded (see mucudnn/_lib.py).
    command = [
        "cargo", "rustc", "--locked", "-p", "mucudnn", "--lib", "--crate-type", "cdylib",
        "--no-default-features", "--profile", profile,
        "--", "-C", "link-arg=-Wl,-rpath,$ORIGIN",
    ]
    print("mucudnn: " + " ".join(command), file=sys.stderr)
    subprocess.run(command, cwd=ROOT, check=True)
    folder = "debug" if profile == "dev" else profile
    built = target_dir / folder / LIBRARY
    if not built.is_file():
        sys.exit(f"mucudnn: cargo finished but {built} is missing")
    return built


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        library = build_library()
        destination = Path(self.build_lib) / "mucudnn" / LIBRARY
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, destination)


class PlatformWheel(bdist_wheel):
    """One wheel for every Python 3: the package holds a shared library but no extension."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", os.environ.get("MUCUDNN_WHEEL_PLATFORM") or platform


class BinaryDistribution(Distribution):
    """Holds a platform binary: installed into platlib (the wheel's root), as auditwheel
    requires, not into purelib."""

    def has_ext_modules(self):
        return True


setup(
    cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel},
    distclass=BinaryDistribution,
)

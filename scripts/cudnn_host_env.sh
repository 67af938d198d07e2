#!/usr/bin/env bash
# The libraries of the cuDNN host test tier (tests/cudnn_host.rs, docs/cudnn_host.md): the real
# libcudnn and libcublas(Lt) from PyPI's runtime wheels, and a stub libcuda.so.1 built from
# tests/stub_libcuda/stub_libcuda.c (test-only, never shipped). No GPU is needed.
#
# Everything is made once under the cache directory and reused, under a lock (flock on
# host/setup.lock: a second test run on the same cache waits, then reuses what the first made):
#   ${MUCUDNN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mucudnn-test}/host/
#     wheels-cudnn<version>-cublas<version>/   pip install --target of the two wheels
#     stub-<hash of the C file>/libcuda.so.1   the stub; bare/libcuda.so.1 lacks cuGetErrorName
#                                              and cuGetErrorString (mucudnn must not panic)
# When the wheels cannot be downloaded, the nvidia packages of the PyTorch test venv
# ($cache/venv, if it exists) serve instead.
#
# Use:
#   eval "$(bash scripts/cudnn_host_env.sh)"    prints export lines (stdout) to eval
#   source scripts/cudnn_host_env.sh            exports them into the current shell
# It sets LD_LIBRARY_PATH (stub, cuDNN, cuBLAS first) and MUCUDNN_HOST_STUB_DIR,
# MUCUDNN_HOST_CUDNN_DIR, MUCUDNN_HOST_CUBLAS_DIR (the tests hide libraries with them).
#
# Exit status: 0 ready; 77 skipped (no network and no cached or venv libraries, or no C
# compiler: "skipped: <reason>" on stderr; callers treat 77 as a skip, as automake does);
# anything else is a failure.

MUCUDNN_HOST_SKIP=77
CUDNN_WHEEL_VERSION=9.28.1.4
CUBLAS_WHEEL_VERSION=13.10.0.20

_mucudnn_host_env() {
  local here repo cache host wheels stub_src stub_hash stub_dir tmp venv_nvidia cc
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  repo=$(cd "$here/.." && pwd)
  cache=${MUCUDNN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mucudnn-test}
  host="$cache/host"
  mkdir -p "$host" || { echo "cudnn_host_env: cannot create $host" >&2; return 1; }
  # Two test runs sharing the cache: one fetches and builds, the other waits, then reuses.
  # shellcheck source=lock.sh
  source "$here/lock.sh" || return 1
  with_lock "$host/setup.lock" _mucudnn_host_setup || return $?

  MUCUDNN_HOST_STUB_DIR="$stub_dir"
  MUCUDNN_HOST_CUDNN_DIR="$wheels/nvidia/cudnn/lib"
  MUCUDNN_HOST_CUBLAS_DIR="$wheels/nvidia/cu13/lib"
  MUCUDNN_HOST_LD_LIBRARY_PATH="$stub_dir:$MUCUDNN_HOST_CUDNN_DIR:$MUCUDNN_HOST_CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# The shared set-up, under the lock; sets wheels and stub_dir (locals of _mucudnn_host_env).
_mucudnn_host_setup() {
  # 1. cuDNN and cuBLAS (the wheels, pinned, once; else the PyTorch venv's).
  wheels="$host/wheels-cudnn$CUDNN_WHEEL_VERSION-cublas$CUBLAS_WHEEL_VERSION"
  if [ ! -e "$wheels/nvidia/cudnn/lib/libcudnn.so.9" ]; then
    tmp="$host/.download-$$"
    rm -rf "$tmp"
    echo "cudnn_host_env: downloading nvidia-cudnn-cu13==$CUDNN_WHEEL_VERSION and" \
      "nvidia-cublas==$CUBLAS_WHEEL_VERSION (about 0.9 GB) into $wheels" >&2
    if python3 -m pip install --disable-pip-version-check --no-input --no-deps --quiet \
        --timeout 30 --target "$tmp" \
        "nvidia-cudnn-cu13==$CUDNN_WHEEL_VERSION" "nvidia-cublas==$CUBLAS_WHEEL_VERSION" \
        >"$host/pip.log" 2>&1 \
      && [ -e "$tmp/nvidia/cudnn/lib/libcudnn.so.9" ]; then
      rm -rf "$wheels" && mv "$tmp" "$wheels"
    else
      rm -rf "$tmp"
      venv_nvidia=$(ls -d "$cache"/venv/lib/python3*/site-packages/nvidia 2>/dev/null | head -n 1)
      if [ -n "$venv_nvidia" ] && [ -e "$venv_nvidia/cudnn/lib/libcudnn.so.9" ] \
          && [ -e "$venv_nvidia/cu13/lib/libcublasLt.so.13" ]; then
        echo "cudnn_host_env: the download failed ($(tail -n 1 "$host/pip.log")); using" \
          "$venv_nvidia" >&2
        wheels=$(dirname "$venv_nvidia")
      else
        echo "skipped: cannot download the cuDNN/cuBLAS wheels from PyPI and none are cached" \
          "($(tail -n 1 "$host/pip.log" 2>/dev/null))" >&2
        return "$MUCUDNN_HOST_SKIP"
      fi
    fi
  fi

  # 2. The stub libcuda (rebuilt only when its source changes).
  stub_src="$repo/tests/stub_libcuda/stub_libcuda.c"
  stub_hash=$(sha256sum "$stub_src" | cut -c1-12)
  stub_dir="$host/stub-$stub_hash"
  if [ ! -e "$stub_dir/libcuda.so.1" ] || [ ! -e "$stub_dir/bare/libcuda.so.1" ]; then
    cc=${CC:-cc}
    if ! command -v "$cc" >/dev/null 2>&1; then
      echo "skipped: no C compiler ($cc) to build the stub libcuda" >&2
      return "$MUCUDNN_HOST_SKIP"
    fi
    tmp="$host/.stub-$$"
    rm -rf "$tmp" && mkdir -p "$tmp/bare"
    "$cc" -shared -fPIC -O2 -o "$tmp/libcuda.so.1" "$stub_src" \
      && "$cc" -shared -fPIC -O2 -DMUCUDNN_STUB_BARE -o "$tmp/bare/libcuda.so.1" "$stub_src" \
      || { rm -rf "$tmp"; echo "cudnn_host_env: building the stub libcuda failed" >&2; return 1; }
    rm -rf "$stub_dir" && mv "$tmp" "$stub_dir"
  fi
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # Sourced: export into the caller's shell.
  if _mucudnn_host_env; then
    export MUCUDNN_HOST_STUB_DIR MUCUDNN_HOST_CUDNN_DIR MUCUDNN_HOST_CUBLAS_DIR
    export LD_LIBRARY_PATH="$MUCUDNN_HOST_LD_LIBRARY_PATH"
  else
    return $?
  fi
else
  set -uo pipefail
  _mucudnn_host_env || exit $?
  printf 'export MUCUDNN_HOST_STUB_DIR=%q\n' "$MUCUDNN_HOST_STUB_DIR"
  printf 'export MUCUDNN_HOST_CUDNN_DIR=%q\n' "$MUCUDNN_HOST_CUDNN_DIR"
  printf 'export MUCUDNN_HOST_CUBLAS_DIR=%q\n' "$MUCUDNN_HOST_CUBLAS_DIR"
  printf 'export LD_LIBRARY_PATH=%q\n' "$MUCUDNN_HOST_LD_LIBRARY_PATH"
fi

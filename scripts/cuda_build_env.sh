#!/usr/bin/env bash
# The toolchain to BUILD mucudnn's `candle-cuda` feature on a machine without CUDA (no GPU, no
# toolkit): docs/candle.md, "Linking beside candle's CUDA". Sourced:
#
#   source scripts/cuda_build_env.sh     # then: cargo build --features candle-cuda ...
#
# Makes once, under $MUCUDNN_CUDA_BUILD_DIR (default ${XDG_CACHE_HOME:-~/.cache}/mucudnn-cuda13),
# under a lock (two builds sharing the folder: one installs, the other waits, then reuses):
#   wheels/   pip install --target of PyPI's CUDA 13.0 wheels: nvcc, the crt and cccl headers,
#             the runtime and nvvm (cicc) to compile candle-kernels' PTX and libmoe.a; NVRTC,
#             cuRAND, NCCL, cuDNN and cuBLAS to link against (about 2 GB)
#   link/     libNAME.so links to those wheels' libNAME.so.N (what `-lNAME` looks for), and a
#             link-only libcuda.so (soname libcuda.so.1) defining every cu* entry point that
#             cudarc's driver bindings name, each an empty function: the linker needs the
#             symbols, no wheel ships the driver, and the binary loads the machine's real
#             libcuda.so.1 at run time (the stub never travels with it)
# and exports PATH (nvcc first), CUDA_HOME, CUDA_PATH, LIBRARY_PATH (link/ first),
# CUDA_COMPUTE_CAP (default 90: candle-kernels compiles PTX for it; there is no GPU to ask) and
# MUCUDNN_CUDA_BUILD_READY=1. Returns non-zero (and says why) when something cannot be had;
# sourcing it twice in one shell does the work once.
#
# The binaries it builds run on a machine with NVIDIA's driver and the CUDA 13 libraries
# (cuDNN 9, cuBLAS, cuRAND, NVRTC, NCCL 2) on LD_LIBRARY_PATH: scripts/gpu/candle_check.sh and
# candle_ddp_check.sh `run` find them there.

MUCUDNN_CUDA_NVCC_VERSION="13.0.*"
MUCUDNN_CUDA_CUDNN_VERSION=9.28.1.4
MUCUDNN_CUDA_CUBLAS_VERSION=13.10.0.20

_mucudnn_cuda_build_setup() {
  local wheels=$1 link=$2 cudarc_sys=$3 tmp lib name stub_c
  if [ ! -x "$wheels/nvidia/cu13/bin/nvcc" ] || [ ! -e "$wheels/nvidia/cudnn/lib/libcudnn.so.9" ]; then
    tmp="$wheels.download-$$"
    rm -rf "$tmp"
    echo "cuda_build_env: installing PyPI's CUDA 13.0 build wheels into $wheels (about 2 GB)" >&2
    # One pip call: a second --target install into the same folder would skip the shared
    # nvidia/ folder.
    if ! python3 -m pip install --disable-pip-version-check --no-input --no-deps --quiet \
        --timeout 60 --target "$tmp" \
        "nvidia-cuda-nvcc==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-cuda-crt==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-cuda-runtime==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-cuda-cccl==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-nvvm==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-cuda-nvrtc==$MUCUDNN_CUDA_NVCC_VERSION" \
        "nvidia-curand" "nvidia-nccl-cu13" \
        "nvidia-cudnn-cu13==$MUCUDNN_CUDA_CUDNN_VERSION" \
        "nvidia-cublas==$MUCUDNN_CUDA_CUBLAS_VERSION" >"$wheels.pip.log" 2>&1; then
      echo "cuda_build_env: pip failed: $(tail -n 2 "$wheels.pip.log")" >&2
      rm -rf "$tmp"
      return 1
    fi
    rm -rf "$wheels" && mv "$tmp" "$wheels" || return 1
    rm -rf "$link"
  fi
  if [ ! -e "$link/libcuda.so" ]; then
    rm -rf "$link" && mkdir -p "$link" || return 1
    for lib in "$wheels"/nvidia/*/lib/lib*.so.*; do
      name=$(basename "$lib")
      name=${name%%.so.*}
      case "$name" in *-builtins* | *.alt) continue ;; esac
      [ -e "$link/$name.so" ] || ln -s "$lib" "$link/$name.so"
    done
    for name in libcudart libcudnn libcublas libcublasLt libcurand libnvrtc libnccl; do
      [ -e "$link/$name.so" ] || { echo "cuda_build_env: no $name in $wheels" >&2; return 1; }
    done
    [ -f "$cudarc_sys" ] || {
      echo "cuda_build_env: cudarc's driver bindings are not at $cudarc_sys (cargo fetch first)" >&2
      return 1
    }
    stub_c="$link/stub_libcuda.c"
    {
      echo "/* Link-only libcuda.so made by scripts/cuda_build_env.sh: never loaded. */"
      grep -ho 'fn cu[A-Za-z0-9_]*' "$cudarc_sys" | sed 's/^fn //' | sort -u |
        sed 's/.*/void &(void) {}/'
    } >"$stub_c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$stub_c" || return 1
  fi
}

_mucudnn_cuda_build_env() {
  local here repo dir wheels link cudarc_sys
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  repo=$(cd "$here/.." && pwd)
  dir=${MUCUDNN_CUDA_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mucudnn-cuda13}
  wheels="$dir/wheels"
  link="$dir/link"
  mkdir -p "$dir" || { echo "cuda_build_env: cannot create $dir" >&2; return 1; }
  # cudarc's driver bindings, from the version the lock file pins (the registry's sources).
  local version
  version=$(awk '/^name = "cudarc"$/ { getline; print $3 }' "$repo/Cargo.lock" | tr -d '"' | head -n 1)
  cudarc_sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$version"/src/driver/sys/mod.rs \
    2>/dev/null | head -n 1)
  # shellcheck source=lock.sh
  source "$here/lock.sh" || return 1
  with_lock "$dir/setup.lock" _mucudnn_cuda_build_setup "$wheels" "$link" "$cudarc_sys" || return 1
  export CUDA_HOME="$wheels/nvidia/cu13"
  export CUDA_PATH="$CUDA_HOME"
  case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) export PATH="$CUDA_HOME/bin:$PATH" ;; esac
  case ":${LIBRARY_PATH:-}:" in
    *":$link:"*) ;;
    *) export LIBRARY_PATH="$link${LIBRARY_PATH:+:$LIBRARY_PATH}" ;;
  esac
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export MUCUDNN_CUDA_BUILD_READY=1
}

if [ "${MUCUDNN_CUDA_BUILD_READY:-0}" != 1 ]; then
  _mucudnn_cuda_build_env
fi

#!/usr/bin/env bash
# The C ABI on a GPU: examples/c_client.c (C, against cuDNN called directly) and
# examples/pytorch_ctypes.py (PyTorch tensors through ctypes, against torch's conv2d).
#
#   bash scripts/gpu/c_abi_check.sh build   # here (no GPU): builds the release libmucudnn.so
#                                           # into .gpu/c_abi/ (ignored by git)
#   bash scripts/gpu/c_abi_check.sh run     # on the GPU machine, with .gpu carried along:
#                                           # compiles and runs both clients
#
# With the device tool: command `bash .gpu/c_abi_check.sh run`, carry [".gpu"]. The GPU
# machine has no Rust toolchain; the header and the examples travel in .gpu/c_abi/. Logs go under $OUT (default /tmp/mucudnn-c-abi); a summary is printed last.
set -uo pipefail
# From the repository root, whether run from scripts/gpu/ or from .gpu/ (build.sh copies it).
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  *) cd "$here/../.." ;;
esac

build() {
  set -e
  mkdir -p .gpu/c_abi
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
  # With a test target in the same call, cargo resolves features as `cargo test --release`
  # does (dev-dependencies unified), so this is the library build.sh's test executables link,
  # not a second build of it that overwrites theirs (a cdylib's file name has no hash) and
  # makes every later call rebuild it.
  cargo build --release --locked --lib --test current_context
  cp "${CARGO_TARGET_DIR:-target}/release/libmucudnn.so" .gpu/c_abi/libmucudnn.so
  strip --strip-debug .gpu/c_abi/libmucudnn.so
  # The clients and the header travel in .gpu: a run carrying only .gpu works.
  cp examples/c_client.c examples/pytorch_ctypes.py include/mucudnn.h .gpu/c_abi/
  du -sh .gpu/c_abi/libmucudnn.so
  echo "now run on the GPU machine: bash scripts/gpu/c_abi_check.sh run   (carry .gpu)"
}

# The first existing path among the arguments.
first() {
  for path in "$@"; do
    [ -e "$path" ] && { echo "$path"; return 0; }
  done
  return 1
}

run() {
  local out=${OUT:-/tmp/mucudnn-c-abi}
  local lib_dir=$PWD/.gpu/c_abi
  mkdir -p "$out"
  : > "$out/summary.txt"
  status() { echo "$1: $([ "$2" -eq 0 ] && echo ok || echo "FAILED ($2)")" >> "$out/summary.txt"; }
  if [ ! -f "$lib_dir/libmucudnn.so" ]; then
    echo "$lib_dir/libmucudnn.so is missing: run 'bash scripts/gpu/c_abi_check.sh build' where" \
         "Rust is installed, and carry .gpu" | tee -a "$out/summary.txt"
    return 1
  fi
  { nvidia-smi --query-gpu=name,driver_version --format=csv; } > "$out/gpu.txt" 2>&1

  # Where CUDA and cuDNN are: the toolkit, the system packages, or PyTorch's wheels.
  local site
  site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
         2>/dev/null || echo /opt/torch/.venv/lib/python3.12/site-packages)
  local cuda_inc cudnn_h cudnn_lib cudart
  cuda_inc=$(first /usr/local/cuda/include/cuda_runtime.h \
    /usr/local/cuda-13*/include/cuda_runtime.h /usr/include/cuda_runtime.h \
    "$site"/nvidia/cu13/include/cuda_runtime.h \
    "$site"/nvidia/cuda_runtime/include/cuda_runtime.h)
  cuda_inc=${cuda_inc:+$(dirname "$cuda_inc")}
  cudart=$(first /usr/local/cuda/lib64/libcudart.so /usr/local/cuda-13*/lib64/libcudart.so \
    /usr/lib/x86_64-linux-gnu/libcudart.so "$site"/nvidia/cu13/lib/libcudart.so.13 \
    "$site"/nvidia/cuda_runtime/lib/libcudart.so.1*)
  # One libcudnn (scripts/gpu/libs.sh: PyTorch's, linked by every name, else the system's):
  # the C client links exactly that libcudnn.so.9, mucudnn loads the same file, and the
  # header comes from the same build where it has one.
  OUT="$out" source .gpu/libs.sh
  if [ -L "$out/lib-links/libcudnn.so" ]; then
    cudnn_lib=$(readlink -f "$out/lib-links/libcudnn.so")
    cudnn_h=$(first "$(dirname "$(dirname "$cudnn_lib")")/include/cudnn.h" /usr/include/cudnn.h \
      /usr/include/x86_64-linux-gnu/cudnn.h /usr/local/cuda/include/cudnn.h)
  else
    cudnn_lib=$(first /usr/lib/x86_64-linux-gnu/libcudnn.so.9 /usr/local/cuda/lib64/libcudnn.so.9 \
      /usr/lib64/libcudnn.so.9)
    cudnn_h=$(first /usr/include/cudnn.h /usr/include/x86_64-linux-gnu/cudnn.h \
      /usr/local/cuda/include/cudnn.h)
  fi
  {
    echo "CUDA headers: ${cuda_inc:-not found}"
    echo "libcudart:    ${cudart:-not found}"
    echo "cudnn.h:      ${cudnn_h:-not found}"
    echo "libcudnn:     ${cudnn_lib:-not found}"
  } | tee "$out/paths.txt"

  if [ -n "$cuda_inc" ] && [ -n "$cudart" ] && [ -n "$cudnn_h" ] && [ -n "$cudnn_lib" ]; then
    local link_dir=$out/cudnn-link
    mkdir -p "$link_dir"
    ln -sf "$cudnn_lib" "$link_dir/libcudnn.so"
    # PyTorch's cuDNN needs the other NVIDIA wheels' libraries too (cuBLAS, NVRTC, ...); never
    # another cuDNN folder than the one chosen.
    local wheel_libs
    wheel_libs=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | grep -v '/nvidia/cudnn/lib$' | tr '\n' ':')
    cc -std=c11 -O2 -Wall -Wextra "$lib_dir/c_client.c" -I "$lib_dir" -I "$cuda_inc" \
      -I "$(dirname "$cudnn_h")" -L "$lib_dir" -lmucudnn "$cudnn_lib" "$cudart" -lm \
      -Wl,-rpath,"$lib_dir" -Wl,-rpath,"$(dirname "$cudnn_lib")" -Wl,-rpath,"$(dirname "$cudart")" \
      -o "$out/c_client" > "$out/c_client-build.txt" 2>&1
    local built=$?
    status "compile examples/c_client.c" $built
    if [ $built -eq 0 ]; then
      LD_LIBRARY_PATH="$link_dir:$(dirname "$cudnn_lib"):$wheel_libs${LD_LIBRARY_PATH:-}" \
        "$out/c_client" > "$out/c_client.txt" 2>&1
      status "C client vs cuDNN (examples/c_client.c)" $?
    else
      cat "$out/c_client-build.txt"
    fi
  else
    status "compile examples/c_client.c (CUDA or cuDNN headers/libraries not found)" 1
  fi

  python3 "$lib_dir/pytorch_ctypes.py" "$lib_dir/libmucudnn.so" > "$out/pytorch_ctypes.txt" 2>&1
  status "PyTorch through ctypes (examples/pytorch_ctypes.py)" $?

  cat "$out/gpu.txt"
  echo "--- examples/c_client.c"
  # The table and checks, without the plans document.
  sed '/^plans (mucudnnGetPlansJson):/,/^}/d' "$out/c_client.txt" 2>/dev/null | tail -n 40
  echo "--- examples/pytorch_ctypes.py"
  tail -n 40 "$out/pytorch_ctypes.txt"
  echo
  cat "$out/summary.txt"
  ! grep -q FAILED "$out/summary.txt"
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac

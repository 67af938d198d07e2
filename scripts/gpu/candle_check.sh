#!/usr/bin/env bash
# mucudnn::candle on a GPU: the CPU checks of tests/candle_cpu.rs on candle's CUDA
# device (forward and gradients vs candle's conv2d for groups, depthwise, dilation, stride 2
# and 1x1; the 9x8 stride-2 input gradient vs the f64 reference; tuning once per shape; errors;
# a small CNN whose SGD step matches candle's; Conv1d and ConvTranspose2d against candle's
# conv1d and conv_transpose2d, tests/candle/layers.rs), then the training step time against
# candle's own cuDNN convolution, and the example with --cuda.
#
#   bash scripts/gpu/candle_check.sh build   # here (no GPU): needs nvcc and the CUDA 13
#                                            # headers and libraries; without nvcc on PATH it
#                                            # sources scripts/cuda_build_env.sh (PyPI's
#                                            # wheels, docs/candle.md); fills .gpu/candle/
#   bash scripts/gpu/candle_check.sh run     # on the GPU machine, with .gpu carried along
#
# On the GPU machine: `bash .gpu/accept.sh candle` (docs/gpu.md). The
# test binary links libcuda, libcudnn, libcublas(Lt), libcurand, libnvrtc and libnccl (cudarc's
# dynamic-linking, forced by candle-core's cuda feature); `run` puts the machine's copies (its
# CUDA install or PyTorch's nvidia wheels) on LD_LIBRARY_PATH. Logs go under $OUT.
set -uo pipefail
# From the repository root, whether run from scripts/gpu/ or from .gpu/ (build.sh copies it).
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  *) cd "$here/../.." ;;
esac

# candle-core's `cudnn` feature makes candle's own conv2d run on cuDNN: the baseline.
FEATURES="candle-cuda,candle-core/cudnn"

build() {
  set -e
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
  mkdir -p .gpu/candle
  # nvcc and the libraries to link: a CUDA install's, else PyPI's wheels (a cache folder).
  command -v nvcc >/dev/null 2>&1 || source scripts/cuda_build_env.sh
  # candle-kernels compiles PTX for this compute capability (there is no GPU to ask here).
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  local exe
  exe=$(cargo test --release --locked --no-default-features --features "$FEATURES" \
    --test candle_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1)
  [ -n "$exe" ] || { echo "building the candle_cuda test failed" >&2; exit 1; }
  cp "$exe" .gpu/candle/candle-cuda-tests
  cargo build --release --locked --no-default-features --features "$FEATURES" \
    --example candle_cnn
  cp "${CARGO_TARGET_DIR:-target}/release/examples/candle_cnn" .gpu/candle/candle_cnn
  du -sh .gpu/candle
  echo "now run on the GPU machine: bash scripts/gpu/candle_check.sh run   (carry .gpu)"
}

run() {
  local out=${OUT:-/tmp/mucudnn-candle}
  mkdir -p "$out"
  # The CUDA libraries: a toolkit's, else PyTorch's nvidia wheels.
  local dirs="" d
  for d in /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu \
    $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]
for root, _, files in os.walk(p):
    if any(f.startswith("lib") and ".so" in f for f in files): print(root)' 2>/dev/null); do
    case "$d" in */cudnn/*) continue ;; esac # cuDNN: libs.sh's one copy (accept.sh)
    [ -d "$d" ] && dirs="$dirs:$d"
  done
  # After what libs.sh put first (one libcudnn, linked by every name), never before it.
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${dirs#:}"
  export XDG_CACHE_HOME="$out/xdg"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
  cat "$out/gpu.txt"
  local status=0
  ./.gpu/candle/candle-cuda-tests --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$out/tests.txt" ||
    status=1
  ./.gpu/candle/candle_cnn --cuda 2>&1 | tee "$out/example.txt" || status=1
  echo "== summary"
  sed -n -E '/^test result|step time|FAILED|panicked/p' "$out/tests.txt"
  tail -n 4 "$out/example.txt"
  return $status
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac

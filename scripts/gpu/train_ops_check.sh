#!/usr/bin/env bash
# GPU acceptance of the training building blocks (src/train/gpu/): every op against its host
# reference, the SGD step, fp32 <-> fp16 transforms, NCCL with world size 1 and a few training
# steps of a tiny CNN; plus the unit tests of src/train/ with the real libraries loaded.
#
# Builds nothing: scripts/gpu/build.sh (here, with Rust) puts the test binaries into .gpu/.
# Run by `bash .gpu/accept.sh train` (docs/gpu.md).
# Logs go under $OUT (default /tmp/mucudnn-train-ops); a summary is printed last.
set -uo pipefail
# From the repository root, whether run from scripts/gpu/ or from .gpu/ (build.sh copies it).
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  *) cd "$here/../.." ;;
esac
G=.gpu
OUT=${OUT:-/tmp/mucudnn-train-ops}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
status() { echo "$1: $([ "$2" -eq 0 ] && echo ok || echo "FAILED ($2)")" >> "$OUT/summary.txt"; }
for binary in train-ops-tests lib-tests; do
  if [ ! -x "$G/$binary" ]; then
    echo "$G/$binary is missing: run 'bash scripts/gpu/build.sh' where Rust is installed, and" \
         "carry .gpu" | tee -a "$OUT/summary.txt"
    exit 1
  fi
done
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1

# cuBLAS, NCCL and cuDNN by the names cudarc loads (the system's, else PyTorch's wheel).
source scripts/gpu/libs.sh

$G/train-ops-tests --include-ignored --nocapture --test-threads=1 > "$OUT/train-ops-tests.txt" 2>&1
status "training ops vs host references, NCCL world 1, tiny CNN steps (tests/gpu_train_ops.rs)" $?
$G/lib-tests train:: --include-ignored --nocapture --test-threads=1 > "$OUT/train-unit-tests.txt" 2>&1
status "src/train unit tests with the libraries present" $?

cat "$OUT/gpu.txt" "$OUT/libraries.txt"
grep -E "^(test |NCCL|cuBLAS|libraries|tiny CNN)|max error|skipped|panicked|FAILED" "$OUT/train-ops-tests.txt" | tail -n 80
grep -E "test result" "$OUT/train-unit-tests.txt"
echo
cat "$OUT/summary.txt"
! grep -q FAILED "$OUT/summary.txt"

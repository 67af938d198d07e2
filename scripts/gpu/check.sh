#!/usr/bin/env bash
# The GPU acceptance of the cuDNN backend, in one call on the GPU machine (see build.sh).
# Writes logs under $OUT and prints a short summary last.
set -uo pipefail
G=.gpu
OUT=${OUT:-/tmp/mucudnn-gpu}
mkdir -p "$OUT"
TORCH_CUDNN=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib
[ -d "$TORCH_CUDNN" ] && export LD_LIBRARY_PATH="$TORCH_CUDNN:${LD_LIBRARY_PATH:-}"
status() { echo "$1: $([ "$2" -eq 0 ] && echo ok || echo "FAILED ($2)")" >> "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1

MUCUDNN_GPU_TESTS=1 $G/lib-tests backend::cudnn --nocapture --test-threads=1 > "$OUT/lib-tests.txt" 2>&1
status "cuDNN wall GPU tests" $?
python3 $G/torch_cases.py "$OUT/torch" > "$OUT/torch-cases.txt" 2>&1
status "PyTorch cases" $?
MUCUDNN_GPU_TESTS=1 MUCUDNN_TORCH_DIR="$OUT/torch" $G/gpu-tests --nocapture --test-threads=1 > "$OUT/gpu-tests.txt" 2>&1
status "plan equivalence (host reference, PyTorch)" $?
MUCUDNN_GPU_TESTS=1 $G/gpu-engines --nocapture --test-threads=1 > "$OUT/gpu-engines.txt" 2>&1
status "graph-API engines (host reference, offset micro-batches, names)" $?

start=$(date +%s.%N)
$G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw --workspace-limit 64MiB \
  --device cuda --save-profile "$OUT/alexnet-fp32.json" > "$OUT/tune-alexnet-fp32.txt" 2>&1
status "tune alexnet fp32 (profile + solve)" $?
echo "tune alexnet fp32 wall: $(echo "$(date +%s.%N) - $start" | bc) s" >> "$OUT/summary.txt"
$G/mucudnn solve --profile "$OUT/alexnet-fp32.json" --workspace-limit 64MiB > /dev/null 2>&1
python3 $G/compare_profile.py "$OUT/alexnet-fp32.json" $G/h100-alexnet-profile.json > "$OUT/compare-profile.txt" 2>&1
status "profile within 15% of the shipped H100 profile" $?
$G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw --workspace-limit 64MiB \
  --device cuda --verify > "$OUT/verify-alexnet-fp32.txt" 2>&1
status "tune --verify alexnet fp32" $?
$G/mucudnn tune --model alexnet --batch 256 --dtype fp16 --layout nhwc --workspace-limit 64MiB \
  --device cuda --verify > "$OUT/verify-alexnet-fp16.txt" 2>&1
status "tune --verify alexnet fp16 nhwc" $?

# Issue "tuning for real networks": ResNet-50 fp16 NHWC at batch 128 under 8 MiB, with a report.
$G/mucudnn tune --model resnet50 --batch 128 --dtype fp16 --layout nhwc --workspace-limit 8MiB \
  --device cuda --report "$OUT/resnet50-fp16-report" > "$OUT/tune-resnet50-fp16.txt" 2>&1
status "tune resnet50 fp16 nhwc 8MiB (+ report)" $?

cat "$OUT/gpu.txt"
grep -E "profiled in" "$OUT/tune-alexnet-fp32.txt"
grep -E "rebuilt from their names|: sweep [0-9]+ configurations|beta = 1 checked" "$OUT/gpu-engines.txt"
tail -n 12 "$OUT/compare-profile.txt"
grep -A 20 "measured end to end" "$OUT/verify-alexnet-fp32.txt" | tail -n 18
grep -E "^total" "$OUT/tune-resnet50-fp16.txt"
echo
cat "$OUT/summary.txt"

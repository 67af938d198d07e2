#!/usr/bin/env bash
# The GPU acceptance, one part per device call (docs/gpu.md). Built here, where Rust is, by
# `bash scripts/gpu/build.sh` (it fills .gpu/ and copies this script there); run there, on the
# GPU machine, from the repository root with .gpu carried along:
#
#   bash .gpu/accept.sh          lists the parts, in priority order, with their time budgets
#   bash .gpu/accept.sh PART     runs one part
#
# Every part runs under a budget (PART_BUDGET_S, default 480 s: a device call allows 600), each
# step under what is left of it; a step that runs out is a failure, not a skip. It writes under
# $OUT (default .gpu/out): PART.json (the summary: steps, status, seconds, the cuDNN loaded),
# PART.log (every step's output, in order) and PART-files.tar.gz (the JSON reports, profiles
# and tables the steps wrote), prints a short table last, and exits non-zero on any failure.
#
# One libcudnn per process: scripts/gpu/libs.sh links PyTorch's cuDNN by every name, and the
# first step of every part proves that only one cuDNN folder loads.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  */scripts/gpu) cd "$here/../.." ;;
esac
G=.gpu
PART_BUDGET_S=${PART_BUDGET_S:-480}
# Engine configurations timed per (op, micro-batch size): bounded, so that a part fits its call.
export MAX_CANDIDATES=${MAX_CANDIDATES:-8}

# part|budget minutes|what it proves (priority order: the first parts matter most)
PARTS="torch|6|the PyTorch package from the wheel: its CUDA tests, converted AlexNet and ResNet-50 against PyTorch (outputs, gradients; fp32, fp16 channels-last)
torch-speed|8|the PyTorch package: step time and peak memory at 8/64/256 MiB per layer against cudnn.benchmark, and tuning time
nd|8|3-D convolutions: the Wan VAE decoder's convolutions (480p x 17 frames, fp16 NDHWC, forward) and r3d_18 training (batch 8), mucudnn at 256 MiB and 1 GiB per layer against cudnn.benchmark: time and peak memory
spatial|8|spatial splits at batch 1: the SDXL VAE decoder's convolutions (2048x2048, fp16 NHWC) and the Wan VAE decoder's (480p x 17 frames, fp16 NDHWC), forward, split=auto at 64 MiB, 256 MiB and 1 GiB per layer against cudnn.benchmark: time, peak memory, which layers split
wall|8|the cuDNN wall and engines: the ignored GPU tests (float64 reference, PyTorch's results, offset micro-batches), a legacy AlexNet tune against the legacy H100 fixture, tune --verify fp32 and fp16
engines|8|engine plans: AlexNet fp16/fp32 plans (legacy + engines) executed against PyTorch's cudnn.benchmark timed in the same run, and the tuning time
c-abi|3|the C ABI clients: examples/c_client.c against cuDNN, examples/pytorch_ctypes.py against torch
candle|5|mucudnn::candle on candle's CUDA device (built here only where nvcc is)
train|5|the candle trainer (examples/candle_ddp.rs) on the GPU: the loss falls, and images/s with mucudnn's convolutions (NCCL, then host gradient sums) against candle's own conv2d in the same run (built here with nvcc or PyPI's CUDA wheels)"

list_parts() {
  echo "bash .gpu/accept.sh PART   (each part under ${PART_BUDGET_S} s; run them in this order)"
  printf '%-12s %8s  %s\n' part minutes "what it proves"
  while IFS='|' read -r name minutes what; do
    printf '%-12s %8s  %s\n' "$name" "$minutes" "$what"
  done <<< "$PARTS"
}

part=${1:-}
if [ -z "$part" ]; then
  list_parts
  exit 0
fi
if ! grep -q "^$part|" <<< "$PARTS"; then
  echo "unknown part '$part'" >&2
  list_parts >&2
  exit 2
fi

OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
work=/tmp/mucudnn-accept/$part
rm -rf "$work"
mkdir -p "$work"
log="$OUT/$part.log"
: > "$log"
steps="$work/steps.tsv"
: > "$steps"
started=$(date +%s)

# step NAME COMMAND...: runs COMMAND with what is left of the part's budget, its output into
# the part's log; records name, exit status and seconds.
step() {
  local name=$1
  shift
  local left=$((PART_BUDGET_S - ($(date +%s) - started)))
  if [ "$left" -lt 5 ]; then
    printf '%s\t%s\t%s\n' "$name" "budget spent, not run" 0 >> "$steps"
    echo "== $name: not run, the part's ${PART_BUDGET_S} s are spent" | tee -a "$log"
    return 1
  fi
  local t0 rc
  t0=$(date +%s)
  echo "== $name (at most $left s)" | tee -a "$log"
  if declare -F "$1" > /dev/null; then
    "$@" >> "$log" 2>&1 # a function of this script (it may export): no timeout of its own
  else
    timeout --kill-after=10 "$left" "$@" >> "$log" 2>&1
  fi
  rc=$?
  local status=ok
  [ "$rc" -eq 0 ] || status="FAILED ($rc)"
  [ "$rc" -eq 124 ] && status="FAILED (out of time after $left s)"
  printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" >> "$steps"
  echo "== $name: $status" | tee -a "$log"
  return "$rc"
}

# The binaries travel xz-compressed (build.sh): unpacked into .gpu once.
if [ -f $G/binaries.tar.xz ] && [ ! -f $G/.unpacked ]; then
  tar -xJf $G/binaries.tar.xz -C $G && touch $G/.unpacked
fi

# The machine and one cuDNN.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/gpu.txt" 2>&1
OUT="$work" source scripts/gpu/libs.sh
step "one libcudnn loads (libs.sh)" one_cudnn_check

# The Python package: the wheel that build.sh made, installed into a folder of this part, on
# PYTHONPATH; pytest from wheels build.sh fetched, where the machine lacks it.
python_package() {
  local wheel
  wheel=$(ls $G/mucudnn-*-py3-none-manylinux_2_28_x86_64.whl 2>/dev/null | head -n 1)
  [ -n "$wheel" ] || { echo "no wheel in $G: run scripts/gpu/build.sh"; return 1; }
  python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" \
    "$wheel" || return 1
  if ! python3 -c 'import pytest' 2>/dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" \
      $G/wheels/*.whl || return 1
  fi
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  export XDG_CACHE_HOME="$work/xdg" # mucudnn's runtime links (python/mucudnn/_lib.py)
  python3 - "$work/site" <<'PY'
import sys
import torch, mucudnn
assert mucudnn.__file__.startswith(sys.argv[1]), f"imported {mucudnn.__file__}, not the wheel"
assert mucudnn.version() == mucudnn.__version__, (mucudnn.version(), mucudnn.__version__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "| mucudnn", mucudnn.__version__, "from", mucudnn.__file__, "| library", mucudnn.library_path(),
      "| GPU", torch.cuda.get_device_name())
PY
}

case "$part" in
  torch)
    step "the wheel installs and imports" python_package &&
      step "pytest: CUDA tests and library loading" python3 -m pytest -q -p no:cacheprovider -rs \
        python/tests/test_torch_cuda.py python/tests/test_loader.py
    step "converted AlexNet and ResNet-50 against PyTorch (outputs, gradients)" \
      python3 $G/torch_check.py "$work/torch" alexnet resnet50 --mode correctness \
      --max-candidates "$MAX_CANDIDATES"
    ;;
  torch-speed)
    step "the wheel installs and imports" python_package &&
      step "step time and peak memory against cudnn.benchmark" \
        python3 $G/torch_check.py "$work/torch" alexnet resnet50 --mode speed \
        --max-candidates "$MAX_CANDIDATES"
    ;;
  nd)
    step "the wheel installs and imports" python_package &&
      step "Wan VAE decoder convs and r3d_18 training against cudnn.benchmark" \
        python3 $G/nd_bench.py "$work/nd" --mucudnn $G/mucudnn \
        --max-candidates "$MAX_CANDIDATES"
    ;;
  spatial)
    step "the wheel installs and imports" python_package &&
      step "SDXL and Wan VAE decoder convs, split=auto, against cudnn.benchmark" \
        python3 $G/spatial_bench.py "$work/spatial" --mucudnn $G/mucudnn \
        --max-candidates "$MAX_CANDIDATES"
    ;;
  wall)
    step "cuDNN wall unit tests (lib, ignored GPU tests included)" \
      $G/lib-tests backend::cudnn --include-ignored --test-threads=1
    step "PyTorch's cases for the plan tests" python3 $G/torch_cases.py "$work/torch"
    step "plans: undivided, float64 reference, PyTorch (tests/gpu_cudnn.rs)" \
      env MUCUDNN_TORCH_DIR="$work/torch" $G/gpu-tests --include-ignored --nocapture --test-threads=1
    step "graph-API engines (tests/gpu_engines.rs)" \
      $G/gpu-engines --include-ignored --nocapture --test-threads=1
    step "teardown on the caller's stream, graph capture (tests/gpu_teardown.rs)" \
      $G/gpu-teardown --include-ignored --nocapture --test-threads=1
    step "the caller's current context (tests/current_context.rs, one GPU)" \
      $G/current-context --include-ignored --nocapture --test-threads=1 \
      no_current_context_stays_none
    # Like with like: legacy algorithms against the legacy-only H100 fixture.
    step "tune AlexNet fp32, legacy algorithms" \
      $G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw \
      --workspace-limit 64MiB --device cuda --candidates legacy \
      --save-profile "$work/alexnet-fp32-legacy.json" --cache "$work/cache.sqlite"
    step "legacy profile within 15% of the legacy H100 fixture" \
      python3 $G/compare_profile.py "$work/alexnet-fp32-legacy.json" $G/h100-alexnet-profile.json
    step "tune --verify AlexNet fp32 (legacy + engines)" \
      $G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw \
      --workspace-limit 64MiB --device cuda --candidates all --max-candidates "$MAX_CANDIDATES" \
      --cache "$work/cache.sqlite" --verify
    step "tune --verify AlexNet fp16 NHWC (legacy + engines)" \
      $G/mucudnn tune --model alexnet --batch 256 --dtype fp16 --layout nhwc \
      --workspace-limit 64MiB --device cuda --candidates all --max-candidates "$MAX_CANDIDATES" \
      --cache "$work/cache.sqlite" --verify
    ;;
  engines)
    # Engines against PyTorch timed in the same run (never against the legacy fixture).
    step "AlexNet plans against cudnn.benchmark, and tuning time" \
      env G=$G OUT="$work/engines" bash $G/engines_vs_torch.sh alexnet tuning
    ;;
  c-abi)
    step "C and PyTorch ctypes clients" env OUT="$work/c-abi" bash $G/c_abi_check.sh run
    ;;
  candle)
    if [ -f $G/candle/NOT-BUILT ]; then
      step "candle was built" sh -c "cat $G/candle/NOT-BUILT; exit 1"
    else
      step "candle on CUDA" env OUT="$work/candle" bash $G/candle_check.sh run
    fi
    ;;
  train)
    if [ -f $G/candle_ddp/NOT-BUILT ]; then
      step "the candle trainer was built" sh -c "cat $G/candle_ddp/NOT-BUILT; exit 1"
    else
      step "candle trainer: mucudnn against candle's conv2d, NCCL against host sums" \
        env OUT="$work/train" bash $G/candle_ddp_check.sh run
    fi
    ;;
esac

# The summary: JSON, the files the steps wrote, the table.
tar -czf "$OUT/$part-files.tar.gz" -C "$work" --exclude=site --exclude=xdg --exclude=lib-links \
  --exclude='*.sqlite' . 2>> "$log"
python3 - "$part" "$steps" "$work" "$OUT/$part.json" "$(($(date +%s) - started))" <<'PY'
import json, sys
part, steps, work, out, seconds = sys.argv[1:]
rows = [line.rstrip("\n").split("\t") for line in open(steps) if line.strip()]
def text(name):
    try:
        return open(f"{work}/{name}").read().strip()
    except OSError:
        return None
doc = {
    "part": part,
    "passed": bool(rows) and all(status == "ok" for _, status, _ in rows),
    "seconds": int(seconds),
    "gpu": text("gpu.txt"),
    "libraries": text("libraries.txt"),
    "steps": [{"name": n, "status": s, "seconds": int(t)} for n, s, t in rows],
}
json.dump(doc, open(out, "w"), indent=1)
print()
print(f"{'step':<72} {'status':<24} {'s':>5}")
for n, s, t in rows:
    print(f"{n[:72]:<72} {s:<24} {t:>5}")
print(f"part {part}: {'PASSED' if doc['passed'] else 'FAILED'} in {seconds} s "
      f"({doc['gpu']}); log {out[:-5]}.log")
sys.exit(0 if doc["passed"] else 1)
PY

#!/usr/bin/env bash
# Issue 7's GPU acceptance, on the GPU machine: the GPU replica's tests (tests/gpu_train.rs:
# world size 1 over NCCL, loss falls, first step vs the CPU replica, fp16), then
# `mucudnn train --device cuda` for each dtype at 8 MiB and 64 MiB per layer, micro-batched
# and with --no-microbatch (the best single algorithm per layer), and a table last: dtype,
# limit, micro-batching, images/s, ms/step, conv share, final held-out accuracy.
#
# Builds nothing: scripts/gpu/build.sh (here, with Rust) puts the binaries and this script
# into .gpu/. With the device tool, carry [".gpu"]:
#   bash .gpu/train_check.sh              tests, then fp32 and fp16 (about 8 minutes)
#   bash .gpu/train_check.sh tests fp32   the same in two calls, if one call is too short:
#   bash .gpu/train_check.sh fp16
# Settings by environment: EPOCHS (3), LIMITS ("8MiB 64MiB"), CANDIDATES (all: legacy
# algorithms and engine configurations), MAX_CANDIDATES (16 engine configurations per (op,
# micro-batch size), to bound the tuning time; 0: every one), BATCH (256), TRAIN_SIZE
# (10240), TEST_SIZE (2048).
# Logs, JSON reports and the tuning cache (shared by the runs of one dtype: a new limit or
# --no-microbatch is solved from the stored measurements) go under $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  */scripts/gpu) cd "$here/../.." ;;
esac
G=.gpu
OUT=${OUT:-/tmp/mucudnn-train}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests fp32 fp16)
EPOCHS=${EPOCHS:-3}
LIMITS=${LIMITS:-"8MiB 64MiB"}
CANDIDATES=${CANDIDATES:-all}
MAX_CANDIDATES=${MAX_CANDIDATES:-16}
bound=()
[ "$MAX_CANDIDATES" != 0 ] && bound=(--max-candidates "$MAX_CANDIDATES")
BATCH=${BATCH:-256}
TRAIN_SIZE=${TRAIN_SIZE:-10240}
TEST_SIZE=${TEST_SIZE:-2048}
: > "$OUT/summary.txt"
status() { echo "$1: $([ "$2" -eq 0 ] && echo ok || echo "FAILED ($2)")" >> "$OUT/summary.txt"; }
for binary in mucudnn train-tests; do
  if [ ! -x "$G/$binary" ]; then
    echo "$G/$binary is missing: run 'bash scripts/gpu/build.sh' where Rust is installed, and" \
         "carry .gpu" | tee -a "$OUT/summary.txt"
    exit 1
  fi
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# cuBLAS, NCCL and cuDNN by the names cudarc loads (the system's, else PyTorch's wheel).
libs=$G/train_libs.sh
[ -f "$libs" ] || libs=scripts/gpu/train_libs.sh
source "$libs"

# A network where the convolutions matter on an H100: 3x64x64 images, blocks of 64, 128 and
# 256 channels (64x64, 32x32, 16x16), a per-rank batch of 256.
NET=(--image-size 64 --channels 3 --block-channels 64,128,256 --noise 0.75 --lr 0.01
     --batch "$BATCH" --train-size "$TRAIN_SIZE" --test-size "$TEST_SIZE" --epochs "$EPOCHS")
runs=()
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      start=$(date +%s)
      MUCUDNN_GPU_TESTS=1 $G/train-tests --nocapture --test-threads=1 > "$OUT/train-tests.txt" 2>&1
      rc=$?
      status "GPU replica tests (tests/gpu_train.rs), $(( $(date +%s) - start )) s" $rc
      ;;
    fp32|fp16)
      for limit in $LIMITS; do
        for mode in micro undivided; do
          name="$step-$limit-$mode"
          extra=()
          [ "$mode" = undivided ] && extra=(--no-microbatch)
          start=$(date +%s)
          $G/mucudnn train --device cuda --dtype "$step" --workspace-limit "$limit" \
            --candidates "$CANDIDATES" "${bound[@]}" --cache "$OUT/cache-$step.sqlite" "${NET[@]}" \
            "${extra[@]}" --json > "$OUT/$name.json" 2> "$OUT/$name.log"
          rc=$?
          status "train $name, $(( $(date +%s) - start )) s" $rc
          runs+=("$name")
        done
      done
      ;;
    *)
      echo "unknown step '$step' (tests, fp32 or fp16)" | tee -a "$OUT/summary.txt"
      ;;
  esac
done

cat "$OUT/gpu.txt" "$OUT/libraries.txt"
if [ -f "$OUT/train-tests.txt" ]; then
  grep -E "^(test |fp16|fp32|evaluate|after one step)|skipped|panicked|FAILED|test result" \
    "$OUT/train-tests.txt" | tail -n 60
fi
if [ ${#runs[@]} -gt 0 ]; then
  python3 - "$OUT" "${runs[@]}" <<'PY'
import json, os, sys
out, runs = sys.argv[1], sys.argv[2:]
print()
print(f"{'dtype':<6} {'limit':>7} {'micro-batch':>11} {'images/s':>10} {'ms/step':>8} "
      f"{'conv share':>10} {'held-out acc':>12} {'tuning s':>8}")
rows = {}
for name in runs:
    dtype, limit, mode = name.split("-")
    try:
        with open(os.path.join(out, name + ".json")) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{dtype:<6} {limit:>7} {mode:>11}  no report ({e.__class__.__name__}; see {name}.log)")
        continue
    s = doc["summary"]
    rows[(dtype, limit, mode)] = s
    print(f"{dtype:<6} {limit:>7} {'yes' if mode == 'micro' else 'no':>11} "
          f"{s['images_per_s']:>10.1f} {s['ms_per_step']:>8.2f} {100 * s['conv_share']:>9.1f}% "
          f"{100 * s['final_test_accuracy']:>11.1f}% {s['tuning_s']:>8.1f}")
print()
for (dtype, limit, mode), s in rows.items():
    base = rows.get((dtype, limit, "undivided"))
    if mode == "micro" and base and base["images_per_s"] > 0:
        print(f"{dtype} {limit}: micro-batching {s['images_per_s'] / base['images_per_s']:.3f}x "
              f"the images/s of the best single algorithm per layer")
PY
fi
echo
cat "$OUT/summary.txt"
! grep -q FAILED "$OUT/summary.txt"

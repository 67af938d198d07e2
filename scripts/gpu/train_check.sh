#!/usr/bin/env bash
# Issue 7's and 18's GPU acceptance, on the GPU machine: the GPU replica's tests
# (tests/gpu_train.rs: world size 1 over NCCL, loss falls, first step vs the CPU replica,
# fp16); issue 18's checks on a small network: `multi` (one process drives every visible GPU,
# communicators from ncclCommInitAll, --check-sync, identical plans on every rank), `fail` (a
# rank failing at step 3 via MUCUDNN_TRAIN_FAIL_AT ends the run non-zero with its message
# within 30 s; with 2+ GPUs the failing rank is 1, so rank 0 waits behind NCCL), `scaling`
# (fp16 from a loss scale of 2^24: the first steps overflow, are skipped and reported, the
# scale backs off and training goes on); then `mucudnn train --device cuda` for each dtype at
# 8 MiB and 64 MiB per layer, micro-batched and with --no-microbatch (the best single
# algorithm per layer), and a table last: dtype, limit, micro-batching, images/s, ms/step,
# conv share, final held-out accuracy, skipped steps.
#
# Builds nothing: scripts/gpu/build.sh (here, with Rust) puts the binaries and this script
# into .gpu/. With the device tool, carry [".gpu"]:
#   bash .gpu/train_check.sh              tests, multi, fail, scaling, fp32, fp16 (not yet
#                                         timed on a GPU; if one call is too short, split it:)
#   bash .gpu/train_check.sh tests multi fail scaling
#   bash .gpu/train_check.sh fp32
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
[ ${#steps[@]} -eq 0 ] && steps=(tests multi fail scaling fp32 fp16)
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
libs=$G/libs.sh
[ -f "$libs" ] || libs=scripts/gpu/libs.sh
source "$libs"

# A network where the convolutions matter on an H100: 3x64x64 images, blocks of 64, 128 and
# 256 channels (64x64, 32x32, 16x16), a per-rank batch of 256.
NET=(--image-size 64 --channels 3 --block-channels 64,128,256 --noise 0.75 --lr 0.01
     --batch "$BATCH" --train-size "$TRAIN_SIZE" --test-size "$TEST_SIZE" --epochs "$EPOCHS")
# Issue 18's checks: a small network, one epoch, a bounded tuning.
SMALL=(--image-size 32 --channels 3 --block-channels 16,32 --noise 0.5 --lr 0.02 --batch 64
       --train-size 2048 --test-size 512 --epochs 1 --max-candidates 4
       --cache "$OUT/cache-small.sqlite")
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
check() { # name, python condition over doc (the --json document); prints what it saw
  python3 - "$OUT/$1.json" "$2" <<'PY'
import json, math, sys
path, condition = sys.argv[1:]
try:
    doc = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"  no report: {e}"); sys.exit(1)
s, t = doc["summary"], doc["tuning"]
print(f"  ranks {doc['settings']['ranks']}, skipped steps {s['skipped_steps']} "
      f"(per epoch {[e['skipped_steps'] for e in doc['epochs']]}), held-out loss "
      f"{s['final_test_loss']:.4f}, accuracy {100 * s['final_test_accuracy']:.1f}%, plans "
      f"{t['plans_fnv1a']}, tuning tasks {t['tasks']} dealt as {t['measured_by_rank']}")
sys.exit(0 if eval(condition) else 1)
PY
}
runs=()
for step in "${steps[@]}"; do
  case "$step" in
    multi)
      # No --ranks: every visible GPU, one process, communicators from ncclCommInitAll.
      start=$(date +%s)
      $G/mucudnn train --device cuda "${SMALL[@]}" --check-sync --json > "$OUT/multi.json" \
        2> "$OUT/multi.log" &&
        check multi "doc['settings']['ranks'] == $gpus and len(set(t['plans_fnv1a'])) == 1" \
          > "$OUT/multi.txt"
      rc=$?
      status "multi: $gpus GPU(s) in one process (ncclCommInitAll), --check-sync, $(( $(date +%s) - start )) s" $rc
      ;;
    fail)
      fail_rank=$([ "$gpus" -gt 1 ] && echo 1 || echo 0)
      start=$(date +%s.%N)
      MUCUDNN_TRAIN_FAIL_AT=$fail_rank:3 timeout 120 $G/mucudnn train --device cuda "${SMALL[@]}" \
        --json > /dev/null 2> "$OUT/fail.log"
      code=$?
      elapsed=$(python3 -c "import time; print(f'{time.time() - $start:.2f}')")
      rc=0
      if [ "$code" -eq 0 ] || [ "$code" -eq 124 ]; then rc=1; fi
      grep -q "injected failure before step 3" "$OUT/fail.log" || rc=1
      python3 -c "import sys; sys.exit(0 if $elapsed < 30 else 1)" || rc=1
      status "fail: rank $fail_rank of $gpus failing at step 3 ended the run with status $code after $elapsed s" $rc
      ;;
    scaling)
      start=$(date +%s)
      $G/mucudnn train --device cuda --dtype fp16 --loss-scale 16777216 "${SMALL[@]}" --json \
        > "$OUT/scaling.json" 2> "$OUT/scaling.log" &&
        check scaling "s['skipped_steps'] > 0 and math.isfinite(s['final_test_loss'])" \
          > "$OUT/scaling.txt"
      rc=$?
      status "scaling: fp16 from loss scale 2^24, skipped steps reported, $(( $(date +%s) - start )) s" $rc
      ;;
    tests)
      start=$(date +%s)
      $G/train-tests --include-ignored --nocapture --test-threads=1 > "$OUT/train-tests.txt" 2>&1
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
      echo "unknown step '$step' (tests, multi, fail, scaling, fp32 or fp16)" | tee -a "$OUT/summary.txt"
      ;;
  esac
done

cat "$OUT/gpu.txt" "$OUT/libraries.txt"
for name in multi scaling; do
  [ -f "$OUT/$name.txt" ] && { echo "$name:"; cat "$OUT/$name.txt"; }
done
[ -f "$OUT/fail.log" ] && { echo "fail (stderr, last lines):"; tail -n 5 "$OUT/fail.log"; }
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
      f"{'conv share':>10} {'held-out acc':>12} {'tuning s':>8} {'skipped':>7}")
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
          f"{100 * s['final_test_accuracy']:>11.1f}% {s['tuning_s']:>8.1f} {s['skipped_steps']:>7}")
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

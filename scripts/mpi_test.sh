#!/usr/bin/env bash
# The MPI tests, on the CPU, of the data-parallel candle trainer
# (examples/candle_ddp.rs, docs/training.md):
# 1. `mpirun -np 2` equals one process computing the 2 ranks' shards in turn, bit for bit
#    (every step's loss, the held-out losses, the final parameters), given the same cache file
#    (so both run the same plans); the loss falls over 3 epochs and the held-out accuracy is
#    well above chance.
# 2. With a cache file per process the measuring is dealt out (about half each, disjoint) and
#    both processes run identical plans; a second run measures nothing.
# 3. A rank failing at step 3 ends the job, non-zero, with its message, within 30 s.
# 4. Mixed precision, `--dtype bf16` (f32 master weights, the model in bf16) for 2 epochs:
#    `mpirun -np 2` equals one process with the 2 ranks' shards, bit for bit; the loss falls
#    and the held-out accuracy is above chance.
# 5. `--dtype f16` (dynamic loss scaling) for 8 steps: the same bits under mpirun as in one
#    process, including the steps skipped for inf/NaN gradients while the scale comes down.
#
# Installs Debian's Open MPI (openmpi-bin, libopenmpi-dev) and libclang-dev (rsmpi's bindgen)
# with apt-get when missing and apt is usable (idempotent: nothing is installed twice), builds
# the example with `--features candle,mpi`, and runs the checks. Exits 77 with "skipped: ..."
# when MPI cannot be had. Run from anywhere: bash scripts/mpi_test.sh [--install]
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lock.sh

skip() { echo "skipped: $*"; exit 77; }

missing_packages() {
  need_packages=()
  command -v mpirun >/dev/null 2>&1 || need_packages+=(openmpi-bin)
  command -v mpicc >/dev/null 2>&1 || need_packages+=(libopenmpi-dev)
  # libclang itself: libclang-cpp.so.* (a C++ interface some images ship) is not what bindgen loads.
  ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || need_packages+=(libclang-dev)
}

# Under a lock for the whole machine (apt's own lock makes a second apt-get fail, not wait): a
# second test run waits for the first's install, then finds the packages there.
install_packages() {
  missing_packages
  [ ${#need_packages[@]} -gt 0 ] || return 0
  command -v apt-get >/dev/null 2>&1 || skip "MPI is missing (${need_packages[*]}) and there is no apt-get"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
      skip "MPI is missing (${need_packages[*]}) and apt-get needs root"; fi
  fi
  echo "installing ${need_packages[*]} (apt-get)"
  # DPkg::Lock::Timeout: wait for an apt-get outside the test runs rather than fail at once.
  if ! { $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        "${need_packages[@]}" >/dev/null; }; then
    skip "apt-get could not install ${need_packages[*]}"
  fi
}
missing_packages
[ ${#need_packages[@]} -eq 0 ] || with_lock "${TMPDIR:-/tmp}/mucudnn-apt.lock" install_packages
command -v mpirun >/dev/null 2>&1 || skip "mpirun is still missing"
# --install: only the packages (scripts/test.sh installs them in the background while cargo
# compiles, then runs this script again for the tests).
if [ "${1:-}" = --install ]; then
  echo "MPI is installed ($(command -v mpirun))"
  exit 0
fi

# The protocol's and the gradient sum's unit tests (src/candle/ddp.rs, grad_sum.rs), then the
# program.
cargo test --locked --no-default-features --features candle,mpi --lib -- candle::ddp \
  candle::grad_sum
cargo build --locked --no-default-features --features candle,mpi --example candle_ddp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A copy of this run's own: another build in the same target dir may replace the example while
# the checks run.
bin=$work/candle_ddp
cp "${CARGO_TARGET_DIR:-target}/debug/examples/candle_ddp" "$bin"
# One candle thread per process in every run (two processes share the runner's two cores).
export RAYON_NUM_THREADS=1
mpirun_np2=(mpirun --allow-run-as-root --oversubscribe -np 2 -x RAYON_NUM_THREADS)
args=(--batch 32 --train-size 512 --test-size 256 --image-size 16 --channels 1 --classes 4
      --width 8 --noise 0.1 --lr 0.05 --momentum 0.9 --json)

# 1. Same plans, same bits: one process with the 2 ranks' shards in turn (it fills the cache),
#    then two MPI processes on that cache; and one rank with the whole global batch, whose sums
#    run in another order (close, not equal).
"$bin" "${args[@]}" --epochs 3 --local-ranks 2 --cache "$work/cache.sqlite" > "$work/local.json"
"${mpirun_np2[@]}" "$bin" "${args[@]}" --epochs 3 --cache "$work/cache.sqlite" > "$work/mpi.json"
"$bin" "${args[@]}" --epochs 1 --cache "$work/cache.sqlite" > "$work/one.json" 2> /dev/null
python3 - "$work/local.json" "$work/mpi.json" "$work/one.json" <<'PY'
import json, sys
local, mpi, one = (json.load(open(p)) for p in sys.argv[1:])
# One rank, global batch: the first epoch's step losses within 1e-6 relative of the 2 ranks'.
steps = len(one["step_losses"])
drift = max(abs(a - b) / abs(b) for a, b in zip(one["step_losses"], mpi["step_losses"][:steps]))
assert one["ranks"] == 1 and drift <= 1e-6, f"1 rank vs 2: relative difference {drift}"
print(f"1 rank with the global batch vs 2 ranks: step losses of epoch 1 within {drift:.1e} relative")
assert local["ranks"] == mpi["ranks"] == 2 and (local["processes"], mpi["processes"]) == (1, 2)
def bits(run):
    return ([x.hex() for x in run["step_losses"]],
            [(e["train_loss"].hex(), e["test_loss"].hex(), e["test_accuracy"]) for e in run["epochs"]],
            run["initial_test_loss"].hex(), run["parameters_fnv1a"])
assert bits(local) == bits(mpi), f"one process {bits(local)} != mpirun {bits(mpi)}"
epochs = mpi["epochs"]
assert len(epochs) == 3
losses = [e["train_loss"] for e in epochs]
assert losses[2] < losses[0] and epochs[2]["test_loss"] < mpi["initial_test_loss"], losses
chance = 1 / mpi["settings"]["classes"]
accuracy = epochs[-1]["test_accuracy"]
assert accuracy >= chance + 0.3, f"held-out accuracy {accuracy} vs chance {chance}"
print(f"mpirun -np 2 == 2 ranks in one process, bit for bit ({len(mpi['step_losses'])} steps, "
      f"parameters {mpi['parameters_fnv1a']}); train loss by epoch {[round(x, 4) for x in losses]}, "
      f"held-out accuracy {accuracy:.3f} (chance {chance:.2f})")
PY

# 2. A cache file per process (as with a file per host): the measuring is dealt out over the
#    two processes and shared; both end with identical plans; a second run measures nothing.
for run in first second; do
  "${mpirun_np2[@]}" sh -c 'exec "$0" "$@" --cache "'"$work"'/rank-$OMPI_COMM_WORLD_RANK.sqlite"' \
    "$bin" "${args[@]}" --epochs 1 > "$work/dealt-$run.json"
done
python3 - "$work/dealt-first.json" "$work/dealt-second.json" <<'PY'
import json, sys
first, second = (json.load(open(p))["tuning"] for p in sys.argv[1:])
shares = first["measured_by_rank"]
assert first["tasks"] > 0 and len(shares) == 2, first
# Each task is measured by exactly one process (the deduplicated union dealt round-robin), so
# the shares are disjoint, cover the tasks, and are about half each.
assert sum(shares) == first["tasks"] and min(shares) >= first["tasks"] // 3, first
assert len(set(first["plans_fnv1a"])) == 1, f"the ranks run different plans: {first}"
assert second["tasks"] == 0 and second["measured_by_rank"] == [0, 0], second
assert second["plans_fnv1a"] == first["plans_fnv1a"], (first, second)
print(f"a cache per process: {first['tasks']} tasks dealt as {shares}, identical plans "
      f"({first['plans_fnv1a'][0]}); the second run measured nothing")
PY

# 3. A rank failing at step 3 ends the job with its message, non-zero, within 30 s.
start=$(date +%s.%N)
set +e
MUCUDNN_TRAIN_FAIL_AT=1:3 timeout 120 "${mpirun_np2[@]}" -x MUCUDNN_TRAIN_FAIL_AT "$bin" "${args[@]}" \
  --epochs 3 --cache "$work/cache.sqlite" > /dev/null 2> "$work/fail.txt"
status=$?
set -e
elapsed=$(python3 -c "import time; print(f'{time.time() - $start:.2f}')")
if [ "$status" -eq 0 ] || [ "$status" -eq 124 ]; then
  cat "$work/fail.txt"; echo "FAIL: exit status $status after $elapsed s"; exit 1
fi
grep -q "rank 1 failed: injected failure before step 3" "$work/fail.txt" || {
  cat "$work/fail.txt"; echo "FAIL: the failing rank's message is missing"; exit 1; }
python3 -c "import sys; sys.exit(0 if $elapsed < 30 else 1)" || {
  echo "FAIL: the job took $elapsed s to end"; exit 1; }
echo "a rank failing at step 3 ended the job: status $status after $elapsed s"

# 4. bf16: the same bits under mpirun as in one process; it learns.
"$bin" "${args[@]}" --dtype bf16 --epochs 2 --local-ranks 2 --cache "$work/cache.sqlite" \
  > "$work/bf16-local.json" 2> /dev/null
"${mpirun_np2[@]}" "$bin" "${args[@]}" --dtype bf16 --epochs 2 --cache "$work/cache.sqlite" \
  > "$work/bf16-mpi.json"
python3 - "$work/bf16-local.json" "$work/bf16-mpi.json" <<'PY'
import json, sys
local, mpi = (json.load(open(p)) for p in sys.argv[1:])
assert local["dtype"] == mpi["dtype"] == "bf16" and mpi["skipped_steps"] == 0, mpi["dtype"]
assert (local["ranks"], mpi["ranks"], local["processes"], mpi["processes"]) == (2, 2, 1, 2)
def bits(run):
    return ([x.hex() for x in run["step_losses"]],
            [(e["train_loss"].hex(), e["test_loss"].hex(), e["test_accuracy"]) for e in run["epochs"]],
            run["initial_test_loss"].hex(), run["parameters_fnv1a"])
assert bits(local) == bits(mpi), f"bf16: one process {bits(local)} != mpirun {bits(mpi)}"
epochs = mpi["epochs"]
losses = [e["train_loss"] for e in epochs]
assert len(epochs) == 2 and losses[1] < losses[0], losses
assert epochs[1]["test_loss"] < mpi["initial_test_loss"], (epochs, mpi["initial_test_loss"])
chance = 1 / mpi["settings"]["classes"]
accuracy = epochs[-1]["test_accuracy"]
assert accuracy >= chance + 0.2, f"bf16 held-out accuracy {accuracy} vs chance {chance}"
print(f"bf16: mpirun -np 2 == 2 ranks in one process, bit for bit ({len(mpi['step_losses'])} "
      f"steps); train loss by epoch {[round(x, 4) for x in losses]}, held-out accuracy "
      f"{accuracy:.3f} (chance {chance:.2f})")
PY

# 5. f16: every rank skips the same steps (the decision is taken on the summed gradient).
f16_args=(--dtype f16 --epochs 1 --train-size 256 --cache "$work/cache.sqlite")
"$bin" "${args[@]}" "${f16_args[@]}" --local-ranks 2 > "$work/f16-local.json" 2> /dev/null
"${mpirun_np2[@]}" "$bin" "${args[@]}" "${f16_args[@]}" > "$work/f16-mpi.json" 2> /dev/null
python3 - "$work/f16-local.json" "$work/f16-mpi.json" <<'PY'
import json, sys
local, mpi = (json.load(open(p)) for p in sys.argv[1:])
assert local["dtype"] == mpi["dtype"] == "f16" and mpi["processes"] == 2
same = lambda run: ([x.hex() for x in run["step_losses"]], run["parameters_fnv1a"],
                    run["skipped_steps"], run["loss_scale"])
assert same(local) == same(mpi), f"f16: one process {same(local)} != mpirun {same(mpi)}"
skipped, steps = mpi["skipped_steps"], len(mpi["step_losses"])
assert 0 < skipped < steps and mpi["loss_scale"] == 65536 / 2 ** skipped, (skipped, mpi["loss_scale"])
print(f"f16: mpirun -np 2 == 2 ranks in one process, bit for bit ({steps} steps, {skipped} "
      f"skipped, loss scale 65536 -> {mpi['loss_scale']:.0f})")
PY
echo "MPI tests passed"

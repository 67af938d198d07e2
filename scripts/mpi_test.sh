#!/usr/bin/env bash
# The MPI tests (issue 18), on the CPU: `mpirun -np 2` training must match the same run with 2
# threads in one process bit for bit (losses and final parameters), given the same cache file
# (so both run the same plans); with a cache file per process the tuning measurements are dealt
# out over the processes (disjoint shares) and both run identical plans; a rank that fails at
# step k must end the job, non-zero, with its message, within seconds.
#
# Installs Debian's Open MPI (openmpi-bin, libopenmpi-dev) and libclang-dev (rsmpi's bindgen)
# with apt-get when mpirun is missing and apt is usable (idempotent: nothing is installed twice),
# builds `mucudnn` with `--features mpi`, and runs the checks. Exits 77 with "skipped: ..." when
# MPI cannot be had. Run from anywhere: bash scripts/mpi_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lock.sh

skip() { echo "skipped: $*"; exit 77; }

missing_packages() {
  need_packages=()
  command -v mpirun >/dev/null 2>&1 || need_packages+=(openmpi-bin)
  command -v mpicc >/dev/null 2>&1 || need_packages+=(libopenmpi-dev)
  ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need_packages+=(libclang-dev)
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

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --locked --features mpi --bin mucudnn
# A copy of this run's own: another build in the same target dir (cargo test's binary has no
# mpi feature) may replace target/debug/mucudnn while the checks run.
bin=$work/mucudnn
cp "${CARGO_TARGET_DIR:-target}/debug/mucudnn" "$bin"
mpirun_np2=(mpirun --allow-run-as-root --oversubscribe -np 2)
args=(train --device cpu --batch 16 --train-size 320 --test-size 100 --image-size 16 --channels 1
      --block-channels 8,16 --noise 0.3 --lr 0.05 --epochs 2 --json --quiet --check-sync
      --cache "$work/cache.sqlite")

# 1. Same plans, same bits: threads first (they fill the cache), then two MPI processes.
"$bin" "${args[@]}" --ranks 2 > "$work/threads.json"
"${mpirun_np2[@]}" "$bin" "${args[@]}" > "$work/mpi.json"
python3 - "$work/threads.json" "$work/mpi.json" <<'PY'
import json, sys
threads, mpi = (json.load(open(p)) for p in sys.argv[1:])
def bits(run):
    return ([(e["train_loss"].hex(), e["test_loss"].hex(), e["train_accuracy"]) for e in run["epochs"]],
            run["initial"]["loss"].hex(), run["summary"]["parameters_fnv1a"])
assert threads["settings"]["ranks"] == mpi["settings"]["ranks"] == 2, "two ranks each"
assert bits(threads) == bits(mpi), f"threads {bits(threads)} != mpirun {bits(mpi)}"
print("mpirun -np 2 == 2 threads, bit for bit:", bits(mpi))
PY

# 2. A cache file per process (as with a file per host): the measuring is dealt out over the
#    two processes and shared, each measures a disjoint share, both end with identical plans;
#    a second run finds both caches complete.
per_rank=(train --device cpu --batch 16 --train-size 320 --test-size 100 --image-size 16 --channels 1
          --block-channels 8,16 --noise 0.3 --lr 0.05 --epochs 1 --json --quiet --check-sync)
for run in first second; do
  "${mpirun_np2[@]}" sh -c 'exec "$0" "$@" --cache "'"$work"'/rank-$OMPI_COMM_WORLD_RANK.sqlite"' \
    "$bin" "${per_rank[@]}" > "$work/dealt-$run.json"
done
python3 - "$work/dealt-first.json" "$work/dealt-second.json" <<'PY'
import json, sys
first, second = (json.load(open(p))["tuning"] for p in sys.argv[1:])
shares = first["measured_by_rank"]
assert first["tasks"] > 0 and len(shares) == 2, first
# Each task is measured by exactly one process (deduplicated union dealt round-robin), so the
# shares are disjoint and cover the tasks.
assert all(n > 0 for n in shares) and sum(shares) == first["tasks"], first
assert len(set(first["plans_fnv1a"])) == 1, f"the ranks run different plans: {first}"
assert second["tasks"] == 0 and second["measured_by_rank"] == [0, 0], second
assert second["plans_fnv1a"] == first["plans_fnv1a"], (first, second)
print(f"a cache per process: {first['tasks']} tasks dealt as {shares}, identical plans "
      f"({first['plans_fnv1a'][0]}); the second run measured nothing")
PY

# 3. A rank failing at step 3 ends the job with its message, non-zero, within seconds.
start=$(date +%s.%N)
set +e
MUCUDNN_TRAIN_FAIL_AT=1:3 timeout 120 "${mpirun_np2[@]}" -x MUCUDNN_TRAIN_FAIL_AT "$bin" "${args[@]}" \
  > /dev/null 2> "$work/fail.txt"
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
echo "MPI tests passed"

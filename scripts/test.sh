#!/usr/bin/env bash
# All of mucudnn's tests, as the README's test command (and .ci/run) runs them:
#
#   1. the Rust workspace: cargo test --workspace --locked, and the library core built alone
#      (--no-default-features) with no CLI, plotting, TOML, signal or training crate;
#   2. the candle layer on candle's CPU device (feature candle);
#   3. the MPI tests of the data-parallel candle trainer (scripts/mpi_test.sh: Open MPI from
#      Debian's packages, installed when missing, and a build with --features candle,mpi);
#   4. the cuDNN host tier (docs/cudnn_host.md): the FFI wall against the real libcudnn on a
#      description of an H100, with no GPU (the cuDNN and cuBLAS wheels and a stub libcuda,
#      fetched and built once under the test cache folder);
#   5. the Python package (python/): the wheel (scripts/build_wheel.sh, built once per run),
#      installed into a fresh virtualenv with no cargo on PATH to run one tuned convolution
#      (scripts/wheel_smoke.py); then pytest, with a virtualenv holding torch, pytest and numpy
#      from PyPI (made once under the test cache folder and only read after) and the wheel
#      installed into a folder of this run: every test on mucudnn.torch's native path (the
#      venv's torch >= 2.10), then under MUCUDNN_TORCH_PATH=python the Python path's own tests
#      (marked python_path) and a smoke set of the shared ones (python_smoke).
#
# What only downloads (the venv's torch, the host tier's cuDNN wheels, the wheel tools, Open
# MPI's packages) starts in the background at the beginning, while cargo compiles, and is
# joined before its tier; the tiers themselves run in the order above. The crate's feature
# configurations are compiled once each: the core alone is checked (`cargo check`: no code
# generated, nothing of it is run). Each tier's minutes are printed at the end.
#
# The test cache folder is $MUCUDNN_TEST_CACHE, else $XDG_CACHE_HOME/mucudnn-test, else
# ~/.cache/mucudnn-test (about 7 GB: torch from PyPI brings the CUDA runtime wheels; plus about
# 8 GB of target/). Two runs may share it: each shared piece is made under a flock
# (scripts/lock.sh) while the other run waits.
#
# Without network on first use, the cuDNN host tier says it was skipped. The Python tier is
# skipped with a message outside CI; under CI=true that is a failure, and so is either pytest
# run collecting no test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lock.sh

section() { printf '\n== %s\n' "$*"; }
in_ci() { [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ]; }

# Each tier's seconds, printed at the end (also when a tier fails): tier NAME starts one.
run_started=$SECONDS
tier_name=""
tier_started=$SECONDS
tier_rows=""
tier() {
  [ -z "$tier_name" ] || tier_rows+="$tier_name|$((SECONDS - tier_started))"$'\n'
  tier_name=$1
  tier_started=$SECONDS
}
bg=$(mktemp -d)
background_pids=()
finish() {
  local status=$?
  tier ""
  # Only the prefetch jobs this run started, by their ids (they may still run after a failure).
  for pid in "${background_pids[@]}"; do
    kill "$pid" 2>/dev/null && echo "stopped background job $pid" >&2
  done
  printf '\n== minutes per tier\n'
  while IFS='|' read -r name seconds; do
    [ -z "$name" ] || awk -v s="$seconds" -v n="$name" 'BEGIN { printf "%6.1f  %s\n", s / 60, n }'
  done <<< "$tier_rows"
  awk -v s="$((SECONDS - run_started))" -v e="$status" \
    'BEGIN { printf "%6.1f  total (exit %s)\n", s / 60, e }'
  rm -rf "$bg" "${run_dir:-}"
}
trap finish EXIT

# Downloads in the background, each joined (join_job NAME) before the tier that needs it; each
# logs into $bg/NAME.log, printed at the join.
source scripts/test_venv.sh # venv, setup_venv, skip_or_fail
declare -A job_pid
prefetch() {
  local name=$1
  shift
  "$@" > "$bg/$name.out" 2> "$bg/$name.log" &
  job_pid[$name]=$!
  background_pids+=("$!")
}
join_job() { # NAME: waits for the job, prints its log, returns its status
  local status=0
  wait "${job_pid[$1]}" || status=$?
  background_pids=("${background_pids[@]/${job_pid[$1]}/}")
  cat "$bg/$1.log" >&2
  return "$status"
}
prefetch venv setup_venv
prefetch host_env bash scripts/cudnn_host_env.sh
prefetch wheel_tools bash scripts/build_wheel.sh --tools
prefetch mpi_packages bash scripts/mpi_test.sh --install

tier "Rust: cargo test --workspace"
section "Rust: cargo test --workspace --locked"
cargo test --workspace --locked

tier "Rust: the core alone (cargo check)"
section "Rust: the library core alone (--no-default-features): compiles, depends on no CLI crate"
cargo check -p mucudnn --no-default-features --locked
core_tree=$(cargo tree -p mucudnn --no-default-features -e normal --locked --prefix none)
if forbidden=$(grep -E '^(clap|indicatif|plotters|ctrlc|toml|anyhow|mpi) v' <<<"$core_tree"); then
  echo "error: the core depends on CLI or training crates:" >&2
  echo "$forbidden" >&2
  exit 1
fi
echo "the core's dependency tree has none of clap, indicatif, plotters, ctrlc, toml, anyhow, mpi"

tier "candle: candle_cpu"
section "candle: cargo test --features candle --test candle_cpu"
cargo test --locked --features candle --test candle_cpu

section "MPI: scripts/mpi_test.sh (candle_ddp: mpirun -np 2 against 2 ranks in one process, dealt tuning, a failing rank)"
tier "MPI: scripts/mpi_test.sh"
status=0
join_job mpi_packages || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 77 ] || echo "the MPI packages' install exited $status" >&2
status=0
bash scripts/mpi_test.sh || status=$?
if [ "$status" -eq 77 ]; then
  if in_ci; then echo "error: the MPI tests were skipped" >&2; exit 1; fi
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi

tier "cuDNN host tier"
section "cuDNN host tier: tests/cudnn_host.rs and current_context.rs against the real libcudnn (no GPU)"
status=0
join_job host_env || status=$?
host_env=$(cat "$bg/host_env.out")
if [ "$status" -eq 0 ]; then
  # cuDNN prints tens of thousands of "Could not load symbol cu..." lines about the stub
  # libcuda's missing entry points (kernel launches, which the tier never makes): filtered.
  # Its tests are #[ignore]d (they need this environment): --include-ignored runs them.
  # current_context.rs's one-GPU tests run against the stub libcuda too: it answers every
  # driver call made before cuInit with CUDA_ERROR_NOT_INITIALIZED, as the driver does.
  (eval "$host_env" && MUCUDNN_CUDNN_HOST_TESTS=1 cargo test --locked --test cudnn_host -- \
    --include-ignored && MUCUDNN_CUDNN_HOST_TESTS=1 cargo test --locked --test current_context \
    -- --include-ignored --skip the_callers_device_stays_current_across_gpus) \
    2> >(grep -v '^Could not load symbol cu' >&2) || exit 1
elif [ "$status" -eq 77 ]; then
  echo "skipped: the cuDNN host tier (its wheels could not be fetched)" >&2
else
  echo "error: the cuDNN host tier could not be set up (exit $status)" >&2
  exit 1
fi

tier "Python: the wheel (zigbuild)"
section "Python: the wheel (scripts/build_wheel.sh), built once for this run"
run_dir=$(mktemp -d)
# The tools' log; a failure there is build_wheel.sh's to report (it makes them if missing).
join_job wheel_tools || echo "the wheel tools' prefetch failed; build_wheel.sh tries again" >&2
bash scripts/build_wheel.sh "$run_dir/dist"
wheel=$(ls "$run_dir"/dist/mucudnn-*-py3-none-manylinux_2_28_x86_64.whl)

tier "Python: the wheel's smoke test"
section "Python: the wheel in a fresh virtualenv, no cargo on PATH, one tuned convolution"
"$python_bin" -m venv "$run_dir/fresh"
no_cargo_path="$run_dir/fresh/bin:/usr/local/bin:/usr/bin:/bin"
if PATH=$no_cargo_path command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is on the PATH meant to lack it ($no_cargo_path)" >&2
  exit 1
fi
PATH=$no_cargo_path "$run_dir/fresh/bin/python" -m pip install --quiet --no-index "$wheel"
# From another folder, so that the installed package is imported, not python/mucudnn.
(repo=$PWD && cd "$run_dir" && PATH=$no_cargo_path "$run_dir/fresh/bin/python" \
  "$repo/scripts/wheel_smoke.py")

# pytest against the installed wheel, on one path of mucudnn.torch: run_pytest PATH ARGS...
# (PATH: native or python, as MUCUDNN_TORCH_PATH takes it; native is an error where the
# runtime cannot load). A run that collects no test is a failure (pytest's exit code 5).
run_pytest() {
  local path=$1
  shift
  local status=0
  # From the repository root, so that the installed package is imported, not python/mucudnn.
  MUCUDNN_TORCH_PATH=$path PYTHONPATH="$run_dir/site${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$@" || status=$?
  if [ "$status" -eq 5 ]; then
    echo "error: pytest ($path path) collected no test" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
}

tier "Python: pytest python/tests (native path)"
# The venv was made in the background (setup_venv again: a no-op when it is ready, the reason
# when it is not).
join_job venv || echo "the venv's prefetch failed; making it again" >&2
if setup_venv || skip_or_fail "could not make the Python virtualenv at $venv"; then
  section "Python: the wheel beside $venv's torch (a folder of this run), pytest python/tests"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-index --target "$run_dir/site" "$wheel"
  run_pytest native python/tests
  tier "Python: pytest, the Python path's tests and smoke set"
  section "Python: MUCUDNN_TORCH_PATH=python, the tests marked python_path or python_smoke"
  run_pytest python -m "python_path or python_smoke" python/tests
fi

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
#      installed into a folder of this run.
#
# The test cache folder is $MUCUDNN_TEST_CACHE, else $XDG_CACHE_HOME/mucudnn-test, else
# ~/.cache/mucudnn-test (about 7 GB: torch from PyPI brings the CUDA runtime wheels; plus about
# 8 GB of target/). Two runs may share it: each shared piece is made under a flock
# (scripts/lock.sh) while the other run waits.
#
# Without network on first use, the cuDNN host tier says it was skipped. The Python tier is
# skipped with a message outside CI; under CI=true that is a failure, and so is a pytest run
# that collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lock.sh

section() { printf '\n== %s\n' "$*"; }
in_ci() { [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ]; }

section "Rust: cargo test --workspace --locked"
cargo test --workspace --locked

section "Rust: the library core alone (--no-default-features): builds, depends on no CLI crate"
cargo build -p mucudnn --no-default-features --locked
core_tree=$(cargo tree -p mucudnn --no-default-features -e normal --locked --prefix none)
if forbidden=$(grep -E '^(clap|indicatif|plotters|ctrlc|toml|anyhow|mpi) v' <<<"$core_tree"); then
  echo "error: the core depends on CLI or training crates:" >&2
  echo "$forbidden" >&2
  exit 1
fi
echo "the core's dependency tree has none of clap, indicatif, plotters, ctrlc, toml, anyhow, mpi"

section "candle: cargo test --features candle --test candle_cpu"
cargo test --locked --features candle --test candle_cpu

section "MPI: scripts/mpi_test.sh (candle_ddp: mpirun -np 2 against 2 ranks in one process, dealt tuning, a failing rank)"
status=0
bash scripts/mpi_test.sh || status=$?
if [ "$status" -eq 77 ]; then
  if in_ci; then echo "error: the MPI tests were skipped" >&2; exit 1; fi
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi

section "cuDNN host tier: tests/cudnn_host.rs against the real libcudnn (no GPU)"
status=0
host_env=$(bash scripts/cudnn_host_env.sh) || status=$?
if [ "$status" -eq 0 ]; then
  # cuDNN prints tens of thousands of "Could not load symbol cu..." lines about the stub
  # libcuda's missing entry points (kernel launches, which the tier never makes): filtered.
  # Its tests are #[ignore]d (they need this environment): --include-ignored runs them.
  (eval "$host_env" && MUCUDNN_CUDNN_HOST_TESTS=1 cargo test --locked --test cudnn_host -- \
    --include-ignored) \
    2> >(grep -v '^Could not load symbol cu' >&2) || exit 1
elif [ "$status" -eq 77 ]; then
  echo "skipped: the cuDNN host tier (its wheels could not be fetched)" >&2
else
  echo "error: the cuDNN host tier could not be set up (exit $status)" >&2
  exit 1
fi

# The shared virtualenv: venv, setup_venv (made once, under a lock), skip_or_fail.
source scripts/test_venv.sh

section "Python: the wheel (scripts/build_wheel.sh), built once for this run"
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
bash scripts/build_wheel.sh "$run_dir/dist"
wheel=$(ls "$run_dir"/dist/mucudnn-*-py3-none-manylinux_2_28_x86_64.whl)

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

if setup_venv || skip_or_fail "could not make the Python virtualenv at $venv"; then
  section "Python: the wheel beside $venv's torch (a folder of this run), pytest python/tests"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-index --target "$run_dir/site" "$wheel"
  status=0
  # From the repository root, so that the installed package is imported, not python/mucudnn.
  PYTHONPATH="$run_dir/site${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs python/tests || status=$?
  if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no test" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
fi

#!/usr/bin/env bash
# All of mucudnn's tests, as the README's test command (and .ci/run) runs them:
#
#   1. the Rust workspace: cargo test --workspace --locked;
#   2. the Python package (python/): a virtualenv with torch, pytest and numpy from PyPI, made
#      once under the test cache folder and reused, the package installed into it (which
#      builds the library with cargo), then pytest.
#
# The test cache folder is $MUCUDNN_TEST_CACHE, else $XDG_CACHE_HOME/mucudnn-test, else
# ~/.cache/mucudnn-test (about 7 GB: torch from PyPI brings the CUDA runtime wheels).
#
# Outside CI, a virtualenv that cannot be made (no network) skips the Python tier with a
# message; under CI=true that is a failure, and so is a pytest run that collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."

section() { printf '\n== %s\n' "$*"; }
in_ci() { [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ]; }

section "Rust: cargo test --workspace --locked"
cargo test --workspace --locked

cache_dir="${MUCUDNN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mucudnn-test}"
venv="$cache_dir/venv"
python_bin="${PYTHON:-python3}"

skip_or_fail() {
  if in_ci; then
    echo "error: $*" >&2
    exit 1
  fi
  echo "skipped: $* (the Python tier needs network access once, to fetch torch from PyPI)" >&2
  return 1
}

setup_venv() {
  if [ -x "$venv/bin/python" ] && [ -f "$venv/.mucudnn-ready" ]; then
    return 0
  fi
  section "Python: making $venv (torch, pytest, numpy from PyPI; once)"
  mkdir -p "$cache_dir"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv" &&
    "$venv/bin/python" -m pip install --quiet --upgrade pip "setuptools>=77" wheel &&
    "$venv/bin/python" -m pip install --quiet "torch>=2.4" pytest numpy &&
    touch "$venv/.mucudnn-ready"
}

if setup_venv || skip_or_fail "could not make the Python virtualenv at $venv"; then
  section "Python: installing ./python into $venv"
  "$venv/bin/python" -m pip install --quiet --no-build-isolation --force-reinstall --no-deps ./python
  section "Python: pytest python/tests"
  status=0
  # From the repository root, so that the installed package is imported, not python/mucudnn.
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs python/tests || status=$?
  if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no test" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
fi

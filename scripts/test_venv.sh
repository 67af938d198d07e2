# Sourced by scripts/test.sh: the Python tier's shared virtualenv (torch, pytest, numpy, and
# the real clients diffusers, timm, transformers, peft and accelerate, from PyPI), made once
# under the test cache folder and then only read.
#
#   venv          $cache_dir/venv
#   setup_venv    makes it unless it is ready; under a lock (flock on $cache_dir/venv.lock), so
#                 that a second test run on the same cache waits for the first's venv instead of
#                 deleting it half-made; returns non-zero when it cannot be made
#   skip_or_fail  under CI: prints the error and exits 1; elsewhere says "skipped" and returns 1
#
# The test cache folder is $MUCUDNN_TEST_CACHE, else $XDG_CACHE_HOME/mucudnn-test, else
# ~/.cache/mucudnn-test. $PYTHON (default python3) makes the venv.
# shellcheck source=lock.sh
source "$(dirname "${BASH_SOURCE[0]}")/lock.sh"
declare -F section >/dev/null || section() { printf '\n== %s\n' "$*"; }
declare -F in_ci >/dev/null || in_ci() { [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ]; }

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

# What the venv holds; a venv made for another list is made again.
venv_packages='"torch>=2.4" pytest numpy diffusers timm transformers peft accelerate'
venv_ready() {
  [ -x "$venv/bin/python" ] && [ -f "$venv/.mucudnn-ready" ] &&
    [ "$(cat "$venv/.mucudnn-ready")" = "$venv_packages" ]
}

# Under the lock. Nothing writes into the venv once it is ready (each test run installs the
# package under test into a folder of its own).
make_venv() {
  venv_ready && return 0 # made by another run while this one waited
  section "Python: making $venv ($venv_packages from PyPI; once)"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv" &&
    "$venv/bin/python" -m pip install --quiet --upgrade pip "setuptools>=77" wheel &&
    eval "\"\$venv/bin/python\" -m pip install --quiet $venv_packages" &&
    printf '%s' "$venv_packages" >"$venv/.mucudnn-ready"
}

setup_venv() {
  venv_ready && return 0
  mkdir -p "$cache_dir" || return 1
  with_lock "$cache_dir/venv.lock" make_venv
}

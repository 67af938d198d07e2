# Sourced by the test scripts: with_lock LOCKFILE COMMAND [ARGS...] runs COMMAND (a function or
# a program) holding an exclusive flock(1) on LOCKFILE, so that two test runs on one machine
# that share the test cache (MUCUDNN_TEST_CACHE) make each shared thing once, one after the
# other, instead of deleting each other's half-made copy. The command runs in the current
# shell (it may set variables); the lock is released when it returns. A run waits up to
# MUCUDNN_LOCK_TIMEOUT seconds (default 3600) for another's set-up before it gives up.
with_lock() {
  local lockfile=$1
  shift
  if ! command -v flock >/dev/null 2>&1; then
    echo "warning: flock(1) is missing (util-linux): $lockfile is not taken; do not run two" \
      "test runs on one test cache at once" >&2
    "$@"
    return
  fi
  mkdir -p "$(dirname "$lockfile")" || return
  local fd status=0
  exec {fd}>>"$lockfile" || return
  if ! flock -n "$fd"; then
    echo "waiting for $lockfile (another test run is setting up)" >&2
    if ! flock -w "${MUCUDNN_LOCK_TIMEOUT:-3600}" "$fd"; then
      echo "error: waited ${MUCUDNN_LOCK_TIMEOUT:-3600} s for $lockfile" >&2
      exec {fd}>&-
      return 1
    fi
  fi
  "$@" {fd}>&- || status=$?
  exec {fd}>&-
  return "$status"
}

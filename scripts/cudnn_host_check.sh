#!/usr/bin/env bash
# The cuDNN host tier as one JSON document:
#   bash scripts/cudnn_host_check.sh --json
# prints one JSON array, one object per (layer, dtype, layout, op) checked, with the fields
# layer, dtype, layout, op, mode_a, mode_b, fallback (configurations each heuristics mode
# returned on the H100 description), plans (rebuilt-from-name plans whose workspace equals
# cuDNN's own) and passed. Exit status: 0 only when every check of tests/cudnn_host.rs
# passed; 77 when the tier was skipped (no network and nothing cached: see
# scripts/cudnn_host_env.sh); otherwise 1. The test's own output goes to stderr.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--json" ]; then
  echo "usage: bash scripts/cudnn_host_check.sh --json" >&2
  exit 2
fi
env_lines=$(bash scripts/cudnn_host_env.sh)
status=$?
[ "$status" -eq 0 ] || exit "$status"
eval "$env_lines"
lines=$(mktemp)
trap 'rm -f "$lines"' EXIT
MUCUDNN_CUDNN_HOST_TESTS=1 MUCUDNN_CUDNN_HOST_JSON="$lines" \
  cargo test --locked --test cudnn_host -- --include-ignored --test-threads=2 >&2 2>&1
tests=$?
python3 - "$lines" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
json.dump(rows, sys.stdout, indent=1)
print()
sys.exit(0 if rows and all(r["passed"] for r in rows) else 1)
PY
rows=$?
[ "$tests" -eq 0 ] && [ "$rows" -eq 0 ]

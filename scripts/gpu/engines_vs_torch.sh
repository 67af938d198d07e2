#!/usr/bin/env bash
# The engines' acceptance in one call on the GPU machine (build first: scripts/gpu/build.sh):
# mucudnn's executed plans (legacy algorithms and graph-API engines, micro-batched under a
# workspace limit) against PyTorch's cudnn.benchmark (no limit) on AlexNet (batch 256) and
# ResNet-50's distinct conv shapes (batch 128), forward + backward, fp16 NHWC and fp32 NCHW.
# Also times tuning all AlexNet layers with engines from an empty cache. Logs under $OUT;
# the table comes last.
#
#   bash .gpu/engines_vs_torch.sh [alexnet] [resnet50] [tuning]   (default: all three)
#
# A device call is limited to 10 minutes: if all three do not fit, run them one per call.
# MAX_CANDIDATES=N caps the engine configurations per (op, size) (accept.sh: 8; unset: no cap).
# Engines are compared with PyTorch timed in this same run, never with the legacy fixture.
set -uo pipefail
PARTS=${*:-alexnet resnet50 tuning}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
CAP=()
[ -n "${MAX_CANDIDATES:-}" ] && CAP=(--max-candidates "$MAX_CANDIDATES")
G=${G:-.gpu}
OUT=${OUT:-/tmp/mucudnn-gpu}
mkdir -p "$OUT"
# One libcudnn: scripts/gpu/libs.sh (accept.sh sources it before running this script).
[ -n "${LD_LIBRARY_PATH:-}" ] || source "$(dirname "$0")/libs.sh"
CACHE="$OUT/engines-cache.sqlite"
rm -f "$CACHE"
: > "$OUT/engines-rows.txt"
# model batch dtype layout limit
CASES="alexnet 256 fp16 nhwc 8MiB
alexnet 256 fp32 nchw 64MiB
alexnet 256 fp32 nchw 256MiB
resnet50 128 fp16 nhwc 8MiB
resnet50 128 fp32 nchw 64MiB
resnet50 128 fp32 nchw 256MiB"
while read -r model batch dtype layout limit; do
  want "$model" || continue
  tag="$model-$dtype-$layout-$limit"
  $G/mucudnn tune --model "$model" --batch "$batch" --dtype "$dtype" --layout "$layout" \
    --workspace-limit "$limit" --device cuda --candidates all --cache "$CACHE" "${CAP[@]}" \
    --save-profile "$OUT/$tag.profile.json" --verify --json > "$OUT/$tag.json" 2> "$OUT/$tag.log"
  rc=$?
  if [ ! -s "$OUT/$model-$dtype-$layout.torch.json" ]; then
    python3 $G/torch_bench.py "$OUT/$tag.profile.json" "$OUT/$model-$dtype-$layout.torch.json" \
      2> "$OUT/$model-$dtype-$layout.torch.log"
  fi
  echo "$tag $rc" >> "$OUT/engines-rows.txt"
done <<< "$CASES"

# Tuning time: all AlexNet layers, engines and legacy, fp16 and fp32, from an empty cache.
for dtype_layout in "fp32 nchw" "fp16 nhwc"; do
  want tuning || continue
  set -- $dtype_layout
  rm -f "$OUT/tuning-time.sqlite"
  $G/mucudnn tune --model alexnet --batch 256 --dtype "$1" --layout "$2" --workspace-limit 64MiB \
    --device cuda --candidates all --cache "$OUT/tuning-time.sqlite" "${CAP[@]}" --json \
    > "$OUT/tuning-time-$1.json" 2> "$OUT/tuning-time-$1.log"
done

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
targets = {("fp16", "8MiB"): 1.0, ("fp32", "256MiB"): 1.0, ("fp32", "64MiB"): 1.2}
rows = [l.split() for l in open(os.path.join(out, "engines-rows.txt"))]
failures = 0
print(f'{"case":<32} {"mucudnn ms":>11} {"pytorch ms":>11} {"ratio":>7} {"target":>7} {"ws max":>9} {"pt extra max":>13} {"engines%":>9} {"tune s":>7}')
for tag, rc in rows:
    model, dtype, layout, limit = tag.split("-")
    try:
        doc = json.load(open(os.path.join(out, tag + ".json")))
        torch = json.load(open(os.path.join(out, f"{model}-{dtype}-{layout}.torch.json")))
    except Exception as e:
        print(f"{tag:<32} FAILED (rc {rc}): {e}")
        failures += 1
        continue
    failures += rc != "0"
    ours = doc["measured"]["total_measured_ms"]
    theirs = sum(l["ms"] for l in torch["layers"])
    ratio = ours / theirs
    target = targets.get((dtype, limit))
    mbs = [mb for p in doc["plans"] for mb in p["micro_batches"]]
    eng = sum(mb["time_ms"] for mb in mbs if mb["kind"] == "engine") / max(1e-12, sum(mb["time_ms"] for mb in mbs))
    ok = "" if target is None else ("ok" if ratio <= target else "MISS")
    print(f'{tag:<32} {ours:11.3f} {theirs:11.3f} {ratio:7.3f} {str(target or "-"):>7} '
          f'{doc["total_workspace_bytes"]/2**20:8.1f}M {max(l["extra_mib"] for l in torch["layers"]):12.1f}M '
          f'{100*eng:8.0f}% {doc["tuning"]["seconds"]:7.1f} {ok}')
for dtype in ("fp32", "fp16"):
    if not os.path.exists(os.path.join(out, f"tuning-time-{dtype}.json")):
        continue
    try:
        t = json.load(open(os.path.join(out, f"tuning-time-{dtype}.json")))["tuning"]
        print(f'tuning all AlexNet layers ({dtype}, legacy + engines, empty cache): {t["seconds"]:.1f} s '
              f'({t["sizes_measured"]} sizes, {t["engine_timings_pruned"]} engine timings pruned; target < 120 s)')
    except Exception as e:
        print(f"tuning time {dtype}: FAILED: {e}")
        failures += 1
sys.exit(1 if failures else 0)
PY

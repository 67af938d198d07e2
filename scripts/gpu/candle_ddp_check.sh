#!/usr/bin/env bash
# The data-parallel candle trainer on GPUs (examples/candle_ddp.rs,
# docs/training.md#on-gpus): one process per GPU trains the small ResNet five times in one
# run: mucudnn's convolutions with the gradients summed by NCCL on candle's stream
# (`--grad-sum nccl`, the default on GPUs), the same with the host sum (`--grad-sum host`:
# copied to the host, f64 sums over MPI), candle's own conv2d (cuDNN through candle-core's
# `cudnn` feature) with NCCL, then mucudnn's in mixed precision with NCCL (`--dtype bf16`,
# and `--dtype f16` with dynamic loss scaling: docs/training.md#precision). Checks that the
# loss falls and the held-out accuracy is above chance for each; prints images/s of each,
# mucudnn's against candle's and NCCL's against the host sum's.
#
#   bash scripts/gpu/candle_ddp_check.sh build   # here (no GPU): nvcc and the CUDA 13 headers
#                                                # and libraries; without nvcc on PATH it
#                                                # sources scripts/cuda_build_env.sh (PyPI's
#                                                # wheels, docs/candle.md); fills .gpu/candle_ddp/
#   bash scripts/gpu/candle_ddp_check.sh run     # on the GPU machine, .gpu carried along
#
# With CANDLE_DDP_MPI=1 at build time the binary is built with `mpi` (it then needs Open MPI's
# libmpi on the GPU machine too) and `run` starts one process per GPU with mpirun; by default,
# one process on GPU 0 (NCCL then all-reduces over one rank: the comparison with the host sum
# means something only with several GPUs). The binary needs libnccl.so.2 there (PyTorch's
# nvidia-nccl wheel or a CUDA install). Logs and summary.json go under $OUT when it is set;
# exits non-zero on any failure. About 4 minutes on one H100 (estimated: never run).
set -uo pipefail
# From scripts/gpu/ here, or from .gpu/ there (build.sh copies this script): the repository root.
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  *) cd "$here/../.." ;;
esac

# The same features as candle_check.sh (one candle-cuda build serves both), plus MPI if asked.
FEATURES="candle-cuda,candle-core/cudnn"

build() {
  set -e
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
  mkdir -p .gpu/candle_ddp
  # nvcc and the libraries to link: a CUDA install's, else PyPI's wheels (a cache folder).
  command -v nvcc >/dev/null 2>&1 || source scripts/cuda_build_env.sh
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  local features=$FEATURES
  if [ "${CANDLE_DDP_MPI:-0}" = 1 ]; then features="$features,mpi"; fi
  cargo build --release --locked --no-default-features --features "$features" \
    --example candle_ddp
  cp "${CARGO_TARGET_DIR:-target}/release/examples/candle_ddp" .gpu/candle_ddp/candle_ddp
  echo "$features" > .gpu/candle_ddp/features.txt
  cp scripts/gpu/candle_ddp_check.sh .gpu/candle_ddp/
  du -sh .gpu/candle_ddp
  echo "now run on the GPU machine: bash scripts/gpu/candle_ddp_check.sh run   (carry .gpu)"
}

run() {
  local out=${OUT:-/tmp/mucudnn-candle-ddp}
  mkdir -p "$out"
  local dirs="" d
  for d in /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu \
    $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]
for root, _, files in os.walk(p):
    if any(f.startswith("lib") and ".so" in f for f in files): print(root)' 2>/dev/null); do
    case "$d" in */cudnn/*) continue ;; esac # cuDNN: libs.sh's one copy (accept.sh)
    [ -d "$d" ] && dirs="$dirs:$d"
  done
  # After what libs.sh put first (one libcudnn, linked by every name), never before it.
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${dirs#:}"
  export XDG_CACHE_HOME="$out/xdg"
  local bin=./.gpu/candle_ddp/candle_ddp
  [ -x "$bin" ] || { echo "FAIL: $bin is missing: run '... build' here first"; return 1; }
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || gpus=0
  [ "$gpus" -ge 1 ] || { echo "FAIL: no GPU"; return 1; }
  local launch=("$bin")
  if grep -q mpi .gpu/candle_ddp/features.txt && command -v mpirun >/dev/null 2>&1; then
    launch=(mpirun --allow-run-as-root -np "$gpus" "$bin")
  else
    gpus=1
  fi
  local args=(--device cuda --batch $((64 * gpus)) --train-size 8192 --test-size 1024
              --image-size 32 --channels 3 --classes 10 --width 32 --noise 0.1 --lr 0.05
              --epochs 3 --json --cache "$out/cache.sqlite")
  local status=0 name conv sum dtype
  # name conv grad-sum dtype
  for run in "mucudnn-nccl mucudnn nccl f32" "mucudnn-host mucudnn host f32" \
             "candle-nccl candle nccl f32" "mucudnn-bf16 mucudnn nccl bf16" \
             "mucudnn-f16 mucudnn nccl f16"; do
    read -r name conv sum dtype <<<"$run"
    "${launch[@]}" "${args[@]}" --conv "$conv" --grad-sum "$sum" --dtype "$dtype" \
      > "$out/$name.json" 2> "$out/$name.log" || {
      status=1; echo "FAIL: the $name run ended with an error"; tail -n 20 "$out/$name.log"; }
    tail -n 4 "$out/$name.log"
  done
  python3 - "$out" "$gpus" <<'PY' || status=1
import json, os, sys
out, gpus = sys.argv[1], int(sys.argv[2])
runs = {}
for name in ("mucudnn-nccl", "mucudnn-host", "candle-nccl", "mucudnn-bf16", "mucudnn-f16"):
    try:
        runs[name] = json.load(open(os.path.join(out, f"{name}.json")))
    except (OSError, ValueError) as e:
        print(f"FAIL: {name}: no report ({e})"); sys.exit(1)
failed = False
rows = []
for name, run in runs.items():
    epochs = run["epochs"]
    falls = epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    accuracy = epochs[-1]["test_accuracy"]
    chance = 1 / run["settings"]["classes"]
    ok = falls and accuracy > chance + 0.2
    failed |= not ok
    # The first epoch includes tuning's first sight of each shape and NCCL's connection
    # set-up: images/s of the last.
    rows.append((name, run["settings"]["grad_sum"], ok, epochs[0]["train_loss"],
                 epochs[-1]["train_loss"], accuracy, epochs[-1]["images_per_s"],
                 run.get("skipped_steps", 0)))
summary = {"gpus": gpus, "runs": [dict(zip(("run", "grad_sum", "ok", "first_loss",
           "last_loss", "accuracy", "images_per_s", "skipped_steps"), r)) for r in rows]}
speed = {r[0]: r[6] for r in rows}
summary["mucudnn_vs_candle_images_per_s"] = speed["mucudnn-nccl"] / speed["candle-nccl"]
summary["nccl_vs_host_sum_images_per_s"] = speed["mucudnn-nccl"] / speed["mucudnn-host"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(f"{'run':13} {'sum':5} {'ok':4} {'loss 1st':>9} {'loss last':>9} {'accuracy':>8} "
      f"{'images/s':>9} {'skipped':>7}")
for name, grad_sum, ok, first, last, accuracy, images, skipped in rows:
    print(f"{name:13} {grad_sum:5} {'yes' if ok else 'NO':4} {first:9.4f} {last:9.4f} "
          f"{accuracy:8.3f} {images:9.0f} {skipped:7}")
print(f"mucudnn / candle images/s (f32, NCCL sums): "
      f"{summary['mucudnn_vs_candle_images_per_s']:.2f} on {gpus} GPU(s)")
print(f"NCCL sum / host sum images/s (mucudnn, f32): "
      f"{summary['nccl_vs_host_sum_images_per_s']:.2f} on {gpus} GPU(s)")
sys.exit(1 if failed else 0)
PY
  return $status
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac

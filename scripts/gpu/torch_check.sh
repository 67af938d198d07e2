#!/usr/bin/env bash
# The PyTorch package's GPU acceptance (issue 15), one device call, carry [".gpu"]:
#   bash .gpu/torch_check.sh [alexnet] [resnet50]        (default: both)
# Built here by scripts/gpu/build.sh into .gpu/python (the package with its library; the GPU
# machine has no Rust toolchain). Runs scripts/gpu/torch_check.py with the machine's PyTorch:
# converted models vs PyTorch's convolutions (outputs, gradients), then step time and peak
# memory at 8/64/256 MiB per layer against cudnn.benchmark with no limit. MAX_CANDIDATES=N
# bounds engine tuning (default 16; 0 = no bound). Logs and JSON under $OUT.
set -euo pipefail
G="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$G/out}"
mkdir -p "$OUT"
export PYTHONPATH="$G/python${PYTHONPATH:+:$PYTHONPATH}"
export XDG_CACHE_HOME="$OUT/xdg"   # mucudnn's runtime links (see python/mucudnn/_lib.py)
candidates=(--max-candidates "${MAX_CANDIDATES:-16}")
[ "${MAX_CANDIDATES:-16}" = 0 ] && candidates=()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true
python3 -c 'import torch, mucudnn; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "mucudnn", mucudnn.library_path())' | tee "$OUT/versions.txt"
python3 -m pytest -q -p no:cacheprovider -rs "$G/../python/tests" 2>&1 | tee "$OUT/pytest.txt" || true
python3 "$G/torch_check.py" "$OUT/torch" "${candidates[@]}" "$@" 2>&1 | tee "$OUT/torch_check.txt"

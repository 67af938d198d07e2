#!/usr/bin/env bash
# Builds, here (no GPU needed), everything the GPU acceptance runs, into .gpu/ (ignored by git
# through .git/info/exclude): the release binary and test executables (stripped, then packed
# into .gpu/binaries.tar.xz), the Python wheel (scripts/build_wheel.sh), pytest's wheels for a
# machine without pytest, the C ABI library, candle's CUDA tests where nvcc is, the scripts and
# the fixture. Prints the size of .gpu and of the working tree that travels with it (the device
# tool takes at most 64 MiB together) and fails above that. Then, there, with .gpu carried:
#
#   bash .gpu/accept.sh          the parts, in priority order, with their minutes
#   bash .gpu/accept.sh PART     one part per device call (docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu
# (git rev-parse: in a worktree .git is a file; the exclude file is the common one)
exclude=$(git rev-parse --git-path info/exclude)
# A clone made without git's templates has no .git/info (issue 17, fix 8).
mkdir -p "$(dirname "$exclude")"
grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
target=${CARGO_TARGET_DIR:-target}
rm -rf .gpu/out .gpu/.unpacked .gpu/binaries.tar.xz

cargo build --release --locked
exe() { # the test executable of a cargo target, from cargo's JSON messages
  local path
  path=$(cargo test --release --locked --no-run --message-format=json "$@" |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1)
  [ -n "$path" ] || { echo "no test executable for $*" >&2; return 1; }
  echo "$path"
}
binaries=(mucudnn lib-tests gpu-tests gpu-engines gpu-teardown current-context c_abi)
cp "$target/release/mucudnn" .gpu/mucudnn
cp "$(exe --lib)" .gpu/lib-tests
cp "$(exe --test gpu_cudnn)" .gpu/gpu-tests
cp "$(exe --test gpu_engines)" .gpu/gpu-engines
cp "$(exe --test gpu_teardown)" .gpu/gpu-teardown
cp "$(exe --test current_context)" .gpu/current-context
strip .gpu/mucudnn .gpu/lib-tests .gpu/gpu-tests .gpu/gpu-engines .gpu/gpu-teardown \
  .gpu/current-context
bash scripts/gpu/c_abi_check.sh build

# candle's CUDA tests need nvcc here (candle-kernels compiles PTX): a CUDA install's, else
# PyPI's wheels (scripts/cuda_build_env.sh, installed once into a cache folder). Without
# either the candle part fails there with this reason.
# The same holds for the candle trainer (examples/candle_ddp.rs, the train part).
rm -rf .gpu/candle .gpu/candle_ddp
if command -v nvcc > /dev/null || source scripts/cuda_build_env.sh; then
  bash scripts/gpu/candle_check.sh build
  bash scripts/gpu/candle_ddp_check.sh build
  binaries+=(candle candle_ddp)
else
  mkdir -p .gpu/candle .gpu/candle_ddp
  echo "candle's CUDA tests were not built: no nvcc on the build machine and no CUDA wheels (docs/candle.md)" \
    > .gpu/candle/NOT-BUILT
  echo "the candle trainer was not built: no nvcc on the build machine and no CUDA wheels (docs/candle.md)" \
    > .gpu/candle_ddp/NOT-BUILT
fi

# The PyTorch package: the wheel (the GPU machine has no Rust toolchain and no network), and
# pytest with its dependencies for a machine without it.
rm -f .gpu/mucudnn-*.whl .gpu/mucudnn-*.tar.gz
bash scripts/build_wheel.sh .gpu
rm -f .gpu/mucudnn-*.tar.gz
rm -rf .gpu/wheels
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 -d .gpu/wheels pytest iniconfig pluggy packaging

cp scripts/gpu/accept.sh scripts/gpu/libs.sh scripts/gpu/c_abi_check.sh \
  scripts/gpu/candle_check.sh scripts/gpu/candle_ddp_check.sh scripts/gpu/engines_vs_torch.sh \
  .gpu/
cp scripts/gpu/torch_check.py scripts/gpu/torch_cases.py scripts/gpu/torch_bench.py \
  scripts/gpu/compare_profile.py scripts/gpu/nd_bench.py scripts/gpu/spatial_bench.py \
  scripts/gpu/bench_common.py .gpu/
cp tests/fixtures/h100-alexnet-profile.json .gpu/

# The binaries travel packed (accept.sh unpacks them into .gpu once).
tar -cJf .gpu/binaries.tar.xz -C .gpu "${binaries[@]}"
rm -rf "${binaries[@]/#/.gpu/}"

gpu_bytes=$(du -sb .gpu | cut -f1)
tree_bytes=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
echo "size: .gpu $((gpu_bytes / 1024)) KiB + the working tree's tracked files" \
  "$((tree_bytes / 1024)) KiB = $(((gpu_bytes + tree_bytes) / 1024)) KiB (limit 65536 KiB)"
du -sh .gpu/* | sort -h | tail -n 8
if [ $((gpu_bytes + tree_bytes)) -gt $((64 * 1024 * 1024)) ]; then
  echo "error: over the device tool's 64 MiB" >&2
  exit 1
fi
echo "now, on the GPU machine with .gpu carried: bash .gpu/accept.sh (lists the parts)"

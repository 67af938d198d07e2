#!/usr/bin/env bash
# Builds, here (no GPU needed), everything the GPU acceptance runs, into .gpu/ (ignored by git
# through .git/info/exclude), so that a run carrying only .gpu works:
#
#   bash scripts/gpu/build.sh                     the core (default, same as --core): every
#                                                 part but candle and train
#   bash scripts/gpu/build.sh --with-candle       also candle's CUDA tests and the trainer
#                                                 (needs nvcc or PyPI's CUDA wheels; a failure
#                                                 writes NOT-BUILT with the log's tail and the
#                                                 rest goes on)
#   bash scripts/gpu/build.sh --parts first-contact,wall
#                                                 only what those parts need (accept.sh's table
#                                                 says what each needs)
#
# What it can make: the stripped release binary and test executables (packed into
# .gpu/binaries.tar.xz), the release libmucudnn.so with the source package (first-contact
# uses them: no zigbuild), the Python wheel (scripts/build_wheel.sh), pytest's wheels for a
# machine without pytest, diffusers' wheels and its dependencies' (the vae part), the scripts, the test files they
# run, the C ABI examples and header, and the fixture. Prints its minutes and the size of
# .gpu (the device tool carries at most 64 MiB) and fails above that. Then, there:
#
#   bash .gpu/accept.sh window 540   the one command of a GPU window (docs/gpu.md)
#   bash .gpu/accept.sh              the parts, in priority order, with their minutes
set -euo pipefail
cd "$(dirname "$0")/../.."
started=$(date +%s)
candle=no
parts=""
while [ $# -gt 0 ]; do
  case "$1" in
    --core) candle=no ;;
    --with-candle) candle=yes ;;
    --parts)
      parts=${2:?--parts needs a comma-separated list}
      shift
      ;;
    *)
      echo "usage: build.sh [--core | --with-candle] [--parts PART,...]" >&2
      exit 2
      ;;
  esac
  shift
done

# What the parts need (the third column of accept.sh's PARTS table).
table=$(sed -n '/^PARTS="/,/"$/p' scripts/gpu/accept.sh | sed 's/^PARTS="//; s/"$//')
if [ -z "$parts" ]; then
  parts=$(cut -d'|' -f1 <<< "$table" | tr '\n' ',')
  [ "$candle" = yes ] || parts=$(tr ',' '\n' <<< "$parts" | grep -vx 'candle\|train' | tr '\n' ',')
fi
parts=$(tr ',' '\n' <<< "$parts" | grep -v '^$' | paste -sd, -)
needs=" "
for part in ${parts//,/ }; do
  line=$(grep "^$part|" <<< "$table") || { echo "unknown part $part" >&2; exit 2; }
  needs+="$(cut -d'|' -f3 <<< "$line") "
done
need() { [[ "$needs" == *" $1 "* ]]; }
echo "building .gpu for: $parts (needs: $(tr ' ' '\n' <<< "$needs" | sort -u | grep -v '^$' | paste -sd' ' -))"

mkdir -p .gpu
# (git rev-parse: in a worktree .git is a file; the exclude file is the common one)
exclude=$(git rev-parse --git-path info/exclude)
# A clone made without git's templates has no .git/info.
mkdir -p "$(dirname "$exclude")"
grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
target=${CARGO_TARGET_DIR:-target}
rm -rf .gpu/out .gpu/.unpacked .gpu/binaries.tar.xz .gpu/python .gpu/wheels .gpu/wheels-vae \
  .gpu/c_abi
mkdir -p .gpu/python/tests

binaries=()
if need bin; then
  # (a test target: the same feature resolution as the test executables below, see
  # c_abi_check.sh build)
  cargo build --release --locked --bin mucudnn --test current_context
  cp "$target/release/mucudnn" .gpu/mucudnn
  binaries+=(mucudnn)
fi
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
# Only the test executables the chosen parts' steps run (first-contact does not run
# gpu-engines: one release build fewer).
commands=$(for part in ${parts//,/ }; do bash scripts/gpu/accept.sh --steps "$part"; done)
runs() { grep -q "\.gpu/$1[[:space:]]" <<< "$commands"; }
# where in .gpu, cargo's arguments
while read -r path args; do
  name=${path#.gpu/}
  if need tests && runs "$name"; then
    # (word splitting of $args is meant: `--lib`, or `--test` and a target)
    # shellcheck disable=SC2086
    cp "$(exe $args)" "$path"
    binaries+=("$name")
  fi
done <<'TESTS'
.gpu/lib-tests --lib
.gpu/gpu-tests --test gpu_cudnn
.gpu/gpu-engines --test gpu_engines
.gpu/gpu-teardown --test gpu_teardown
.gpu/current-context --test current_context
TESTS
if [ ${#binaries[@]} -gt 0 ]; then
  (cd .gpu && strip "${binaries[@]}")
fi
# The release libmucudnn.so (c_abi_check.sh build: .gpu/c_abi/) with the C ABI's examples and
# header, and the source package beside it (first-contact runs it with MUCUDNN_LIBRARY).
if need lib; then
  bash scripts/gpu/c_abi_check.sh build
  mkdir -p .gpu/python/mucudnn
  (cd python && tar -cf - --exclude=__pycache__ mucudnn) | tar -xf - -C .gpu/python
fi

# .gpu/candle/ and .gpu/candle_ddp/: the binaries, or a NOT-BUILT note (.gpu/candle/NOT-BUILT,
# .gpu/candle_ddp/NOT-BUILT) that the candle and train parts report.
# candle's CUDA tests need nvcc here (candle-kernels compiles PTX): a CUDA install's, else
# PyPI's wheels (scripts/cuda_build_env.sh). Opt-in and fail-soft: a failure writes NOT-BUILT
# (the reason and the log's tail), which the part reports there, and the rest is built.
# candle_build NAME SCRIPT: builds one of the two into .gpu/NAME.
candle_build() {
  local name=$1 script=$2 log
  rm -rf ".gpu/$name"
  mkdir -p ".gpu/$name"
  log=$(mktemp)
  if { command -v nvcc > /dev/null || source scripts/cuda_build_env.sh; } > "$log" 2>&1 &&
    bash "$script" build >> "$log" 2>&1; then
    binaries+=("$name")
  else
    mkdir -p ".gpu/$name"
    {
      echo "$name was not built here (bash $script build failed; no nvcc, or no CUDA wheels?):"
      tail -n 30 "$log"
    } > ".gpu/$name/NOT-BUILT"
    echo "warning: $name not built; see .gpu/$name/NOT-BUILT" >&2
  fi
  rm -f "$log"
}
for name in candle candle_ddp; do
  if need "$name"; then
    candle_build "$name" "scripts/gpu/${name}_check.sh"
  else
    rm -rf ".gpu/$name"
    mkdir -p ".gpu/$name"
    echo "$name was not built: build.sh --with-candle (or --parts with its part) builds it" \
      > ".gpu/$name/NOT-BUILT"
  fi
done

# The PyTorch package's wheel (the GPU machine has no Rust toolchain and no network).
rm -f .gpu/mucudnn-*.whl .gpu/mucudnn-*.tar.gz
if need wheel; then
  bash scripts/build_wheel.sh .gpu
  rm -f .gpu/mucudnn-*.tar.gz
fi
pip_download() { # FOLDER PACKAGE...: wheels for the GPU machine's Python 3.12, no dependencies
  local folder=$1
  shift
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 -d "$folder" "$@"
}
if need pytest || need wheel; then
  pip_download .gpu/wheels pytest iniconfig pluggy packaging
fi
# diffusers with its dependencies' wheels (for Python 3.12), less numpy and Pillow, which the
# GPU machine has (torch, torchvision): there, accept.sh installs diffusers and only those
# dependencies the machine lacks or has in a version diffusers does not accept (its versions
# are not known here; diffusers 0.42 wants huggingface_hub >= 1.32, which an older
# transformers' hub would not satisfy).
if need diffusers; then
  python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 -d .gpu/wheels-vae diffusers
  rm -f .gpu/wheels-vae/numpy-*.whl .gpu/wheels-vae/pillow-*.whl
fi

# The scripts, the test files and helpers they run, the fixture.
cp scripts/gpu/accept.sh scripts/gpu/libs.sh scripts/gpu/c_abi_check.sh \
  scripts/gpu/candle_check.sh scripts/gpu/candle_ddp_check.sh scripts/gpu/engines_vs_torch.sh \
  scripts/gpu/check_part.py scripts/gpu/summary.py .gpu/
cp scripts/gpu/torch_check.py scripts/gpu/torch_cases.py scripts/gpu/torch_bench.py \
  scripts/gpu/compare_profile.py scripts/gpu/nd_bench.py scripts/gpu/spatial_bench.py \
  scripts/gpu/bench_common.py scripts/gpu/verify_table.py .gpu/
rm -f .gpu/vae_bench.py
if [ -f scripts/gpu/vae_bench.py ]; then
  cp scripts/gpu/vae_bench.py .gpu/
fi
cp python/tests/conftest.py python/tests/converted.py python/tests/test_torch_cuda.py \
  python/tests/test_loader.py .gpu/python/tests/
cp tests/fixtures/h100-alexnet-profile.json .gpu/

# What `accept.sh window` reads: the parts built for (it may reach only these), the parts
# that passed on each kind of GPU (from the windows' and parts' summaries committed under
# benches/gpu/), and the commit built (its summary names it).
tr ',' '\n' <<< "$parts" > .gpu/parts.txt
python3 scripts/gpu/summary.py collect benches/gpu .gpu/passed.json
{
  git rev-parse HEAD
  git diff --quiet HEAD -- . ':!benches/gpu' || echo "(with uncommitted changes)"
} | paste -sd' ' - > .gpu/commit.txt

# The binaries travel packed (accept.sh unpacks them into .gpu once).
if [ ${#binaries[@]} -gt 0 ]; then
  tar -cJf .gpu/binaries.tar.xz -C .gpu "${binaries[@]}"
  rm -rf "${binaries[@]/#/.gpu/}"
fi

gpu_bytes=$(du -sb .gpu | cut -f1)
echo "size: .gpu $((gpu_bytes / 1024)) KiB (limit 65536 KiB, carrying .gpu alone)"
du -sh .gpu/* | sort -h | tail -n 8
if [ "$gpu_bytes" -gt $((64 * 1024 * 1024)) ]; then
  echo "error: over the device tool's 64 MiB" >&2
  exit 1
fi
# What each part built for still lacks (vae without vae_bench.py, say): reported, and the
# part fails there saying so (the window runs it and records the failure).
if ! bash .gpu/accept.sh window --check | grep -E '(: ok|INCOMPLETE|^  )'; then
  echo "warning: .gpu is incomplete for the window (bash .gpu/accept.sh window --check)" >&2
fi
seconds=$(($(date +%s) - started))
echo "build.sh took $((seconds / 60)) min $((seconds % 60)) s"
echo "now, one device call (timeout_s 600) with .gpu carried: bash .gpu/accept.sh window 540"

#!/usr/bin/env bash
# The GPU acceptance (docs/gpu.md). Built here, where Rust is, by `bash scripts/gpu/build.sh`
# (it fills .gpu/ and copies this script there); run there, on the GPU machine, from the folder
# above .gpu (only .gpu needs to be carried):
#
#   bash .gpu/accept.sh window [SECONDS]  THE command of a GPU window: first-contact, then each
#                                       part build.sh built for that has not passed on this
#                                       kind of GPU (.gpu/passed.json, from benches/gpu/), in
#                                       priority order, while the next part's caps fit in
#                                       SECONDS (default 540); a failing part never stops it
#   bash .gpu/accept.sh                 lists the parts, in priority order, with their minutes
#   bash .gpu/accept.sh PART            runs one part
#   bash .gpu/accept.sh --check [PART]  here, on the CPU: every file each part needs is in .gpu,
#                                       every Python script compiles, every test a step selects
#                                       exists, and each part's step caps fit its minutes
#   bash .gpu/accept.sh window --check [SECONDS]
#                                       here: --check for every part the window may reach, and
#                                       that each fits the window's SECONDS
#
# A GPU window is 15 minutes in all, the machine's start included, and the machine goes back
# 30 s after a command ends, so a window is one command: a fix made here needs a new window.
# A part is at most 5 minutes and every step has its own cap in seconds (not "what is left"):
# a step that runs out says so and the part fails; each step's seconds are recorded, so caps
# can be set from measurements. A part writes under $OUT (default .gpu/out): PART.json (steps,
# caps, status, seconds, the GPU, the cuDNN loaded, the failed step's last lines), PART.log
# (every step's output, in order) and PART-files.tar.gz (the reports the steps wrote), prints a
# short table last, and exits non-zero on any failure. The window writes four files instead,
# each as its parts finish (a command killed at its limit still returns them): window.json
# (every part's summary), window.txt (the table), window.log (every step's output, live) and
# window-files.tar (the parts' reports). accept.sh reads nothing outside .gpu/.
#
# One libcudnn per process: .gpu/libs.sh links PyTorch's cuDNN by every name, and a set-up step
# of every part proves that only one cuDNN folder loads.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
  */.gpu) cd "$here/.." ;;
  */scripts/gpu) cd "$here/../.." ;;
esac
G=.gpu
# Engine configurations timed per (op, micro-batch size): bounded, so that a part fits its call.
export MAX_CANDIDATES=${MAX_CANDIDATES:-8}

# part|minutes|what build.sh must make for it|what it proves, in priority order. The needs:
# bin (the mucudnn CLI), tests (the Rust test executables), lib (the release libmucudnn.so and
# the source package), wheel (the PyTorch package's wheel), pytest, diffusers (its wheels),
# vae_bench, candle, candle_ddp.
PARTS="first-contact|5|tests lib pytest|the widest surface in one call: set-up (one libcudnn, the package, CUDA), PyTorch's CUDA path (18 named tests: fp32 NCHW and fp16 channels-last, legacy and engines, grouped/strided, a side stream with no host sync, CUDA graphs, Conv3d, ConvTranspose2d, batch-1 spatial 2-D/3-D; no skip, no fallback), converted AlexNet fp16 against cudnn.benchmark (error, ms/step, peak memory, tuning), the cuDNN wall (legacy vs float64, offset micro-batches, timer and Find, plans vs PyTorch, 3-D/1-D, spatial, teardown, current context)
verify|5|bin tests|verified tuning on this GPU and cuDNN: the output comparison (cudnnOpTensor + cudnnReduceTensor) against known differences, verified measuring of every candidate (2-D fp32/TF32/fp16/bf16, 3-D), then verified tunes of AlexNet fp32 and fp16 and r3d_18 fp32 (3-D, TF32): a table per layer of each candidate's error, and which candidates are rejected (findings, not failures)
torch|5|wheel pytest|the wheel installs and imports; every CUDA test of test_torch_cuda.py and library loading (no skip, no fallback); converted AlexNet fp32 and fp16 against PyTorch (outputs, gradients)
torch-resnet50|5|wheel|converted ResNet-50 training step, fp32 and fp16 channels-last: mucudnn's and PyTorch's outputs and gradients against a float64 reference (mucudnn within 2x PyTorch's own error)
torch-speed-resnet50-fp16|5|wheel|ResNet-50 fp16 channels-last at 64 MiB per layer against cudnn.benchmark: step time, peak memory, tuning time
torch-speed-resnet50-fp32|5|wheel|ResNet-50 fp32 NCHW at 256 MiB per layer against cudnn.benchmark: step time, peak memory, tuning time
torch-speed-alexnet-fp32|5|wheel|AlexNet fp32 NCHW at 256 MiB per layer against cudnn.benchmark: step time, peak memory, tuning time
wall|5|tests|the whole cuDNN wall: every GPU test of src/backend/cudnn, tests/gpu_cudnn.rs (with PyTorch's cases), gpu_teardown.rs, current_context.rs
wall-engines|5|tests|graph-API engines (tests/gpu_engines.rs): every op against the host reference, offset micro-batches, beta, names, the sweep, argument checks
tune-legacy|5|bin|a legacy-only AlexNet fp32 tune, reported against the legacy H100 fixture (a report, never a failure), then tune --verify AlexNet fp32 with engines
tune-fp16|5|bin|tune --verify AlexNet fp16 NHWC with legacy algorithms and engines
engines-alexnet|5|bin|AlexNet's executed plans (fp16 NHWC, fp32 NCHW) against cudnn.benchmark timed in the same run
engines-resnet50|5|bin|ResNet-50's distinct convolutions' executed plans against cudnn.benchmark timed in the same run
engines-tuning|5|bin|the time to tune all of AlexNet's layers with engines from an empty cache
nd-vae|5|bin wheel|Wan 2.1 VAE decoder convolutions (480p x 17 frames, fp16 NDHWC, forward, split=batch) at 1 GiB per layer against cudnn.benchmark: time, peak memory, error
nd-r3d|5|bin wheel|r3d_18 training (batch 8, fp16 NDHWC) at 1 GiB per layer against cudnn.benchmark: step time, peak memory, loss and weight-gradient error
spatial-sdxl|5|bin wheel|SDXL VAE decoder convolutions at 2048x2048 (fp16 NHWC, batch 1, split=auto) at 256 MiB per layer against cudnn.benchmark: time, peak memory, which layers split
spatial-wan|5|bin wheel|Wan 2.1 VAE decoder convolutions (fp16 NDHWC, batch 1, split=auto) at 256 MiB per layer against cudnn.benchmark: time, peak memory, which layers split
vae-wan|5|wheel diffusers vae_bench|a real diffusers AutoencoderKLWan decode (Wan 2.1 topology at a third of its width, 17x480x832, fp16; vae_bench.py): untiled PyTorch, enable_tiling() and mucudnn at 256 MiB and 1 GiB per layer: time, peak memory, error against untiled fp32
vae-sdxl|5|wheel diffusers vae_bench|a real diffusers AutoencoderKL decode (SDXL topology, 1024x1024 and 2048x2048, fp16; vae_bench.py): the same four variants
c-abi|3|lib|the C ABI clients: examples/c_client.c against cuDNN, examples/pytorch_ctypes.py against torch
candle|5|candle|mucudnn::candle on candle's CUDA device (built with build.sh --with-candle, where nvcc is)
train|5|candle_ddp|the candle trainer (examples/candle_ddp.rs) on the GPU: the loss falls, images/s against candle's own conv2d (build.sh --with-candle)"

# The named selection of python/tests/test_torch_cuda.py that first-contact runs: fp32 NCHW
# and fp16 channels-last with legacy algorithms and engines, plain and grouped/strided; a side
# stream with no host synchronisation; CUDA-graph capture and the untuned shape under capture;
# Conv3d fp32 NCDHW (both kinds) and fp16 NDHWC (engines: with legacy algorithms alone cuDNN
# may have none for an op there, and that test may only record a fallback); ConvTranspose2d;
# batch-1 spatial plans in 2-D and 3-D.
TORCH_CUDA=$G/python/tests/test_torch_cuda.py
FIRST_CONTACT_TESTS=(
  "$TORCH_CUDA::test_matches_pytorch[legacy-fp32-nchw-3x3]"
  "$TORCH_CUDA::test_matches_pytorch[engines-fp32-nchw-3x3]"
  "$TORCH_CUDA::test_matches_pytorch[legacy-fp16-nhwc-3x3]"
  "$TORCH_CUDA::test_matches_pytorch[engines-fp16-nhwc-3x3]"
  "$TORCH_CUDA::test_matches_pytorch[legacy-fp32-nchw-5x5-s2-g2]"
  "$TORCH_CUDA::test_matches_pytorch[engines-fp32-nchw-5x5-s2-g2]"
  "$TORCH_CUDA::test_matches_pytorch[legacy-fp16-nhwc-5x5-s2-g2]"
  "$TORCH_CUDA::test_matches_pytorch[engines-fp16-nhwc-5x5-s2-g2]"
  "$TORCH_CUDA::test_no_host_synchronisation_after_tuning_and_other_streams"
  "$TORCH_CUDA::test_cuda_graph_capture_after_tuning"
  "$TORCH_CUDA::test_untuned_shape_inside_capture_is_a_clear_error"
  "$TORCH_CUDA::test_nd_layers_match_pytorch[legacy-fp32-conv3d]"
  "$TORCH_CUDA::test_nd_layers_match_pytorch[engines-fp32-conv3d]"
  "$TORCH_CUDA::test_nd_layers_match_pytorch[engines-fp16-conv3d]"
  "$TORCH_CUDA::test_nd_layers_match_pytorch[legacy-fp32-convT2d]"
  "$TORCH_CUDA::test_nd_layers_match_pytorch[engines-fp16-convT2d]"
  "$TORCH_CUDA::test_spatial_plans_at_batch_1_fp16_channels_last_match_pytorch[conv2d]"
  "$TORCH_CUDA::test_spatial_plans_at_batch_1_fp16_channels_last_match_pytorch[conv3d]"
)

list_parts() {
  echo "bash .gpu/accept.sh window [SECONDS]   (a GPU window's one command: first-contact, then"
  echo "  the parts below not yet passed on this GPU, in this order, while they fit SECONDS)"
  echo "bash .gpu/accept.sh PART   (one part)"
  printf '%-26s %7s  %s\n' part minutes "what it proves"
  while IFS='|' read -r name minutes _ what; do
    printf '%-26s %7s  %s\n' "$name" "$minutes" "$what"
  done <<< "$PARTS"
  echo "bash .gpu/accept.sh --check [PART]   (on the build machine: is .gpu complete for it?)"
  echo "bash .gpu/accept.sh window --check    (on the build machine: for every part the window"
  echo "  may reach)"
}

mode=run
window=no
budget=540
case "${1:-}" in
  --check) mode=check && shift ;;
  --steps) mode=steps && shift ;; # build.sh and the window: the steps' commands and caps
esac
if [ "${1:-}" = window ]; then
  window=yes
  shift
  if [ "${1:-}" = --check ]; then
    mode=check
    shift
  fi
  budget=${1:-540}
  if ! [[ "$budget" =~ ^[0-9]+$ ]] || [ "$budget" -lt 60 ]; then
    echo "accept.sh window [SECONDS]: SECONDS is a whole number of seconds >= 60, not '$budget'" >&2
    exit 2
  fi
  [ $# -le 1 ] || { echo "usage: accept.sh window [--check] [SECONDS]" >&2; exit 2; }
  part=""
else
  part=${1:-}
fi
if [ "$window" = no ] && [ -z "$part" ] && [ "$mode" = run ]; then
  list_parts
  exit 0
fi
if [ "$mode" = steps ] && [ -z "$part" ]; then
  echo "usage: accept.sh --steps PART" >&2
  exit 2
fi
if [ -n "$part" ] && ! grep -q "^$part|" <<< "$PARTS"; then
  echo "unknown part '$part'" >&2
  list_parts >&2
  exit 2
fi

# step NAME CAP_S COMMAND...: runs COMMAND (a program, or a function of this script) under its
# own cap of CAP_S seconds, its output into the part's log; records name, cap, status, seconds
# and kind (required, or info: see info_step). Under --check and --steps it only records the
# step and its command for the checker.
step() {
  local name=$1 cap=$2
  shift 2
  if [ "$mode" != run ]; then
    {
      printf '%s\t%s' "$name" "$cap"
      printf '\t%s' "$@"
      printf '\n'
    } >> "$steps"
    return 0
  fi
  local t0 rc
  t0=$(date +%s)
  echo "== $name (cap $cap s)" | tee -a "$log"
  if declare -F "$1" > /dev/null; then
    # A function of this script: run in a child bash that knows it, under the same cap.
    export -f "$1"
    timeout --kill-after=5 "$cap" bash -c '"$@"' _ "$@" >> "$log" 2>&1
  else
    timeout --kill-after=5 "$cap" "$@" >> "$log" 2>&1
  fi
  rc=$?
  local status=ok
  [ "$rc" -eq 0 ] || status="FAILED ($rc)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="FAILED: out of time (cap $cap s)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$cap" "$status" "$(($(date +%s) - t0))" \
    "${step_kind:-required}" >> "$steps"
  echo "== $name: $status" | tee -a "$log"
  return "$rc"
}

# info_step NAME CAP_S COMMAND...: a step whose failure is recorded (as a warning) but neither
# fails the part nor stops it: what it finds is information, not a condition of the rest.
info_step() {
  step_kind=info step "$@"
  return 0
}

# rust_tests BINARY ARGS...: a Rust test executable, failing when it ran no test or, with
# --exact, fewer than it names (libtest passes a filter that matches nothing: a renamed test
# would pass unseen). `--skip NAME` is not a name it runs.
rust_tests() {
  local out rc ran expected=0 exact=no skip=no arg missing="" name
  out=$(mktemp)
  "$@" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  for arg in "${@:2}"; do
    if [ "$skip" = yes ]; then
      skip=no
    elif [ "$arg" = --skip ]; then
      skip=yes
    elif [ "$arg" = --exact ]; then
      exact=yes
    elif [[ "$arg" != -* ]]; then
      expected=$((expected + 1))
    fi
  done
  ran=$(sed -n -E 's/^running ([0-9]+) tests?$/\1/p' "$out" | head -n 1)
  if [ "${ran:-0}" -eq 0 ]; then
    echo "rust_tests: $1 ran no test (a filter that matches nothing?)"
    rc=1
  elif [ "$exact" = yes ] && [ "$ran" -lt "$expected" ]; then
    skip=no
    for arg in "${@:2}"; do
      if [ "$skip" = yes ]; then skip=no; continue; fi
      [ "$arg" = --skip ] && { skip=yes; continue; }
      [[ "$arg" == -* ]] && continue
      name=$arg
      grep -q "^test $name \.\.\. " "$out" || missing="$missing $name"
    done
    echo "rust_tests: $1 ran $ran of the $expected tests it names; not run:$missing"
    rc=1
  fi
  rm -f "$out"
  return "$rc"
}

# stop REASON: records why the rest of the part did not run (a failed set-up step).
stop() {
  [ "$mode" = run ] || return 0
  printf '%s\t%s\t%s\t%s\n' "the rest of the part" 0 "not run: $1" 0 >> "$steps"
  echo "== stopped: $1" | tee -a "$log"
}

# ------------------------------------------------------------------------------------------
# Set-up steps (functions: each runs in a child bash under its step's cap).

# The binaries travel xz-compressed (build.sh): unpacked into .gpu once.
unpack() {
  if [ -f .gpu/.unpacked ]; then
    echo "already unpacked"
  else
    tar -xJvf .gpu/binaries.tar.xz -C .gpu && touch .gpu/.unpacked
  fi
}

# The GPU's name, driver and memory (nvidia-smi's first run on a fresh machine can take seconds
# while the driver loads: an info step, whose failure stops nothing).
gpu_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/gpu.txt" &&
    cat "$work/gpu.txt"
}

# The package imports (from PYTHONPATH: the wheel's folder or .gpu/python), its library loads,
# and PyTorch sees a CUDA device; prints the versions.
package_check() {
  python3 - "$1" <<'PY'
import sys
import torch
import mucudnn
import mucudnn.torch  # noqa: F401 (registers the custom ops)
where = sys.argv[1]
assert mucudnn.__file__.startswith(where), f"imported {mucudnn.__file__}, not the one in {where}"
assert mucudnn.version() == mucudnn.__version__, (mucudnn.version(), mucudnn.__version__)
if not torch.cuda.is_available():
    sys.exit(f"torch.cuda.is_available() is False (torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}): nothing below can run")
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "| mucudnn", mucudnn.__version__, "from", mucudnn.__file__, "| library", mucudnn.library_path(),
      "| GPU", torch.cuda.get_device_name())
PY
}

# The wheel build.sh made, installed into a folder of this part (on PYTHONPATH, set below); and
# pytest from wheels build.sh fetched, where the machine lacks it.
wheel_install() {
  local wheel
  wheel=$(ls .gpu/mucudnn-*-py3-none-manylinux_2_28_x86_64.whl 2>/dev/null | head -n 1)
  [ -n "$wheel" ] || { echo "no wheel in .gpu: run scripts/gpu/build.sh"; return 1; }
  python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" "$wheel" ||
    return 1
  if ! python3 -c 'import pytest' 2>/dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" \
      .gpu/wheels/*.whl || return 1
  fi
}

# first-contact's package: the source package (PYTHONPATH, set by the part) with the release
# library; pytest from the wheels build.sh fetched, where the machine lacks it; then the checks.
source_package() {
  if ! python3 -c 'import pytest' 2>/dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" \
      .gpu/wheels/*.whl || return 1
  fi
  package_check "$1"
}

# diffusers from .gpu/wheels-vae, with those of its dependencies (recursively) that the machine
# lacks or has in a version diffusers' requirements exclude: installed into the part's folder
# on PYTHONPATH (the machine's own packages stay where they satisfy).
diffusers_install() {
  python3 - "$work/site" <<'PY' || return 1
import glob, os, re, subprocess, sys, zipfile
import importlib.metadata as metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def key(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wheels = {key(os.path.basename(w).split("-")[0]): w for w in glob.glob(".gpu/wheels-vae/*.whl")}

def requires(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]

chosen, todo, missing = [], ["diffusers"], []
while todo:
    name = todo.pop()
    if name in chosen:
        continue
    if name not in wheels:
        missing.append(name)
        continue
    chosen.append(name)
    for text in requires(wheels[name]):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            if req.specifier.contains(metadata.version(req.name), prereleases=True):
                continue  # the machine's own version satisfies it
        except metadata.PackageNotFoundError:
            pass
        todo.append(key(req.name))
if missing:
    sys.exit(f"no wheel in .gpu/wheels-vae for {missing} (needed by diffusers here)")
print("installing from .gpu/wheels-vae:", ", ".join(chosen))
subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                "--no-compile", "--target", sys.argv[1], *(wheels[n] for n in chosen)], check=True)
PY
  python3 -c 'import diffusers; print("diffusers", diffusers.__version__, "from", diffusers.__file__)'
}

# pytest_strict JUNIT_XML PYTEST_ARGS...: pytest, and a failure on any skipped test too (a
# CUDA test that skips on the GPU machine proves nothing).
pytest_strict() {
  local xml=$1
  shift
  python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$xml" "$@" || return $?
  python3 - "$xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
ran = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"{ran} tests, {skipped} skipped")
sys.exit(1 if skipped or not ran else 0)
PY
}

# The set-up of the parts after first-contact: they run in the window after it, on a machine
# whose driver, cuDNN and torch have been loaded once (first-contact's set-up has the room of
# a first touch). nvidia-smi only informs (the GPU's name in the summary): it stops nothing.

# The common set-up: the GPU, the binaries, one libcudnn (17 s at most together).
setup_binaries() {
  info_step "nvidia-smi" 5 gpu_info
  step "unpack the binaries" 7 unpack &&
    step "one libcudnn (libs.sh)" 5 one_cudnn_check
}

# The set-up of the PyTorch parts: the GPU, one libcudnn, the wheel, torch sees CUDA.
setup_wheel() {
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  info_step "nvidia-smi" 5 gpu_info
  step "one libcudnn (libs.sh)" 5 one_cudnn_check &&
    step "the wheel installs" 30 wheel_install &&
    step "the package imports, CUDA is available" 10 package_check "$work/site"
}

# ------------------------------------------------------------------------------------------
# The parts: each a list of steps; their caps add up to the part's minutes at most.

# first-contact's caps (300 s): set-up 75 (first touches: 5 + 20 + 20 + 30), PyTorch's CUDA
# path 85 (18 small layers, each tuned with at most 8 configurations per op and size, after
# the process's CUDA and cuDNN start), AlexNet 65, then five fresh Rust or Python processes,
# each paying CUDA's start, cuDNN's load and plan builds again: the wall's legacy checks 20,
# PyTorch's cases 15, the plan tests 20, teardown 10 (two plans, one of 20 calls of about 59
# GFLOP), the current context 10 (two tuners, each tuning one bounded undivided plan).
part_first_contact() {
  # The source package with the release library (no wheel needed for this part).
  export PYTHONPATH="$PWD/.gpu/python:$work/site${PYTHONPATH:+:$PYTHONPATH}"
  export MUCUDNN_LIBRARY="$PWD/.gpu/c_abi/libmucudnn.so"
  # 1. Set-up, 75 s.
  info_step "nvidia-smi" 20 gpu_info
  if ! { step "unpack the binaries" 5 unpack &&
    step "one libcudnn (libs.sh)" 20 one_cudnn_check &&
    step "the package imports, CUDA is available" 30 source_package "$PWD/.gpu/python"; }; then
    stop "set-up failed (see the log)"
    return
  fi
  # 2. PyTorch's CUDA path, 85 s: no skip, and the tests assert no fallback.
  step "PyTorch's CUDA path: ${#FIRST_CONTACT_TESTS[@]} tests of test_torch_cuda.py" 85 \
    pytest_strict "$work/first-contact-pytest.xml" "${FIRST_CONTACT_TESTS[@]}"
  # 3. Speed and memory, 65 s.
  step "converted AlexNet fp16 channels-last against cudnn.benchmark" 65 \
    python3 $G/torch_check.py "$work/torch" alexnet --mode first-contact \
    --max-candidates "$MAX_CANDIDATES"
  # 4. The cuDNN wall, 75 s.
  step "legacy algorithms vs float64, offset micro-batches, timer and Find" 20 \
    rust_tests $G/lib-tests --include-ignored --test-threads=1 --exact \
    backend::cudnn::tests::gpu_all_ops_and_algorithms_match_host \
    backend::cudnn::tests::gpu_micro_batches_match_the_whole_batch \
    backend::cudnn::tests::gpu_timer_and_find \
    backend::cudnn::tests::gpu_tiled_fill_matches_the_host_pattern
  step "PyTorch's cases for the plan tests" 15 python3 $G/torch_cases.py "$work/torch"
  export MUCUDNN_TORCH_DIR="$work/torch"
  step "plans vs PyTorch, 3-D/1-D plans, spatial plans (gpu_cudnn.rs)" 20 \
    rust_tests $G/gpu-tests --include-ignored --nocapture --test-threads=1 --exact \
    cudnn_plans_match_pytorch cudnn_3d_and_1d_plans_equal_undivided_and_the_host_reference \
    spatial_plans_equal_undivided_and_the_host_reference
  step "teardown on the caller's stream, graph capture (gpu_teardown.rs)" 10 \
    rust_tests $G/gpu-teardown --include-ignored --nocapture --test-threads=1 --exact \
    releasing_a_plan_waits_for_the_callers_stream a_captured_plan_is_parked_and_the_graph_replays
  step "the caller's current context (current_context.rs)" 10 \
    rust_tests $G/current-context --include-ignored --nocapture --test-threads=1 --exact \
    no_current_context_stays_none engine_plans_are_destroyed_in_the_callers_context
}

part_torch() {
  setup_wheel || { stop "set-up failed (see the log)"; return; }
  step "pytest: every CUDA test, library loading" 200 \
    pytest_strict "$work/torch-pytest.xml" $G/python/tests/test_torch_cuda.py \
    $G/python/tests/test_loader.py
  step "converted AlexNet fp32 and fp16 against PyTorch (outputs, gradients)" 40 \
    python3 $G/torch_check.py "$work/torch" alexnet --mode correctness \
    --max-candidates "$MAX_CANDIDATES"
}

part_torch_resnet50() {
  setup_wheel || { stop "set-up failed (see the log)"; return; }
  step "ResNet-50 fp32 and fp16: outputs, gradients against float64" 240 \
    python3 $G/torch_check.py "$work/torch" resnet50 --mode correctness \
    --max-candidates "$MAX_CANDIDATES"
}

# verified_tune NAME ARGS...: `mucudnn tune ARGS... --json` into $work/verify-NAME.json (its
# summary on stderr goes to the log).
verified_tune() {
  local name=$1
  shift
  $G/mucudnn tune "$@" --device cuda --json > "$work/verify-$name.json"
}

part_verify() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  step "the GPU comparison against known differences (gpu_cudnn.rs)" 20 \
    rust_tests $G/gpu-tests --include-ignored --nocapture --test-threads=1 --exact \
    gpu_output_comparison_measures_known_differences
  step "verified measuring of every candidate, 2-D and 3-D (gpu_cudnn.rs)" 40 \
    rust_tests $G/gpu-tests --include-ignored --nocapture --test-threads=1 --exact \
    gpu_verified_measuring_compares_every_candidate
  step "verified tune: AlexNet fp32 NCHW (legacy + engines)" 75 \
    verified_tune alexnet-fp32 --model alexnet --batch 16 --dtype fp32 --layout nchw \
    --candidates all --max-candidates "$MAX_CANDIDATES" --cache "$work/cache.sqlite"
  step "verified tune: AlexNet fp16 NHWC (legacy + engines)" 65 \
    verified_tune alexnet-fp16 --model alexnet --batch 16 --dtype fp16 --layout nhwc \
    --candidates all --max-candidates "$MAX_CANDIDATES" --cache "$work/cache.sqlite"
  step "verified tune: r3d_18 fp32 NCDHW (3-D, TF32 allowed)" 60 \
    verified_tune r3d-fp32 --model r3d_18 --batch 2 --input 8x56x56 --channel-divisor 2 \
    --dtype fp32 --layout ncdhw --candidates all --max-candidates "$MAX_CANDIDATES" \
    --cache "$work/cache.sqlite"
  step "a table per layer of each candidate's error (verify_table.py)" 10 \
    python3 $G/verify_table.py "$work/verify-table.txt" "$work/verify-alexnet-fp32.json" \
    "$work/verify-alexnet-fp16.json" "$work/verify-r3d-fp32.json"
}

# torch_speed MODEL DTYPE LIMIT
torch_speed() {
  setup_wheel || { stop "set-up failed (see the log)"; return; }
  step "$1 $2 at $3 per layer against cudnn.benchmark" 240 \
    python3 $G/torch_check.py "$work/torch" "$1" --mode speed --dtype "$2" --limits "$3" \
    --max-candidates "$MAX_CANDIDATES"
}

part_wall() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  step "every GPU test of src/backend/cudnn" 90 \
    rust_tests $G/lib-tests backend::cudnn --include-ignored --test-threads=1
  step "a CUDA tuner keeps no measuring backend after a tune (c_abi::tuner)" 15 \
    rust_tests $G/lib-tests --include-ignored --test-threads=1 --exact \
    c_abi::tuner::tests::gpu_tune_leaves_no_measuring_backend
  step "PyTorch's cases for the plan tests" 15 python3 $G/torch_cases.py "$work/torch"
  export MUCUDNN_TORCH_DIR="$work/torch"
  step "plans: undivided, float64, PyTorch, 3-D/1-D, spatial (gpu_cudnn.rs)" 120 \
    rust_tests $G/gpu-tests --include-ignored --nocapture --test-threads=1
  step "teardown on the caller's stream, graph capture (gpu_teardown.rs)" 15 \
    rust_tests $G/gpu-teardown --include-ignored --nocapture --test-threads=1
  # (the_callers_device_stays_current_across_gpus needs two GPUs; the machine has one)
  step "the caller's current context (current_context.rs, one GPU)" 10 \
    rust_tests $G/current-context --include-ignored --nocapture --test-threads=1 \
    --skip the_callers_device_stays_current_across_gpus
}

part_wall_engines() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  step "graph-API engines (gpu_engines.rs)" 260 \
    rust_tests $G/gpu-engines --include-ignored --nocapture --test-threads=1
}

part_tune_legacy() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  # Like with like: legacy algorithms against the legacy-only H100 fixture, as a report (it
  # was measured by other code at another offset, maybe on another card).
  step "tune AlexNet fp32, legacy algorithms" 110 \
    $G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw \
    --workspace-limit 64MiB --device cuda --candidates legacy \
    --save-profile "$work/alexnet-fp32-legacy.json" --cache "$work/cache.sqlite"
  step "report: legacy best times against the legacy H100 fixture" 10 \
    python3 $G/compare_profile.py "$work/alexnet-fp32-legacy.json" $G/h100-alexnet-profile.json
  step "tune --verify AlexNet fp32 (legacy + engines)" 150 \
    $G/mucudnn tune --model alexnet --batch 256 --dtype fp32 --layout nchw \
    --workspace-limit 64MiB --device cuda --candidates all --max-candidates "$MAX_CANDIDATES" \
    --cache "$work/cache.sqlite" --verify
}

part_tune_fp16() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  step "tune --verify AlexNet fp16 NHWC (legacy + engines)" 260 \
    $G/mucudnn tune --model alexnet --batch 256 --dtype fp16 --layout nhwc \
    --workspace-limit 64MiB --device cuda --candidates all --max-candidates "$MAX_CANDIDATES" \
    --cache "$work/cache.sqlite" --verify
}

# engines WHAT: engines against PyTorch timed in the same run (never against the fixture).
engines() {
  setup_binaries || { stop "set-up failed (see the log)"; return; }
  step "$1: plans against cudnn.benchmark" 260 \
    env G=$G OUT="$work/engines" bash $G/engines_vs_torch.sh "$1"
}

# bench SCRIPT PARTS LIMIT [ARGS...]: one benchmark of nd_bench.py / spatial_bench.py, one
# workload, one limit.
bench() {
  local script=$1 workload=$2 limit=$3
  shift 3
  setup_wheel || { stop "set-up failed (see the log)"; return; }
  step "$workload at $limit per layer against cudnn.benchmark ($script)" 240 \
    python3 "$G/$script" "$work/bench" --parts "$workload" --limits "$limit" \
    --mucudnn $G/mucudnn --max-candidates "$MAX_CANDIDATES" "$@"
}

# part_vae CASES CAP_PER_CASE_S
part_vae() {
  if [ ! -f $G/vae_bench.py ]; then
    step "vae_bench.py is in .gpu" 1 sh -c "echo 'no .gpu/vae_bench.py (build.sh ships vae_bench.py when the repository has it)'; exit 1"
    return
  fi
  setup_wheel || { stop "set-up failed (see the log)"; return; }
  step "diffusers installs from .gpu/wheels-vae" 30 diffusers_install ||
    { stop "diffusers did not install"; return; }
  step "diffusers VAE decode ($1) against cudnn.benchmark (vae_bench.py)" 210 \
    python3 $G/vae_bench.py "$work/vae" --cases "$1" --cap-s "$2"
}

part_c_abi() {
  info_step "nvidia-smi" 5 gpu_info
  step "C and PyTorch ctypes clients" 150 env OUT="$work/c-abi" bash $G/c_abi_check.sh run
}

part_candle() {
  if [ -f $G/candle/NOT-BUILT ]; then
    step "candle was built" 1 sh -c "cat $G/candle/NOT-BUILT; exit 1"
  else
    step "candle on CUDA" 280 env OUT="$work/candle" bash $G/candle_check.sh run
  fi
}

part_train() {
  if [ -f $G/candle_ddp/NOT-BUILT ]; then
    step "the candle trainer was built" 1 sh -c "cat $G/candle_ddp/NOT-BUILT; exit 1"
  else
    step "candle trainer: mucudnn against candle's conv2d, NCCL against host sums" 280 \
      env OUT="$work/train" bash $G/candle_ddp_check.sh run
  fi
}

run_part() {
  case "$1" in
    first-contact) part_first_contact ;;
    verify) part_verify ;;
    torch) part_torch ;;
    torch-resnet50) part_torch_resnet50 ;;
    torch-speed-resnet50-fp16) torch_speed resnet50 fp16 64MiB ;;
    torch-speed-resnet50-fp32) torch_speed resnet50 fp32 256MiB ;;
    torch-speed-alexnet-fp32) torch_speed alexnet fp32 256MiB ;;
    wall) part_wall ;;
    wall-engines) part_wall_engines ;;
    tune-legacy) part_tune_legacy ;;
    tune-fp16) part_tune_fp16 ;;
    engines-alexnet) engines alexnet ;;
    engines-resnet50) engines resnet50 ;;
    engines-tuning) engines tuning ;;
    nd-vae) bench nd_bench.py vae 1GiB ;;
    nd-r3d) bench nd_bench.py r3d 1GiB ;;
    spatial-sdxl) bench spatial_bench.py sdxl 256MiB ;;
    spatial-wan) bench spatial_bench.py wan 256MiB ;;
    vae-wan) part_vae wan 190 ;;
    vae-sdxl) part_vae sdxl1024,sdxl2048 95 ;;
    c-abi) part_c_abi ;;
    candle) part_candle ;;
    train) part_train ;;
    *)
      echo "part $1 has no steps" >&2
      return 2
      ;;
  esac
}

# ------------------------------------------------------------------------------------------
# --steps PART: each step's name, cap and command, tab-separated (nothing runs).

if [ "$mode" = steps ]; then
  work=$(mktemp -d)
  steps=/dev/stdout
  run_part "$part"
  rm -rf "$work"
  exit 0
fi

# The parts the window may reach, in priority order: first-contact, then those build.sh built
# .gpu for (.gpu/parts.txt).
window_parts() {
  local name
  echo first-contact
  [ -f $G/parts.txt ] || return 0
  while IFS='|' read -r name _; do
    [ "$name" != first-contact ] && grep -qx "$name" $G/parts.txt && echo "$name"
  done <<< "$PARTS"
}

# part_caps PART: the sum of the part's step caps, in seconds.
part_caps() {
  bash "$G/accept.sh" --steps "$1" | awk -F'\t' '{ s += $2 } END { print s + 0 }'
}

# Seconds the window keeps after each part for its summary, as check_part.py does per part.
SUMMARY_S=10

# ------------------------------------------------------------------------------------------
# --check: on the build machine, no GPU.

if [ "$mode" = check ]; then
  [ -f $G/libs.sh ] || { echo "no $G/libs.sh: run scripts/gpu/build.sh" >&2; exit 1; }
  failed=0
  if [ "$window" = yes ]; then
    [ -f $G/parts.txt ] || {
      echo "no $G/parts.txt (the parts .gpu was built for): run scripts/gpu/build.sh" >&2
      exit 1
    }
    names=$(window_parts)
    python3 $G/summary.py check-passed $G/passed.json || failed=1
  else
    names=$part
    [ -n "$names" ] || names=$(cut -d'|' -f1 <<< "$PARTS")
  fi
  for name in $names; do
    work=$(mktemp -d)
    steps="$work/steps.tsv"
    : > "$steps"
    run_part "$name"
    needs=$(grep "^$name|" <<< "$PARTS" | cut -d'|' -f3)
    minutes=$(grep "^$name|" <<< "$PARTS" | cut -d'|' -f2)
    python3 $G/check_part.py "$name" "$minutes" "$needs" "$steps" || failed=1
    if [ "$window" = yes ]; then
      caps=$(awk -F'\t' '{ s += $2 } END { print s + 0 }' "$steps")
      if [ $((caps + SUMMARY_S)) -gt "$budget" ]; then
        echo "  $name: its caps ($caps s) and summary ($SUMMARY_S s) exceed the window's $budget s"
        failed=1
      fi
    fi
    rm -rf "$work"
  done
  if [ "$window" = yes ]; then
    echo "window: $(wc -w <<< "$names") parts it may reach in $budget s:" $names
    echo "window: $([ "$failed" -eq 0 ] && echo ok || echo INCOMPLETE)"
  fi
  exit "$failed"
fi

# ------------------------------------------------------------------------------------------
# Running a part, or a window of parts.

# run_one PART LOG: PART's steps, their output appended to LOG, recorded in $work/steps.tsv
# (work=/tmp/mucudnn-accept/PART). Run it in a subshell: a part's exports stay in it.
run_one() {
  part=$1
  log=$2
  work=/tmp/mucudnn-accept/$part
  rm -rf "$work"
  mkdir -p "$work"
  steps="$work/steps.tsv"
  : > "$steps"
  echo "######## part $part, $(date -u +%FT%TZ)" >> "$log"
  # One cuDNN for every step (LD_LIBRARY_PATH), and one_cudnn_check.
  OUT="$work" source $G/libs.sh
  export -f one_cudnn_check package_check
  # mucudnn's runtime links (python/mucudnn/_lib.py) in a folder of this part.
  export work XDG_CACHE_HOME="$work/xdg"
  run_part "$part"
}

# What a part's files leave out of its reports (installed packages, caches, links).
FILES_EXCLUDED=(--exclude=site --exclude=xdg --exclude=lib-links --exclude='*.sqlite')

OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"

if [ "$window" = no ]; then
  log="$OUT/$part.log"
  : > "$log"
  started=$(date +%s)
  (run_one "$part" "$log")
  work=/tmp/mucudnn-accept/$part
  tar -czf "$OUT/$part-files.tar.gz" -C "$work" "${FILES_EXCLUDED[@]}" . 2>> "$log"
  python3 $G/summary.py part "$part" "$work" "$log" 0 "$(($(date +%s) - started))" \
    "$OUT/$part.json"
  exit $?
fi

# The window: each part's summary into window.json and window.txt as it finishes (a part
# about to run is recorded as running), its output into window.log as it runs, its reports
# appended to window-files.tar: four files, what the device tool brings back at most 8 of.
rm -f "$OUT"/window.json "$OUT"/window.txt "$OUT"/window.log "$OUT"/window-files.tar
: > "$OUT/window.log"
W="$OUT/window.json"
python3 $G/summary.py window-start "$W" "$budget" || exit 1
[ -f $G/parts.txt ] ||
  echo "warning: no $G/parts.txt (the parts .gpu was built for): first-contact alone" |
  tee -a "$OUT/window.log"
window_started=$(date +%s)
gpu_name=""
stopped=""
for name in $(window_parts); do
  if [ -n "$stopped" ]; then
    python3 $G/summary.py window-note "$W" "$name" "not run: $stopped"
    continue
  fi
  if [ "$name" != first-contact ] && [ -n "$gpu_name" ] &&
    passed=$(python3 $G/summary.py passed $G/passed.json "$gpu_name" "$name"); then
    python3 $G/summary.py window-note "$W" "$name" "skipped: passed on $gpu_name ($passed)"
    continue
  fi
  caps=$(part_caps "$name")
  left=$((budget - ($(date +%s) - window_started)))
  if [ $((caps + SUMMARY_S)) -gt "$left" ]; then
    stopped="the window's time: ${left} s left, $name needs its caps ($caps s) and $SUMMARY_S s"
    python3 $G/summary.py window-note "$W" "$name" "not run: $stopped"
    continue
  fi
  python3 $G/summary.py window-note "$W" "$name" "running"
  offset=$(stat -c %s "$OUT/window.log")
  part_started=$(date +%s)
  (run_one "$name" "$OUT/window.log")
  work=/tmp/mucudnn-accept/$name
  python3 $G/summary.py part "$name" "$work" "$OUT/window.log" "$offset" \
    "$(($(date +%s) - part_started))" "$work/summary.json" > /dev/null
  python3 $G/summary.py window-add "$W" "$work/summary.json" "$caps"
  python3 $G/summary.py window-files "$W" "$OUT/window-files.tar" "$work" "$name" \
    "${FILES_EXCLUDED[@]}"
  python3 $G/summary.py window-log "$OUT/window.log"
  if [ "$name" = first-contact ] && [ -s "$work/gpu.txt" ]; then
    gpu_name=$(cut -d, -f1 "$work/gpu.txt" | head -n 1)
  fi
done
python3 $G/summary.py window-end "$W" "$(($(date +%s) - window_started))"

#!/usr/bin/env bash
# Builds, here (no GPU needed), everything the GPU checks run, into .gpu/ (ignored by git
# through .git/info/exclude). Then run the device tool, one call each, carry [".gpu"]:
#   bash .gpu/check.sh                    backend, plans vs PyTorch, graph-API engines,
#                                         tune/verify, profile check
#   bash scripts/gpu/c_abi_check.sh run   the C ABI clients (C and PyTorch ctypes)
#   bash .gpu/engines_vs_torch.sh         issue 8: executed plans (legacy + engines) vs PyTorch
#   bash .gpu/torch_check.sh              issue 15: the PyTorch package (pytest incl. CUDA
#                                         tests, converted AlexNet/ResNet-50 vs PyTorch)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu
# (git rev-parse: in a worktree .git is a file; the exclude file is the common one)
exclude=$(git rev-parse --git-path info/exclude)
# A clone made without git's templates has no .git/info (issue 17, fix 8).
mkdir -p "$(dirname "$exclude")"
grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
cargo build --release --locked
exe() { # the test executable of a cargo target, from cargo's JSON messages
  cargo test --release --locked --no-run --message-format=json "$@" 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1
}
cp target/release/mucudnn .gpu/mucudnn
cp "$(exe --lib)" .gpu/lib-tests
cp "$(exe --test gpu_cudnn)" .gpu/gpu-tests
cp "$(exe --test gpu_engines)" .gpu/gpu-engines
cp scripts/gpu/check.sh scripts/gpu/torch_cases.py scripts/gpu/compare_profile.py .gpu/
cp scripts/gpu/engines_vs_torch.sh scripts/gpu/torch_bench.py .gpu/
cp tests/fixtures/h100-alexnet-profile.json .gpu/
bash scripts/gpu/c_abi_check.sh build
du -sh .gpu
# The PyTorch package (issue 15): the package with its library, and its tests.
cargo rustc --release --locked -p mucudnn --lib --crate-type cdylib --no-default-features \
  -- -C 'link-arg=-Wl,-rpath,$ORIGIN'
rm -rf .gpu/python && mkdir -p .gpu/python
cp -r python/mucudnn .gpu/python/
cp target/release/libmucudnn.so .gpu/python/mucudnn/
cp scripts/gpu/torch_check.sh scripts/gpu/torch_check.py .gpu/
du -sh .gpu

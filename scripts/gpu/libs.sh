# Sourced on the GPU machine by scripts/gpu/accept.sh: makes ONE libcudnn, and the cuBLASLt and
# NCCL it needs, loadable by the names cudarc and mucudnn dlopen, and records what was found in
# "$OUT/libraries.txt". Needs OUT set.
#
# The machine has two cuDNN builds: the system's (9.14, /lib/x86_64-linux-gnu, what a plain
# dlopen of libcudnn.so finds) and PyTorch's wheel (9.19, only libcudnn.so.9 and its
# sub-libraries). Putting the wheel's folder on LD_LIBRARY_PATH alone mixes them: libcudnn.so
# resolves to the system's 9.14, whose sub-libraries (libcudnn_graph.so.9, ...) then resolve
# to the wheel's 9.19. So cuDNN is PyTorch's (the cuDNN the H100 fixtures were measured with,
# and the one the PyTorch baseline runs), whole: links by every name in $OUT/lib-links, that
# folder and the wheel's folder first on LD_LIBRARY_PATH. Only where PyTorch has no cuDNN is
# the system's used. cuBLASLt: the library mucudnn's cuDNN gate loads, libcublasLt.so.MAJOR for
# the CUDA major PyTorch was built with (13 for cu130), never any other libcublas (a system
# CUDA 12 copy would satisfy a looser check and hide the one cuDNN needs); the system's where
# the loader knows that exact name, else PyTorch's wheel. NCCL likewise. `one_cudnn_check`
# (below) proves that one libcudnn and that cuBLASLt load.
# PyTorch's site-packages and the CUDA major it was built with (one interpreter start).
torch_info=$(python3 -c 'import os, torch
print(os.path.dirname(os.path.dirname(torch.__file__)))
print((torch.version.cuda or "13").split(".")[0])' 2>/dev/null) || torch_info=""
site=$(sed -n 1p <<< "$torch_info")
cuda_major=$(sed -n 2p <<< "$torch_info")
[ -n "$site" ] || site=/opt/torch/.venv/lib/python3.12/site-packages
[ -n "$cuda_major" ] || cuda_major=13
links="$OUT/lib-links"
mkdir -p "$links"
: > "$OUT/libraries.txt"
prepend=""
torch_cudnn=$(ls -d "$site"/nvidia/cudnn/lib 2>/dev/null | head -n 1)
if [ -n "$torch_cudnn" ] && [ -e "$torch_cudnn/libcudnn.so.9" ]; then
  ln -sf "$torch_cudnn/libcudnn.so.9" "$links/libcudnn.so"
  prepend="$links:$torch_cudnn"
  echo "libcudnn: $torch_cudnn/libcudnn.so.9 (PyTorch's wheel, linked as $links/libcudnn.so)" \
    >> "$OUT/libraries.txt"
else
  echo "libcudnn: the system's ($(ldconfig -p 2>/dev/null | grep -m 1 'libcudnn.so.9 ' |
    sed 's/.*=> //'))" >> "$OUT/libraries.txt"
fi
# The cuBLASLt of PyTorch's CUDA major, which its cuDNN wheel (and mucudnn's gate) needs.
export MUCUDNN_CUBLASLT="libcublasLt.so.$cuda_major"
for spec in "$MUCUDNN_CUBLASLT" "libnccl.so.2 libnccl.so"; do
  set -- $spec
  plain=$1
  pattern=$(printf '%s|' "$@" | sed 's/|$//; s/\./\\./g')
  system=$(ldconfig -p 2>/dev/null | grep -E "^[[:space:]]+($pattern) " | head -n 1 | sed 's/.*=> //')
  if [ -n "$system" ]; then
    echo "$plain: $system (system)" >> "$OUT/libraries.txt"
    continue
  fi
  found=$(find "$site/nvidia" -name "$plain*" 2>/dev/null | sort | head -n 1)
  if [ -n "$found" ]; then
    ln -sf "$found" "$links/$plain"
    prepend="${prepend:+$prepend:}$links:$(dirname "$found")"
    echo "$plain: $found (PyTorch's wheel, linked as $links/$plain)" >> "$OUT/libraries.txt"
  else
    echo "$plain: NOT FOUND" >> "$OUT/libraries.txt"
  fi
done
[ -n "$prepend" ] && export LD_LIBRARY_PATH="$prepend${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >> "$OUT/libraries.txt"

# Loads libcudnn by each name mucudnn, cudarc and cuDNN itself use (libcudnn.so,
# libcudnn.so.9, the sub-libraries) and fails unless every one came from one folder; then the
# cuBLASLt the cuDNN gate needs ($MUCUDNN_CUBLASLT). Prints the version and paths. Exit status
# 0 only when both hold.
one_cudnn_check() {
  python3 - <<'PY'
import ctypes, os, sys
names = ["libcudnn.so", "libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9",
         "libcudnn_cnn.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9"]
loaded = {}
for name in names:
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        print(f"{name}: not loadable: {e}")
        continue
    loaded[name] = lib
version = loaded["libcudnn.so"].cudnnGetVersion() if "libcudnn.so" in loaded else None
paths = sorted({line.split()[-1] for line in open("/proc/self/maps")
                if "libcudnn" in line.split()[-1]})
folders = sorted({os.path.dirname(os.path.realpath(p)) for p in paths})
print(f"cuDNN {version}, loaded from {folders}:")
for p in paths:
    print(f"  {p}")
cublas_lt = os.environ.get("MUCUDNN_CUBLASLT", "libcublasLt.so.13")
try:
    ctypes.CDLL(cublas_lt)
    where = [line.split()[-1] for line in open("/proc/self/maps") if cublas_lt in line]
    print(f"{cublas_lt}: {where[0] if where else '?'}")
    lt_ok = True
except OSError as e:
    print(f"{cublas_lt}: not loadable (the cuDNN gate needs it): {e}")
    lt_ok = False
sys.exit(0 if version and len(folders) == 1 and "libcudnn.so" in loaded and lt_ok else 1)
PY
}

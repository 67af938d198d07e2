# Sourced by the training checks (train_ops_check.sh, train_check.sh) on the GPU machine:
# makes cuBLAS, NCCL and cuDNN loadable by the names cudarc dlopens, and records which ones
# were found in "$OUT/libraries.txt". Needs OUT set.
#
# cudarc dlopens each library by the names it knows (libcublas.so or libcublas.so.13,
# libcudnn.so or libcudnn.so.9); mucudnn opens libnccl itself, as libnccl.so or libnccl.so.2
# (the name pip wheels and Debian's libnccl2 ship). Use the system's where the
# dynamic loader knows one of those names; otherwise take PyTorch's wheel: its folder on
# LD_LIBRARY_PATH (only that folder, so that the system cuDNN stays the one used) and a link
# under the plain name in $OUT/lib-links.
site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
       2>/dev/null || echo /opt/torch/.venv/lib/python3.12/site-packages)
links="$OUT/lib-links"
mkdir -p "$links"
: > "$OUT/libraries.txt"
for spec in "libcublas.so libcublas.so.13" "libnccl.so.2 libnccl.so" "libcudnn.so libcudnn.so.9"; do
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
    export LD_LIBRARY_PATH="$links:$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "$plain: $found (PyTorch's wheel, linked as $links/$plain)" >> "$OUT/libraries.txt"
  else
    echo "$plain: NOT FOUND" >> "$OUT/libraries.txt"
  fi
done
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >> "$OUT/libraries.txt"

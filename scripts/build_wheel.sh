#!/usr/bin/env bash
# The Python package as a wheel that needs no Rust toolchain, and an sdist that builds with
# cargo where no wheel fits:
#
#   bash scripts/build_wheel.sh [OUT_DIR]      (default dist/)
#   bash scripts/build_wheel.sh --tools        only the tools below (scripts/test.sh fetches
#                                              them in the background while cargo compiles)
#
# makes OUT_DIR/mucudnn-<version>-py3-none-manylinux_2_28_x86_64.whl and
# OUT_DIR/mucudnn-<version>.tar.gz. The wheel holds the library core (libmucudnn.so: release,
# --no-default-features, stripped, RUNPATH $ORIGIN as python/setup.py builds it) linked by
# cargo-zigbuild against glibc 2.28's symbols, so it loads on any x86_64 Linux with glibc
# 2.28 or newer; the script checks the symbol versions the library needs (objdump -T), its
# RUNPATH and its libraries, and the tag with auditwheel. The library is pure C ABI (no
# libpython, no libtorch): one wheel serves every Python 3 and torch.
#
# The tools (ziglang, cargo-zigbuild, auditwheel, setuptools, wheel; pinned, from PyPI) are
# installed once into a virtualenv under the test cache folder ($MUCUDNN_TEST_CACHE, else
# $XDG_CACHE_HOME/mucudnn-test, else ~/.cache/mucudnn-test), under a lock. Needs cargo,
# python3 with venv, and binutils (strip, objdump, readelf). Builds in a staging folder of its
# own: two runs at once do not touch each other's files.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lock.sh

tools_only=no
[ "${1:-}" != --tools ] || tools_only=yes
out=${1:-dist}
[ "$tools_only" = yes ] || { mkdir -p "$out" && out=$(cd "$out" && pwd); }
cache=${MUCUDNN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mucudnn-test}
PLATFORM=manylinux_2_28_x86_64
GLIBC_MAX=2.28
ZIG_TARGET=x86_64-unknown-linux-gnu.2.28
PINS=(ziglang==0.17.1 cargo-zigbuild==0.24.1 auditwheel==6.8.2 setuptools==84.2.1 wheel==0.48.0)

tools="$cache/wheel-tools"
stamp="$tools/.ready-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-12)"
make_tools() {
  [ -f "$stamp" ] && return 0 # made by another run while this one waited
  echo "build_wheel: installing ${PINS[*]} into $tools (once)" >&2
  rm -rf "$tools"
  python3 -m venv "$tools" &&
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" &&
    touch "$stamp"
}
[ -f "$stamp" ] || with_lock "$cache/wheel-tools.lock" make_tools
if [ "$tools_only" = yes ]; then
  echo "build_wheel: the tools are in $tools"
  exit 0
fi

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' python/mucudnn/_version.py)
cargo_version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
if [ -z "$version" ] || [ "$version" != "$cargo_version" ]; then
  echo "error: python/mucudnn/_version.py says '$version', Cargo.toml '$cargo_version'" >&2
  exit 1
fi

# 1. The library, linked against glibc 2.28 (zig's libc stubs; cargo-zigbuild finds zig as
#    `python3 -m ziglang` in the tools venv).
PATH="$tools/bin:$PATH" cargo-zigbuild rustc --release --locked -p mucudnn --lib \
  --crate-type cdylib --no-default-features --target "$ZIG_TARGET" \
  -- -C 'link-arg=-Wl,-rpath,$ORIGIN'
built="${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release/libmucudnn.so"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
strip --strip-unneeded -o "$stage/libmucudnn.so" "$built"

# 2. What the library needs from the system: glibc symbols no newer than 2.28, only the
#    libraries every manylinux system has (CUDA and cuDNN are dlopened at run time), and
#    RUNPATH $ORIGIN (python/mucudnn/_lib.py's links to torch's libcudnn sit beside it).
newest=$(objdump -T "$stage/libmucudnn.so" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' |
  sort -V | tail -n 1)
if [ "$(printf '%s\n%s\n' "$newest" "$GLIBC_MAX" | sort -V | tail -n 1)" != "$GLIBC_MAX" ]; then
  echo "error: libmucudnn.so needs glibc $newest, newer than $GLIBC_MAX:" >&2
  objdump -T "$stage/libmucudnn.so" | grep "GLIBC_$newest" >&2
  exit 1
fi
needed=$(readelf -d "$stage/libmucudnn.so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
for lib in $needed; do
  case "$lib" in
    libc.so.6 | libm.so.6 | libgcc_s.so.1 | libpthread.so.0 | libdl.so.2 | librt.so.1 | \
      ld-linux-x86-64.so.2) ;;
    *) echo "error: libmucudnn.so links $lib, which a manylinux system need not have" >&2; exit 1 ;;
  esac
done
if ! readelf -d "$stage/libmucudnn.so" | grep -q 'RUNPATH.*\[\$ORIGIN\]'; then
  echo "error: libmucudnn.so has no RUNPATH \$ORIGIN:" >&2
  readelf -d "$stage/libmucudnn.so" | grep -E 'RPATH|RUNPATH' >&2
  exit 1
fi

# 3. The wheel, from a copy of the package (no build/ or egg-info in python/).
mkdir -p "$stage/package" "$stage/dist"
cp python/pyproject.toml python/setup.py python/README.md "$stage/package/"
cp -r python/mucudnn "$stage/package/"
find "$stage/package" \( -name __pycache__ -o -name 'libmucudnn.so' \) -prune -exec rm -rf {} +
(cd "$stage/package" &&
  MUCUDNN_PREBUILT_LIBRARY="$stage/libmucudnn.so" MUCUDNN_WHEEL_PLATFORM=$PLATFORM \
    "$tools/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation --no-index -w "$stage/dist" .)
wheel="$stage/dist/mucudnn-$version-py3-none-$PLATFORM.whl"
[ -f "$wheel" ] || { echo "error: no $wheel:" >&2; ls "$stage/dist" >&2; exit 1; }

# 4. auditwheel's verdict on the tag the wheel claims.
"$tools/bin/auditwheel" show "$wheel" > "$stage/auditwheel.txt" 2>&1 || {
  cat "$stage/auditwheel.txt" >&2; exit 1; }
tag=$(tr -s ' \n' ' ' < "$stage/auditwheel.txt" |
  sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p')
tag_glibc=$(sed -n 's/^manylinux_\([0-9]*\)_\([0-9]*\)_x86_64$/\1.\2/p' <<<"$tag")
if [ -z "$tag_glibc" ] ||
  [ "$(printf '%s\n%s\n' "$tag_glibc" "$GLIBC_MAX" | sort -V | tail -n 1)" != "$GLIBC_MAX" ]; then
  echo "error: auditwheel does not find the wheel consistent with $PLATFORM:" >&2
  cat "$stage/auditwheel.txt" >&2
  exit 1
fi

# 5. The sdist: the package with the Rust workspace in rust/ (tracked files only), for
#    platforms without a wheel: `pip install mucudnn-<version>.tar.gz` builds with cargo.
mkdir -p "$stage/sdist/rust"
git ls-files -z -- Cargo.toml Cargo.lock cbindgen.toml solver cache src benches tests examples \
  include | tar -c --null -T - -f - | tar -x -C "$stage/sdist/rust" -f -
cp -r "$stage/package/." "$stage/sdist/"
printf 'graft rust\nglobal-exclude __pycache__ *.pyc\n' > "$stage/sdist/MANIFEST.in"
(cd "$stage/sdist" && "$tools/bin/python" setup.py -q sdist -d "$stage/dist" > "$stage/sdist.log" 2>&1) ||
  { cat "$stage/sdist.log" >&2; exit 1; }
sdist="$stage/dist/mucudnn-$version.tar.gz"
[ -f "$sdist" ] || { echo "error: no $sdist" >&2; ls "$stage/dist" >&2; exit 1; }

mv "$wheel" "$sdist" "$out/"
echo "glibc symbols needed: up to $newest; libraries: $needed; auditwheel: $tag"
ls -la "$out/$(basename "$wheel")" "$out/$(basename "$sdist")"

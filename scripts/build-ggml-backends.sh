#!/usr/bin/env bash
# scripts/build-ggml-backends.sh SDIST OUTDIR
#
# ggml with its Vulkan and RPC backends, for apir's host on a GPU or on ggml-rpc servers
# built from the same PyPI sdist as the C reference (libggml-python 0.20.2.post1,
# ggml 0.20.2): so it is the very ggml ABI apir's wheel has. tests/ggml_backends.py calls it
# with OUTDIR = <cache>/ggml-backends/<sdist version> and a file lock; by hand:
#   scripts/build-ggml-backends.sh ~/.cache/apir/cref/sdist/libggml_python-0.20.2.post1.tar.gz \
#       ~/.cache/apir/ggml-backends/0.20.2.post1
# Outputs, named in OUTDIR/paths.env (shell syntax, one KEY=VALUE a line):
#   build/src/libggml-base.so libggml-cpu.so libggml.so, build/src/ggml-vulkan/libggml-vulkan.so,
#       build/src/ggml-rpc/libggml-rpc.so (GGML_BACKEND_DL=OFF: libggml.so's registry holds CPU,
#       Vulkan and RPC; point apir at them with APIR_GGML_LIB_DIR=<build/src>)
#   build/bin/test-backend-ops, build/bin/rpc-server (scripts/rpc-server.c)
#   mesa/: Mesa 25.0.7's lavapipe (bookworm-backports mesa-vulkan-drivers, unpacked), with
#       lvp_icd.json naming the library by absolute path (VK_ICD_FILENAMES)
#   shader-cache/: a persistent MESA_SHADER_CACHE_DIR (made here: Mesa 22.3 turns its cache off
#       when the folder is missing; cold shader compiles dominate test-backend-ops on lavapipe)
#
# Why the pieces (measured): bookworm's libvulkan-dev 1.3.239
# predates VK_EXT_layer_settings, which ggml-vulkan uses; trixie's 1.4.309 headers work and the
# build still links bookworm's 1.3.239 loader. They and Mesa come through a private apt
# configuration under OUTDIR/apt (no change to the machine's sources) and `dpkg -x`. bookworm's
# Mesa 22.3 lavapipe crashes on permuted f32 cases; 25.0.7 passes them.
# Needs (.ci/run installs them): cmake ninja gcc g++ glslc spirv-headers libvulkan-dev (the
# 1.3 loader to link), apt-get and dpkg-deb, and lavapipe's runtime libraries (libllvm15 ...).
# Time: about 6 minutes on 2 idle cores (ggml-vulkan's 288 shader steps dominate). Runs with
# nice -n 10 and -j${APIR_BACKENDS_JOBS:-2}: the machine is shared.
# Idempotent: a re-run reuses the downloads, the unpacked trees and the build dir.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SDIST OUTDIR" >&2
    exit 2
fi
SDIST=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
JOBS=${APIR_BACKENDS_JOBS:-2}
VULKAN_HEADERS_VERSION=1.4.309.0-1   # trixie's libvulkan-dev
MESA_VERSION=25.0.7-2~bpo12+1        # bookworm-backports' mesa-vulkan-drivers
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
BUILD="$OUT/build"

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing tool: $1 (.ci/run installs it)" >&2; exit 1; }; }
for t in tar cmake ninja gcc g++ glslc apt-get dpkg-deb; do need "$t"; done
[ -f /usr/include/spirv/unified1/spirv.hpp ] || { echo "missing spirv-headers (apt-get install spirv-headers)" >&2; exit 1; }

TIMES=()
timed() {  # timed LABEL CMD...
    local label=$1 t0 t1
    shift
    t0=$(date +%s)
    "$@"
    t1=$(date +%s)
    TIMES+=("$(printf '%-28s %5d s' "$label" $((t1 - t0)))")
}

# --- 1. Debian packages through a private apt configuration --------------------------
# apt_get SUITE ARGS...: apt-get with only SUITE as source and its lists under OUTDIR/apt/SUITE.
apt_get() {
    local suite=$1 dir="$OUT/apt/$1"
    shift
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/empty.d"
    echo "deb [signed-by=$KEYRING] http://deb.debian.org/debian $suite main" > "$dir/sources.list"
    apt-get -q -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts="$dir/empty.d" \
        -o Dir::State::lists="$dir/lists" -o Dir::Cache="$dir/cache" \
        -o Dir::Etc::preferencesparts="$dir/empty.d" -o Debug::NoLocking=1 \
        -o APT::Sandbox::User=root "$@"
}
# fetch_deb SUITE PACKAGE VERSION DEST: PACKAGE=VERSION unpacked into DEST (once).
fetch_deb() {
    local suite=$1 pkg=$2 ver=$3 dest=$4 debs="$OUT/debs"
    [ -f "$dest/.unpacked-$pkg-$ver" ] && return 0
    mkdir -p "$debs" "$dest"
    find_deb() {  # the downloaded PACKAGE=VERSION .deb, if any
        local f
        for f in "$debs/${pkg}_"*.deb; do
            [ -f "$f" ] && [ "$(dpkg-deb -f "$f" Version)" = "$ver" ] && { echo "$f"; return 0; }
        done
        return 0
    }
    local deb
    deb=$(find_deb)
    if [ -z "$deb" ]; then
        apt_get "$suite" update >/dev/null
        (cd "$debs" && apt_get "$suite" download "$pkg=$ver" >/dev/null)
        deb=$(find_deb)
        [ -n "$deb" ] || { echo "apt-get download $pkg=$ver ($suite) gave no .deb" >&2; exit 1; }
    fi
    dpkg-deb -x "$deb" "$dest"
    touch "$dest/.unpacked-$pkg-$ver"
}
timed "vulkan headers (trixie)" fetch_deb trixie libvulkan-dev "$VULKAN_HEADERS_VERSION" "$OUT/vulkan-headers"
timed "mesa lavapipe (backports)" fetch_deb bookworm-backports mesa-vulkan-drivers "$MESA_VERSION" "$OUT/mesa"
# lavapipe's ICD file names the library without a folder; the loader would search the system's.
LVP_LIB="$OUT/mesa/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"
[ -f "$LVP_LIB" ] || { echo "no $LVP_LIB in mesa-vulkan-drivers $MESA_VERSION" >&2; exit 1; }
LVP_ICD="$OUT/mesa/lvp_icd.json"
printf '{\n    "file_format_version": "1.0.0",\n    "ICD": {"library_path": "%s", "api_version": "1.4.305"}\n}\n' \
    "$LVP_LIB" > "$LVP_ICD"
mkdir -p "$OUT/shader-cache"

# --- 2. ggml from the sdist -----------------------------------------------------------
SRC="$OUT/src"
SUM=$(sha256sum "$SDIST" | cut -c1-16)
extract() {
    [ -f "$SRC/.extracted-$SUM" ] && return 0
    rm -rf "$SRC" "$BUILD"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1
    touch "$SRC/.extracted-$SUM"
}
timed "extract sdist" extract
GGML="$SRC/ggml"
[ -f "$GGML/src/ggml-vulkan/CMakeLists.txt" ] || { echo "no ggml/src/ggml-vulkan in $SDIST" >&2; exit 1; }

configure() {
    cmake -S "$GGML" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON \
        -DGGML_BACKEND_DL=OFF \
        -DGGML_NATIVE=OFF \
        -DGGML_OPENMP=OFF \
        -DGGML_CCACHE=OFF \
        -DGGML_VULKAN=ON \
        -DGGML_RPC=ON \
        -DGGML_RPC_RDMA=OFF \
        -DGGML_BUILD_TESTS=ON \
        -DGGML_BUILD_EXAMPLES=OFF \
        -DVulkan_INCLUDE_DIR="$OUT/vulkan-headers/usr/include" \
        > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log" >&2; exit 1; }
}
mkdir -p "$BUILD"
timed "cmake configure" configure

build() {
    nice -n 10 ninja -C "$BUILD" -j "$JOBS" "$@" > "$OUT/ninja-$1.log" 2>&1 || { tail -60 "$OUT/ninja-$1.log" >&2; exit 1; }
}
for t in ggml-base ggml-cpu ggml-rpc ggml-vulkan ggml test-backend-ops; do
    timed "ninja $t" build "$t"
done

LIB="$BUILD/src"   # libggml-base, -cpu and libggml; the backends in src/ggml-<name>/
rpc_server() {
    local bin="$BUILD/bin" rpc="$LIB/ggml-rpc"
    nice -n 10 gcc -O2 -Wall -o "$bin/rpc-server.tmp" "$HERE/rpc-server.c" -I"$GGML/include" \
        -L"$LIB" -L"$rpc" -lggml -lggml-base -lggml-rpc -Wl,-rpath,"$LIB" -Wl,-rpath,"$rpc"
    mv "$bin/rpc-server.tmp" "$bin/rpc-server"
}
timed "rpc-server" rpc_server

# --- 3. report --------------------------------------------------------------------------
echo "== build times (wall clock, this run, -j$JOBS) =="
printf '%s\n' "${TIMES[@]}"
BIN="$BUILD/bin"
for f in "$LIB"/libggml-base.so "$LIB"/libggml-cpu.so "$LIB"/libggml.so "$LIB"/ggml-vulkan/libggml-vulkan.so \
        "$LIB"/ggml-rpc/libggml-rpc.so "$BIN"/test-backend-ops "$BIN"/rpc-server; do
    [ -e "$f" ] || { echo "missing output $f" >&2; exit 1; }
done
ENVF="$OUT/paths.env"
{
    echo "GGML_SRC=$GGML"
    echo "GGML_INCLUDE=$GGML/include"
    echo "GGML_LIB_DIR=$LIB"
    echo "TEST_BACKEND_OPS=$BIN/test-backend-ops"
    echo "RPC_SERVER=$BIN/rpc-server"
    echo "LVP_ICD=$LVP_ICD"
    echo "MESA_SHADER_CACHE_DIR=$OUT/shader-cache"
} > "$ENVF.tmp"
mv "$ENVF.tmp" "$ENVF"
echo "== outputs (also in $ENVF) =="
cat "$ENVF"

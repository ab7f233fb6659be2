#!/usr/bin/env bash
# scripts/build-llama-cpp.sh [--extensions] SDIST OUTDIR
#
# llama.cpp with ggml 0.25 from the llama-cpp-python==0.3.36 sdist (vendor/llama.cpp), built
# once for three uses:
#   * the host's ggml 0.25 (CPU): libggml-base.so, libggml-cpu.so, libggml.so in BUILD/bin,
#     headers in ggml/include -- apir loads them through APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR;
#   * the guest: libllama.so and the tools (llama-simple, llama-completion, llama-bench,
#     test-backend-ops) with ggml-virtgpu compiled in (GGML_VIRTGPU=ON, needs libdrm);
#   * the local reference: the same binaries without the shim -- ggml-virtgpu then finds no
#     DRM device and llama.cpp runs on ggml CPU, same build, same kernels.
# Also builds libggml-virtgpu-backend.so (the C host library) for comparison runs.
# Writes OUTDIR/build/paths.env naming everything. tests/llama/build.py downloads the sdist
# (pip download --no-binary :all:, PyPI only) and calls this with OUTDIR =
# <cache>/llama-cpp/0.3.36 under a file lock.
#
# Offline like scripts/build-c-reference.sh (same two work-arounds, in scripts/lib/
# llama-cpp-offline.sh, shared with build-llama-cpp-python.sh): the venus_hw.h ExternalProject
# is replaced with a stub through -DCMAKE_PROJECT_INCLUDE, and when the system's
# drm/virtgpu_drm.h is too old, the one from build-c-reference.sh's compat folder (or
# ziglang's wheel) is used with -isystem.
# Release, GGML_NATIVE=OFF (the CPU variant a host and a guest of one machine share),
# GGML_OPENMP=OFF, shared libs, no curl/openssl, no server.
# About 25 minutes at -j2 on a loaded 2-core machine (llama-common is the bulk).
# Idempotent: a re-run reuses the extracted tree and the ninja build dir.
# Knobs: APIR_LLAMA_JOBS=N (default 2), APIR_LLAMA_TARGETS="t1 t2" (default: all below),
#        APIR_CREF_VIRTGPU_DRM_INCLUDE=/dir, APIR_CREF_ZIGLANG_VERSION (as build-c-reference.sh).
#
# Vulkan variant (llama.cpp on a GPU host): APIR_LLAMA_VULKAN_INCLUDE=DIR (a folder holding
# vulkan/vulkan.h, 1.3.290 or newer: build-ggml-backends.sh's <cache>/vulkan-headers/usr/include)
# builds the same tree a second time into OUTDIR/build-vulkan with GGML_VULKAN=ON as well
# (needs glslc and spirv-headers, as build-ggml-backends.sh): libggml-vulkan.so for the host's
# ggml 0.25, and tools that run on llama.cpp's own Vulkan device locally (-dev Vulkan0) or on
# the virtgpu device through apir (-dev Virtgpu... or GGML_VK_VISIBLE_DEVICES=""). Its
# paths.env adds LIBGGML_VULKAN. tests/llama/build.py build_vulkan() drives it.
#
# Extended C guest variant (--extensions, or APIR_LLAMA_EXTENSIONS=1): patches/
# ggml-virtgpu-extensions.patch (apir's extensions in ggml-virtgpu, docs/llama.md) applied to a
# copy of the tree, OUTDIR/src-extensions (hard links but for ggml-virtgpu, so the unpatched
# tree stays as is), built into OUTDIR/build-extensions. Only libggml-virtgpu (and the
# libggml-base it links) by default, a minute or two: the main build's tools and libllama load
# it when its bin folder (GGML_LIB_DIR of build-extensions/paths.env) comes first in
# LD_LIBRARY_PATH (the main build's rpath is a RUNPATH). APIR_LLAMA_TARGETS builds more.
set -euo pipefail

EXTENSIONS=${APIR_LLAMA_EXTENSIONS:-}
if [ "${1:-}" = "--extensions" ]; then
    EXTENSIONS=1
    shift
fi
if [ $# -ne 2 ]; then
    echo "usage: $0 [--extensions] SDIST.tar.gz OUTDIR" >&2
    exit 2
fi
SDIST=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
JOBS=${APIR_LLAMA_JOBS:-2}
BUILD="$OUT/build"
VULKAN_INCLUDE=${APIR_LLAMA_VULKAN_INCLUDE:-}
if [ -n "$VULKAN_INCLUDE" ]; then
    VULKAN_INCLUDE=$(realpath "$VULKAN_INCLUDE")
    [ -f "$VULKAN_INCLUDE/vulkan/vulkan.h" ] || { echo "no vulkan/vulkan.h in $VULKAN_INCLUDE" >&2; exit 1; }
    command -v glslc >/dev/null 2>&1 || { echo "missing tool: glslc (apt-get install glslc)" >&2; exit 1; }
    BUILD="$OUT/build-vulkan"
fi
# host libraries first, so the host side can be used while the tools still compile
TARGETS=${APIR_LLAMA_TARGETS:-"ggml-base ggml-cpu ggml ggml-virtgpu ggml-virtgpu-backend llama llama-simple llama-common test-backend-ops llama-bench llama-completion"}
# the Vulkan variant: the host's ggml (with ggml-vulkan) and the tools a GPU benchmark runs
if [ -n "$VULKAN_INCLUDE" ]; then
    TARGETS=${APIR_LLAMA_TARGETS:-"ggml-base ggml-cpu ggml-vulkan ggml ggml-virtgpu llama llama-simple llama-common llama-bench"}
fi

# shellcheck source=scripts/lib/llama-cpp-offline.sh
. "$(dirname "$(realpath "$0")")/lib/llama-cpp-offline.sh"

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing tool: $1" >&2; exit 1; }; }
for t in tar cmake ninja gcc g++ python3 pkg-config; do need "$t"; done
pkg-config --exists libdrm || { echo "libdrm (pkg-config libdrm) not found: apt-get install libdrm-dev" >&2; exit 1; }

# --- 1. extract (once per sdist content) ----------------------------------------
SRC="$OUT/src"
SUM=$(sha256sum "$SDIST" | cut -c1-16)
if [ ! -f "$SRC/.extracted-$SUM" ]; then
    rm -rf "$SRC" "$OUT/build" "$OUT/build-vulkan" "$OUT/build-extensions" "$OUT/src-extensions"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1
    touch "$SRC/.extracted-$SUM"
fi
LLAMA="$SRC/vendor/llama.cpp"
GGML="$LLAMA/ggml"
[ -f "$GGML/src/ggml-virtgpu/CMakeLists.txt" ] || { echo "no vendor/llama.cpp/ggml/src/ggml-virtgpu in $SDIST" >&2; exit 1; }

# --- 1b. the extended C guest: a patched copy of the tree --------------------------------
if [ -n "$EXTENSIONS" ]; then
    [ -z "$VULKAN_INCLUDE" ] || { echo "--extensions and APIR_LLAMA_VULKAN_INCLUDE: one at a time" >&2; exit 2; }
    need patch
    PATCH=$(dirname "$(realpath "$0")")/../patches/ggml-virtgpu-extensions.patch
    PATCH_SUM=$(sha256sum "$PATCH" | cut -c1-16)
    EXT_LLAMA="$OUT/src-extensions/llama.cpp"
    if [ ! -f "$EXT_LLAMA/.patched-$PATCH_SUM" ]; then
        rm -rf "$OUT/src-extensions"
        mkdir -p "$OUT/src-extensions"
        cp -al "$LLAMA" "$EXT_LLAMA"
        # a real copy of what the patch changes (patching through a hard link would change the
        # original), with new times, so that ninja rebuilds it after a change of the patch
        rm -rf "$EXT_LLAMA/ggml/src/ggml-virtgpu"
        cp -r "$LLAMA/ggml/src/ggml-virtgpu" "$EXT_LLAMA/ggml/src/"
        patch -p1 --forward --quiet -d "$EXT_LLAMA" < "$PATCH"
        touch "$EXT_LLAMA/.patched-$PATCH_SUM"
    fi
    LLAMA=$EXT_LLAMA
    GGML="$LLAMA/ggml"
    BUILD="$OUT/build-extensions"
    TARGETS=${APIR_LLAMA_TARGETS:-"ggml-virtgpu"}
fi

# --- 2./3. the venus_hw.h download -> stub, and a virtgpu_drm.h new enough (scripts/lib) ----
OFFLINE_CMAKE=$(llama_offline_venus_cmake "$OUT/cmake")
COMPAT=$(llama_virtgpu_drm_compat "$OUT")

# --- 4. configure ---------------------------------------------------------------------
CXXFLAGS_EXTRA=""
[ -n "$COMPAT" ] && CXXFLAGS_EXTRA="-isystem $COMPAT"
VULKAN_ARGS=(-DGGML_VULKAN=OFF)
if [ -n "$VULKAN_INCLUDE" ]; then
    VULKAN_ARGS=(-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR="$VULKAN_INCLUDE")
fi
mkdir -p "$BUILD"
if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$LLAMA" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON \
        -DGGML_BACKEND_DL=OFF \
        -DGGML_NATIVE=OFF \
        -DGGML_OPENMP=OFF \
        -DGGML_CCACHE=OFF \
        -DGGML_VIRTGPU=ON \
        -DGGML_VIRTGPU_BACKEND=ON \
        "${VULKAN_ARGS[@]}" \
        -DLLAMA_BUILD_TESTS=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DCMAKE_PROJECT_INCLUDE="$OFFLINE_CMAKE" \
        -DCMAKE_CXX_FLAGS="$CXXFLAGS_EXTRA" \
        > "$BUILD.configure.log" 2>&1 || { tail -40 "$BUILD.configure.log" >&2; rm -f "$BUILD/build.ninja"; exit 1; }
fi

# --- 5. build the targets one at a time (a log per target) ------------------------------
for t in $TARGETS; do
    echo "ninja $t ($(date -u +%T))"
    nice -n 10 ninja -C "$BUILD" -j "$JOBS" "$t" > "$BUILD.ninja-$t.log" 2>&1 \
        || { tail -60 "$BUILD.ninja-$t.log" >&2; exit 1; }
done

# --- 6. paths.env ---------------------------------------------------------------------
{
    echo "LLAMA_SRC=$LLAMA"
    echo "GGML_SRC=$GGML"
    echo "GGML_BUILD=$BUILD"
    echo "GGML_LIB_DIR=$BUILD/bin"
    echo "GGML_INCLUDE=$GGML/include"
    echo "LLAMA_INCLUDE=$LLAMA/include"
    echo "VIRTGPU_DRM_INCLUDE=$COMPAT"
    # only what this build made (the Vulkan variant skips some tools)
    for lib in ggml-base ggml-cpu ggml ggml-vulkan ggml-virtgpu ggml-virtgpu-backend llama; do
        var=LIB$(echo "$lib" | tr 'a-z-' 'A-Z_')
        if [ -e "$BUILD/bin/lib$lib.so" ]; then echo "$var=$BUILD/bin/lib$lib.so"; fi
    done
    for tool in llama-simple llama-completion llama-bench test-backend-ops; do
        var=$(echo "$tool" | tr 'a-z-' 'A-Z_')
        if [ -e "$BUILD/bin/$tool" ]; then echo "$var=$BUILD/bin/$tool"; fi
    done
} > "$BUILD/paths.env"
echo "== outputs ($BUILD/paths.env) =="
cat "$BUILD/paths.env"

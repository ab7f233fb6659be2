# shellcheck shell=bash
# Sourced by scripts/build-llama-cpp.sh and scripts/build-llama-cpp-python.sh: the two
# work-arounds that let ggml-virtgpu of the llama-cpp-python==0.3.36 sdist build offline and on
# Debian 12 (see scripts/build-c-reference.sh, which has the same two for ggml 0.20).

# llama_offline_venus_cmake DIR: writes DIR/offline-venus-hw.cmake and prints its path. Given
# with -DCMAKE_PROJECT_INCLUDE, it replaces ggml-virtgpu's venus_hw.h download (an
# ExternalProject from gitlab.freedesktop.org) with a stub header: ggml-virtgpu uses nothing
# from it.
llama_offline_venus_cmake() {
    mkdir -p "$1"
    cat > "$1/offline-venus-hw.cmake.new" <<'CMAKE'
# Injected with -DCMAKE_PROJECT_INCLUDE; ExternalProject has include_guard(GLOBAL), so the
# include(ExternalProject) in ggml-virtgpu/CMakeLists.txt does not undo this override.
include_guard(GLOBAL)
include(ExternalProject)
function(ExternalProject_Add name)
    if(name STREQUAL "venus_hw_header")
        cmake_parse_arguments(EP "" "DOWNLOAD_DIR;DOWNLOAD_NAME" "" ${ARGN})
        set(hdr "${EP_DOWNLOAD_DIR}/${EP_DOWNLOAD_NAME}")
        if(NOT EXISTS "${hdr}")
            file(WRITE "${hdr}" "/* offline stub (scripts/lib/llama-cpp-offline.sh): ggml-virtgpu uses nothing from venus_hw.h */\n#pragma once\n#include <stdint.h>\n")
        endif()
        add_custom_target(venus_hw_header)
    else()
        _ExternalProject_Add(${name} ${ARGN})
    endif()
endfunction()
CMAKE
    # replaced only when it changed: a newer file makes every build tree using it reconfigure
    if cmp -s "$1/offline-venus-hw.cmake.new" "$1/offline-venus-hw.cmake"; then
        rm "$1/offline-venus-hw.cmake.new"
    else
        mv "$1/offline-venus-hw.cmake.new" "$1/offline-venus-hw.cmake"
    fi
    echo "$1/offline-venus-hw.cmake"
}

# llama_drm_header_ok [CXXFLAGS...]: whether <drm/virtgpu_drm.h> (with those flags) has what
# ggml-virtgpu's frontend uses (context init, blob resources, ring_idx).
llama_drm_header_ok() {
    local probe
    probe=$(mktemp --suffix=.cpp)
    cat > "$probe" <<'CPP'
#include <xf86drm.h>
#include <drm/virtgpu_drm.h>
int main() {
    drm_virtgpu_execbuffer e = {}; e.ring_idx = 0; e.syncobj_stride = 0;
    drm_virtgpu_resource_create_blob b = {}; b.blob_id = VIRTGPU_BLOB_MEM_HOST3D;
    drm_virtgpu_context_init c = {}; c.num_params = VIRTGPU_CONTEXT_PARAM_POLL_RINGS_MASK;
    return (int)(DRM_IOCTL_VIRTGPU_CONTEXT_INIT + e.flags + b.size + c.pad);
}
CPP
    local rc=0
    # shellcheck disable=SC2046
    g++ -std=c++20 -fsyntax-only "$@" $(pkg-config --cflags libdrm) "$probe" 2>/dev/null || rc=1
    rm -f "$probe"
    return $rc
}

# llama_virtgpu_drm_compat OUT: prints a folder to pass with -isystem when the system's
# drm/virtgpu_drm.h is too old (Debian 12), or nothing when it is new enough. The folder is
# $APIR_CREF_VIRTGPU_DRM_INCLUDE if set, else OUT/compat-include with the kernel UAPI header
# taken from ziglang's wheel ($APIR_CREF_ZIGLANG_VERSION, default 0.16.0; pip, PyPI only).
llama_virtgpu_drm_compat() {
    local out=$1 compat whl zig=${APIR_CREF_ZIGLANG_VERSION:-0.16.0}
    if [ -n "${APIR_CREF_VIRTGPU_DRM_INCLUDE:-}" ]; then
        compat=$(realpath "$APIR_CREF_VIRTGPU_DRM_INCLUDE")
    elif llama_drm_header_ok; then
        return 0
    else
        compat="$out/compat-include"
        if ! { [ -f "$compat/drm/virtgpu_drm.h" ] && llama_drm_header_ok -isystem "$compat"; }; then
            mkdir -p "$out/downloads" "$compat/drm"
            whl=$(ls "$out/downloads"/ziglang-"$zig"-*.whl 2>/dev/null | head -1 || true)
            if [ -z "$whl" ]; then
                python3 -m pip download --quiet --no-deps --only-binary=:all: "ziglang==$zig" -d "$out/downloads" >&2
                whl=$(ls "$out/downloads"/ziglang-"$zig"-*.whl | head -1)
            fi
            python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read(
                "ziglang/lib/libc/include/any-linux-any/drm/virtgpu_drm.h"))' "$whl" "$compat/drm/virtgpu_drm.h"
        fi
    fi
    llama_drm_header_ok -isystem "$compat" || { echo "$compat/drm/virtgpu_drm.h does not compile" >&2; return 1; }
    echo "$compat"
}

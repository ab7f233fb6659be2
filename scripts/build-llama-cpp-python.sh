#!/usr/bin/env bash
# scripts/build-llama-cpp-python.sh SDIST OUTDIR
#
# llama-cpp-python==0.3.36 built from its sdist the way a Python user builds it for a VM's
# virtio-gpu: CMAKE_ARGS="-DGGML_VIRTGPU=ON" and pip, installed into a venv
# of its own (OUTDIR/venv; never the system python). The wheel vendors its own llama.cpp and
# ggml 0.25 (llama_cpp/lib: libllama, libggml-base, libggml-cpu, libggml, libggml-virtgpu).
#
# CMAKE_ARGS adds to -DGGML_VIRTGPU=ON only what this machine needs:
#   * -DCMAKE_INSTALL_LIBDIR=llama_cpp/lib: llama-cpp-python's CMakeLists.txt installs its list
#     of ggml backends next to libllama (llama_cpp/lib, rpath $ORIGIN) but ggml-virtgpu is not
#     in that list; ggml's own install rule then puts libggml-virtgpu.so in <site-packages>/lib,
#     where libggml.so (which links it when GGML_BACKEND_DL=OFF, the default) does not find it
#     and `import llama_cpp` fails. With this, ggml's install rule puts it in llama_cpp/lib too.
#   * -DCMAKE_PROJECT_INCLUDE=<offline venus_hw.h stub> and, on Debian 12, the kernel UAPI
#     drm/virtgpu_drm.h with -isystem (scripts/lib/llama-cpp-offline.sh: the build is offline
#     and the system header is too old).
# Everything else is llama-cpp-python's default (GGML_NATIVE, OpenMP, mtmd included).
#
# Layout of OUTDIR: src/ (the extracted sdist; pip builds in-tree), build/ (scikit-build-core's
# build dir, kept: a re-run rebuilds only what changed), wheels/, venv/, paths.env.
# About 25 minutes at -j2 on a loaded 2-core machine. Idempotent. tests/llama/build_python.py
# calls it with OUTDIR = <cache>/llama-cpp-python/0.3.36 under a file lock, with the sdist
# tests/llama/build.py downloaded.
# Knobs: APIR_LLAMA_JOBS=N (default 2), APIR_CREF_VIRTGPU_DRM_INCLUDE, APIR_CREF_ZIGLANG_VERSION.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SDIST.tar.gz OUTDIR" >&2
    exit 2
fi
SDIST=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
JOBS=${APIR_LLAMA_JOBS:-2}
# shellcheck source=scripts/lib/llama-cpp-offline.sh
. "$(dirname "$(realpath "$0")")/lib/llama-cpp-offline.sh"

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing tool: $1" >&2; exit 1; }; }
for t in tar cmake ninja gcc g++ python3 pkg-config; do need "$t"; done
pkg-config --exists libdrm || { echo "libdrm (pkg-config libdrm) not found: apt-get install libdrm-dev" >&2; exit 1; }

# --- 1. extract (once per sdist content) ----------------------------------------
SRC="$OUT/src"
BUILD="$OUT/build"
SUM=$(sha256sum "$SDIST" | cut -c1-16)
if [ ! -f "$SRC/.extracted-$SUM" ]; then
    rm -rf "$SRC" "$BUILD"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1
    touch "$SRC/.extracted-$SUM"
fi
[ -f "$SRC/vendor/llama.cpp/ggml/src/ggml-virtgpu/CMakeLists.txt" ] || { echo "no ggml-virtgpu in $SDIST" >&2; exit 1; }

# --- 2. the venv, with the build backend (no build isolation: the build dir is reused) --------
VENV="$OUT/venv"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -c 'import scikit_build_core' 2>/dev/null || "$PY" -m pip install --quiet "scikit-build-core[pyproject]>=0.9.2"

# --- 3. CMAKE_ARGS (no spaces inside an argument) ----------------------------------------
OFFLINE_CMAKE=$(llama_offline_venus_cmake "$OUT/cmake")
COMPAT=$(llama_virtgpu_drm_compat "$OUT")
CMAKE_ARGS="-DGGML_VIRTGPU=ON -DCMAKE_INSTALL_LIBDIR=llama_cpp/lib -DCMAKE_PROJECT_INCLUDE=$OFFLINE_CMAKE"
[ -z "$COMPAT" ] || CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_FLAGS=-isystem$COMPAT"
echo "CMAKE_ARGS=$CMAKE_ARGS"

# --- 4. the wheel ---------------------------------------------------------------------------
WHEELS="$OUT/wheels"
mkdir -p "$WHEELS"
echo "pip wheel ($(date -u +%T))"
CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS nice -n 10 \
    "$PY" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$WHEELS" \
        --config-settings=build-dir="$BUILD" "$SRC" > "$OUT/wheel.log" 2>&1 \
    || { tail -60 "$OUT/wheel.log" >&2; exit 1; }
echo "built ($(date -u +%T))"
WHEEL=$(ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl | head -1)

# --- 5. install into the venv (again only when the wheel changed) ---------------------------
WSUM=$(sha256sum "$WHEEL" | cut -c1-16)
if [ ! -f "$VENV/.installed-$WSUM" ]; then
    "$PY" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
    "$PY" -m pip install --quiet "$WHEEL"   # its dependencies (numpy, jinja2, diskcache, ...)
    rm -f "$VENV"/.installed-*
    touch "$VENV/.installed-$WSUM"
fi
LIB_DIR=$("$PY" -c 'import pathlib, llama_cpp; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')
for lib in llama ggml ggml-base ggml-cpu ggml-virtgpu; do
    [ -f "$LIB_DIR/lib$lib.so" ] || { echo "$LIB_DIR/lib$lib.so missing from the wheel" >&2; exit 1; }
done

# --- 6. paths.env ---------------------------------------------------------------------------
{
    echo "PYTHON=$PY"
    echo "WHEEL=$WHEEL"
    echo "LLAMA_CPP_LIB_DIR=$LIB_DIR"
    # the host's ggml: the wheel's own (see docs/llama.md), headers from the same source
    echo "GGML_LIB_DIR=$LIB_DIR"
    echo "GGML_INCLUDE=$SRC/vendor/llama.cpp/ggml/include"
    echo "VIRTGPU_DRM_INCLUDE=$COMPAT"
    for lib in ggml-base ggml-cpu ggml ggml-virtgpu llama; do
        var=LIB$(echo "$lib" | tr 'a-z-' 'A-Z_')
        echo "$var=$LIB_DIR/lib$lib.so"
    done
} > "$OUT/paths.env"
echo "== outputs ($OUT/paths.env) =="
cat "$OUT/paths.env"

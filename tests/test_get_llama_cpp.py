"""scripts/get-llama-cpp.sh, the llama.cpp steps of docs/llama.md (and of tests/llama/build.py
and .ci/run), on a copy beside a stand-in build-llama-cpp.sh and a stand-in `python3` that
logs each pip download: it builds once, then only prints the paths; a failed build says why
and leaves no marker; each argument reaches its tree."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

FAKE_BUILD = """#!/usr/bin/env bash
# stand-in for build-llama-cpp.sh SDIST OUTDIR: logs, fails on demand, writes paths.env
echo "$0 $*" >> "$FAKE_LOG"
[ -z "${FAKE_FAIL:-}" ] || { echo "boom: $FAKE_FAIL"; exit 1; }
BUILD=$2/build; [ -n "${APIR_LLAMA_VULKAN_INCLUDE:-}" ] && BUILD=$2/build-vulkan
[ -n "${APIR_LLAMA_EXTENSIONS:-}" ] && BUILD=$2/build-extensions
case "$(basename "$0")" in *python*) BUILD=$2;; esac
mkdir -p "$BUILD"; echo "LLAMA_SIMPLE=$BUILD/bin/llama-simple" > "$BUILD/paths.env"
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in for python3: `-m pip download ... REQ -d DIR` makes the sdist, logged
echo "python3 $*" >> "$FAKE_LOG"
[ "$1 $2 $3" = "-m pip download" ] || exit 99
dir=${@: -1}; touch "$dir/llama_cpp_python-0.3.36.tar.gz"
"""


@pytest.fixture
def kit(tmp_path):
    """(run(*args, **env) -> CompletedProcess, the cache folder, the call log)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(REPO / "scripts" / "get-llama-cpp.sh", scripts)
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "ggml-virtgpu-extensions.patch").write_text("the patch\n")
    for name, text in (("build-llama-cpp.sh", FAKE_BUILD), ("build-llama-cpp-python.sh", FAKE_BUILD)):
        (scripts / name).write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    cache, log = tmp_path / "cache", tmp_path / "calls.log"
    model = cache / "models" / "smollm2-0.1.2" / GGUF
    model.parent.mkdir(parents=True)
    model.write_text("gguf")  # present: no model download in these tests
    log.write_text("")

    def run(*args, **env):
        full = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", APIR_CACHE_DIR=str(cache),
                    FAKE_LOG=str(log), **env)
        return subprocess.run(["bash", str(scripts / "get-llama-cpp.sh"), *args], capture_output=True,
                              text=True, env=full, timeout=60)

    return run, cache, log


def test_builds_once_then_prints_the_paths(kit):
    run, cache, log = kit
    tree = cache / "llama-cpp" / "0.3.36"
    first = run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [f"LLAMA_SIMPLE={tree}/build/bin/llama-simple", f"MODEL={cache}/models/smollm2-0.1.2/{GGUF}"]
    assert "about 25 minutes" in first.stderr and (tree / ".complete").exists()
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36" in calls[0]
    assert calls[1].endswith(f"build-llama-cpp.sh {cache}/dl/llama_cpp_python-0.3.36.tar.gz {tree}")
    second = run()
    assert second.returncode == 0 and second.stdout == first.stdout and second.stderr == ""
    assert len(log.read_text().splitlines()) == 2  # neither downloaded nor built again


def test_a_failed_build_says_why_and_leaves_no_marker(kit):
    run, cache, log = kit
    done = run(FAKE_FAIL="no compiler")
    assert done.returncode == 1 and done.stdout == ""
    assert "boom: no compiler" in done.stderr and f"log: {cache}/llama-cpp/0.3.36/build.log" in done.stderr
    assert not (cache / "llama-cpp" / "0.3.36" / ".complete").exists()
    assert run().returncode == 0  # the next run builds


def test_vulkan_and_python_build_their_own_trees(kit, tmp_path):
    run, cache, log = kit
    refused = run("vulkan")
    assert refused.returncode == 2 and "APIR_LLAMA_VULKAN_INCLUDE" in refused.stderr
    vk = run("vulkan", APIR_LLAMA_VULKAN_INCLUDE=str(tmp_path))
    assert vk.returncode == 0, vk.stderr
    assert vk.stdout.startswith(f"LLAMA_SIMPLE={cache}/llama-cpp/0.3.36/build-vulkan/bin/llama-simple\n")
    assert (cache / "llama-cpp" / "0.3.36" / ".complete-vulkan").exists()
    assert not (cache / "llama-cpp" / "0.3.36" / ".complete").exists()
    py = run("python")
    assert py.returncode == 0 and (cache / "llama-cpp-python" / "0.3.36" / ".complete").exists()
    assert log.read_text().count("pip download") == 1  # one sdist for all trees


def test_model_only_and_bad_usage(kit):
    run, cache, log = kit
    done = run("model")
    assert done.returncode == 0 and done.stdout == f"MODEL={cache}/models/smollm2-0.1.2/{GGUF}\n"
    assert log.read_text() == ""
    bad = run("gpu")
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_extensions_build_the_cpu_tree_then_the_patched_guest_once_per_patch(kit, tmp_path):
    run, cache, log = kit
    tree = cache / "llama-cpp" / "0.3.36"
    first = run("extensions")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == f"LLAMA_SIMPLE={tree}/build-extensions/bin/llama-simple"
    builds = [c for c in log.read_text().splitlines() if "build-llama-cpp.sh" in c]
    assert len(builds) == 2 and (tree / ".complete").exists()
    assert run("extensions").stdout == first.stdout
    assert len([c for c in log.read_text().splitlines() if "build-llama-cpp.sh" in c]) == 2
    (tmp_path / "patches" / "ggml-virtgpu-extensions.patch").write_text("a changed patch\n")
    assert run("extensions").returncode == 0
    assert len([c for c in log.read_text().splitlines() if "build-llama-cpp.sh" in c]) == 3  # the variant only
    # back to the first patch: its build was replaced in the one build-extensions folder
    (tmp_path / "patches" / "ggml-virtgpu-extensions.patch").write_text("the patch\n")
    assert run("extensions").returncode == 0
    assert len([c for c in log.read_text().splitlines() if "build-llama-cpp.sh" in c]) == 4
    assert len(list(tree.glob(".complete-extensions-*"))) == 1

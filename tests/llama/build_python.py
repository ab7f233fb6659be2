"""llama-cpp-python==0.3.36 built with CMAKE_ARGS="-DGGML_VIRTGPU=ON" into a venv of its own
(scripts/build-llama-cpp-python.sh), cached in the user's cache folder (tests/cref.py's
`user_cache_dir()`):

    <cache>/llama-cpp-python/0.3.36/   the script's tree; paths.env names the venv's python and
                                       the wheel's libraries (llama_cpp/lib)

The sdist is the one tests/llama/build.py downloads (<cache>/dl/, pip, PyPI only). A file lock
keeps two processes from building at once; `.complete` says the build finished. About 25
minutes on 2 busy cores.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Dict

from tests.cref import REPO, read_paths_env, run_build_script, user_cache_dir
from tests.llama.build import LLAMA_CPP_PYTHON, LLAMA_SDIST, LLAMA_VERSION, _download

BUILD_SCRIPT = REPO / "scripts" / "build-llama-cpp-python.sh"


def build_dir() -> Path:
    return user_cache_dir() / "llama-cpp-python" / LLAMA_VERSION


def is_built() -> bool:
    """Whether the build finished (without building)."""
    return (build_dir() / ".complete").exists() and (build_dir() / "paths.env").exists()


def build() -> Dict[str, str]:
    """paths.env of the build as a dict (PYTHON: the venv's interpreter; LLAMA_CPP_LIB_DIR,
    LIBGGML_BASE, LIBGGML_CPU, LIBGGML: the wheel's libraries; GGML_INCLUDE: the sdist's ggml
    headers; VIRTGPU_DRM_INCLUDE); builds it on first use (log: <build_dir>/build.log). Raises
    BuildFailed with the log's end."""
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built():
            sdist = _download(LLAMA_CPP_PYTHON, LLAMA_SDIST, source=True)
            # the script's `python3` (venv, pip download of a header wheel) is this interpreter
            env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
            run_build_script(BUILD_SCRIPT, [sdist, out], out / "build.log", BUILD_SCRIPT.name, env=env)
            (out / ".complete").touch()
    return read_paths_env(out / "paths.env")


if __name__ == "__main__":  # python -m tests.llama.build_python: build (or find) it, print the paths
    for key, value in build().items():
        print(f"{key}={value}")

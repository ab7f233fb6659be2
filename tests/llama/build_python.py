"""llama-cpp-python==0.3.36 built with CMAKE_ARGS="-DGGML_VIRTGPU=ON" into a venv of its own
(scripts/build-llama-cpp-python.sh, run by scripts/get-llama-cpp.sh python: the steps
docs/llama.md gives users), cached in the user's cache folder (tests/cref.py's
`user_cache_dir()`):

    <cache>/llama-cpp-python/0.3.36/   the script's tree; paths.env names the venv's python and
                                       the wheel's libraries (llama_cpp/lib)

The sdist is the one of tests/llama/build.py (<cache>/dl/, pip, PyPI only). A file lock
keeps two processes from building at once; `.complete` says the build finished. About 25
minutes on 2 busy cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from tests.cref import user_cache_dir
from tests.llama.build import LLAMA_VERSION, get


def build_dir() -> Path:
    return user_cache_dir() / "llama-cpp-python" / LLAMA_VERSION


def is_built() -> bool:
    """Whether the build finished (without building)."""
    return (build_dir() / ".complete").exists() and (build_dir() / "paths.env").exists()


def build() -> Dict[str, str]:
    """paths.env of the build as a dict (PYTHON: the venv's interpreter; LLAMA_CPP_LIB_DIR,
    LIBGGML_BASE, LIBGGML_CPU, LIBGGML: the wheel's libraries; GGML_INCLUDE: the sdist's ggml
    headers; VIRTGPU_DRM_INCLUDE), and MODEL; builds it on first use (log:
    <build_dir>/build.log). Raises BuildFailed with the log's end."""
    return get("python")


if __name__ == "__main__":  # python -m tests.llama.build_python: as scripts/get-llama-cpp.sh python
    for key, value in build().items():
        print(f"{key}={value}")

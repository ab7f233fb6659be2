"""ggml with its Vulkan and RPC backends (plus test-backend-ops, rpc-server and Mesa's lavapipe),
built once with scripts/build-ggml-backends.sh from the libggml-python 0.20.2.post1 sdist (the
one tests/cref.py downloads) and cached in <cache>/ggml-backends/0.20.2.post1, <cache> as in
tests/cref.py (`user_cache_dir()`). A file lock keeps two test processes from building at once.

System tests (markers `vulkan`, `rpc`) reach the build through `build_or_skip()`: it skips with
the reason when a prerequisite is missing (glslc, spirv-headers, ... : .ci/run installs them) or
the build fails, but when APIR_REQUIRE_SYSTEM_TESTS=1 (CI sets it) that is a failure instead
(tests/prereq.py's `missing`).
"""

from __future__ import annotations

import fcntl
import shutil
import socket
import subprocess
from pathlib import Path

from tests import cref, prereq
from tests.cref import BuildFailed, read_paths_env, run_build_script

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "build-ggml-backends.sh"
SDIST_VERSION = "0.20.2.post1"  # libggml-python, the sdist tests/cref.py fetches for "0.20"
_TOOLS = ("cmake", "ninja", "gcc", "g++", "glslc", "apt-get", "dpkg-deb")


def cache_dir() -> Path:
    return cref.user_cache_dir() / "ggml-backends" / SDIST_VERSION


def missing_prerequisites() -> list:
    """What the build needs and this machine lacks (tool names, files)."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if not Path("/usr/include/spirv/unified1/spirv.hpp").exists():
        missing.append("spirv-headers")
    return missing


def is_built() -> bool:
    """Whether the build finished (without building): what a benchmark checks before using it."""
    return (cache_dir() / ".complete").exists() and (cache_dir() / "paths.env").exists()


def read_build() -> dict:
    """paths.env of a finished build (see `build`), without building or locking."""
    return read_paths_env(cache_dir() / "paths.env")


def build() -> dict:
    """paths.env of the build as a dict (GGML_LIB_DIR, GGML_INCLUDE, TEST_BACKEND_OPS,
    RPC_SERVER, LVP_ICD, MESA_SHADER_CACHE_DIR); builds on first use (about 6 minutes on 2
    cores; the log is <cache_dir>/build.log). Raises BuildFailed."""
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    env_file = out / "paths.env"
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env_file.exists() and (out / ".complete").exists()):
            sdist = cref._sdist("0.20")
            run_build_script(BUILD_SCRIPT, [sdist, out], out / "build.log", BUILD_SCRIPT.name)
            (out / ".complete").touch()
    return read_paths_env(env_file)


def build_or_skip() -> dict:
    """`build()`, skipping (or failing under APIR_REQUIRE_SYSTEM_TESTS=1: tests/prereq.py) when
    a prerequisite is missing or the build fails."""
    missing = missing_prerequisites()
    if missing:
        prereq.missing(f"ggml Vulkan/RPC build needs {', '.join(missing)} (.ci/run installs them)")
    try:
        return build()
    except (BuildFailed, subprocess.CalledProcessError) as exc:
        prereq.missing(f"ggml Vulkan/RPC build failed: {exc}")
        raise  # not reached


def ggml_env(paths: dict) -> dict:
    """Environment variables that make apir (and its child processes) load this build's ggml."""
    return {"APIR_GGML_LIB_DIR": paths["GGML_LIB_DIR"], "APIR_GGML_INCLUDE_DIR": paths["GGML_INCLUDE"]}


def lavapipe_env(paths: dict) -> dict:
    """Environment for ggml Vulkan on Mesa's lavapipe (scripts/build-ggml-backends.sh says why): only the
    unpacked Mesa 25 ICD; ggml skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES
    names them; a persistent shader cache (cold compiles dominate)."""
    cache = Path(paths["MESA_SHADER_CACHE_DIR"])
    cache.mkdir(parents=True, exist_ok=True)  # Mesa 22.3 turned its cache off when missing
    return {
        "VK_ICD_FILENAMES": paths["LVP_ICD"],
        "VK_DRIVER_FILES": paths["LVP_ICD"],
        "GGML_VK_VISIBLE_DEVICES": "0",
        "MESA_SHADER_CACHE_DIR": str(cache),
        "MESA_SHADER_CACHE_MAX_SIZE": "4G",
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for an rpc-server (which takes no port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

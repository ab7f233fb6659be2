"""The C reference (ggml's ggml-virtgpu guest and host libraries, test-backend-ops), built
once from the PyPI sdists with ../shared/tools/build-c-reference.sh and cached.

Cache: $APIR_CREF_CACHE (tox sets <repo>/.cache/cref), else <repo>/.cache/cref. A file lock
keeps two test processes from building the same tree at once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO.parent / "shared" / "tools" / "build-c-reference.sh"

# version label -> (PyPI requirement, sdist file name)
SDISTS = {
    "0.20": ("libggml-python==0.20.2.post1", "libggml_python-0.20.2.post1.tar.gz"),
    "0.10": ("ggml-py==0.10.1", "ggml_py-0.10.1.tar.gz"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("APIR_CREF_CACHE") or REPO / ".cache" / "cref")


def _sdist(version: str) -> Path:
    req, fname = SDISTS[version]
    dest = cache_dir() / "sdist"
    path = dest / fname
    if not path.exists():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        req, "-d", str(dest)], check=True)
    return path


def build(version: str) -> dict:
    """paths.env of the C reference for `version` ("0.20" or "0.10") as a dict; builds it
    on first use (about 2 minutes). Raises CalledProcessError when the build fails."""
    out = cache_dir() / version
    out.mkdir(parents=True, exist_ok=True)
    env_file = out / "build" / "paths.env"
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env_file.exists() and (out / ".complete").exists()):
            sdist = _sdist(version)
            log = out / "build.log"
            with open(log, "w") as fh:
                subprocess.run(["bash", str(BUILD_SCRIPT), str(sdist), str(out)], check=True,
                               stdout=fh, stderr=subprocess.STDOUT)
            (out / ".complete").touch()
    paths = {}
    for line in env_file.read_text().splitlines():
        key, _, value = line.partition("=")
        paths[key] = value
    return paths

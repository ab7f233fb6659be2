"""The C reference (ggml's ggml-virtgpu guest and host libraries, test-backend-ops), built
once per version from the PyPI sdists with scripts/build-c-reference.sh and cached.

Cache (`cache_dir()`): the user's cache folder, outside the clone, so every clone, tox env and
CI run on one machine shares one build: $APIR_CREF_CACHE if set, else <cache>/cref with
<cache> = $APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else ~/.cache/apir. Inside it:
sdist/ (the downloaded sdists), <version>/ (one build each), interop/ (tests/interop's
programs). A file lock keeps two test processes from building the same tree at once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "build-c-reference.sh"

# version label -> (PyPI requirement, sdist file name)
SDISTS = {
    "0.20": ("libggml-python==0.20.2.post1", "libggml_python-0.20.2.post1.tar.gz"),
    "0.10": ("ggml-py==0.10.1", "ggml_py-0.10.1.tar.gz"),
}


class BuildFailed(RuntimeError):
    """A build script (scripts/build-*.sh) failed; the message ends with its log's last lines."""


def user_cache_dir() -> Path:
    """apir's folder in the user's cache: $APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else
    ~/.cache/apir (the XDG base directory rule; an empty variable counts as unset)."""
    if os.environ.get("APIR_CACHE_DIR"):
        return Path(os.environ["APIR_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "apir" if xdg else Path.home() / ".cache" / "apir"


def cache_dir() -> Path:
    """The C reference cache: $APIR_CREF_CACHE, else user_cache_dir()/cref."""
    override = os.environ.get("APIR_CREF_CACHE")
    return Path(override) if override else user_cache_dir() / "cref"


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
    on first use (a minute or more per version; the log is <cache_dir>/<version>/build.log).
    Raises BuildFailed (with the log's path and its last lines) when the build fails."""
    out = cache_dir() / version
    out.mkdir(parents=True, exist_ok=True)
    env_file = out / "build" / "paths.env"
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env_file.exists() and (out / ".complete").exists()):
            sdist = _sdist(version)
            run_build_script(BUILD_SCRIPT, [sdist, out], out / "build.log", f"{BUILD_SCRIPT.name} {version}")
            (out / ".complete").touch()
    return read_paths_env(env_file)


def run_build_script(script: Path, args: list, log: Path, what: str, env: Optional[dict] = None) -> None:
    """`bash script *args`, its output into `log`. Raises BuildFailed naming `what`, the exit
    status, the log and its last 20 lines."""
    with open(log, "w") as fh:
        done = subprocess.run(["bash", str(script), *map(str, args)], stdout=fh, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise BuildFailed(f"{what} failed (exit {done.returncode}); log: {log}; its end:\n{tail}")


def read_paths_env(env_file: Path) -> Dict[str, str]:
    """A build script's paths.env (KEY=VALUE lines) as a dict."""
    paths = {}
    for line in env_file.read_text().splitlines():
        key, _, value = line.partition("=")
        paths[key] = value
    return paths

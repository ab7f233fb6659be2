"""What the interop tests share: building the C shim and programs, the environment that makes a
process use the C reference build's ggml, and an apir host process to talk to.

Builds are cached beside the C reference (tests/cref.py's cache) under
``interop/<version>/<hash of sources and flags>/``; a build takes a few seconds with gcc.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from tests import cref

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "shim"
REPO = HERE.parents[1]

# The C guest's device is always this one ggml-virtgpu device ("[virtgpu] " + the host's name).
VIRTGPU_DEVICE_PREFIX = "[virtgpu] "


def c_build_env(paths: Dict[str, str], base: Optional[dict] = None) -> dict:
    """Environment for a process whose ggml must be the C build's (apir's binding included)."""
    env = dict(os.environ if base is None else base)
    env["APIR_GGML_LIB_DIR"] = str(Path(paths["LIBGGML_BASE"]).parent)
    env["APIR_GGML_INCLUDE_DIR"] = paths["GGML_INCLUDE"]
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _build(paths: Dict[str, str], name: str, sources, args) -> Path:
    """gcc `sources` with `args` into a cached file `name`; returns its path."""
    digest = hashlib.sha256()
    for src in sources:
        digest.update(Path(src).read_bytes())
    digest.update(" ".join(map(str, args)).encode())
    version = Path(paths["GGML_BUILD"]).parent.name
    out_dir = cref.cache_dir() / "interop" / version / digest.hexdigest()[:16]
    out = out_dir / name
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.{os.getpid()}"
        subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-o", str(tmp), *map(str, sources), *args],
                       check=True, capture_output=True, text=True)
        tmp.replace(out)
    return out


def _drm_cflags(paths: Dict[str, str]) -> list:
    flags = subprocess.run(["pkg-config", "--cflags", "libdrm"], check=True, capture_output=True,
                           text=True).stdout.split()
    if paths.get("VIRTGPU_DRM_INCLUDE"):
        flags += ["-isystem", paths["VIRTGPU_DRM_INCLUDE"]]
    return flags


def build_shim(paths: Dict[str, str]) -> Path:
    """apir_drm_shim.so, against the kernel UAPI header the C guest of `paths` was built with."""
    return _build(paths, "apir_drm_shim.so", [SHIM_DIR / "apir_drm_shim.c"],
                  ["-shared", "-fPIC", *_drm_cflags(paths), "-ldl", "-lpthread"])


def build_program(paths: Dict[str, str], stem: str) -> Path:
    """tests/interop/shim/<stem>.c linked against the C build's ggml (rpath set)."""
    lib_dir = str(Path(paths["LIBGGML"]).parent)
    return _build(paths, stem, [SHIM_DIR / f"{stem}.c"],
                  [f"-I{paths['GGML_INCLUDE']}", f"-L{lib_dir}", "-lggml", "-lggml-base", "-lggml-cpu",
                   f"-Wl,-rpath,{lib_dir}"])


def guest_env(paths: Dict[str, str], shim: Path, socket_path: str) -> dict:
    """Environment for an unmodified C guest program talking to the apir host at `socket_path`."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = str(shim)
    env["APIR_SHIM_SOCKET"] = str(socket_path)
    env["LD_LIBRARY_PATH"] = str(Path(paths["LIBGGML"]).parent)
    return env


class HostProcess:
    """`python -m tests.interop.serve_host` on the C build's ggml, with apir's Python dispatcher
    (c_library=False) or the C backend library. Use as a context manager; `log` holds its stderr
    once stopped. `backend`: a backend spec (apir.host.backend, e.g. ``vulkan:0``) served
    instead of the C build's CPU library, with `env` (e.g. another ggml build's
    APIR_GGML_LIB_DIR, the Vulkan driver's variables) over the C build's environment."""

    def __init__(self, paths: Dict[str, str], socket_path: Path, c_library: bool = False,
                 log_level: str = "WARNING", n_threads: Optional[int] = None,
                 backend: Optional[str] = None, env: Optional[dict] = None, device_type: Optional[str] = None):
        self.paths = paths
        self.socket_path = Path(socket_path)
        self.log_path = self.socket_path.with_suffix(".log")
        where = (["--backend", backend] if backend else
                 ["--ggml-library", paths["LIBGGML_CPU"], "--ggml-reg", "ggml_backend_cpu_reg"])
        cmd = [sys.executable, "-m", "tests.interop.serve_host", "--socket", str(self.socket_path),
               *where, "--log-level", log_level]
        if n_threads:
            cmd += ["--n-threads", str(n_threads)]
        if device_type:
            cmd += ["--device-type", device_type]
        if c_library:
            cmd += ["--c-library", paths["LIBGGML_VIRTGPU_BACKEND"]]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env={**c_build_env(paths), **(env or {})}, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        line = self.proc.stdout.readline()  # "ready" once the socket listens
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"apir host did not start: {self.log}")

    @property
    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "HostProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def parse(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.replace("_", "").isalnum():
            out[key] = value
    return out


def expected_matmul(K: int, M: int, N: int) -> np.ndarray:
    """out = mul_mat(a, b) + c with the program's inputs, in float64 (exact: every value is a
    multiple of 1/8, so every float32 partial sum is exact too)."""
    def values(seed, n):
        i = np.arange(n)
        return (((seed * 7919 + i * 104729) % 32) - 16) / 8.0

    a = values(1, K * M).reshape(M, K)
    b = values(2, K * N).reshape(N, K)
    c = values(3, M * N).reshape(N, M)
    return (b @ a.T + c).reshape(-1)  # ggml: out[n, m] = sum_k a[m, k] * b[n, k]

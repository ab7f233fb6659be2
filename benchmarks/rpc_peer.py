"""ggml-rpc as the peer of apir in the benchmarks: an rpc-server on loopback and this process on
the ggml build that has ggml-rpc's client.

Theory of operation: ggml-rpc (ggml/src/ggml-rpc) is what people use today to run ggml on another
machine's hardware; apir's socket host and embedded host are measured next to it in the same run
scripts/build-ggml-backends.sh builds `rpc-server` (scripts/rpc-server.c) and
libggml-rpc from the same libggml-python sdist as apir's wheel (ggml 0.20.2), cached where
tests/ggml_backends.py says. The wheel's ggml has no RPC backend, so a benchmark with the peer
loads that build instead (`use_build`, before anything loads ggml): apir's hosts, the local
baseline and rpc-server then run the very same ggml CPU kernels, and only the transport differs.
A benchmark never builds it (about 6 minutes): without it the peer is skipped and `skip_reason`
says how to build it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests import ggml_backends  # noqa: E402

BUILD_HINT = ("build it with: PYTHONPATH=. python -c 'from tests import ggml_backends; ggml_backends.build()' "
              "(scripts/build-ggml-backends.sh, about 6 minutes on 2 cores)")


def find_build() -> tuple[Optional[dict], str]:
    """(paths.env of the ggml Vulkan/RPC build as a dict, "") when it is built with an rpc-server,
    else (None, why the peer is skipped and how to build it). Builds nothing."""
    if not ggml_backends.is_built():
        return None, f"ggml-rpc peer skipped: no rpc-server in {ggml_backends.cache_dir()}; {BUILD_HINT}"
    paths = ggml_backends.read_build()
    if not Path(paths.get("RPC_SERVER", "")).is_file():
        return None, f"ggml-rpc peer skipped: {paths.get('RPC_SERVER')} is missing; {BUILD_HINT}"
    return paths, ""


def use_build(paths: dict) -> Optional[str]:
    """Makes this process (and the processes it starts) load the build's ggml, the one with
    ggml-rpc's client. Call it before anything loads ggml. Returns None, or why it cannot (ggml
    already loaded from elsewhere)."""
    os.environ.update(ggml_backends.ggml_env(paths))
    from apir.ggml import load

    lib_dir = load().lib_dir
    if lib_dir.resolve() != Path(paths["GGML_LIB_DIR"]).resolve():
        return f"ggml-rpc peer skipped: this process already loaded ggml from {lib_dir}"
    return None


class RpcServer:
    """The build's rpc-server on 127.0.0.1 (a free port), ggml's CPU device with `threads` threads,
    accepting when constructed; `endpoint` is "127.0.0.1:PORT", `spec` the apir.ggml.backend_spec
    naming it. Stopped on close (SIGTERM, then SIGKILL). Raises RuntimeError when it does not come
    up within `timeout_s`."""

    def __init__(self, paths: dict, threads: int, timeout_s: float = 30.0):
        self.port = ggml_backends.free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.spec = f"rpc:{self.endpoint}"
        self.proc = subprocess.Popen([paths["RPC_SERVER"], "-H", "127.0.0.1", "-p", str(self.port), "-d", "CPU",
                                      "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rpc-server exited with {self.proc.returncode}")
            try:
                # rpc-server serves one client at a time and drops a connection that sends no HELLO
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"rpc-server not accepting on {self.endpoint} after {timeout_s} s") from exc
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "RpcServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

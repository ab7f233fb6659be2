"""Fixtures of the system tests on other ggml backends: the Vulkan/RPC build (tests/ggml_backends.py)
and processes on it (an `apir host serve`, ggml's rpc-server), each in a process of its own since
the ggml build and the Vulkan driver are chosen by environment when ggml loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest

from tests import ggml_backends

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def backends_build():
    """paths.env of the ggml Vulkan/RPC build (skips, or fails under APIR_REQUIRE_SYSTEM_TESTS=1,
    when it cannot be built)."""
    return ggml_backends.build_or_skip()


def base_env(paths: dict, vulkan: bool) -> dict:
    env = {**os.environ, **ggml_backends.ggml_env(paths), "PYTHONPATH": str(REPO)}
    if vulkan:
        env.update(ggml_backends.lavapipe_env(paths))
    return env


class Proc:
    """A child process with its output in a file; stopped (SIGTERM, then SIGKILL) on close."""

    def __init__(self, cmd: List[str], env: dict, log: Path):
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for(self, predicate, what: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: the process exited ({self.proc.returncode}): {self.log()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{what}: not within {timeout} s: {self.log()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def host_serve(paths: dict, sock: Path, backend: str, vulkan: bool, log: Path, extra: Optional[list] = None) -> Proc:
    """`apir host serve --socket SOCK --backend BACKEND` on the build's ggml, ready to accept."""
    cmd = [sys.executable, "-m", "apir", "--log-level", "info", "host", "serve", "--socket", str(sock),
           "--backend", backend, *(extra or [])]
    p = Proc(cmd, base_env(paths, vulkan), log)
    p.wait_for(sock.exists, "apir host serve listening")
    return p


def rpc_server(paths: dict, port: int, log: Path) -> Proc:
    """The build's rpc-server on 127.0.0.1:PORT with ggml's CPU device, ready to accept."""
    p = Proc([paths["RPC_SERVER"], "-H", "127.0.0.1", "-p", str(port), "-d", "CPU", "-t", "1"],
             base_env(paths, False), log)
    p.wait_for(lambda: "listening on" in p.log(), "rpc-server listening")

    def accepts() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    p.wait_for(accepts, "rpc-server accepting")
    return p


def minilm(paths: dict, backend: str, out: Path, vulkan: bool, device: Optional[str] = None,
           timeout: float = 900.0) -> subprocess.CompletedProcess:
    """tests/backends/minilm_run.py: the embeddings of its sentences on `backend`, locally
    (device None) or through APIR over `device`; the process's result (check returncode)."""
    cmd = [sys.executable, "-m", "tests.backends.minilm_run", "--backend", backend,
           *(["--device", device] if device else ["--local"]), str(out)]
    return subprocess.run(cmd, env=base_env(paths, vulkan), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def graph_cache_run(paths: dict, backend: str, out: Path, vulkan: bool, script: str = "graph_cache_run") -> dict:
    """tests/backends/<script>.py (graph_cache_run, transfers_run) on `backend`: its report
    (asserts the process succeeded)."""
    import json

    cmd = [sys.executable, "-m", f"tests.backends.{script}", "--backend", backend, str(out)]
    done = subprocess.run(cmd, env=base_env(paths, vulkan), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def check_graph_cache_report(report: dict) -> None:
    """A repeated graph was served from the cache with each step's row ids (not stale ones left
    in the device copy by the graphs in between): byte-identical to a fresh build and to ggml
    on the device directly, different ids giving different results; ids out of range refused
    on a hit, and the next graph served."""
    steps = report["steps"]
    for row in steps:
        assert row["cached"] == [0, 0, row["direct"]], row
        assert row["fresh"] == [0, 0, row["direct"]], row
    assert len({row["direct"] for row in steps}) == len(steps)  # each step's ids show
    # graph A came 3 times (hit twice), the 7-id graph twice (hit once), the 20000-id one once
    assert (report["hits"], report["misses"]) == (3, 3), report
    assert report["refused_rc"] != 0
    assert report["after_refusal"] == [0, 0, True]


def check_compute_bound_report(report: dict) -> None:
    """tests/backends/compute_bound_run.py on a backend without an abort callback: ranges of
    nodes compute the whole graph's logits byte for byte; a graph over its time limit stops
    with GGML_STATUS_ABORTED at a range's end and the context computes the next graph; a guest
    hanging up mid-compute stops its graph and its context goes; expert ids a TOP_K of the
    graph computes route MUL_MAT_ID and GET_ROWS as on ggml CPU."""
    aborted, success = report["statuses"]["ABORTED"], report["statuses"]["SUCCESS"]
    whole, ranges = report["exact"]["whole"], report["exact"]["ranges"]
    assert (whole["chunked"], ranges["chunked"]) == (False, True)
    assert (whole["status"], whole["rc"], ranges["status"], ranges["rc"]) == (success, 0, success, 0)
    assert len(set(bytes.fromhex(whole["logits"]))) > 16
    assert ranges["logits"] == whole["logits"]
    limit = report["time_limit"]
    assert limit["chunked"] and limit["status"] == aborted, limit
    assert 0 < limit["nodes"] < 6000 and limit["nodes"] % 64 == 0, limit  # (compute_bound_run's N_NODES, CHUNK)
    assert limit["next"] == [success, 3], limit
    hang = report["hang_up"]
    assert hang["started"] and hang["contexts_left"] == 0, hang
    assert hang["statuses"] == [aborted], hang
    ids = report["computed_ids"]  # (MUL_MAT_ID in another order of sums: within float rounding)
    assert (ids["status"], ids["rc"], ids["nonzero"]) == (success, 0, True), ids
    assert ids["max_abs_diff"] < 1e-4, ids

"""apir's host computing on ggml-rpc servers (the build's rpc-server, ggml CPU behind each, on
loopback), compared with ggml CPU directly. Needs scripts/build-ggml-backends.sh's build."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.backends.conftest import (
    REPO,
    base_env,
    check_compute_bound_report,
    check_graph_cache_report,
    graph_cache_run,
    host_serve,
    minilm,
    rpc_server,
)
from tests.ggml_backends import free_port

pytestmark = pytest.mark.rpc

# test-backend-ops' default bound on the normalized mean squared error between two backends
# (tests/test-backend-ops.cpp, max_nmse_err 1e-7), the check ggml's RPC backend is held to.
NMSE_MAX = 1e-7


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(((a64 - b64) ** 2).sum() / (a64**2).sum())


def test_minilm_on_two_rpc_servers_equals_local_cpu(backends_build, tmp_path):
    paths = backends_build
    ports = [free_port(), free_port()]
    servers = [rpc_server(paths, p, tmp_path / f"rpc{i}.log") for i, p in enumerate(ports)]
    sock = tmp_path / "host.sock"
    spec = ",".join(f"127.0.0.1:{p}" for p in ports)
    host = None
    try:
        host = host_serve(paths, sock, f"rpc:{spec}", False, tmp_path / "host.log")
        runs = [minilm(paths, "cpu", tmp_path / f"rpc{i}.npy", False, device=f"unix:{sock}", timeout=600)
                for i in range(2)]
        for r in runs:
            assert r.returncode == 0, r.stderr[-3000:] + host.log()[-3000:]
    finally:
        if host:
            host.close()
        for s in servers:
            s.close()
    # one guest context per server, in turn: the devices of both servers served
    served = sorted(r.stdout.split(" through APIR")[0].split()[-1] for r in runs)
    assert served == ["RPC0", "RPC1"], [r.stdout for r in runs]
    local = minilm(paths, "cpu", tmp_path / "local.npy", False)
    assert local.returncode == 0, local.stderr[-3000:]
    want = np.load(tmp_path / "local.npy")
    assert want.shape == (4, 384)
    for i in range(2):
        got = np.load(tmp_path / f"rpc{i}.npy")
        assert nmse(got, want) <= NMSE_MAX


def test_rpc_server_killed_mid_compute_gives_the_guest_an_error(backends_build, tmp_path):
    """ggml-rpc aborts its client process when a server stops answering (RPC_STATUS_ASSERT):
    the host process ends, and the guest gets an error from its connection, not a hang."""
    paths = backends_build
    port = free_port()
    server = rpc_server(paths, port, tmp_path / "rpc.log")
    sock = tmp_path / "host.sock"
    host = host_serve(paths, sock, f"rpc:127.0.0.1:{port}", False, tmp_path / "host.log")
    cmd = [sys.executable, "-m", "tests.backends.minilm_run", "--backend", "cpu", "--device", f"unix:{sock}",
           "--repeat", "100000", str(tmp_path / "out.npy")]
    guest = subprocess.Popen(cmd, env=base_env(paths, False), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert "through APIR" in guest.stdout.readline()
        assert guest.stdout.readline().strip() == "batch 1 done"  # weights up, graphs computing
        server.kill()
        t0 = time.monotonic()
        try:
            rc = guest.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail("the guest hangs after its rpc server died")
        assert rc != 0, "the guest finished its 100000 batches without its server"
        assert time.monotonic() - t0 < 120
        err = guest.stderr.read()
        assert "Error" in err or "error" in err, err[-2000:]
    finally:
        if guest.poll() is None:
            guest.kill()
            guest.wait()
        host.close()
        server.close()


def test_repeated_graph_hits_the_cache_with_the_rechecked_row_ids(backends_build, tmp_path):
    """apir.host.graph.cache on ggml-rpc (one loopback rpc-server): a hit uploads its re-checked
    row ids into the device copy, on the server (tests/backends/graph_cache_run.py)."""
    port = free_port()
    server = rpc_server(backends_build, port, tmp_path / "rpc.log")
    try:
        report = graph_cache_run(backends_build, f"rpc:127.0.0.1:{port}", tmp_path / "report.json", False)
    finally:
        server.close()
    assert report["backend"].startswith("RPC")
    check_graph_cache_report(report)


def test_the_time_limit_and_a_hang_up_stop_a_graph_on_rpc(backends_build, tmp_path):
    """ggml-rpc has no abort callback: as on Vulkan, the host computes in ranges of nodes
    (tests/backends/compute_bound_run.py against one loopback rpc-server)."""
    port = free_port()
    server = rpc_server(backends_build, port, tmp_path / "rpc.log")
    try:
        report = graph_cache_run(backends_build, f"rpc:127.0.0.1:{port}", tmp_path / "report.json", False,
                                 script="compute_bound_run")
    finally:
        server.close()
    check_compute_bound_report(report)
